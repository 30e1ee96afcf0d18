"""celery-steplock: owner-keyed Redis leases with a heartbeat and a Django compare-and-swap
guard, so that duplicate deliveries, retries, resumes and compensations never commit the same
step twice.

Public API::

    from celery_steplock import StepLockedTask, DjangoStepLockedTask, RedisLeaseStore, Lease
    from celery_steplock import AsyncRedisLeaseStore, get_async_lease_store  # asyncio
    from celery_steplock import signals, exceptions
    from celery_steplock import effects  # effects that go out once (effects.publish, ...)
"""

import warnings

from . import effects, exceptions, signals
from ._version import __version__ as __version__
from .exceptions import (
    AdmissionDenied,
    CircuitOpen,
    EffectsUnavailable,
    ForceReleaseRefused,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeyReused,
    IdempotencyQuotaExceeded,
    ImproperlyConfigured,
    InvalidArgument,
    InvalidEffect,
    InvalidStepId,
    InvalidTransition,
    LeaseHeldByAnother,
    LeaseNotHeld,
    LockContended,
    LockError,
    LockLost,
    LockNameError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
    OuterTransactionError,
    RateLimited,
    StepLockError,
    StepNotFound,
    TransitionConflict,
    TransitionError,
)
from .lock import Lease, RedisLeaseStore, get_lease_store, make_client, new_owner_token
from .patterns.breaker import CircuitBreaker
from .patterns.ratelimit import RateDecision, SlidingWindow, TokenBucket
from .patterns.retry import NonRetryable, RetryPolicy
from .task import StepLockedTask

#: Old names kept for one release (DeprecationWarning on first use).
_RENAMED = {"RedisStepLock": "RedisLeaseStore", "get_lock": "get_lease_store"}

__all__ = [
    "StepLockedTask",
    "DjangoStepLockedTask",
    "RedisLeaseStore",
    "AsyncRedisLeaseStore",
    "get_async_lease_store",
    "Lease",
    "make_client",
    "new_owner_token",
    "get_lease_store",
    "signals",
    "exceptions",
    "effects",
    "EffectsUnavailable",
    "InvalidEffect",
    "StepLockError",
    "ImproperlyConfigured",
    "LockNameError",
    "LockError",
    "LockContended",
    "LockLost",
    "LockStoreUnavailable",
    "LockStoreMisconfigured",
    "TransitionError",
    "TransitionConflict",
    "InvalidTransition",
    "StepNotFound",
    "InvalidStepId",
    "OuterTransactionError",
    "ForceReleaseRefused",
    "LeaseNotHeld",
    "LeaseHeldByAnother",
    "InvalidArgument",
    "Idempotency",
    "idempotent",
    "IdempotencyError",
    "IdempotencyKeyReused",
    "IdempotencyInProgress",
    "IdempotencyQuotaExceeded",
    "CircuitBreaker",
    "CircuitOpen",
    "AdmissionDenied",
    "RetryPolicy",
    "NonRetryable",
    "ConcurrencyLimit",
    "ConcurrencyLimited",
    "RateLimited",
    "TokenBucket",
    "SlidingWindow",
    "RateDecision",
    "Decision",
]

#: The former name of :class:`RateDecision`, kept for one release.
Decision = RateDecision


def __getattr__(name: str):
    # Imported on first use: its base class imports Django.
    if name == "DjangoStepLockedTask":
        from .contrib.django.task import DjangoStepLockedTask

        return DjangoStepLockedTask
    if name in ("Idempotency", "idempotent"):
        from .patterns import idempotency

        return getattr(idempotency, name)
    if name in ("AsyncRedisLeaseStore", "get_async_lease_store"):
        from .aio import lock as aio_lock

        return getattr(aio_lock, name)
    if name in ("ConcurrencyLimit", "ConcurrencyLimited"):
        from .patterns import concurrency

        return getattr(concurrency, name)
    if name in _RENAMED:
        new_name = _RENAMED[name]
        warnings.warn(
            f"celery_steplock.{name} is deprecated; use celery_steplock.{new_name}",
            DeprecationWarning,
            stacklevel=2,
        )
        value = globals()[name] = globals()[new_name]  # warn once: `from x import y` looks twice
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
