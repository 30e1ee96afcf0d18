"""Settings: every ``steplock_*`` setting in one table, read and validated through
:class:`Settings`.

Settings live on the Celery app's configuration (``app.conf.steplock_default_ttl = 30``); a
Django project that loads its Celery configuration with ``namespace="CELERY"`` sets them as
``CELERY_STEPLOCK_DEFAULT_TTL`` in ``settings.py``. They are read at access time, so a change
to ``app.conf`` takes effect on the next task. An invalid value raises
:class:`~celery_steplock.exceptions.ImproperlyConfigured` naming the setting.

:data:`SETTINGS` declares each setting once (name, default, check, description, unit), the
way Celery's ``celery/app/defaults.py`` declares its own; :data:`DEFAULTS`,
:data:`DESCRIPTIONS`, the attributes of :class:`Settings`, :meth:`Settings.problems` (worker
start, ``manage.py check``) and the generated settings reference (``docs/_ext``) all read it.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast

from . import _django
from ._checks import (  # noqa: F401 - re-exported: the settings' checks and bounds
    MAX_ACTIVITY_FLUSH_INTERVAL,
    MAX_BACKOFF,
    MAX_FENCE_TTL,
    MAX_HISTORY_MAX_AGE,
    MAX_HISTORY_MAX_ENTRIES,
    MAX_HOLD,
    MAX_IDEMPOTENCY_MAX_RECORDS,
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
    MIN_ACTIVITY_FLUSH_INTERVAL,
    MIN_FENCE_TTL,
    MIN_HISTORY_MAX_AGE,
    MIN_HISTORY_MAX_ENTRIES,
    MIN_IDEMPOTENCY_MAX_RECORDS,
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
from .clients import (
    URL_SCHEMES,
    check_client_factory,
    check_transport_options,
    check_url,
    check_use_ssl,
)
from .exceptions import MAX_MESSAGE_LENGTH, ImproperlyConfigured  # noqa: F401

# "skip" and "return" end the task with a successful outcome that says so
# (celery_steplock.outcomes; "return_winner": the winner's stored result when there is one);
# "ignore" is Celery's Ignore (no state stored).
ON_CONTENDED = ("retry", "skip", "ignore", "raise")
ON_CONFLICT = ("return", "return_winner", "ignore", "raise")
ON_STORE_ERROR = ("fail_closed", "fail_open")
#: The overlap guard of periodic runs (task option ``overlap``; None: off).
OVERLAP = ("skip", "coalesce", "queue")
IDEMPOTENCY_STORES = ("redis", "database")

#: A setting's check: ``check(value, qualified setting name)`` returns the value as the
#: library uses it, or raises ImproperlyConfigured naming that setting.
Check = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Setting:
    """One ``steplock_*`` setting, declared once.

    Attributes:
        name: The name without the ``steplock_`` prefix (``"default_ttl"``).
        default: The value when the setting is unset (None on ``app.conf`` counts as unset).
        check: ``check(value, qualified name) -> value``: the value as the library uses it;
            raises ImproperlyConfigured naming the setting. The rule of the value alone: a
            setting judged against another (the transport options against the URL) adds
            that in its :class:`Settings` property.
        description: What it means, for the settings reference (sentences, MyST inline
            markup).
        unit: ``"seconds"``, ``"count"``, ``"bytes"``, ``"ratio"`` or None (not a number).
        renamed_from: Former names (without the prefix), still read for one release when
            this one is unset; the validator warns about them (``celery_steplock.W006``).
    """

    name: str
    default: Any
    check: Check = field(repr=False)
    description: str = field(repr=False)
    unit: str | None = None
    renamed_from: tuple[str, ...] = ()
    #: ``"steplock_" + name``: what app.conf is read under and errors are named by.
    qualified: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "qualified", setting_name(self.name))


# -- checks of the table's settings -------------------------------------------------------------


def _seconds(**bounds: Any) -> Check:
    """:func:`check_seconds` with ``bounds``."""

    def check(value: Any, name: str) -> Any:  # float, or None with allow_none
        return check_seconds(value, name, **bounds)

    return check


def _count(**bounds: Any) -> Check:
    """:func:`check_count` with ``bounds``."""

    def check(value: Any, name: str) -> Any:  # int, or None with allow_none
        return check_count(value, name, **bounds)

    return check


def _choice(choices: tuple[str, ...]) -> Check:
    """:func:`check_choice` among ``choices``."""

    def check(value: Any, name: str) -> str:
        return check_choice(value, name, choices)

    return check


def _check_renewal_ratio(value: Any, name: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_RENEWAL_RATIO <= value <= MAX_RENEWAL_RATIO
    ):
        raise ImproperlyConfigured(
            f"{describe(name)} must be a number between {MIN_RENEWAL_RATIO} and "
            f"{MAX_RENEWAL_RATIO} (the renewal interval must leave time for a retry "
            f"before the TTL runs out), got {shown(value)}",
            setting=name,
        )
    return float(value)


def _check_field(value: Any, name: str) -> str:
    if (
        not isinstance(value, str)
        or not value.isidentifier()
        or len(value) > MAX_IDENTIFIER_LENGTH
    ):
        raise ImproperlyConfigured(
            f"{describe(name)} must be a model field name, got {shown(value)}", setting=name
        )
    return value


def _check_reaper_recover(value: Any, name: str) -> dict[str, dict[str, str]]:
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
            f'{describe(name)} must map "app_label.Model" to '
            f"{{in-flight status: recovery status}}, got {shown(value)}",
            setting=name,
        )
    return value


def _check_step_store(value: Any, name: str) -> Any:
    if not (
        isinstance(value, str) and value.strip() and len(value) <= MAX_IDENTIFIER_LENGTH
    ) and not callable(value):
        raise ImproperlyConfigured(
            f"{describe(name)} must be a qualified name "
            f'("package.module:Factory") or a callable, got {shown(value)}',
            setting=name,
        )
    return value


def _check_serializer(value: Any, name: str) -> str:
    text = check_text(value, name, what="a kombu serializer name")
    from kombu.serialization import registry  # type: ignore[attr-defined]  # not in the stubs

    if text not in registry._encoders:
        raise ImproperlyConfigured(
            f"{describe(name)} must name a registered kombu "
            f"serializer ({', '.join(sorted(registry._encoders))}), got {shown(text)}",
            setting=name,
        )
    return text


def _check_transport_options(value: Any, name: str) -> dict[str, Any]:
    return check_transport_options(value, None, name=name)


def _check_use_ssl(value: Any, name: str) -> dict[str, Any]:
    return check_use_ssl(value, name=name)


_ON_STORE_ERROR = _choice(ON_STORE_ERROR)


def _overlap(value: Any, name: str) -> str | None:
    """None (the guard off) or one of :data:`OVERLAP`."""
    return None if value is None else check_choice(value, name, OVERLAP)


_WEEK = 7 * 24 * 3600.0

#: Every setting, in the order of the reference. Units are seconds.
SETTINGS: tuple[Setting, ...] = (
    Setting(
        "redis_url",
        None,  # the broker URL when it is a Redis URL (Settings.redis_url)
        check_url,
        "The lock store's URL: ``redis://``, ``rediss://``, ``unix://`` or "
        "``sentinel://host:port;sentinel://...``. None: the broker URL when it is a Redis URL.",
    ),
    Setting(
        "redis_transport_options",
        None,  # the broker's broker_transport_options when redis_url is None
        _check_transport_options,
        "What a URL cannot say: Sentinel's ``master_name`` (required), ``sentinel_kwargs``, "
        "``min_other_sentinels``; ``health_check_interval``, ``socket_keepalive``, "
        "``client_name``. None: ``broker_transport_options`` when the broker URL is used, else "
        "``{}``.",
    ),
    Setting(
        "redis_use_ssl",
        None,  # the broker's broker_use_ssl when redis_url is None
        _check_use_ssl,
        "TLS options as ``broker_use_ssl`` (``ssl_cert_reqs``, ``ssl_ca_certs``, "
        "``ssl_certfile``, ``ssl_keyfile``, any other ``ssl_*`` of redis-py). None: "
        "``broker_use_ssl`` when the broker URL is used, else ``{}``.",
    ),
    Setting(
        "redis_client_factory",
        None,
        check_client_factory,
        "``factory(settings) -> redis.Redis`` or its qualified name, for any other client setup; "
        "replaces the three settings above.",
    ),
    Setting(
        "redis_cluster",
        False,
        check_bool,
        "True: the URL names one node of a Redis Cluster, the entry point of a ``RedisCluster`` "
        "client.",
    ),
    Setting(
        "key_prefix",
        "steplock",
        check_key_prefix,
        "Key namespace: ``<prefix>:lease:{name}``, ``<prefix>:fence:{name}``.",
    ),
    Setting("default_ttl", 30.0, check_ttl, "Lease TTL, seconds.", "seconds"),
    Setting(
        "renewal_ratio",
        1 / 3,  # Redisson's watchdog renews at ttl / 3
        _check_renewal_ratio,
        "The heartbeat renews every ``ttl * ratio`` (0.05 to 0.75; never more often than every "
        "0.01 s).",
        "ratio",
    ),
    Setting(
        "lock_wait",
        0.0,
        _seconds(allow_zero=True, maximum=MAX_WAIT),
        "Seconds to wait for a busy lease before it counts as contended.",
        "seconds",
    ),
    Setting(
        "max_hold",
        None,
        _seconds(allow_none=True, maximum=MAX_HOLD),
        "Seconds after which renewal stops and the lease is lost; None: renew for as long as the "
        "task runs.",
        "seconds",
    ),
    Setting(
        "on_contended",
        "retry",
        _choice(ON_CONTENDED),
        "A busy lease: ``retry``, ``skip`` (succeed with the skipped outcome), ``ignore`` "
        "(Celery ``Ignore``) or ``raise`` (``LockContended``).",
    ),
    Setting(
        "overlap",
        None,
        _overlap,
        "The overlap guard of tasks that leave ``overlap`` unset (periodic runs that never "
        "overlap): None (off), ``skip`` (a send finding the lease held ends skipped), "
        "``coalesce`` (at most one more run after the current one) or ``queue`` (waits its "
        "turn). A task's own ``on_contended`` or ``lock_wait`` wins over it.",
    ),
    Setting(
        "on_conflict",
        "return",
        _choice(ON_CONFLICT),
        "A compare-and-swap that updated no row: ``return`` (succeed with the duplicate "
        "outcome), ``return_winner`` (succeed with the winner's stored result, else the "
        "duplicate outcome), ``ignore`` (no state update) or ``raise`` "
        "(``TransitionConflict``).",
    ),
    Setting(
        "on_store_error",
        "fail_closed",
        _ON_STORE_ERROR,
        "Redis unreachable: ``fail_closed`` (refuse the body, retry) or ``fail_open`` (run it "
        "unlocked).",
    ),
    Setting(
        "retry_backoff",
        1.0,
        _seconds(maximum=MAX_BACKOFF),
        "Seconds: the base of the full-jitter retry countdown.",
        "seconds",
    ),
    Setting(
        "retry_backoff_max",
        60.0,
        _seconds(maximum=MAX_BACKOFF),
        "Seconds: the cap of the full-jitter retry countdown.",
        "seconds",
    ),
    Setting(
        "retry_max",
        None,  # retry a busy lease or an outage until it clears
        _count(maximum=MAX_RETRIES, allow_none=True),
        "Lease retries (busy, outage, lost) before the task fails; None: until it clears.",
        "count",
    ),
    Setting(
        "broker_consumer_timeout",
        1800.0,  # RabbitMQ's default consumer_timeout (30 minutes)
        _seconds(allow_zero=True, maximum=MAX_SECONDS),
        "Seconds: the AMQP broker's ``consumer_timeout`` (RabbitMQ's ``rabbitmq.conf``, "
        "milliseconds there), which a client cannot read from the server; set it to match. "
        "RabbitMQ closes the channel of a delivery unacknowledged that long and redelivers "
        "it, so the checks (``celery_steplock.W004``) warn about countdowns, ``max_hold``, "
        "``lock_wait`` and time limits not below it. 0: the server has no timeout. Read only "
        "with an ``amqp://``, ``amqps://``, ``pyamqp://`` or ``librabbitmq://`` broker.",
        "seconds",
    ),
    Setting("status_field", "status", _check_field, "The step model's status column."),
    Setting(
        "owner_field",
        "lock_owner",
        _check_field,
        "The step model's column of the owner token (left out when the model has none).",
    ),
    Setting(
        "fence_field",
        "lock_fence",
        _check_field,
        "The step model's column of the fencing token (left out when the model has none).",
    ),
    Setting(
        "precheck",
        True,
        check_bool,
        "Read the step's status before the body and skip the body when the step already left "
        "``from_``.",
    ),
    Setting(
        "db_deadline",
        True,
        check_bool,
        "PostgreSQL: from the compare-and-swap to COMMIT, ``lock_timeout`` and "
        "``idle_in_transaction_session_timeout`` are the lease's remaining validity.",
    ),
    Setting(
        "socket_timeout",
        5.0,
        _seconds(maximum=MAX_SOCKET_TIMEOUT),
        "Redis socket timeout, seconds.",
        "seconds",
    ),
    Setting(
        "release_wait",
        False,
        check_bool,
        "Wait for the reply of a worker task's release after COMMIT. Safety is the same "
        "either way: the commit came first, and a release that never arrives leaves the "
        "lease to its TTL. Off (the default) saves one blocking round trip per task: the "
        "release is written on a connection of its own (Redis deletes the lease and wakes a "
        "waiter as it reads it) and its reply is read about 10 ms later by a background "
        "thread, the next release or a warm shutdown, so ``lock_released`` and "
        "``release_failed`` are sent from that thread, after the task returned. Turn it on "
        "when a ``lock_released`` receiver must run in the task's thread before it returns. "
        "Eager and direct calls, a cluster, TLS, Sentinel, a client factory's own pool and "
        "green pools always wait.",
    ),
    Setting(
        "fence_ttl",
        _WEEK,
        check_fence_ttl,
        "Seconds an idle name's fencing counter is kept (7 days).",
        "seconds",
    ),
    Setting(
        "max_waiters",
        1000,
        _count(minimum=1, maximum=MAX_WAITERS_LIMIT),
        "Callers of one process that may wait (``lock_wait``) at once; one more fails with "
        "``LockStoreMisconfigured``. Waiters that must share the store's pool (a client "
        "factory's own pool) are capped at its ``max_connections`` minus a reserve of a quarter "
        "of them (at least 8).",
        "count",
    ),
    Setting(
        "history",
        True,
        check_bool,
        "Keep each lock name's history (acquired, contended, released with the execution's "
        "outcome, forced, reaped, lost) in a capped Redis list, written by the lease scripts "
        "in the same call (``celery steplock history NAME``, the admin's timeline). False: "
        "nothing written.",
    ),
    Setting(
        "history_max_entries",
        100,
        _count(minimum=MIN_HISTORY_MAX_ENTRIES, maximum=MAX_HISTORY_MAX_ENTRIES),
        "Entries of history kept per lock name (1 to 100,000).",
        "count",
    ),
    Setting(
        "history_max_age",
        _WEEK,
        _seconds(minimum=MIN_HISTORY_MAX_AGE, maximum=MAX_HISTORY_MAX_AGE),
        "Seconds a lock name's history lives after its last event, and beyond which its "
        "entries are not shown (7 days).",
        "seconds",
    ),
    Setting(
        "activity",
        False,
        check_bool,
        "Django: count lease and pattern events per minute in each process (executions, wait "
        "and hold histograms, contention, conflicts, duplicates per task; rate limits' "
        "decisions; breakers' state changes) and write them to Redis every flush interval, "
        "one pipelined round trip, kept two hours: the admin's Activity page draws them "
        "(``celery_steplock.activity``). The Redis user needs ``HINCRBY`` and ``PEXPIRE`` "
        "on ``<prefix>:activity:*``.",
    ),
    Setting(
        "activity_flush_interval",
        10.0,
        _seconds(minimum=MIN_ACTIVITY_FLUSH_INTERVAL, maximum=MAX_ACTIVITY_FLUSH_INTERVAL),
        "Seconds between a process's writes of its activity counts (1 to 60; default 10).",
        "seconds",
    ),
    Setting(
        "event_log",
        False,
        check_bool,
        "Django: write a ``LeaseEvent`` row per lease event.",
    ),
    Setting(
        "event_retention",
        _WEEK,
        _seconds(),
        "Seconds of event log kept by ``prune_lease_events`` (7 days).",
        "seconds",
    ),
    Setting(
        "reaper_recover",
        {},
        _check_reaper_recover,
        '``{"app_label.Model": {"in-flight status": "recovery status"}}``: the reaper moves '
        "steps left in flight by dead owners.",
    ),
    Setting(
        "reaper_older_than",
        0.0,
        _seconds(allow_zero=True, maximum=MAX_REAPER_OLDER_THAN),
        "Seconds a step must have been in flight before the reaper recovers it.",
        "seconds",
    ),
    Setting(
        "step_store",
        "celery_steplock.contrib.django.steps:DjangoStepStore",
        _check_step_store,
        "The step-store factory (:class:`celery_steplock.steps.StepStore`), a qualified name or "
        "a callable.",
    ),
    Setting(
        "step_database",
        None,  # the step model's write database (Django: the router)
        check_database,
        "Database alias of the step statements and their transaction; None: the step model's "
        "``router.db_for_write``.",
    ),
    Setting(
        "name_secret",
        None,  # derived from Django's SECRET_KEY when Django is configured (Settings.name_secret)
        check_name_secret,
        "The key (32 to 4096 characters, the same on every worker) of default lock names and "
        "idempotency keys; None: derived from Django's ``SECRET_KEY`` when Django is configured.",
    ),
    # Idempotency records (celery_steplock.patterns.idempotency).
    Setting(
        "idempotency_store",
        "redis",
        _choice(IDEMPOTENCY_STORES),
        'Where idempotency records live: ``"redis"`` (Redis alone) or ``"database"`` (the '
        "``IdempotencyRecord`` model is the truth, Redis the cache of completed records).",
    ),
    Setting(
        "idempotency_ttl",
        24 * 3600.0,
        _seconds(minimum=MIN_IDEMPOTENCY_TTL, maximum=MAX_IDEMPOTENCY_TTL),
        "Seconds a completed idempotency record is replayed (default 24 h; 0.1 s to 366 days); "
        "``idempotency_ttl`` on a task or decorator overrides it.",
        "seconds",
    ),
    Setting(
        "idempotency_lock_ttl",
        600.0,
        _seconds(minimum=MIN_IDEMPOTENCY_TTL, maximum=MAX_IDEMPOTENCY_TTL),
        "Seconds a ``locked`` idempotency record lives when its holder dies without finishing: "
        "the call can run again after it. A running body's record is renewed by its "
        "process's heartbeat (every lock TTL * ``steplock_renewal_ratio``), so this bounds "
        "how long a dead holder blocks its key, not how long a body may run.",
        "seconds",
    ),
    Setting(
        "idempotency_serializer",
        "json",
        _check_serializer,
        "The kombu serializer name results are recorded with (what a replay returns).",
    ),
    Setting(
        "idempotency_on_store_error",
        "fail_closed",
        _ON_STORE_ERROR,
        "Idempotency records when the store cannot be reached: ``fail_closed`` (the task is "
        "retried) or ``fail_open`` (the body runs unrecorded).",
    ),
    Setting(
        "idempotency_max_result_bytes",
        1024 * 1024,
        _count(minimum=1024, maximum=64 * 1024 * 1024),
        "The largest serialized result, in bytes, an idempotency record keeps (1 KiB to 64 MiB; "
        "default 1 MiB): a larger one is not recorded and the key runs again.",
        "bytes",
    ),
    Setting(
        "idempotency_max_records",
        10_000,
        _count(minimum=MIN_IDEMPOTENCY_MAX_RECORDS, maximum=MAX_IDEMPOTENCY_MAX_RECORDS),
        "The live records one principal (per host) of the HTTP ``Idempotency-Key`` layer may "
        "hold (1 to 1,000,000; default 10,000): a request with a new key beyond it is refused "
        "with 429 before the view runs. ``max_records=`` on a view or the middleware "
        "overrides it; the anonymous scope is one principal.",
        "count",
    ),
    Setting(
        "breaker_on_store_error",
        "fail_closed",
        _ON_STORE_ERROR,
        "Circuit breakers when Redis cannot be reached: ``fail_closed`` (the call is refused, "
        "the task retried) or ``fail_open`` (the dependency is called).",
    ),
    Setting(
        "breaker_state_cache",
        1.0,
        _seconds(allow_zero=True, maximum=60.0),
        "How long, in seconds, a process trusts its cached copy of a circuit breaker's state "
        "(0 to 60; default 1.0; 0: every call asks Redis). While it holds, a closed breaker's "
        "successful call sends nothing (successes are counted locally and written at the next "
        "refresh, failures at once) and an open one refuses without a round trip; a trip, "
        "a probe's outcome or an operator's override on another worker is seen within it, so "
        "after another worker trips the breaker each process may still call the dependency "
        "for up to this long (its call rate times this many calls). Half-open probes always "
        "ask Redis. ``CircuitBreaker(state_cache=)`` overrides it.",
        "seconds",
    ),
    Setting(
        "concurrency_limit_on_store_error",
        "fail_closed",
        _ON_STORE_ERROR,
        "Concurrency limits when Redis cannot be reached: ``fail_closed`` (the task is retried) "
        "or ``fail_open`` (the body runs without a slot).",
        renamed_from=("bulkhead_on_store_error",),
    ),
    Setting(
        "concurrency_limit_retry_after",
        0.5,
        _seconds(minimum=0.05, maximum=3600.0),
        "The longest time, in seconds, a task refused by a concurrency limit is re-queued past "
        "(before jitter; 0.05 to 3600).",
        "seconds",
        renamed_from=("bulkhead_retry_after",),
    ),
    Setting(
        "rate_limit_on_store_error",
        "fail_closed",
        _ON_STORE_ERROR,
        "Cluster-wide rate limits when Redis cannot be reached: ``fail_closed`` (the task is "
        "retried) or ``fail_open`` (the call is allowed); a limit's own ``on_store_error=`` wins.",
    ),
    # The effects outbox (celery_steplock.effects, celery_steplock.contrib.django.outbox).
    Setting(
        "effect_max_attempts",
        10,
        _count(minimum=1, maximum=MAX_RETRIES),
        "Dispatch attempts of one effect of the outbox before it is marked ``dead`` (an "
        "operator may retry it); a permanent refusal (an HTTP 4xx other than 408, 409, 425, "
        "429; ``NonRetryable``) is dead at once.",
        "count",
    ),
    Setting(
        "effect_relay_delay",
        10.0,
        _seconds(allow_zero=True, maximum=MAX_SECONDS),
        "Seconds the periodic relay leaves a freshly written effect to the process that "
        "committed it (which dispatches it on commit) before taking it over.",
        "seconds",
    ),
    Setting(
        "effect_claim_timeout",
        60.0,
        _seconds(maximum=MAX_SECONDS),
        "Seconds a relay's claim of an effect holds: a relay that died while dispatching it "
        "leaves it to another after this.",
        "seconds",
    ),
    Setting(
        "effect_http_timeout",
        10.0,
        _seconds(maximum=MAX_SECONDS),
        "Seconds an ``http`` effect's request may take (connect and each read) unless the "
        "effect names its own ``timeout``; a timeout is retried.",
        "seconds",
    ),
)

#: Every setting with its default (same keys as :data:`SETTINGS`, without the ``steplock_``
#: prefix). Units are seconds.
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}

#: One line per setting of :data:`DEFAULTS`: what it means, its unit.
DESCRIPTIONS: dict[str, str] = {s.name: s.description for s in SETTINGS}

#: Deprecated setting names (without the prefix) -> the name that replaced them; the old name
#: is read when the new one is unset, for one release (``celery_steplock.W006`` warns).
RENAMED: dict[str, str] = {old: s.name for s in SETTINGS for old in s.renamed_from}

_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
_BY_NAME.update({old: _BY_NAME[new] for old, new in RENAMED.items()})

#: The settings a client factory replaces (not read while one is set).
_REPLACED_BY_FACTORY = ("redis_url", "redis_transport_options", "redis_use_ssl")

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


class _Read:
    """The :class:`Settings` attribute of a setting without logic of its own: its value on
    ``app.conf``, checked on every access (read-only, like a property)."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.__doc__ = setting.description

    def __get__(self, obj: Settings | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value, name = obj._read(self.setting)
        return self.setting.check(value, name)

    def __set__(self, obj: Settings, value: Any) -> NoReturn:
        raise AttributeError(
            f"{self.setting.name} is read from app.conf.{self.setting.qualified}: set it there"
        )


_S = TypeVar("_S", bound=type)


def _from_table(cls: _S) -> _S:
    """Give ``cls`` a :class:`_Read` attribute per setting of :data:`SETTINGS` it does not
    define itself. Each must be annotated with its type in the class body (what a type
    checker sees), and each annotation must be a setting: a setting added to the table
    without its attribute fails at import."""
    annotations = set(inspect.get_annotations(cls))
    defined = {s.name for s in SETTINGS if s.name in vars(cls)}
    wanted = set(_BY_NAME) - set(RENAMED) - defined
    if annotations != wanted:
        raise TypeError(
            f"Settings: annotate exactly the settings without a property of their own: "
            f"missing {sorted(wanted - annotations)}, not settings {sorted(annotations - wanted)}"
        )
    for name in sorted(wanted):
        setattr(cls, name, _Read(_BY_NAME[name]))
    return cls


@_from_table
class Settings:
    """The ``steplock_*`` settings of one Celery app, validated on access.

    ``Settings(app).default_ttl`` reads ``app.conf.steplock_default_ttl`` (default 30.0):
    one attribute per setting of :data:`SETTINGS`, checked by the setting's check.
    With ``snapshot=True`` each setting is read from ``app.conf`` once and kept, and so are
    the values for the next snapshot as long as the configuration is unchanged (see
    :func:`_shared_snapshot`; a value changed in place, e.g. a dict mutated rather than
    assigned, is not noticed): a task execution takes one snapshot, so its reads cost
    nothing once the first execution made them (Celery's namespaced configuration lookups
    are not cheap).
    """

    # The settings read and checked straight from the table (a _Read each, set by
    # _from_table); these annotations are their types for the type checker. The four with
    # logic of their own (redis_url, redis_transport_options, redis_use_ssl, name_secret)
    # are properties below.
    redis_client_factory: Any
    redis_cluster: bool
    key_prefix: str
    default_ttl: float
    renewal_ratio: float
    lock_wait: float
    max_hold: float | None
    on_contended: str
    overlap: str | None
    on_conflict: str
    on_store_error: str
    retry_backoff: float
    retry_backoff_max: float
    retry_max: int | None
    broker_consumer_timeout: float
    status_field: str
    owner_field: str
    fence_field: str
    precheck: bool
    db_deadline: bool
    socket_timeout: float
    release_wait: bool
    fence_ttl: float
    max_waiters: int
    history: bool
    history_max_entries: int
    history_max_age: float
    activity: bool
    activity_flush_interval: float
    event_log: bool
    event_retention: float
    reaper_recover: dict[str, dict[str, str]]
    reaper_older_than: float
    step_store: Any
    step_database: str | None
    idempotency_store: str
    idempotency_ttl: float
    idempotency_lock_ttl: float
    idempotency_serializer: str
    idempotency_on_store_error: str
    idempotency_max_result_bytes: int
    idempotency_max_records: int
    breaker_on_store_error: str
    breaker_state_cache: float
    concurrency_limit_on_store_error: str
    concurrency_limit_retry_after: float
    rate_limit_on_store_error: str
    effect_max_attempts: int
    effect_relay_delay: float
    effect_claim_timeout: float
    effect_http_timeout: float

    def __init__(self, app: Any, snapshot: bool = False) -> None:
        self.app = app
        self._snapshot: dict[str, tuple[Any, str]] | None = None
        #: Objects built from a snapshot's values (a task's guard), kept as long as it is.
        self.memo: dict[Any, Any] | None = None
        if snapshot:
            self._snapshot, self.memo = _shared_snapshot(app)

    def _read(self, setting: Setting) -> tuple[Any, str]:
        """``(value, qualified name it was read under)`` of ``setting``: its own name, else
        (unset) a former name of :attr:`Setting.renamed_from` that is set, else its default
        under its own name. A check then names the setting the user wrote."""
        snapshot = self._snapshot
        if snapshot is not None:
            found = snapshot.get(setting.name)
            if found is not None:
                return found
        get = self.app.conf.get
        value, name = get(setting.qualified), setting.qualified
        if value is None:
            for old in setting.renamed_from:
                value, name = get(setting_name(old)), setting_name(old)
                if value is not None:
                    break
            else:
                value, name = setting.default, setting.qualified
        if snapshot is not None:
            snapshot[setting.name] = (value, name)
        return value, name

    def raw(self, name: str) -> Any:
        """The unchecked value of setting ``name`` (without the prefix; a former name reads
        the setting that replaced it): its value on ``app.conf``, else its default.

        Raises:
            KeyError: ``name`` is no setting.
        """
        return self._read(_BY_NAME[name])[0]

    @property
    def redis_url(self) -> str:
        return self._redis_url(self.raw("redis_url"))

    def _redis_url(self, url: Any) -> str:
        if url is None:
            broker = self.app.conf.broker_url or ""
            if isinstance(broker, str) and broker.startswith(URL_SCHEMES):
                return check_url(broker, "broker_url")
            raise ImproperlyConfigured(
                "steplock_redis_url is not set and the broker URL is not a Redis URL; "
                "set steplock_redis_url (CELERY_STEPLOCK_REDIS_URL in Django settings)",
                setting="steplock_redis_url",
            )
        return cast(str, _BY_NAME["redis_url"].check(url, "steplock_redis_url"))

    def _redis_inputs(self) -> list[Any]:
        """``[url, transport options, TLS options]`` of the lease store, each a value or the
        ImproperlyConfigured it raised, each setting read once. Unset, the options are the
        broker's (``broker_transport_options``, ``broker_use_ssl``) when the lease store
        uses the broker URL; keys the lease store does not use are then dropped."""
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
        setting read once.

        Raises:
            ImproperlyConfigured: naming the first invalid one.
        """
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
    def name_secret(self) -> bytes | None:
        """The HMAC-SHA256 key of default lock names and idempotency keys: the bytes of
        ``steplock_name_secret`` when set; else, under a configured Django, the key derived
        from ``SECRET_KEY`` (:func:`derive_name_secret`); else None (names are then made with
        a public key: anyone can recompute them)."""
        value, name = self._read(_BY_NAME["name_secret"])
        if value is not None:
            return cast(bytes, _BY_NAME["name_secret"].check(value, name))
        secret_key = django_secret_key()
        return None if secret_key is None else derive_name_secret(secret_key)

    @property
    def bulkhead_on_store_error(self) -> str:
        """Deprecated alias of :attr:`concurrency_limit_on_store_error` (one release)."""
        return self.concurrency_limit_on_store_error

    @property
    def bulkhead_retry_after(self) -> float:
        """Deprecated alias of :attr:`concurrency_limit_retry_after` (one release)."""
        return self.concurrency_limit_retry_after

    def problems(self) -> list[ImproperlyConfigured]:
        """Every invalid setting of :data:`SETTINGS`, one error each.

        Returns:
            The errors, in the table's order (empty when every setting is valid).
        """
        found = []
        for name in self._read_names():
            try:
                getattr(self, name)
            except ImproperlyConfigured as exc:
                found.append(exc)
        return found

    def validate(self) -> None:
        """Read every setting of :data:`SETTINGS` once.

        Raises:
            ImproperlyConfigured: naming the first invalid setting.
        """
        for name in self._read_names():
            getattr(self, name)

    def _read_names(self) -> list[str]:
        """The settings the library reads, in the table's order: with a client factory, not
        those it replaces."""
        try:
            factory = self.redis_client_factory
        except ImproperlyConfigured:
            # A factory was given but is invalid: its own error comes first, and the
            # settings it would replace are not read (their absence is not the problem).
            return ["redis_client_factory"] + [
                s.name
                for s in SETTINGS
                if s.name != "redis_client_factory" and s.name not in _REPLACED_BY_FACTORY
            ]
        if factory is None:
            return [s.name for s in SETTINGS]
        return [s.name for s in SETTINGS if s.name not in _REPLACED_BY_FACTORY]
