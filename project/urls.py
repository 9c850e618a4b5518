from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_not_required
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from accounts_app.views import LoginView
from project import metrics

urlpatterns = [
    path("admin/", admin.site.urls),
    # Pages without base.html's <link rel="icon"> (the admin's) make the browser ask for
    # /favicon.ico: answer with Corral's icon instead of a 404 in the console.
    path("favicon.ico", login_not_required(RedirectView.as_view(url=static("corral/favicon.svg"), permanent=True))),
    path("metrics", metrics.metrics, name="metrics"),
    path("login/", LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("api_app.urls")),
    path("", include("accounts_app.urls")),
    path("", include("attention_app.urls")),
    path("", include("sessions_app.servers.urls")),  # the machines page
    path("", include("sessions_app.urls")),
    path("", include("usage_app.urls")),
]

handler403 = "sessions_app.views.permission_denied"
