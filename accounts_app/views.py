"""The login page (the password form and, when single sign-on is set up, "Sign in with …"),
and the two pages of a sign-in: to the provider and back (accounts_app/sso.py does the rest)."""

from __future__ import annotations

import logging

import requests
from django.conf import settings
from django.contrib.auth import views as auth_views
from django.core.exceptions import SuspiciousOperation
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from . import sso
from .forms import LoginForm

log = logging.getLogger(__name__)


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


# --- single sign-on --------------------------------------------------------------------------------

def failure(request: HttpRequest, sentence: str, status: int) -> HttpResponse:
    """The page a sign-in that did not work ends on: ``sentence``, and the way back."""
    return render(request, "registration/sso_failed.html",
                  {"sentence": sentence, "provider": settings.CORRAL_OIDC_PROVIDER_NAME}, status=status)


def _unreachable(request: HttpRequest, exc: Exception) -> HttpResponse:
    log.warning("single sign-on: the provider could not be asked: %s", sso.short(exc))
    return failure(request, f"Corral could not reach {settings.CORRAL_OIDC_PROVIDER_NAME} to sign you in: "
                            f"{sso.short(exc)}. Try again in a moment; if it goes on, tell a Corral admin.", 502)


class SignIn(OIDCAuthenticationRequestView):
    """GET: send the browser to the provider's sign-in (state, nonce and PKCE challenge
    kept in this browser's session); ``?next=`` is where it lands afterwards."""

    def __init__(self, *args, **kwargs):
        # The library reads the endpoint here; it is found in get(), where a failure can
        # be told as a page.
        super(OIDCAuthenticationRequestView, self).__init__(*args, **kwargs)

    def get(self, request):
        if not sso.enabled():
            raise Http404("Single sign-on is not set up on this Corral.")
        try:
            self.OIDC_OP_AUTH_ENDPOINT = sso.endpoints()["authorization"]
        except sso.ProviderUnreachable as exc:
            return _unreachable(request, exc)
        self.OIDC_RP_CLIENT_ID = settings.OIDC_RP_CLIENT_ID
        return super().get(request)


#: What an answer that does not belong to a sign-in of this browser is told.
START_AGAIN = "Start again from the login page."


class Callback(OIDCAuthenticationCallbackView):
    """GET: the provider's answer. Logs the person in and sends them on, or ends on a
    page that says what went wrong (400 for an answer that does not match this browser's
    sign-in, 403 for a refusal, 502 when the provider cannot be asked)."""

    def get(self, request):
        if not sso.enabled():
            raise Http404("Single sign-on is not set up on this Corral.")
        try:
            return super().get(request)
        except SuspiciousOperation as exc:
            log.warning("single sign-on: an answer refused: %s", sso.short(exc))
            return failure(request, f"This sign-in could not be completed: {self._why(exc)} {START_AGAIN}", 400)
        except (requests.RequestException, sso.ProviderUnreachable) as exc:
            return _unreachable(request, exc)

    @staticmethod
    def _why(exc: SuspiciousOperation) -> str:
        text = str(exc)
        if "state not found" in text:
            return ("the answer does not belong to a sign-in started in this browser, or it was used already "
                    "(its state is unknown here).")
        if "Nonce" in text:
            return "the provider's ID token does not belong to the sign-in this browser started (its nonce differs)."
        if "JWS" in text or "JWKS" in text or "alg" in text:
            return f"the provider's ID token did not verify ({text.rstrip('.')})."
        return text if text.endswith(".") else text + "."

    def login_failure(self):
        request = self.request
        if request.GET.get("error"):
            said = request.GET.get("error_description") or request.GET["error"]
            return failure(request, f"{settings.CORRAL_OIDC_PROVIDER_NAME} did not sign you in: {said[:300]}. "
                                    f"{START_AGAIN}", 403)
        user = getattr(self, "user", None)
        if user is not None and not user.is_active:
            return failure(request, f"Your Corral account {user.get_username()} is turned off; a Corral admin "
                                    f"can turn it on.", 403)
        if "code" not in request.GET or "state" not in request.GET:
            return failure(request, f"This is not an answer from {settings.CORRAL_OIDC_PROVIDER_NAME} "
                                    f"(no code or state). {START_AGAIN}", 400)
        if not hasattr(self, "user"):  # the library found no sign-in started in this session
            return failure(request, "This sign-in could not be completed: it was not started in this browser, or "
                                    f"it was used already. {START_AGAIN}", 400)
        return failure(request, f"{settings.CORRAL_OIDC_PROVIDER_NAME} signed you in, but its answer names no one "
                                f"Corral can log in (Corral's log says why); tell a Corral admin.", 403)
