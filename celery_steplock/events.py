"""One structured log line and one signal per lease or transition event.

Log lines go to the ``celery_steplock`` logger as ``event=<name> key=... owner=... fence=...``
with the same fields in ``extra={"steplock": {...}}`` for JSON formatters.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from celery.utils.dispatch import Signal

logger = logging.getLogger("celery_steplock")

_FIELDS = ("key", "owner", "fence", "task_id", "task_name", "ttl", "holder", "step_id",
           "from_", "to", "current", "reason", "forced", "policy")


def _value(value: Any) -> str:
    """logfmt: quote a value that holds spaces, quotes, '=' or control characters, so that a
    lock name made from task arguments cannot forge fields or lines."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "='):
        return text
    return json.dumps(text)


def lease_fields(lease) -> dict[str, Any]:
    """The payload fields of a :class:`~celery_steplock.lock.Lease`."""
    return {"key": lease.key, "name": lease.name, "owner": lease.owner, "fence": lease.fence,
            "task_id": lease.task_id, "task_name": lease.task_name, "ttl": lease.ttl}


def listening(signal: Signal, level: int = logging.INFO) -> bool:
    """Whether :func:`emit` of ``signal`` at ``level`` would log or reach a receiver (a
    caller sending many events can skip building their payloads when it would not)."""
    return bool(signal.receivers) or logger.isEnabledFor(level)


def emit(signal: Signal, sender: Any, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``fields`` as one line and send ``signal``; never raises."""
    if not signal.receivers and not logger.isEnabledFor(level):
        return
    fields.setdefault("monotonic", time.monotonic())
    fields.setdefault("timestamp", time.time())
    event = signal.name
    try:
        if logger.isEnabledFor(level):
            text = " ".join(f"{k}={_value(fields[k])}" for k in _FIELDS
                            if fields.get(k) is not None)
            logger.log(level, "event=%s %s", event, text,
                       extra={"steplock": dict(fields, event=event)})
    except Exception:  # noqa: BLE001 - logging must never break locking
        pass
    try:
        signal.send(sender=sender, event=event, **fields)
    except Exception:  # noqa: BLE001 - Celery's send is robust; this guards the rest
        logger.exception("event=%s receiver failed", event)
