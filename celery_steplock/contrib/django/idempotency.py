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
response (status >= 400) or an exception is not recorded, and the key runs again.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import logging
import math
from typing import Any, Callable, Iterable

from django.db import DatabaseError, IntegrityError, router, transaction
from django.http import HttpResponse, JsonResponse
from django.utils import timezone

from ...events import log_event
from ...exceptions import (
    IdempotencyInProgress,
    IdempotencyKeyReused,
    LockError,
    LockStoreUnavailable,
)
from ...patterns.idempotency import (
    Idempotency,
    Record,
    RecordDecision,
    Stored,
    _fingerprint_bytes,
)

__all__ = [
    "DatabaseRecords",
    "idempotent_view",
    "IdempotencyMiddleware",
    "REPLAYED_HEADER",
    "UNSAFE_METHODS",
]

REPLAYED_HEADER = "Idempotent-Replayed"
UNSAFE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
#: Response headers never recorded (a replay must not hand a session to another client).
_NOT_RECORDED = {"set-cookie", "content-length", REPLAYED_HEADER.lower()}
MAX_HEADER_LENGTH = 255


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


class DatabaseRecords:
    """The database store of idempotency records (see the module's text for the
    consistency rule). ``cache``: a :class:`~celery_steplock.patterns.idempotency.RedisRecords` for
    the copies of completed rows (None: no cache); ``using``: a database alias (default the
    model's ``router.db_for_write``). A database error raises LockStoreUnavailable."""

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

    def _put_cache(self, record: Record) -> None:
        if self.cache is None or record.expires_at is None:
            return
        left = record.expires_at - timezone.now().timestamp()
        if left <= 0:
            return
        try:
            self.cache.cache(record, left)
        except LockError as exc:
            log_event("idempotency_cache_error", logging.WARNING, key=record.key, error=exc)

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
        cached = self._cached(key)
        if cached is not None and cached.status == "completed":
            if cached.fingerprint == fingerprint:
                return RecordDecision("replay", record=cached)
            return RecordDecision("reused", status="completed")
        using = self._db()
        try:
            with transaction.atomic(using=using):
                decision = self._begin(
                    using, key, fingerprint, owner, lock_ttl, namespace, version
                )
        except DatabaseError as exc:
            raise self._outage(exc, key, "begin") from exc
        if decision.outcome == "replay" and decision.record is not None:
            self._put_cache(decision.record)
        return decision

    def _begin(
        self, using, key, fingerprint, owner, lock_ttl, namespace, version
    ) -> RecordDecision:
        objects = self.model.objects.using(using)
        now = timezone.now()
        until = now + dt.timedelta(seconds=lock_ttl)
        try:
            # A new key is the common case: the unique key decides who locks it.
            with transaction.atomic(using=using):
                objects.create(
                    key=key,
                    namespace=namespace,
                    version=version,
                    status="locked",
                    fingerprint=fingerprint,
                    owner=owner,
                    created_at=now,
                    locked_at=now,
                    expires_at=until,
                    attempts=1,
                )
            return RecordDecision("locked")
        except IntegrityError:
            pass
        row = objects.select_for_update().get(key=key)
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
        fields: dict[str, Any] = dict(
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
            expires_at=now + dt.timedelta(seconds=ttl),
        )
        objects = self.model.objects.using(using)
        try:
            # One UPDATE when the caller still holds the row (the common case).
            done = objects.filter(key=key, owner=owner, status="locked").update(**fields)
            if not done:
                with transaction.atomic(using=using):
                    if objects.select_for_update().filter(key=key).exists():
                        return False  # another execution holds or completed it
                    objects.create(key=key, created_at=now, attempts=1, **fields)
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
                expires_at=fields["expires_at"].timestamp(),
                serializer=stored.serializer,
                content_type=stored.content_type,
                content_encoding=stored.content_encoding,
                payload=stored.raw(),
            )
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


# -- views --------------------------------------------------------------------------------------


def _default_scope(request) -> str:
    """Keys are per user (an authenticated user's primary key), else shared by anonymous
    clients."""
    user = getattr(request, "user", None)
    if user is not None and getattr(user, "is_authenticated", False):
        return f"user:{user.pk}"
    return "anonymous"


def _request_fingerprint(request, secret) -> str:
    return _fingerprint_bytes(
        [
            request.method.encode(),
            request.path.encode(),
            request.META.get("QUERY_STRING", "").encode(),
            request.META.get("CONTENT_TYPE", "").encode(),
            request.body,
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
        app,
        options,
    ):
        self.namespace = namespace
        self.methods = tuple(m.upper() for m in methods)
        self.header = header
        self.required = required
        self.scope = scope or _default_scope
        self.app = app
        self.arguments = dict(version=version, ttl=ttl, lock_ttl=lock_ttl, **options)
        self._policy: Idempotency | None = None

    @property
    def policy(self) -> Idempotency:
        if self._policy is None:
            app = self.app
            if app is None and "client" not in self.arguments:
                from celery import current_app

                app = current_app._get_current_object()  # type: ignore[attr-defined]
            self._policy = Idempotency(self.namespace, app=app, **self.arguments)
        return self._policy

    def handle(self, request, call: Callable[[], Any], resource_prefix: str = ""):
        if request.method not in self.methods:
            return call()
        value = request.headers.get(self.header)
        if not value:
            if self.required:
                return _error(400, f"the {self.header} header is required")
            return call()
        if len(value) > MAX_HEADER_LENGTH or not value.isprintable():
            return _error(
                400,
                f"the {self.header} header must be 1 to {MAX_HEADER_LENGTH} printable characters",
            )
        policy = self.policy
        resource = f"{self.scope(request)}\0{resource_prefix}{value}"
        try:
            ticket = policy.begin(
                resource, fingerprint=_request_fingerprint(request, policy.secret)
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
        try:
            response = call()
        except BaseException as exc:
            ticket.fail(exc)
            raise
        if getattr(response, "streaming", False):
            ticket.release()
        elif response.status_code >= 400:
            ticket.fail(None, reason=f"http_{response.status_code}")
        else:
            ticket.complete(_snapshot(response))
        return response


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
    scope: Callable[[Any], str] | None = None,
    app: Any = None,
    **options: Any,
):
    """Decorator of a Django view (function): requests with ``header`` (``methods`` only,
    default POST/PUT/PATCH/DELETE) run once per key; see the module's text for the answers
    (replay with ``Idempotent-Replayed: true``, 422, 409, 503 when the store is down and
    fails closed). ``required`` True: a request without the header gets 400. ``scope(request)
    -> str`` separates keys of different clients (default: the authenticated user's pk, else
    one anonymous scope). ``namespace`` default ``"django:<module>.<qualname>"``; ``app`` the
    Celery app (default the current one); other keywords as
    :class:`~celery_steplock.patterns.idempotency.Idempotency`. Usable bare (``@idempotent_view``)."""

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
            app=app,
            options=options,
        )

        @functools.wraps(fun)
        def wrapper(request, *args, **kwargs):
            return policy.handle(request, lambda: fun(request, *args, **kwargs))

        wrapper.idempotency = policy  # type: ignore[attr-defined]  # a function attribute
        return wrapper

    return decorate(view) if view is not None else decorate


class IdempotencyMiddleware:
    """Middleware form of :func:`idempotent_view` for every view: a request of an unsafe
    method with an ``Idempotency-Key`` header runs once per key, path and client scope.
    Settings (Django): ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE = {"version": ..., "ttl": ...,
    "methods": [...], "header": ..., "required": False, "namespace": "django"}``
    (all optional)."""

    def __init__(self, get_response: Callable):
        from django.conf import settings

        self.get_response = get_response
        config = dict(getattr(settings, "STEPLOCK_IDEMPOTENCY_MIDDLEWARE", {}) or {})
        self.policy = _ViewPolicy(
            config.pop("namespace", "django"),
            version=config.pop("version", "1"),
            ttl=config.pop("ttl", None),
            lock_ttl=config.pop("lock_ttl", None),
            methods=config.pop("methods", UNSAFE_METHODS),
            header=config.pop("header", "Idempotency-Key"),
            required=config.pop("required", False),
            scope=config.pop("scope", None),
            app=config.pop("app", None),
            options=config,
        )

    def __call__(self, request):
        return self.policy.handle(
            request, lambda: self.get_response(request), resource_prefix=f"{request.path}\0"
        )
