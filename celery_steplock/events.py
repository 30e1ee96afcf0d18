"""One structured log line and one signal per lease or transition event.

Log lines go to the ``celery_steplock`` logger as ``event=<name> key=... owner=... fence=...``
with the same fields in ``extra={"steplock": {...}}`` for JSON formatters. Every line the
library writes goes through :func:`emit` (a signal and its line) or :func:`log_event` (a line
only), so every line carries ``record.steplock`` and every value in it is escaped.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from celery.utils.dispatch import Signal

logger = logging.getLogger("celery_steplock")

_FIELDS = (
    "key",
    "owner",
    "fence",
    "task_id",
    "task_name",
    "ttl",
    "holder",
    "step_id",
    "from_",
    "to",
    "current",
    "reason",
    "forced",
    "user",
    "actor",
    "actor_host",
    "via",
    "audit",
    "policy",
    "wait_seconds",
    "hold_seconds",
    "cas_seconds",
    "commit_seconds",
    "limit",
    "retry_after",
    "decision",
    "attempt",
    "countdown",
    "skew",
    "follower",
    "kind",
    "step",
    "attempts",
    "error",
)


def _value(value: Any) -> str:
    """logfmt: quote a value that holds spaces, quotes, '=' or control characters, so that a
    lock name made from task arguments cannot forge fields or lines."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return json.dumps(text)


def _seconds(key: str, value: Any) -> Any:
    """A duration (a ``*_seconds`` field given as a float) rounded to microseconds, the
    resolution a line needs (``time.monotonic`` differences carry float noise such as
    ``0.00027734799999734605``); any other value as it is."""
    if key.endswith("_seconds") and isinstance(value, float):
        return round(value, 6)
    return value


def _text(key: str, value: Any) -> str:
    """The logfmt text of one field: a duration in fixed notation (``0.000005``, never
    ``5e-06``), anything else escaped by :func:`_value`."""
    value = _seconds(key, value)
    if key.endswith("_seconds") and isinstance(value, float) and value == value:
        text = f"{value:.6f}".rstrip("0")
        return text + "0" if text.endswith(".") else text
    return _value(_structured(value))


def _structured(value: Any) -> Any:
    """A value for ``record.steplock``: JSON types as they are, anything else as text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    return str(value)


def log_event(
    event: str, level: int = logging.INFO, *, exc_info: Any = None, **fields: Any
) -> None:
    """Log one line ``event=<event> k=v ...`` to the ``celery_steplock`` logger; never raises.

    The line carries ``extra={"steplock": {"event": event, **fields}}``.

    Args:
        event: The event's name.
        level: The logging level.
        exc_info: As for :meth:`logging.Logger.log`.
        **fields: In the order given, None left out, each value escaped as in logfmt; an
            exception value is written as ``"<type>: <message>"``; a ``*_seconds`` float
            rounded to microseconds (6 decimals) in the line and in ``record.steplock``.
    """
    if not logger.isEnabledFor(level):
        return
    try:
        text = " ".join(f"{k}={_text(k, v)}" for k, v in fields.items() if v is not None)
        payload = {k: _structured(_seconds(k, v)) for k, v in fields.items()}
        payload["event"] = event
        logger.log(
            level,
            "event=%s %s",
            _value(event),
            text,
            exc_info=exc_info,
            extra={"steplock": payload},
        )
    except Exception:  # noqa: BLE001 - logging must never break locking
        pass


def lease_fields(
    lease, task_id: str | None = None, task_name: str | None = None
) -> dict[str, Any]:
    """The payload fields of a lease.

    Args:
        lease: A :class:`~celery_steplock.lease.Lease`, or None (no lease held).
        task_id: The ``task_id`` without a lease.
        task_name: The ``task_name`` without a lease.

    Returns:
        Its ``key``, ``name``, ``owner``, ``fence``, ``task_id``, ``task_name`` and ``ttl``;
        without a lease, None but for ``task_id`` and ``task_name``.
    """
    if lease is None:
        return {
            "key": None,
            "name": None,
            "owner": None,
            "fence": None,
            "task_id": task_id,
            "task_name": task_name,
            "ttl": None,
        }
    return {
        "key": lease.key,
        "name": lease.name,
        "owner": lease.owner,
        "fence": lease.fence,
        "task_id": lease.task_id,
        "task_name": lease.task_name,
        "ttl": lease.ttl,
    }


def listening(signal: Signal, level: int = logging.INFO) -> bool:
    """Whether :func:`emit` would log or reach a receiver.

    A caller sending many events can skip building their payloads when it would not.

    Args:
        signal: The signal.
        level: The logging level of its line.

    Returns:
        True when the signal has receivers or the logger is enabled for ``level``.
    """
    return bool(signal.receivers) or logger.isEnabledFor(level)


#: Callables ``tap(sender, event, fields)`` that :func:`emit` calls first for every event,
#: whether or not the signal has receivers or the line is logged: the per-minute counts of
#: :mod:`celery_steplock.activity`, which a signal receiver would make cost several
#: microseconds more an event (Celery's dispatch). ``fields`` is the event's keyword
#: arguments (no ``timestamp`` yet); a tap must be fast, must not change them, and must not
#: raise.
TAPS: list[Any] = []


def emit(signal: Signal, sender: Any, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``fields`` as one line and send ``signal``; never raises.

    ``monotonic`` and ``timestamp`` are added when not given. A ``*_seconds`` float is
    rounded to microseconds in the line and in ``record.steplock``; the signal's receivers
    get it unrounded. A receiver that raises is logged (``event=receiver_failed``) and
    ignored.

    Args:
        signal: One of :mod:`celery_steplock.signals`.
        sender: The signal's sender.
        level: The logging level of the line.
        **fields: The signal's keyword arguments.
    """
    try:
        for tap in TAPS:
            tap(sender, signal.name, fields)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a tap must never break locking
        log_event("receiver_failed", logging.ERROR, exc_info=True, signal="tap")
    if not signal.receivers and not logger.isEnabledFor(level):
        return
    fields.setdefault("monotonic", time.monotonic())
    fields.setdefault("timestamp", time.time())
    event = signal.name  # type: ignore[attr-defined]
    try:
        if logger.isEnabledFor(level):
            text = " ".join(
                f"{k}={_text(k, fields[k])}" for k in _FIELDS if fields.get(k) is not None
            )
            record = {k: _seconds(k, v) for k, v in fields.items()}
            record["event"] = event
            logger.log(level, "event=%s %s", event, text, extra={"steplock": record})
    except Exception:  # noqa: BLE001 - logging must never break locking
        pass
    try:
        signal.send(sender=sender, event=event, **fields)
    except Exception:  # noqa: BLE001 - Celery's send is robust; this guards the rest
        log_event("receiver_failed", logging.ERROR, exc_info=True, signal=event)
