"""The login page: the password form and, when single sign-on is set up, "Sign in with …"."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import views as auth_views

from .forms import LoginForm


class LoginView(auth_views.LoginView):
    """Django's login view with :class:`~accounts_app.forms.LoginForm`. Context adds
    ``sso_name`` (the provider's name, or empty when single sign-on is off) and
    ``password_login`` (``CORRAL_PASSWORD_LOGIN``: with it off the form is folded away
    under "Administrator login")."""

    authentication_form = LoginForm

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context["sso_name"] = settings.CORRAL_OIDC_PROVIDER_NAME if settings.CORRAL_OIDC_ISSUER else ""
        context["password_login"] = settings.CORRAL_PASSWORD_LOGIN
        return context
