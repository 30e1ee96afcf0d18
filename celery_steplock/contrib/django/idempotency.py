"""Idempotency records in Django: the database store, the view decorator and the middleware.

The database store (``steplock_idempotency_store = "database"``) keeps one
:class:`~celery_steplock.contrib.django.models.IdempotencyRecord` row per record, on the
model's write database (``router.db_for_write``). **The row is the truth**; Redis holds a
*cache copy of completed rows only*, written after the row's COMMIT with a TTL that ends no
later than the row, read first by the next call (a replay then costs one Redis read and no
query). A locked or failed record lives in the database alone. Invalidation deletes the row,
then the copy. A Redis outage slows replays down (every decision goes to the database) and
never changes one; a database outage is a store outage (fail closed by default). Times of the
database store come from the workers' clock (keep them synchronized; lock TTLs are minutes).

Views: :func:`idempotent_view` (a decorator) and :class:`IdempotencyMiddleware` read an
``Idempotency-Key`` header, as payment APIs do: the first request with a key runs the view
and records its response (status < 400, not streaming; ``Set-Cookie`` never recorded); a
repeat with the same key and the same request (method, path, query, content type and body)
gets the recorded response with the header ``Idempotent-Replayed: true``; the same key with
another request gets 422; while the first still runs, 409 with ``Retry-After``; an error
response (status >= 400) or an exception is not recorded, and the key runs again: a refused
request (4xx, or an exception Django or DRF answers with one: ``Http404``,
``PermissionDenied``...) deletes its record at once, a server error (5xx, any other
exception) leaves it ``failed`` for operators. A principal holds at most ``max_records``
live records (default ``steplock_idempotency_max_records``): a new key beyond it gets 429.

A record belongs to the request's host and principal (``scope``, default the authenticated
``request.user``): a replay only ever reaches the principal that recorded it, and a key
without a principal is refused with 403 unless the view opts in to an anonymous scope. On a
DRF handler method the guard runs after DRF's authentication and permissions. A response is
recorded once rendered and once every transaction open around the view has committed
(``transaction.on_commit``); a rollback, a failed COMMIT or a rendering error fails the
record (docs/patterns/idempotency.md, "Whose key it is" and "When a response is recorded").
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import difflib
import functools
import hashlib
import inspect
import logging
import math
import re
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generator, Iterable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import (
    BadRequest,
    PermissionDenied,
    RequestDataTooBig,
    SuspiciousOperation,
)
from django.core.signals import got_request_exception
from django.db import DatabaseError, IntegrityError, connections, router, transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.urls import Resolver404, resolve
from django.utils import timezone
from django.utils.functional import empty

from ... import calls
from ..._checks import (
    MAX_IDEMPOTENCY_MAX_RECORDS,
    MIN_IDEMPOTENCY_MAX_RECORDS,
    check_bool,
    check_count,
    check_seconds,
    shown,
)
from ..._redis import wire
from ..._redis.scripts.idempotency_quota import ADMIT, COMPLETED
from ...clients import async_client_for
from ...events import log_event
from ...exceptions import (
    IdempotencyInProgress,
    IdempotencyKeyReused,
    IdempotencyQuotaExceeded,
    ImproperlyConfigured,
    InvalidArgument,
    LockError,
    LockStoreUnavailable,
)
from ...keys import idempotency_key, idempotency_quota_key
from ...patterns.idempotency import ARGUMENTS as POLICY_ARGUMENTS
from ...patterns.idempotency import KEYWORDS as POLICY_KEYWORDS
from ...patterns.idempotency import (
    Idempotency,
    Record,
    RecordDecision,
    RedisRecords,
    Stored,
    _fingerprint_bytes,
    check_argument,
)

__all__ = [
    "DatabaseRecords",
    "prune_expired_records",
    "idempotent_view",
    "idempotency_exempt",
    "default_scope",
    "adefault_scope",
    "IdempotencyMiddleware",
    "middleware_policy",
    "ANONYMOUS_SCOPE",
    "REPLAYED_HEADER",
    "UNSAFE_METHODS",
]

REPLAYED_HEADER = "Idempotent-Replayed"
#: Seconds a renewal of the database store waits for a lock at most (then retried).
RENEWAL_WAIT = 0.5
UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
#: Response headers never recorded (a replay must not hand a session to another client).
_NOT_RECORDED = {"set-cookie", "content-length", REPLAYED_HEADER.lower()}
MAX_HEADER_LENGTH = 255
#: An HTTP token (RFC 9110, 5.6.2): a method or a header name.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
#: The Django setting of :class:`IdempotencyMiddleware`.
MIDDLEWARE_SETTING = "STEPLOCK_IDEMPOTENCY_MIDDLEWARE"
#: The options of :func:`idempotent_view` (and keys of :data:`MIDDLEWARE_SETTING`, with
#: ``exempt_paths``).
VIEW_OPTIONS = (
    "namespace",
    "methods",
    "header",
    "required",
    "scope",
    "anonymous",
    "max_records",
    *POLICY_KEYWORDS,
)


def _seconds(value: dt.datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _record(row) -> Record:
    payload: Any = row.result
    if row.result_b64:
        payload = base64.b64decode(payload)
    return Record(
        key=row.key,
        status=row.status,
        fingerprint=row.fingerprint,
        namespace=row.namespace,
        version=row.version,
        owner=row.owner or None,
        created_at=_seconds(row.created_at),
        locked_at=_seconds(row.locked_at),
        completed_at=_seconds(row.completed_at),
        failed_at=_seconds(row.failed_at),
        expires_at=_seconds(row.expires_at),
        serializer=row.serializer or None,
        content_type=row.content_type or None,
        content_encoding=row.content_encoding or None,
        payload=payload if row.status == "completed" else None,
        error=row.error or None,
        attempts=row.attempts,
    )


#: The columns of a new ``locked`` row and their SQL values: ``%s`` a parameter of
#: :meth:`DatabaseRecords._insert`, in this order; else a constant (fewer parameters to
#: adapt per call). ``completed_at`` and ``failed_at`` are left NULL.
_INSERT_COLUMNS = (
    ("key", "%s"),
    ("namespace", "%s"),
    ("version", "%s"),
    ("status", "'locked'"),
    ("fingerprint", "%s"),
    ("owner", "%s"),
    ("serializer", "''"),
    ("content_type", "''"),
    ("content_encoding", "''"),
    ("result", "''"),
    ("result_b64", "%s"),
    ("error", "''"),
    ("attempts", "1"),
    ("created_at", "%s"),
    ("locked_at", "%s"),
    ("expires_at", "%s"),
)
#: The columns a completion sets (then ``owner = ''``, ``error = ''``, ``failed_at = NULL``).
_COMPLETE_COLUMNS = (
    "fingerprint",
    "serializer",
    "content_type",
    "content_encoding",
    "result",
    "result_b64",
    "namespace",
    "version",
    "completed_at",
    "expires_at",
)


@dataclass(frozen=True)
class _Statements:
    """The raw SQL of the database store's hot path for one vendor and table: the ORM
    compiles a statement per call (about as long as the round trip on PostgreSQL), these are
    built once. ``on_conflict``: ``insert`` ends with ``ON CONFLICT (key) DO NOTHING``
    (PostgreSQL, SQLite 3.24+); else it is a plain INSERT (MySQL, MariaDB, other vendors),
    whose IntegrityError says the key has a row (``INSERT IGNORE`` would also silence a
    truncation, and MySQL's row count of ``ON DUPLICATE KEY UPDATE`` under Django's
    ``FOUND_ROWS`` flag does not tell an insert from a conflict)."""

    insert: str
    complete: str
    on_conflict: bool

    @classmethod
    def build(cls, connection, model) -> _Statements:
        quote = connection.ops.quote_name
        column = {f.name: quote(f.column) for f in model._meta.concrete_fields}
        table = quote(model._meta.db_table)
        on_conflict = connection.vendor == "postgresql" or (
            connection.vendor == "sqlite" and connection.Database.sqlite_version_info >= (3, 24, 0)
        )
        insert = (
            f"INSERT INTO {table} ({', '.join(column[c] for c, _ in _INSERT_COLUMNS)}) "
            f"VALUES ({', '.join(value for _, value in _INSERT_COLUMNS)})"
        )
        if on_conflict:
            insert += f" ON CONFLICT ({column['key']}) DO NOTHING"
        sets = ", ".join(f"{column[c]} = %s" for c in _COMPLETE_COLUMNS)
        complete = (
            f"UPDATE {table} SET {column['status']} = 'completed', {column['owner']} = '', "
            f"{column['error']} = '', {column['failed_at']} = NULL, {sets} "
            f"WHERE {column['key']} = %s AND {column['owner']} = %s "
            f"AND {column['status']} = 'locked'"
        )
        return cls(insert, complete, on_conflict)


#: Built statements per (vendor, table).
_STATEMENTS: dict[tuple[str, str], _Statements] = {}


class DatabaseRecords:
    """The database store of idempotency records (see the module's text for the
    consistency rule). ``cache``: a :class:`~celery_steplock.patterns.idempotency.RedisRecords` for
    the copies of completed rows (None: no cache); ``using``: a database alias (default the
    model's ``router.db_for_write``). A database error raises LockStoreUnavailable.

    Asyncio: ``abegin``, ``acomplete``, ``afail``, ``arelease``, ``aextend_many``,
    ``ainvalidate``, ``aget`` and ``aon_commit`` are the coroutine forms (same arguments,
    results and errors). Each runs its synchronous method in one
    ``asgiref.sync.sync_to_async(..., thread_sensitive=True)`` hop (Django's own thread for
    sync ORM work called from async code): Django's ORM has no asynchronous transactions
    (``atomic``, ``select_for_update``, ``on_commit``), and every transition here needs
    one. The exception is :meth:`abegin`'s first step: the Redis cache copy of a completed
    record is read on the event loop (``redis.asyncio``), so a replay costs no hop. The
    renewals of a record locked from async code run on the heartbeat thread's
    ``"database"`` lane, as the sync ones do (never on the event loop).
    """

    #: The heartbeat renews the records on a thread of their own
    #: (:func:`celery_steplock.heartbeat.heartbeat_for`): a database that stops answering
    #: must never delay the renewal of the process's Redis leases.
    renewal_lane = "database"

    def __init__(self, cache=None, using: str | None = None):
        self.cache = cache
        self.using = using

    @property
    def model(self):
        from .models import IdempotencyRecord

        return IdempotencyRecord

    def _db(self) -> str:
        return self.using or router.db_for_write(self.model)

    def _outage(self, exc: BaseException, key: str, what: str) -> LockStoreUnavailable:
        return LockStoreUnavailable(
            f"idempotency {what} of {key}: the database did not "
            f"answer ({type(exc).__name__}: {exc})",
            key=key,
        )

    # -- the cache ------------------------------------------------------------------------------

    def _cached(self, key: str) -> Record | None:
        if self.cache is None:
            return None
        try:
            return self.cache.get(key)
        except LockError as exc:
            log_event("idempotency_cache_error", logging.WARNING, key=key, error=exc)
            return None

    def _put_cache(self, record: Record, using: str) -> None:
        """Copy ``record`` to Redis once ``using``'s transaction commits (at once outside one):
        a copy written before a COMMIT that then fails would replay a row that never was."""
        if self.cache is not None and record.expires_at is not None:
            transaction.on_commit(functools.partial(self._copy, record), using=using)

    def _copy(self, record: Record) -> None:
        if self.cache is None or record.expires_at is None:
            return
        left = record.expires_at - timezone.now().timestamp()
        if left <= 0:
            return
        try:
            self.cache.cache(record, left)
        except LockError as exc:
            log_event("idempotency_cache_error", logging.WARNING, key=record.key, error=exc)

    # -- raw SQL of the hot path ----------------------------------------------------------------

    def _sql(self, connection) -> _Statements:
        """The hot path's statements for ``connection``'s vendor and table (built once)."""
        model = self.model
        cache_key = (connection.vendor, model._meta.db_table)
        statements = _STATEMENTS.get(cache_key)
        if statements is None:
            statements = _STATEMENTS[cache_key] = _Statements.build(connection, model)
        return statements

    def _insert(self, using, key, fingerprint, owner, namespace, version, now, until) -> bool:
        """INSERT the ``locked`` row of a new key in one statement; True when inserted, False
        when the key has a row. Outside an atomic block the statement is its own transaction
        (autocommit: committed, so durable, when this returns; no savepoint, no BEGIN); inside
        one, it joins the caller's transaction. PostgreSQL and SQLite (3.24+) use ``ON
        CONFLICT (key) DO NOTHING``; another vendor a plain ``INSERT`` whose IntegrityError
        (the unique key) says the key has a row (inside an atomic block, in a savepoint)."""
        connection = connections[using]
        sql = self._sql(connection)
        adapt = connection.ops.adapt_datetimefield_value
        at = adapt(now)
        params = [key, namespace, version, fingerprint, owner, False, at, at, adapt(until)]
        if sql.on_conflict:
            with transaction.mark_for_rollback_on_error(using), connection.cursor() as cursor:
                cursor.execute(sql.insert, params)
                return cursor.rowcount == 1
        try:
            if connection.in_atomic_block:
                with transaction.atomic(using=using), connection.cursor() as cursor:
                    cursor.execute(sql.insert, params)
            else:
                with connection.cursor() as cursor:
                    cursor.execute(sql.insert, params)
        except IntegrityError:
            return False
        return True

    # -- transitions ----------------------------------------------------------------------------

    def begin(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> RecordDecision:
        decision = _from_cache(self._cached(key), fingerprint)
        if decision is not None:
            return decision
        return self._begin_in_database(key, fingerprint, owner, lock_ttl, namespace, version)

    def _begin_in_database(
        self, key, fingerprint, owner, lock_ttl, namespace, version
    ) -> RecordDecision:
        using = self._db()
        try:
            connection = connections[using]
            if connection.in_atomic_block or not connection.get_autocommit():
                # A savepoint: a database error leaves the caller's transaction usable (an
                # atomic block, or autocommit turned off: a transaction with no atomic block,
                # which a failed statement on PostgreSQL would otherwise abort).
                with transaction.atomic(using=using):
                    decision = self._begin(
                        using, key, fingerprint, owner, lock_ttl, namespace, version
                    )
            else:
                decision = self._begin(
                    using, key, fingerprint, owner, lock_ttl, namespace, version
                )
        except DatabaseError as exc:
            raise self._outage(exc, key, "begin") from exc
        if decision.outcome == "replay" and decision.record is not None:
            self._put_cache(decision.record, using)
        return decision

    def _begin(
        self, using, key, fingerprint, owner, lock_ttl, namespace, version
    ) -> RecordDecision:
        while True:
            now = timezone.now()
            until = now + dt.timedelta(seconds=lock_ttl)
            # A new key is the common case: one INSERT, and the unique key decides who locks it.
            if self._insert(using, key, fingerprint, owner, namespace, version, now, until):
                return RecordDecision("locked")
            with transaction.atomic(using=using, savepoint=False):
                decision = self._take(
                    using, key, fingerprint, owner, namespace, version, now, until
                )
            if decision is not None:
                return decision
            # The row was deleted since the INSERT (pruned, invalidated): lock a new one.

    def _take(self, using, key, fingerprint, owner, namespace, version, now, until):
        """Decide on the existing row of ``key`` (locked FOR UPDATE, in a transaction); None
        when it is gone."""
        objects = self.model.objects.using(using)
        row = objects.select_for_update().filter(key=key).first()
        if row is None:
            return None
        live = row.expires_at > now
        if live and row.status in ("completed", "locked"):
            if row.fingerprint != fingerprint:
                return RecordDecision("reused", status=row.status)
            if row.status == "completed":
                return RecordDecision("replay", record=_record(row))
            if row.owner != owner:
                return RecordDecision(
                    "in_progress", retry_after=(row.expires_at - now).total_seconds()
                )
        fresh = not live or row.status == "completed"
        objects.filter(pk=row.pk).update(
            status="locked",
            fingerprint=fingerprint,
            owner=owner,
            namespace=namespace,
            version=version,
            locked_at=now,
            expires_at=until,
            result="",
            result_b64=False,
            serializer="",
            content_type="",
            content_encoding="",
            error="",
            completed_at=None,
            failed_at=None,
            created_at=now if fresh else row.created_at,
            attempts=1 if fresh else row.attempts + 1,
        )
        return RecordDecision("locked")

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
        using = self._db()
        now = timezone.now()
        expires_at = now + dt.timedelta(seconds=ttl)
        connection = connections[using]
        try:
            # One UPDATE when the caller still holds the row (the common case), raw SQL: in
            # autocommit it is its own transaction, committed when it returns.
            adapt = connection.ops.adapt_datetimefield_value
            with transaction.mark_for_rollback_on_error(using), connection.cursor() as cursor:
                cursor.execute(
                    self._sql(connection).complete,
                    [
                        fingerprint,
                        stored.serializer,
                        stored.content_type,
                        stored.content_encoding,
                        stored.payload,
                        stored.b64,
                        namespace,
                        version,
                        adapt(now),
                        adapt(expires_at),
                        key,
                        owner,
                    ],
                )
                done = cursor.rowcount
            if not done:
                objects = self.model.objects.using(using)
                with transaction.atomic(using=using):
                    if objects.select_for_update().filter(key=key).exists():
                        return False  # another execution holds or completed it
                    objects.create(
                        key=key,
                        created_at=now,
                        attempts=1,
                        status="completed",
                        fingerprint=fingerprint,
                        owner="",
                        serializer=stored.serializer,
                        content_type=stored.content_type,
                        content_encoding=stored.content_encoding,
                        result=stored.payload,
                        result_b64=stored.b64,
                        error="",
                        failed_at=None,
                        namespace=namespace,
                        version=version,
                        completed_at=now,
                        expires_at=expires_at,
                    )
        except IntegrityError:
            return False
        except DatabaseError as exc:
            raise self._outage(exc, key, "complete") from exc
        self._put_cache(
            Record(
                key=key,
                status="completed",
                fingerprint=fingerprint,
                namespace=namespace,
                version=version,
                completed_at=now.timestamp(),
                expires_at=expires_at.timestamp(),
                serializer=stored.serializer,
                content_type=stored.content_type,
                content_encoding=stored.content_encoding,
                payload=stored.raw(),
            ),
            using,
        )
        return True

    def fail(self, key: str, owner: str, error: str, ttl: float) -> bool:
        using = self._db()
        now = timezone.now()
        try:
            return bool(
                self.model.objects.using(using)
                .filter(key=key, owner=owner, status="locked")
                .update(
                    status="failed",
                    owner="",
                    error=error[:255],
                    failed_at=now,
                    expires_at=now + dt.timedelta(seconds=ttl),
                )
            )
        except DatabaseError as exc:
            raise self._outage(exc, key, "fail") from exc

    def release(self, key: str, owner: str) -> bool:
        try:
            deleted, _ = (
                self.model.objects.using(self._db())
                .filter(key=key, owner=owner, status="locked")
                .delete()
            )
        except DatabaseError as exc:
            raise self._outage(exc, key, "release") from exc
        return bool(deleted)

    def on_commit(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` once the transaction open on the store's database commits (at
        once outside one): a row locked inside the caller's transaction is seen by no one
        else, and cannot be renewed, before its COMMIT (the policy starts the renewals so)."""
        transaction.on_commit(callback, using=self._db())

    def extend_many(self, items: Iterable[tuple[str, str, float]]) -> list[bool]:
        """Renew running bodies' ``locked`` rows (the heartbeat's renewals, on the thread of
        its ``"database"`` lane and its own connection): one ``UPDATE ... SET expires_at =
        now + lock TTL WHERE key AND owner AND status = 'locked' AND expires_at > now`` per
        row, in autocommit. A lock wait is bounded by :data:`RENEWAL_WAIT` (SQLite's
        ``busy_timeout``, PostgreSQL's ``lock_timeout``, and its ``statement_timeout`` for
        the whole statement): a writer holding SQLite's write lock (a body in ``BEGIN
        IMMEDIATE``) must not stall the other records' renewals; the renewal is retried. A
        connection attempt is bounded only by the database's own options (PostgreSQL:
        ``OPTIONS={"connect_timeout": ...}``); a hang delays the records' lane alone, and a
        record whose local validity runs out meanwhile is lost with a reason saying the
        database did not answer.

        Args:
            items: ``(record key, owner token, lock TTL seconds)`` per row.

        Returns:
            One bool per item: True when extended; False (nothing written) when the row is
            completed, failed, deleted, expired or locked by another owner.

        Raises:
            LockStoreUnavailable: The database did not answer, or the wait ran out.
        """
        using = self._db()
        connection = connections[using]
        objects = self.model.objects.using(using)
        results: list[bool] = []
        key = ""
        restore = None
        try:
            bounded = not connection.in_atomic_block
            if bounded and connection.vendor == "sqlite":
                with connection.cursor() as cursor:
                    cursor.execute("PRAGMA busy_timeout")
                    restore = cursor.fetchone()[0]
                    cursor.execute(f"PRAGMA busy_timeout = {int(RENEWAL_WAIT * 1000)}")
            for key, owner, ttl in items:
                with transaction.atomic(using=using):
                    if bounded and connection.vendor == "postgresql":
                        with connection.cursor() as cursor:
                            wait = f"{int(RENEWAL_WAIT * 1000)}ms"
                            cursor.execute(
                                "SELECT set_config('lock_timeout', %s, true), "
                                "set_config('statement_timeout', %s, true)",
                                [wait, wait],
                            )
                    now = timezone.now()
                    updated = objects.filter(
                        key=key, owner=owner, status="locked", expires_at__gt=now
                    ).update(expires_at=now + dt.timedelta(seconds=ttl))
                results.append(bool(updated))
        except DatabaseError as exc:
            raise self._outage(exc, key, "renewal") from exc
        finally:
            if restore is not None:
                try:
                    with connection.cursor() as cursor:
                        cursor.execute(f"PRAGMA busy_timeout = {int(restore)}")
                except DatabaseError:
                    pass
            if not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()  # the heartbeat's, per CONN_MAX_AGE
        return results

    def invalidate(self, key: str) -> bool:
        """Delete the row, then the cache copy (a Redis error raises after the row is gone:
        call again once Redis answers, or the copy replays until its TTL)."""
        try:
            deleted, _ = self.model.objects.using(self._db()).filter(key=key).delete()
        except DatabaseError as exc:
            raise self._outage(exc, key, "invalidate") from exc
        cached = self.cache.invalidate(key) if self.cache is not None else False
        return bool(deleted) or cached

    def get(self, key: str) -> Record | None:
        try:
            row = self.model.objects.using(self._db()).filter(key=key).first()
        except DatabaseError as exc:
            raise self._outage(exc, key, "read") from exc
        if row is None or row.expires_at <= timezone.now():
            return None
        return _record(row)

    # -- asyncio: one sync_to_async(thread_sensitive=True) hop each ------------------------------

    async def _acached(self, key: str) -> Record | None:
        if self.cache is None:
            return None
        try:
            return await self.cache.aget(key)
        except LockError as exc:
            log_event("idempotency_cache_error", logging.WARNING, key=key, error=exc)
            return None

    async def abegin(
        self,
        key: str,
        fingerprint: str,
        owner: str,
        lock_ttl: float,
        namespace: str = "",
        version: str = "",
    ) -> RecordDecision:
        """:meth:`begin` under asyncio: the Redis cache copy is read on the event loop (a
        replay or a reused key is decided without a thread hop); otherwise the database
        transition runs in one ``sync_to_async(thread_sensitive=True)`` hop (the ORM has no
        async ``atomic``/``select_for_update``).

        Raises:
            LockStoreUnavailable: The database did not answer.
        """
        decision = _from_cache(await self._acached(key), fingerprint)
        if decision is not None:
            return decision
        return await _hop(self._begin_in_database)(
            key, fingerprint, owner, lock_ttl, namespace, version
        )

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
        """:meth:`complete` in one ``sync_to_async(thread_sensitive=True)`` hop (the cache
        copy is written after the row's COMMIT, on that thread)."""
        return await _hop(self.complete)(key, owner, fingerprint, stored, ttl, namespace, version)

    async def afail(self, key: str, owner: str, error: str, ttl: float) -> bool:
        """:meth:`fail` in one ``sync_to_async(thread_sensitive=True)`` hop."""
        return await _hop(self.fail)(key, owner, error, ttl)

    async def arelease(self, key: str, owner: str) -> bool:
        """:meth:`release` in one ``sync_to_async(thread_sensitive=True)`` hop."""
        return await _hop(self.release)(key, owner)

    async def aon_commit(self, callback: Callable[[], Any]) -> None:
        """:meth:`on_commit` in one ``sync_to_async(thread_sensitive=True)`` hop: the
        callback runs when the transaction open on that thread commits (at once outside one,
        the usual case under an async view), on that thread."""
        await _hop(self.on_commit)(callback)

    async def aextend_many(self, items: Iterable[tuple[str, str, float]]) -> list[bool]:
        """:meth:`extend_many` in one ``sync_to_async(thread_sensitive=True)`` hop. The
        policy does not renew through it (a record locked from async code is renewed on the
        heartbeat thread's ``"database"`` lane, which a slow database cannot stall for
        anyone else); it serves callers that renew records themselves."""
        return await _hop(self.extend_many)(list(items))

    async def ainvalidate(self, key: str) -> bool:
        """:meth:`invalidate` in one ``sync_to_async(thread_sensitive=True)`` hop (the row,
        then the cache copy)."""
        return await _hop(self.invalidate)(key)

    async def aget(self, key: str) -> Record | None:
        """:meth:`get` in one ``sync_to_async(thread_sensitive=True)`` hop."""
        return await _hop(self.get)(key)


def _hop(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` as a coroutine function run on Django's thread for sync code called from
    async code (``sync_to_async(thread_sensitive=True)``: the ORM's connections belong to
    threads, and Django's ORM has no async transaction)."""
    from asgiref.sync import sync_to_async

    return sync_to_async(method, thread_sensitive=True)


def _from_cache(cached: Record | None, fingerprint: str) -> RecordDecision | None:
    """The decision a cache copy gives alone (a completed record: replay or reused), or
    None (go to the database)."""
    if cached is not None and cached.status == "completed":
        if cached.fingerprint == fingerprint:
            return RecordDecision("replay", record=cached)
        return RecordDecision("reused", status="completed")
    return None


def prune_expired_records(
    *,
    older_than: float = 0.0,
    batch_size: int = 1000,
    dry_run: bool = False,
    using: str | None = None,
    now: dt.datetime | None = None,
) -> tuple[int, int]:
    """Delete the database store's rows that expired more than ``older_than`` seconds ago
    (an expired row already counts as absent: deleting it changes no decision).

    Each batch is one short ``DELETE`` of at most ``batch_size`` rows by primary key, in its
    own transaction, that checks the expiry again (a row locked anew meanwhile is kept).
    Run it from cron, like ``clearsessions`` (``manage.py prune_idempotency_records``).

    Args:
        older_than: Seconds past ``expires_at`` (>= 0; default 0).
        batch_size: Rows per ``DELETE`` (1 to 100,000; default 1000).
        dry_run: Only count the rows.
        using: A database alias (default the model's ``router.db_for_write``).
        now: The current time (default ``timezone.now()``).

    Returns:
        ``(rows, batches)``: rows deleted (with ``dry_run``: that would be) and the number
        of ``DELETE`` statements.

    Raises:
        ImproperlyConfigured: ``older_than`` or ``batch_size`` is out of its bounds.
    """
    from .models import IdempotencyRecord

    older_than = check_seconds(older_than, "older_than", allow_zero=True)
    batch_size = check_count(batch_size, "batch_size", minimum=1, maximum=100_000)
    using = using or router.db_for_write(IdempotencyRecord)
    cutoff = (now or timezone.now()) - dt.timedelta(seconds=older_than)
    expired = IdempotencyRecord.objects.using(using).filter(expires_at__lte=cutoff)
    if dry_run:
        return expired.count(), 0
    rows = batches = 0
    while True:
        pks = list(expired.order_by("pk").values_list("pk", flat=True)[:batch_size])
        if not pks:
            return rows, batches
        with transaction.atomic(using=using):
            deleted, _ = expired.filter(pk__in=pks).delete()
        rows += deleted
        batches += 1


# -- views --------------------------------------------------------------------------------------

#: The principal of a request without one, when the view or middleware opts in
#: (``anonymous=True``): every anonymous client of a host shares it.
ANONYMOUS_SCOPE = "anonymous"
#: The attribute of Django's request listing its guarded responses not yet settled.
_PENDING = "_steplock_idempotency_pending"


def _http_request(request) -> HttpRequest:
    """Django's request: ``request`` itself, or the one a DRF ``Request`` wraps."""
    inner = getattr(request, "_request", None)
    return inner if isinstance(inner, HttpRequest) else request


def _is_request(value: Any) -> bool:
    return isinstance(_http_request(value), HttpRequest)


def default_scope(request) -> str | None:
    """The default ``scope``: the authenticated user (``"user:<model label>:<pk>"``) that
    ``request.user`` holds, or None (no principal). Inside a DRF view's handler that is the
    user DRF's authentication classes found; in a plain Django view, the user of
    ``AuthenticationMiddleware`` (a header credential the view checks itself is not seen:
    give ``scope=``).

    Args:
        request: A Django ``HttpRequest`` or a DRF ``Request``.

    Returns:
        The principal's scope, or None when there is no authenticated user with a primary key.
    """
    return _user_scope(getattr(request, "user", None))


async def adefault_scope(request) -> str | None:
    """The async form of :func:`default_scope`, the default ``scope`` of an async view: the
    same principal, found without blocking the event loop. A Django request's user comes
    from ``await request.auser()`` (``AuthenticationMiddleware``; Django's own async lookup
    of the session's user) unless ``request.user`` is already a loaded user; a DRF
    request's is the one its authentication found before the handler ran (an async adapter
    such as adrf authenticates in its dispatch; if it has not yet, its ``request.user`` is
    read in a thread, ``sync_to_async``).

    Args:
        request: A Django ``HttpRequest`` or a DRF ``Request``.

    Returns:
        The principal's scope, or None when there is no authenticated user with a primary key.
    """
    http = _http_request(request)
    if http is not request:  # a DRF Request: its authenticators decide
        if hasattr(request, "_user"):
            return _user_scope(request.user)
        return _user_scope(await sync_to_async(lambda: request.user)())
    user = http.__dict__.get("user")
    wrapped = getattr(user, "_wrapped", None)
    auser = getattr(http, "auser", None)
    if auser is not None and (user is None or wrapped is empty):
        user = await auser()
    return _user_scope(user)


def _user_scope(user: Any) -> str | None:
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    pk = getattr(user, "pk", None)
    if pk is None:
        return None
    meta = getattr(user, "_meta", None)
    label = meta.label_lower if meta is not None else type(user).__qualname__
    return f"user:{label}:{pk}"


#: The form field of Django's CSRF token: no part of a request's meaning (it is masked
#: anew each time a form is rendered), so never part of its fingerprint.
_CSRF_FIELD = "csrfmiddlewaretoken"
#: Bytes an uploaded file is hashed by at a time.
_FILE_CHUNK = 64 * 1024


def _form_parts(request: HttpRequest) -> list[bytes]:
    """A multipart request's fields and files as Django parsed them (``request.POST``,
    ``request.FILES``; files hashed in chunks and rewound): the body may be gone already (a
    CSRF check reads ``request.POST`` first) and its files may be far larger than memory."""
    parts: list[bytes] = []
    for name, values in request.POST.lists():
        if name != _CSRF_FIELD:
            parts += [b"field", name.encode(), b"%d" % len(values)]
            parts += [value.encode() for value in values]
    for name, files in request.FILES.lists():
        parts += [b"files", name.encode(), b"%d" % len(files)]
        for upload in files:
            digest = hashlib.sha256()
            for chunk in upload.chunks(_FILE_CHUNK):
                digest.update(chunk)
            upload.seek(0)
            name_of = (upload.name or "").encode()
            parts += [name_of, (upload.content_type or "").encode(), digest.digest()]
    return parts


def _request_fingerprint(request, secret) -> str:
    """The fingerprint of method, path, query, media type and body. A multipart body is
    its parsed fields (but the CSRF token) and files, and its media type has no boundary
    (a retry's boundary differs); another body is read whole (``request.body``).

    Raises:
        RequestDataTooBig: the body (a multipart one's fields) is above Django's
            ``DATA_UPLOAD_MAX_MEMORY_SIZE``.
        MultiPartParserError: the multipart body cannot be parsed.
    """
    request = _http_request(request)
    content_type = request.META.get("CONTENT_TYPE", "")
    media_type = content_type.split(";", 1)[0].strip().lower()
    if media_type == "multipart/form-data":
        head, body = [media_type.encode()], _form_parts(request)
    else:
        head, body = [content_type.encode()], [request.body]
    return _fingerprint_bytes(
        [
            request.method.encode(),
            request.path.encode(),
            request.META.get("QUERY_STRING", "").encode(),
            *head,
            *body,
        ],
        secret,
    )


def _snapshot(response) -> dict[str, Any]:
    return {
        "status": response.status_code,
        "headers": [
            [name, value] for name, value in response.items() if name.lower() not in _NOT_RECORDED
        ],
        "body": base64.b64encode(response.content).decode(),
    }


def _replayed(snapshot: dict[str, Any]) -> HttpResponse:
    response = HttpResponse(base64.b64decode(snapshot["body"]), status=snapshot["status"])
    for name, value in snapshot["headers"]:
        response[name] = value
    response[REPLAYED_HEADER] = "true"
    return response


def _error(status: int, message: str, **headers: str) -> JsonResponse:
    response = JsonResponse({"error": message}, status=status)
    for name, value in headers.items():
        response[name] = value
    return response


#: Exceptions Django (or DRF) answers with a 4xx: the request was refused.
_REFUSALS: tuple[tuple[type[BaseException], int], ...] = (
    (Http404, 404),
    (PermissionDenied, 403),
    (BadRequest, 400),
    (SuspiciousOperation, 400),
    (MultiPartParserError, 400),
)


def _refusal_status(exc: BaseException) -> int | None:
    """The 4xx Django answers ``exc`` with (its refusal exceptions: ``Http404``,
    ``PermissionDenied``, ``BadRequest``, ``SuspiciousOperation``, ``MultiPartParserError``)
    or DRF does (an ``APIException``'s ``status_code``, when DRF is installed), else None: a
    server error. Another exception's ``status_code`` (an SDK's error for its upstream's 429)
    is no refusal: Django answers it with 500."""
    for kind, status in _REFUSALS:
        if isinstance(exc, kind):
            return status
    try:
        from rest_framework.exceptions import APIException  # type: ignore[import-untyped]
    except ImportError:  # DRF is optional
        return None
    if isinstance(exc, APIException):
        code = getattr(exc, "status_code", None)
        if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 500:
            return code
    return None


def _live(policy: Idempotency, resource: str, record: Record | None, error) -> bool:
    if error is not None:
        log_event(
            "idempotency_quota_error", logging.WARNING, key=policy.key(resource), error=error
        )
        return False
    return record is not None and record.status in ("completed", "locked")


def _has_record(policy: Idempotency, resource: str) -> bool:
    """True when ``resource`` has a live completed or locked record (a store error: False)."""
    try:
        record = policy.get(resource)
    except LockError as exc:
        return _live(policy, resource, None, exc)
    return _live(policy, resource, record, None)


async def _ahas_record(policy: Idempotency, resource: str) -> bool:
    """:func:`_has_record` with the policy's async read (``Idempotency.aget``)."""
    try:
        record = await policy.aget(resource)
    except LockError as exc:
        return _live(policy, resource, None, exc)
    return _live(policy, resource, record, None)


def _release(ticket: Any, quota: _Quota | None) -> None:
    """Delete the record (nothing recorded) and its place in the principal's cap."""
    if ticket.release() and quota is not None:
        quota.forget(ticket.key)


async def _arelease(ticket: Any, quota: _Quota | None) -> None:
    """:func:`_release` with the async forms."""
    if await ticket.arelease() and quota is not None:
        await quota.aforget(ticket.key)


def _refused(status: int | None) -> bool:
    """Whether an error answer ``status`` is a refusal (4xx: the record is deleted) rather
    than a server error (5xx, or an exception Django answers with 500: marked failed)."""
    return status is not None and 400 <= status < 500


def _released_event(ticket: Any, status: int | None) -> None:
    log_event("idempotency_released", logging.INFO, key=ticket.key, reason=f"http_{status}")


def _settle_error(ticket: Any, quota: _Quota | None, status: int | None, exc=None) -> None:
    if _refused(status):
        _release(ticket, quota)
        _released_event(ticket, status)
        return
    ticket.fail(exc, reason=None if exc is not None else f"http_{status}")


async def _asettle_error(ticket: Any, quota: _Quota | None, status: int | None, exc=None) -> None:
    """:func:`_settle_error` with the async forms."""
    if _refused(status):
        await _arelease(ticket, quota)
        _released_event(ticket, status)
        return
    await ticket.afail(exc, reason=None if exc is not None else f"http_{status}")


class _Quota:
    """One principal's cap of live records (``max_records``) in Redis
    (:mod:`celery_steplock._redis.scripts.idempotency_quota`): each record key counts from
    its first lock for ``lock_ttl + ttl`` seconds, then from its completion for ``ttl``
    (the heartbeat may keep a record locked past its lock TTL: it never counts shorter than
    the record lives), unless its record was released (a refused request, a streaming
    response). A Redis error is logged and admits (the store's own call then decides: the
    Redis store is down too, the database store runs on)."""

    _admit = wire.Script(ADMIT)
    _completed = wire.Script(COMPLETED)

    def __init__(self, client: Any, redis_key: str, limit: int, hold: float):
        self.client = client
        self.redis_key = redis_key
        self.limit = limit
        self.hold = hold

    def _admit_steps(self, key: str) -> calls.Steps[None]:
        try:
            admitted, wait_ms = yield calls.Eval(
                self._admit,
                [self.redis_key],
                [key, str(self.limit), str(max(1, int(self.hold * 1000)))],
                "idempotency quota",
            )
        except LockError as exc:
            log_event("idempotency_quota_error", logging.WARNING, key=key, error=exc)
            return
        if not int(admitted):
            raise IdempotencyQuotaExceeded(
                f"the principal holds its max_records ({self.limit}) live idempotency records",
                retry_after=int(wait_ms) / 1000.0,
                key=key,
                limit=f"{self.limit} live records",
            )

    def _completed_steps(self, key: str, ttl: float) -> calls.Steps[None]:
        try:
            yield calls.Eval(
                self._completed,
                [self.redis_key],
                [key, str(max(1, int(ttl * 1000)))],
                "idempotency quota",
            )
        except LockError as exc:
            log_event("idempotency_quota_error", logging.WARNING, key=key, error=exc)

    def _forget_steps(self, key: str) -> calls.Steps[None]:
        try:
            yield calls.Command(
                ("ZREM", self.redis_key, key), "idempotency quota", key=self.redis_key
            )
        except LockError as exc:
            log_event("idempotency_quota_error", logging.WARNING, key=key, error=exc)

    def admit(self, key: str) -> None:
        """Count record ``key``. Raises IdempotencyQuotaExceeded when the principal holds
        ``limit`` other live records (nothing is counted then)."""
        calls.run(self._admit_steps(key), self.client)

    def completed(self, key: str, ttl: float) -> None:
        """Count record ``key`` for ``ttl`` seconds from now (it completed now)."""
        calls.run(self._completed_steps(key, ttl), self.client)

    def forget(self, key: str) -> None:
        """Stop counting record ``key`` (its record was released: nothing recorded)."""
        calls.run(self._forget_steps(key), self.client)

    async def aadmit(self, key: str) -> None:
        """:meth:`admit` on the running loop's asyncio client (the same script and key)."""
        await calls.arun(self._admit_steps(key), async_client_for(self.client))

    async def acompleted(self, key: str, ttl: float) -> None:
        """:meth:`completed` on the running loop's asyncio client."""
        await calls.arun(self._completed_steps(key, ttl), async_client_for(self.client))

    async def aforget(self, key: str) -> None:
        """:meth:`forget` on the running loop's asyncio client."""
        await calls.arun(self._forget_steps(key), async_client_for(self.client))


class _Outcome:
    """The end of one guarded response. Its record completes once the response is rendered
    (a ``TemplateResponse`` or DRF ``Response`` is rendered after the view returns) and every
    database transaction open around the view has committed (``ATOMIC_REQUESTS``); it fails
    when one rolls back, when the rendering raises, or when recording does, so the retry
    runs the view again at once instead of meeting a ``locked`` record."""

    def __init__(self, ticket: Any, request: HttpRequest, quota: _Quota | None = None):
        self.ticket = ticket
        self.request = request
        self.quota = quota
        self.snapshot: dict[str, Any] | None = None
        self.waiting: set[str] = set()

    def _io(self, run: Callable[[], Any], arun: Callable[[], Awaitable[Any]]) -> None:
        """Run one store operation: ``run()`` here; :class:`_AsyncOutcome` runs ``arun()``
        on the view's event loop."""
        run()

    def refused(self, status: int) -> None:
        """An error answer: a 4xx (the request refused) deletes the record and its place in
        the principal's cap; a 5xx marks it failed (kept for operators, binding nothing)."""
        ticket, quota = self.ticket, self.quota
        self._io(
            lambda: _settle_error(ticket, quota, status),
            lambda: _asettle_error(ticket, quota, status),
        )

    def settle(self, response) -> None:
        if getattr(response, "streaming", False):
            ticket, quota = self.ticket, self.quota
            self._io(lambda: _release(ticket, quota), lambda: _arelease(ticket, quota))
            return
        if response.status_code >= 400:
            self.refused(response.status_code)
            return
        self.waiting = {
            c.alias for c in connections.all(initialized_only=True) if c.in_atomic_block
        }
        # What ends the response without a COMMIT or a rendering: an exception after the view
        # (the COMMIT itself, the rendering: Django's got_request_exception), or a rollback
        # without one (set_rollback: the response's close).
        pending = getattr(self.request, _PENDING, None)
        if pending is None:
            pending = []
            setattr(self.request, _PENDING, pending)
        pending.append(self)
        closers = getattr(response, "_resource_closers", None)
        if isinstance(closers, list):
            closers.append(self.abandon)
        for alias in sorted(self.waiting):
            transaction.on_commit(functools.partial(self._committed, alias), using=alias)
        if getattr(response, "is_rendered", True) is False:
            response.add_post_render_callback(self._rendered)
        else:
            self._rendered(response)

    def _rendered(self, response) -> None:
        try:
            if response.status_code >= 400:
                self.refused(response.status_code)
                return
            self.snapshot = _snapshot(response)
        except Exception as exc:  # noqa: BLE001 - the response stands; the record must not
            _unrecordable(self.ticket, exc)
            ticket, error = self.ticket, exc
            self._io(
                lambda: ticket.fail(error, reason="unrecordable"),
                lambda: ticket.afail(error, reason="unrecordable"),
            )
            return
        self._finish()

    def _committed(self, alias: str) -> None:
        self.waiting.discard(alias)
        self._finish()

    def _finish(self) -> None:
        if self.snapshot is None or self.waiting:
            return
        self._io(self._complete, self._acomplete)

    def _complete(self) -> None:
        if self.ticket.complete(self.snapshot) and self.quota is not None:
            self.quota.completed(self.ticket.key, self.ticket.policy.ttl)

    async def _acomplete(self) -> None:
        if await self.ticket.acomplete(self.snapshot) and self.quota is not None:
            await self.quota.acompleted(self.ticket.key, self.ticket.policy.ttl)

    def abandon(self) -> None:
        """Fail the record unless it was completed (the transaction rolled back, or the
        response never rendered)."""
        if not self.ticket.done:
            ticket = self.ticket
            reason = "rolled_back" if self.waiting else "not_rendered"
            self._io(
                lambda: ticket.fail(None, reason=reason), lambda: ticket.afail(None, reason=reason)
            )


class _AsyncOutcome(_Outcome):
    """The end of a guarded async view's response that is rendered after the view returns
    (a ``TemplateResponse``, a DRF ``Response``). Django renders it in a thread
    (``sync_to_async(response.render)``, its own hop, not ours), where the post-render
    callback runs: the record is then completed (or failed) with the async forms on the
    view's event loop (``asyncio.run_coroutine_threadsafe``; that thread waits for it). A
    callback that runs on the loop itself (an ``async`` render, the response's close)
    starts a task of the loop instead. A response rendered when the view returns (an
    ``HttpResponse``, a ``JsonResponse``: the common case) never gets here: it is recorded
    at once, on the loop, by :meth:`_ViewPolicy.ahandle`."""

    def __init__(self, ticket: Any, request: HttpRequest, quota: _Quota | None = None):
        super().__init__(ticket, request, quota)
        self.loop = asyncio.get_running_loop()

    def _io(self, run: Callable[[], Any], arun: Callable[[], Awaitable[Any]]) -> None:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            from ..._loops import background

            background(arun())
            return
        if self.loop.is_closed():
            run()  # the view's loop is gone: the sync form, from this thread
            return
        asyncio.run_coroutine_threadsafe(arun(), self.loop).result()  # type: ignore[arg-type]


def _abandon_pending(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    for outcome in getattr(request, _PENDING, None) or ():
        outcome.abandon()


got_request_exception.connect(_abandon_pending, dispatch_uid="celery_steplock.idempotency")


def _part(text: str) -> str:
    return f"{len(text)}:{text}"


def _host(request) -> str:
    """The request's host as records and caps are keyed on: ``request.get_host()`` (checked
    against ``ALLOWED_HOSTS``) in lower case, without its port and trailing dot. Django
    accepts any digits as a port (``:1``, ``:01``): with the port, each would be another
    host, with a fresh cap and fresh keys. An IPv6 literal keeps its brackets."""
    host = _http_request(request).get_host().lower()
    if host.startswith("["):
        return host[: host.index("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0].removesuffix(".")


class _ViewPolicy:
    def __init__(
        self,
        namespace: str,
        *,
        version,
        ttl,
        lock_ttl,
        methods: Iterable[str],
        header: str,
        required: bool,
        scope: Callable | None,
        anonymous: bool,
        app,
        options,
        max_records: int | None = None,
        label: Callable[[str], str] = str,
    ):
        # Every argument is judged here, at decoration (or the middleware's load), by the
        # policy's own checks: the policy itself is only built at the first request.
        for name in options:
            if name not in POLICY_KEYWORDS:
                close = difflib.get_close_matches(name, VIEW_OPTIONS, n=1)
                raise InvalidArgument(
                    f"{label(name)}: unknown argument"
                    + (f"; did you mean {close[0]!r}?" if close else ""),
                    label(name),
                )
        for name, value in (("version", version), ("ttl", ttl), ("lock_ttl", lock_ttl)):
            if value is not None:
                check_argument(name, value, label(name))
        for name, value in options.items():
            if name in POLICY_ARGUMENTS and value is not None:
                check_argument(name, value, label(name))
        check_argument("namespace", namespace, label("namespace"))
        if scope is not None and not callable(scope):
            raise ImproperlyConfigured(
                f"{label('scope')} must be a callable(request) -> str | None, got {shown(scope)}",
                setting=label("scope"),
            )
        check_bool(anonymous, label("anonymous"))
        check_bool(required, label("required"))
        if (
            isinstance(methods, (str, bytes))
            or not isinstance(methods, Iterable)
            or not (methods := tuple(methods))
            or not all(isinstance(m, str) and _TOKEN.fullmatch(m) for m in methods)
        ):
            raise ImproperlyConfigured(
                f"{label('methods')} must be a list of HTTP method names, got {shown(methods)}",
                setting=label("methods"),
            )
        if (
            not isinstance(header, str)
            or len(header) > MAX_HEADER_LENGTH
            or not _TOKEN.fullmatch(header)
        ):
            raise ImproperlyConfigured(
                f"{label('header')} must be an HTTP header name, got {shown(header)}",
                setting=label("header"),
            )
        self.max_records = (
            check_count(
                max_records,
                label("max_records"),
                minimum=MIN_IDEMPOTENCY_MAX_RECORDS,
                maximum=MAX_IDEMPOTENCY_MAX_RECORDS,
            )
            if max_records is not None
            else None
        )
        self.namespace = namespace
        self.methods = tuple(m.upper() for m in methods)
        self.header = header
        self.required = required
        self.scope = scope or default_scope
        self.anonymous = anonymous
        self.app = app
        self.arguments = dict(version=version, ttl=ttl, lock_ttl=lock_ttl, **options)
        self._policy: Idempotency | None = None
        self._app: Any = None

    @property
    def policy(self) -> Idempotency:
        if self._policy is None:
            app = self.app
            if app is None and "client" not in self.arguments:
                from celery import current_app

                app = current_app._get_current_object()  # type: ignore[attr-defined]
            self._policy = Idempotency(self.namespace, app=app, **self.arguments)
            self._app = app
        return self._policy

    def quota(self, request, principal: str | None = None) -> _Quota | None:
        """The cap of the request's principal (host and scope; ``principal``: the request's
        :meth:`principal` when already known), or None when the policy's store has no Redis
        (a store object without one)."""
        policy = self.policy
        store = policy.store
        records = store if isinstance(store, RedisRecords) else getattr(store, "cache", None)
        if not isinstance(records, RedisRecords):
            return None
        limit = self.max_records
        if limit is None:
            from ...conf import DEFAULTS, Settings

            app = self._app
            limit = (
                Settings(app).idempotency_max_records
                if app is not None
                else DEFAULTS["idempotency_max_records"]
            )
        if principal is None:
            principal = self.principal(request)
        holder = _part(_host(request)) + _part(principal or "")
        redis_key = idempotency_quota_key(
            records.prefix, idempotency_key(policy.secret, "http-quota", holder)
        )
        return _Quota(records.client, redis_key, limit, policy.lock_ttl + policy.ttl)

    def principal(self, request) -> str | None:
        """The request's principal for the record's resource: ``"p:<scope>"``, the anonymous
        scope when opted in, else None (the layer refuses the key). A scope function that
        raises propagates (the view does not run)."""
        return self._principal(self.scope(request))

    async def aprincipal(self, request) -> str | None:
        """:meth:`principal` in an async view: the default scope is :func:`adefault_scope`
        (no blocking lookup of the user), an ``async def`` scope function is awaited, a sync
        one is called on the event loop (it must not query the database there: give an
        ``async def`` one that uses Django's async ORM)."""
        scope = self.scope
        if scope is default_scope:
            found = await adefault_scope(request)
        elif iscoroutinefunction(scope) or inspect.iscoroutinefunction(scope):
            found = await scope(request)
        else:
            found = scope(request)
        return self._principal(found)

    def _principal(self, scope: Any) -> str | None:
        if scope is not None and not isinstance(scope, str):
            raise ImproperlyConfigured(
                f"scope must return a str or None, got {shown(scope)}", setting="scope"
            )
        if scope:
            return f"p:{scope}"
        return ANONYMOUS_SCOPE if self.anonymous else None

    def resource(self, request, value: str, prefix: str = "", principal: str | None = None) -> str:
        """The resource of key ``value``: the host (``request.get_host()``, checked against
        ``ALLOWED_HOSTS``, without its port and trailing dot: :func:`_host`), the principal
        (``principal``: the request's :meth:`principal` when already known) and the key,
        each length-prefixed (no two requests of different hosts or principals share one).
        Raises ImproperlyConfigured when there is no principal."""
        if principal is None:
            principal = self.principal(request)
        if principal is None:
            raise ImproperlyConfigured("no authenticated principal", setting="anonymous")
        return _part(_host(request)) + _part(principal) + _part(f"{prefix}{value}")

    def _screen(self, http: HttpRequest) -> tuple[HttpResponse | None, str | None]:
        """The request's key, before any I/O: ``(None, None)`` when it is not guarded (another
        method, no header and not required: the view just runs), ``(answer, None)`` when it
        is answered without the view (400), ``(None, key)`` when it is guarded."""
        if http.method not in self.methods:
            return None, None
        value = http.headers.get(self.header)
        if value is None:
            if self.required:
                return _error(400, f"the {self.header} header is required"), None
            return None, None
        # An empty key is a bad key, not no key: it must not turn the guard off.
        if not value.strip() or len(value) > MAX_HEADER_LENGTH or not value.isprintable():
            return _error(
                400,
                f"the {self.header} header must be 1 to {MAX_HEADER_LENGTH} printable characters",
            ), None
        return None, value

    def _no_principal(self) -> JsonResponse:
        return _error(
            403,
            f"the {self.header} header needs an authenticated client: its recorded "
            f"response is only replayed to the client that made it",
        )

    def _admission(
        self, request, value: str, principal: str, prefix: str, quota: _Quota | None
    ) -> Generator[_Io, Any, Any]:
        """The guard's decision for a request with key ``value``, written once for both
        forms (as :mod:`celery_steplock.calls` writes a Redis operation): it yields each
        store operation as an :class:`_Io` (the quota's admission, the record read, the
        begin, a release), which :func:`_drive` runs with the sync forms and :func:`_adrive`
        with the async ones, sending back the result or throwing the error in. Returns the
        :class:`~celery_steplock.patterns.idempotency.IdempotentCall`, or the answer given
        without the view (413, 400, 429, 422, 409, 503)."""
        policy = self.policy
        resource = self.resource(request, value, prefix, principal)
        try:
            fingerprint = _request_fingerprint(request, policy.secret)
            refusal = None
            if quota is not None:
                key = policy.key(resource)
                try:
                    yield _Io(lambda: quota.admit(key), lambda: quota.aadmit(key))
                except IdempotencyQuotaExceeded as exc:
                    # The cap is for new keys: one with a live record gets its answer
                    # (replay, 409, 422) even if its quota entry is gone.
                    live = yield _Io(
                        lambda: _has_record(policy, resource),
                        lambda: _ahas_record(policy, resource),
                    )
                    if not live:
                        raise
                    refusal = exc
            ticket = yield _Io(
                lambda: policy.begin(resource, fingerprint=fingerprint),
                lambda: policy.abegin(resource, fingerprint=fingerprint),
            )
            if refusal is not None and not ticket.replayed:
                # the record ended meanwhile: the key is new again
                yield _Io(lambda: _release(ticket, None), lambda: _arelease(ticket, None))
                raise refusal
        except RequestDataTooBig:
            return _error(
                413,
                f"the request body is larger than DATA_UPLOAD_MAX_MEMORY_SIZE "
                f"({settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes) a request with a "
                f"{self.header} may have (files of a multipart body do not count)",
            )
        except MultiPartParserError as exc:
            return _error(400, f"the multipart body cannot be parsed: {exc}")
        except IdempotencyQuotaExceeded as exc:
            return _error(
                429,
                f"too many live {self.header} records for this client (max_records "
                f"{quota.limit if quota is not None else ''}): retry later",
                **{"Retry-After": str(max(1, math.ceil(exc.retry_after)))},
            )
        except IdempotencyKeyReused:
            return _error(422, f"this {self.header} was used for another request")
        except IdempotencyInProgress as exc:
            return _error(
                409,
                f"a request with this {self.header} is in progress",
                **{"Retry-After": str(max(1, math.ceil(exc.retry_after)))},
            )
        except LockStoreUnavailable:
            return _error(503, "the idempotency store is unavailable", **{"Retry-After": "1"})
        if ticket.replayed:
            return _replayed(ticket.result)
        return ticket

    def handle(self, request, call: Callable[[], Any], resource_prefix: str = ""):
        """Guard one request of a sync view: ``call()`` runs the view (see the module's
        text for the answers)."""
        http = _http_request(request)
        answer, value = self._screen(http)
        if value is None:
            return answer if answer is not None else call()
        # The scope function runs once per request (it may query the database).
        principal = self.principal(request)
        if principal is None:
            return self._no_principal()
        quota = self.quota(request, principal)
        ticket = _drive(self._admission(request, value, principal, resource_prefix, quota))
        if isinstance(ticket, HttpResponse):
            return ticket
        try:
            response = call()
        except BaseException as exc:
            _settle_error(ticket, quota, _refusal_status(exc), exc)
            raise
        try:
            _Outcome(ticket, http, quota).settle(response)
        except Exception as exc:  # noqa: BLE001 - the view ran: answer, and let the key rerun
            _unrecordable(ticket, exc)
            ticket.fail(exc, reason="unrecordable")
        return response

    async def ahandle(
        self, request, call: Callable[[], Awaitable[Any]], resource_prefix: str = ""
    ):
        """Guard one request of an async view (``await call()`` runs it): :meth:`handle`'s
        decisions and answers, on the event loop with the async forms of the policy
        (``abegin``, ``acomplete``, ``afail``, ``arelease``) and of the cap. With the Redis
        store nothing hops to a thread: the key's checks, the fingerprint (the body Django's
        ASGI handler already read), the cap, the record, the view and the recording of a
        response rendered when the view returns. What does hop: Django's own user lookup
        when the default scope needs it (``request.auser()``), the database store's
        operations (``DatabaseRecords``' async forms), and the recording of a response
        Django renders after the view (:class:`_AsyncOutcome`)."""
        http = _http_request(request)
        answer, value = self._screen(http)
        if value is None:
            return answer if answer is not None else await call()
        principal = await self.aprincipal(request)
        if principal is None:
            return self._no_principal()
        quota = self.quota(request, principal)
        ticket = await _adrive(self._admission(request, value, principal, resource_prefix, quota))
        if isinstance(ticket, HttpResponse):
            return ticket
        try:
            response = await call()
        except asyncio.CancelledError:
            await asyncio.shield(_arelease(ticket, quota))  # the view never finished
            raise
        except BaseException as exc:
            await asyncio.shield(_asettle_error(ticket, quota, _refusal_status(exc), exc))
            raise
        # The view ran: its outcome is recorded even when the request is cancelled meanwhile
        # (a client that disconnects), or the record would stay in progress, renewed while
        # the process lives, and every retry would get 409.
        await asyncio.shield(self._arecord(ticket, http, quota, response))
        return response

    @staticmethod
    async def _arecord(ticket: Any, http: Any, quota: Any, response: Any) -> None:
        """Record ``response``, the view's, on ``ticket`` (:meth:`ahandle`'s last step)."""
        try:
            if getattr(response, "streaming", False):
                await _arelease(ticket, quota)
            elif response.status_code >= 400:
                await _asettle_error(ticket, quota, response.status_code)
            elif getattr(response, "is_rendered", True) is False:
                _AsyncOutcome(ticket, http, quota).settle(response)
            else:
                snapshot = _snapshot(response)
                if await ticket.acomplete(snapshot) and quota is not None:
                    await quota.acompleted(ticket.key, ticket.policy.ttl)
        except Exception as exc:  # noqa: BLE001 - the view ran: answer, and let the key rerun
            _unrecordable(ticket, exc)
            await ticket.afail(exc, reason="unrecordable")


def _unrecordable(ticket: Any, exc: BaseException) -> None:
    log_event(
        "idempotency_record_failed",
        logging.ERROR,
        key=ticket.key,
        reason="unrecordable",
        error=exc,
    )


class _Io:
    """One store operation of :meth:`_ViewPolicy._admission`, in both forms: ``run()``
    (sync) and ``arun()`` (a coroutine)."""

    __slots__ = ("run", "arun")

    def __init__(self, run: Callable[[], Any], arun: Callable[[], Awaitable[Any]]):
        self.run = run
        self.arun = arun


def _drive(steps: Generator[_Io, Any, Any]) -> Any:
    """Run ``steps`` with the sync forms; an error is thrown back in where it was yielded."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        send, error = None, None
        try:
            send = step.run()
        except Exception as exc:  # noqa: BLE001 - thrown into the generator
            error = exc


async def _adrive(steps: Generator[_Io, Any, Any]) -> Any:
    """Run ``steps`` with the async forms, as :func:`_drive`."""
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        send, error = None, None
        try:
            send = await step.arun()
        except Exception as exc:  # noqa: BLE001 - thrown into the generator
            error = exc


def idempotent_view(
    view: Callable | None = None,
    *,
    namespace: str | None = None,
    version: str | int = "1",
    ttl: float | None = None,
    lock_ttl: float | None = None,
    methods: Iterable[str] = UNSAFE_METHODS,
    header: str = "Idempotency-Key",
    required: bool = False,
    scope: Callable[[Any], str | None] | None = None,
    anonymous: bool = False,
    max_records: int | None = None,
    app: Any = None,
    **options: Any,
):
    """Decorator of a Django view function, or of a view method (``def post(self, request)``
    of a DRF ``APIView`` or a Django class-based view): requests with ``header`` (``methods``
    only) run once per host, principal and key; see the module's text for the answers.

    On a DRF handler method (or under ``@api_view``), the guard runs inside DRF's dispatch,
    after its authentication, permission and throttle checks: ``request.user`` is the user
    DRF authenticated, and a client DRF refuses never reaches a recorded response.

    An async view (an ``async def`` function or handler method, a class-based view whose
    handlers are async, the ``async def post`` of a DRF async adapter's ``APIView`` such as
    adrf's) gets a coroutine function with the same answers, guarded on the event loop with
    the async forms of the policy: with the Redis store, no thread hop. Its ``scope`` may
    be an ``async def``; the default awaits Django's ``request.auser()``
    (:func:`adefault_scope`). A cancelled view (Django cancels it when the client
    disconnects) releases its record.

    Args:
        view: The view (the decorator is usable bare, ``@idempotent_view``).
        namespace: Default ``"django:<module>.<qualname>"``.
        version: Part of every record key (str or int).
        ttl: Seconds a completed record replays (default ``steplock_idempotency_ttl``).
        lock_ttl: Seconds a ``locked`` record lives (default
            ``steplock_idempotency_lock_ttl``).
        methods: The guarded methods (default POST, PUT, PATCH, DELETE).
        header: The request header holding the key.
        required: True: a guarded method's request without the header gets 400.
        scope: ``scope(request) -> str | None``: the principal a record belongs to (default
            :func:`default_scope`, the authenticated user; an async view's may be ``async
            def``). None means no principal, and the
            request's key is refused with 403 (fail closed); an exception propagates.
        anonymous: True: a request without a principal is guarded in one anonymous scope per
            host (any client that knows a key gets its response: keys must be unguessable
            and responses public). Every anonymous client of a host is then one principal,
            and shares one ``max_records``.
        max_records: The live records one principal (per host, the port aside) may hold
            (1 to 1,000,000; default ``steplock_idempotency_max_records``, 10,000): a
            request with a new key beyond it gets 429 with ``Retry-After`` and the view does
            not run; a key that has a live record is never refused (replay, 409, 422). The
            count is one per principal and host across every guarded view (and the
            middleware): this view checks its ``max_records`` against that shared count. A
            record counts from its first request for ``lock_ttl + ttl``, then from its
            completion for ``ttl``, unless it was released (a refused request, 4xx, or a
            streaming response: deleted at once).
        app: The Celery app (default the current one).
        **options: As :class:`~celery_steplock.patterns.idempotency.Idempotency` (``store``,
            ``on_store_error``, ``serializer``...).

    Returns:
        The wrapped view (``wrapper.idempotency`` is its policy).

    Raises:
        ImproperlyConfigured: ``scope`` is not callable, ``anonymous`` or ``required``
            not a bool, ``methods`` not a list of method names, ``header`` no header name,
            ``version``, ``ttl``, ``lock_ttl``, ``max_records`` or an ``**options`` value of
            the wrong type or out of its bounds
            (:func:`celery_steplock.patterns.idempotency.check_argument`), an unknown
            keyword (an :class:`~celery_steplock.exceptions.InvalidArgument`, also a
            TypeError) (at decoration); ``scope`` returned neither a str nor None (at the
            request).
    """

    def decorate(fun: Callable) -> Callable:
        policy = _ViewPolicy(
            namespace or f"django:{fun.__module__}.{fun.__qualname__}",
            version=version,
            ttl=ttl,
            lock_ttl=lock_ttl,
            methods=methods,
            header=header,
            required=required,
            scope=scope,
            anonymous=anonymous,
            app=app,
            options=options,
            max_records=max_records,
        )

        wrapper: Callable
        if iscoroutinefunction(fun) or inspect.iscoroutinefunction(fun):
            # An ``async def`` view, or a class-based view whose handlers are (its
            # ``as_view()`` is marked so): a coroutine function, guarded on the loop.
            @functools.wraps(fun)
            async def wrapper(*args, **kwargs):
                request = args[0] if _is_request(args[0]) else args[1]
                return await policy.ahandle(request, lambda: fun(*args, **kwargs))

        else:

            @functools.wraps(fun)
            def wrapper(*args, **kwargs):
                # A view function's request comes first; a view method's after ``self``.
                request = args[0] if _is_request(args[0]) else args[1]
                return policy.handle(request, lambda: fun(*args, **kwargs))

        wrapper.idempotency = policy  # type: ignore[attr-defined]  # a function attribute
        return wrapper

    return decorate(view) if view is not None else decorate


def idempotency_exempt(view: Callable) -> Callable:
    """Mark a view (function, or a class-based view's class) that
    :class:`IdempotencyMiddleware` never guards, even with ``"required": True`` (a login
    form, a webhook with its own deduplication).

    Args:
        view: The view function or class.

    Returns:
        ``view`` itself, marked.
    """
    view.idempotency_exempt = True  # type: ignore[attr-defined]  # a function attribute
    return view


def _exempt_view(func: Any) -> bool:
    return bool(
        getattr(func, "idempotency_exempt", False)
        or getattr(getattr(func, "view_class", None), "idempotency_exempt", False)
        or getattr(getattr(func, "cls", None), "idempotency_exempt", False)
    )


def _guarded_by_view(func: Any, method: str) -> bool:
    # A view with its own @idempotent_view (on the function, or on the class-based view's
    # handler of this method) is guarded by it alone: its options are the ones that hold,
    # and one request takes one record, not two.
    if getattr(func, "idempotency", None) is not None:
        return True
    cls = getattr(func, "view_class", None) or getattr(func, "cls", None)
    if cls is None:
        return False
    # A DRF ViewSet routes a method to its action (``{"post": "create"}``).
    actions = getattr(func, "actions", None) or {}
    handler = getattr(cls, actions.get(method.lower(), method.lower()), None)
    return getattr(handler, "idempotency", None) is not None


def middleware_policy(config: Any) -> tuple[_ViewPolicy, list[re.Pattern]]:
    """The policy and the compiled ``exempt_paths`` of :class:`IdempotencyMiddleware` for
    ``config``, the value of ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE``: its one validation, run
    at the middleware's load and by ``manage.py check`` (``celery_steplock.E011``).

    Args:
        config: A dict of the middleware's options, or None (every default).

    Returns:
        The view policy (its :class:`Idempotency` is built at the first request) and the
        compiled ``exempt_paths``.

    Raises:
        ImproperlyConfigured: ``config`` is not a dict, names an unknown option (with the
            closest real one), or an option's value is of the wrong type or out of its
            bounds (those of :func:`idempotent_view`). The message names the setting and
            the option (``STEPLOCK_IDEMPOTENCY_MIDDLEWARE["ttl"]``); ``setting`` is
            ``"STEPLOCK_IDEMPOTENCY_MIDDLEWARE"``.
    """

    def label(name: str) -> str:
        return f'{MIDDLEWARE_SETTING}["{name}"]'

    def refuse(message: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(message, setting=MIDDLEWARE_SETTING)

    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise refuse(f"{MIDDLEWARE_SETTING} must be a dict of options, got {shown(config)}")
    known = (*VIEW_OPTIONS, "exempt_paths")
    for name in config:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f'; did you mean "{close[0]}"?' if close else ""
            raise refuse(f"{label(str(name))}: unknown option{hint}")
    config = dict(config)
    exempt = config.pop("exempt_paths", None) or ()
    if isinstance(exempt, (str, bytes)) or not isinstance(exempt, (list, tuple)):
        raise refuse(
            f"{label('exempt_paths')} must be a list of regular expressions, got {shown(exempt)}"
        )
    compiled = []
    for pattern in exempt:
        try:
            compiled.append(re.compile(pattern))
        except (re.error, TypeError) as exc:
            raise refuse(
                f"{label('exempt_paths')}: {shown(pattern)} is not a regular expression ({exc})"
            ) from None
    try:
        policy = _ViewPolicy(
            config.pop("namespace", "django"),
            version=config.pop("version", "1"),
            ttl=config.pop("ttl", None),
            lock_ttl=config.pop("lock_ttl", None),
            methods=config.pop("methods", UNSAFE_METHODS),
            header=config.pop("header", "Idempotency-Key"),
            required=config.pop("required", False),
            scope=config.pop("scope", None),
            anonymous=config.pop("anonymous", False),
            app=config.pop("app", None),
            max_records=config.pop("max_records", None),
            options=config,
            label=label,
        )
    except ImproperlyConfigured as exc:
        raise refuse(str(exc)) from None
    return policy, compiled


class IdempotencyMiddleware:
    """Middleware form of :func:`idempotent_view` for every view: a request of an unsafe
    method with an ``Idempotency-Key`` header runs once per key, path, host and principal.
    Place it after ``AuthenticationMiddleware`` (check ``celery_steplock.E010``): it reads
    ``request.user`` before the view runs, so a client a view or DRF authenticates by a
    header has no principal here and its key is refused (403; guard DRF views with
    :func:`idempotent_view` on the handler instead, which the middleware then leaves to
    that guard). Settings (Django):
    ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE = {"version": ..., "ttl": ..., "methods": [...],
    "header": ..., "required": False, "namespace": "django", "scope": ..., "anonymous":
    False, "max_records": ..., "exempt_paths": [regex, ...]}`` (all optional). Views marked
    :func:`idempotency_exempt`, paths one of ``exempt_paths`` matches (``re.search`` on
    ``request.path_info``) and paths that resolve to no view are never guarded. A view with
    its own :func:`idempotent_view` (the function, a class-based view's handler of the
    request's method, a DRF ViewSet's action) is left to it: one guard, with the view's
    options, per request.

    Sync and async (Django's ``sync_capable``/``async_capable`` middleware): under ASGI,
    Django builds it with an async ``get_response`` and it guards each request on the event
    loop, so an async view below it runs with no ``sync_to_async`` hop of ours (with the
    Redis store; a sync view below it is adapted by Django as always); under WSGI it is the
    sync middleware it always was. The default scope of an async request is
    :func:`adefault_scope` (``request.auser()``)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable):
        from django.conf import settings

        self.get_response = get_response
        config = getattr(settings, MIDDLEWARE_SETTING, None)
        self.policy, self.exempt_paths = middleware_policy(config)
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def _exempt(self, request) -> bool:
        if request.method not in self.policy.methods:
            return True
        if any(pattern.search(request.path_info) for pattern in self.exempt_paths):
            return True
        try:
            match = resolve(request.path_info, getattr(request, "urlconf", None))
        except Resolver404:
            return True  # no view: nothing to guard (Django answers 404)
        return _exempt_view(match.func) or _guarded_by_view(match.func, request.method)

    def __call__(self, request):
        if self.is_async:
            return self.__acall__(request)
        if self._exempt(request):
            return self.get_response(request)
        return self.policy.handle(
            request, lambda: self.get_response(request), resource_prefix=f"{request.path}\0"
        )

    async def __acall__(self, request):
        if self._exempt(request):
            return await self.get_response(request)
        return await self.policy.ahandle(
            request, lambda: self.get_response(request), resource_prefix=f"{request.path}\0"
        )
