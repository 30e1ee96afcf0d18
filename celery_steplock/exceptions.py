"""The celery-steplock exception tree.

Every error the library raises derives from :class:`StepLockError` (tests/test_exceptions.py
checks this drawing against the classes: each once, under its first base of the tree)::

    StepLockError
    ├── ImproperlyConfigured        a setting or task option is invalid (names it)
    │   ├── InvalidArgument         an argument of the public API is invalid (names it)
    │   ├── GreenPoolUnsupported    the heartbeat cannot renew natively (_green)
    │   └── EffectsUnavailable      an effect declared outside a step's transaction (effects)
    ├── LockNameError               an argument cannot enter a lock name (names it)
    ├── MetadataError               lease metadata names a reserved field (names the keys)
    ├── OuterTransactionError       called inside a caller's transaction.atomic()
    ├── InvalidEffect               an effect's argument cannot be stored (names it)
    ├── LockError                   an error about one lease (names it)
    │   ├── LockContended           the lease is held by another owner (retryable)
    │   ├── LockStoreUnavailable    Redis could not be reached (retryable)
    │   ├── LockStoreMisconfigured  Redis refused our credentials or a permission (not retried)
    │   ├── LockLost                a held lease expired, was stolen or ran past its max hold
    │   │   └── FenceAhead          the step row's fence is ahead of the store's (clock went back)
    │   └── ForceReleaseRefused     an operator's force release deleted nothing
    │       ├── LeaseNotHeld        ... because the lease is not held
    │       ├── LeaseHeldByAnother  ... because another owner holds it now
    │       └── AuditRecordFailed   ... because its audit record could not be written
    ├── TransitionError             a step's status transition did not happen
    │   ├── InvalidTransition       ``from_ -> to`` is not in the allowed-transition table
    │   ├── StepNotFound            no row with that primary key
    │   ├── InvalidStepId           the step id cannot be a primary key of the step model
    │   └── TransitionConflict      the compare-and-swap matched no row (another owner won)
    ├── AdmissionDenied             a gate refused the execution for now (retryable later)
    │   ├── RateLimited             a cluster-wide rate limit has no quota left
    │   ├── ConcurrencyLimited      every slot of a concurrency limit is held
    │   └── CircuitOpen             the dependency's circuit breaker is open
    └── IdempotencyError            an idempotency record refused the call
        ├── IdempotencyKeyReused    the key's record was made with other arguments
        ├── IdempotencyInProgress   another execution holds the key (also an AdmissionDenied)
        └── IdempotencyQuotaExceeded  live records at the client's cap (also an AdmissionDenied)

:data:`RETRYABLE_ERRORS` lists the classes a task may retry safely: the body did not commit.
"""

from __future__ import annotations

from typing import Any

from ._jitter import full_jitter

__all__ = [
    "StepLockError",
    "ImproperlyConfigured",
    "InvalidArgument",
    "LockNameError",
    "OuterTransactionError",
    "MetadataError",
    "EffectsUnavailable",
    "InvalidEffect",
    "LockError",
    "LockContended",
    "LockStoreUnavailable",
    "LockStoreMisconfigured",
    "LockLost",
    "FenceAhead",
    "TransitionError",
    "InvalidTransition",
    "StepNotFound",
    "TransitionConflict",
    "InvalidStepId",
    "ForceReleaseRefused",
    "LeaseNotHeld",
    "LeaseHeldByAnother",
    "AuditRecordFailed",
    "AdmissionDenied",
    "RateLimited",
    "ConcurrencyLimited",
    "CircuitOpen",
    "IdempotencyError",
    "IdempotencyKeyReused",
    "IdempotencyInProgress",
    "IdempotencyQuotaExceeded",
    "RETRYABLE_ERRORS",
]


class StepLockError(Exception):
    """Base class of every celery-steplock error (the tree is in the module docstring)."""

    # A subclass with keyword-only attributes pickles them, in this order, through the
    # module function named by _rebuilder (pickles of earlier releases name it too).
    _pickled: tuple[str, ...] = ()
    _rebuilder = ""

    def __reduce__(self) -> Any:
        if not self._pickled:
            return super().__reduce__()
        values = tuple(getattr(self, name) for name in self._pickled)
        return globals()[self._rebuilder], (type(self), str(self), *values)


#: The longest message of ImproperlyConfigured and LockNameError, characters.
MAX_MESSAGE_LENGTH = 2000


def _bounded(message: str) -> str:
    # A message can quote caller-controlled values: it stays a few lines however large they
    # are (it ends up in logs and stored task results).
    if len(message) <= MAX_MESSAGE_LENGTH:
        return message
    cut = len(message) - MAX_MESSAGE_LENGTH
    return f"{message[:MAX_MESSAGE_LENGTH]}... ({cut} more characters)"


class ImproperlyConfigured(StepLockError, ValueError):
    """A ``steplock_*`` setting or a task option has an invalid value.

    The message is at most :data:`MAX_MESSAGE_LENGTH` characters (cut beyond).

    Attributes:
        setting: The setting or option name the message is about, or None.
    """

    def __init__(self, message: str, setting: str | None = None):
        super().__init__(_bounded(str(message)))
        self.setting = setting


class InvalidArgument(ImproperlyConfigured, TypeError):
    """An argument of the library's public API is of the wrong type or out of its bounds.

    E.g. ``RedisLeaseStore.acquire(ttl=...)``. Both a ``ValueError`` and a ``TypeError``, as
    Python raises either for such calls.

    Attributes:
        argument: The argument's name (``setting`` holds the same).
    """

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(message, setting=argument)
        self.argument = argument


class LockNameError(StepLockError, TypeError):
    """A task argument cannot be turned into a lock name (e.g. it is not serialisable).

    The message is at most :data:`MAX_MESSAGE_LENGTH` characters and quotes at most
    ``conf.MAX_SHOWN`` characters of a value.

    Attributes:
        argument: The argument's name, or None.
    """

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(_bounded(str(message)))
        self.argument = argument


class MetadataError(StepLockError, ValueError):
    """Lease metadata uses a reserved key or breaks a bound; raised before anything is written.

    The metadata of ``RedisLeaseStore.acquire(metadata=...)`` or ``holder_metadata`` may not
    use a key reserved for the lease's own fields (``owner``, ``fence``, ``acquired_ms``, ...;
    see :data:`celery_steplock.lease.RESERVED_FIELDS`) nor break a bound of
    :func:`celery_steplock.lease.check_metadata`. The message is at most
    :data:`MAX_MESSAGE_LENGTH` characters.

    Attributes:
        keys: The refused keys, sorted (each quoted at most 40 characters when a bound is
            broken).
    """

    def __init__(self, message: str, keys: tuple[str, ...] = ()):
        super().__init__(_bounded(str(message)))
        self.keys = tuple(keys)


class OuterTransactionError(StepLockError, RuntimeError):
    """A step-locked task was called inside an outer ``transaction.atomic()``.

    Its commit would happen after the lease is released, against the rule "commit first,
    release after".
    """


class EffectsUnavailable(ImproperlyConfigured):
    """An effect was declared (:mod:`celery_steplock.effects`) where none can be written.

    Effects are declared inside the body of a step-locked task that has a ``step_model``
    (from the body to its compare-and-swap) or inside a ``guarded_step`` block; anywhere
    else there is no transaction for them to commit with. Raised too, at COMMIT time,
    when effects were declared but no transition applied in the transaction (the key
    names the transition), or when the step store cannot write them (no
    ``write_effects``); the transaction then rolls back.
    """


class InvalidEffect(StepLockError, ValueError):
    """An argument of an effect cannot be stored in the outbox (not JSON, wrong type, or
    empty where a value is needed); raised at declaration, before anything is written.

    The message is at most :data:`MAX_MESSAGE_LENGTH` characters.

    Attributes:
        argument: The argument's name (``"kwargs"``, ``"url"``, ...).
    """

    def __init__(self, message: str, argument: str | None = None):
        super().__init__(_bounded(str(message)))
        self.argument = argument


class LockError(StepLockError):
    """Base of the errors about a lease.

    Attributes:
        name: The lock name (as in redis-py's ``LockError.lock_name``), or None.
        key: The Redis key holding the lease, or None.
        owner: The owner token of the lease concerned, when known.
        fence: The fencing token (int) of the lease concerned, when known.
        context: Any other keyword given to the constructor (a dict).
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        *,
        name: str | None = None,
        owner: str | None = None,
        fence: int | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.name = name
        self.owner = owner
        self.fence = fence
        self.context = context


class LockContended(LockError):
    """Another owner holds the lease. Retryable: nothing ran.

    Attributes:
        holder: The owner token of the current holder, when known.
        holder_task_id: The current holder's task id, when known.
        ttl: The holder's remaining lifetime in seconds (float), when known.
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        holder: str | None = None,
        ttl: float | None = None,
        holder_task_id: str | None = None,
        *,
        name: str | None = None,
    ):
        super().__init__(message, key=key, name=name)
        self.holder = holder
        self.ttl = ttl
        self.holder_task_id = holder_task_id


class LockStoreUnavailable(LockError):
    """Redis did not answer (connection refused, timeout). Retryable: nothing committed.

    Attributes are those of :class:`LockError`.
    """


class LockStoreMisconfigured(LockError):
    """Redis answered but refused us for a reason a retry cannot fix.

    A command or key the Redis user is not permitted (ACL ``NOPERM``), a wrong password or
    unknown user (``WRONGPASS``, ``NOAUTH``), a failed TLS certificate verification, or more
    waiters in one process than its waiter pool holds. Not retryable and never a reason to
    run a body without its lease: the task fails with it.

    Attributes:
        setting: The setting to fix, e.g. ``steplock_redis_url`` (the credentials or the
            Redis user's ACL) or ``steplock_max_waiters``.
        permissions: The commands the Redis user lacks (a tuple, lower case, with the key
            where one was refused), when known.
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        *,
        setting: str | None = None,
        permissions: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(message, key, **kwargs)
        self.setting = setting
        self.permissions = tuple(permissions)


class LockLost(LockError):
    """The lease is no longer ours; any commit that depended on it is refused.

    It expired locally, the key vanished, another owner took it, or it ran past
    ``lock_max_hold``. Attributes are those of :class:`LockError`.
    """


class FenceAhead(LockLost):
    """The step row carries a fencing token ahead of the one the lock store just granted.

    Raised when the fenced compare-and-swap is refused while the lease is still valid: no
    newer holder of the lease can exist, so the fence in the row came from a store whose
    clock (or counter) was ahead, e.g. before a failover to a primary whose clock is behind
    (fencing tokens are ``max(counter + 1, Redis time in microseconds)``,
    :data:`celery_steplock._redis.scripts.fragments.FENCE`), or from a writer under another
    lock name. Every grant stays behind the row until the store's clock passes it: a task
    retries it after the skew at most ``task.FENCE_AHEAD_RETRY_MAX`` times (not at all when
    the skew exceeds ``steplock_retry_backoff_max``), then fails with it.

    Attributes:
        row_fence: The fencing token in the step row (int), or None when unread.
        skew: Seconds the row's fence is ahead of the lock store's clock now (the granted
            token's lead less the seconds since its grant: what a retry waits out), or None
            when unread.
        step_id: The step's primary key.
    """

    _pickled = ("key", "name", "owner", "fence", "row_fence", "skew", "step_id")
    _rebuilder = "_rebuild_fence_ahead"

    def __init__(
        self,
        message: str,
        key: str | None = None,
        *,
        name: str | None = None,
        owner: str | None = None,
        fence: int | None = None,
        row_fence: int | None = None,
        skew: float | None = None,
        step_id: Any = None,
    ) -> None:
        super().__init__(message, key, name=name, owner=owner, fence=fence)
        self.row_fence = row_fence
        self.skew = skew
        self.step_id = step_id


class ForceReleaseRefused(LockError):
    """A force release deleted nothing.

    Attributes:
        name: The lock name asked for.
        key: The Redis key of that lease.
        owner: The owner token asked for.
        current: The lease as it is now (a dict as ``RedisLeaseStore.inspect`` returns), or
            None when it is not held.
    """

    def __init__(
        self, message: str, *, name: str, key: str, owner: str, current: dict[str, Any] | None
    ):
        holder = current or {}
        fence = holder.get("fence")
        super().__init__(
            message,
            key,
            name=name,
            owner=owner,
            fence=int(fence) if isinstance(fence, str) and fence.isdigit() else None,
        )
        self.current = current


class LeaseNotHeld(ForceReleaseRefused):
    """The lease is not held (released or expired): nothing to release."""


class LeaseHeldByAnother(ForceReleaseRefused):
    """Another owner holds the lease now (``current``): the compare-and-delete spared it.

    Attributes:
        holder: The owner token of the lease's holder now.
    """

    def __init__(self, message: str, **kwargs: Any):
        super().__init__(message, **kwargs)
        self.holder = (self.current or {}).get("owner")


class AuditRecordFailed(ForceReleaseRefused):
    """The audit record of a force release could not be made durable: nothing released.

    The database refused the write or its commit; the lease was left as it was (``current``,
    still held by ``owner``). The error of the audit store is the ``__cause__``.
    """


class TransitionError(StepLockError):
    """Base of the errors about a step's status transition.

    Attributes:
        step_id: The step's primary key.
        from_: The status the transition expected.
        to: The status it was to write.
        current: The step's status when it was read, when known.
    """

    def __init__(
        self,
        message: str,
        step_id: Any = None,
        from_: Any = None,
        to: Any = None,
        current: Any = None,
    ) -> None:
        super().__init__(message)
        self.step_id = step_id
        self.from_ = from_
        self.to = to
        self.current = current


class InvalidTransition(TransitionError):
    """``from_ -> to`` is not allowed by the guard's transition table."""


class StepNotFound(TransitionError):
    """No step row has the given primary key."""


class InvalidStepId(TransitionError, ValueError):
    """The step id cannot be a primary key of the step model, e.g. ``"abc"`` for an integer.

    Raised before any lease is taken; not retryable.

    Attributes:
        argument: The name of the task argument holding the step id (the task's
            ``step_id_arg``).
    """

    def __init__(self, message: str, step_id: Any = None, argument: str | None = None) -> None:
        super().__init__(message, step_id=step_id)
        self.argument = argument


class TransitionConflict(TransitionError):
    """The compare-and-swap updated no row.

    The step left ``from_`` (``current`` holds its status at the time of the check), or a
    newer fencing token already wrote it.

    Attributes:
        stale_fence: True when the status matched and the fenced condition refused.
    """

    def __init__(
        self,
        message: str,
        step_id: Any = None,
        from_: Any = None,
        to: Any = None,
        current: Any = None,
        stale_fence: bool = False,
    ) -> None:
        super().__init__(message, step_id=step_id, from_=from_, to=to, current=current)
        self.stale_fence = stale_fence


class AdmissionDenied(StepLockError):
    """A gate refused the execution for now; the body did not run. Retryable.

    The gates are those of :mod:`celery_steplock.patterns.gates`.

    Attributes:
        retry_after: Seconds (a float >= 0) until the gate may admit it, e.g. a rate
            limit's next token.
        option: The task option (or API argument) of the gate.
        key: The Redis key the gate decided on.
        limit: A short description of the configured limit.
        context: Any other keyword given to the constructor (a dict).
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after: float,
        option: str | None = None,
        key: str | None = None,
        limit: str | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message)
        self.retry_after = max(0.0, float(retry_after))
        self.option = option
        self.key = key
        self.limit = limit
        self.context = context

    def countdown(self) -> float:
        """Seconds to re-queue the refused task after.

        Returns:
            Seconds drawn uniformly from ``[retry_after, 2 * retry_after]`` (full jitter
            past the earliest moment the gate may admit it:
            :func:`celery_steplock._jitter.full_jitter`), ``retry_after`` at least 0.05.
        """
        wait = max(0.05, self.retry_after)
        return full_jitter(wait, after=wait)

    # Pickled into result backends and across eager retries: keep the figures.
    _pickled: tuple[str, ...] = ("retry_after", "option", "key", "limit", "context")
    _rebuilder = "_rebuild_denied"


class RateLimited(AdmissionDenied):
    """A cluster-wide rate limit (token bucket or sliding window) has no quota left.

    Attributes:
        context: ``context["ticket"]`` is the refused request's place in the limit's
            first-come queue (None without one), ``context["headers"]`` the message headers
            carrying it.
    """

    def countdown(self) -> float:
        """Seconds to re-queue the refused task after.

        Returns:
            With a ticket, the time its turn is due: ``retry_after`` (at least 0.01) plus
            2 ms plus at most 5 % (and 50 ms) of jitter, since the quota waits for it there;
            without one, as :meth:`AdmissionDenied.countdown`.
        """
        if not self.context.get("ticket"):
            return super().countdown()
        wait = max(0.01, self.retry_after)
        return full_jitter(min(0.05, 0.05 * wait), after=wait + 0.002)


class ConcurrencyLimited(AdmissionDenied):
    """Every slot of a cluster-wide concurrency limit (bulkhead) is held."""


class CircuitOpen(AdmissionDenied):
    """The dependency's shared circuit breaker is open: the dependency was not called.

    Also raised while its half-open probes are taken.
    """


class IdempotencyError(StepLockError):
    """An idempotency record refused the call; the body did not run.

    The records are those of :mod:`celery_steplock.patterns.idempotency`.

    Attributes:
        key: The record key (64 hex digits).
        namespace: The record's namespace.
        version: The record's policy version.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        namespace: str | None = None,
        version: str | None = None,
    ):
        super().__init__(_bounded(message))
        self.key = key
        self.namespace = namespace
        self.version = version

    _pickled: tuple[str, ...] = ("key", "namespace", "version")
    _rebuilder = "_rebuild_idempotency"


class IdempotencyKeyReused(IdempotencyError, ValueError):
    """The key's record (locked or completed) was made by a call with other arguments.

    A key names one call, its arguments included, until it expires or is invalidated. Not
    retryable: the same call fails the same way.
    """


class IdempotencyInProgress(IdempotencyError, AdmissionDenied):
    """Another execution holds the key's record (``locked``); also an :class:`AdmissionDenied`.

    Retry after ``retry_after`` seconds (at most the holder's remaining lock TTL). A task
    re-queues itself (:meth:`StepLockedTask.handle_denied`). Attributes are those of
    :class:`IdempotencyError` and :class:`AdmissionDenied` (``option`` defaults to
    ``"idempotency_key"``).
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after: float,
        key: str | None = None,
        namespace: str | None = None,
        version: str | None = None,
        option: str | None = "idempotency_key",
        **context: Any,
    ) -> None:
        AdmissionDenied.__init__(
            self, _bounded(message), retry_after=retry_after, option=option, key=key, **context
        )
        self.namespace = namespace
        self.version = version

    _pickled = ("retry_after", "key", "namespace", "version")
    _rebuilder = "_rebuild_in_progress"


class IdempotencyQuotaExceeded(IdempotencyError, AdmissionDenied):
    """The principal already holds its cap of live idempotency records (the HTTP layer's
    ``max_records``, default ``steplock_idempotency_max_records``); also an
    :class:`AdmissionDenied`. No record was made and the view did not run.

    Retry after ``retry_after`` seconds (when the principal's oldest record stops counting).
    ``limit`` is the cap (``"<n> live records"``); other attributes are those of
    :class:`IdempotencyError` and :class:`AdmissionDenied` (``option`` defaults to
    ``"max_records"``). The HTTP layer answers 429 with ``Retry-After``.
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after: float,
        key: str | None = None,
        namespace: str | None = None,
        version: str | None = None,
        limit: str | None = None,
        option: str | None = "max_records",
        **context: Any,
    ) -> None:
        AdmissionDenied.__init__(
            self,
            _bounded(message),
            retry_after=retry_after,
            option=option,
            key=key,
            limit=limit,
            **context,
        )
        self.namespace = namespace
        self.version = version

    _pickled = ("retry_after", "key", "namespace", "version", "limit")
    _rebuilder = "_rebuild_in_progress"


def _rebuild(cls: type[StepLockError], message: str, values: tuple[Any, ...]) -> StepLockError:
    fields = dict(zip(cls._pickled, values))
    return cls(message, **fields.pop("context", {}), **fields)


# One function per family of fields, under the names pickles of earlier releases hold.
def _rebuild_denied(cls: type[AdmissionDenied], message: str, *values: Any) -> StepLockError:
    return _rebuild(cls, message, values)


def _rebuild_idempotency(cls: type[IdempotencyError], message: str, *values: Any) -> StepLockError:
    return _rebuild(cls, message, values)


def _rebuild_in_progress(
    cls: type[IdempotencyInProgress], message: str, *values: Any
) -> StepLockError:
    return _rebuild(cls, message, values)


def _rebuild_fence_ahead(cls: type[FenceAhead], message: str, *values: Any) -> StepLockError:
    return _rebuild(cls, message, values)


#: The errors a task may retry safely: the body did not commit.
RETRYABLE_ERRORS: tuple[type[StepLockError], ...] = (
    LockContended,
    LockStoreUnavailable,
    AdmissionDenied,
)
