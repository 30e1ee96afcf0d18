"""Settings: every ``steplock_*`` setting, its default and its validation, in one place.

Settings live on the Celery app's configuration (``app.conf.steplock_default_ttl = 30``); a
Django project that loads its Celery configuration with ``namespace="CELERY"`` sets them as
``CELERY_STEPLOCK_DEFAULT_TTL`` in ``settings.py``. They are read at access time, so a change
to ``app.conf`` takes effect on the next task. An invalid value raises
:class:`~celery_steplock.exceptions.ImproperlyConfigured` naming the setting.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, cast

from . import _django
from ._checks import (  # noqa: F401 - re-exported: the settings' checks and bounds
    MAX_BACKOFF,
    MAX_FENCE_TTL,
    MAX_HOLD,
    MAX_IDEMPOTENCY_TTL,
    MAX_IDENTIFIER_LENGTH,
    MAX_OWNER_LENGTH,
    MAX_PREFIX_LENGTH,
    MAX_REAPER_OLDER_THAN,
    MAX_RECOVER_MODELS,
    MAX_RENEWAL_RATIO,
    MAX_RETRIES,
    MAX_SCAN_COUNT,
    MAX_SECONDS,
    MAX_SECRET_LENGTH,
    MAX_SHOWN,
    MAX_SOCKET_TIMEOUT,
    MAX_TTL,
    MAX_WAIT,
    MAX_WAITERS_LIMIT,
    MIN_FENCE_TTL,
    MIN_IDEMPOTENCY_TTL,
    MIN_RENEWAL_INTERVAL,
    MIN_RENEWAL_RATIO,
    MIN_SECRET_LENGTH,
    MIN_TTL,
    NAME_SECRET_DERIVATION,
    check_bool,
    check_choice,
    check_count,
    check_database,
    check_fence_ttl,
    check_key_prefix,
    check_name_secret,
    check_seconds,
    check_text,
    check_ttl,
    derive_name_secret,
    describe,
    setting_name,
    shown,
)
from .exceptions import MAX_MESSAGE_LENGTH, ImproperlyConfigured  # noqa: F401

# "skip" and "return" end the task with a successful outcome that says so
# (celery_steplock.outcomes); "ignore" is Celery's Ignore (no state stored).
ON_CONTENDED = ("retry", "skip", "ignore", "raise")
ON_CONFLICT = ("return", "ignore", "raise")
ON_STORE_ERROR = ("fail_closed", "fail_open")
IDEMPOTENCY_STORES = ("redis", "database")

#: Every setting with its default. Units are seconds.
DEFAULTS: dict[str, Any] = {
    "redis_url": None,  # None: the broker URL when it is a Redis URL
    # None: the broker's broker_transport_options / broker_use_ssl when redis_url is None
    "redis_transport_options": None,  # {"master_name": ..., "sentinel_kwargs": {...}}
    "redis_use_ssl": None,  # {"ssl_cert_reqs": ..., "ssl_ca_certs": ..., ...}
    "redis_client_factory": None,  # factory(settings) -> redis client, or its qualified name
    "redis_cluster": False,  # True: redis_url names one node of a Redis Cluster
    "key_prefix": "steplock",
    "default_ttl": 30.0,
    "renewal_ratio": 1 / 3,  # renew every ttl * ratio (Redisson's watchdog: ttl / 3)
    "lock_wait": 0.0,
    "max_hold": None,  # None: renew for as long as the task runs
    "on_contended": "retry",
    "on_conflict": "return",
    "on_store_error": "fail_closed",
    "retry_backoff": 1.0,
    "retry_backoff_max": 60.0,
    "retry_max": None,  # None: retry a busy lease or an outage until it clears
    "status_field": "status",
    "owner_field": "lock_owner",
    "fence_field": "lock_fence",
    "precheck": True,
    "db_deadline": True,  # PostgreSQL: bound the CAS's lock wait and idle-before-COMMIT
    "socket_timeout": 5.0,
    "fence_ttl": 7 * 24 * 3600.0,  # lifetime of an idle name's fencing counter
    "max_waiters": 1000,  # callers of one process waiting for leases at once
    "event_log": False,  # Django: write LeaseEvent rows (contrib.django)
    "event_retention": 7 * 24 * 3600.0,
    "reaper_recover": {},  # {"app_label.Model": {"in-flight status": "recovery status"}}
    "reaper_older_than": 0.0,  # seconds a step must have been in flight before recovery
    # The step-store factory (celery_steplock.steps.StepStore), a qualified string.
    "step_store": "celery_steplock.contrib.django.steps:DjangoStepStore",
    "step_database": None,  # None: the step model's write database (Django: the router)
    # The key of default lock names and idempotency keys (HMAC-SHA256); None: derived from
    # Django's SECRET_KEY when Django is configured (see name_secret below), else none.
    "name_secret": None,
    # Idempotency records (celery_steplock.patterns.idempotency).
    "idempotency_store": "redis",  # "redis" | "database" (Django model, Redis as its cache)
    "idempotency_ttl": 24 * 3600.0,  # a completed record's lifetime
    "idempotency_lock_ttl": 600.0,  # a locked record's lifetime (a crashed holder's)
    "idempotency_serializer": "json",  # the kombu serializer of recorded results
    "idempotency_on_store_error": "fail_closed",
    "idempotency_max_result_bytes": 1024 * 1024,  # a larger recorded result is not recorded
    # The circuit breakers' policy when Redis cannot be reached (celery_steplock.patterns.breaker).
    "breaker_on_store_error": "fail_closed",
    # Concurrency limits (celery_steplock.patterns.concurrency): the outage policy, and the longest
    # retry_after (seconds) a denied execution is re-queued past.
    "bulkhead_on_store_error": "fail_closed",
    "bulkhead_retry_after": 0.5,
    # Redis does not answer a cluster-wide rate limit's decision (celery_steplock.patterns.ratelimit)
    "rate_limit_on_store_error": "fail_closed",
}

#: One line per setting of :data:`DEFAULTS` (same keys, without the ``steplock_`` prefix): what
#: it means, its unit. The documentation's settings reference is generated from the two.
DESCRIPTIONS: dict[str, str] = {
    "redis_url": "The lock store's URL: ``redis://``, ``rediss://``, ``unix://`` or "
    "``sentinel://host:port;sentinel://...``. None: the broker URL when it is a "
    "Redis URL.",
    "redis_transport_options": "What a URL cannot say: Sentinel's ``master_name`` "
    "(required), ``sentinel_kwargs``, ``min_other_sentinels``; "
    "``health_check_interval``, ``socket_keepalive``, "
    "``client_name``. None: ``broker_transport_options`` when the "
    "broker URL is used, else ``{}``.",
    "redis_use_ssl": "TLS options as ``broker_use_ssl`` (``ssl_cert_reqs``, ``ssl_ca_certs``, "
    "``ssl_certfile``, ``ssl_keyfile``, any other ``ssl_*`` of redis-py). "
    "None: ``broker_use_ssl`` when the broker URL is used, else ``{}``.",
    "redis_client_factory": "``factory(settings) -> redis.Redis`` or its qualified name, for "
    "any other client setup; replaces the three settings above.",
    "redis_cluster": "True: the URL names one node of a Redis Cluster, the entry point of a "
    "``RedisCluster`` client.",
    "key_prefix": "Key namespace: ``<prefix>:lease:{name}``, ``<prefix>:fence:{name}``.",
    "default_ttl": "Lease TTL, seconds.",
    "renewal_ratio": "The heartbeat renews every ``ttl * ratio`` (0.05 to 0.75; never more "
    "often than every 0.01 s).",
    "lock_wait": "Seconds to wait for a busy lease before it counts as contended.",
    "max_hold": "Seconds after which renewal stops and the lease is lost; None: renew for as "
    "long as the task runs.",
    "on_contended": "A busy lease: ``retry``, ``skip`` (succeed with the skipped outcome), "
    "``ignore`` (Celery ``Ignore``) or ``raise`` (``LockContended``).",
    "on_conflict": "A compare-and-swap that updated no row: ``return`` (succeed with the "
    "duplicate outcome), ``ignore`` (no state update) or ``raise`` "
    "(``TransitionConflict``).",
    "on_store_error": "Redis unreachable: ``fail_closed`` (refuse the body, retry) or "
    "``fail_open`` (run it unlocked).",
    "retry_backoff": "Seconds: the base of the full-jitter retry countdown.",
    "retry_backoff_max": "Seconds: the cap of the full-jitter retry countdown.",
    "retry_max": "Lease retries (busy, outage, lost) before the task fails; None: until it "
    "clears.",
    "status_field": "The step model's status column.",
    "owner_field": "The step model's column of the owner token (left out when the model has "
    "none).",
    "fence_field": "The step model's column of the fencing token (left out when the model has "
    "none).",
    "precheck": "Read the step's status before the body and skip the body when the step "
    "already left ``from_``.",
    "db_deadline": "PostgreSQL: from the compare-and-swap to COMMIT, ``lock_timeout`` and "
    "``idle_in_transaction_session_timeout`` are the lease's remaining "
    "validity.",
    "socket_timeout": "Redis socket timeout, seconds.",
    "fence_ttl": "Seconds an idle name's fencing counter is kept (7 days).",
    "max_waiters": "Callers of one process that may wait (``lock_wait``) at once; one more "
    "fails with ``LockStoreMisconfigured``.",
    "event_log": "Django: write a ``LeaseEvent`` row per lease event.",
    "event_retention": "Seconds of event log kept by ``prune_lease_events`` (7 days).",
    "reaper_recover": '``{"app_label.Model": {"in-flight status": "recovery status"}}``: '
    "the reaper moves steps left in flight by dead owners.",
    "reaper_older_than": "Seconds a step must have been in flight before the reaper recovers it.",
    "step_store": "The step-store factory (:class:`celery_steplock.steps.StepStore`), a "
    "qualified name or a callable.",
    "step_database": "Database alias of the step statements and their transaction; None: the "
    "step model's ``router.db_for_write``.",
    "name_secret": "The key (32 to 4096 characters, the same on every worker) of default lock "
    "names and idempotency keys; None: derived from Django's ``SECRET_KEY`` "
    "when Django is configured.",
    "idempotency_store": 'Where idempotency records live: ``"redis"`` (Redis alone) or '
    '``"database"`` (the ``IdempotencyRecord`` model is the truth, Redis '
    "the cache of completed records).",
    "idempotency_ttl": "Seconds a completed idempotency record is replayed (default 24 h); "
    "``idempotency_ttl`` on a task or decorator overrides it.",
    "idempotency_lock_ttl": "Seconds a ``locked`` idempotency record lives when its holder "
    "dies without finishing: the call can run again after it.",
    "idempotency_serializer": "The kombu serializer name results are recorded with (what a "
    "replay returns).",
    "idempotency_on_store_error": "Idempotency records when the store cannot be reached: "
    "``fail_closed`` (the task is retried) or ``fail_open`` "
    "(the body runs unrecorded).",
    "idempotency_max_result_bytes": "The largest serialized result, in bytes, an idempotency "
    "record keeps (1 KiB to 64 MiB; default 1 MiB): a larger one "
    "is not recorded and the key runs again.",
    "breaker_on_store_error": "Circuit breakers when Redis cannot be reached: ``fail_closed`` "
    "(the call is refused, the task retried) or ``fail_open`` (the "
    "dependency is called).",
    "bulkhead_on_store_error": "Concurrency limits when Redis cannot be reached: "
    "``fail_closed`` (the task is retried) or ``fail_open`` (the "
    "body runs without a slot).",
    "bulkhead_retry_after": "The longest time, in seconds, a task refused by a concurrency "
    "limit is re-queued past (before jitter).",
    "rate_limit_on_store_error": "Cluster-wide rate limits when Redis cannot be reached: "
    "``fail_closed`` (the task is retried) or ``fail_open`` (the "
    "call is allowed).",
}

# -- bounds ------------------------------------------------------------------------------------
#: Django's SECRET_KEY, or None (see :func:`celery_steplock._django.secret_key`).
django_secret_key = _django.secret_key


# app -> (conf, its maps, Django settings version, copy of conf.changes, values, memo)
_snapshots: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()
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
    _django.watch_settings(_django_setting_changed, dispatch_uid="celery_steplock.conf")


def _shared_snapshot(app: Any) -> tuple[dict[str, Any], dict[Any, Any]]:
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
    if (
        cached is not None
        and cached[0] is conf
        and cached[2] == _django_version[0]
        and len(cached[1]) == len(maps)
        and all(a is b for a, b in zip(cached[1], maps))
        and cached[3] == changes
    ):
        return cached[4], cached[5]
    values: dict[str, Any] = {}
    memo: dict[Any, Any] = {}
    with _snapshots_guard:
        _snapshots[app] = (conf, list(maps), _django_version[0], dict(changes), values, memo)
    return values, memo


def configuration_version(app: Any) -> Any:
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

    def __init__(self, app: Any, snapshot: bool = False) -> None:
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
                setting="steplock_redis_url",
            )
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
        checks: tuple[tuple[str, str, Callable[[Any, bool, str], Any]], ...] = (
            (
                "redis_transport_options",
                "broker_transport_options",
                lambda value, strict, setting: check_transport_options(
                    value, url, strict=strict, name=setting
                ),
            ),
            (
                "redis_use_ssl",
                "broker_use_ssl",
                lambda value, strict, setting: check_use_ssl(value, strict=strict, name=setting),
            ),
        )
        for name, broker_name, check in checks:
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
        return cast(dict[str, Any], value)

    @property
    def redis_use_ssl(self) -> dict[str, Any]:
        value = self._redis_inputs()[2]
        if isinstance(value, ImproperlyConfigured):
            raise value
        return cast(dict[str, Any], value)

    @property
    def redis_client_factory(self) -> Any:
        from .clients import check_client_factory

        return check_client_factory(self.raw("redis_client_factory"))

    @property
    def redis_cluster(self) -> bool:
        return check_bool(self.raw("redis_cluster"), "steplock_redis_cluster")

    @property
    def key_prefix(self) -> str:
        return check_key_prefix(self.raw("key_prefix"))

    @property
    def default_ttl(self) -> float:
        return check_ttl(self.raw("default_ttl"), "steplock_default_ttl")

    @property
    def renewal_ratio(self) -> float:
        ratio = self.raw("renewal_ratio")
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not MIN_RENEWAL_RATIO <= ratio <= MAX_RENEWAL_RATIO
        ):
            raise ImproperlyConfigured(
                f"{describe('steplock_renewal_ratio')} must be a number between "
                f"{MIN_RENEWAL_RATIO} and "
                f"{MAX_RENEWAL_RATIO} (the renewal interval must leave time for a retry "
                f"before the TTL runs out), got {shown(ratio)}",
                setting="steplock_renewal_ratio",
            )
        return float(ratio)

    @property
    def lock_wait(self) -> float:
        return check_seconds(
            self.raw("lock_wait"), "steplock_lock_wait", allow_zero=True, maximum=MAX_WAIT
        )

    @property
    def max_hold(self) -> float | None:
        return check_seconds(
            self.raw("max_hold"), "steplock_max_hold", allow_none=True, maximum=MAX_HOLD
        )

    @property
    def on_contended(self) -> str:
        return check_choice(self.raw("on_contended"), "steplock_on_contended", ON_CONTENDED)

    @property
    def on_conflict(self) -> str:
        return check_choice(self.raw("on_conflict"), "steplock_on_conflict", ON_CONFLICT)

    @property
    def on_store_error(self) -> str:
        return check_choice(self.raw("on_store_error"), "steplock_on_store_error", ON_STORE_ERROR)

    @property
    def rate_limit_on_store_error(self) -> str:
        return check_choice(
            self.raw("rate_limit_on_store_error"),
            "steplock_rate_limit_on_store_error",
            ON_STORE_ERROR,
        )

    @property
    def retry_backoff(self) -> float:
        return check_seconds(
            self.raw("retry_backoff"), "steplock_retry_backoff", maximum=MAX_BACKOFF
        )

    @property
    def retry_backoff_max(self) -> float:
        return check_seconds(
            self.raw("retry_backoff_max"), "steplock_retry_backoff_max", maximum=MAX_BACKOFF
        )

    @property
    def retry_max(self) -> int | None:
        return check_count(
            self.raw("retry_max"), "steplock_retry_max", maximum=MAX_RETRIES, allow_none=True
        )

    def _field(self, name: str) -> str:
        value = self.raw(name)
        if (
            not isinstance(value, str)
            or not value.isidentifier()
            or len(value) > MAX_IDENTIFIER_LENGTH
        ):
            raise ImproperlyConfigured(
                f"{describe(setting_name(name))} must be a model field name, got {shown(value)}",
                setting=setting_name(name),
            )
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
        return check_seconds(
            self.raw("socket_timeout"), "steplock_socket_timeout", maximum=MAX_SOCKET_TIMEOUT
        )

    @property
    def max_waiters(self) -> int:
        return check_count(
            self.raw("max_waiters"), "steplock_max_waiters", minimum=1, maximum=MAX_WAITERS_LIMIT
        )

    @property
    def fence_ttl(self) -> float:
        return check_fence_ttl(self.raw("fence_ttl"), "steplock_fence_ttl")

    @property
    def event_log(self) -> bool:
        return check_bool(self.raw("event_log"), "steplock_event_log")

    @property
    def event_retention(self) -> float:
        return check_seconds(self.raw("event_retention"), "steplock_event_retention")

    @property
    def name_secret(self) -> bytes | None:
        """The HMAC-SHA256 key of default lock names and idempotency keys: the bytes of
        ``steplock_name_secret`` when set; else, under a configured Django, the key derived
        from ``SECRET_KEY`` (:func:`derive_name_secret`); else None (names are then made with
        a public key: anyone can recompute them)."""
        value = self.raw("name_secret")
        if value is not None:
            return check_name_secret(value)
        secret_key = django_secret_key()
        return None if secret_key is None else derive_name_secret(secret_key)

    @property
    def reaper_recover(self) -> dict[str, dict[str, str]]:
        value = self.raw("reaper_recover")
        if (
            not isinstance(value, dict)
            or len(value) > MAX_RECOVER_MODELS
            or not all(
                isinstance(model, str)
                and isinstance(moves, dict)
                and len(model) <= MAX_IDENTIFIER_LENGTH
                and len(moves) <= MAX_RECOVER_MODELS
                and all(
                    isinstance(a, str)
                    and isinstance(b, str)
                    and len(a) <= MAX_IDENTIFIER_LENGTH
                    and len(b) <= MAX_IDENTIFIER_LENGTH
                    for a, b in moves.items()
                )
                for model, moves in value.items()
            )
        ):
            raise ImproperlyConfigured(
                f'{describe("steplock_reaper_recover")} must map "app_label.Model" to '
                f"{{in-flight status: recovery status}}, got {shown(value)}",
                setting="steplock_reaper_recover",
            )
        return value

    @property
    def reaper_older_than(self) -> float:
        return check_seconds(
            self.raw("reaper_older_than"),
            "steplock_reaper_older_than",
            allow_zero=True,
            maximum=MAX_REAPER_OLDER_THAN,
        )

    @property
    def step_store(self) -> Any:
        value = self.raw("step_store")
        if not (
            isinstance(value, str) and value.strip() and len(value) <= MAX_IDENTIFIER_LENGTH
        ) and not callable(value):
            raise ImproperlyConfigured(
                f"{describe('steplock_step_store')} must be a qualified name "
                f'("package.module:Factory") or a callable, got {shown(value)}',
                setting="steplock_step_store",
            )
        return value

    @property
    def step_database(self) -> str | None:
        return check_database(self.raw("step_database"), "steplock_step_database")

    @property
    def idempotency_store(self) -> str:
        return check_choice(
            self.raw("idempotency_store"), "steplock_idempotency_store", IDEMPOTENCY_STORES
        )

    @property
    def idempotency_ttl(self) -> float:
        return check_seconds(
            self.raw("idempotency_ttl"),
            "steplock_idempotency_ttl",
            minimum=MIN_IDEMPOTENCY_TTL,
            maximum=MAX_IDEMPOTENCY_TTL,
        )

    @property
    def idempotency_lock_ttl(self) -> float:
        return check_seconds(
            self.raw("idempotency_lock_ttl"),
            "steplock_idempotency_lock_ttl",
            minimum=MIN_IDEMPOTENCY_TTL,
            maximum=MAX_IDEMPOTENCY_TTL,
        )

    @property
    def idempotency_serializer(self) -> str:
        value = check_text(
            self.raw("idempotency_serializer"),
            "steplock_idempotency_serializer",
            what="a kombu serializer name",
        )
        from kombu.serialization import registry  # type: ignore[attr-defined]  # not in the stubs

        if value not in registry._encoders:
            raise ImproperlyConfigured(
                f"{describe('steplock_idempotency_serializer')} must name a registered kombu "
                f"serializer ({', '.join(sorted(registry._encoders))}), got {shown(value)}",
                setting="steplock_idempotency_serializer",
            )
        return value

    @property
    def idempotency_max_result_bytes(self) -> int:
        return check_count(
            self.raw("idempotency_max_result_bytes"),
            "steplock_idempotency_max_result_bytes",
            minimum=1024,
            maximum=64 * 1024 * 1024,
        )

    @property
    def idempotency_on_store_error(self) -> str:
        return check_choice(
            self.raw("idempotency_on_store_error"),
            "steplock_idempotency_on_store_error",
            ON_STORE_ERROR,
        )

    @property
    def breaker_on_store_error(self) -> str:
        return check_choice(
            self.raw("breaker_on_store_error"), "steplock_breaker_on_store_error", ON_STORE_ERROR
        )

    @property
    def bulkhead_on_store_error(self) -> str:
        return check_choice(
            self.raw("bulkhead_on_store_error"), "steplock_bulkhead_on_store_error", ON_STORE_ERROR
        )

    @property
    def bulkhead_retry_after(self) -> float:
        return check_seconds(
            self.raw("bulkhead_retry_after"),
            "steplock_bulkhead_retry_after",
            minimum=0.05,
            maximum=3600.0,
        )

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
                name
                for name in DEFAULTS
                if name
                not in (
                    "redis_client_factory",
                    "redis_url",
                    "redis_transport_options",
                    "redis_use_ssl",
                )
            ]
        if factory is None:
            return list(DEFAULTS)
        return [
            name
            for name in DEFAULTS
            if name not in ("redis_url", "redis_transport_options", "redis_use_ssl")
        ]
