"""Settings of the celery-steplock example/test project.

Database: ``DATABASE_URL`` (PostgreSQL via psycopg 3, MariaDB/MySQL via mysqlclient with a
``mysql://`` URL, or any URL dj-database-url understands); default a SQLite file under
``var/``. SQLite is configured for
several worker *processes* writing at once (WAL, busy timeout, ``BEGIN
IMMEDIATE``), and its test database is a real file so that ``celery worker``
subprocesses started by the tests can open it.

Celery: every ``CELERY_*`` setting maps to the lowercase Celery setting
(``CELERY_STEPLOCK_DEFAULT_TTL`` -> ``app.conf.steplock_default_ttl``).
"""

import copy
import json
import os
from pathlib import Path

import django
import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("STEPLOCK_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _env_bool(name, default=False):
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


SECRET_KEY = os.environ.get(
    "DJANGO_SECRET_KEY",
    "django-insecure-steplock-example-only-never-use-in-production",
)
DEBUG = _env_bool("DJANGO_DEBUG", False)
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1").split(",")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "celery_steplock.contrib.django",
    "django_app.workflows",
    "django_app.faults",
    "django_app.routing",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "django_app.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

# --- Database -----------------------------------------------------------------
SQLITE_PATH = Path(os.environ.get("STEPLOCK_SQLITE", VAR_DIR / "steplock.sqlite3"))
SQLITE_TEST_PATH = Path(os.environ.get("STEPLOCK_TEST_SQLITE", VAR_DIR / "test_steplock.sqlite3"))

DATABASES = {
    "default": dj_database_url.config(
        env="DATABASE_URL",
        default=f"sqlite:///{SQLITE_PATH}",
        conn_max_age=0,
    )
}

if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    _sqlite_options = {"timeout": 30}
    if django.VERSION >= (5, 1):
        # Django 5.1+: BEGIN IMMEDIATE takes the write lock up front (no
        # "database is locked" on a read->write upgrade), WAL lets readers run
        # beside the single writer.
        _sqlite_options.update(
            {
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            }
        )
    DATABASES["default"].setdefault("OPTIONS", {}).update(_sqlite_options)
    # Never in-memory: real worker processes must open the test database.
    DATABASES["default"]["TEST"] = {"NAME": str(SQLITE_TEST_PATH)}
else:
    DATABASES["default"]["CONN_MAX_AGE"] = 0


def _mysql(database):
    """MariaDB/MySQL through mysqlclient (requirements/mysql.txt). utf8mb4: the 3-byte "utf8"
    cannot hold every character. Django runs MySQL sessions at READ COMMITTED unless told;
    STEPLOCK_MYSQL_ISOLATION ("repeatable read", ...) picks another level for a test run."""
    if database["ENGINE"] != "django.db.backends.mysql":
        return
    options = database.setdefault("OPTIONS", {})
    options.setdefault("charset", "utf8mb4")
    if os.environ.get("STEPLOCK_MYSQL_ISOLATION"):
        options["isolation_level"] = os.environ["STEPLOCK_MYSQL_ISOLATION"].strip().lower()
    database.setdefault("TEST", {}).update(CHARSET="utf8mb4", COLLATION="utf8mb4_unicode_ci")


_mysql(DATABASES["default"])

# Two more databases for the router tests (django_app/routers.py, docs/databases.md):
# "replica", which nothing writes (a read replica lagging without end), and "other", a second
# primary. Same engine as default: SQLite files beside its file, or databases of the same
# PostgreSQL or MariaDB/MySQL server ("<name>_replica", "<name>_other");
# STEPLOCK_<ALIAS>_DATABASE_URL points one elsewhere (the tests' worker processes get their test
# databases that way). Only the tests that declare them create their test databases.
for _alias in ("replica", "other"):
    _url = os.environ.get(f"STEPLOCK_{_alias.upper()}_DATABASE_URL")
    if _url:
        _extra = dj_database_url.parse(_url, conn_max_age=0)
        if _extra["ENGINE"] == "django.db.backends.sqlite3":
            _extra["OPTIONS"] = dict(DATABASES["default"].get("OPTIONS", {}))
            _extra["TEST"] = {"NAME": _extra["NAME"]}
    else:
        _extra = copy.deepcopy(DATABASES["default"])
        if _extra["ENGINE"] == "django.db.backends.sqlite3":
            _path = Path(_extra["NAME"])
            _extra["NAME"] = str(_path.with_name(f"{_path.stem}_{_alias}{_path.suffix}"))
            _extra["TEST"] = {
                "NAME": str(
                    SQLITE_TEST_PATH.with_name(
                        f"{SQLITE_TEST_PATH.stem}_{_alias}{SQLITE_TEST_PATH.suffix}"
                    )
                )
            }
        else:
            _extra["NAME"] = f"{_extra['NAME']}_{_alias}"
            _extra.pop("TEST", None)
    _mysql(_extra)
    DATABASES[_alias] = _extra

DATABASE_ROUTERS = [
    name
    for name in os.environ.get(
        "STEPLOCK_DATABASE_ROUTERS", "django_app.routers.ProjectRouter"
    ).split(",")
    if name
]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = []

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"

# --- Celery (CELERY_ namespace, see django_app/celery.py) ----------------------
CELERY_BROKER_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = "django-db"
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": int(os.environ.get("STEPLOCK_VISIBILITY_TIMEOUT", 3600)),
}
# Optional kombu Redis-transport knobs (used by scripts/demo.py): how often a
# worker sweeps for messages whose consumer died (kombu 5.6+ sweeps every
# interval * throttle seconds, 10 * 10 by default), and a key prefix that
# isolates this project's broker keys on a shared Redis.
for _env, _option in (
    ("STEPLOCK_UNACKED_RESTORE_INTERVAL", "unacked_restore_interval"),
    ("STEPLOCK_UNACKED_RESTORE_THROTTLE", "unacked_restore_throttle"),
    ("STEPLOCK_UNACKED_MUTEX_EXPIRE", "unacked_mutex_expire"),
):
    if os.environ.get(_env):
        CELERY_BROKER_TRANSPORT_OPTIONS[_option] = int(os.environ[_env])
if os.environ.get("STEPLOCK_BROKER_KEYPREFIX"):
    CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"] = os.environ["STEPLOCK_BROKER_KEYPREFIX"]
CELERY_TIMEZONE = TIME_ZONE

# --- celery-steplock (read by the library as app.conf.steplock_*) -------------
CELERY_STEPLOCK_DEFAULT_TTL = float(os.environ.get("STEPLOCK_TTL", 30))
if os.environ.get("STEPLOCK_REDIS_URL"):  # else the broker's Redis
    CELERY_STEPLOCK_REDIS_URL = os.environ["STEPLOCK_REDIS_URL"]
CELERY_STEPLOCK_REDIS_CLUSTER = _env_bool("STEPLOCK_REDIS_CLUSTER", False)
if os.environ.get("STEPLOCK_KEY_PREFIX"):
    CELERY_STEPLOCK_KEY_PREFIX = os.environ["STEPLOCK_KEY_PREFIX"]
CELERY_STEPLOCK_EVENT_LOG = _env_bool("STEPLOCK_EVENT_LOG", False)
if os.environ.get("STEPLOCK_RENEWAL_RATIO"):
    CELERY_STEPLOCK_RENEWAL_RATIO = float(os.environ["STEPLOCK_RENEWAL_RATIO"])
if os.environ.get("STEPLOCK_RETRY_MAX"):
    CELERY_STEPLOCK_RETRY_MAX = int(os.environ["STEPLOCK_RETRY_MAX"])
if os.environ.get("STEPLOCK_RETRY_BACKOFF"):
    CELERY_STEPLOCK_RETRY_BACKOFF = float(os.environ["STEPLOCK_RETRY_BACKOFF"])
if os.environ.get("STEPLOCK_RETRY_BACKOFF_MAX"):
    CELERY_STEPLOCK_RETRY_BACKOFF_MAX = float(os.environ["STEPLOCK_RETRY_BACKOFF_MAX"])
if os.environ.get("STEPLOCK_MAX_HOLD"):
    CELERY_STEPLOCK_MAX_HOLD = float(os.environ["STEPLOCK_MAX_HOLD"])
if os.environ.get("STEPLOCK_REDIS_URL"):
    CELERY_STEPLOCK_REDIS_URL = os.environ["STEPLOCK_REDIS_URL"]
if os.environ.get("STEPLOCK_REDIS_TRANSPORT_OPTIONS"):  # JSON, e.g. {"master_name": "..."}
    CELERY_STEPLOCK_REDIS_TRANSPORT_OPTIONS = json.loads(
        os.environ["STEPLOCK_REDIS_TRANSPORT_OPTIONS"]
    )
# The reaper (manage.py reap_expired_leases, celery steplock reap, the beat task) moves a step
# whose owner is gone from "running" back to "pending", by compare-and-swap.
CELERY_STEPLOCK_REAPER_RECOVER = {"workflows.Step": {"running": "pending"}}

# --- Logging ------------------------------------------------------------------
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "loggers": {
        "celery_steplock": {
            "handlers": ["console"],
            "level": os.environ.get("STEPLOCK_LOG_LEVEL", "INFO"),
            "propagate": False,
        },
    },
}
