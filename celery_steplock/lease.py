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
import math
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from .exceptions import ImproperlyConfigured, LockLost, MetadataError

__all__ = [
    "Lease",
    "drift",
    "CLOCK_DRIFT_FACTOR",
    "new_owner_token",
    "owner_has_task_id",
    "owner_task_id",
    "MAX_OWNER_TOKEN",
    "holder_metadata",
    "RESERVED_FIELDS",
    "INTEGER_FIELDS",
    "check_metadata",
    "parse_lease",
    "bounded_text",
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY",
    "MAX_METADATA_VALUE",
    "MAX_METADATA_SIZE",
    "MAX_META_BYTES",
    "MAX_HOLDER_TEXT",
]

logger = logging.getLogger("celery_steplock")

#: Field names metadata may not use: the lease hash's own fields (written by the acquire
#: script; ``contended``, the refusals counted for the history, by a refused acquire) and the
#: ones readers add (``name``, ``key``, ``ttl``, ``malformed``; ``age`` and
#: ``renewed_ago`` by ``celery steplock``).
RESERVED_FIELDS = frozenset(
    {
        "owner",
        "fence",
        "acquired_ms",
        "renewed_ms",
        "ttl_ms",
        "meta",
        "contended",
        "name",
        "key",
        "ttl",
        "malformed",
        "age",
        "renewed_ago",
    }
)

#: Integer fields of a lease and their inclusive bounds: a value outside them (or not a
#: decimal integer) is malformed. ``pid`` fits a C ``pid_t`` (what ``os.kill`` takes).
INTEGER_FIELDS = {
    "fence": (0, 2**63 - 1),
    "acquired_ms": (0, 2**63 - 1),
    "renewed_ms": (0, 2**63 - 1),
    "ttl_ms": (0, 2**63 - 1),
    "renew_ms": (0, 2**63 - 1),
    "pid": (1, 2**31 - 1),
    "retries": (0, 2**31 - 1),
}

#: Characters of a malformed value quoted in ``malformed`` at most.
MALFORMED_EXCERPT = 40


#: Bounds of lease metadata (``acquire(metadata=...)``, :func:`holder_metadata`), checked
#: before any write: entries, characters of a key, characters of a string value, and bytes
#: of the whole encoded ``meta`` field. An integer value must fit a signed 64-bit integer.
MAX_METADATA_ENTRIES = 64
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 1024
MAX_METADATA_SIZE = 16 * 1024
#: A stored ``meta`` field longer than this (bytes) is malformed, never decoded.
MAX_META_BYTES = 64 * 1024
#: Characters at most of the texts :func:`holder_metadata` writes itself (``task_id``,
#: ``task_name``, ``worker``, ``step``): a longer one is stored as :func:`bounded_text` gives.
MAX_HOLDER_TEXT = 255

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _refuse(problem: str, key: Any) -> MetadataError:
    shown_key = _excerpt(key) if isinstance(key, str) else _excerpt(_safe_repr(key))
    return MetadataError(f"lease metadata {problem} (key {shown_key})", keys=(shown_key,))


def _safe_repr(value: Any) -> str:
    try:
        return repr(value)[: MALFORMED_EXCERPT + 3]
    except Exception:  # noqa: BLE001 - a repr that fails still gets a message
        return f"<{type(value).__name__}>"


def check_metadata(metadata: Any) -> None:
    """Check lease metadata before any write, so a refused acquire changes nothing.

    Args:
        metadata: None, or a mapping of at most :data:`MAX_METADATA_ENTRIES` entries whose
            keys are strings of 1 to :data:`MAX_METADATA_KEY` characters, not in
            :data:`RESERVED_FIELDS`, and whose values are None, bool, a finite float, an int
            within [-2**63, 2**63 - 1] or a string of at most :data:`MAX_METADATA_VALUE`
            characters; no key or string value may hold a control character
            (U+0000-U+001F, U+007F-U+009F), and the encoded ``meta`` field must fit
            :data:`MAX_METADATA_SIZE` bytes.

    Raises:
        MetadataError: ``metadata`` breaks one of those rules (its message and ``keys``
            quote at most :data:`MALFORMED_EXCERPT` characters of the key).
    """
    if metadata is None:
        return
    try:
        items = list(metadata.items())
    except Exception:  # noqa: BLE001 - not a mapping
        raise MetadataError(
            f"lease metadata must be None or a mapping, got {_safe_repr(metadata)}", keys=()
        ) from None
    if len(items) > MAX_METADATA_ENTRIES:
        raise MetadataError(
            f"lease metadata may hold at most {MAX_METADATA_ENTRIES} entries, got {len(items)}",
            keys=(),
        )
    reserved = sorted(k for k, _ in items if isinstance(k, str) and k in RESERVED_FIELDS)
    if reserved:
        raise MetadataError(
            f"lease metadata may not use the key(s) {', '.join(reserved)}: reserved for the "
            f"lease's own fields ({', '.join(sorted(RESERVED_FIELDS))})",
            keys=tuple(reserved),
        )
    size = 0
    for key, value in items:
        if not isinstance(key, str):
            raise _refuse("keys must be strings", key)
        if not 0 < len(key) <= MAX_METADATA_KEY:
            raise _refuse(f"keys must be 1 to {MAX_METADATA_KEY} characters", key)
        if _CONTROL.search(key):
            raise _refuse("keys may not hold control characters", key)
        if value is None:
            text = ""
        elif isinstance(value, str):
            if len(value) > MAX_METADATA_VALUE:
                raise _refuse(
                    f"strings must be at most {MAX_METADATA_VALUE} characters, got {len(value)}",
                    key,
                )
            if _CONTROL.search(value):
                raise _refuse("strings may not hold control characters", key)
            text = value
        elif isinstance(value, bool):
            text = ""
        elif isinstance(value, int):
            if not -(2**63) <= value <= 2**63 - 1:
                raise _refuse("integers must fit 64 bits (within [-2**63, 2**63 - 1])", key)
            text = ""
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _refuse("floats must be finite (not NaN or infinite)", key)
            text = ""
        else:
            raise _refuse(
                f"values must be None, str, int, float or bool, got {type(value).__name__}", key
            )
        size += len(key) + len(text)
    if size > MAX_METADATA_SIZE // 8:  # small metadata cannot reach the bound: not encoded
        encoded = len(
            _encode_meta({k: "" if v is None else str(v) for k, v in items}).encode(
                "utf-8", "surrogatepass"
            )
        )
        if encoded > MAX_METADATA_SIZE:
            raise MetadataError(
                f"lease metadata must encode to at most {MAX_METADATA_SIZE} bytes, got {encoded}",
                keys=(),
            )


_encode_meta = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def bounded_text(value: str, limit: int = MAX_HOLDER_TEXT) -> str:
    """A client-chosen text as :func:`holder_metadata` stores it.

    Args:
        value: The text.
        limit: Characters at most of the result.

    Returns:
        ``value`` unchanged when it has at most ``limit`` characters and no control
        character; else each control character written as a backslash escape
        (``\\x1b``), and when still longer than ``limit``, its first ``limit - 45``
        characters, ``"..."`` and ``"sha256:"`` with the first 35 hex digits of the SHA-256
        of the UTF-8 of the original ``value`` (so two long ids that share their beginning
        still differ). Never longer than ``limit`` characters.
    """
    value = str(value)
    if len(value) <= limit and not _CONTROL.search(value):
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:35]
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value[: limit * 4])
    if len(text) <= limit and len(value) <= limit:
        return text
    return f"{text[: limit - 45]}...sha256:{digest}"


def _text(value: Any) -> str:
    # Clients decode with errors="replace": a byte that is not UTF-8 arrives as U+FFFD.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _excerpt(value: str) -> str:
    return repr(value if len(value) <= MALFORMED_EXCERPT else value[:MALFORMED_EXCERPT] + "...")


def parse_lease(fields: Any) -> dict[str, Any]:
    """A stored lease hash as every reader sees it, whatever it holds; never raises for it.

    The readers: the store's ``inspect``/``scan``, the admin, ``celery steplock``, the
    reaper. A field that cannot be what it claims is left out and described in
    ``malformed``: an integer field (:data:`INTEGER_FIELDS`) that is not a decimal integer
    within its bounds, a ``meta`` that is not a JSON object (or nested too deep to decode,
    or longer than :data:`MAX_META_BYTES` bytes: not decoded), a metadata entry whose key is
    reserved (:data:`RESERVED_FIELDS`) or whose value is a list or an object, text that was
    not UTF-8 (kept, with U+FFFD in place of the bad bytes), a missing ``owner``. Readers
    show such a lease as malformed (the reaper skips it).

    Args:
        fields: The hash as read (a mapping of str or bytes).

    Returns:
        A dict of strings: the ``meta`` JSON object spread into top-level fields beside
        ``owner``, ``fence``, ``acquired_ms``... (a field of the hash wins over a metadata
        entry of the same name; leases written before ``meta`` existed hold those fields
        directly and come out the same), plus ``malformed`` (``"field: why; ..."``, its
        parts sorted) when something is wrong. An empty mapping (the key does not exist)
        gives an empty dict.
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
    if meta and (
        len(meta) > MAX_META_BYTES or len(meta.encode("utf-8", "surrogatepass")) > MAX_META_BYTES
    ):
        problems.append(f"meta: larger than {MAX_META_BYTES} bytes ({len(meta)} characters)")
    elif meta:
        try:
            extra = json.loads(meta)
        except (ValueError, RecursionError, TypeError, MemoryError):
            extra = None  # deep nesting, a huge integer, not JSON: malformed, never raised
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
                merged[str(key)] = (
                    value
                    if isinstance(value, str)
                    else (str(value).lower() if isinstance(value, bool) else str(value))
                )
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
    """Seconds of a TTL held back for clock drift and the acquire round trip.

    Args:
        ttl: The lease's TTL in seconds.

    Returns:
        ``ttl * CLOCK_DRIFT_FACTOR + 0.002`` seconds.
    """
    return ttl * CLOCK_DRIFT_FACTOR + 0.002


#: Characters of an owner token at most when it carries its task id (:func:`new_owner_token`):
#: the owner columns' ``max_length`` (``LeaseFencedStep.lock_owner``, the event log's and the
#: admin's records).
MAX_OWNER_TOKEN = 64
#: Random hex digits that start every owner token (96 bits).
_RANDOM_DIGITS = 24
#: What follows the random digits of a token that carries its task id.
_TASK_ID_MARK = ":"
# A task id carried as itself: visible ASCII (no space, no control or non-ASCII character),
# short enough for the token to fit MAX_OWNER_TOKEN (a uuid4 string is 36 characters).
_CARRIED = rf"[\x21-\x7e]{{1,{MAX_OWNER_TOKEN - _RANDOM_DIGITS - 1}}}"
_CARRIED_ID = re.compile(_CARRIED)
_CARRYING = re.compile(rf"[0-9a-f]{{{_RANDOM_DIGITS}}}{re.escape(_TASK_ID_MARK)}({_CARRIED})")
_DIGEST_TOKEN = re.compile(r"[0-9a-f]{32}")


def new_owner_token(task_id: str | None = None, max_length: int | None = None) -> str:
    """A fresh owner token, unique per execution attempt.

    Args:
        task_id: The Celery task id of the attempt, when there is one.
        max_length: The length of the owner column the token is written to, when it has
            one (default None: :data:`MAX_OWNER_TOKEN`): a task id whose carrying form would
            not fit gets the 32-character form.

    Returns:
        Without ``task_id``: 32 random hex digits. With one of 1 to 39 visible ASCII
        characters (a uuid4 string is 36): 24 random hex digits (96 bits), ``":"`` and the
        task id itself, at most :data:`MAX_OWNER_TOKEN` (64) characters, so that the step
        row's owner column names the task id that wrote it (:func:`owner_task_id`: the
        "duplicate" outcome's ``committed_by``). With another task id: 24 random hex digits
        and 8 of a digest of the task id (32 in all, the only form of earlier versions;
        :func:`owner_task_id` gives None). Either form tells a redelivery of the same task
        id from another task (:func:`owner_has_task_id`).
    """
    token = uuid.uuid4().hex
    if task_id is None:
        return token
    task_id = str(task_id)
    fits = max_length is None or _RANDOM_DIGITS + len(_TASK_ID_MARK) + len(task_id) <= max_length
    if fits and _CARRIED_ID.fullmatch(task_id):
        return f"{token[:_RANDOM_DIGITS]}{_TASK_ID_MARK}{task_id}"
    return token[:_RANDOM_DIGITS] + _task_digest(task_id)


def _task_digest(task_id: str) -> str:
    return hashlib.sha256(str(task_id).encode("utf-8", "surrogatepass")).hexdigest()[:8]


def owner_task_id(owner: str | None) -> str | None:
    """The task id an owner token carries (:func:`new_owner_token`), else None.

    Args:
        owner: An owner token (a step row's owner column, a lease's ``owner``), or None.

    Returns:
        The task id after the 24 random hex digits and ``":"``; None for a token without
        one (made without a task id, carrying only a digest of it, written by an earlier
        version, or chosen by the caller).
    """
    if not owner or len(owner) > MAX_OWNER_TOKEN:
        return None
    match = _CARRYING.fullmatch(owner)
    return match.group(1) if match is not None else None


def owner_has_task_id(owner: str | None, task_id: str | None) -> bool:
    """Whether an owner token was made by ``new_owner_token(task_id)``.

    Args:
        owner: The owner token.
        task_id: The task id.

    Returns:
        True when the token carries ``task_id`` itself (:func:`owner_task_id`), or when it
        is 32 hex digits whose last 8 are the task id's digest (the form of a task id
        that cannot be carried, and of tokens written by earlier versions); a digest
        matches another task id by chance only (1 in 2**32).
    """
    if not owner or not task_id:
        return False
    carried = owner_task_id(owner)
    if carried is not None:
        return carried == str(task_id)
    if not _DIGEST_TOKEN.fullmatch(owner):
        return False
    return owner[_RANDOM_DIGITS:] == _task_digest(task_id)


def holder_metadata(
    task_id: str | None = None,
    task_name: str | None = None,
    retries: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The metadata stored beside an owner token: who holds the lease, for people and the reaper.

    ``task_id``, ``task_name`` and the ``worker`` and ``step`` of ``extra`` are client-chosen
    texts: each is stored as :func:`bounded_text` gives (at most :data:`MAX_HOLDER_TEXT`
    characters, control characters escaped, a longer one cut and followed by a digest of the
    whole), never refused.

    Args:
        task_id: The Celery task id.
        task_name: The task's name.
        retries: The task's retry count.
        **extra: More entries, e.g. ``worker`` (the Celery node name, ``celery@host``),
            ``step`` (``"<app_label>.<model>:<pk>"`` of the step the lease guards),
            ``renew_ms`` (the holder's renewal interval, in milliseconds).

    Returns:
        A dict without the None values, with this process's ``hostname`` and ``pid``.

    Raises:
        MetadataError: ``extra`` breaks a rule of :func:`check_metadata`.
    """
    texts = {"task_id": task_id, "task_name": task_name}
    for name in ("worker", "step"):
        if name in extra:
            texts[name] = extra.pop(name)
    bounded = {k: None if v is None else bounded_text(v) for k, v in texts.items()}
    meta = {
        "task_id": bounded["task_id"],
        "task_name": bounded["task_name"],
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "retries": retries,
    }
    meta.update({k: bounded[k] for k in ("worker", "step") if k in bounded})
    meta.update(extra)
    meta = {k: v for k, v in meta.items() if v is not None}
    check_metadata(meta)
    return meta


@dataclass(eq=False)
class Lease:
    """One granted lease, as seen by its holder.

    :attr:`lost` turns true when ``valid_until`` passes, when a renewal finds the key gone
    or owned by someone else, or when ``max_hold_until`` passes; it never turns back.

    Attributes:
        name: The lock name.
        key: The Redis key of the lease.
        owner: The owner token.
        fence: The fencing token of the grant.
        ttl: The TTL in seconds.
        acquired_at: When the acquire was sent, a reading of ``clock``.
        valid_until: When the acquire (or the last successful renewal) was *sent* plus the
            TTL less :func:`drift`, a reading of ``clock``.
        task_id: The holder's task id, when known.
        task_name: The holder's task name, when known.
        max_hold_until: The reading of ``clock`` after which the lease is no longer
            renewed (``lock_max_hold``), or None.
        lost_reason: Why the lease was lost, once it is.
        clock: The clock of the readings, in seconds (default :func:`time.monotonic`).
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
        """Flag the lease lost.

        Args:
            reason: Why, kept in :attr:`lost_reason`.

        Returns:
            False if it already was lost, else True.
        """
        if self._lost.is_set():
            return False
        self.lost_reason = reason
        self._lost.set()
        return True

    def renewed(self, sent_at: float, ttl: float | None = None) -> None:
        """Record a successful renewal.

        Args:
            sent_at: When the renewal was sent, a ``clock`` reading.
            ttl: A new TTL in seconds, when it changed.
        """
        if ttl is not None:
            self.ttl = ttl
        self.valid_until = sent_at + self.ttl - drift(self.ttl)

    def remaining(self) -> float:
        """Seconds of local validity left (0.0 when lost)."""
        return 0.0 if self.lost else max(0.0, self.valid_until - self.clock())

    def check(self) -> None:
        """Check the lease between units of work.

        Raises:
            LockLost: The lease is lost (with ``name``, ``key``, ``owner``, ``fence``).
        """
        if self.lost:
            raise LockLost(
                f"lease {self.key} (owner {self.owner}, fence {self.fence}) is "
                f"lost: {self.lost_reason}",
                key=self.key,
                name=self.name,
                owner=self.owner,
                fence=self.fence,
            )

    @property
    def idempotency_key(self) -> str:
        """A key for effects outside the database (HTTP, e-mail, payments), one per step.

        The same for every attempt of this task on this step (retries, redeliveries and
        duplicates alike): a system that deduplicates on it performs the effect once. It is
        HMAC-SHA256 keyed with the name secret over the task name and the lock name
        (:func:`celery_steplock.keys.idempotency_key`), so the system that receives it
        learns nothing of either (a templated lock name carries raw argument values). Where
        that system can refuse stale writers, pass it ``fence`` too (Kleppmann 2016): it
        increases with every grant.

        Returns:
            64 hex digits.

        Raises:
            ImproperlyConfigured: The lease store has no name secret
                (``RedisLeaseStore(name_secret=...)``; tasks get the setting's, or the one
                derived from Django's ``SECRET_KEY``); ``setting`` is
                ``steplock_name_secret``.
        """
        if self.secret is None:
            raise ImproperlyConfigured(
                "lease.idempotency_key needs a name secret: set steplock_name_secret "
                "(CELERY_STEPLOCK_NAME_SECRET in Django settings), or pass name_secret= to "
                "RedisLeaseStore",
                setting="steplock_name_secret",
            )
        from .keys import idempotency_key

        return idempotency_key(self.secret, self.task_name, self.name)
