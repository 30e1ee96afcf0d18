"""The :class:`Lease` value object, as its holder sees it, the owner token and holder
metadata that go with a grant, and :func:`parse_lease`, the one reader of a stored lease hash.

A lease's local validity is measured on a monotonic clock (``time.monotonic`` unless another
is given): the time the acquire or last successful renewal was *sent*, plus the TTL, less a
drift allowance, so the holder stops trusting the lease before Redis can expire it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .exceptions import ImproperlyConfigured, LockLost, MetadataError

__all__ = ["Lease", "drift", "CLOCK_DRIFT_FACTOR", "new_owner_token", "owner_has_task_id",
           "holder_metadata", "RESERVED_FIELDS", "INTEGER_FIELDS", "check_metadata", "parse_lease"]

logger = logging.getLogger("celery_steplock")

#: Field names metadata may not use: the lease hash's own fields (written by the acquire
#: script) and the ones readers add (``name``, ``key``, ``ttl``, ``malformed``; ``age`` and
#: ``renewed_ago`` by ``celery steplock``).
RESERVED_FIELDS = frozenset({"owner", "fence", "acquired_ms", "renewed_ms", "ttl_ms", "meta",
                             "name", "key", "ttl", "malformed", "age", "renewed_ago"})

#: Integer fields of a lease and their inclusive bounds: a value outside them (or not a
#: decimal integer) is malformed. ``pid`` fits a C ``pid_t`` (what ``os.kill`` takes).
INTEGER_FIELDS = {"fence": (0, 2 ** 63 - 1), "acquired_ms": (0, 2 ** 63 - 1),
                  "renewed_ms": (0, 2 ** 63 - 1), "ttl_ms": (0, 2 ** 63 - 1),
                  "renew_ms": (0, 2 ** 63 - 1), "pid": (1, 2 ** 31 - 1),
                  "retries": (0, 2 ** 31 - 1)}

#: Characters of a malformed value quoted in ``malformed`` at most.
MALFORMED_EXCERPT = 40


def check_metadata(metadata: Any) -> None:
    """Raise :class:`~celery_steplock.exceptions.MetadataError` when ``metadata`` (a mapping,
    or None) uses a key of :data:`RESERVED_FIELDS` or a key that is not a string; else
    return None. Called before any write, so a refused acquire changes nothing."""
    if not metadata:
        return
    bad = sorted(repr(k) if not isinstance(k, str) else k for k in metadata
                 if not isinstance(k, str) or k in RESERVED_FIELDS)
    if bad:
        raise MetadataError(
            f"lease metadata may not use the key(s) {', '.join(bad)}: reserved for the "
            f"lease's own fields ({', '.join(sorted(RESERVED_FIELDS))}) or not a string",
            keys=tuple(bad))


def _text(value: Any) -> str:
    # Clients decode with errors="replace": a byte that is not UTF-8 arrives as U+FFFD.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _excerpt(value: str) -> str:
    return repr(value if len(value) <= MALFORMED_EXCERPT else value[:MALFORMED_EXCERPT] + "...")


def parse_lease(fields: Any) -> dict[str, Any]:
    """A stored lease hash as every reader sees it (the store's ``inspect``/``scan``, the
    admin, ``celery steplock``, the reaper), whatever it holds.

    ``fields``: the hash as read (a mapping of str or bytes). The ``meta`` JSON object is
    spread into top-level fields beside ``owner``, ``fence``, ``acquired_ms``... (a field of
    the hash wins over a metadata entry of the same name; leases written before ``meta``
    existed hold those fields directly and come out the same). Returns a dict of strings.

    Never raises for what the hash holds. A field that cannot be what it claims is left out
    and described in ``malformed`` (a string, ``"field: why; ..."``, absent when all is
    well; its parts sorted): an integer field (:data:`INTEGER_FIELDS`) that is not a decimal
    integer within its bounds, a ``meta`` that is not a JSON object, a metadata entry whose
    key is reserved (:data:`RESERVED_FIELDS`) or whose value is a list or an object, text
    that was not UTF-8 (kept, with U+FFFD in place of the bad bytes), a missing ``owner``.
    Readers show such a lease as malformed (the reaper skips it). An empty mapping (the
    key does not exist) gives an empty dict.
    """
    problems: list[str] = []
    info: dict[str, Any] = {}
    try:
        items = list(fields.items())
    except Exception:  # noqa: BLE001 - not a mapping at all
        return {"malformed": "hash: unreadable"}
    if not items:
        return {}  # no hash (HGETALL of a missing key): nothing held, nothing malformed
    for key, value in items:
        info[_text(key)] = _text(value) if value is not None else ""
    meta = info.pop("meta", None)
    if meta:
        try:
            extra = json.loads(meta)
        except ValueError:
            extra = None
        if not isinstance(extra, dict):
            problems.append(f"meta: not a JSON object ({_excerpt(meta)})")
        else:
            merged: dict[str, Any] = {}
            for key, value in extra.items():
                if value is None:
                    continue
                if str(key) in RESERVED_FIELDS:
                    problems.append(f"meta: reserved key {_excerpt(str(key))}")
                    continue
                if isinstance(value, (dict, list)):
                    problems.append(f"{key}: not a string ({type(value).__name__})")
                    continue
                merged[str(key)] = value if isinstance(value, str) else (
                    str(value).lower() if isinstance(value, bool) else str(value))
            merged.update(info)
            info = merged
    for key in list(info):
        if key in INTEGER_FIELDS:
            value = info[key]
            low, high = INTEGER_FIELDS[key]
            text = value.strip()
            digits = text[1:] if text[:1] == "-" else text
            if not (digits.isascii() and digits.isdigit()):
                problems.append(f"{key}: not an integer ({_excerpt(value)})")
                del info[key]
            elif len(digits) > 19 or not low <= int(text) <= high:
                problems.append(f"{key}: out of range ({_excerpt(value)})")
                del info[key]
            else:
                info[key] = str(int(text))
        elif "\ufffd" in info[key] or "\ufffd" in key:
            problems.append(f"{key}: not UTF-8")
    if not info.get("owner"):
        problems.append("owner: missing")
    if problems:
        info["malformed"] = "; ".join(sorted(problems))  # the same whatever the field order
    return info

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
    and ``pid`` are this process's. Raises
    :class:`~celery_steplock.exceptions.MetadataError` when ``extra`` uses a key of
    :data:`RESERVED_FIELDS`."""
    check_metadata(extra)
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
    #: The name secret (HMAC key) of :attr:`idempotency_key`; the lease store's.
    secret: bytes | None = field(default=None, repr=False, compare=False)
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
        """64 hex digits that are the same for every attempt of this task on this step
        (retries, redeliveries and duplicates alike), for effects outside the database
        (HTTP, e-mail, payments): a system that deduplicates on it performs the effect once.
        It is HMAC-SHA256 keyed with the name secret over the task name and the lock name
        (:func:`celery_steplock.keys.idempotency_key`), so the system that receives it
        learns nothing of either (a templated lock name carries raw argument values). Where
        that system can refuse stale writers, pass it ``fence`` too (Kleppmann 2016): it
        increases with every grant.

        Raises ImproperlyConfigured (``setting`` ``steplock_name_secret``) when the lease
        store has no name secret (``RedisLeaseStore(name_secret=...)``; tasks get the
        setting's, or the one derived from Django's ``SECRET_KEY``).
        """
        if self.secret is None:
            raise ImproperlyConfigured(
                "lease.idempotency_key needs a name secret: set steplock_name_secret "
                "(CELERY_STEPLOCK_NAME_SECRET in Django settings), or pass name_secret= to "
                "RedisLeaseStore", setting="steplock_name_secret")
        from .keys import idempotency_key

        return idempotency_key(self.secret, self.task_name, self.name)
