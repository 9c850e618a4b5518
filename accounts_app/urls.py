from django.contrib.auth.decorators import login_not_required
from django.urls import path

from . import views

urlpatterns = [
    path("oidc/callback/", login_not_required(views.Callback.as_view()), name="oidc_authentication_callback"),
    path("oidc/authenticate/", login_not_required(views.SignIn.as_view()), name="oidc_authentication_init"),
]
