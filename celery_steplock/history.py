"""The history of a lock name: a capped record of its lease events and of the outcomes of
the executions that held it.

Each name has one Redis list, ``<prefix>:history:{<name>}``
(:func:`celery_steplock.keys.history_key`), newest entry first, in the lease's hash slot.
The lease scripts (:mod:`celery_steplock._redis.scripts.lease`) append to it in the same
call as the lease's own write, so the history costs no round trip: ``acquired`` (a grant),
``contended`` (the first refused acquire of a grant; the refusals are counted in the
lease's ``contended`` field and that count rides on the release), ``released`` (with the
execution's outcome), ``forced`` (an operator's force release) and ``reaped`` (the reaper's
delete of a dead holder's lease). ``lost`` (the holder found its lease gone) is appended by
the holder, one call. ``expired`` is never written: a lease whose TTL ran out leaves
nothing to see, and the reader (:func:`parse_entries`) infers it where a grant follows a
grant of another owner with no end between them. Renewals are not recorded: a lease
renewed every third of its TTL would fill the list with them, the cap would keep only the
latest renewals of one execution, and each renewal would pay a write; the ``acquired`` and
``released`` entries already show the hold.

Bounds: at most ``steplock_history_max_entries`` entries per name (``LTRIM`` once the list
is longer) and the list's TTL reset to ``steplock_history_max_age`` at every append (an
idle name's history is dropped that long after its last event); the reader leaves out
entries older than the max age. ``steplock_history = False`` writes nothing (the scripts
get no history key and skip it). A list rather than a stream: a stream's first node
preallocates its listpack (about 4.4 KB a name on Redis 7.0), a list of two entries takes
about 500 bytes, and most names (one a step) see one execution or two.

The writes go through ``redis.pcall``: a history key of the wrong type, or a Redis user
whose ACL lacks ``LPUSH`` (docs/acl.md), leaves the history unwritten, never a lease
refused.

An entry is one string: :data:`FIELDS` in order joined by U+001F (which no owner token can
hold), trailing empty fields left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ._redis.scripts.lease import HISTORY_FIELDS
from .exceptions import FenceAhead, TransitionConflict

__all__ = [
    "EVENTS",
    "OUTCOMES",
    "HistoryEntry",
    "HistoryConfig",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_MAX_AGE",
    "parse_entries",
    "encode",
    "FIELDS",
    "outcome_of",
]

#: Every event an entry can carry (``expired`` only inferred by the reader).
EVENTS = ("acquired", "contended", "released", "forced", "reaped", "lost", "expired")

#: The outcomes a ``released`` entry can record, in the words of the ``execution_done`` log
#: line: ``committed`` (the step's transition committed), ``conflict`` (the compare-and-swap found the step moved on), ``fenced`` (it
#: was refused by the fence: a newer holder wrote the step), ``duplicate`` (the execution
#: ended as a duplicate), ``skipped``, ``done`` (the body ran, no transition), ``error``.
OUTCOMES = ("committed", "conflict", "fenced", "duplicate", "skipped", "done", "error")

#: Default of ``steplock_history_max_entries``.
DEFAULT_MAX_ENTRIES = 100

#: Default of ``steplock_history_max_age``, seconds (7 days).
DEFAULT_MAX_AGE = 7 * 24 * 3600.0

#: The fields of an entry, in their order in its string: the scripts' own tuple, which
#: the Lua that writes the entries follows (one list for the writer and the reader).
FIELDS = HISTORY_FIELDS

#: The separator of an entry's fields.
SEPARATOR = "\x1f"


@dataclass(frozen=True)
class HistoryConfig:
    """The history bounds a lease store writes with.

    Attributes:
        max_entries: Entries kept per name (approximately: ``MAXLEN ~``), 1 to 100,000.
        max_age: Seconds a name's history lives after its last event, and the age beyond
            which the reader leaves entries out.
    """

    max_entries: int = DEFAULT_MAX_ENTRIES
    max_age: float = DEFAULT_MAX_AGE
    #: ``(length cap, max age ms)`` as the scripts take them (decimal strings), built once.
    args: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        args = (str(self.max_entries), str(max(1, int(self.max_age * 1000))))
        object.__setattr__(self, "args", args)


@dataclass(frozen=True)
class HistoryEntry:
    """One entry of a name's history.

    Attributes:
        id: Its index in the list when read (0: the newest), as text; an inferred entry
            takes the id of the grant it precedes.
        at: Its Redis server time, seconds since the epoch.
        event: One of :data:`EVENTS`, or ``"malformed"`` for an entry that cannot be read.
        owner: The owner token (the contender's for ``contended``).
        fence: The fencing token of the lease concerned (int), when known.
        task_id: The task id, when known.
        outcome: The execution's outcome (``released``: one of :data:`OUTCOMES`), or None.
        contended: Refused acquires counted during the hold (``released``), or None.
        holder: The holder's owner token (``contended``).
        by: Who released it (``forced``: the operator).
        reason: Why (``lost``; ``expired``: inferred; ``malformed``: what is wrong).
        inferred: True for an ``expired`` entry the reader inferred (not stored).
        extra: Fields of the entry this version does not know.
    """

    id: str
    at: float
    event: str
    owner: str | None = None
    fence: int | None = None
    task_id: str | None = None
    outcome: str | None = None
    contended: int | None = None
    holder: str | None = None
    by: str | None = None
    reason: str | None = None
    inferred: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The entry as JSON-ready types (numbers as numbers, None left out but ``id``,
        ``at``, ``event``)."""
        out: dict[str, Any] = {"id": self.id, "at": self.at, "event": self.event}
        for name in ("owner", "fence", "task_id", "outcome", "contended", "holder", "by"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.reason is not None:
            out["reason"] = self.reason
        if self.inferred:
            out["inferred"] = True
        if self.extra:
            out["extra"] = dict(self.extra)
        return out


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


#: The latest time an entry can carry, ms since the epoch: the end of year 9999 (what
#: ``datetime`` can show); a later one is ``malformed``.
MAX_MS = 253_402_300_799_999

#: Seconds an entry's time may be ahead of the reader's Redis time (``parse_entries``'
#: ``now``) before the entry is ``malformed``: the entries are stamped with Redis time, so
#: only a planted or corrupt entry is ahead by more.
FUTURE_SKEW = 24 * 3600.0


def _int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    if value.isascii() and value.isdigit() and len(value) <= 19:
        return int(value)
    raise ValueError(value)


def _entry(raw: Any, index: int) -> HistoryEntry:
    """One stored entry (the list's element at ``index`` from the newest) as an entry; never
    raises (an entry that cannot be read is ``malformed``)."""
    entry_id = str(index)
    try:
        parts = _text(raw).split(SEPARATOR)
    except Exception:  # noqa: BLE001 - not text at all
        return HistoryEntry(id=entry_id, at=0.0, event="malformed", reason="not text")
    fields = dict(zip(FIELDS, parts))
    extra = {str(n): part for n, part in enumerate(parts[len(FIELDS) :], len(FIELDS))}
    try:
        ms = _int(fields.get("ms"))
    except ValueError:
        ms = None
    if ms is None:
        return HistoryEntry(
            id=entry_id, at=0.0, event="malformed", reason=f"no time: {_text(raw)[:60]!r}"
        )
    if ms > MAX_MS:
        return HistoryEntry(
            id=entry_id, at=0.0, event="malformed", reason=f"time out of range: {ms}"[:60]
        )
    at = ms / 1000.0
    event = fields.get("event")
    if event not in EVENTS or event == "expired":
        return HistoryEntry(
            id=entry_id, at=at, event="malformed", reason=f"unknown event {str(event)[:40]!r}"
        )
    try:
        fence, contended = _int(fields.get("fence")), _int(fields.get("contended"))
    except ValueError as exc:
        return HistoryEntry(
            id=entry_id, at=at, event="malformed", reason=f"not a number: {str(exc)[:40]!r}"
        )
    return HistoryEntry(
        id=entry_id,
        at=at,
        event=event,
        owner=fields.get("owner") or None,
        fence=fence,
        task_id=fields.get("task_id") or None,
        outcome=fields.get("outcome") or None,
        contended=contended,
        holder=fields.get("holder") or None,
        by=fields.get("by") or None,
        reason=fields.get("reason") or None,
        extra=extra,
    )


def field_text(value: Any) -> str:
    """One field's text in an entry: ``""`` for None, else ``str(value)`` with the
    separator (U+001F) replaced by a space, so no text forges the fields after it. Every
    writer of an entry passes its fields through it (:func:`encode`, and the lease scripts'
    arguments built in :mod:`celery_steplock.lock`)."""
    return "" if value is None else str(value).replace(SEPARATOR, " ")


def encode(event: str, **fields: Any) -> str:
    """An entry's string less its time (the scripts prepend Redis time): ``event`` and
    ``fields`` (names of :data:`FIELDS`) in order, each through :func:`field_text`,
    trailing empty fields left out."""
    values = [field_text(event)] + [field_text(fields.get(name)) for name in FIELDS[2:]]
    while values and values[-1] == "":
        values.pop()
    return SEPARATOR.join(values)


_ENDS = frozenset(("released", "forced", "reaped", "lost"))


def parse_entries(
    raw: Iterable[Any],
    *,
    now: float | None = None,
    max_age: float | None = None,
    offset: int = 0,
) -> list[HistoryEntry]:
    """A history's entries as read newest first (``LRANGE``), with the inferred ``expired``
    entries; newest first. Never raises for what the list holds.

    Args:
        raw: The ``LRANGE`` reply: the entries' strings, newest first.
        offset: The index of the first of them in the list (the entries' ``id``).
        now: Redis server time, seconds: an entry more than :data:`FUTURE_SKEW` seconds
            ahead of it is ``malformed``; with ``max_age``, entries older are left out.
        max_age: Seconds of history kept (``steplock_history_max_age``).

    Returns:
        The entries, newest first. Where a grant (``acquired``) is followed by another
        owner's grant with no ``released``, ``forced``, ``reaped`` or ``lost`` of the first
        between them, an ``expired`` entry (``inferred=True``, at the later grant's time) is
        put between them: the first lease's TTL ran out.
    """
    entries = [_entry(item, n) for n, item in enumerate(raw, offset)]
    if now is not None:
        entries = [
            HistoryEntry(id=e.id, at=0.0, event="malformed", reason=f"time ahead: {e.at:.0f}")
            if e.at > now + FUTURE_SKEW
            else e
            for e in entries
        ]
    if now is not None and max_age is not None:
        floor = now - max_age
        entries = [e for e in entries if e.event == "malformed" or e.at >= floor]
    out: list[HistoryEntry] = []
    # Oldest first to follow the grants: the last grant not yet ended.
    open_grant: HistoryEntry | None = None
    for entry in reversed(entries):
        if entry.event == "acquired":
            if open_grant is not None and open_grant.owner != entry.owner:
                out.append(
                    HistoryEntry(
                        id=entry.id,
                        at=entry.at,
                        event="expired",
                        owner=open_grant.owner,
                        fence=open_grant.fence,
                        task_id=open_grant.task_id,
                        reason="inferred: granted again with no release",
                        inferred=True,
                    )
                )
            open_grant = entry
        elif entry.event in _ENDS and open_grant is not None and entry.owner == open_grant.owner:
            open_grant = None
        out.append(entry)
    out.reverse()
    return out


def outcome_of(applied: bool, result: Any, exc: BaseException | None) -> str:
    """The outcome a ``released`` entry records for an execution.

    Args:
        applied: The step's transition was applied in the execution's transaction
            (``Execution.applied_to`` is set).
        result: What the execution returned (an outcome dict of
            :mod:`celery_steplock.outcomes`, ``{"steplock": "duplicate", ...}``, or anything),
            or the outcome's kind when the caller knows it (``"duplicate"``, ``"skipped"``:
            :func:`celery_steplock.outcomes.outcome_kind`, which also knows a duplicate that
            returned the winner's result).
        exc: The exception the execution is ending with, or None.

    Returns:
        One of :data:`OUTCOMES`: ``fenced`` for a :class:`~celery_steplock.exceptions.FenceAhead`
        or a ``TransitionConflict`` whose fenced condition refused (``stale_fence``),
        ``conflict`` for another ``TransitionConflict``, ``error`` for another exception,
        ``committed`` when the transition was applied, the outcome dict's ``duplicate`` or
        ``skipped``, else ``done``.
    """
    if exc is not None:
        if isinstance(exc, FenceAhead):
            return "fenced"
        if isinstance(exc, TransitionConflict):
            return "fenced" if exc.stale_fence else "conflict"
        return "committed" if applied else "error"
    if applied:
        return "committed"
    kind = result.get("steplock") if isinstance(result, dict) else result
    if isinstance(kind, str) and kind in ("duplicate", "skipped"):
        return kind
    return "done"
