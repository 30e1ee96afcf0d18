"""Settings: every ``steplock_*`` setting, its default and its validation, in one place.

Settings live on the Celery app's configuration (``app.conf.steplock_default_ttl = 30``); a
Django project that loads its Celery configuration with ``namespace="CELERY"`` sets them as
``CELERY_STEPLOCK_DEFAULT_TTL`` in ``settings.py``. They are read at access time, so a change
to ``app.conf`` takes effect on the next task. An invalid value raises
:class:`~celery_steplock.exceptions.ImproperlyConfigured` naming the setting.
"""
from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Any

from .exceptions import ImproperlyConfigured

# "skip" and "return" end the task with a successful outcome that says so
# (celery_steplock.outcomes); "ignore" is Celery's Ignore (no state stored).
ON_CONTENDED = ("retry", "skip", "ignore", "raise")
ON_CONFLICT = ("return", "ignore", "raise")
ON_STORE_ERROR = ("fail_closed", "fail_open")

#: Every setting with its default. Units are seconds.
DEFAULTS: dict[str, Any] = {
    "redis_url": None,              # None: the broker URL when it is a Redis URL
    # None: the broker's broker_transport_options / broker_use_ssl when redis_url is None
    "redis_transport_options": None,  # {"master_name": ..., "sentinel_kwargs": {...}}
    "redis_use_ssl": None,          # {"ssl_cert_reqs": ..., "ssl_ca_certs": ..., ...}
    "redis_client_factory": None,   # factory(settings) -> redis client, or its qualified name
    "redis_cluster": False,         # True: redis_url names one node of a Redis Cluster
    "key_prefix": "steplock",
    "default_ttl": 30.0,
    "renewal_ratio": 1 / 3,         # renew every ttl * ratio (Redisson's watchdog: ttl / 3)
    "lock_wait": 0.0,
    "max_hold": None,               # None: renew for as long as the task runs
    "on_contended": "retry",
    "on_conflict": "return",
    "on_store_error": "fail_closed",
    "retry_backoff": 1.0,
    "retry_backoff_max": 60.0,
    "retry_max": None,              # None: retry a busy lease or an outage until it clears
    "status_field": "status",
    "owner_field": "lock_owner",
    "fence_field": "lock_fence",
    "precheck": True,
    "db_deadline": True,            # PostgreSQL: bound the CAS's lock wait and idle-before-COMMIT
    "socket_timeout": 5.0,
    "fence_ttl": 7 * 24 * 3600.0,   # lifetime of an idle name's fencing counter
    "max_waiters": 1000,            # callers of one process waiting for leases at once
    "event_log": False,             # Django: write LeaseEvent rows (contrib.django)
    "event_retention": 7 * 24 * 3600.0,
    "reaper_recover": {},           # {"app_label.Model": {"in-flight status": "recovery status"}}
    "reaper_older_than": 0.0,       # seconds a step must have been in flight before recovery
    # The step-store factory (celery_steplock.steps.StepStore), a qualified string.
    "step_store": "celery_steplock.contrib.django.steps:DjangoStepStore",
    "step_database": None,          # None: the step model's write database (Django: the router)
}


def setting_name(name: str) -> str:
    """``"default_ttl"`` -> ``"steplock_default_ttl"``."""
    return f"steplock_{name}"


def describe(name: str) -> str:
    """A setting's name as both Celery and Django users write it; task options as is."""
    if name.startswith("steplock_"):
        return f"{name} (CELERY_{name.upper()} in Django settings)"
    return name


def check_seconds(value: Any, name: str, *, allow_zero: bool = False,
                  allow_none: bool = False) -> float | None:
    """Return ``value`` as float seconds, or raise ImproperlyConfigured naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or math.isinf(value):
        raise ImproperlyConfigured(
            f"{describe(name)} must be a number of seconds, got {value!r}", setting=name)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ImproperlyConfigured(f"{describe(name)} must be {bound} seconds, got {value!r}",
                                   setting=name)
    return float(value)


#: Bounds of a lease TTL, seconds: below the minimum the drift allowance and one round trip
#: eat the lease; above the maximum a lease is a bug (the heartbeat keeps short ones alive).
MIN_TTL = 0.05
MAX_TTL = 24 * 3600.0
#: The renewal interval may use at most this share of the TTL, leaving time for a retry.
MAX_RENEWAL_RATIO = 0.75


def check_ttl(value: Any, name: str) -> float:
    """Return ``value`` as a TTL in seconds within [MIN_TTL, MAX_TTL], else raise."""
    ttl = check_seconds(value, name)
    if not MIN_TTL <= ttl <= MAX_TTL:
        raise ImproperlyConfigured(f"{describe(name)} must be between {MIN_TTL} and "
                                   f"{MAX_TTL:.0f} seconds, got {value!r}", setting=name)
    return ttl


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise (``"false"`` is not False)."""
    if not isinstance(value, bool):
        raise ImproperlyConfigured(f"{describe(name)} must be True or False, got {value!r}",
                                   setting=name)
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ImproperlyConfigured."""
    if value not in choices:
        raise ImproperlyConfigured(
            f"{describe(name)} must be one of {', '.join(map(repr, choices))}, got {value!r}",
            setting=name)
    return value


def check_database(value: Any, name: str) -> str | None:
    """Return ``value`` if it is None or a database name (a non-empty string without
    surrounding spaces), else raise ImproperlyConfigured naming ``name``. Whether the
    database exists is the step store's to say."""
    if value is not None and (not isinstance(value, str) or not value
                              or value != value.strip()):
        raise ImproperlyConfigured(
            f"{describe(name)} must be None or a database alias (a key of DATABASES), "
            f"got {value!r}", setting=name)
    return value


# app -> (conf, its maps, Django settings version, copy of conf.changes, values, memo)
_snapshots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_snapshots_guard = threading.Lock()
_django_version = [0]
_django_watched = False


def _django_setting_changed(**kwargs: Any) -> None:
    _django_version[0] += 1


def _watch_django() -> None:
    """Count Django's ``setting_changed`` (override_settings), which a Django-namespaced
    ``app.conf`` reads through."""
    global _django_watched
    _django_watched = True
    if "django" in sys.modules:
        try:
            from django.core.signals import setting_changed
        except ImportError:
            return
        setting_changed.connect(_django_setting_changed, weak=False,
                                dispatch_uid="celery_steplock.conf")


def _shared_snapshot(app) -> tuple[dict[str, Any], dict[Any, Any]]:
    """The values read so far and the memo of ``app``'s configuration as it is now: kept
    across executions while ``app.conf`` stays the same object with the same maps, its
    ``changes`` (what ``app.conf.x = y`` and ``update()`` write) compare equal, and Django
    announced no setting change; else fresh ones."""
    if not _django_watched:
        _watch_django()
    conf = app.conf
    maps = getattr(conf, "maps", None)
    changes = getattr(conf, "changes", None)
    if not isinstance(maps, list) or not isinstance(changes, dict):
        return {}, {}
    cached = _snapshots.get(app)
    if cached is not None and cached[0] is conf and cached[2] == _django_version[0] \
            and len(cached[1]) == len(maps) and all(a is b for a, b in zip(cached[1], maps)) \
            and cached[3] == changes:
        return cached[4], cached[5]
    values: dict[str, Any] = {}
    memo: dict[Any, Any] = {}
    with _snapshots_guard:
        _snapshots[app] = (conf, list(maps), _django_version[0], dict(changes), values, memo)
    return values, memo


def configuration_version(app) -> Any:
    """A token that stays the same object while ``app``'s configuration is unchanged (see
    :func:`_shared_snapshot`) and is a new one after any change: what the execution plan is
    cached against. Cheap: identity and equality checks, no setting is read."""
    _, memo = _shared_snapshot(app)
    return memo


class Settings:
    """The ``steplock_*`` settings of one Celery app, validated on access.

    ``Settings(app).default_ttl`` reads ``app.conf.steplock_default_ttl`` (default 30.0).
    With ``snapshot=True`` each setting is read from ``app.conf`` once and kept, and so are
    the values for the next snapshot as long as the configuration is unchanged (see
    :func:`_shared_snapshot`; a value changed in place, e.g. a dict mutated rather than
    assigned, is not noticed): a task execution takes one snapshot, so its reads cost
    nothing once the first execution made them (Celery's namespaced configuration lookups
    are not cheap).
    """

    def __init__(self, app, snapshot: bool = False):
        self.app = app
        self._snapshot: dict[str, Any] | None = None
        #: Objects built from a snapshot's values (a task's guard), kept as long as it is.
        self.memo: dict[Any, Any] | None = None
        if snapshot:
            self._snapshot, self.memo = _shared_snapshot(app)

    def raw(self, name: str) -> Any:
        if self._snapshot is not None and name in self._snapshot:
            return self._snapshot[name]
        value = self.app.conf.get(setting_name(name))
        value = DEFAULTS[name] if value is None else value
        if self._snapshot is not None:
            self._snapshot[name] = value
        return value

    @property
    def redis_url(self) -> str:
        return self._redis_url(self.raw("redis_url"))

    def _redis_url(self, url: Any) -> str:
        from .clients import URL_SCHEMES, check_url

        if url is None:
            broker = self.app.conf.broker_url or ""
            if isinstance(broker, str) and broker.startswith(URL_SCHEMES):
                return check_url(broker, "broker_url")
            raise ImproperlyConfigured(
                "steplock_redis_url is not set and the broker URL is not a Redis URL; "
                "set steplock_redis_url (CELERY_STEPLOCK_REDIS_URL in Django settings)",
                setting="steplock_redis_url")
        return check_url(url)

    def _redis_inputs(self) -> list[Any]:
        """``[url, transport options, TLS options]`` of the lease store, each a value or the
        ImproperlyConfigured it raised, each setting read once. Unset, the options are the
        broker's (``broker_transport_options``, ``broker_use_ssl``) when the lease store
        uses the broker URL; keys the lease store does not use are then dropped."""
        from .clients import check_transport_options, check_use_ssl

        own_url = self.raw("redis_url")
        found: list[Any] = []
        try:
            found.append(self._redis_url(own_url))
        except ImproperlyConfigured as exc:
            found.append(exc)
        url = found[0] if isinstance(found[0], str) else None
        for name, broker_name, check in (
                ("redis_transport_options", "broker_transport_options",
                 lambda value, strict, setting: check_transport_options(
                     value, url, strict=strict, name=setting)),
                ("redis_use_ssl", "broker_use_ssl",
                 lambda value, strict, setting: check_use_ssl(value, strict=strict,
                                                              name=setting))):
            value, strict, setting = self.raw(name), True, setting_name(name)
            if value is None and own_url is None:
                value, strict, setting = self.app.conf.get(broker_name), False, broker_name
            try:
                found.append(check(value, strict, setting))
            except ImproperlyConfigured as exc:
                found.append(exc)
        return found

    def redis_connection(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """``(url, transport options, TLS options)`` of the lease store, validated, each
        setting read once. Raises ImproperlyConfigured naming the first invalid one."""
        found = self._redis_inputs()
        for value in found:
            if isinstance(value, ImproperlyConfigured):
                raise value
        return found[0], found[1], found[2]

    @property
    def redis_transport_options(self) -> dict[str, Any]:
        value = self._redis_inputs()[1]
        if isinstance(value, ImproperlyConfigured):
            raise value
        return value

    @property
    def redis_use_ssl(self) -> dict[str, Any]:
        value = self._redis_inputs()[2]
        if isinstance(value, ImproperlyConfigured):
            raise value
        return value

    @property
    def redis_client_factory(self) -> Any:
        from .clients import check_client_factory

        return check_client_factory(self.raw("redis_client_factory"))

    @property
    def redis_cluster(self) -> bool:
        return check_bool(self.raw("redis_cluster"), "steplock_redis_cluster")

    @property
    def key_prefix(self) -> str:
        prefix = self.raw("key_prefix")
        if not isinstance(prefix, str) or not prefix or any(c in "{}*?[]\\" or c.isspace()
                                                            for c in prefix):
            raise ImproperlyConfigured(
                f"{describe('steplock_key_prefix')} must be a non-empty string without "
                f"braces, glob characters (*?[]\\) or spaces, got {prefix!r}",
                setting="steplock_key_prefix")
        return prefix

    @property
    def default_ttl(self) -> float:
        return check_ttl(self.raw("default_ttl"), "steplock_default_ttl")

    @property
    def renewal_ratio(self) -> float:
        ratio = self.raw("renewal_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) \
                or not 0 < ratio <= MAX_RENEWAL_RATIO:
            raise ImproperlyConfigured(
                f"{describe('steplock_renewal_ratio')} must be a number above 0 and at most "
                f"{MAX_RENEWAL_RATIO} (the renewal interval must leave time for a retry "
                f"before the TTL runs out), got {ratio!r}", setting="steplock_renewal_ratio")
        return float(ratio)

    @property
    def lock_wait(self) -> float:
        return check_seconds(self.raw("lock_wait"), "steplock_lock_wait", allow_zero=True)

    @property
    def max_hold(self) -> float | None:
        return check_seconds(self.raw("max_hold"), "steplock_max_hold", allow_none=True)

    @property
    def on_contended(self) -> str:
        return check_choice(self.raw("on_contended"), "steplock_on_contended", ON_CONTENDED)

    @property
    def on_conflict(self) -> str:
        return check_choice(self.raw("on_conflict"), "steplock_on_conflict", ON_CONFLICT)

    @property
    def on_store_error(self) -> str:
        return check_choice(self.raw("on_store_error"), "steplock_on_store_error",
                            ON_STORE_ERROR)

    @property
    def retry_backoff(self) -> float:
        return check_seconds(self.raw("retry_backoff"), "steplock_retry_backoff")

    @property
    def retry_backoff_max(self) -> float:
        return check_seconds(self.raw("retry_backoff_max"), "steplock_retry_backoff_max")

    @property
    def retry_max(self) -> int | None:
        value = self.raw("retry_max")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 0):
            raise ImproperlyConfigured(
                f"{describe('steplock_retry_max')} must be None or a whole number >= 0, "
                f"got {value!r}", setting="steplock_retry_max")
        return value

    def _field(self, name: str) -> str:
        value = self.raw(name)
        if not isinstance(value, str) or not value.isidentifier():
            raise ImproperlyConfigured(
                f"{describe(setting_name(name))} must be a model field name, got {value!r}",
                setting=setting_name(name))
        return value

    @property
    def status_field(self) -> str:
        return self._field("status_field")

    @property
    def owner_field(self) -> str:
        return self._field("owner_field")

    @property
    def fence_field(self) -> str:
        return self._field("fence_field")

    @property
    def precheck(self) -> bool:
        return check_bool(self.raw("precheck"), "steplock_precheck")

    @property
    def db_deadline(self) -> bool:
        return check_bool(self.raw("db_deadline"), "steplock_db_deadline")

    @property
    def socket_timeout(self) -> float:
        return check_seconds(self.raw("socket_timeout"), "steplock_socket_timeout")

    @property
    def max_waiters(self) -> int:
        value = self.raw("max_waiters")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ImproperlyConfigured(
                f"{describe('steplock_max_waiters')} must be a whole number >= 1, "
                f"got {value!r}", setting="steplock_max_waiters")
        return value

    @property
    def fence_ttl(self) -> float:
        return check_seconds(self.raw("fence_ttl"), "steplock_fence_ttl")

    @property
    def event_log(self) -> bool:
        return check_bool(self.raw("event_log"), "steplock_event_log")

    @property
    def event_retention(self) -> float:
        return check_seconds(self.raw("event_retention"), "steplock_event_retention")

    @property
    def reaper_recover(self) -> dict[str, dict[str, str]]:
        value = self.raw("reaper_recover")
        if not isinstance(value, dict) or not all(
                isinstance(model, str) and isinstance(moves, dict)
                and all(isinstance(a, str) and isinstance(b, str) for a, b in moves.items())
                for model, moves in value.items()):
            raise ImproperlyConfigured(
                f"{describe('steplock_reaper_recover')} must map \"app_label.Model\" to "
                f"{{in-flight status: recovery status}}, got {value!r}",
                setting="steplock_reaper_recover")
        return value

    @property
    def reaper_older_than(self) -> float:
        return check_seconds(self.raw("reaper_older_than"), "steplock_reaper_older_than",
                             allow_zero=True)

    @property
    def step_store(self) -> Any:
        value = self.raw("step_store")
        if not (isinstance(value, str) and value.strip()) and not callable(value):
            raise ImproperlyConfigured(
                f"{describe('steplock_step_store')} must be a qualified name "
                f"(\"package.module:Factory\") or a callable, got {value!r}",
                setting="steplock_step_store")
        return value

    @property
    def step_database(self) -> str | None:
        return check_database(self.raw("step_database"), "steplock_step_database")

    def problems(self) -> list[ImproperlyConfigured]:
        """Every invalid setting, one error each (empty when all are valid)."""
        found = []
        for name in self._read_names():
            try:
                getattr(self, name)
            except ImproperlyConfigured as exc:
                found.append(exc)
        return found

    def validate(self) -> None:
        """Read every setting once, raising ImproperlyConfigured on the first invalid one."""
        for name in self._read_names():
            getattr(self, name)

    def _read_names(self) -> list[str]:
        """The settings the library reads: with a client factory, not those it replaces."""
        try:
            factory = self.redis_client_factory
        except ImproperlyConfigured:
            # A factory was given but is invalid: its own error comes first, and the
            # settings it would replace are not read (their absence is not the problem).
            return ["redis_client_factory"] + [
                name for name in DEFAULTS if name not in (
                    "redis_client_factory", "redis_url", "redis_transport_options",
                    "redis_use_ssl")]
        if factory is None:
            return list(DEFAULTS)
        return [name for name in DEFAULTS
                if name not in ("redis_url", "redis_transport_options", "redis_use_ssl")]
