"""Django admin pages of celery_steplock, one module per page; importing this package (Django's
``autodiscover`` does) registers them all.

``leases``
    "Held leases", read live from Redis, and the audited force release of one lease.
``history``
    The timeline of one lock name (its history in Redis), linked from the Held leases
    rows and the event log's rows.
``events``
    The lease event log (``LeaseEvent`` rows), read-only.
``idempotency``
    The idempotency records of the database store, with the "Invalidate" action.
``breakers``
    The circuit breakers, read live from Redis, and the audited override.
``ratelimits``
    The rate limits, read live from Redis (use against the limit, waiting tickets).
``concurrency``
    The concurrency limits, read live from Redis (slots held and by whom, waiters).
``activity``
    The last hour per minute as charts (inline SVG drawn on the server): per task the lease
    wait and hold times, contention and conflicts; rate limits' decisions; breakers' states.
``effects``
    The effects outbox (``Effect`` rows), read-only, with the audited "Retry now" and
    "Discard" actions.
``_common``
    What they share: error text safe for staff, the audited-view wrapper, the bases.

Every name of the single-module admin is importable from here.
"""

from __future__ import annotations

# The names of the single-module admin outside __all__ stay importable (``x as x``: a
# re-export).
from ..models import CircuitBreakerState as CircuitBreakerState
from ..models import IdempotencyRecord as IdempotencyRecord
from ..models import Lease as Lease
from ..models import LeaseEvent as LeaseEvent
from ._common import _error_text as _error_text
from ._common import logger as logger
from .activity import ActivityAdmin
from .breakers import MAX_BREAKERS as MAX_BREAKERS
from .breakers import BreakerOverrideForm as BreakerOverrideForm
from .breakers import CircuitBreakerAdmin
from .breakers import _task_breakers as _task_breakers
from .breakers import breaker_names as breaker_names
from .concurrency import ConcurrencyLimitAdmin
from .effects import EffectAdmin
from .events import LeaseEventAdmin
from .idempotency import IdempotencyRecordAdmin as IdempotencyRecordAdmin
from .idempotency import _idempotency_store as _idempotency_store
from .leases import LIST_PARAMS as LIST_PARAMS
from .leases import ForceReleaseForm, LeaseAdmin, LeaseChangeList, TaskNameFilter
from .leases import _breakable as _breakable
from .leases import _duration as _duration
from .leases import _holder as _holder
from .leases import _list_query as _list_query
from .ratelimits import RateLimitAdmin

__all__ = [
    "LeaseAdmin",
    "LeaseEventAdmin",
    "ForceReleaseForm",
    "LeaseChangeList",
    "TaskNameFilter",
    "CircuitBreakerAdmin",
    "RateLimitAdmin",
    "ConcurrencyLimitAdmin",
    "EffectAdmin",
    "ActivityAdmin",
]
