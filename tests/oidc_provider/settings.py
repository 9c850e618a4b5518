"""The test identity provider's settings, from its environment:

``IDP_DIR`` (its SQLite file and RSA key), ``IDP_ISSUER`` (``http://127.0.0.1:PORT/o``).
"""

import os
from pathlib import Path

DIR = Path(os.environ["IDP_DIR"])
KEY_FILE = DIR / "rsa.pem"

SECRET_KEY = "test identity provider, not a secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "oauth2_provider",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.oidc_provider.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [Path(__file__).parent / "templates"],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": ["django.template.context_processors.request"]},
}]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": DIR / "idp.sqlite3"}}
# Fast hashing for the users' passwords and Corral's client secret, which the token
# endpoint checks at every sign-in: Django's default takes a second of CPU each time, and
# more on a loaded test machine. Test-only: never for a real provider.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
LOGIN_URL = "/accounts/login/"
# Corral runs on the same host (127.0.0.1, another port) and cookies do not tell ports
# apart: names of its own keep the two logins from overwriting each other.
SESSION_COOKIE_NAME = "idp_sessionid"
CSRF_COOKIE_NAME = "idp_csrftoken"

OAUTH2_PROVIDER = {
    "OIDC_ENABLED": True,
    "OIDC_RSA_PRIVATE_KEY": KEY_FILE.read_text() if KEY_FILE.exists() else "",
    "OIDC_ISS_ENDPOINT": os.environ.get("IDP_ISSUER", ""),
    "SCOPES": {"openid": "OpenID Connect", "email": "E-mail address", "profile": "Name and groups"},
    "OAUTH2_VALIDATOR_CLASS": "tests.oidc_provider.claims.Validator",
    "PKCE_REQUIRED": True,
}
