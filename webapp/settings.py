"""Django settings, read from environment variables (embedded SQLite/in-memory/eager by default)."""

from __future__ import annotations

import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from agent import defaults
from webapp.core.files import write_once
from webapp.env import envbool, envint, envlist, envstr

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(envstr("SWARM_DATA_DIR", str(BASE_DIR / "var"))).resolve()
DATA_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = envbool("DEBUG", False)


def _secret_key() -> str:
    """SECRET_KEY (or SECRET_KEY_FILE); otherwise one generated once into the data dir (0600)."""
    key = envstr("SECRET_KEY")
    if key:
        if len(key) < 32:
            raise ImproperlyConfigured("SECRET_KEY must be at least 32 characters")
        return key
    path = DATA_DIR / "secret_key"
    if not path.exists():
        write_once(path, secrets.token_urlsafe(48).encode())
    return path.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS", [])
SITE_URL = envstr("SITE_URL", f"http://127.0.0.1:{defaults.WEB_PORT}").rstrip("/")
# GET /metrics (webapp/metrics.py) asks for `Authorization: Bearer <token>` when this is set.
METRICS_TOKEN = envstr("SWARM_METRICS_TOKEN")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "webapp.core",
    "webapp.catalog",
    "webapp.fleet",
    "webapp.routing",
    "webapp.playground",
    "webapp.api",
    "webapp.telemetry",
    "webapp.tracker",
    "webapp.releases",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "webapp.metrics.ErrorCodeMiddleware",  # 4xx/5xx responses by code on /metrics
]

ROOT_URLCONF = "webapp.urls"
ASGI_APPLICATION = "webapp.asgi.application"
WSGI_APPLICATION = None

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

# --- database: DATABASE_URL (PostgreSQL) or the embedded SQLite file ------------------------------
DATABASE_URL = envstr("DATABASE_URL")
# PostgreSQL connections each process keeps in a pool (0: a new connection per request or consumer call).
# Every agent's heartbeat is a database call every few seconds, and opening a connection for each was
# about half of what a heartbeat cost the web process (py-spy, docs/benchmarks.md). Pooled, not persistent
# (CONN_MAX_AGE): under ASGI a request's thread does not outlive it, so Django's own persistent
# connections would be opened per request anyway; health-checked when taken from the pool.
DB_POOL_MAX = envint("DB_POOL_MAX", 10, minimum=0)
if DATABASE_URL:
    try:
        DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0, conn_health_checks=True)}
    except ValueError as e:
        raise ImproperlyConfigured(f"DATABASE_URL is not a valid database URL: {e}") from None
    if DB_POOL_MAX and DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # A burst past max_size waits this long for a connection before its request fails.
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": DB_POOL_MAX,
            "timeout": 20,
            "max_idle": 300,
        }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(DATA_DIR / "db.sqlite3"),
            # Several processes (web, worker, `swarm_up`) share the file: wait instead of failing.
            "OPTIONS": {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: Celery broker + Channels layer, or in-process fallbacks --------------------------------
REDIS_URL = envstr("REDIS_URL")
if REDIS_URL:
    if not REDIS_URL.startswith(("redis://", "rediss://", "unix://")):
        raise ImproperlyConfigured(f"REDIS_URL={REDIS_URL!r} must start with redis://, rediss:// or unix://")
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                # redis-py 8 times socket reads out after 5 s by default, exactly channels-redis's blocking-pop
                # timeout: the race killed consumers with "Timeout reading" (close 1011). Read longer.
                "hosts": [{"address": REDIS_URL, "socket_timeout": 30}],
                "prefix": envstr("CHANNELS_PREFIX", "swarm"),
            },
        }
    }
    CELERY_BROKER_URL = REDIS_URL
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    CELERY_BROKER_URL = "memory://"
# Tracker peers live in Redis when it exists (several web processes answer announces), else in memory.
TRACKER_REDIS_PREFIX = envstr("CHANNELS_PREFIX", "swarm") + ":tracker"
# SSL torrents (docs/security.md "Swarm: SSL torrents"): new .torrents carry the data-plane CA as root,
# so only enrolled nodes with an https data plane (a node certificate) exchange pieces, over TLS.
SWARM_SSL_TORRENTS = envbool("SWARM_SSL_TORRENTS", False)
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", not REDIS_URL)
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A publish waits at most this for Redis per try (kombu's default is no timeout: a Redis that accepts and
# never answers held the publisher forever, an agent consumer's rollout step on the web's shared
# database thread among them); above the workers' 1 s blocking pop. Ignored by memory://.
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_timeout": 5, "socket_connect_timeout": 5}
CELERY_TASK_DEFAULT_QUEUE = envstr("CELERY_QUEUE", "swarm")
CELERY_BEAT_SCHEDULE = {
    "sweep-offline-nodes": {
        "task": "webapp.fleet.tasks.sweep_offline_nodes",
        "schedule": timedelta(seconds=2),
    },
    "prune-telemetry": {"task": "webapp.telemetry.tasks.prune_samples", "schedule": timedelta(minutes=10)},
    "gc-route-sessions": {"task": "webapp.routing.tasks.gc_sessions", "schedule": timedelta(minutes=1)},
    "advance-rollouts": {"task": "webapp.releases.tasks.advance_rollouts", "schedule": timedelta(seconds=5)},
    "requeue-unqueued-builds": {
        "task": "webapp.catalog.tasks.requeue_unqueued_builds",
        "schedule": timedelta(seconds=30),
    },
}

# --- swarm behaviour ------------------------------------------------------------------------------
HEARTBEAT_INTERVAL_S = envint("HEARTBEAT_INTERVAL_S", defaults.HEARTBEAT_INTERVAL_S, minimum=1)
NODE_OFFLINE_AFTER_S = envint("NODE_OFFLINE_AFTER_S", 7, minimum=2)
# An offline node's shards are re-placed on the survivors after this long (a quick restart keeps them).
NODE_LOST_AFTER_S = envint("NODE_LOST_AFTER_S", 30, minimum=0)
# ... unless its data plane stopped answering too: then after this long (a restart comes back sooner).
NODE_DEAD_AFTER_S = envint("NODE_DEAD_AFTER_S", 5, minimum=0)
# An agent whose control socket dropped retries with a backoff up to this long (agent.defaults): after a
# web start, silence counts only once every live agent has had its next try (fleet.services.silence_start).
AGENT_RECONNECT_MAX_S = envint("AGENT_RECONNECT_MAX_S", int(defaults.RECONNECT_MAX_S), minimum=0)
ENROLLMENT_TOKEN_TTL_S = envint("ENROLLMENT_TOKEN_TTL_S", 3600, minimum=60)
ROUTE_TOKEN_TTL_S = envint("ROUTE_TOKEN_TTL_S", defaults.ROUTE_TOKEN_TTL_S, minimum=60)
ROUTE_SESSION_IDLE_S = envint("ROUTE_SESSION_IDLE_S", 1800, minimum=60)
TELEMETRY_SAMPLE_EVERY_S = envint("TELEMETRY_SAMPLE_EVERY_S", 10, minimum=1)
TELEMETRY_KEEP_HOURS = envint("TELEMETRY_KEEP_HOURS", 24, minimum=1)
KV_RESERVE_BYTES = envint("KV_RESERVE_BYTES", 256 << 20, minimum=0)
# The ggml executor when a node has it built; nodes without it fall back to their first backend.
DEFAULT_BACKEND = envstr("DEFAULT_BACKEND", defaults.DEFAULT_BACKEND)
# How the playground's and the API's route clients drive the hops (docs/protocol.md, "Star vs chain"):
# chain keeps hidden states off this process; star keeps every seam in it (a dead hop's spare re-prefills
# from its own seam instead of the whole route from position 0).
ROUTE_MODE = envstr("ROUTE_MODE", defaults.CONTROL_PLANE_ROUTE_MODE)
if ROUTE_MODE not in defaults.ROUTE_MODES:
    raise ImproperlyConfigured(
        f"ROUTE_MODE={ROUTE_MODE[:40]!r} must be one of {', '.join(defaults.ROUTE_MODES)}"
    )
# A chat's leading system messages may be shared with other users' sessions (issue 32): a new route
# restores the hops' saved state at that prefix instead of prefilling it (webapp/routing/prefix.py).
ROUTE_PREFIX_SHARING = envbool("ROUTE_PREFIX_SHARING", True)
# Speculative decoding (issue 34, docs/speculative.md): at most this many prompt-lookup drafts per step of
# the route, sized per answer by its measured round trip, verification cost and acceptance; the tokens
# are the plain route's either way. On by default: over 25 ms links it gave 2.6x on quoting answers, and
# on one machine's loopback, where the drafts are sized away, answers ran as fast as without it
# (docs/benchmarks.md, 2026-12-07). 0 turns it off.
ROUTE_SPECULATE = envint("ROUTE_SPECULATE", 8)
if not 0 <= ROUTE_SPECULATE <= 15:
    raise ImproperlyConfigured(
        f"ROUTE_SPECULATE={ROUTE_SPECULATE} must be 0..15 (drafts per verification step)"
    )
# Ed25519 key that signs route tokens: ROUTE_KEY_PEM(_FILE), else generated into the data dir (0600).
ROUTE_KEY_PEM = envstr("ROUTE_KEY_PEM")
ROUTE_KEY_PATH = DATA_DIR / "route_key.pem"
# Agent releases (webapp/releases, docs/security.md): the base64 Ed25519 public key nodes pin at
# enrollment, and optionally a 0600 PEM private key so the web host signs uploads itself (less safe).
RELEASE_PUBLIC_KEY = envstr("RELEASE_PUBLIC_KEY")
RELEASE_SIGNING_KEY_FILE = envstr("RELEASE_SIGNING_KEY_FILE")
RELEASE_DIR = DATA_DIR / "releases"
# A node told to update must report the new version (or its refusal) within this long.
RELEASE_NODE_TIMEOUT_S = envint("RELEASE_NODE_TIMEOUT_S", 300, minimum=10)
ARTIFACT_DIR = DATA_DIR / "artifacts"
MAX_UPLOAD_BYTES = envint("MAX_UPLOAD_BYTES", 64 << 30, minimum=1)
DATA_UPLOAD_MAX_MEMORY_SIZE = 10 << 20
FILE_UPLOAD_MAX_MEMORY_SIZE = 10 << 20

# --- issue 17: defences of the control plane (docs/security.md) ------------------------------------
# Path registrations may only name files under this directory (symlinks resolved, must stay inside).
MODELS_DIR = Path(envstr("SWARM_MODELS_DIR", str(DATA_DIR / "models"))).resolve()
# Every request body is refused past this (declared or counted while it arrives), except uploads to
# /models/register, which may carry MAX_UPLOAD_BYTES (webapp.core.bodylimit).
MAX_REQUEST_BYTES = envint("MAX_REQUEST_BYTES", 32 << 20, minimum=1 << 20)
# Login lockout (webapp.core.throttle): failures per (username, address) and per username, in a window.
LOGIN_FAILURE_LIMIT = envint("LOGIN_FAILURE_LIMIT", 10, minimum=1)
LOGIN_FAILURE_LIMIT_PER_USER = envint("LOGIN_FAILURE_LIMIT_PER_USER", 100, minimum=1)
LOGIN_LOCKOUT_S = envint("LOGIN_LOCKOUT_S", 900, minimum=1)
AUTHENTICATION_BACKENDS = [
    "webapp.core.throttle.ThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
# A node's data-plane host must be its control socket's peer address (loopback counts as one) unless
# listed here (host names or addresses; "*" allows any, e.g. behind NAT): docs/security.md.
DATAPLANE_ALLOWED_HOSTS = envlist("DATAPLANE_ALLOWED_HOSTS", [])
DATAPLANE_PROBE_TIMEOUT_S = envint("DATAPLANE_PROBE_TIMEOUT_S", 3, minimum=1)
# A data plane that failed its check is checked again on a heartbeat at most this often (seconds).
DATAPLANE_REPROBE_S = envint("DATAPLANE_REPROBE_S", 30, minimum=0)

# --- issue 33: limits per user and per node (docs/security.md, "Limits per user", "Tracker poisoning") --
# Requests a minute for all of a user's API keys together (each key keeps its own API_KEY_RATE_PER_MIN).
API_USER_RATE_PER_MIN = envint("API_USER_RATE_PER_MIN", 120, minimum=1)
# Active API keys a user may hold, and keys a user may create in an hour.
API_KEYS_PER_USER = envint("API_KEYS_PER_USER", 10, minimum=1)
API_KEY_CREATES_PER_HOUR = envint("API_KEY_CREATES_PER_HOUR", 20, minimum=1)
# Answers a user may have running at once, API requests and playground answers together (429 beyond).
USER_MAX_STREAMS = envint("USER_MAX_STREAMS", 3, minimum=1)
# Route sessions (KV kept on the hops) a user may hold per web process; past it the oldest idle close.
USER_MAX_ROUTE_SESSIONS = envint("USER_MAX_ROUTE_SESSIONS", 4, minimum=1)
# Answers before their first token (prefills) at once per web process; the rest wait round-robin by user.
ROUTE_PREFILLS_AT_ONCE = envint("ROUTE_PREFILLS_AT_ONCE", 4, minimum=1)
# While a user prefills, decode steps of users running more answers wait this long at most (0: never).
ROUTE_GIVE_WAY_MS = envint("ROUTE_GIVE_WAY_MS", 1000, minimum=0)
# Tracker announces and scrapes a node may send a minute (refused with a failure reason beyond).
TRACKER_ANNOUNCES_PER_MIN = envint("TRACKER_ANNOUNCES_PER_MIN", 30, minimum=1)
# --- issue 33: prompts checked before tokenizing, tokenized off the event loop (webapp/routing/prompt.py)
# A prompt may carry this many bytes per token of the model's context (text averages about 4), and at
# most MAX_CHAT_MESSAGES messages (never more than the context's tokens); refused with a 400 past either.
PROMPT_BYTES_PER_TOKEN = envint("PROMPT_BYTES_PER_TOKEN", 8, minimum=1)
MAX_CHAT_MESSAGES = envint("MAX_CHAT_MESSAGES", 2048, minimum=1)
# Threads rendering and tokenizing prompts, and prompts admitted to them at once (503 beyond) per process.
TOKENIZE_THREADS = envint("TOKENIZE_THREADS", 2, minimum=1)
TOKENIZE_QUEUE = envint("TOKENIZE_QUEUE", 8, minimum=1)
if REDIS_URL:  # lockout counters shared by every web process
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": envstr("CHANNELS_PREFIX", "swarm") + ":cache",
        }
    }

# --- auth, i18n, static ---------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = envbool("SECURE_COOKIES", False)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
SERVE_STATIC = envbool("SERVE_STATIC", True)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    # Secrets (passkeys, tokens, keys, passwords) are redacted before any handler writes (issue 17).
    "filters": {"secrets": {"()": "agent.logsafe.RedactSecrets"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain", "filters": ["secrets"]}},
    "root": {"handlers": ["console"], "level": envstr("LOG_LEVEL", "INFO")},
    "loggers": {"django.channels.server": {"level": "WARNING"}, "daphne": {"level": "WARNING"}},
}
