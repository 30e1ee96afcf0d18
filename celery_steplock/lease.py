"""The :class:`Lease` value object, as its holder sees it, and the owner token and holder
metadata that go with a grant.

A lease's local validity is measured on a monotonic clock (``time.monotonic`` unless another
is given): the time the acquire or last successful renewal was *sent*, plus the TTL, less a
drift allowance, so the holder stops trusting the lease before Redis can expire it.
"""
from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .exceptions import LockLost

__all__ = ["Lease", "drift", "CLOCK_DRIFT_FACTOR", "new_owner_token", "owner_has_task_id",
           "holder_metadata"]

#: Share of the TTL held back from the local validity for clock drift (as in Redlock).
CLOCK_DRIFT_FACTOR = 0.01


def drift(ttl: float) -> float:
    """Seconds of a ``ttl`` (seconds) held back for clock drift and the acquire round trip:
    ``ttl * CLOCK_DRIFT_FACTOR + 0.002``."""
    return ttl * CLOCK_DRIFT_FACTOR + 0.002


def new_owner_token(task_id: str | None = None) -> str:
    """A fresh owner token: 32 hex digits, unique per execution attempt. With ``task_id``
    the last 8 are a digest of the task id (:func:`owner_has_task_id`), so that the step
    row's owner column tells a redelivery of the same task id from another task; the other
    24 (96 bits) stay random."""
    token = uuid.uuid4().hex
    if task_id is None:
        return token
    return token[:24] + _task_digest(task_id)


def _task_digest(task_id: str) -> str:
    return hashlib.sha256(str(task_id).encode("utf-8", "surrogatepass")).hexdigest()[:8]


def owner_has_task_id(owner: str | None, task_id: str | None) -> bool:
    """Whether ``owner`` (an owner token) was made by ``new_owner_token(task_id)``; a token
    made without a task id matches a given one by chance only (1 in 2**32)."""
    if not owner or not task_id or len(owner) != 32:
        return False
    return owner[24:] == _task_digest(task_id)


def holder_metadata(task_id: str | None = None, task_name: str | None = None,
                    retries: int | None = None, **extra: Any) -> dict[str, Any]:
    """The metadata stored beside an owner token: who holds the lease, for people and for
    the reaper (``worker`` is the Celery node name, e.g. ``celery@host``; ``step`` is
    ``"<app_label>.<model>:<pk>"`` of the step the lease guards; ``renew_ms`` the holder's
    renewal interval in milliseconds). Returns a dict without the None values; ``hostname``
    and ``pid`` are this process's."""
    meta = {"task_id": task_id, "task_name": task_name, "hostname": socket.gethostname(),
            "pid": os.getpid(), "retries": retries}
    meta.update(extra)
    return {k: v for k, v in meta.items() if v is not None}


@dataclass(eq=False)
class Lease:
    """One granted lease, as seen by its holder.

    ``ttl`` is in seconds. ``acquired_at`` and ``valid_until`` are readings of ``clock``
    (default :func:`time.monotonic`, seconds): ``valid_until`` is when the acquire (or last
    successful renewal) was *sent* plus the TTL less :func:`drift`. ``lost`` turns true when
    that deadline passes, when a renewal finds the key gone or owned by someone else, or when
    ``max_hold_until`` passes; it never turns back.
    """

    name: str
    key: str
    owner: str
    fence: int
    ttl: float
    acquired_at: float
    valid_until: float
    task_id: str | None = None
    task_name: str | None = None
    max_hold_until: float | None = None
    lost_reason: str | None = None
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _lost: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def lost(self) -> bool:
        """True once the lease can no longer be trusted (see the class docstring)."""
        if not self._lost.is_set():
            now = self.clock()
            if self.max_hold_until is not None and now >= self.max_hold_until:
                self.mark_lost("max hold reached: renewal stopped")
            elif now >= self.valid_until:
                self.mark_lost("local validity ran out without a successful renewal")
        return self._lost.is_set()

    def mark_lost(self, reason: str) -> bool:
        """Flag the lease lost with ``reason``; returns False if it already was."""
        if self._lost.is_set():
            return False
        self.lost_reason = reason
        self._lost.set()
        return True

    def renewed(self, sent_at: float, ttl: float | None = None) -> None:
        """Record a successful renewal sent at ``sent_at`` (a ``clock`` reading); ``ttl``
        (seconds) replaces the TTL when given."""
        if ttl is not None:
            self.ttl = ttl
        self.valid_until = sent_at + self.ttl - drift(self.ttl)

    def remaining(self) -> float:
        """Seconds of local validity left (0.0 when lost)."""
        return 0.0 if self.lost else max(0.0, self.valid_until - self.clock())

    def check(self) -> None:
        """Raise :class:`LockLost` (with ``name``, ``key``, ``owner``, ``fence``) if the lease
        is lost; call it between units of work."""
        if self.lost:
            raise LockLost(f"lease {self.key} (owner {self.owner}, fence {self.fence}) is "
                           f"lost: {self.lost_reason}", key=self.key, name=self.name,
                           owner=self.owner, fence=self.fence)

    @property
    def idempotency_key(self) -> str:
        """``"<task name>:<lock name>"``: a key for effects outside the database (HTTP,
        e-mail, payments) that is the same for every attempt of this task on this step:
        retries, redeliveries and duplicates alike, so a system that deduplicates on it
        performs the effect once. Where that system can refuse stale writers, pass it
        ``fence`` too (Kleppmann 2016): it increases with every grant."""
        return f"{self.task_name}:{self.name}" if self.task_name else self.name
