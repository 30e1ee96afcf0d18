"""celery-steplock: owner-keyed Redis leases with a heartbeat and a Django compare-and-swap
guard, so that duplicate deliveries, retries, resumes and compensations never commit the same
step twice.

Public API::

    from celery_steplock import StepLockedTask, DjangoStepLockedTask, RedisLeaseStore, Lease
    from celery_steplock import signals, exceptions
"""
from . import exceptions, signals
from .exceptions import (ImproperlyConfigured, InvalidTransition, LockContended, LockError,
                         LockLost, LockNameError, LockStoreUnavailable, StepLockError,
                         StepNotFound, TransitionConflict, TransitionError)
from .lock import Lease, RedisLeaseStore, make_client, new_owner_token
from .lock import get_lease_store
from .task import StepLockedTask

__version__ = "0.1.0"

__all__ = [
    "StepLockedTask", "DjangoStepLockedTask", "RedisLeaseStore", "Lease", "make_client",
    "new_owner_token", "get_lease_store", "signals", "exceptions", "StepLockError",
    "ImproperlyConfigured", "LockNameError", "LockError", "LockContended", "LockLost",
    "LockStoreUnavailable", "TransitionError", "TransitionConflict", "InvalidTransition",
    "StepNotFound",
]


def __getattr__(name: str):
    # Imported on first use: its base class imports Django.
    if name == "DjangoStepLockedTask":
        from .contrib.django.task import DjangoStepLockedTask

        return DjangoStepLockedTask
    if name in ("RedisStepLock", "get_lock"):
        from . import lock

        return getattr(lock, name)  # deprecated aliases: lock.py warns
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
