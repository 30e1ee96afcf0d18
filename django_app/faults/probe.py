"""The worker side of the fault-injection suite (``tests/faults``, ``tests/support/faults``).

Enabled only when ``STEPLOCK_FAULTS=1``. It writes a history of every attempt to the control
Redis (``STEPLOCK_FAULTS_URL``; the broker of the fault workers, never the lock store, which the
faults break) and stops an attempt at a named barrier when the controller armed it:

``after_acquire`` (first line of the body), ``before_cas`` and ``after_cas`` (around the
guard's compare-and-swap), ``before_commit`` (after the pre-commit ownership check, the last
point before COMMIT), ``after_commit`` (an on-commit callback, before the release).

Protocol: the controller sets ``faults:arm:<step>:<point>``; the first attempt to reach that
point takes the arm (GETDEL), pushes its description to ``faults:arrived:<step>:<point>`` and
blocks on ``faults:go:<step>:<point>`` until the controller pushes an instruction ("" to go on,
``sleep:<seconds>`` to work that long first). History entries are JSON objects in the list
``faults:history`` with ``ev``, ``t`` (wall clock seconds), ``pid``, ``step``, ``owner``,
``fence``, ``task_id`` and event fields.
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger(__name__)

HISTORY = "faults:history"
BARRIER_TIMEOUT = 300  # seconds an armed barrier waits for the controller
SLICE = 0.05

_client = None
_client_pid = None


def enabled() -> bool:
    return os.environ.get("STEPLOCK_FAULTS") == "1"


def unguarded() -> bool:
    """Negative control: transitions by a plain UPDATE, no compare-and-swap, no pre-check."""
    return os.environ.get("STEPLOCK_FAULTS_UNGUARDED") == "1"


def guard() -> str:
    """The guard of the fault workers' CAS: ``"fenced"`` (default) or ``"nofence"`` (the
    fence-decides family's negative control: status CAS, pre-check and ownership check, no
    fence condition), from ``STEPLOCK_FAULTS_GUARD``."""
    return os.environ.get("STEPLOCK_FAULTS_GUARD") or "fenced"


def _redis():
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        import redis

        url = os.environ.get("STEPLOCK_FAULTS_URL") or os.environ["REDIS_URL"]
        _client = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=BARRIER_TIMEOUT + 30,
            socket_connect_timeout=5,
        )
        _client_pid = os.getpid()
    return _client


def record(event: str, **fields) -> None:
    """Append one history entry; a control-plane error is logged, never raised."""
    if not enabled():
        return
    fields.update(ev=event, t=time.time(), pid=os.getpid())
    if event == "acquired":  # which lock-store path granted it (a split has two primaries)
        fields["via"] = _via()
    try:
        _redis().rpush(HISTORY, json.dumps(fields, default=str))
    except Exception:  # noqa: BLE001
        logger.exception("faults: could not record %s", event)


def _via():
    """The port of this worker's lock-store URL (its proxy in the fault suite), or None."""
    from urllib.parse import urlsplit

    try:
        return urlsplit(os.environ.get("STEPLOCK_REDIS_URL", "")).port
    except ValueError:
        return None


def step_of(name: str | None):
    """The step id of a lock name ``step:<id>``."""
    if name and name.startswith("step:"):
        try:
            return int(name.split(":", 1)[1])
        except ValueError:
            return None
    return None


def _backend_pid():
    try:
        from django.db import connection

        if connection.vendor == "postgresql" and connection.connection is not None:
            return connection.connection.info.backend_pid
    except Exception:  # noqa: BLE001
        return None
    return None


def barrier(point: str, task, step_id) -> None:
    """Record that ``point`` was reached and, if the controller armed it for this step, wait
    for its instruction."""
    if not enabled():
        return
    lease = task.lease
    info = {
        "step": step_id,
        "point": point,
        "task": task.name,
        "task_id": task.request.id,
        "owner": lease.owner if lease else None,
        "fence": lease.fence if lease else None,
        "backend_pid": _backend_pid(),
    }
    record("point", **info)
    client = _redis()
    if not client.getdel(f"faults:arm:{step_id}:{point}"):
        return
    client.rpush(
        f"faults:arrived:{step_id}:{point}",
        json.dumps({**info, "pid": os.getpid(), "t": time.time()}),
    )
    item = client.blpop(f"faults:go:{step_id}:{point}", timeout=BARRIER_TIMEOUT)
    instruction = item[1] if item else ""
    record("resumed", instruction=instruction, **info)
    if instruction.startswith("sleep:"):
        work(task, float(instruction.split(":", 1)[1]), check=False)


def work(task, seconds: float, check: bool = True) -> None:
    """Sleep ``seconds`` in slices; with ``check``, stop with LockLost once the lease is lost."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if check and task.lease is not None:
            task.lease.check()
        time.sleep(min(SLICE, left))


# -- receivers: library signals into the history ------------------------------------------

_EVENTS = {
    "lock_acquired": "acquired",
    "lock_released": "released",
    "lock_lost": "lost",
    "lock_contended": "contended",
    "transition_conflict": "conflict",
    "transition_applied": "applied",
    "lock_store_error": "store_error",
}


def _receiver(event):
    def receive(sender=None, **kw):
        step = kw.get("step_id")
        if step is None:
            step = step_of(kw.get("name"))
        record(
            event,
            step=step,
            owner=kw.get("owner"),
            fence=kw.get("fence"),
            task_id=kw.get("task_id"),
            task=kw.get("task_name"),
            reason=kw.get("reason") or _conflict_reason(event, kw),
            holder=kw.get("holder"),
            current=kw.get("current"),
        )

    receive.__name__ = f"faults_{event}"
    return receive


def _conflict_reason(event, kw):
    """A conflict whose row was still at ``from_`` was refused by the fence condition alone
    (the library's ``TransitionConflict.stale_fence``; the signal carries ``current``)."""
    if event != "conflict" or kw.get("fence") is None or guard() != "fenced":
        return None
    if kw.get("current") is not None and kw.get("current") == kw.get("from_"):
        return "stale fence: the status matched, the fence refused"
    return None


_receivers = {signal: _receiver(event) for signal, event in _EVENTS.items()}


def freeze_heartbeat(sender=None, **kw):
    """``lock_extended`` runs on the heartbeat thread: while ``faults:freeze:<pid>`` holds the
    token it held when this renewal came, it blocks here, so this process renews nothing while
    its task threads run on.

    Each freeze sets a token of its own (a fresh uuid): a thaw followed at once by the
    next freeze (a new trial) changes the token, so the receiver, which looks every
    ``SLICE``, still lets that renewal cycle end, and the next renewal is frozen anew, with its
    own ``heartbeat_frozen`` entry."""
    client = _redis()
    key = f"faults:freeze:{os.getpid()}"
    token = client.get(key)
    if token:
        record("heartbeat_frozen", step=step_of(kw.get("name")), owner=kw.get("owner"))
        while client.get(key) == token:
            time.sleep(SLICE)
        record("heartbeat_thawed", step=step_of(kw.get("name")), owner=kw.get("owner"))


def task_ended(sender=None, task_id=None, task=None, state=None, **kw):
    step = (kw.get("kwargs") or {}).get("step_id")
    if step is None and kw.get("args"):
        step = kw["args"][0]
    record("task_end", step=step, task_id=task_id, task=getattr(task, "name", None), state=state)


def connect() -> bool:
    """Connect the receivers (idempotent); nothing unless STEPLOCK_FAULTS=1."""
    if not enabled():
        return False
    from celery.signals import task_postrun

    from celery_steplock import signals

    for name, receiver in _receivers.items():
        getattr(signals, name).connect(receiver, weak=False, dispatch_uid=f"faults-{name}")
    signals.lock_extended.connect(freeze_heartbeat, weak=False, dispatch_uid="faults-freeze")
    task_postrun.connect(task_ended, weak=False, dispatch_uid="faults-task-end")
    return True


# -- receivers of the distributed patterns (the randomized run, django_app/faults/patterns.py) --

_idempotency_keys: dict = {}  # task id -> the record key its execution locked


def idempotency_key_of(task_id):
    """The idempotency record key the execution ``task_id`` locked in this process, or None."""
    return _idempotency_keys.get(task_id)


def _lease_owner(sender):
    lease = getattr(sender, "lease", None)
    return getattr(lease, "owner", None)


def rate_granted(sender=None, **kw):
    record(
        "rate_granted",
        key=kw.get("key"),
        granted_at=kw.get("granted_at"),
        limit=str(kw.get("limit")),
        task_id=kw.get("task_id"),
        owner=_lease_owner(sender),
    )


def _slot_receiver(event):
    def receive(sender=None, **kw):
        record(
            event,
            limit_key=kw.get("limit_key"),
            limit=kw.get("limit"),
            slot=kw.get("slot"),
            owner=kw.get("owner"),
            fence=kw.get("fence"),
            task_id=kw.get("task_id"),
        )

    receive.__name__ = f"faults_{event}"
    return receive


def idempotency_locked(sender=None, **kw):
    if kw.get("task_id"):
        _idempotency_keys[kw["task_id"]] = kw.get("key")


def _idempotency_receiver(event):
    def receive(sender=None, **kw):
        record(event, key=kw.get("key"), task_id=kw.get("task_id"))

    receive.__name__ = f"faults_{event}"
    return receive


def _breaker_receiver(what):
    def receive(sender=None, **kw):
        record(
            "breaker",
            name=kw.get("name"),
            state=str(kw.get("state")),
            what=what,
            task_id=kw.get("task_id"),
            reason=kw.get("reason"),
        )

    receive.__name__ = f"faults_breaker_{what}"
    return receive


_pattern_receivers = {
    "rate_limit_allowed": rate_granted,
    "slot_acquired": _slot_receiver("slot_acquired"),
    "slot_released": _slot_receiver("slot_released"),
    "slot_expired": _slot_receiver("slot_expired"),
    "idempotency_locked": idempotency_locked,
    "idempotency_completed": _idempotency_receiver("idem_completed"),
    "idempotency_replayed": _idempotency_receiver("idem_replayed"),
    "circuit_opened": _breaker_receiver("opened"),
    "circuit_closed": _breaker_receiver("closed"),
    "circuit_half_opened": _breaker_receiver("half_open"),
    "circuit_rejected": _breaker_receiver("rejected"),
}


def connect_patterns() -> bool:
    """Connect the pattern receivers (idempotent); nothing unless STEPLOCK_FAULTS=1."""
    if not enabled():
        return False
    from celery_steplock import signals

    for name, receiver in _pattern_receivers.items():
        getattr(signals, name).connect(receiver, weak=False, dispatch_uid=f"faults-{name}")
    return True
