"""Corral settings: declarations read from the environment, nothing more.

Importing this module writes nothing and starts nothing: the launcher (``./corral``)
creates the data directory and the secret key first (``project/data_dir.py``). Every
variable is read through the strict helpers in ``project/env.py``, so a value that
cannot mean anything (``DEBUG=ture``, ``CORRAL_STOP_GRACE=5s``) stops the process with
``ImproperlyConfigured`` naming it. The README's table lists the variables;
``docs/deployment.md`` explains the production ones (``CORRAL_HTTPS``, the
Content-Security-Policy, login throttling).
"""

import logging
from datetime import timedelta
from urllib.parse import urlsplit

from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

from project import data_dir, queues
from project.broker import celery_broker
from project.channel_layer import channel_prefix
from project.env import env_bool, env_choice, env_db, env_float, env_int, env_list, env_redis_url, env_str, env_url

BASE_DIR = data_dir.BASE_DIR

DATA_DIR = data_dir.location()

SECRET_KEY = env_str("SECRET_KEY", "") or data_dir.read_secret_key(DATA_DIR)
if not SECRET_KEY:
    raise ImproperlyConfigured(
        f"No secret key: set SECRET_KEY, or start Corral once with ./corral run (or ./corral test), "
        f"which writes one to {DATA_DIR / data_dir.SECRET_KEY_FILE}."
    )
# Off unless asked for: `./corral run` asks for it on a plain loopback run (see
# project/launcher.py); daphne, Celery, manage.py and the tests started any other way
# run without it.
DEBUG = env_bool("DEBUG", False)
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

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
    "axes",
    "machines_app",
    "sessions_app",
    "attention_app",
    "search_app",
    "usage_app",
    "api_app",
    "accounts_app",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    # Before the CSRF check, which would turn an over-large body into a bare 400.
    "project.middleware.request_too_large",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    # LoginRequiredMiddleware, telling an open page's click that its login ended.
    "project.middleware.LoginRequired",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes asks: it turns a lockout noticed during authentication into
    # the lockout page.
    "axes.middleware.AxesMiddleware",
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
                "django.template.context_processors.csp",  # csp_nonce, for the admin's templates
                "attention_app.context_processors.attention",  # the inbox count in the top bar
            ],
        },
    },
]

WSGI_APPLICATION = None
ASGI_APPLICATION = "project.asgi.application"

DATABASES = {"default": env_db("DATABASE_URL", f"sqlite:///{DATA_DIR / 'corral.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Daphne and the Celery workers write to one file: wait for the lock instead of
    # failing, and let readers go on while a turn streams (WAL).
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    # Tests share the database with a real worker process, so it must be a file.
    DATABASES["default"]["TEST"] = {"NAME": str(DATA_DIR / "test-corral.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Security (docs/deployment.md) -------------------------------------------------------

# One switch for running behind an HTTPS reverse proxy. The proxy terminates TLS and must
# set X-Forwarded-Proto (and X-Forwarded-For to the client's address: the launcher then
# runs daphne with --proxy-headers so REMOTE_ADDR is the client, not the proxy).
CORRAL_HTTPS = env_bool("CORRAL_HTTPS", False)
if CORRAL_HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # A year, this domain and its subdomains, eligible for browsers' preload lists: what
    # `check --deploy` asks for. Lower it (CORRAL_HSTS_SECONDS=300) while trying HTTPS
    # out: a browser that has seen the header refuses plain HTTP for that long.
    SECURE_HSTS_SECONDS = env_int("CORRAL_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True

# Content-Security-Policy on every response (Django's own middleware). Scripts and styles
# come only from Corral's static files: no inline <script>, no on*= handler, no style
# attribute or <style> block runs, including any that a model's output or a bug might
# put in the page. htmx is told not to inject its indicator <style> and not to eval
# (templates/base.html, meta htmx-config). The websocket is same-origin ('self').
# NONCE: Django's admin marks its few inline blocks with the per-request nonce
# ({% csp_nonce_attr %}); Django puts 'nonce-…' in the header only on responses whose
# template used it, so Corral's own pages get 'self' alone.
SECURE_CSP = {
    "default-src": [CSP.NONE],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF, CSP.NONCE],
    "img-src": [CSP.SELF],
    "font-src": [CSP.SELF],
    "connect-src": [CSP.SELF],
    # The web app manifest and the service worker (docs/attention.md); a worker falls back
    # to script-src, said here so it stays true if script-src changes.
    "manifest-src": [CSP.SELF],
    "worker-src": [CSP.SELF],
    "form-action": [CSP.SELF],
    "base-uri": [CSP.NONE],
    "object-src": [CSP.NONE],
    "frame-ancestors": [CSP.NONE],
}

# Login throttling (django-axes): this many wrong passwords for one username from one
# address lock that pair out for AXES_COOLOFF_TIME; a right password resets the count.
# Keyed on the pair so that one person mistyping cannot lock a whole office behind one
# NAT address out, and a stranger cannot lock a colleague out from elsewhere.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    # Django's password check, refusing all but superusers with CORRAL_PASSWORD_LOGIN=off.
    "accounts_app.backends.PasswordBackend",
    # Single sign-on (OpenID Connect); answers only the provider's callback.
    "accounts_app.sso.Backend",
]
AXES_FAILURE_LIMIT = env_int("CORRAL_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("CORRAL_LOGIN_LOCKOUT_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# No "AXES: BEGIN version …" banner from every process at every start.
AXES_VERBOSE = False
# Its rows (attempts, lockouts) are not for an admin to edit: a lockout ends by itself, and
# `manage.py axes_reset_username` ends it early (docs/deployment.md). No "AXES" section in the admin.
AXES_ENABLE_ADMIN = False
AXES_LOCKOUT_CALLABLE = "project.login_throttle.locked_out"
AXES_USERNAME_CALLABLE = "project.login_throttle.client_username"
# The client's address is REMOTE_ADDR (django-ipware is deliberately not installed): a
# client's own X-Forwarded-For must not give it a fresh address for every guess. Behind
# the HTTPS proxy, daphne sets REMOTE_ADDR from the proxy's header (--proxy-headers).

# Single sign-on with the team's OpenID Connect provider (docs/access.md, "Single sign-on";
# accounts_app/sso.py). Off unless CORRAL_OIDC_ISSUER is set; the provider's endpoints are
# discovered from <issuer>/.well-known/openid-configuration at the first sign-in (so
# Corral starts while the provider is down), unless all four are given here.
CORRAL_OIDC_ISSUER = env_url("CORRAL_OIDC_ISSUER", "", {"https", "http"}).rstrip("/")
CORRAL_OIDC_CLIENT_ID = env_str("CORRAL_OIDC_CLIENT_ID", "")
CORRAL_OIDC_CLIENT_SECRET = env_str("CORRAL_OIDC_CLIENT_SECRET", "")
CORRAL_OIDC_PROVIDER_NAME = env_str("CORRAL_OIDC_PROVIDER_NAME", "")
CORRAL_OIDC_GROUPS_CLAIM = env_str("CORRAL_OIDC_GROUPS_CLAIM", "groups")
CORRAL_OIDC_AUTHORIZATION_ENDPOINT = env_url("CORRAL_OIDC_AUTHORIZATION_ENDPOINT", "", {"https", "http"})
CORRAL_OIDC_TOKEN_ENDPOINT = env_url("CORRAL_OIDC_TOKEN_ENDPOINT", "", {"https", "http"})
CORRAL_OIDC_USERINFO_ENDPOINT = env_url("CORRAL_OIDC_USERINFO_ENDPOINT", "", {"https", "http"})
CORRAL_OIDC_JWKS_URI = env_url("CORRAL_OIDC_JWKS_URI", "", {"https", "http"})
# Password login: on, or off for everyone but superusers (the form is folded away, a member's
# password is refused with a sentence, and a member's login made with a password ends).
CORRAL_PASSWORD_LOGIN = env_bool("CORRAL_PASSWORD_LOGIN", True)
if CORRAL_OIDC_ISSUER:
    for _name in ("CORRAL_OIDC_CLIENT_ID", "CORRAL_OIDC_CLIENT_SECRET"):
        if not globals()[_name]:
            raise ImproperlyConfigured(f"CORRAL_OIDC_ISSUER is set but {_name} is not: set both client settings "
                                       f"to the values the identity provider gave for Corral.")
    CORRAL_OIDC_PROVIDER_NAME = CORRAL_OIDC_PROVIDER_NAME or urlsplit(CORRAL_OIDC_ISSUER).hostname or "single sign-on"
elif not CORRAL_PASSWORD_LOGIN:
    raise ImproperlyConfigured("CORRAL_PASSWORD_LOGIN=off needs single sign-on (CORRAL_OIDC_ISSUER): "
                               "without it only superusers could log in.")
# mozilla-django-oidc's own settings, from the ones above.
OIDC_RP_CLIENT_ID = CORRAL_OIDC_CLIENT_ID
OIDC_RP_CLIENT_SECRET = CORRAL_OIDC_CLIENT_SECRET
OIDC_RP_SCOPES = env_str("CORRAL_OIDC_SCOPES", "openid email profile")
if CORRAL_OIDC_ISSUER and "openid" not in OIDC_RP_SCOPES.split():
    raise ImproperlyConfigured(f"CORRAL_OIDC_SCOPES={OIDC_RP_SCOPES!r} is not valid: it must include openid.")
OIDC_RP_SIGN_ALGO = env_choice("CORRAL_OIDC_SIGN_ALGO", "RS256",
                               {"RS256", "RS384", "RS512", "ES256", "ES384", "ES512", "HS256"})
# Endpoints are found per request (accounts_app.sso.endpoints); these keep the library's
# checks quiet.
OIDC_OP_AUTHORIZATION_ENDPOINT = CORRAL_OIDC_AUTHORIZATION_ENDPOINT
OIDC_OP_TOKEN_ENDPOINT = CORRAL_OIDC_TOKEN_ENDPOINT
OIDC_OP_USER_ENDPOINT = CORRAL_OIDC_USERINFO_ENDPOINT
OIDC_OP_JWKS_ENDPOINT = CORRAL_OIDC_JWKS_URI or None
OIDC_USE_PKCE = True
# Seconds Corral waits for each answer of the provider (discovery, token, keys, userinfo).
OIDC_TIMEOUT = env_float("CORRAL_OIDC_TIMEOUT", 10.0, minimum=1.0)

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
# Serve static files straight from the apps and STATICFILES_DIRS (no collectstatic step).
WHITENOISE_USE_FINDERS = True

REDIS_URL = env_redis_url("REDIS_URL", "redis://127.0.0.1:6379/0")
CHANNEL_LAYERS = {
    "default": {
        # channels_redis's pub/sub layer: one PUBLISH per message, pushed to every daphne
        # subscribed (project/channel_layer.py; docs/live-page.md "What it costs"). A page that
        # misses a message catches up from the database (docs/behaviour.md C17). Its receiver
        # waits in long reads, not ten a second (project/pubsub_layer.py).
        "BACKEND": "project.pubsub_layer.QuietPubSubChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": channel_prefix(REDIS_URL)},
    },
}

# Celery (project/celery.py reads the CELERY_ namespace).
# The same Redis, database and TLS checks, in kombu's words (project/broker.py).
_BROKER = celery_broker(REDIS_URL)
CELERY_BROKER_URL = _BROKER.url
CELERY_BROKER_USE_SSL = _BROKER.use_ssl
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# docs/behaviour.md C16: the Redis broker redelivers a task not acknowledged within the visibility
# timeout. Tasks are acknowledged on receipt (acks_late off), so a long turn is never
# redelivered; a worker that dies mid-step is recovered by the watch task from the
# database lease instead. The timeout is still set above the longest step (a 30 min
# completion, docs/behaviour.md §6) in case acks_late is ever turned on.
CELERY_TASK_ACKS_LATE = False
# No "polling_interval" here: kombu takes it as the BRPOP timeout but also as a sleep after
# every empty poll in its blocking consumer loop (``drain_events``, Celery's synloop, the
# loop of a worker that does not run the event loop): a task sent during that sleep waited
# up to 2 s (tests/test_broker_wakeup.py). The BRPOP's own timeout is set apart, without
# that sleep: project/celery.py, BRPOP_SECONDS.
# An idle worker's event loop also woke every 10 s to restore unacknowledged messages,
# though kombu scans for them only every tenth time (every 100 s), and every 10 s to hand a
# streaming credential provider's new token to its connections (Corral configures none:
# REDIS_URL carries the password). Both now run when they have something to do: the scan
# every 100 s as before, the token look every 5 minutes (docs/live-page.md, "What it costs").
CELERY_BROKER_TRANSPORT_OPTIONS = {**_BROKER.transport_options, "visibility_timeout": 2 * 60 * 60,
                                   "unacked_restore_interval": 100, "unacked_restore_throttle": 1,
                                   "reauth_check_interval": 300}
# Nothing in Corral sends Celery's remote control commands (which workers are alive is told
# by keys in Redis: sessions_app/liveness.py), so workers do not listen for them.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Celery's Django fixup closes the database connections around every task unless this is
# set; the workers keep theirs instead, Django's CONN_MAX_AGE deciding (project/celery.py).
CELERY_DB_REUSE_MAX = 1_000_000
# One queue per kind of work, each with workers of its own (project/queues.py).
CELERY_TASK_ROUTES = queues.ROUTES
CELERY_TASK_DEFAULT_QUEUE = queues.HOUSEKEEPING
# No Celery beat: the periodic checks run in threads of the housekeeping workers, one
# worker of the deployment taking each round's shared part (sessions_app/rounds.py).

# A refused token is answered like any refusal, in the page's message line.
CSRF_FAILURE_VIEW = "sessions_app.views.csrf_failure"

# Corral
CORRAL_LOCAL_MODELS_DIR = env_str("CORRAL_LOCAL_MODELS_DIR", str(DATA_DIR / "models"))
CORRAL_LLAMA_SERVER = env_str("CORRAL_LLAMA_SERVER", "")
CORRAL_READY_TIMEOUT = env_float("CORRAL_READY_TIMEOUT", 300.0, minimum=1.0)
CORRAL_STOP_GRACE = env_float("CORRAL_STOP_GRACE", 5.0, minimum=0.0)
CORRAL_LOG_DIR = DATA_DIR / "logs"
# Which Corral host this process runs on (CORRAL_HOST_ID, or data/host_id): the local
# machine whose servers are its own, and the queues of its workers (docs/operations.md,
# "More hosts"). "" before the launcher prepared the data directory.
CORRAL_HOST_ID = data_dir.read_host_id(DATA_DIR)
# Disk (docs/operations.md "Disk"): llama-server logs kept per session (one per start; the
# oldest go at each start, all of them with the session), and the hours a saved prompt cache
# (slot file, megabytes to gigabytes) is kept for a session without a running server.
CORRAL_SERVER_LOGS_KEPT = env_int("CORRAL_SERVER_LOGS_KEPT", 5, minimum=1, maximum=1000)
CORRAL_SLOT_KEEP_HOURS = env_float("CORRAL_SLOT_KEEP_HOURS", 72.0, minimum=0.01)
# A turn step holds its lease this long without renewing (it renews every third of it);
# a worker that dies mid-step is taken over once it lapses (docs/behaviour.md C16).
CORRAL_LEASE_SECONDS = env_float("CORRAL_LEASE_SECONDS", 60.0, minimum=1.0)
# How long a server start's claim lasts without renewal (renewed every third of it while the
# start lives): a start lost with its worker or the broker is taken for gone after this.
CORRAL_START_CLAIM_SECONDS = env_float("CORRAL_START_CLAIM_SECONDS", 30.0, minimum=1.0)
# An open session page refreshes its "watching now" entry this often; an entry left by a
# daphne that died expires after three missed refreshes (docs/sharing.md).
CORRAL_PRESENCE_SECONDS = env_float("CORRAL_PRESENCE_SECONDS", 20.0, minimum=0.1)
# Images a message may carry (docs/behaviour.md §16): the largest one in bytes, and how many.
CORRAL_IMAGE_MAX_BYTES = env_int("CORRAL_IMAGE_MAX_BYTES", 10_000_000, minimum=1)
CORRAL_IMAGE_MAX_COUNT = env_int("CORRAL_IMAGE_MAX_COUNT", 8, minimum=1, maximum=100)
# The largest text file (code, logs, Markdown) a message may carry, in bytes: it goes to
# the model as text, so it counts against the context (100 KB is about 25,000 tokens).
CORRAL_TEXT_FILE_MAX_BYTES = env_int("CORRAL_TEXT_FILE_MAX_BYTES", 100_000, minimum=1, maximum=10_000_000)
# … and the most pixels one may have (width × height): the bytes say little about what
# decoding costs (a 9000×9000 PNG of one colour is a few hundred KB and 320 MB decoded).
# At most Pillow's own decompression-bomb limit, which refuses more anyway.
CORRAL_IMAGE_MAX_PIXELS = env_int("CORRAL_IMAGE_MAX_PIXELS", 16_777_216, minimum=1, maximum=89_478_485)
# Threads of the turns worker that ./corral run starts: how many turns stream at once on
# this host; more wait in the queue, and their pages say how many are ahead.
CORRAL_TURN_WORKERS = env_int("CORRAL_TURN_WORKERS", 8, minimum=1, maximum=256)
# The longest reply, in tokens, of a session that sets no max_tokens of its own: a model
# that never emits its end token would otherwise generate until the context is full
# (minutes), and the next message would not fit (docs/behaviour.md §6).
CORRAL_DEFAULT_MAX_TOKENS = env_int("CORRAL_DEFAULT_MAX_TOKENS", 4096, minimum=1, maximum=4_194_304)
# The most characters of one tool result that are stored and sent to the model; the rest is
# cut with a note saying how much and how to ask for a part (docs/behaviour.md §9): one
# huge result would otherwise be re-sent with every request and overflow the context.
# Seconds a reply's stream may send nothing (not even a progress chunk) before the turn
# ends with "llama-server sent nothing for …" (a frozen server held it for 30 minutes).
CORRAL_STREAM_IDLE_SECONDS = env_float("CORRAL_STREAM_IDLE_SECONDS", 600.0, minimum=1.0)
# Seconds a ready llama-server has to answer GET /health at each watch before its session
# shows "unknown" (a frozen process still has a pid).
CORRAL_HEALTH_TIMEOUT = env_float("CORRAL_HEALTH_TIMEOUT", 10.0, minimum=0.5)
# A bearer token that may read /metrics (Prometheus' scrape, project/metrics.py); staff may
# always. Unset: only staff.
CORRAL_METRICS_TOKEN = env_str("CORRAL_METRICS_TOKEN", "")
# Seconds an API request (api_app, docs/api.md) waits for its model's server to start,
# waiting for memory on its machine included, before it is answered 503 with the reason.
CORRAL_API_WAIT_SECONDS = env_float("CORRAL_API_WAIT_SECONDS", 300.0, minimum=1.0)
CORRAL_TOOL_RESULT_MAX_CHARS = env_int("CORRAL_TOOL_RESULT_MAX_CHARS", 20_000, minimum=1_000, maximum=10_000_000)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    # One line per event: a refused request and an SSH link that fails are expected, not
    # tracebacks (project/log_filters.py).
    "filters": {
        "one_line_refusals": {"()": "project.log_filters.OneLineRefusals"},
        "no_paramiko_tracebacks": {"()": "project.log_filters.NoParamikoTracebacks"},
    },
    # On the handler, not on the loggers: a logger's filters do not apply to records of its
    # children (paramiko logs as ``paramiko.transport``).
    "handlers": {"console": {"class": "logging.StreamHandler",
                             "filters": ["one_line_refusals", "no_paramiko_tracebacks"]}},
    "root": {"handlers": ["console"], "level": env_choice("LOG_LEVEL", "INFO", set(logging.getLevelNamesMapping()))},
}

# Web Push (docs/attention.md): who runs this Corral, as the VAPID "sub" claim (RFC 8292 §2.1,
# a mailto: or https: URL) push services may write to about the messages it sends.
CORRAL_VAPID_SUBJECT = env_str("CORRAL_VAPID_SUBJECT", "mailto:corral@localhost")
