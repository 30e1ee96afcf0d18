"""The shared base of the Redis-backed patterns (idempotency records, the circuit breaker, the
concurrency limit, the rate limits): where a pattern's Redis calls go (:func:`target`), the
one error-translating call (:func:`call`, :func:`translated`) and the one outage policy
(:func:`check_on_store_error`, :func:`resolve_policy`, :func:`outage`). The jitter of every
backoff is :mod:`celery_steplock._jitter`, one floor down, since the exceptions use it too.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .. import signals
from .._checks import check_choice
from .._redis import route, wire
from ..conf import ON_STORE_ERROR, Settings, configuration_version
from ..events import emit
from ..exceptions import ImproperlyConfigured, LockStoreUnavailable
from ..lock import STORE_ERRORS, get_lease_store, store_error

__all__ = [
    "DEFAULT_PREFIX",
    "FAIL_CLOSED",
    "FAIL_OPEN",
    "Target",
    "target",
    "resolve_policy",
    "call",
    "translated",
    "check_on_store_error",
    "outage",
    "clock_skew",
]

#: The key prefix of a pattern given a bare client and no prefix.
DEFAULT_PREFIX = "steplock"

FAIL_CLOSED, FAIL_OPEN = ON_STORE_ERROR

# The key of the cached targets in a configuration version's memo.
_TARGET = "celery_steplock.patterns._base.target"


@dataclass(frozen=True)
class Target:
    """Where a pattern's Redis calls go.

    Attributes:
        client: the redis-py client (``Redis`` or ``RedisCluster``).
        prefix: the key prefix of the pattern's keys.
        store: the app's lease store (:func:`celery_steplock.lock.get_lease_store`); None
            for a bare client.
        settings: the app's :class:`~celery_steplock.conf.Settings`; None without an app.
    """

    client: Any
    prefix: str
    store: Any = None
    settings: Settings | None = None


def target(app: Any = None, *, client: Any = None, prefix: str | None = None) -> Target:
    """The client and key prefix of a pattern, for the app's current configuration.

    With ``client``, that client under ``prefix`` (default :data:`DEFAULT_PREFIX`), with the
    settings of ``app`` when one is given. Else the lease store of ``app`` (default:
    Celery's current app) with its client and prefix (``prefix`` overrides the prefix),
    looked up once per configuration version
    (:func:`celery_steplock.conf.configuration_version`): a change of ``app.conf`` is seen
    by the next call.

    Args:
        app: a Celery app.
        client: a redis-py client, used instead of the app's lease store.
        prefix: the key prefix, instead of the default or the store's.

    Returns:
        The :class:`Target`.

    Raises:
        ImproperlyConfigured: a setting of the lease store is invalid (it names itself).
    """
    if client is not None:
        settings = Settings(app) if app is not None else None
        return Target(client, prefix or DEFAULT_PREFIX, None, settings)
    if app is None:
        from celery import current_app

        app = current_app._get_current_object()  # type: ignore[attr-defined]
    memo = configuration_version(app)
    found = memo.get((_TARGET, prefix))
    if found is None:
        settings = Settings(app)
        store = get_lease_store(app, settings)
        found = Target(store.client, prefix or store.prefix, store, settings)
        memo[(_TARGET, prefix)] = found
    return found


def resolve_policy(choice: str | None, settings: Settings | None, setting: str) -> str:
    """The outage policy a pattern follows.

    Args:
        choice: the pattern's own ``on_store_error``, which wins when given.
        settings: the app's settings (None: no app).
        setting: the pattern's setting without ``steplock_`` (``"breaker_on_store_error"``).

    Returns:
        ``choice``, else the setting of ``settings``, else ``"fail_closed"``.

    Raises:
        ImproperlyConfigured: the setting is invalid (it names itself).
    """
    if choice is not None:
        return choice
    return getattr(settings, setting) if settings is not None else FAIL_CLOSED


def call(
    client: Any,
    script: wire.Script,
    keys: list[str],
    args: list[str],
    what: str,
    *,
    name: str | None = None,
) -> Any:
    """Run a script through :func:`celery_steplock._redis.route.evalsha`, errors translated.

    Args:
        client: the redis-py client.
        script: the script.
        keys: its KEYS; the first names the call in an error.
        args: its ARGV.
        what: the call in an error's message (``"rate limit"``).
        name: the lock name, limit or dependency the call is about (in an error).

    Returns:
        The script's reply.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or a permission.
        LockError: Redis refused the call otherwise (:func:`celery_steplock.lock.store_error`).
    """
    try:
        return route.evalsha(client, script, keys, args)
    except STORE_ERRORS as exc:
        raise store_error(exc, what, key=keys[0] if keys else None, name=name) from exc


@contextmanager
def translated(what: str, *, key: str | None = None, name: str | None = None) -> Iterator[None]:
    """A block of plain Redis commands whose errors are translated as :func:`call`'s are.

    Args:
        what: the call in an error's message.
        key: the Redis key the block is about.
        name: the name it is about.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or a permission.
        LockError: Redis refused a command otherwise.
    """
    try:
        yield
    except STORE_ERRORS as exc:
        raise store_error(exc, what, key=key, name=name) from exc


def check_on_store_error(value: Any, name: str, *, setting: str | None = None) -> str | None:
    """A pattern's own ``on_store_error`` choice, checked.

    Args:
        value: ``"fail_closed"``, ``"fail_open"`` or None (the pattern's setting decides).
        name: the argument's name in the message (``"CircuitBreaker(on_store_error=)"``).
        setting: what the error names (default ``name``): the task option that carries it.

    Returns:
        ``value``.

    Raises:
        ImproperlyConfigured: ``value`` is none of these
            (:func:`celery_steplock._checks.check_choice`).
    """
    if value is None:
        return None
    try:
        return check_choice(value, name, ON_STORE_ERROR)
    except ImproperlyConfigured as exc:
        if setting is None:
            raise
        raise ImproperlyConfigured(str(exc), setting=setting) from None


def outage(
    exc: LockStoreUnavailable,
    policy: str,
    fail_open: Any = None,
    *,
    pattern: str,
    sender: Any = None,
    key: str | None = None,
    name: str | None = None,
    cleanup: Callable[[], Any] | None = None,
    **fields: Any,
) -> Any:
    """The outage policy of every Redis-backed pattern: Redis could not be reached.

    Sends ``lock_store_error`` (one signal and one log line ``event=lock_store_error``, at
    ERROR) with the fields the lease's outage sends (``key``, ``name``, ``owner`` and
    ``fence`` None, ``task_id`` and ``task_name`` of ``sender``, ``ttl`` None, ``reason``
    ``"<pattern>: <error>"``, ``policy``) plus ``fields``; then fails closed or open.

    Args:
        exc: the outage.
        policy: ``"fail_closed"`` or ``"fail_open"``.
        fail_open: what the pattern returns when it fails open.
        pattern: the pattern in the reason (``"rate limit"``).
        sender: the task (None: the plain API).
        key: the Redis key (or record key) the pattern decided on.
        name: the pattern's name for it (a limit key, a dependency, a namespace).
        cleanup: called before the error is raised (fail closed), e.g. to give back what
            the pattern took before the outage.
        **fields: more fields of the pattern's own.

    Returns:
        ``fail_open`` when the policy is fail open.

    Raises:
        LockStoreUnavailable: ``exc``, when the policy is fail closed.
    """
    request = getattr(sender, "request", None)
    emit(
        signals.lock_store_error,
        sender,
        logging.ERROR,
        key=key,
        name=name,
        owner=None,
        fence=None,
        task_id=getattr(request, "id", None),
        task_name=getattr(sender, "name", None),
        ttl=None,
        reason=f"{pattern}: {exc}",
        policy=policy,
        **fields,
    )
    if policy == FAIL_OPEN:
        return fail_open
    if cleanup is not None:
        cleanup()
    raise exc


def clock_skew(
    skew: float,
    field: str,
    *,
    pattern: str,
    sender: Any = None,
    key: str | None = None,
    name: str | None = None,
    **fields: Any,
) -> float | None:
    """Report a stored Redis time that a pattern's script found ahead of Redis ``TIME`` by
    more than :data:`~celery_steplock._checks.CLOCK_SKEW_TOLERANCE` and clamped to now.

    Sends ``clock_skew`` (one signal and one WARNING line ``event=clock_skew``) with the
    fields :func:`outage` sends (``owner``, ``fence``, ``ttl`` None; ``task_id`` and
    ``task_name`` of ``sender`` unless given in ``fields``) plus ``pattern``, ``field``,
    ``skew`` (seconds) and ``reason``. Nothing when ``skew`` is 0. The script already
    clamped the time and wrote it back, so each clamp is reported once.

    Args:
        skew: how far the stored time was ahead, seconds (the script's figure).
        field: the clamped time's name the script returned (``ts``, ``opened_ms``...).
        pattern: the pattern (``"rate limit"``).
        sender: the task (None: the plain API).
        key: the Redis key the pattern decided on.
        name: the pattern's name for it (a limit key, a dependency).
        **fields: more fields of the pattern's own.

    Returns:
        The skew in seconds, or None when there was none.
    """
    if skew <= 0:
        return None
    request = getattr(sender, "request", None)
    fields.setdefault("task_id", getattr(request, "id", None))
    fields.setdefault("task_name", getattr(sender, "name", None))
    emit(
        signals.clock_skew,
        sender,
        logging.WARNING,
        key=key,
        name=name,
        owner=None,
        fence=None,
        ttl=None,
        pattern=pattern,
        field=field,
        skew=skew,
        reason=(
            f"{pattern}: its stored {field} was {skew:.3f} s ahead of Redis TIME, clamped "
            f"to now: the lock store's clock went back (a failover to a primary whose clock "
            f"is behind?)"
        ),
        **fields,
    )
    return skew
