"""The lease store: owner-keyed Redis leases with fencing tokens.

A lease is a Redis hash ``<prefix>:lease:{<name>}`` with a TTL (its fields:
:mod:`celery_steplock._redis.scripts.lease`); acquire, release, extend and the ownership check
are each one Lua script, so no client can interleave between reading the owner and acting on
it. Every grant returns a fencing token (Kleppmann, "How to do distributed locking", 2016),
``max(previous + 1, Redis server time in microseconds)``, which orders holders; the step
store's compare-and-swap refuses a stale commit. The reasoning is in docs/safety.md ("The
fencing token") and docs/design.md.

Re-exports :class:`~celery_steplock.lease.Lease`, ``new_owner_token``, ``holder_metadata`` and
``CLOCK_DRIFT_FACTOR`` from :mod:`celery_steplock.lease`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, cast

import redis
from redis.exceptions import RedisClusterException, RedisError, ResponseError

from . import _green, signals
from ._checks import (
    MAX_HISTORY_MAX_AGE,
    MAX_HISTORY_MAX_ENTRIES,
    MAX_OWNER_LENGTH,
    MAX_SCAN_COUNT,
    MAX_TTL,
    MAX_WAIT,
    MAX_WAITERS_LIMIT,
    MIN_HISTORY_MAX_AGE,
    MIN_HISTORY_MAX_ENTRIES,
    MIN_TTL,
    check_bool,
    check_count,
    check_fence_ttl,
    check_key_prefix,
    check_name_secret,
    check_seconds,
    check_ttl,
    shown,
)
from ._redis import cluster, route, wire
from ._redis.scripts import lease as scripts
from ._redis.scripts.lease import EXTEND_CHUNK
from .clients import ClientConfig, make_client
from .conf import Settings
from .events import emit, lease_fields, log_event
from .exceptions import (
    ImproperlyConfigured,
    InvalidArgument,
    LockError,
    LockNameError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
)
from .history import (
    DEFAULT_MAX_AGE as DEFAULT_HISTORY_MAX_AGE,
)
from .history import (
    DEFAULT_MAX_ENTRIES as DEFAULT_HISTORY_MAX_ENTRIES,
)
from .history import (
    EVENTS as HISTORY_EVENTS,
)
from .history import (
    HistoryConfig,
    HistoryEntry,
    parse_entries,
)
from .history import (
    encode as encode_entry,
)
from .history import (
    field_text as history_field,
)
from .keys import (
    MAX_NAME_LENGTH,
    PROBE_NAME,  # the permission probe's reserved name; lock.PROBE_NAME stays valid
    check_name,
    fence_key,
    glob_escape,
    history_key,
    lease_key,
    lease_keys,
    name_from_key,
    released_channel,
    waiters_key,
    wake_key,
)
from .lease import (
    CLOCK_DRIFT_FACTOR,
    Lease,
    check_metadata,
    drift,
    holder_metadata,
    new_owner_token,
    parse_lease,
)
from .redact import redact

__all__ = [
    "Lease",
    "RedisLeaseStore",
    "ClusterLeaseStore",
    "new_owner_token",
    "holder_metadata",
    "make_client",
    "get_lease_store",
    "CLOCK_DRIFT_FACTOR",
    "STORE_ERRORS",
    "store_error",
    "MAX_WAITERS",
    "drain_releases",
    "lost_line",
    "FORCED_MARK_TTL",
    "WaitRegistry",
    "WAITS",
]


#: What redis-py raises when Redis cannot be reached (a refusal is a ``ResponseError``, a
#: subclass of ``RedisError``, told apart where it matters; a ``RedisCluster`` raises
#: ``RedisClusterException`` when no node serves a slot).
STORE_ERRORS = (RedisError, OSError, RedisClusterException)

#: Default of ``max_waiters``: how many callers of one store may wait (``acquire(wait=...)``)
#: at once, each blocking one connection of the waiters' own pool.
MAX_WAITERS = 1000

#: Waiters that share the store's own pool (see :attr:`RedisLeaseStore.waiter_limit`) leave
#: a quarter of its connections, and at least this many, to renewals and releases.
WAITER_RESERVE = 8

#: Where the least-privilege ACL is documented (named by the permission errors).
ACL_DOC = "docs/acl.md"

#: Seconds the mark of a force release lives (:meth:`RedisLeaseStore.mark_forced`): its
#: holder reads it once it finds its lease gone, at its next renewal (a third of the TTL
#: away) or its pre-commit check, or later when its process was paused.
FORCED_MARK_TTL = 3600.0

#: The fields of an operator's record (:class:`celery_steplock.ops.ForcedRelease`) a force
#: release's mark keeps, and the ``lock_lost`` line of its holder names.
FORCED_MARK_FIELDS = ("actor", "actor_host", "via", "audit", "reason")

#: Characters of each field of a force release's mark the ``lock_lost`` line keeps.
FORCED_FIELD_MAX = 200


def forced_key(prefix: str, name: str) -> str:
    """The Redis key of the mark a force release leaves for the lease's holder.

    Args:
        prefix: The key prefix (``steplock_key_prefix``).
        name: The lock name.

    Returns:
        ``<prefix>:forced:{<name>}`` (the lease's hash slot; outside ``<prefix>:lease:*``,
        which the reaper scans).
    """
    return f"{prefix}:forced:{{{name}}}"


def parse_forced(raw: Any, owner: str) -> dict[str, Any] | None:
    """The force release's record in the mark ``raw`` (its GET reply), or None when there is
    none, it is no JSON object, or it names another owner than ``owner``."""
    try:
        record = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("owner") != owner:
        return None
    return record


def forced_line(record: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
    """The level and extra fields of a ``lock_lost`` line given the force release's record
    read back (:func:`parse_forced`): WARNING naming it, or ERROR with none.

    Only the known fields (:data:`FORCED_MARK_FIELDS` but ``reason``) are kept, each a
    text cut to :data:`FORCED_FIELD_MAX` characters, else None: the mark is read from
    Redis, where anyone with write access could have planted nested objects or megabytes
    (what :func:`celery_steplock.ops.force_release` writes is short text)."""
    if record is None:
        return logging.ERROR, {}
    fields = {
        k: v[:FORCED_FIELD_MAX] if isinstance(v := record.get(k), str) else None
        for k in FORCED_MARK_FIELDS
        if k != "reason"
    }
    return logging.WARNING, {"forced": True, **fields}


def lost_line(store: Any, lease: Lease) -> tuple[int, dict[str, Any]]:
    """The level and the extra fields of the ``lock_lost`` line of ``lease``.

    An operator's force release (:func:`celery_steplock.ops.force_release`) is what the
    operator asked for: WARNING, with ``forced=True`` and the operator's record (``actor``,
    ``actor_host``, ``via``, ``audit``: the audit record's id, ``reason``) read back from
    the mark the release left (one GET, only when a lease is lost). Any other loss, or a
    mark that cannot be read: ERROR, no extra field. Never raises.

    Args:
        store: The lease's store (only a :class:`RedisLeaseStore` is asked).
        lease: The lost lease.

    Returns:
        ``(level, fields)``.
    """
    if not isinstance(store, RedisLeaseStore):
        return logging.ERROR, {}
    try:
        record = store.forced(lease.name, lease.owner)
    except Exception:  # noqa: BLE001 - the loss is reported either way
        record = None
    return forced_line(record)


def store_error(
    exc: BaseException,
    what: str,
    *,
    key: str | None = None,
    name: str | None = None,
    owner: str | None = None,
) -> LockError:
    """The library's error for an error redis-py raised; every message is redacted.

    Args:
        exc: What redis-py raised.
        what: The call it raised during, for the message (e.g. ``"acquire"``).
        key: The Redis key concerned, when one is.
        name: The lock name concerned, when one is.
        owner: The owner token concerned, when one is.

    Returns:
        :class:`LockStoreMisconfigured` when Redis refused our credentials, a permission or
        the TLS verification (naming the setting to fix, e.g. ``steplock_redis_url``, and
        the command refused, when known); :class:`LockError` when it refused the call
        otherwise (e.g. ``WRONGTYPE``); :class:`LockStoreUnavailable` when it could not be
        reached.
    """
    of = f" of {name!r}" if name is not None else ""
    # redis-py's text may quote a URL or connection options (a client factory's own).
    error = redact(exc)
    reason = wire.misconfiguration(exc)
    if reason is not None:
        command = wire.refused_command(exc)
        permissions = (command,) if command else ()
        setting = "steplock_redis_url"
        if reason == "permission refused":
            hint = (
                f"grant {'+' + command if command else 'the command'} (and the key "
                f"pattern of steplock_key_prefix) to the Redis user of steplock_redis_url; "
                f"the least-privilege ACL is in {ACL_DOC}"
            )
        elif reason in (wire.SENTINEL_AUTH, wire.SENTINEL_UNKNOWN_MASTER):
            setting = "steplock_redis_transport_options"
            hint = (
                "fix the sentinels' password in sentinel_kwargs of "
                "steplock_redis_transport_options"
                if reason == wire.SENTINEL_AUTH
                else "set master_name in steplock_redis_transport_options to the name the "
                "sentinels monitor (SENTINEL MASTERS)"
            )
        elif reason.startswith("TLS"):
            setting = "steplock_redis_use_ssl"
            hint = (
                "fix the TLS options (steplock_redis_use_ssl, or the ssl_* parameters of "
                "a rediss:// steplock_redis_url): ssl_ca_certs must hold the CA that "
                "signed the server's certificate"
                if "verification" in reason
                else "fix the TLS options (steplock_redis_use_ssl, or the ssl_* parameters of "
                "a rediss:// steplock_redis_url): ssl_certfile and ssl_keyfile must be "
                "the PEM client certificate and its key (required by a server of mutual "
                "TLS), ssl_ca_certs a PEM file of CA certificates"
            )
        else:
            hint = "fix the credentials (user name, password) in steplock_redis_url"
        return LockStoreMisconfigured(
            f"lock store refused the {what}{of}: {reason} ({error}): {hint}",
            key=key,
            name=name,
            owner=owner,
            setting=setting,
            permissions=permissions,
        )
    if isinstance(exc, ResponseError):
        # Redis answered and refused (e.g. WRONGTYPE: something else wrote our key): not
        # an outage, so never a reason to retry or to run fail-open.
        return LockError(
            f"lock store refused the {what}{of}: {error}{cluster.redirect_hint(exc)}",
            key=key,
            name=name,
            owner=owner,
        )
    return LockStoreUnavailable(
        f"lock store unavailable during {what}{of}: {error}", key=key, name=name, owner=owner
    )


logger = logging.getLogger("celery_steplock")


# -- arguments of the public API: validated as the settings are, by name, never clamped ------


def _argument(check: Callable[..., Any], value: Any, name: str, **kwargs: Any) -> Any:
    """``check(value, name, **kwargs)`` (a validator of :mod:`celery_steplock.conf`), its
    ImproperlyConfigured raised as :class:`InvalidArgument` naming the argument."""
    try:
        return check(value, name, **kwargs)
    except ImproperlyConfigured as exc:
        raise InvalidArgument(str(exc), argument=name) from None


def _store_arguments(
    prefix: Any, fence_ttl: Any, max_waiters: Any, clock: Any, name_secret: Any
) -> tuple[str, float, int, Callable[[], float], bytes | None]:
    """The checked settings of a lease store (the sync :class:`RedisLeaseStore` and
    :class:`~celery_steplock.aio.lock.AsyncRedisLeaseStore` alike): ``(prefix, fence_ttl,
    max_waiters, clock, name_secret)``. Raises :class:`InvalidArgument` naming the first
    argument that is off."""
    prefix = _argument(check_key_prefix, prefix, "prefix")
    fence_ttl = _argument(check_fence_ttl, fence_ttl, "fence_ttl")
    max_waiters = _argument(
        check_count, max_waiters, "max_waiters", minimum=1, maximum=MAX_WAITERS_LIMIT
    )
    if not callable(clock):
        raise InvalidArgument(
            f"clock must be a callable returning seconds, got {shown(clock)}", argument="clock"
        )
    if name_secret is not None:
        name_secret = _argument(check_name_secret, name_secret, "name_secret")
    return prefix, fence_ttl, max_waiters, clock, name_secret


def _ttl(ttl: Any, name: str = "ttl") -> float:
    if type(ttl) is float and MIN_TTL <= ttl <= MAX_TTL:
        return ttl
    return cast(float, _argument(check_ttl, ttl, name))


def _owner(owner: Any, name: str = "owner") -> str:
    if type(owner) is str and 0 < len(owner) <= MAX_OWNER_LENGTH and owner.isprintable():
        return owner
    raise InvalidArgument(
        f"{name} must be a non-empty string of at most {MAX_OWNER_LENGTH} "
        f"printable characters (an owner token), got {shown(owner)}",
        argument=name,
    )


def _name(name: Any) -> str:
    if type(name) is str and "}" in name and _is_slot_name(name):
        return name
    return check_name(name)


def _is_slot_name(name: str) -> bool:
    # A slot of a concurrency limit (celery_steplock.patterns.concurrency): "<limit key>}#<index>", so
    # that its key "<prefix>:lease:{<limit key>}#<index>}" shares the hash tag of its limit.
    key, mark, index = name.rpartition("}#")
    return (
        bool(mark)
        and index.isdigit()
        and len(index) <= 6
        and len(name) <= MAX_NAME_LENGTH
        and bool(key)
        and key.isprintable()
        and "{" not in key
        and "}" not in key
    )


def _metadata(metadata: Any) -> Mapping[str, Any] | None:
    if metadata is None or isinstance(metadata, Mapping):
        return metadata
    raise InvalidArgument(
        f"metadata must be None or a mapping, got {shown(metadata)}", argument="metadata"
    )


def pack_metadata(metadata: Mapping[str, Any] | None) -> str:
    """The ``meta`` field of a lease.

    Args:
        metadata: The lease's metadata, or None.

    Returns:
        ``metadata`` as one compact JSON object of strings (a None value becomes ``""``), or
        ``""`` when there is none.

    Raises:
        MetadataError: A key of :data:`~celery_steplock.lease.RESERVED_FIELDS` (``owner``,
            ``fence``, ...) or a broken bound of
            :func:`~celery_steplock.lease.check_metadata`.
    """
    if not metadata:
        return ""
    check_metadata(metadata)
    return _encode_meta({k: "" if v is None else str(v) for k, v in metadata.items()})


_encode_meta = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def unpack_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A lease hash's fields as readers see them; never raises.

    Args:
        fields: The hash as read.

    Returns:
        :func:`celery_steplock.lease.parse_lease` of them: the ``meta`` JSON object spread
        into top-level string fields, a malformed field left out and described in
        ``malformed``.
    """
    return parse_lease(fields)


def _name_of(key: str) -> str:
    """The lock name of a listed lease key (the key itself when it has no braces)."""
    try:
        return name_from_key(key)
    except LockNameError:
        return key


def _escaped(text: str) -> str:
    """``text`` with each non-printable character as a backslash escape."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


# -- shared by RedisLeaseStore and celery_steplock.aio.lock.AsyncRedisLeaseStore: one
# -- argument building, one reply parsing, one set of error messages for both forms.


def _wait_seconds(wait: Any) -> float:
    """``wait`` of an acquire, validated (seconds within [0, :data:`MAX_WAIT`])."""
    if wait != 0:
        return cast(
            float, _argument(check_seconds, wait, "wait", allow_zero=True, maximum=MAX_WAIT)
        )
    return wait  # type: ignore[no-any-return]


def _acquire_request(
    prefix: str,
    fence_ttl: float,
    name: str,
    owner: str,
    ttl: float,
    wait: float,
    metadata: Mapping[str, Any] | None,
    history: HistoryConfig | None = None,
) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of :data:`~celery_steplock._redis.scripts.lease.ACQUIRE` for validated
    arguments (``wait`` above 0: the refused owner is recorded as waiting that long;
    ``history``: the bounds of the name's history, None: none written)."""
    ttl_ms = str(max(1, int(ttl * 1000)))
    args = [
        owner,
        ttl_ms,
        str(max(int(ttl_ms), int(fence_ttl * 1000))),
        str(max(1, int(wait * 1000)) if wait > 0 else 0),
        pack_metadata(metadata),
    ]
    keys = [lease_key(prefix, name), fence_key(prefix, name)]
    if wait > 0:
        keys.append(waiters_key(prefix, name))
    if history is not None:
        keys.append(history_key(prefix, name))
        task_id = metadata.get("task_id") if metadata else None
        args += history.args
        args.append(history_field(task_id))
    return keys, args


def _release_request(
    prefix: str,
    name: str,
    owner: str,
    history: HistoryConfig | None,
    outcome: str | None = None,
    task_id: str | None = None,
    event: str = "released",
    by: str | None = None,
) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of :data:`~celery_steplock._redis.scripts.lease.RELEASE` for validated
    arguments (``history`` None: no history key, nothing written to it). The entry's
    fields go through :func:`~celery_steplock.history.field_text` (a caller's task id or
    actor holding the separator forges no field)."""
    keys = [lease_key(prefix, name), waiters_key(prefix, name), wake_key(prefix, name)]
    if history is None:
        return keys, [owner]
    keys.append(history_key(prefix, name))
    return keys, [
        owner,
        *history.args,
        history_field(outcome),
        history_field(task_id),
        history_field(event),
        history_field(by),
    ]


def _history_store_argument(history: bool, max_entries: Any, max_age: Any) -> HistoryConfig | None:
    """The store's :class:`HistoryConfig` (None: off), its bounds checked as the settings'."""
    if not _argument(check_bool, history, "history"):
        return None
    return HistoryConfig(
        max_entries=_argument(
            check_count,
            max_entries,
            "history_max_entries",
            minimum=MIN_HISTORY_MAX_ENTRIES,
            maximum=MAX_HISTORY_MAX_ENTRIES,
        ),
        max_age=_argument(
            check_seconds,
            max_age,
            "history_max_age",
            minimum=MIN_HISTORY_MAX_AGE,
            maximum=MAX_HISTORY_MAX_AGE,
        ),
    )


def _granted(
    reply: Any,
    store: Any,
    name: str,
    key: str,
    owner: str,
    ttl: float,
    sent: float,
    metadata: Mapping[str, Any] | None,
) -> tuple[Lease | None, str | None, float | None]:
    """ACQUIRE's reply as ``try_acquire`` returns it: ``(lease, None, None)`` when granted
    (``sent``: the store's ``clock`` reading before the call; a fresh grant and a re-grant
    alike, see :func:`_fresh_grant`), else ``(None, holder, holder_ttl_seconds)``."""
    if isinstance(reply, list):
        holder, ttl_left = reply
        return (
            None,
            wire.text(holder),
            (ttl_left / 1000.0 if ttl_left and ttl_left > 0 else None),
        )
    try:
        fence = int(reply)
    except (TypeError, ValueError):
        # Only a re-grant reads the token back from the hash (a fresh one is computed).
        raise LockError(
            f"lease {key!r} is held by this owner but its fencing token is not a number "
            f"({shown(reply)}): the hash is corrupt. Release it (`celery steplock release "
            f"{name} --owner {owner}`) or let its TTL run out",
            key,
            name=name,
            owner=owner,
        ) from None
    meta = metadata or {}
    return (
        Lease(
            name=name,
            key=key,
            owner=owner,
            fence=fence,
            ttl=ttl,
            acquired_at=sent,
            valid_until=sent + ttl - drift(ttl),
            task_id=meta.get("task_id"),
            task_name=meta.get("task_name"),
            clock=store.clock,
            secret=store.name_secret,
        ),
        None,
        None,
    )


def _fresh_grant(reply: Any) -> bool:
    """Whether ACQUIRE's ``reply`` is a grant that call made: an integer token (a re-grant to
    an owner that already held the lease is its token as a string, a refusal a table)."""
    return isinstance(reply, int) and not isinstance(reply, bool)


def _ttl_ms(ttl: float) -> str:
    """A validated TTL in seconds as the scripts' milliseconds (at least 1)."""
    return str(max(1, int(ttl * 1000)))


def _owned_seconds(result: Any) -> float | None:
    """OWNED's reply as seconds left, or None when not held by the owner."""
    return result / 1000.0 if result is not None and result >= 0 else None


def _probe_keys(prefix: str, probe_name: str) -> list[str]:
    """KEYS of the permission probe on ``probe_name``."""
    return [
        lease_key(prefix, probe_name),
        fence_key(prefix, probe_name),
        waiters_key(prefix, probe_name),
        wake_key(prefix, probe_name),
    ]


def _probe_names() -> tuple[str, str]:
    """The names the probe tries in turn: the reserved one, then a random one of its own."""
    return (PROBE_NAME, f"{PROBE_NAME}:{uuid.uuid4().hex}")


def _probe_error(
    prefix: str,
    refused: Any,
    keys: list[str],
    *,
    key: str | None,
    name: str | None,
    owner: str | None,
) -> LockStoreMisconfigured | None:
    """The error of the probe's last reply (1: both names' keys were taken; a list: the
    commands refused), or None when it found every permission."""
    if refused == 1:
        return LockStoreMisconfigured(
            f"the permission probe found its keys taken ({keys[0]} and a random name's): "
            f"keys under {prefix}:* are written by something else than "
            f"celery-steplock",
            key=key,
            name=name,
            owner=owner,
            setting="steplock_key_prefix",
        )
    if not refused:
        return None
    refused = tuple(wire.text(r) for r in refused)
    commands = sorted({r.split(" ")[0] for r in refused})
    return LockStoreMisconfigured(
        f"the Redis user of steplock_redis_url may not run {', '.join(refused)} "
        f"(needed by the lease scripts): grant "
        f"{' '.join('+' + c for c in commands)} and the key pattern "
        f"~{prefix}:* (steplock_key_prefix); the least-privilege ACL is in "
        f"{ACL_DOC}",
        key=key,
        name=name,
        owner=owner,
        setting="steplock_redis_url",
        permissions=refused,
    )


def _waiters_full(
    store: Any, name: str, owner: str, limit: int, size: int | None
) -> LockStoreMisconfigured:
    """The error of a caller that would be one waiter more than ``store`` allows
    (``limit``; ``size``: the shared pool's max_connections when the waiters share it)."""
    if limit < store.max_waiters:
        return LockStoreMisconfigured(
            f"cannot wait for {name!r}: {limit} callers of this process already wait "
            f"for leases, the most the store's pool allows (steplock_max_waiters, "
            f"{store.max_waiters}, is capped to the pool's max_connections, {size}, "
            f"minus {(size or 0) - limit} kept for renewals and releases, because the "
            f"waiters share that pool: no pool of their own could be derived from the "
            f"store's client): give the pool more connections, lower lock_wait or the "
            f"pool's concurrency",
            key=store.key(name),
            name=name,
            owner=owner,
            setting="steplock_max_waiters",
        )
    return LockStoreMisconfigured(
        f"cannot wait for {name!r}: {store.max_waiters} callers of this process "
        f"already wait for leases (steplock_max_waiters; each blocks a connection "
        f"of the waiters' pool): raise steplock_max_waiters or lower lock_wait or "
        f"the pool's concurrency",
        key=store.key(name),
        name=name,
        owner=owner,
        setting="steplock_max_waiters",
    )


#: Seconds a waiter whose wait a failover dropped keeps trying to reach the new primary
#: (Sentinel promotes a replica within seconds; a Redis really gone is reported after it).
FAILOVER_GRACE = 10.0


class _FailoverGrace:
    """The acquire attempts of a waiter after its wait was dropped, or after an attempt of a
    wait already refused once failed: each refused for a lost connection (a primary demoted,
    not yet replaced) is tried again after a pause growing from 0.1 s to 1 s, until
    :data:`FAILOVER_GRACE` seconds passed or the wait's deadline."""

    __slots__ = ("until", "delay")

    def __init__(self) -> None:
        self.until = time.monotonic() + FAILOVER_GRACE
        self.delay = 0.1

    def pause(self, error: LockError, deadline: float) -> float | None:
        """Seconds to pause before the next attempt, or None: raise ``error``."""
        now = time.monotonic()
        if not isinstance(error.__cause__, redis.ConnectionError):
            return None
        if now + self.delay >= min(self.until, deadline):
            return None
        pause, self.delay = self.delay, min(self.delay * 2, 1.0)
        return pause


def _wait_timeout(left: float, holder_ttl: float | None, cap: float | None) -> float:
    """Seconds a waiter blocks in BLPOP: until its deadline or the holder's TTL runs out
    (a dead holder announces nothing), within the socket timeout (a timeout is retried)."""
    timeout = min(left, holder_ttl) if holder_ttl else min(left, 0.01)
    if cap:
        timeout = min(timeout, cap * 0.8)
    return max(round(timeout, 3), 0.001)


def _extend_many_calls(
    prefix: str, items: list[tuple[str, str, float]], chunk: int
) -> Iterator[tuple[list[str], list[str]]]:
    """The EXTEND_MANY calls of validated ``items``, ``chunk`` leases per call."""
    names: list[str] = []
    argv: list[str] = []
    for name, owner, ttl in items:
        names.append(name)
        argv.append(owner)
        argv.append(str(max(1, int(ttl * 1000))))
        if len(names) >= chunk:
            yield lease_keys(prefix, names), argv
            names, argv = [], []
    if names:
        yield lease_keys(prefix, names), argv


def _extend_many_results(replies: list[Any]) -> list[bool]:
    """EXTEND_MANY's replies (one string of 0/1 per call) as one bool per lease.

    Raises:
        LockStoreUnavailable, LockStoreMisconfigured: Redis refused a call.
    """
    results: list[bool] = []
    for reply in replies:
        if isinstance(reply, Exception):
            raise _unavailable_unless_misconfigured(reply, "renewal", refused=True)
        results.extend([c == "1" for c in wire.text(reply)])
    return results


class RedisLeaseStore:
    """Acquire, extend, release, reap and inspect owner-keyed leases in one Redis.

    Every argument of the constructor and of the methods is validated as the settings are
    (``ttl`` within [0.05, 86400] seconds, ``wait`` within [0, 86400], ``fence_ttl`` within
    [1, 31622400], ``max_waiters`` within [1, 100000], names as lock names, owners non-empty
    printable strings of at most 256 characters; bounds in :mod:`celery_steplock._checks`),
    never clamped. Every method raises :class:`LockStoreUnavailable` when Redis cannot be
    reached, :class:`LockStoreMisconfigured` when it refuses our credentials or a permission,
    and :class:`LockError` when it refuses a call otherwise (e.g. ``WRONGTYPE``: a key of
    ours holds something else); all carry ``name`` (and ``owner``) where one lease is
    concerned.

    Waiters (``acquire(wait=...)``) block on ``waiter_client``, by default a client derived
    from ``client`` with a pool of its own of ``max_waiters`` connections, so that renewals
    and releases never wait for a connection behind them; a caller that would be waiter
    number ``max_waiters + 1`` gets :class:`LockStoreMisconfigured` naming
    ``steplock_max_waiters``. When no pool can be derived (a custom pool class from a client
    factory) the waiters share the store's pool and are capped below its
    ``max_connections`` (see :attr:`waiter_limit`).

    Args:
        client: A ``redis.Redis`` or a ``redis.cluster.RedisCluster`` (see
            :func:`make_client`); a cluster client makes a :class:`ClusterLeaseStore`.
        prefix: Namespaces the keys (``steplock_key_prefix``).
        fence_ttl: Seconds an idle name's fencing counter is kept at least (at most twice
            that); default 7 days.
        clock: The clock of the leases' local validity, in seconds (default
            :func:`time.monotonic`).
        waiter_client: The client waiters block on; default one derived from ``client``.
        max_waiters: How many callers of this store may wait at once (default
            :data:`MAX_WAITERS`).
        name_secret: The HMAC key (str or bytes, 32 to 4096 long) of the leases'
            :attr:`~celery_steplock.lease.Lease.idempotency_key`; default None (they raise).
        history: Keep each name's history (:mod:`celery_steplock.history`, written by the
            lease scripts in the same call); default True (``steplock_history``).
        history_max_entries: Entries kept per name, 1 to 100,000; default 100
            (``steplock_history_max_entries``).
        history_max_age: Seconds a name's history lives after its last event, 1 to 366
            days; default 7 days (``steplock_history_max_age``).

    Raises:
        InvalidArgument: An argument of the wrong type or out of its bounds (naming it).
    """

    def __new__(cls, client: Any = None, *args: Any, **kwargs: Any) -> RedisLeaseStore:
        # A RedisCluster client gets the store whose multi-lease calls are split by slot.
        if cls is RedisLeaseStore and cluster.is_cluster(client):
            cls = ClusterLeaseStore
        return super().__new__(cls)

    def __init__(
        self,
        client: redis.Redis,
        prefix: str = "steplock",
        fence_ttl: float = 7 * 24 * 3600.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        waiter_client: redis.Redis | None = None,
        max_waiters: int = MAX_WAITERS,
        name_secret: bytes | str | None = None,
        history: bool = True,
        history_max_entries: int = DEFAULT_HISTORY_MAX_ENTRIES,
        history_max_age: float = DEFAULT_HISTORY_MAX_AGE,
    ):
        # Looked up on the type: a deferred cluster client builds itself on attribute access.
        if not cluster.is_cluster(client) and not callable(
            getattr(type(client), "execute_command", None)
        ):
            raise InvalidArgument(
                f"client must be a redis.Redis or RedisCluster client, got {shown(client)}",
                argument="client",
            )
        prefix, fence_ttl, max_waiters, clock, name_secret = _store_arguments(
            prefix, fence_ttl, max_waiters, clock, name_secret
        )
        #: The HMAC key of the idempotency keys of the leases it grants (None: they raise).
        self.name_secret = name_secret
        #: The bounds of the names' history (None: not written).
        self.history_config = _history_store_argument(
            history, history_max_entries, history_max_age
        )
        self.client = client
        self.max_waiters = max_waiters
        self._waiter_client = waiter_client
        self._waiter_guard = threading.Lock()
        self._waiter_limit: int | None = None
        self._shares_pool = False
        self._waiting = 0
        self._waiting_guard = threading.Lock()
        self._probed = False
        self.prefix = prefix
        self.fence_ttl = fence_ttl
        self.clock = clock
        self._acquire = wire.Script(scripts.ACQUIRE)
        self._release = wire.Script(scripts.RELEASE)
        self._reap = wire.Script(scripts.REAP)
        self._extend = wire.Script(scripts.EXTEND)
        self._extend_many = wire.Script(scripts.EXTEND_MANY)
        self._scan_fields = wire.Script(scripts.SCAN_FIELDS)
        self._forget_waiter = wire.Script(scripts.FORGET_WAITER)
        self._owned = wire.Script(scripts.OWNED)
        self._probe = wire.Script(scripts.PROBE)
        self._history_add = wire.Script(scripts.HISTORY_ADD)
        self._history_read = wire.Script(scripts.HISTORY_READ)
        # The releases written without waiting (release_later): built on first use; None
        # when the client's shape keeps waiting (route.deferred).
        self._deferred: wire.Deferred | None = None
        self._deferred_built = False

    def key(self, name: str) -> str:
        """The Redis key of a lease.

        Args:
            name: The lock name.

        Returns:
            ``<prefix>:lease:{<name>}``.
        """
        return lease_key(self.prefix, name)

    def forced_key(self, name: str) -> str:
        """The Redis key of a force release's mark (:func:`forced_key`)."""
        return forced_key(self.prefix, name)

    def mark_forced(self, name: str, owner: str, record: Mapping[str, Any]) -> None:
        """Leave the operator's record of a force release of ``owner``'s lease for its
        holder (``SET ... PX``, :data:`FORCED_MARK_TTL`): written before the delete, so that
        the holder, finding its lease gone, logs the loss as a WARNING naming the record
        (:func:`lost_line`). One mark a name: a later force release replaces it.

        Args:
            name: The lock name.
            owner: The owner token released.
            record: The record's fields (:data:`FORCED_MARK_FIELDS` are kept, as text).

        Raises:
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the write (ACL).
        """
        name, owner = _name(name), _owner(owner)
        kept = {k: record.get(k) for k in FORCED_MARK_FIELDS if record.get(k) is not None}
        payload = json.dumps({"owner": owner, **{k: str(v) for k, v in kept.items()}})
        key = self.forced_key(name)
        try:
            self.client.set(key, payload, px=int(FORCED_MARK_TTL * 1000))
        except STORE_ERRORS as exc:
            raise store_error(exc, "force release mark", key=key, name=name, owner=owner) from exc

    def forced(self, name: str, owner: str) -> dict[str, Any] | None:
        """The operator's record a force release of ``owner``'s lease left
        (:meth:`mark_forced`), or None: no force release of that owner's lease (within
        :data:`FORCED_MARK_TTL`), or a mark that is no JSON object.

        Args:
            name: The lock name.
            owner: The owner token.

        Raises:
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the read (ACL).
        """
        name, owner = _name(name), _owner(owner)
        key = self.forced_key(name)
        try:
            raw = self.client.get(key)
        except STORE_ERRORS as exc:
            raise store_error(exc, "force release mark", key=key, name=name, owner=owner) from exc
        return parse_forced(raw, owner)

    @property
    def waiter_client(self) -> redis.Redis:
        """The client waiters block on (see the class docstring)."""
        if self._waiter_client is None:
            with self._waiter_guard:
                if self._waiter_client is None:
                    derived = route.derived_client(self.client, self.max_waiters)
                    self._shares_pool = derived is self.client
                    self._waiter_client = derived
        return self._waiter_client

    @property
    def waiter_limit(self) -> int:
        """How many callers of this store may wait at once.

        ``max_waiters``; but when the waiters' client could not be derived from the store's
        (it is the store's client itself, so the waiters share its pool), at most that
        pool's ``max_connections`` minus a reserve of a quarter of them (at least
        :data:`WAITER_RESERVE`), which the renewals and releases keep. A ``waiter_client``
        passed in is not capped.
        """
        if self._waiter_limit is None:
            client = self.waiter_client
            limit = self.max_waiters
            # A Cluster client is not capped (a pool per node), nor built here if deferred.
            size = (
                None
                if cluster.is_cluster(client)
                else getattr(getattr(client, "connection_pool", None), "max_connections", None)
            )
            if self._shares_pool and isinstance(size, int) and size > 0:
                limit = min(limit, max(0, size - max(WAITER_RESERVE, size // 4)))
            self._waiter_limit = limit
        return self._waiter_limit

    def _enter_waiting(self) -> bool:
        limit = self.waiter_limit
        with self._waiting_guard:
            if self._waiting >= limit:
                return False
            self._waiting += 1
            return True

    def _leave_waiting(self) -> None:
        with self._waiting_guard:
            self._waiting -= 1

    def check_permissions(
        self,
        *,
        what: str = "permission check",
        key: str | None = None,
        name: str | None = None,
        owner: str | None = None,
    ) -> None:
        """Run the permission probe once, before the store's first write.

        The probe (:data:`celery_steplock._redis.scripts.lease.PROBE`) runs every command of
        the lease scripts on the keys of a reserved name under this prefix, each refusal
        collected, so that a Redis user lacking a permission is refused before any script
        can stop halfway.

        Args:
            what: The call the check comes before, for the errors' messages.
            key: The Redis key of that call, for the errors.
            name: The lock name of that call, for the errors.
            owner: The owner token of that call, for the errors.

        Raises:
            LockStoreMisconfigured: Naming every command (and key) refused.
            LockStoreUnavailable: Redis cannot be reached.
        """
        # The probe leaves alone any of its keys that exists (it returns 1): a lease of the
        # reserved name that an older version took, or a key written by hand, is never
        # touched; then it runs on a name of its own instead.
        for probe_name in _probe_names():
            keys = _probe_keys(self.prefix, probe_name)
            try:
                refused = route.evalsha(self.client, self._probe, keys, [])
            except STORE_ERRORS as exc:
                raise store_error(exc, what, key=key, name=name, owner=owner) from exc
            if refused != 1:
                break
        error = _probe_error(self.prefix, refused, keys, key=key, name=name, owner=owner)
        if error is not None:
            raise error
        self._probed = True

    def _call(
        self,
        script: wire.Script,
        keys: list[str],
        args: list[str],
        what: str,
        name: str,
        owner: str | None = None,
        client: redis.Redis | None = None,
        writes: bool = True,
    ) -> Any:
        # The probe guards scripts that write; a read (the ownership check) never stops
        # halfway, and must work on a replica too.
        if writes and not self._probed:
            self.check_permissions(what=what, key=keys[0], name=name, owner=owner)
        try:
            return route.evalsha(client or self.client, script, keys, args)
        except STORE_ERRORS as exc:
            raise store_error(exc, what, key=keys[0], name=name, owner=owner) from exc

    def try_acquire(
        self,
        name: str,
        owner: str,
        ttl: float,
        metadata: Mapping[str, Any] | None = None,
        *,
        wait: float = 0.0,
        _client: redis.Redis | None = None,
    ) -> tuple[Lease | None, str | None, float | None]:
        """One acquire attempt.

        Args:
            name: The lock name.
            owner: The owner token.
            ttl: The lease's lifetime in seconds.
            metadata: Stored beside the owner (see :meth:`acquire`).
            wait: Seconds a refused owner is recorded as waiting, so that the next release
                wakes a waiter (default 0: not recorded).

        Returns:
            ``(lease, None, None)`` when granted, else ``(None, holder_owner,
            holder_ttl_seconds)``.

        Raises:
            InvalidArgument: An argument of the wrong type or out of bounds.
            LockNameError: ``name`` cannot be a lock name.
            MetadataError: ``metadata`` uses a reserved key or breaks a bound.
        """
        name, owner, ttl = _name(name), _owner(owner), _ttl(ttl)
        metadata = _metadata(metadata)
        wait = _wait_seconds(wait)
        keys, args = _acquire_request(
            self.prefix, self.fence_ttl, name, owner, ttl, wait, metadata, self.history_config
        )
        deferred = self._deferred
        if deferred is not None and deferred.pending:
            # This process's own release of the name, written but unread, reaches Redis on
            # another connection: its reply is read first, so that Redis ran it before.
            deferred.settle(keys[0])
        sent = self.clock()
        reply = self._call(self._acquire, keys, args, "acquire", name, owner, _client)
        return _granted(reply, self, name, keys[0], owner, ttl, sent, metadata)

    def channel(self, name: str) -> str:
        """Deprecated: the pub/sub channel on which releases of ``name`` used to be announced.

        Nothing is published any more (waiters block on a wake-up list, see :meth:`acquire`).

        Args:
            name: The lock name.

        Returns:
            The channel's name.
        """
        warnings.warn(
            "RedisLeaseStore.channel(): releases are no longer published",
            DeprecationWarning,
            stacklevel=2,
        )
        return released_channel(self.prefix, name)

    def acquire(
        self,
        name: str,
        owner: str | None = None,
        ttl: float = 30.0,
        *,
        wait: float = 0.0,
        metadata: Mapping[str, Any] | None = None,
    ) -> Lease | None:
        """Acquire a lease, waiting for it at most ``wait`` seconds.

        A waiter does not poll: a refused attempt records it as waiting (in the same script),
        and it blocks on the name's wake-up list (``BLPOP``). A release pushes one wake-up
        when anyone waits, which the waiter blocked longest takes, so a release wakes one
        waiter rather than all of them. A waiter also retries when the holder's TTL runs out
        (a dead holder announces nothing).

        Args:
            name: The lock name.
            owner: The owner token; a fresh one when None.
            ttl: The lease's lifetime in seconds.
            wait: Seconds to wait for a lease another owner holds (default 0: one attempt).
            metadata: Stored beside the owner (task_id, task_name, hostname, pid, ...; see
                :func:`holder_metadata`), returned by :meth:`inspect` and :meth:`scan` as
                strings.

        Returns:
            The :class:`Lease`, or None when another owner holds it and ``wait`` seconds
            passed without it being released or expiring.

        Raises:
            InvalidArgument: An argument of the wrong type or out of bounds.
            LockNameError: ``name`` cannot be a lock name.
            MetadataError: ``metadata`` uses a reserved key or breaks a bound.
            LockStoreMisconfigured: Also when this caller would be one waiter more than
                the store allows (naming ``steplock_max_waiters``).
        """
        owner = new_owner_token() if owner is None else _owner(owner)
        name, ttl, metadata = _name(name), _ttl(ttl), _metadata(metadata)
        wait = _wait_seconds(wait)
        if wait <= 0:
            return self.try_acquire(name, owner, ttl, metadata)[0]
        if not self._enter_waiting():
            lease = self.try_acquire(name, owner, ttl, metadata)[0]
            if lease is not None:
                return lease
            limit = self.waiter_limit
            size = (
                self.client.connection_pool.max_connections if limit < self.max_waiters else None
            )
            raise _waiters_full(self, name, owner, limit, size)
        try:
            return self._wait(name, owner, ttl, wait, metadata)
        finally:
            self._leave_waiting()

    def _wait(
        self, name: str, owner: str, ttl: float, wait: float, metadata: Mapping[str, Any] | None
    ) -> Lease | None:
        # Every command of a waiter goes through the waiters' pool: blocked in BLPOP or not,
        # waiters never take the connections that renewals and releases need.
        client = self.waiter_client
        deadline = time.monotonic() + wait
        wake = wake_key(self.prefix, name)
        # BLPOP must return before the socket times out (a timeout would be retried).
        cap = route.socket_timeout(client)
        lease = None
        interrupted = False
        failover: _FailoverGrace | None = None
        waiting = None  # WAITS' token once refused: a wait really happens
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    lease, _holder, holder_ttl = self.try_acquire(
                        name, owner, ttl, metadata, wait=max(left, 0.001), _client=client
                    )
                except LockStoreUnavailable as exc:
                    if failover is None and waiting is not None:
                        # Refused before, so Redis was there: a failover that lands on this
                        # attempt rather than on the BLPOP gets the same grace.
                        failover = _FailoverGrace()
                    pause = failover.pause(exc, deadline) if failover is not None else None
                    if pause is None:
                        raise
                    time.sleep(pause)
                    continue
                if lease is not None or left <= 0:
                    return lease
                if waiting is None:
                    waiting = WAITS.start("lease", str((metadata or {}).get("task_name") or ""))
                try:
                    client.blpop([wake], timeout=_wait_timeout(left, holder_ttl, cap))
                    interrupted = False
                except STORE_ERRORS as exc:
                    if isinstance(exc, redis.ConnectionError) and not interrupted:
                        # One dropped wait (a failover closed the connection, or a demoted
                        # primary answered READONLY) goes back to the acquire attempt, which
                        # reconnects, and keeps trying while the failover lasts (at most
                        # FAILOVER_GRACE seconds): it raises if Redis is really gone.
                        interrupted = True
                        failover = _FailoverGrace()
                        continue
                    raise store_error(
                        exc, "wait", key=self.key(name), name=name, owner=owner
                    ) from exc
        finally:
            if waiting is not None:
                WAITS.end(waiting)
            if lease is None:
                # The waiter entry dropped; and a wake-up this wait may have taken from BLPOP
                # before an exception cut it short (a soft time limit) passed on when the
                # lease is free, else another waiter sleeps until its BLPOP times out.
                try:
                    route.evalsha(client, self._forget_waiter, self._wake_keys(name), [owner])
                except STORE_ERRORS:
                    pass  # the entry expires with its deadline

    def _wake_keys(self, name: str) -> list[str]:
        return [self.key(name), waiters_key(self.prefix, name), wake_key(self.prefix, name)]

    def release(
        self,
        name: str,
        owner: str,
        *,
        outcome: str | None = None,
        task_id: str | None = None,
        forced_by: str | None = None,
    ) -> bool:
        """Delete the lease if ``owner`` holds it, and wake a waiter.

        Args:
            name: The lock name.
            owner: The owner token.
            outcome: The holder's execution outcome, for the name's history
                (:data:`celery_steplock.history.OUTCOMES`; None: not recorded).
            task_id: The holder's task id, for the history.
            forced_by: An operator's force release: the history's entry is ``forced``,
                naming them (:func:`celery_steplock.ops.force_release`).

        Returns:
            True when deleted; False (nothing changed) when the key is gone or another owner
            holds it, so releasing twice is harmless.
        """
        name, owner = _name(name), _owner(owner)
        keys, args = _release_request(
            self.prefix,
            name,
            owner,
            self.history_config,
            outcome,
            task_id,
            "released" if forced_by is None else "forced",
            forced_by,
        )
        return bool(self._call(self._release, keys, args, "release", name, owner))

    @property
    def deferred(self) -> wire.Deferred | None:
        """The connection of :meth:`release_later` (:class:`~celery_steplock._redis.wire.Deferred`),
        or None when this store's client cannot defer: a cluster, TLS, Sentinel, a factory's
        own pool class (:func:`~celery_steplock._redis.route.deferred`), or a green pool (its
        hub, not a thread, owns the sockets)."""
        if not self._deferred_built:
            with self._waiter_guard:
                if not self._deferred_built:
                    self._deferred = None if _green.green_pool() else route.deferred(self.client)
                    self._deferred_built = True
        return self._deferred

    def release_later(
        self,
        name: str,
        owner: str,
        done: Callable[[bool | None, LockError | None], Any],
        *,
        outcome: str | None = None,
        task_id: str | None = None,
    ) -> bool:
        """:meth:`release`, written to Redis without waiting for its reply, when this store
        can (see :attr:`deferred`): Redis runs it (and wakes a waiter) as soon as it reads
        it; its reply is read later, on a connection of its own, and handed to ``done``:
        ``done(released, None)`` (``released`` as :meth:`release` returns it) or
        ``done(None, error)`` (the :class:`LockError` of :func:`store_error`). ``done`` runs
        in the thread that reads the reply (the next :meth:`release_later` of this process,
        :func:`drain_releases`, or the worker's shutdown) and must not raise. ``outcome``
        and ``task_id``: as :meth:`release`'s.

        Returns:
            True when the release was written (or its write failed and ``done`` got the
            error); False when this store cannot defer, or its permission probe has not run
            yet: nothing was sent, call :meth:`release`.
        """
        deferred = self.deferred
        if deferred is None or not self._probed:
            return False
        name, owner = _name(name), _owner(owner)
        keys, args = _release_request(
            self.prefix, name, owner, self.history_config, outcome, task_id
        )

        def replied(reply: Any, error: BaseException | None) -> None:
            if error is None:
                done(bool(reply), None)
            else:
                done(None, store_error(error, "release", key=keys[0], name=name, owner=owner))

        deferred.send(self._release, keys, args, replied)
        return True

    def reap(self, name: str, owner: str, renewed_ms: str) -> bool:
        """Delete a dead holder's lease unless it changed since it was read, and wake a waiter.

        Args:
            name: The lock name.
            owner: The owner token that must still hold it.
            renewed_ms: The lease's ``renewed_ms`` field as read before deciding its holder
                is dead (``""`` for a lease without the field).

        Returns:
            True when deleted; False (nothing changed) when it was renewed, released or
            re-acquired since.

        Raises:
            InvalidArgument: ``renewed_ms`` is not digits (or empty), or another argument
                is invalid.
        """
        name, owner = _name(name), _owner(owner)
        renewed_ms = _renewed_ms(renewed_ms)
        keys, args = self._reap_request(name, owner, str(renewed_ms))
        return bool(self._call(self._reap, keys, args, "reap", name, owner))

    def _reap_request(self, name: str, owner: str, renewed_ms: str) -> tuple[list[str], list[str]]:
        keys, args = self._wake_keys(name), [owner, renewed_ms]
        if self.history_config is not None:
            keys.append(history_key(self.prefix, name))
            args += self.history_config.args
        return keys, args

    def reap_many(
        self, items: Iterable[tuple[str, str, str]]
    ) -> list[bool | LockError | InvalidArgument | LockNameError]:
        """:meth:`reap` for many leases in one pipelined round trip.

        Args:
            items: ``(name, owner, renewed_ms)`` per lease.

        Returns:
            Per item: whether it was deleted; or the :class:`LockError` (with ``name``,
            ``owner``) of an item Redis refused; or the :class:`InvalidArgument` /
            :class:`LockNameError` of an item that cannot be asked for (a malformed lease: it
            is not sent, the others are).

        Raises:
            LockStoreUnavailable: The round trip failed.
        """
        results: list[Any] = []
        valid: list[tuple[int, str, str, str]] = []
        for name, owner, renewed_ms in items:
            try:
                valid.append((len(results), _name(name), _owner(owner), _renewed_ms(renewed_ms)))
            except (InvalidArgument, LockNameError) as exc:
                results.append(exc)
                continue
            results.append(None)
        if not valid:
            return results
        if not self._probed:
            self.check_permissions(what="reap")
        calls = [
            self._reap_request(name, owner, renewed_ms) for _n, name, owner, renewed_ms in valid
        ]
        try:
            replies = route.evalsha_many(self.client, self._reap, calls)
        except STORE_ERRORS as exc:
            raise store_error(exc, "reap") from exc
        for (n, name, owner, _renewed), reply in zip(valid, replies):
            results[n] = (
                store_error(reply, "reap", key=self.key(name), name=name, owner=owner)
                if isinstance(reply, Exception)
                else bool(reply)
            )
        return results

    def extend(self, name: str, owner: str, ttl: float) -> bool:
        """Reset the lease's TTL if ``owner`` holds it.

        Args:
            name: The lock name.
            owner: The owner token.
            ttl: The new TTL in seconds.

        Returns:
            True when extended; False (nothing changed) when the key is gone or another
            owner holds it.
        """
        name, owner, ttl = _name(name), _owner(owner), _ttl(ttl)
        return bool(
            self._call(
                self._extend,
                [self.key(name)],
                [owner, _ttl_ms(ttl)],
                "extend",
                name,
                owner,
            )
        )

    def owned(self, name: str, owner: str) -> float | None:
        """Whether ``owner`` holds the lease, in one round trip (a read: a replica answers).

        Args:
            name: The lock name.
            owner: The owner token.

        Returns:
            Seconds left on the lease if ``owner`` holds it, else None.
        """
        name, owner = _name(name), _owner(owner)
        result = self._call(
            self._owned, [self.key(name)], [owner], "ownership check", name, owner, writes=False
        )
        return _owned_seconds(result)

    def extend_many(
        self, items: Iterable[tuple[str, str, float]], chunk: int = EXTEND_CHUNK
    ) -> list[bool]:
        """Extend many leases in one pipelined round trip (the heartbeat's renewals).

        The leases go ``chunk`` at a time to one script call each, every call written to
        one connection before any reply is read (Redis runs the first call while the next
        is encoded), so Redis is never blocked for long by one call.

        Args:
            items: ``(name, owner, ttl seconds)`` per lease.
            chunk: Leases per script call.

        Returns:
            One bool per item, as :meth:`extend`.

        Raises:
            LockStoreUnavailable: The round trip failed or Redis refused a call.
            LockStoreMisconfigured: Redis refused a permission or our credentials.
        """
        items = self._checked_items(items)
        chunk = _argument(check_count, chunk, "chunk", minimum=1, maximum=MAX_SCAN_COUNT)
        try:
            if not self._probed:
                self.check_permissions(what="renewal")
            replies = route.evalsha_many(
                self.client, self._extend_many, _extend_many_calls(self.prefix, items, chunk)
            )
        except STORE_ERRORS as exc:
            raise _unavailable_unless_misconfigured(exc, "renewal") from exc
        return _extend_many_results(replies)

    def scan_keys(
        self, cursor: int = 0, count: int = 500, match: str = "*"
    ) -> tuple[int, list[str]]:
        """One ``SCAN`` step over the lease keys, key names only. Never ``KEYS``.

        Args:
            cursor: The cursor of the previous step (0 to start).
            count: SCAN's hint of keys examined per step.
            match: A glob the lock names must match.

        Returns:
            ``(next_cursor, keys)``; ``next_cursor`` 0: the scan is complete.
        """
        cursor, count, match = self._checked_scan(cursor, count, match)
        try:
            cursor, keys = self.client.scan(
                cursor=cursor, match=lease_key(glob_escape(self.prefix), match), count=count
            )
        except STORE_ERRORS as exc:
            raise _unavailable_unless_misconfigured(exc, "scan") from exc
        return int(cursor), [wire.text(key) for key in keys]

    @staticmethod
    def _checked_items(items: Iterable[tuple[str, str, float]]) -> list[tuple[str, str, float]]:
        """``items`` of :meth:`extend_many` as a list, each name, owner and TTL validated."""
        checked = []
        for item in items:
            name, owner, ttl = item
            checked.append((_name(name), _owner(owner), _ttl(ttl)))
        return checked

    @staticmethod
    def _checked_scan(cursor: Any, count: Any, match: Any) -> tuple[int, int, str]:
        """The arguments of :meth:`scan_keys`, validated."""
        # 2 ** 80: a Redis Cluster cursor carries a slot above Redis's own 64-bit cursor.
        cursor = _argument(check_count, cursor, "cursor", maximum=2**80)
        count = _argument(check_count, count, "count", minimum=1, maximum=MAX_SCAN_COUNT)
        if not isinstance(match, str) or not match or len(match) > MAX_NAME_LENGTH:
            raise InvalidArgument(
                f"match must be a glob of 1 to {MAX_NAME_LENGTH} characters, got {shown(match)}",
                argument="match",
            )
        return cursor, count, match

    def read_leases(self, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        """Read many leases by one script call.

        Each hash comes back as one JSON string (parsing thousands of small RESP replies in
        Python cost more than the scan itself).

        Args:
            keys: A list (or other iterable) of key names, as :meth:`scan_keys` gives.

        Returns:
            Key -> the lease as :meth:`inspect` returns it; None for a key gone since it was
            listed or not a lease hash (logged: one stray key cannot blind the admin, ``ls``
            and the reaper). A key whose name was not UTF-8 (listed with U+FFFD in place of
            the bad bytes, so it cannot be read back) comes out malformed.

        Raises:
            InvalidArgument: ``keys`` is a str or bytes, or holds something else than str.
        """
        keys = self._checked_keys(keys)
        if not keys:
            return {}
        try:
            [replies] = route.evalsha_many(self.client, self._scan_fields, [(keys, [])])
        except STORE_ERRORS as exc:
            raise _unavailable_unless_misconfigured(exc, "scan") from exc
        if isinstance(replies, Exception):
            raise _unavailable_unless_misconfigured(replies, "scan", refused=True)
        return self._parse_scan_fields(keys, replies)

    @staticmethod
    def _checked_keys(keys: Any) -> list[str]:
        """The ``keys`` of :meth:`read_leases` as a list of str, validated."""
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
            raise InvalidArgument(
                f"keys must be a list of key names, got {shown(keys)}", argument="keys"
            )
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str):
                raise InvalidArgument(
                    f"keys must be a list of key names (str), got an item {shown(key)}",
                    argument="keys",
                )
        return cast(list[str], keys)

    def _parse_scan_fields(
        self, keys: list[str], replies: list[Any]
    ) -> dict[str, dict[str, Any] | None]:
        found: dict[str, dict[str, Any] | None] = {}
        for key, doc, pttl in zip(keys, replies[::2], replies[1::2]):
            doc = wire.text(doc)
            unreadable = False
            try:
                fields = json.loads(doc) if doc else None
            except ValueError:
                fields, unreadable = None, True
            if unreadable or (fields is not None and not isinstance(fields, dict)):
                info: dict[str, Any] = {"malformed": "hash: not readable"}
            elif not fields and "\ufffd" in key and wire.text(pttl) == "none":
                # SCAN listed a name that was not UTF-8: as decoded it names no key, so it
                # is shown (escaped) rather than dropped; the reaper skips it.
                found[key] = {
                    "key": _escaped(key),
                    "name": _escaped(_name_of(key)),
                    "ttl": None,
                    "malformed": "key: not UTF-8 (cannot be read back)",
                }
                continue
            elif not fields:
                if not doc and wire.text(pttl) != "none":
                    log_event(
                        "scan_skipped",
                        logging.WARNING,
                        key=key,
                        error=f"WRONGTYPE a {wire.text(pttl)}, not a lease hash",
                    )
                found[key] = None  # else expired between the listing and the read
                continue
            else:
                info = unpack_fields(fields)
            info["key"] = key
            info["name"] = _name_of(key)
            info["ttl"] = pttl / 1000.0 if isinstance(pttl, int) and pttl > 0 else None
            found[key] = info
        return found

    def scan(
        self, cursor: int = 0, count: int = 500, match: str = "*"
    ) -> tuple[int, list[dict[str, Any]]]:
        """One ``SCAN`` step over the leases (:meth:`scan_keys`, then :meth:`read_leases`).

        Never ``KEYS``: memory stays flat however many leases Redis holds.

        Args:
            cursor: The cursor of the previous step (0 to start).
            count: SCAN's hint of keys examined per step, not a page size; a step can
                return fewer or more leases.
            match: A glob the lock names must match.

        Returns:
            ``(next_cursor, leases)``: ``next_cursor`` is 0 when the scan is complete; each
            lease is a dict as :meth:`inspect` returns.
        """
        cursor, keys = self.scan_keys(cursor, count, match)
        found = self.read_leases(keys)
        return cursor, [info for info in found.values() if info is not None]

    def iter_leases(self, match: str = "*", count: int = 1000) -> Iterator[dict[str, Any]]:
        """Every held lease, as :meth:`scan` returns them.

        A lease acquired or released during the iteration may or may not be seen, as with
        SCAN.

        Args:
            match: A glob the lock names must match.
            count: SCAN's hint of keys examined per step.

        Yields:
            One dict per lease.
        """
        cursor = 0
        while True:
            cursor, leases = self.scan(cursor, count, match)
            yield from leases
            if cursor == 0:
                return

    def inspect(self, name: str) -> dict[str, Any] | None:
        """Read one lease.

        Args:
            name: The lock name.

        Returns:
            The lease's stored fields (``owner``, ``fence``, ``acquired_ms``,
            ``renewed_ms``, ``ttl_ms`` and the metadata entries, all strings) plus ``name``,
            ``key`` and ``ttl`` (seconds left, float); None when not held, or when the key
            is not a lease hash (logged ``scan_skipped``, as a scan does). A hash that cannot
            be read as a lease comes out with a ``malformed`` entry saying why.

        Raises:
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the read (ACL).
        """
        key = self.key(_name(name))
        reply = self._call(self._scan_fields, [key], [], "inspect", name, writes=False)
        return _inspected(self, key, name, reply)

    def history(self, name: str, count: int = 50, *, offset: int = 0) -> list[HistoryEntry]:
        """A name's history (:mod:`celery_steplock.history`), newest first: one call
        (``TIME``, ``TYPE``, ``LRANGE``; a read, a replica answers).

        Args:
            name: The lock name.
            count: How many stored entries at most, 1 to 10,000 (the inferred ``expired``
                entries come on top).
            offset: Stored entries to skip from the newest (the next page: the previous
                page's ``offset + count``; entries appended meanwhile shift it).

        Returns:
            :class:`~celery_steplock.history.HistoryEntry` items, newest first; entries
            older than ``steplock_history_max_age`` (this store's) left out. An entry that
            cannot be read is one ``malformed`` entry; a key that is no list gives one
            ``malformed`` entry naming its type. Empty when the name has no history (or
            the history is off and none was left).

        Raises:
            InvalidArgument: ``count`` or ``offset`` is off.
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the read (ACL: ``lrange``, ``type``).
        """
        name = _name(name)
        count = _argument(check_count, count, "count", minimum=1, maximum=10_000)
        offset = _argument(check_count, offset, "offset", maximum=MAX_HISTORY_MAX_ENTRIES)
        key = history_key(self.prefix, name)
        reply = self._call(
            self._history_read,
            [key],
            [str(offset), str(offset + count - 1)],
            "history",
            name,
            writes=False,
        )
        return _history_entries(reply, key, self.history_config, offset)

    def record_history(
        self,
        name: str,
        event: str,
        *,
        owner: str | None = None,
        fence: int | None = None,
        task_id: str | None = None,
        reason: str | None = None,
        by: str | None = None,
    ) -> str | None:
        """Append an event only a client sees (``lost``) to a name's history: one call
        (``TIME``, ``LPUSH``, ``LTRIM`` past the cap, ``PEXPIRE``).

        Args:
            name: The lock name.
            event: One of :data:`celery_steplock.history.EVENTS`.
            owner: The owner token concerned.
            fence: Its fencing token.
            task_id: Its task id.
            reason: Why (text, cut to 200 characters).
            by: Who (text, cut to 200 characters).

        Returns:
            The history's key; None when this store keeps no history.

        Raises:
            InvalidArgument: ``event`` is not one of the events.
            LockStoreUnavailable: Redis cannot be reached.
            LockStoreMisconfigured: Redis refused the write (ACL: ``lpush``).
        """
        request = _history_add_request(
            self.prefix, self.history_config, name, event, owner, fence, task_id, reason, by
        )
        if request is None:
            return None
        keys, args = request
        self._call(self._history_add, keys, args, "history", _name(name), owner)
        return keys[0]


def _history_add_request(
    prefix: str,
    config: HistoryConfig | None,
    name: str,
    event: str,
    owner: str | None,
    fence: int | None,
    task_id: str | None,
    reason: str | None,
    by: str | None,
) -> tuple[list[str], list[str]] | None:
    """KEYS and ARGV of :data:`~celery_steplock._redis.scripts.lease.HISTORY_ADD` for
    ``record_history`` (the sync and the async store's): None when ``config`` is None (no
    history kept); ``reason`` and ``by`` cut to 200 characters.

    Raises:
        InvalidArgument: ``event`` is not one of the events (``expired`` is only inferred),
            or ``name`` is not a lock name.
    """
    if config is None:
        return None
    if event not in HISTORY_EVENTS or event == "expired":
        raise InvalidArgument(
            f"event must be one of {', '.join(HISTORY_EVENTS[:-1])}, got {shown(event)}",
            argument="event",
        )
    entry = encode_entry(
        event,
        owner=owner,
        fence=fence,
        task_id=task_id,
        reason=None if reason is None else str(reason)[:200],
        by=None if by is None else str(by)[:200],
    )
    return [history_key(prefix, _name(name))], [*config.args, entry]


def _history_entries(
    reply: Any, key: str, config: HistoryConfig | None, offset: int = 0
) -> list[HistoryEntry]:
    """HISTORY_READ's reply as entries, newest first (see :meth:`RedisLeaseStore.history`)."""
    try:
        seconds, micros, kind = (wire.text(part) for part in reply[:3])
        now = int(seconds) + int(micros) / 1e6
    except (TypeError, ValueError, IndexError):
        return [HistoryEntry(id="?", at=0.0, event="malformed", reason="unreadable reply")]
    if kind == "none":
        return []
    if kind != "list":
        return [
            HistoryEntry(
                id="?", at=now, event="malformed", reason=f"{key} is a {kind}, not a list"
            )
        ]
    raw = reply[3] if len(reply) > 3 else []
    max_age = config.max_age if config is not None else None
    return parse_entries(raw, now=now, max_age=max_age, offset=offset)


def _inspected(store: Any, key: str, name: str, reply: Any) -> dict[str, Any] | None:
    """SCAN_FIELDS's reply for one lease as ``inspect`` returns it (the sync and the async
    store's one reading: a key that is not a lease hash reads as none, logged, as in a
    scan; a hash that is not readable comes out ``malformed``)."""
    info = RedisLeaseStore._parse_scan_fields(store, [key], reply).get(key)
    if info is not None:
        info["name"] = name
    return info


def _renewed_ms(value: Any) -> str:
    # "" is a lease without the field (as the reaper passes it); else Redis milliseconds.
    text = str(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if text is None or (text and not text.isdigit()) or len(text) > 20:
        raise InvalidArgument(
            f"renewed_ms must be the lease's renewed_ms field (digits, or "
            f"empty), got {shown(value)}",
            argument="renewed_ms",
        )
    return text


def _unavailable_unless_misconfigured(
    exc: BaseException, what: str, *, refused: bool = False
) -> LockError:
    # These paths report any Redis error as LockStoreUnavailable (a renewal, a scan are
    # retried), except a refused permission or credentials: a configuration error.
    error = store_error(exc, what)
    if isinstance(error, LockStoreMisconfigured):
        return error
    if refused:
        return LockStoreUnavailable(f"lock store refused the {what}: {redact(exc)}")
    return LockStoreUnavailable(f"lock store unavailable during {what}: {redact(exc)}")


class ClusterLeaseStore(cluster.ClusterStoreMixin, RedisLeaseStore):
    """:class:`RedisLeaseStore` over a ``redis.cluster.RedisCluster``.

    Renewals, reaps and reads of many leases are split by slot and pipelined per node, scans
    walk every primary (see :mod:`celery_steplock._redis.cluster`).
    ``RedisLeaseStore(cluster_client)`` makes one.
    """


#: The store's former name, kept so that old imports keep working.


_stores: dict[tuple[Any, ...], RedisLeaseStore] = {}
_stores_guard = threading.Lock()


def get_lease_store(app: Any, settings: Settings | None = None) -> RedisLeaseStore:
    """The lease store of an app's settings, one per distinct configuration per process.

    Shared by every task, heartbeat and operator tool of the process.

    Args:
        app: The Celery app.
        settings: Its :class:`~celery_steplock.conf.Settings`, when already made.

    Returns:
        The store of ``steplock_redis_url``, the transport, TLS and client-factory settings
        of :mod:`celery_steplock.clients`, ``steplock_redis_cluster``,
        ``steplock_socket_timeout``, ``steplock_key_prefix``, ``steplock_fence_ttl``,
        ``steplock_max_waiters``, ``steplock_name_secret`` and the ``steplock_history*``
        settings.

    Raises:
        ImproperlyConfigured: One of those settings is invalid (naming it).
    """
    settings = settings or Settings(app)
    config = ClientConfig(settings)
    ident = (
        config.identity,
        settings.key_prefix,
        settings.fence_ttl,
        settings.max_waiters,
        settings.name_secret,
        settings.history,
        settings.history_max_entries,
        settings.history_max_age,
    )
    store = _stores.get(ident)
    if store is None:
        with _stores_guard:
            store = _stores.get(ident)
            if store is None:
                store = RedisLeaseStore(
                    config.client(),
                    prefix=ident[1],
                    fence_ttl=ident[2],
                    waiter_client=config.waiter_client(),
                    max_waiters=ident[3],
                    name_secret=ident[4],
                    history=ident[5],
                    history_max_entries=ident[6],
                    history_max_age=ident[7],
                )
                _stores[ident] = store
    return store


#: Old names kept for one release; using one warns (DeprecationWarning).
_DEPRECATED = {
    "RedisStepLock": ("RedisLeaseStore", RedisLeaseStore),
    "get_lock": ("get_lease_store", get_lease_store),
}


def release_after_commit(
    store: RedisLeaseStore,
    lease: Lease,
    sender: Any,
    *,
    wait: bool = True,
    outcome: str | None = None,
) -> None:
    """Release ``lease`` once its holder committed, and send ``lock_released`` when it was
    still held. Errors are logged (``release_failed``), never raised: a failed release only
    delays the next holder by the lease's TTL (commit first, release after).

    With ``wait=False`` (``steplock_release_wait`` off) the release is written without
    waiting for its reply (:meth:`RedisLeaseStore.release_later`) where the store can; the
    holder's visible cost is then its acquire and its ownership check. Redis deletes the
    lease and wakes a waiter as soon as it reads the command; ``lock_released`` (with the
    ``hold_seconds`` up to the write) or ``release_failed`` follows when the reply is read:
    at the process's next release, :func:`drain_releases`, or the worker's shutdown.

    Args:
        store: the lease store the lease was acquired from.
        lease: the lease.
        sender: the sender of the signal (the task, or a guarded step).
        wait: False: do not wait for the reply where the store can defer it.
        outcome: The execution's outcome, recorded in the name's history with the release
            (:data:`celery_steplock.history.OUTCOMES`; None: not recorded).
    """
    task_id = lease.task_id
    if not wait:
        held = lease.clock() - lease.acquired_at

        def done(released: bool | None, error: LockError | None) -> None:
            _released(lease, sender, released, error, held)

        try:
            if store.release_later(
                lease.name,
                lease.owner,
                done,
                **_history_kwargs(store, outcome, task_id, "release_later"),
            ):
                return
        except Exception as exc:  # noqa: BLE001 - must never mask the holder's outcome
            _released(lease, sender, None, exc, held)
            return
    try:
        released = store.release(
            lease.name, lease.owner, **_history_kwargs(store, outcome, task_id)
        )
    except Exception as exc:  # noqa: BLE001 - must never mask the holder's outcome
        _released(lease, sender, None, exc, 0.0)
        return
    _released(lease, sender, released, None, lease.clock() - lease.acquired_at)


def _history_kwargs(
    store: Any, outcome: str | None, task_id: str | None, method: str = "release"
) -> dict[str, Any]:
    # The history's arguments of a release, for a store that keeps a history; a store of
    # another kind, or whose release was replaced on the instance (a wrapper, a test
    # double), takes release(name, owner) alone.
    if getattr(store, "history_config", None) is None or method in getattr(store, "__dict__", ()):
        return {}
    return {"outcome": outcome, "task_id": task_id}


def _released(
    lease: Lease, sender: Any, released: bool | None, error: BaseException | None, held: float
) -> None:
    # The outcome of a release after commit: logged when it failed, signalled when it
    # deleted the lease; never raises (a receiver's error is logged by emit).
    if error is not None:
        log_event("release_failed", logging.WARNING, key=lease.key, owner=lease.owner, error=error)
    elif released:
        # DEBUG: a task's INFO line is its execution_done, which carries hold_seconds.
        emit(
            signals.lock_released,
            sender,
            logging.DEBUG,
            forced=False,
            hold_seconds=held,
            **lease_fields(lease),
        )


class WaitRegistry:
    """The waits in progress in this process, for the metrics
    (:mod:`celery_steplock.contrib.prometheus`): a lease waited for
    (:meth:`RedisLeaseStore.acquire` with ``wait``, from its first refusal: ``kind`` "lease",
    ``label`` the task name from the metadata, "" without one) and a concurrency-limit slot
    (:meth:`~celery_steplock.patterns.concurrency.ConcurrencyLimit.acquire` with ``wait``, from
    its first denial: ``kind`` "concurrency", ``label`` the limit key).

    Touched only when a wait really happens (an acquire granted at once never calls it):
    :meth:`start` is a dict insert, :meth:`end` a delete, each followed under the registry's
    lock by ``listener(kind, label, count, oldest)`` when one is set (``count``: waits of
    that kind and label now; ``oldest``: the oldest one's start, ``time.time()`` seconds,
    None when none). A listener that raises is ignored: a wait never fails for a metric.
    A forked child starts with none of its parent's waits (its threads are not copied)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waits: dict[int, tuple[str, str, float]] = {}
        self._tokens = iter(range(1, 1 << 62))
        self.listener: Callable[[str, str, int, float | None], Any] | None = None

    def start(self, kind: str, label: str) -> int:
        """Record a wait starting now; returns the token :meth:`end` takes."""
        with self._lock:
            token = next(self._tokens)
            self._waits[token] = (kind, label, time.time())
            self._changed(kind, label)
        return token

    def end(self, token: int) -> None:
        """Forget the wait of ``token`` (granted, given up or failed); twice is harmless."""
        with self._lock:
            entry = self._waits.pop(token, None)
            if entry is not None:
                self._changed(entry[0], entry[1])

    def current(self) -> list[tuple[str, str, float]]:
        """``(kind, label, started)`` of every wait in progress (``started``: time.time())."""
        with self._lock:
            return list(self._waits.values())

    def _changed(self, kind: str, label: str) -> None:
        listener = self.listener
        if listener is None:
            return
        starts = [s for k, n, s in self._waits.values() if k == kind and n == label]
        try:
            listener(kind, label, len(starts), min(starts, default=None))
        except Exception:  # noqa: BLE001 - a wait never fails for its metrics
            pass

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._waits = {}


#: This process's :class:`WaitRegistry`.
WAITS = WaitRegistry()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WAITS._forked)


def drain_releases(block: bool = True) -> int:
    """Read the replies of this process's releases written without waiting
    (:meth:`RedisLeaseStore.release_later`), so that their ``lock_released`` signals and
    ``release_failed`` lines are sent now; ``block``: wait for the replies not yet arrived
    (each at most the socket timeout), else only read those arrived. Called at a worker's
    (or pool process's) warm shutdown. Returns how many replies were read; never raises."""
    try:
        return wire.drain_all(block)
    except Exception as exc:  # noqa: BLE001 - a shutdown path
        log_event("release_failed", logging.WARNING, error=exc)
        return 0


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new_name, value = _DEPRECATED[name]
        warnings.warn(
            f"celery_steplock.{name} is deprecated; use celery_steplock.{new_name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
