"""Idempotency records: a call whose key completed returns its recorded result without
running again.

A record key is deterministic: the HMAC-SHA256 (keyed with ``steplock_name_secret``, 64 hex
digits, :func:`record_key`) of a *namespace* (the task's name, a function's qualified name, a
view's), a *resource key* (the rendered ``idempotency_key`` template, or the keyed hash of
every argument) and the policy *version*, so a result recorded under another version is never
replayed. A record is

``locked``
    an execution holds it (owner-keyed, with the lock TTL ``steplock_idempotency_lock_ttl``,
    600 s by default): a concurrent call with the same key and arguments gets
    :class:`~celery_steplock.exceptions.IdempotencyInProgress` (a task re-queues itself). The
    process's heartbeat (:mod:`celery_steplock.heartbeat`) renews the record every
    ``lock TTL * steplock_renewal_ratio`` seconds while the body runs, owner-checked, as it
    renews leases, so a body may run longer than the lock TTL; a crashed holder's renewals
    stop, its record expires after the lock TTL and the next call runs, once.
``completed``
    the body returned: the result as the serializer returned it (kombu's, ``"json"`` by
    default), the serializer, content type and encoding, the fingerprint of the arguments,
    created/completed/expiry times (Redis server time). A call with the key and the same
    arguments returns the recorded result without running its body until the record expires
    (``idempotency_ttl``, 24 h by default) or is invalidated (:meth:`Idempotency.invalidate`,
    :func:`invalidate`).
``failed``
    the body raised: errors are never recorded as results; the record keeps the error's type
    for operators and the next call runs again.

A call with a key whose locked or completed record was made with other arguments is refused
with :class:`~celery_steplock.exceptions.IdempotencyKeyReused`. Results are stored as the
serializer returns them: never return credentials, secrets or personal data from an
idempotent call; return hashes or opaque references.

Stores (``steplock_idempotency_store``): ``"redis"``, one hash per record, every transition
one Lua script (:mod:`celery_steplock._redis.scripts.idempotency`); or ``"database"``, the Django model
:class:`~celery_steplock.contrib.django.models.IdempotencyRecord` as the truth with Redis as a
cache of completed records (:mod:`celery_steplock.contrib.django.idempotency`).

Forms: the task options ``idempotency_key`` / ``idempotency_version`` / ``idempotency_ttl``
(the first admission gate: a replay costs nothing else), the decorator :func:`idempotent`,
the :class:`Idempotency` object (``begin``/``call``), and the Django view decorator and
middleware of :mod:`celery_steplock.contrib.django.idempotency`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import inspect
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping

from .. import _django, calls, signals
from .._checks import (
    MAX_IDEMPOTENCY_TTL,
    MIN_IDEMPOTENCY_TTL,
    check_count,
    check_seconds,
    shown,
)
from .._loops import background
from .._redis import wire
from .._redis.scripts.idempotency import BEGIN, CACHE, COMPLETE, EXTEND, FAIL, RELEASE
from ..clients import async_client_for
from ..conf import Settings
from ..events import emit, log_event
from ..exceptions import (
    IdempotencyInProgress,
    IdempotencyKeyReused,
    ImproperlyConfigured,
    LockError,
    LockNameError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
)
from ..keys import (
    _key,
    _keyed,
    bind_arguments,
    canonical_json,
    idempotency_key,
    idempotency_record_key,
    name_from_arguments,
    template_fields,
)
from ..lease import Lease, drift
from ..lock import store_error
from ._base import check_on_store_error, outage, resolve_policy, target
from .gates import NOT_RUN, Replay

__all__ = [
    "Idempotency",
    "Record",
    "IdempotentCall",
    "IdempotentBlock",
    "Ticket",
    "RedisRecords",
    "idempotent",
    "invalidate",
    "ainvalidate",
    "record_key",
    "fingerprint",
    "OPTIONS",
    "gate",
    "STATUSES",
    "MAX_VERSION_LENGTH",
]

STATUSES = ("locked", "completed", "failed")
#: ``idempotency_version`` / ``version=``: a str (or int) of 1 to this many printable characters.
MAX_VERSION_LENGTH = 64

#: The ``retry_after`` of IdempotencyInProgress at most, seconds (the holder's remaining
#: lock TTL when shorter; the exception's ``context["lock_ttl_left"]`` has that).
IN_PROGRESS_RETRY = 1.0

#: The task options of the gate (:mod:`celery_steplock.patterns.gates`).
OPTIONS = frozenset({"idempotency_key", "idempotency_version", "idempotency_ttl"})


# -- keys ---------------------------------------------------------------------------------------


def check_version(value: Any, name: str = "idempotency_version") -> str:
    """``value`` (a str or int, not a bool) as the version string, else ImproperlyConfigured."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_VERSION_LENGTH
        or not value.isprintable()
    ):
        raise ImproperlyConfigured(
            f"{name} must be a str or int of 1 to {MAX_VERSION_LENGTH} printable characters, "
            f"got {shown(value)}",
            setting=name,
        )
    return value


def record_key(
    namespace: str, resource: str, version: str | int = "1", *, secret: bytes | str | None = None
) -> str:
    """The record key of ``resource`` in ``namespace`` under policy ``version``: 64 hex
    digits, :func:`celery_steplock.keys.idempotency_key` (HMAC-SHA256 keyed with the name
    secret; None: the public key) over the namespace and ``"<resource>\\0v<version>"``, so
    a version bump gives another key and whoever sees a key learns neither part."""
    return idempotency_key(secret, namespace, f"{resource}\0v{check_version(version, 'version')}")


def fingerprint(arguments: Mapping[str, Any], *, secret: bytes | str | None = None) -> str:
    """The fingerprint of a call's bound arguments: 64 hex digits, HMAC-SHA256 keyed with the
    name secret over their canonical JSON (:func:`celery_steplock.keys.canonical_json`:
    ``LockNameError`` for an argument JSON cannot encode). The record keeps it, never the
    arguments."""
    mac = _keyed(_key(secret), b"idempotency-fingerprint\0")
    mac.update(canonical_json(arguments).encode())
    return mac.hexdigest()


def _fingerprint_bytes(parts: list[bytes], secret: bytes | str | None) -> str:
    mac = _keyed(_key(secret), b"idempotency-fingerprint\0")
    for part in parts:
        mac.update(b"%d:%s" % (len(part), part))
    return mac.hexdigest()


# -- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One idempotency record as a store holds it. Times are seconds since the epoch (float;
    Redis server time for the Redis store, the database's clock for the database store),
    None when not reached. ``payload`` is the serialized result (``completed`` only)."""

    key: str
    status: str
    fingerprint: str
    namespace: str = ""
    version: str = ""
    owner: str | None = None
    created_at: float | None = None
    locked_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expires_at: float | None = None
    serializer: str | None = None
    content_type: str | None = None
    content_encoding: str | None = None
    payload: bytes | str | None = None
    error: str | None = None
    attempts: int = 0

    def result(self, serializer: str | None = None) -> Any:
        """The recorded result, deserialized; only ``serializer``'s content type (default:
        the one it was recorded with) is accepted (a pickle payload planted in the store is
        refused unless pickle is the configured serializer)."""
        from kombu.serialization import loads, registry  # type: ignore[attr-defined]  # stubs

        name = serializer or self.serializer or "json"
        accept = {registry.name_to_type.get(name, name)}
        # kombu takes None for each (no payload, its default type and encoding); not its stubs.
        return loads(
            self.payload,  # type: ignore[arg-type]
            self.content_type,  # type: ignore[arg-type]
            self.content_encoding,  # type: ignore[arg-type]
            accept=accept,
        )


@dataclass(frozen=True)
class RecordDecision:
    """What a store's ``begin`` decided: ``outcome`` "locked" (the caller holds the record),
    "replay" (``record`` is completed), "reused" (``status`` is the record's), "in_progress"
    (``retry_after`` seconds left on the holder's lock)."""

    outcome: str
    record: Record | None = None
    status: str | None = None
    retry_after: float = 0.0


#: The former name of :class:`RecordDecision`, kept for one release.
Decision = RecordDecision


@dataclass(frozen=True)
class Stored:
    """A serialized result: what a store writes for a completion."""

    payload: str
    serializer: str
    content_type: str
    content_encoding: str
    b64: bool

    @classmethod
    def dump(cls, result: Any, serializer: str) -> Stored:
        from kombu.serialization import dumps

        content_type, content_encoding, payload = dumps(result, serializer=serializer)
        if isinstance(payload, bytes):
            try:
                text = payload.decode() if content_encoding != "binary" else None
            except UnicodeDecodeError:
                text = None
            if text is None:
                return cls(
                    base64.b64encode(payload).decode(),
                    serializer,
                    content_type,
                    content_encoding,
                    True,
                )
            payload = text
        return cls(payload, serializer, content_type, content_encoding, False)

    def raw(self) -> bytes | str:
        return base64.b64decode(self.payload) if self.b64 else self.payload


def _ms(value: Any) -> float | None:
    value = wire.text(value)
    if value in (None, ""):
        return None
    return int(value) / 1000.0


class RedisRecords:
    """Idempotency records in Redis: the hash ``<prefix>:idem:{<record key>}`` with a TTL,
    every transition one Lua script (Redis server time; one key, so one slot on Cluster).

    ``client`` a redis-py client (or ``RedisCluster``); ``prefix`` the key prefix (the lease
    store's, ``steplock_key_prefix``). Raises LockStoreUnavailable (or LockStoreMisconfigured)
    when Redis cannot be reached or refuses.
    """

    _begin = wire.Script(BEGIN)
    _complete = wire.Script(COMPLETE)
    _fail = wire.Script(FAIL)
    _release = wire.Script(RELEASE)
    _extend = wire.Script(EXTEND)
    _cache = wire.Script(CACHE)

    def __init__(self, client: Any, prefix: str = "steplock"):
        self.client = client
        self.prefix = prefix

    def redis_key(self, key: str) -> str:
        """The Redis key of record ``key``."""
        return idempotency_record_key(self.prefix, key)

    def _eval(self, script: wire.Script, key: str, args: list[str], what: str) -> calls.Steps[Any]:
        return (yield calls.Eval(script, [self.redis_key(key)], args, what))

    def _aclient(self) -> Any:
        """The ``redis.asyncio`` twin of :attr:`client` for the running event loop
        (:func:`celery_steplock.clients.async_client_for`)."""
        return async_client_for(self.client)

    # -- the operations, written once as steps (celery_steplock.calls) ------------------------

    def begin_steps(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> calls.Steps[RecordDecision]:
        """The steps of :meth:`begin` (one script call), for :func:`celery_steplock.calls.run`
        and :func:`~celery_steplock.calls.arun`."""
        reply = yield from self._eval(
            self._begin,
            key,
            [owner, fingerprint, str(max(1, int(lock_ttl * 1000))), namespace, version],
            "idempotency begin",
        )
        return _decision([wire.text(v) for v in reply], key, fingerprint, namespace, version)

    def complete_steps(
        self,
        key: str,
        owner: str,
        fingerprint: str,
        stored: Stored,
        ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> calls.Steps[bool]:
        """The steps of :meth:`complete`."""
        reply = yield from self._eval(
            self._complete,
            key,
            [
                owner,
                fingerprint,
                stored.payload,
                stored.serializer,
                stored.content_type,
                stored.content_encoding,
                "1" if stored.b64 else "0",
                str(max(1, int(ttl * 1000))),
                namespace,
                version,
            ],
            "idempotency complete",
        )
        return int(reply[0]) != 0

    def fail_steps(self, key: str, owner: str, error: str, ttl: float) -> calls.Steps[bool]:
        """The steps of :meth:`fail`."""
        reply = yield from self._eval(
            self._fail, key, [owner, error, str(max(1, int(ttl * 1000)))], "idempotency fail"
        )
        return bool(reply)

    def release_steps(self, key: str, owner: str) -> calls.Steps[bool]:
        """The steps of :meth:`release`."""
        return bool((yield from self._eval(self._release, key, [owner], "idempotency release")))

    def extend_many_steps(
        self, items: Iterable[tuple[str, str, float]]
    ) -> calls.Steps[list[bool]]:
        """The steps of :meth:`extend_many` (one pipelined batch)."""
        batch = [
            ([self.redis_key(key)], [owner, str(max(1, int(ttl * 1000)))])
            for key, owner, ttl in items
        ]
        if not batch:
            return []
        try:
            replies = yield calls.EvalMany(self._extend, batch, "idempotency renewal")
        except LockError as exc:  # translated by the driver, with its cause
            raise _renewal_error(exc) from exc.__cause__
        for reply in replies:
            if isinstance(reply, Exception):
                raise _renewal_error(reply)
        return [int(reply) == 1 for reply in replies]

    def invalidate_steps(self, key: str) -> calls.Steps[bool]:
        """The steps of :meth:`invalidate` (one ``DEL``)."""
        redis_key = self.redis_key(key)
        deleted = yield calls.Command(("DEL", redis_key), "idempotency invalidate", key=redis_key)
        return bool(deleted)

    def get_steps(self, key: str) -> calls.Steps[Record | None]:
        """The steps of :meth:`get` (one ``HGETALL``)."""
        redis_key = self.redis_key(key)
        fields = yield calls.Command(("HGETALL", redis_key), "idempotency read", key=redis_key)
        return record_from_hash(key, _pairs(fields))

    def cache_steps(self, record: Record, ttl: float) -> calls.Steps[None]:
        """The steps of :meth:`cache`."""
        yield from self._eval(
            self._cache,
            record.key,
            [str(max(1, int(ttl * 1000))), *_cache_pairs(record)],
            "idempotency cache",
        )

    # -- synchronous ------------------------------------------------------------------------

    def begin(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> RecordDecision:
        """Lock record ``key`` for ``owner`` (``lock_ttl`` seconds), or find it completed,
        locked by another owner, or made with another ``fingerprint``.

        Returns:
            The :class:`RecordDecision`.

        Raises:
            LockStoreUnavailable, LockStoreMisconfigured, LockError: Redis did not answer or
                refused.
        """
        return calls.run(
            self.begin_steps(key, fingerprint, owner, lock_ttl, namespace, version), self.client
        )

    def complete(
        self,
        key: str,
        owner: str,
        fingerprint: str,
        stored: Stored,
        ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> bool:
        """Record the completion; False when another execution holds or completed it."""
        return calls.run(
            self.complete_steps(key, owner, fingerprint, stored, ttl, namespace, version),
            self.client,
        )

    def fail(self, key: str, owner: str, error: str, ttl: float) -> bool:
        """Mark ``owner``'s locked record failed for ``ttl`` seconds; False when not its."""
        return calls.run(self.fail_steps(key, owner, error, ttl), self.client)

    def release(self, key: str, owner: str) -> bool:
        """Delete ``owner``'s locked record; False when not its."""
        return calls.run(self.release_steps(key, owner), self.client)

    def extend_many(self, items: Iterable[tuple[str, str, float]]) -> list[bool]:
        """Renew running bodies' ``locked`` records (the heartbeat's renewals), one script
        call per record (each lives in its own Cluster slot), pipelined in one round trip.

        Args:
            items: ``(record key, owner token, lock TTL seconds)`` per record.

        Returns:
            One bool per item: True when the record was the owner's and ``locked``, and now
            lives another lock TTL; False (nothing written) when it was completed, failed,
            invalidated, expired or locked by another owner.

        Raises:
            LockStoreUnavailable: The round trip failed or Redis refused a call.
            LockStoreMisconfigured: Redis refused a permission or our credentials.
        """
        return calls.run(self.extend_many_steps(items), self.client)

    def invalidate(self, key: str) -> bool:
        """Delete the record whatever its status; True when there was one."""
        return calls.run(self.invalidate_steps(key), self.client)

    def get(self, key: str) -> Record | None:
        """The record of ``key``, or None."""
        return calls.run(self.get_steps(key), self.client)

    def cache(self, record: Record, ttl: float) -> None:
        """Write ``record`` (completed) as the cache copy of a database record for ``ttl``
        seconds (the database store's fast path)."""
        calls.run(self.cache_steps(record, ttl), self.client)

    # -- asyncio: the same steps on the async twin of the client ----------------------------

    async def abegin(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> RecordDecision:
        """:meth:`begin` on the ``redis.asyncio`` twin of the client (same script, same
        decision, same errors).

        Raises:
            asyncio.CancelledError: Cancelled. The script may have locked the record for
                ``owner`` with its reply unread: a task of the loop
                (one its caller's cancellation cannot stop) then sends the owner-checked
                release (:data:`RELEASE`: only a record ``locked`` by ``owner``, never
                another caller's), as the lease store does for a cancelled acquire, so the
                record is not left locked for ``lock_ttl``. A release that fails is logged
                (``release_failed``): the lock TTL frees the record.
        """
        steps = self.begin_steps(key, fingerprint, owner, lock_ttl, namespace, version)
        try:
            return await calls.arun(steps, self._aclient())
        except asyncio.CancelledError:
            release = functools.partial(self.arelease, key, owner)
            background(_release_after(None, release, key, owner))
            raise

    async def acomplete(
        self,
        key: str,
        owner: str,
        fingerprint: str,
        stored: Stored,
        ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> bool:
        """:meth:`complete` under asyncio."""
        return await calls.arun(
            self.complete_steps(key, owner, fingerprint, stored, ttl, namespace, version),
            self._aclient(),
        )

    async def afail(self, key: str, owner: str, error: str, ttl: float) -> bool:
        """:meth:`fail` under asyncio."""
        return await calls.arun(self.fail_steps(key, owner, error, ttl), self._aclient())

    async def arelease(self, key: str, owner: str) -> bool:
        """:meth:`release` under asyncio."""
        return await calls.arun(self.release_steps(key, owner), self._aclient())

    async def aextend_many(self, items: Iterable[tuple[str, str, float]]) -> list[bool]:
        """:meth:`extend_many` under asyncio: the asyncio heartbeat renews the ``locked``
        records of the running loop's calls through it (:attr:`async_renewals`)."""
        return await calls.arun(self.extend_many_steps(items), self._aclient())

    async def ainvalidate(self, key: str) -> bool:
        """:meth:`invalidate` under asyncio."""
        return await calls.arun(self.invalidate_steps(key), self._aclient())

    async def aget(self, key: str) -> Record | None:
        """:meth:`get` under asyncio."""
        return await calls.arun(self.get_steps(key), self._aclient())

    async def acache(self, record: Record, ttl: float) -> None:
        """:meth:`cache` under asyncio."""
        await calls.arun(self.cache_steps(record, ttl), self._aclient())

    @property
    def async_renewals(self) -> _AsyncRenewals:
        """What the asyncio heartbeat renews these records' ``locked`` holds through: an
        object whose coroutine ``extend_many`` is :meth:`aextend_many` (the asyncio store
        convention: the sync method names, as coroutines); one per store, so the heartbeat
        batches every record of the loop in one round trip."""
        renewals = self.__dict__.get("_async_renewals")
        if renewals is None:
            renewals = self.__dict__["_async_renewals"] = _AsyncRenewals(self)
        return renewals


class _AsyncRenewals:
    """A :class:`RedisRecords`' renewals as the asyncio heartbeat calls them."""

    def __init__(self, records: RedisRecords):
        self.records = records

    async def extend_many(self, items: Iterable[tuple[str, str, float]]) -> list[bool]:
        return await self.records.aextend_many(list(items))


def _decision(
    reply: list[Any], key: str, fingerprint: str, namespace: str, version: str
) -> RecordDecision:
    """The :class:`RecordDecision` of a ``BEGIN`` script reply (texts)."""
    outcome = reply[0]
    if outcome == "locked":
        return RecordDecision("locked")
    if outcome == "in_progress":
        return RecordDecision("in_progress", retry_after=max(0.0, int(reply[1]) / 1000.0))
    if outcome == "reused":
        return RecordDecision("reused", status=reply[1])
    payload, ser, ctype, cenc, b64 = reply[1:6]
    record = Record(
        key=key,
        status="completed",
        fingerprint=fingerprint,
        namespace=namespace,
        version=version,
        created_at=_ms(reply[6]),
        completed_at=_ms(reply[7]),
        expires_at=_ms(reply[8]),
        serializer=ser,
        content_type=ctype,
        content_encoding=cenc,
        payload=base64.b64decode(payload) if b64 == "1" else payload,
    )
    return RecordDecision("replay", record=record)


def _pairs(fields: Any) -> Mapping:
    """An ``HGETALL`` reply as a mapping (a client without its response callback, or a RESP
    version without a map type, gives the flat list)."""
    if isinstance(fields, Mapping):
        return fields
    items = list(fields or ())
    return dict(zip(items[::2], items[1::2]))


def _cache_pairs(record: Record) -> list[str]:
    """The hash fields of a completed record's cache copy (``CACHE``'s ARGV after the TTL)."""
    pairs = [
        "status",
        "completed",
        "fp",
        record.fingerprint,
        "ns",
        record.namespace,
        "ver",
        record.version,
        "ser",
        record.serializer or "",
        "ctype",
        record.content_type or "",
        "cenc",
        record.content_encoding or "",
    ]
    payload = record.payload
    if isinstance(payload, bytes):
        pairs += ["result", base64.b64encode(payload).decode(), "b64", "1"]
    else:
        pairs += ["result", payload or "", "b64", "0"]
    for name, value in (
        ("created_ms", record.created_at),
        ("completed_ms", record.completed_at),
        ("expires_ms", record.expires_at),
    ):
        if value is not None:
            pairs += [name, str(int(value * 1000))]
    return pairs


def _renewal_error(exc: BaseException) -> LockStoreUnavailable | LockStoreMisconfigured:
    # The heartbeat retries an unavailable store and reports a misconfigured one; any other
    # refusal is retried like an outage (the record is lost when its validity runs out).
    error = exc if isinstance(exc, LockError) else store_error(exc, "idempotency renewal")
    if isinstance(error, (LockStoreUnavailable, LockStoreMisconfigured)):
        return error
    return LockStoreUnavailable(f"lock store refused the idempotency renewal: {error}")


def record_from_hash(key: str, fields: Mapping) -> Record | None:
    """A :class:`Record` from a record hash as Redis returns it (None when empty)."""
    if not fields:
        return None
    # A field that does not apply to the status is stored as "" (no HDEL in the scripts).
    f = {wire.text(k): wire.text(v) for k, v in fields.items() if wire.text(v) != ""}
    payload = f.get("result", "") if f.get("status") == "completed" else None
    if payload is not None and f.get("b64") == "1":
        payload = base64.b64decode(payload)
    return Record(
        key=key,
        status=f.get("status", ""),
        fingerprint=f.get("fp", ""),
        namespace=f.get("ns", ""),
        version=f.get("ver", ""),
        owner=f.get("owner"),
        created_at=_ms(f.get("created_ms")),
        locked_at=_ms(f.get("locked_ms")),
        completed_at=_ms(f.get("completed_ms")),
        failed_at=_ms(f.get("failed_ms")),
        expires_at=_ms(f.get("expires_ms")),
        serializer=f.get("ser"),
        content_type=f.get("ctype"),
        content_encoding=f.get("cenc"),
        payload=payload,
        error=f.get("error"),
        attempts=int(f.get("attempts") or 0),
    )


# -- one call -----------------------------------------------------------------------------------


class IdempotentCall:
    """One call's hold on its record, from :meth:`Idempotency.begin` or
    :meth:`Idempotency.abegin`.

    ``replayed`` True: ``result`` is the recorded result (do not run the body). Otherwise
    the caller holds the record (``locked``; or nothing at all when ``unguarded``: the store
    did not answer and the policy is fail open) and ends it with exactly one of
    :meth:`complete`, :meth:`fail`, :meth:`release`, or :meth:`exit` (the admission gate's
    form), or, under asyncio, their coroutine forms :meth:`acomplete`, :meth:`afail`,
    :meth:`arelease`, :meth:`aexit` (same signals, same log events). None of them raises:
    a store error is logged (``idempotency_record_failed``) and the record's lock TTL ends
    it. End a call from :meth:`Idempotency.abegin` with the ``a`` forms: the sync forms
    would block the event loop on a Redis round trip.

    ``lease``: while the caller holds the record, a heartbeat renews it through this
    :class:`~celery_steplock.lease.Lease` (``name`` the record key, ``ttl`` the lock TTL,
    ``fence`` 0): the process's heartbeat thread (:mod:`celery_steplock.heartbeat`) for a
    call from :meth:`Idempotency.begin`; for one from :meth:`Idempotency.abegin`, the
    running event loop's asyncio heartbeat (:mod:`celery_steplock.aio.heartbeat`) for the
    Redis store, the heartbeat thread's ``"database"`` lane for the database store.
    ``lease.lost`` turns true when a renewal found the record no longer the caller's (signal
    ``idempotency_lost``); the body is never interrupted. Each of the methods above stops
    the renewals first. None when replayed or unguarded.
    """

    def __init__(
        self,
        policy: Idempotency,
        key: str,
        fingerprint: str,
        owner: str | None,
        *,
        replayed: bool = False,
        result: Any = None,
        unguarded: bool = False,
        task: Any = None,
        lease: Any = None,  # a Lease: a bare "Lease" is ambiguous in the API reference
    ):
        self.policy = policy
        self.key = key
        self.fingerprint = fingerprint
        self.owner = owner
        self.replayed = replayed
        self.result = result
        self.unguarded = unguarded
        self.task = task
        self.lease = lease
        self.done = replayed or unguarded
        # The heartbeat renewing :attr:`lease` (None: not registered, or not yet).
        self._heartbeat: Any = None
        self._async_heartbeat = False

    def _fields(self) -> dict[str, Any]:
        request = getattr(self.task, "request", None)
        return {
            "key": self.key,
            "name": self.policy.namespace,
            "version": self.policy.version,
            "task_id": getattr(request, "id", None),
            "task_name": getattr(self.task, "name", None),
        }

    # -- the ends, sync ------------------------------------------------------------------------

    def complete(self, result: Any) -> bool:
        """Record ``result`` as the call's (serialized now); True when recorded."""
        if self.done:
            return False
        self.done = True
        self._stop_renewal()
        policy = self.policy
        stored, reason, error = self._dump(result)
        if stored is None:
            self._unrecordable(reason, error)
            self._safely(lambda: policy.store.fail(self.key, self.owner, reason, policy.ttl))
            self._failed(reason)
            return False
        recorded = self._safely(lambda: policy.store.complete(*self._completion(stored)))
        return self._completed(recorded)

    def fail(self, exc: BaseException | None, reason: str | None = None) -> bool:
        """Mark the record failed (kept for operators, with ``reason``, default the error's
        type; the next call runs again)."""
        if self.done:
            return False
        self.done = True
        self._stop_renewal()
        reason = _reason(exc, reason)
        marked = self._safely(
            lambda: self.policy.store.fail(self.key, self.owner, reason, self.policy.ttl)
        )
        self._failed(reason)
        return bool(marked)

    def release(self) -> bool:
        """Drop the lock without recording anything (the body never ran)."""
        if self.done:
            return False
        self.done = True
        self._stop_renewal()
        return bool(self._safely(lambda: self.policy.store.release(self.key, self.owner)))

    def exit(self, exc: BaseException | None, result: Any) -> None:
        """The admission gate's exit: NOT_RUN releases, an exception fails, else completes."""
        if result is NOT_RUN:
            self.release()
        elif exc is not None:
            self.fail(exc)
        else:
            self.complete(result)

    # -- the ends, asyncio ---------------------------------------------------------------------

    async def acomplete(self, result: Any) -> bool:
        """:meth:`complete` under asyncio: the store's ``acomplete`` (the Redis store on the
        ``redis.asyncio`` twin of its client; the database store hops to a thread,
        :class:`~celery_steplock.contrib.django.idempotency.DatabaseRecords`). Returns True
        when recorded; never raises but ``asyncio.CancelledError`` (a completion cancelled
        in flight may or may not be recorded; the record is never left renewed)."""
        if self.done:
            return False
        self.done = True
        await self._astop_renewal()
        policy = self.policy
        stored, reason, error = self._dump(result)
        if stored is None:
            self._unrecordable(reason, error)
            await self._asafely(
                lambda: _astore(policy.store, "fail")(self.key, self.owner, reason, policy.ttl)
            )
            self._failed(reason)
            return False
        recorded = await self._asafely(
            lambda: _astore(policy.store, "complete")(*self._completion(stored))
        )
        return self._completed(recorded)

    async def afail(self, exc: BaseException | None, reason: str | None = None) -> bool:
        """:meth:`fail` under asyncio."""
        if self.done:
            return False
        self.done = True
        await self._astop_renewal()
        reason = _reason(exc, reason)
        marked = await self._asafely(
            lambda: _astore(self.policy.store, "fail")(
                self.key, self.owner, reason, self.policy.ttl
            )
        )
        self._failed(reason)
        return bool(marked)

    async def arelease(self) -> bool:
        """:meth:`release` under asyncio."""
        if self.done:
            return False
        self.done = True
        await self._astop_renewal()
        return bool(
            await self._asafely(
                lambda: _astore(self.policy.store, "release")(self.key, self.owner)
            )
        )

    async def aexit(self, exc: BaseException | None, result: Any) -> None:
        """:meth:`exit` under asyncio: NOT_RUN or a cancellation (``asyncio.CancelledError``)
        releases, another exception fails, else completes."""
        if result is NOT_RUN or isinstance(exc, asyncio.CancelledError):
            await self.arelease()
        elif exc is not None:
            await self.afail(exc)
        else:
            await self.acomplete(result)

    # -- shared by both forms ------------------------------------------------------------------

    def _completion(self, stored: Stored) -> tuple[str, Any, str, Stored, float, str, str]:
        """The store's ``complete``/``acomplete`` arguments: ``(key, owner, fingerprint,
        stored, ttl seconds, namespace, version)``."""
        policy = self.policy
        return (
            self.key,
            self.owner,
            self.fingerprint,
            stored,
            policy.ttl,
            policy.namespace,
            policy.version,
        )

    def _dump(self, result: Any) -> tuple[Stored | None, str, Exception | str]:
        """``result`` serialized, or None with the reason it cannot be recorded."""
        policy = self.policy
        try:
            stored = Stored.dump(result, policy.serializer)
        except Exception as exc:  # noqa: BLE001 - the body's result cannot be recorded
            return None, "unserializable", exc
        size = len(stored.payload)
        if size > policy.max_result_bytes:
            return (
                None,
                "too_large",
                f"the serialized result is {size} bytes, above max_result_bytes "
                f"({policy.max_result_bytes})",
            )
        return stored, "", ""

    def _unrecordable(self, reason: str, error: Exception | str) -> None:
        log_event(
            "idempotency_record_failed",
            logging.ERROR,
            **self._fields(),
            reason=reason,
            error=error,
        )

    def _failed(self, reason: str) -> None:
        emit(
            signals.idempotency_failed, self.task, logging.WARNING, reason=reason, **self._fields()
        )

    def _completed(self, recorded: Any) -> bool:
        if recorded:
            emit(signals.idempotency_completed, self.task, ttl=self.policy.ttl, **self._fields())
        elif recorded is not None:
            log_event(
                "idempotency_record_failed",
                logging.ERROR,
                **self._fields(),
                reason="taken",
                error="another execution holds or completed the record",
            )
        return bool(recorded)

    # -- renewals ------------------------------------------------------------------------------

    def _renew(self, ratio: float) -> None:
        """Register :attr:`lease` with the process's heartbeat, unless the call already
        ended (the database store registers once the record's row is committed)."""
        from ..heartbeat import heartbeat_for

        if self.done or self.lease is None:
            return
        # The store's lane: a database store's renewals run on their own thread.
        heartbeat = heartbeat_for(self.policy.store)
        heartbeat.register(
            self.lease, self.policy.store, ratio=ratio, sender=self.task, on_lost=self._lost
        )
        self._heartbeat = heartbeat
        if self.done:  # ended meanwhile on another thread: never renew an ended record
            self._stop_renewal()

    async def _arenew(self, ratio: float) -> None:
        """Register :attr:`lease` with the running loop's asyncio heartbeat through the
        store's ``async_renewals`` (the Redis store); a store without them (the database
        store, whose renewals must never share the loop) with the heartbeat thread of its
        lane (:meth:`_renew`: a registration takes a lock, never a round trip)."""
        if self.done or self.lease is None:
            return
        renewals = getattr(self.policy.store, "async_renewals", None)
        if renewals is None:
            self._renew(ratio)
            return
        from ..aio.heartbeat import get_async_heartbeat

        heartbeat = get_async_heartbeat()
        heartbeat.register(self.lease, renewals, ratio=ratio, sender=self.task, on_lost=self._lost)
        self._heartbeat, self._async_heartbeat = heartbeat, True

    def _stop_renewal(self) -> None:
        """Stop the heartbeat's renewals of the record before it is completed, failed or
        released (a renewal after it would find the record no longer locked)."""
        if self.lease is None:
            return
        from ..heartbeat import heartbeat_for

        try:
            if self._async_heartbeat:
                # A call from abegin ended by a sync method: the loop's heartbeat drops it.
                self._heartbeat.unregister(self.lease)
                return
            heartbeat_for(self.policy.store).unregister(self.lease)
        except Exception as exc:  # noqa: BLE001 - the record is ended all the same
            self._stop_failed(exc)

    async def _astop_renewal(self) -> None:
        """:meth:`_stop_renewal` under asyncio: the asyncio heartbeat's unregistration is
        a plain call (nothing to cancel: an ended record is never left renewed); the
        heartbeat thread's (which waits for a renewal cycle in flight) runs on a thread."""
        if self.lease is None or self._heartbeat is None:
            # Never registered, or not yet: a registration after the end undoes itself.
            return
        try:
            if self._async_heartbeat:
                self._heartbeat.unregister(self.lease)
            else:
                await asyncio.to_thread(self._heartbeat.unregister, self.lease)
        except Exception as exc:  # noqa: BLE001 - the record is ended all the same
            self._stop_failed(exc)

    def _stop_failed(self, exc: Exception) -> None:
        log_event(
            "idempotency_record_failed",
            logging.ERROR,
            **self._fields(),
            reason="renewal_stop",
            error=exc,
        )

    def _lost(self, lease: Lease) -> None:
        """The heartbeat found the record no longer ours: say so (never raise into the body)."""
        emit(
            signals.idempotency_lost,
            self.task,
            logging.ERROR,
            owner=lease.owner,
            ttl=lease.ttl,
            reason=lease.lost_reason,
            **self._fields(),
        )

    def _safely(self, action: Callable[[], Any]) -> Any:
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - the lock TTL ends the record
            self._store_failed(exc)
            return None

    async def _asafely(self, action: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await action()
        except Exception as exc:  # noqa: BLE001 - the lock TTL ends the record
            self._store_failed(exc)
            return None

    def _store_failed(self, exc: Exception) -> None:
        log_event(
            "idempotency_record_failed",
            logging.ERROR,
            **self._fields(),
            reason="store_error",
            error=exc,
        )


def _reason(exc: BaseException | None, reason: str | None) -> str:
    if reason is not None:
        return reason
    return type(exc).__name__ if exc is not None else "error"


def _astore(store: Any, method: str) -> Callable[..., Awaitable[Any]]:
    """A store's coroutine form of ``method``: its ``a<method>`` (:class:`RedisRecords`,
    :class:`~celery_steplock.contrib.django.idempotency.DatabaseRecords`), else the sync
    method run on a thread (``asyncio.to_thread``: a custom store never blocks the loop)."""
    found = getattr(store, f"a{method}", None)
    if found is not None:
        return found
    return functools.partial(asyncio.to_thread, getattr(store, method))


async def _begin_or_release(
    begin: Awaitable[RecordDecision],
    release: Callable[[], Awaitable[Any]],
    key: str,
    owner: str,
) -> RecordDecision:
    """Await a store's ``begin`` for ``owner`` in a task a cancellation of the caller does
    not stop: the caller's cancellation (``asyncio.CancelledError``) propagates at once,
    and a task of the loop (one its caller's cancellation cannot stop) then waits for the
    begin's decision and, when it locked the record, awaits ``release`` (the store's
    owner-checked release of ``owner``'s locked record: never another caller's). For a
    store other than :class:`RedisRecords` (which releases blindly, owner-checked, after a
    cancelled script): the database store's transition runs on a thread, which a
    cancellation does not stop, so a release sent at once could reach the database before
    the row it should free. A begin that ended in another decision, or failed, leaves
    nothing to release. A release that fails is logged (``release_failed``): the lock TTL
    frees the record.

    Args:
        begin: The store's ``abegin(...)`` (a coroutine or awaitable, not yet awaited).
        release: Returns the awaitable of the owner-checked release (``arelease(key,
            owner)``).
        key: The record key (in the log line).
        owner: The begin's owner token (in the log line).

    Returns:
        The begin's :class:`RecordDecision`.

    Raises:
        asyncio.CancelledError: The caller was cancelled.
        Exception: What the begin raised.
    """
    task = asyncio.ensure_future(begin)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        background(_release_after(task, release, key, owner))
        raise


async def _release_after(
    task: asyncio.Future[RecordDecision] | None,
    release: Callable[[], Awaitable[Any]],
    key: str,
    owner: str,
) -> None:
    """After a cancelled begin: wait for its decision (``task``), then release the record
    it locked; released blindly (owner-checked) when ``task`` is None (the Redis store: its
    reply lost with the cancellation) or was cancelled too (the loop closing)."""
    if task is not None:
        try:
            decision = await task
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the begin failed: it locked nothing (error read)
            return
        else:
            if decision.outcome != "locked":
                return
    try:
        await release()
    except Exception as exc:  # noqa: BLE001 - a background task: logged, left to the lock TTL
        log_event(
            "release_failed",
            logging.WARNING,
            key=key,
            owner=owner,
            error=exc,
            reason="after a cancelled idempotency begin; the record stays locked until its "
            "lock TTL",
        )


#: The former name of :class:`IdempotentCall`, kept for one release.
Ticket = IdempotentCall


#: The keyword arguments of :class:`Idempotency` that :func:`check_argument` judges alone
#: (``app``, ``client`` and ``secret`` are judged with the app they come from).
ARGUMENTS = (
    "namespace",
    "version",
    "ttl",
    "lock_ttl",
    "serializer",
    "store",
    "on_store_error",
    "max_result_bytes",
)
#: Every keyword argument of :class:`Idempotency` but ``namespace``.
KEYWORDS = (*ARGUMENTS[1:], "app", "client", "prefix", "secret")


def check_argument(name: str, value: Any, label: str | None = None) -> Any:
    """Check one argument of :class:`Idempotency` (one of :data:`ARGUMENTS`, not None) and
    return it (``version`` as a str, ``ttl`` and ``lock_ttl`` as float seconds): the one
    place their bounds live, used by the policy and by the HTTP layer at decoration and at
    the middleware's load (``manage.py check`` E011).

    Args:
        name: The argument's name.
        value: Its value.
        label: What an error names (default ``name``), e.g.
            ``'STEPLOCK_IDEMPOTENCY_MIDDLEWARE["ttl"]'``.

    Raises:
        ImproperlyConfigured: ``value`` is of the wrong type or out of its bounds:
            ``namespace`` a str of 1 to 512 characters; ``version`` a str or int
            (:func:`check_version`); ``ttl`` and ``lock_ttl`` 0.1 s to 366 days;
            ``serializer`` a registered kombu serializer; ``store`` "redis", "database" or
            an object with the store's methods; ``on_store_error`` "fail_closed" or
            "fail_open"; ``max_result_bytes`` 1 KiB to 64 MiB.
    """
    label = label or name
    if name == "namespace":
        if not isinstance(value, str) or not value or len(value) > 512:
            raise ImproperlyConfigured(
                f"{label} must be a non-empty str of at most 512 characters, got {shown(value)}",
                setting=label,
            )
        return value
    if name == "version":
        return check_version(value, label)
    if name in ("ttl", "lock_ttl"):
        return check_seconds(
            value, label, minimum=MIN_IDEMPOTENCY_TTL, maximum=MAX_IDEMPOTENCY_TTL
        )
    if name == "serializer":
        from kombu.serialization import registry  # type: ignore[attr-defined]  # stubs

        if not isinstance(value, str) or value not in registry._encoders:
            raise ImproperlyConfigured(
                f"{label} must name a registered kombu serializer, got {shown(value)}",
                setting=label,
            )
        return value
    if name == "store":
        if value not in ("redis", "database") and (
            isinstance(value, str) or not hasattr(value, "begin")
        ):
            raise ImproperlyConfigured(
                f"{label} must be 'redis', 'database' or a store object, got {shown(value)}",
                setting=label,
            )
        return value
    if name == "on_store_error":
        return check_on_store_error(value, label)
    if name == "max_result_bytes":
        return check_count(value, label, minimum=1024, maximum=64 * 1024 * 1024)
    raise ValueError(f"check_argument: no argument {name!r}")  # a caller's bug


class Idempotency:
    """The idempotency policy of one namespace: its version, TTLs, serializer and store.

    ``namespace`` (str): what the keys are made in (a task's or function's name).
    ``version`` (str or int, default "1"): part of every key. ``ttl`` seconds a completed
    record lasts (default ``steplock_idempotency_ttl``, 24 h), ``lock_ttl`` seconds a
    locked one outlives its holder (default ``steplock_idempotency_lock_ttl``, 600 s; the
    process's heartbeat renews it while the body runs, every ``lock_ttl *
    steplock_renewal_ratio`` seconds, so it bounds how long a dead holder blocks the key,
    not the body's length), both 0.1 s to 366 days; ``serializer`` a kombu serializer name (default
    ``steplock_idempotency_serializer``, "json"); ``store`` "redis", "database" or a store
    object (default ``steplock_idempotency_store``); ``on_store_error`` "fail_closed" (raise
    LockStoreUnavailable) or "fail_open" (run without a record; default
    ``steplock_idempotency_on_store_error``). ``app`` a Celery app whose settings and lease
    store (client, key prefix, name secret) are used; or ``client`` a redis client (with
    ``prefix``, default "steplock", and ``secret``, default none). ``max_result_bytes``
    (int, 1 KiB to 64 MiB; default ``steplock_idempotency_max_result_bytes``, 1 MiB): a
    larger serialized result is not recorded (the record is marked failed, reason
    "too_large"; the key runs again). Raises ImproperlyConfigured (InvalidArgument) naming a
    bad argument.
    """

    def __init__(
        self,
        namespace: str,
        *,
        version: str | int = "1",
        ttl: float | None = None,
        lock_ttl: float | None = None,
        serializer: str | None = None,
        store: Any = None,
        on_store_error: str | None = None,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        secret: bytes | str | None = None,
        max_result_bytes: int | None = None,
    ):
        self.namespace = check_argument("namespace", namespace)
        self.version = check_argument("version", version)
        settings = Settings(app) if app is not None else None
        if app is None and client is None and not hasattr(store, "begin"):
            raise ImproperlyConfigured(
                "Idempotency needs app= (a Celery app) or client= (a redis client)", setting="app"
            )

        def setting(name, default):
            return getattr(settings, f"idempotency_{name}") if settings is not None else default

        self.ttl = check_argument("ttl", ttl) if ttl is not None else setting("ttl", 24 * 3600.0)
        self.lock_ttl = (
            check_argument("lock_ttl", lock_ttl)
            if lock_ttl is not None
            else setting("lock_ttl", 600.0)
        )
        #: Renewals of a running body's record come every ``lock_ttl * renewal_ratio``
        #: seconds (``steplock_renewal_ratio``, as the leases'; 1/3 without an app).
        self.renewal_ratio = settings.renewal_ratio if settings is not None else 1 / 3
        self.serializer = check_argument(
            "serializer", serializer if serializer is not None else setting("serializer", "json")
        )
        self.max_result_bytes = (
            check_argument("max_result_bytes", max_result_bytes)
            if max_result_bytes is not None
            else setting("max_result_bytes", 1024 * 1024)
        )
        self.on_store_error = resolve_policy(
            check_argument("on_store_error", on_store_error),
            settings,
            "idempotency_on_store_error",
        )
        if client is None and settings is not None:
            where = target(app)
            client, prefix = where.client, where.prefix
            secret = settings.name_secret if secret is None else secret
        self.secret = secret
        redis_records = RedisRecords(client, prefix or "steplock") if client is not None else None
        kind = check_argument("store", store if store is not None else setting("store", "redis"))
        # RedisRecords, DatabaseRecords or any object with their methods (duck-typed).
        self.store: Any
        if kind == "redis":
            self.store = redis_records
        elif kind == "database":
            database_records = _django.contrib("idempotency").DatabaseRecords
            self.store = database_records(cache=redis_records)
        else:
            self.store = kind

    def key(self, resource: str) -> str:
        """The record key of ``resource`` (:func:`record_key`)."""
        return record_key(self.namespace, resource, self.version, secret=self.secret)

    def fingerprint(self, arguments: Mapping[str, Any]) -> str:
        return fingerprint(arguments, secret=self.secret)

    def begin(
        self,
        resource: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
        task: Any = None,
    ) -> IdempotentCall:
        """Lock ``resource``'s record for this call, or find its completed result.

        ``arguments``: the call's bound arguments (their fingerprint is recorded; or give
        ``fingerprint``, a str, directly). Returns a :class:`IdempotentCall` (``replayed`` with the
        recorded ``result``, or holding the lock). Raises IdempotencyKeyReused (the record
        was made with other arguments), IdempotencyInProgress (another execution holds it;
        ``retry_after`` seconds), LockStoreUnavailable (the store did not answer; fail
        closed).

        A locked record is renewed by the process's heartbeat until the call ends
        (:class:`IdempotentCall`): end every call this returns, or its record stays locked
        while the process lives. A store object without ``extend_many`` is not renewed (its
        record lives its lock TTL)."""
        begun = _Begun(self, resource, arguments, fingerprint, task)
        try:
            decision = self.store.begin(*begun.request())
        except LockStoreUnavailable as exc:
            return begun.outage(exc)
        held = begun.settled(decision)
        if held.lease is None:
            return held  # a replay, or a record no heartbeat renews
        try:
            # The database store's row is seen by others (and renewed) once committed.
            when_committed = getattr(self.store, "on_commit", None)
            if when_committed is not None:
                when_committed(functools.partial(held._renew, self.renewal_ratio))
            else:
                held._renew(self.renewal_ratio)
        except BaseException:
            held.release()  # no record is left locked behind a call that never started
            raise
        return held

    async def abegin(
        self,
        resource: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
        task: Any = None,
    ) -> IdempotentCall:
        """:meth:`begin` under asyncio: the same record, decision, signals and errors, so a
        sync caller (a Celery task, a WSGI view) and an async one (an async view, an asyncio
        worker) with one key and policy run the body once between them.

        The store's ``abegin``: the Redis store's script on the ``redis.asyncio`` twin of its
        client (:func:`celery_steplock.clients.async_client_for`); the database store reads
        its Redis cache copy without leaving the loop and hops to a thread for the ORM
        (:class:`~celery_steplock.contrib.django.idempotency.DatabaseRecords`). A locked
        record is renewed while the call holds it, across any number of ``await`` points: by
        the running loop's asyncio heartbeat (:mod:`celery_steplock.aio.heartbeat`, every
        ``lock_ttl * renewal_ratio`` seconds, one pipelined round trip for every record and
        lease of the loop) for the Redis store; by the heartbeat thread's ``"database"`` lane
        for the database store. End the call with :meth:`IdempotentCall.acomplete`,
        :meth:`~IdempotentCall.afail` or :meth:`~IdempotentCall.arelease` (or use
        :meth:`acall` / ``@idempotent``, which do).

        Args:
            resource: The resource key (``"order:42"``).
            arguments: The call's bound arguments (their fingerprint is recorded).
            fingerprint: Or the fingerprint itself (a str).
            task: The sender of the signals (a Celery task), or None.

        Returns:
            A :class:`IdempotentCall`: ``replayed`` with the recorded ``result``, holding
            the record, or ``unguarded`` (the store did not answer, the policy fails open).

        Raises:
            IdempotencyKeyReused: The record was made with other arguments.
            IdempotencyInProgress: Another execution (sync or async) holds it
                (``retry_after`` seconds, at most 1).
            LockStoreUnavailable: The store did not answer (fail closed).
            asyncio.CancelledError: Cancelled; a record locked meanwhile is released,
                owner-checked (never another caller's), never renewed: the Redis store
                sends the release of this call's owner token from a task of the loop
                (:meth:`RedisRecords.abegin`); another store's begin (the database one's,
                on its thread) ends in a task of its own, and what it locked is released
                then (:func:`_begin_or_release`). Left to its lock TTL only when that
                release fails or the loop closes first.
        """
        begun = _Begun(self, resource, arguments, fingerprint, task)
        store = self.store
        try:
            if isinstance(store, RedisRecords):  # releases what a cancelled script locked
                decision = await store.abegin(*begun.request())
            else:
                # Another store (the database one hops to a thread, which a cancellation
                # does not stop): its begin ends in a task of its own, then a record it
                # locked is released (owner-checked).
                decision = await _begin_or_release(
                    _astore(store, "begin")(*begun.request()),
                    functools.partial(_astore(store, "release"), begun.key, begun.owner),
                    begun.key,
                    begun.owner,
                )
        except LockStoreUnavailable as exc:
            return begun.outage(exc)
        held = begun.settled(decision)
        if held.lease is None:
            return held  # a replay, or a record no heartbeat renews
        try:
            when_committed = getattr(self.store, "on_commit", None)
            if when_committed is not None:
                await _astore(self.store, "on_commit")(
                    functools.partial(held._renew, self.renewal_ratio)
                )
            else:
                await held._arenew(self.renewal_ratio)
        except BaseException:
            # no record is left locked behind a call that never started (shielded: a
            # cancellation here still releases it)
            await asyncio.shield(held.arelease())
            raise
        return held

    def call(
        self,
        resource: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
    ) -> IdempotentBlock:
        """Context manager form of :meth:`begin` (``with``) and of :meth:`abegin`
        (``async with``)::

            with policy.call("order:42", {"order_id": 42}) as call:
                if not call.replayed:
                    call.result = charge(42)
            use(call.result)

        A block that raises marks the record failed (and the exception propagates; under
        ``async with`` a cancellation releases it instead); one that ends records
        ``call.result``."""
        return IdempotentBlock(self, resource, arguments, fingerprint)

    def acall(
        self,
        resource: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        fingerprint: str | None = None,
    ) -> IdempotentBlock:
        """:meth:`call` for ``async with`` (the same object): ``async with
        policy.acall("order:42", {"order_id": 42}) as call:``, then set ``call.result``
        unless ``call.replayed``."""
        return IdempotentBlock(self, resource, arguments, fingerprint)

    def get(self, resource: str) -> Record | None:
        """The record of ``resource``, or None."""
        return self.store.get(self.key(resource))

    async def aget(self, resource: str) -> Record | None:
        """:meth:`get` under asyncio."""
        return await _astore(self.store, "get")(self.key(resource))

    def invalidate(self, resource: str) -> bool:
        """Delete the record of ``resource`` (whatever its status): the next call runs.
        True when there was one."""
        return invalidate(self.key(resource), store=self.store)

    async def ainvalidate(self, resource: str) -> bool:
        """:meth:`invalidate` under asyncio."""
        return await ainvalidate(self.key(resource), store=self.store)


class _Begun:
    """One begin of :class:`Idempotency`, sync or async: its key, fingerprint, owner token
    and signal fields, and what each decision of the store makes of it."""

    def __init__(
        self,
        policy: Idempotency,
        resource: str,
        arguments: Mapping[str, Any] | None,
        fingerprint: str | None,
        task: Any,
    ):
        self.policy = policy
        self.task = task
        self.key = policy.key(resource)
        self.fingerprint = (
            policy.fingerprint(arguments or {}) if fingerprint is None else fingerprint
        )
        self.owner = secrets.token_hex(16)
        self.sent = time.monotonic()
        self.fields: dict[str, Any] = {
            "key": self.key,
            "name": policy.namespace,
            "version": policy.version,
            "task_id": getattr(getattr(task, "request", None), "id", None),
            "task_name": getattr(task, "name", None),
        }

    def request(self) -> tuple[str, str, str, float, str, str]:
        """The store's ``begin``/``abegin`` arguments: ``(key, fingerprint, owner, lock_ttl
        seconds, namespace, version)``."""
        policy = self.policy
        return (
            self.key,
            self.fingerprint,
            self.owner,
            policy.lock_ttl,
            policy.namespace,
            policy.version,
        )

    def settled(self, decision: RecordDecision) -> IdempotentCall:
        """The call ``decision`` makes: the replayed call (its ``lease`` None), or the call
        holding the record (:meth:`held`, not yet renewed); raises as :meth:`decided`."""
        replayed = self.decided(decision)
        return replayed if replayed is not None else self.held()

    def outage(self, exc: LockStoreUnavailable) -> IdempotentCall:
        policy = self.policy
        unguarded = IdempotentCall(
            policy, self.key, self.fingerprint, None, unguarded=True, task=self.task
        )
        return outage(
            exc,
            policy.on_store_error,
            unguarded,
            pattern="idempotency",
            sender=self.task,
            key=self.key,
            name=policy.namespace,
            version=policy.version,
        )

    def decided(self, decision: RecordDecision) -> IdempotentCall | None:
        """The replayed call, or None when the caller holds the record (its lock signal
        sent); raises IdempotencyKeyReused or IdempotencyInProgress."""
        policy, task, key, fields = self.policy, self.task, self.key, self.fields
        if decision.outcome == "locked":
            emit(signals.idempotency_locked, task, ttl=policy.lock_ttl, owner=self.owner, **fields)
            return None
        if decision.outcome == "replay":
            assert decision.record is not None
            result = decision.record.result(policy.serializer)
            emit(signals.idempotency_replayed, task, **fields)
            return IdempotentCall(
                policy, key, self.fingerprint, None, replayed=True, result=result, task=task
            )
        if decision.outcome == "reused":
            emit(
                signals.idempotency_conflict,
                task,
                logging.WARNING,
                reason="reused",
                current=decision.status,
                **fields,
            )
            raise IdempotencyKeyReused(
                f"idempotency key {key} of {policy.namespace!r} (version {policy.version}) is "
                f"{decision.status} for a call with other arguments",
                key=key,
                namespace=policy.namespace,
                version=policy.version,
            )
        emit(signals.idempotency_conflict, task, reason="in_progress", **fields)
        # A holder usually ends long before its lock TTL: ask again soon (a retry that finds
        # the record completed is a replay), never later than the lock's end.
        raise IdempotencyInProgress(
            f"idempotency key {key} of {policy.namespace!r} is held by another execution",
            retry_after=min(decision.retry_after, IN_PROGRESS_RETRY),
            key=key,
            namespace=policy.namespace,
            version=policy.version,
            lock_ttl_left=decision.retry_after,
        )

    def held(self) -> IdempotentCall:
        """The call holding the record, with the :class:`~celery_steplock.lease.Lease` its
        renewals go through (None for a store without ``extend_many``); not yet renewed."""
        policy, task = self.policy, self.task
        lease = None
        if hasattr(policy.store, "extend_many"):
            lease = Lease(
                name=self.key,
                key=self.key,
                owner=self.owner,
                fence=0,
                ttl=policy.lock_ttl,
                acquired_at=self.sent,
                valid_until=self.sent + policy.lock_ttl - drift(policy.lock_ttl),
                task_id=getattr(getattr(task, "request", None), "id", None),
                task_name=getattr(task, "name", None),
            )
        return IdempotentCall(
            policy, self.key, self.fingerprint, self.owner, task=task, lease=lease
        )


class IdempotentBlock:
    """:meth:`Idempotency.call`'s context manager, for ``with`` (:meth:`Idempotency.begin`)
    and ``async with`` (:meth:`Idempotency.abegin`); entering gives the
    :class:`IdempotentCall`.

    Leaving: an exception marks the record failed and propagates (under ``async with``, an
    ``asyncio.CancelledError`` releases the record instead, shielded, and propagates); a
    normal end records ``call.result`` unless the call was replayed or already ended. Under
    ``async with`` the record is written shielded: a cancellation meanwhile does not cut it
    short.
    """

    def __init__(
        self,
        policy: Idempotency,
        resource: str,
        arguments: Mapping[str, Any] | None,
        fingerprint: str | None,
    ):
        self.policy = policy
        self.resource = resource
        self.arguments = arguments
        self.fingerprint = fingerprint
        self.ticket: IdempotentCall | None = None

    def __enter__(self) -> IdempotentCall:
        self.ticket = self.policy.begin(
            self.resource, self.arguments, fingerprint=self.fingerprint
        )
        return self.ticket

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        ticket = self.ticket
        assert ticket is not None
        if exc is not None:
            ticket.fail(exc)
            return
        if not ticket.done:
            ticket.complete(ticket.result)

    async def __aenter__(self) -> IdempotentCall:
        self.ticket = await self.policy.abegin(
            self.resource, self.arguments, fingerprint=self.fingerprint
        )
        return self.ticket

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        ticket = self.ticket
        assert ticket is not None
        # Shielded: a cancellation while the record is written (the caller's task cancelled
        # as the block ends) must not leave the record in progress, renewed while the loop
        # lives, with every later call refused as in progress.
        if isinstance(exc, asyncio.CancelledError):
            await asyncio.shield(ticket.arelease())
        elif exc is not None:
            await asyncio.shield(ticket.afail(exc))
        elif not ticket.done:
            await asyncio.shield(ticket.acomplete(ticket.result))


def _store_for(app: Any, client: Any, prefix: str | None, store: Any) -> Any:
    if store is not None:
        return store
    if app is not None:
        return Idempotency("invalidate", app=app).store
    if client is not None:
        return RedisRecords(client, prefix or "steplock")
    raise ImproperlyConfigured("invalidate needs app=, client= or store=", setting="app")


def invalidate(
    key: str, *, app: Any = None, client: Any = None, prefix: str | None = None, store: Any = None
) -> bool:
    """Delete record ``key`` (64 hex digits, :func:`record_key`) from ``store`` (a store
    object), or from ``app``'s configured store, or from Redis ``client`` (key ``prefix``,
    default "steplock"). True when there was one."""
    removed = _store_for(app, client, prefix, store).invalidate(key)
    log_event("idempotency_invalidated", logging.INFO, key=key, removed=removed)
    return removed


async def ainvalidate(
    key: str, *, app: Any = None, client: Any = None, prefix: str | None = None, store: Any = None
) -> bool:
    """:func:`invalidate` under asyncio (the store's ``ainvalidate``; ``client`` a sync
    redis-py client, whose ``redis.asyncio`` twin is used, or an asyncio one)."""
    removed = await _astore(_store_for(app, client, prefix, store), "invalidate")(key)
    log_event("idempotency_invalidated", logging.INFO, key=key, removed=removed)
    return removed


# -- the decorator ------------------------------------------------------------------------------


def idempotent(
    key: str | Callable[..., str] | None = None,
    *,
    version: str | int = "1",
    ttl: float | None = None,
    lock_ttl: float | None = None,
    namespace: str | None = None,
    app: Any = None,
    client: Any = None,
    **options: Any,
) -> Callable:
    """Decorator: ``fun``'s calls with one key run once; later calls with that key and the
    same arguments return the recorded result.

    ``key``: a :meth:`str.format` template over ``fun``'s argument names
    (``"payment:{payment_id}"``), a callable of the bound arguments returning the resource
    key, or None (the keyed hash of every argument). ``namespace`` defaults to
    ``"<module>.<qualname>"``. Other keywords as :class:`Idempotency` (``app`` or ``client``
    required). The wrapper raises what :meth:`Idempotency.begin` raises, plus ``fun``'s own
    errors (recorded as failed, never as results). ``wrapper.idempotency`` is the policy;
    ``wrapper.invalidate(*args, **kwargs)`` deletes one call's record
    (``await wrapper.ainvalidate(...)`` under asyncio).

    On an ``async def`` (or a function marked with asgiref's ``markcoroutinefunction``)
    the wrapper is a coroutine function over :meth:`Idempotency.abegin`: the same record,
    replay, signals and errors (a concurrent duplicate, sync or async, gets
    IdempotencyInProgress), the record renewed across the body's ``await`` points by the
    loop's asyncio heartbeat; a cancelled body (``asyncio.CancelledError``) releases its
    record (shielded) and is never recorded.
    """
    if key is not None and not callable(key):
        if not isinstance(key, str):
            raise ImproperlyConfigured(
                f"key must be a str.format template or a callable, got {shown(key)}", setting="key"
            )
        try:
            template_fields(key)
        except LockNameError as exc:
            raise ImproperlyConfigured(str(exc), setting="key") from None

    def decorate(fun: Callable) -> Callable:
        space = namespace or f"{fun.__module__}.{fun.__qualname__}"
        policy = Idempotency(
            space, version=version, ttl=ttl, lock_ttl=lock_ttl, app=app, client=client, **options
        )

        def resource(args, kwargs) -> tuple[str, dict[str, Any]]:
            arguments = bind_arguments(fun, args, kwargs)
            return name_from_arguments(space, arguments, key, secret=policy.secret), arguments

        wrapper: Any
        if _is_coroutine_function(fun):

            @functools.wraps(fun)
            async def wrapper(*args, **kwargs):
                name, arguments = resource(args, kwargs)
                ticket = await policy.abegin(name, arguments)
                if ticket.replayed:
                    return ticket.result
                try:
                    result = await fun(*args, **kwargs)
                except asyncio.CancelledError:
                    # the body did not finish: release (shielded), never record
                    await asyncio.shield(ticket.arelease())
                    raise
                except BaseException as exc:
                    await ticket.afail(exc)
                    raise
                await ticket.acomplete(result)
                return result

        else:

            @functools.wraps(fun)
            def wrapper(*args, **kwargs):
                name, arguments = resource(args, kwargs)
                ticket = policy.begin(name, arguments)
                if ticket.replayed:
                    return ticket.result
                try:
                    result = fun(*args, **kwargs)
                except BaseException as exc:
                    ticket.fail(exc)
                    raise
                ticket.complete(result)
                return result

        # Function attributes: the typeshed's functools.wraps result does not declare them.
        wrapper.idempotency = policy
        wrapper.invalidate = lambda *a, **kw: policy.invalidate(resource(a, kw)[0])
        wrapper.ainvalidate = lambda *a, **kw: policy.ainvalidate(resource(a, kw)[0])
        wrapper.record_key = lambda *a, **kw: policy.key(resource(a, kw)[0])
        return wrapper

    return decorate


def _is_coroutine_function(fun: Callable) -> bool:
    """Whether calling ``fun`` gives a coroutine: an ``async def`` (through
    ``functools.partial`` and ``functools.wraps`` layers), or one marked so by asgiref's
    ``markcoroutinefunction`` (read without importing asgiref: on Python 3.12+ its mark is
    :func:`inspect.markcoroutinefunction`'s, before it asyncio's ``_is_coroutine``)."""
    while isinstance(fun, functools.partial):
        fun = fun.func
    if inspect.iscoroutinefunction(fun):
        return True
    marker = getattr(asyncio.coroutines, "_is_coroutine", None)
    return marker is not None and getattr(fun, "_is_coroutine", None) is marker


# -- the admission gate -------------------------------------------------------------------------


def _task_key(task) -> Any:
    import inspect

    template = getattr(task, "idempotency_key", None)
    if inspect.ismethod(template) and template.__self__ is task:
        template = template.__func__  # a function given as a class attribute
    if template is None or callable(template):
        return template
    if not isinstance(template, str):
        raise ImproperlyConfigured(
            f"idempotency_key must be a str.format template or a callable, got {shown(template)}",
            setting="idempotency_key",
        )
    try:
        fields = template_fields(template)
    except LockNameError as exc:
        raise ImproperlyConfigured(
            str(exc).replace("lock_key", "idempotency_key", 1), setting="idempotency_key"
        ) from None
    from ..keys import argument_names

    known = argument_names(task.run)
    if known is not None and not known[1]:
        for name in fields:
            if name not in known[0]:
                raise ImproperlyConfigured(
                    f"idempotency_key {template!r} names {name!r} which is not an argument "
                    f"of the task (arguments: {', '.join(sorted(known[0])) or 'none'})",
                    setting="idempotency_key",
                )
    return template


class IdempotencyGate:
    """The admission gate of a task with ``idempotency_key``: the first gate, so a replay
    costs no breaker probe, concurrency slot or rate-limit token."""

    option = "idempotency_key"

    def __init__(self, task, template, version: str, ttl: float | None, settings: Settings):
        self.task_name = task.name
        self.template = template
        self.policy = Idempotency(
            task.name,
            version=version,
            ttl=ttl,
            app=task.app,
            serializer=settings.idempotency_serializer,
            store=settings.idempotency_store,
            lock_ttl=settings.idempotency_lock_ttl,
            on_store_error=settings.idempotency_on_store_error,
            max_result_bytes=settings.idempotency_max_result_bytes,
        )

    def resource(self, arguments: Mapping[str, Any]) -> str:
        if self.template == "":
            raise ImproperlyConfigured(
                "idempotency_key cannot be empty", setting="idempotency_key"
            )
        template = None if self.template is True else self.template
        return name_from_arguments(self.task_name, arguments, template, secret=self.policy.secret)

    def enter(self, context) -> IdempotentCall | None:
        ticket = self.policy.begin(
            self.resource(context.arguments), context.arguments, task=context.task
        )
        if ticket.replayed:
            raise Replay(ticket.result, gate=self.option)
        return None if ticket.unguarded else ticket


def gate(task, settings: Settings) -> IdempotencyGate | None:
    """The task's idempotency gate, or None without ``idempotency_key``. ``idempotency_key``
    True keys the record on every argument (their keyed hash). Raises ImproperlyConfigured
    naming the option."""
    raw = getattr(task, "idempotency_key", None)
    if raw is None or raw is False:
        return None
    template = True if raw is True else _task_key(task)
    version = getattr(task, "idempotency_version", None)
    version = "1" if version is None else check_version(version)
    ttl = getattr(task, "idempotency_ttl", None)
    if ttl is not None:
        ttl = check_seconds(
            ttl, "idempotency_ttl", minimum=MIN_IDEMPOTENCY_TTL, maximum=MAX_IDEMPOTENCY_TTL
        )
    return IdempotencyGate(task, template, version, ttl, settings)
