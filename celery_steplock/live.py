"""The live state of the rate limits, the concurrency limits and the idempotency records, read
from Redis for operators' pages (the Django admin's "Rate limits" and "Concurrency limits"
pages, the summary of its idempotency records page). Pure reads, no Django, no write.

Every listing is bounded whatever Redis holds: names come first from the tasks' options,
then from ``SCAN`` (never ``KEYS``; ``COUNT`` :data:`SCAN_COUNT`, at most
:data:`MAX_SCAN_STEPS` round trips per walk), at most :data:`MAX_LIMITS` limit keys,
:data:`MAX_SLOTS` slot hashes or :data:`MAX_RECORDS` records; what was found is then read in
one pipeline (plus one ``TIME``). A listing that a bound stopped says so (``complete``
False). What a key holds never raises: an entry of the wrong type, a name that is not UTF-8,
a field that is no number, comes back as a row whose ``malformed`` says what is wrong (as
:func:`celery_steplock.lease.parse_lease` says it of a lease). Only Redis itself can make a
listing fail: :class:`~celery_steplock.exceptions.LockStoreUnavailable` (not reached) or
:class:`~celery_steplock.exceptions.LockStoreMisconfigured` (refused).

The commands sent are ``SCAN``, ``TIME``, ``TYPE``, ``HMGET``, ``ZCARD``, ``ZCOUNT``,
``ZRANGE`` and the lease store's ``SCAN_FIELDS`` script: all within the least-privilege ACL
of docs/acl.md.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from ._redis.cluster import is_cluster
from ._redis.cluster import scan_keys as cluster_scan_keys
from .exceptions import StepLockError
from .keys import (
    concurrency_keys,
    glob_escape,
    lease_key,
    parse_slot_name,
    rate_limit_keys,
    slot_key,
    template_fields,
)
from .lease import MALFORMED_EXCERPT
from .lock import get_lease_store
from .patterns._base import translated
from .redact import printable

__all__ = [
    "MAX_LIMITS",
    "MAX_SLOTS",
    "MAX_RECORDS",
    "MAX_SCAN_STEPS",
    "SCAN_COUNT",
    "Listing",
    "rate_limit_rows",
    "concurrency_rows",
    "idempotency_summary",
]

#: Limit keys a listing returns at most (the tasks' limits first, then SCAN's finds), as
#: :data:`celery_steplock.ops.MAX_BREAKERS` for the breakers.
MAX_LIMITS = 500
#: Concurrency slot hashes one listing reads at most.
MAX_SLOTS = 5000
#: Idempotency records one summary reads at most.
MAX_RECORDS = 5000
#: SCAN round trips of one walk at most (each ``COUNT`` :data:`SCAN_COUNT`): a keyspace of
#: other keys costs round trips, never an unbounded page.
MAX_SCAN_STEPS = 100
#: SCAN's ``COUNT`` hint.
SCAN_COUNT = 1000
#: Slots of one limit read at most (the largest ``ConcurrencyLimit``).
MAX_LIMIT_SLOTS = 1000

_UNREADABLE_NAME = "key: not UTF-8 (cannot be read back)"
_TYPE_NAMES = {"zset": "sorted set"}


@dataclass
class Listing:
    """What a page shows: ``rows`` (dicts, sorted), ``complete`` (False: a bound stopped the
    walk before it saw every key: :data:`MAX_LIMITS`, :data:`MAX_SLOTS`,
    :data:`MAX_RECORDS` or :data:`MAX_SCAN_STEPS`), ``scan_steps`` (SCAN round trips made),
    ``now_ms`` (Redis ``TIME``, ms), ``extra`` (per listing: see each function)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    complete: bool = True
    scan_steps: int = 0
    now_ms: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _Scan:
    """One bounded SCAN walk over ``match``: yields key names (str; a name that is not UTF-8
    with U+FFFD), at most ``max_steps`` round trips; ``complete`` once the cursor came back
    to 0. On a ``RedisCluster`` the walk visits each primary in turn."""

    def __init__(self, client: Any, match: str, max_steps: int = MAX_SCAN_STEPS):
        self.client = client
        self.match = match
        self.max_steps = max_steps
        self.steps = 0
        self.complete = False

    def __iter__(self) -> Iterator[str]:
        cursor = 0
        while self.steps < self.max_steps:
            if is_cluster(self.client):
                cursor, keys = cluster_scan_keys(self.client, cursor, SCAN_COUNT, self.match)
            else:
                cursor, keys = self.client.scan(cursor=cursor, match=self.match, count=SCAN_COUNT)
                cursor = int(cursor)
            self.steps += 1
            for key in keys:
                yield _text(key)
            if cursor == 0:
                self.complete = True
                return


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _excerpt(value: Any) -> str:
    text = _text(value)
    if len(text) > MALFORMED_EXCERPT:
        text = text[:MALFORMED_EXCERPT] + "..."
    return repr(text)


def _number(value: Any, what: str, problems: list[str]) -> float | None:
    """A stored number (a Lua ``%.17g`` or an integer) as a finite float; None (and a
    problem noted) when it is none."""
    if value is None:
        return None
    try:
        number = float(_text(value))
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        problems.append(f"{what}: not a number ({_excerpt(value)})")
        return None
    return number


def _redis_now_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _pipelined(client: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` in one pipeline (no transaction); a command Redis refused (WRONGTYPE)
    gives its exception in place of its reply."""
    if not commands:
        return []
    pipe = client.pipeline(transaction=False)
    for command in commands:
        pipe.execute_command(*command)
    return list(pipe.execute(raise_on_error=False))


def _types(client: Any, keys: list[str]) -> dict[str, str]:
    """The Redis types of ``keys`` (one pipeline), for the rows whose read Redis refused."""
    replies = _pipelined(client, [("TYPE", key) for key in keys])
    return {
        key: _text(reply) if not isinstance(reply, BaseException) else "unknown"
        for key, reply in zip(keys, replies)
    }


def _task_option(task: Any, name: str) -> Any:
    value = getattr(task, name, None)
    if inspect.ismethod(value) and value.__self__ is task:
        value = value.__func__  # a function given as a class attribute or a keyword
    return value


def _plain_name(template: Any, default: str) -> str | None:
    """The one name a key template gives whatever the arguments (None: per arguments)."""
    if template is None:
        return default
    if isinstance(template, str):
        try:
            return None if template_fields(template) else template
        except StepLockError:
            return None
    return None


def _wait_ms(now_ms: int, reply: Any) -> float | None:
    """``now_ms`` less the score of a ``ZRANGE ... 0 0 WITHSCORES`` reply (None: empty)."""
    if not isinstance(reply, list) or not reply:
        return None
    first = reply[0]
    try:
        score = float(first[1] if isinstance(first, (list, tuple)) else reply[1])
    except (IndexError, TypeError, ValueError):
        return None
    return max(0.0, now_ms - score)


# -- rate limits ----------------------------------------------------------------------------


def _parse_rate_key(prefix: str, key: str) -> tuple[str, str, str, str] | None:
    """``(kind, ident, name, role)`` of a key of :func:`celery_steplock.keys.rate_limit_keys`
    (``role``: ``state``, ``queue`` or ``due``), or None when ``key`` is none of them."""
    head = f"{prefix}:rate:"
    if not key.startswith(head) or not key.endswith("}"):
        return None
    rest = key[len(head) : -1]
    brace = rest.find("{")
    if brace < 2 or rest[brace - 1] != ":" or "}" in rest[brace + 1 :]:
        return None
    middle, name = rest[: brace - 1], rest[brace + 1 :]
    kind, sep, ident = middle.partition(":")
    role = "state"
    for suffix in (":queue", ":due"):
        if ident.endswith(suffix):
            ident, role = ident[: -len(suffix)], suffix[1:]
            break
    if kind not in ("tb", "sw") or not sep or not ident or not name:
        return None
    return kind, ident, name, role


def _rate_params(kind: str, ident: str) -> tuple[float, float] | None:
    """A limit's figures from its keys' ``ident``: a bucket's ``(rate per s, capacity)``, a
    window's ``(limit, window s)``; None when they are not what a limiter writes."""
    first, sep, second = ident.rpartition(":")
    if not sep:
        return None
    try:
        a, b = float(first), float(second)
    except ValueError:
        return None
    if not (math.isfinite(a) and math.isfinite(b) and a > 0 and b > 0):
        return None
    if kind == "tb" and b != int(b):
        return None
    if kind == "sw" and a != int(a):
        return None
    return a, b


def _describe_limit(kind: str, figures: tuple[float, float]) -> str:
    if kind == "tb":
        return f"{figures[0]:g}/s bucket of {int(figures[1])}"
    return f"{int(figures[0])}/{figures[1]:g}s window"


def task_rate_limits(tasks: Iterable[Any]) -> tuple[dict, dict]:
    """The rate limits the tasks' ``cluster_rate_limit`` options name.

    Args:
        tasks: Task objects.

    Returns:
        ``(named, templated)``: ``named`` maps ``(kind, ident, name)`` of a limit whose key
        is one name (the task's name, or a template without fields) to the tasks' names;
        ``templated`` maps ``(kind, ident)`` of a limit keyed per arguments to
        ``"task (template)"`` texts, which the keys SCAN finds are attributed to. An option
        the gate would refuse is left out (``manage.py check`` reports it).
    """
    from .patterns.ratelimit import _limiters

    named: dict[tuple[str, str, str], list[str]] = {}
    templated: dict[tuple[str, str], list[str]] = {}
    for task in tasks:
        value = getattr(task, "cluster_rate_limit", None)
        if value is None:
            continue
        key = _task_option(task, "cluster_rate_limit_key")
        try:
            limiters = _limiters(value, "cluster_rate_limit")
        except StepLockError:
            continue
        for limiter in limiters:
            template = limiter.key if limiter.key is not None else key
            ident = limiter._ident()
            name = _plain_name(template, task.name)
            if name is not None:
                named.setdefault((limiter.kind, ident, name), []).append(task.name)
            else:
                shown = template if isinstance(template, str) else "a callable"
                templated.setdefault((limiter.kind, ident), []).append(f"{task.name} ({shown})")
    return named, templated


def rate_limit_rows(
    app: Any,
    *,
    tasks: Iterable[Any] = (),
    limit: int = MAX_LIMITS,
    max_steps: int = MAX_SCAN_STEPS,
    client: Any = None,
    prefix: str | None = None,
) -> Listing:
    """Every rate limit there is (the tasks' first, then SCAN's finds of
    ``<prefix>:rate:*``), at most ``limit``, with its use now.

    Args:
        app: The Celery app (its lease store's client and prefix).
        tasks: Task objects whose ``cluster_rate_limit`` options name limits.
        limit: Limits at most (rows of unreadable keys count too).
        max_steps: SCAN round trips at most.
        client: A redis-py client instead of the app's lease store's (with ``prefix``).
        prefix: The key prefix with ``client``.

    Returns:
        A :class:`Listing`. Each row: ``key`` (the state key), ``name`` (the limit key),
        ``kind`` (``"bucket"``/``"window"``), ``limit`` (its description), ``tasks`` (the
        tasks whose option names it), ``configured`` (named by a task), ``used`` and
        ``capacity`` (a bucket: tokens taken and its capacity; a window: grants in the
        last window and its limit), ``left`` (tokens or grants left now), ``tickets``
        (queued tickets whose holder may still come back), ``queued`` (tickets in the
        queue, expired ones not yet dropped included), ``oldest_wait`` (seconds the oldest
        queued ticket has been waiting, None: none), ``malformed`` (``""``: nothing).
        A row of a key that names no limit has ``key``, ``name`` and ``malformed`` only.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or a command.
    """
    if client is None:
        store = get_lease_store(app)
        client, prefix = store.client, store.prefix
    prefix = prefix if prefix is not None else "steplock"
    named, templated = task_rate_limits(tasks)
    found: dict[tuple[str, str, str], set[str]] = {k: set() for k in named}
    unnamed: dict[str, str] = {}
    listing = Listing()
    match = f"{glob_escape(prefix)}:rate:*"
    with translated("rate limit listing", key=match):
        walk = _Scan(client, match, max_steps)
        stopped = False
        for key in walk:
            parsed = _parse_rate_key(prefix, key)
            if parsed is None or "\ufffd" in key:
                if key in unnamed:
                    continue
                if len(found) + len(unnamed) >= limit:
                    stopped = True
                    break
                unnamed[key] = _UNREADABLE_NAME if "\ufffd" in key else "key: names no rate limit"
                continue
            kind, ident, name, role = parsed
            entry = found.get((kind, ident, name))
            if entry is None:
                if len(found) + len(unnamed) >= limit:
                    stopped = True
                    break
                entry = found[kind, ident, name] = set()
            entry.add(role)
        listing.scan_steps = walk.steps
        listing.complete = walk.complete and not stopped
        # the tasks' limits first when the bound cuts, then by name
        chosen = sorted(found, key=lambda k: (k not in named, k[2], k[0], k[1]))
        chosen = chosen[: max(0, limit - len(unnamed))]
        now = listing.now_ms = _redis_now_ms(client)
        commands: list[tuple[Any, ...]] = []
        plans: list[tuple[tuple[str, str, str], tuple[float, float] | None, tuple]] = []
        for kind, ident, name in chosen:
            keys = rate_limit_keys(prefix, kind, ident, name)
            figures = _rate_params(kind, ident)
            plans.append(((kind, ident, name), figures, keys))
            if figures is None:
                continue
            if kind == "tb":
                commands.append(("HMGET", keys[0], "tokens", "ts"))
            else:
                commands.append(("ZCOUNT", keys[0], f"({now - figures[1] * 1000.0!r}", "+inf"))
            commands += [
                ("ZCARD", keys[1]),
                ("ZRANGE", keys[1], 0, 0, "WITHSCORES"),
                ("ZCOUNT", keys[2], f"({now}", "+inf"),
            ]
        replies = iter(_pipelined(client, commands))
        # (row, what the key is, the key, the type it should be) of each read Redis refused
        refused: list[tuple[dict[str, Any], str, str, str]] = []
        rows: list[dict[str, Any]] = []
        for (kind, ident, name), figures, keys in plans:
            base: dict[str, Any] = {
                "key": printable(keys[0]),
                "name": printable(name),
                "kind": "bucket" if kind == "tb" else "window",
                "tasks": named.get((kind, ident, name)) or templated.get((kind, ident)) or [],
                "configured": (kind, ident, name) in named,
            }
            if figures is None:
                rows.append(base | {"malformed": f"key: {ident!r} is no {base['kind']}'s figures"})
                continue
            state, queued, oldest, live = (next(replies) for _ in range(4))
            row = base | _rate_row(kind, figures, now, state, queued, oldest, live)
            rows.append(row)
            expected = (
                ("key", keys[0], "hash" if kind == "tb" else "zset"),
                ("ticket queue", keys[1], "zset"),
                ("tickets' deadlines", keys[2], "zset"),
            )
            refused += [
                (row, what, key, kind_of)
                for (what, key, kind_of), reply in zip(expected, (state, queued, live))
                if isinstance(reply, BaseException)
            ]
        types = _types(client, [key for _, _, key, _ in refused]) if refused else {}
        for row, what, key, kind_of in refused:
            found_type = types.get(key, "unknown")
            problem = f"{what}: a {found_type}, not a {_TYPE_NAMES.get(kind_of, kind_of)}"
            row["malformed"] = "; ".join(sorted(filter(None, [row["malformed"], problem])))
    rows.extend(
        {"key": printable(key), "name": printable(key), "malformed": why}
        for key, why in unnamed.items()
    )
    rows.sort(key=lambda row: (row["name"], row["key"]))
    listing.rows = rows
    return listing


def _rate_row(
    kind: str,
    figures: tuple[float, float],
    now: int,
    state: Any,
    queued: Any,
    oldest: Any,
    live: Any,
) -> dict[str, Any]:
    """The figures of one limit from its replies, whatever they hold (never raises)."""
    problems: list[str] = []
    row: dict[str, Any] = {"limit": _describe_limit(kind, figures)}
    try:
        if kind == "tb":
            rate, capacity = figures
            left = capacity
            if not isinstance(state, BaseException):
                tokens = _number(state[0], "tokens", problems)
                ts = _number(state[1], "ts", problems)
                # As the script reads them: no number is no bucket (full); below zero is
                # none left; above the capacity is the capacity.
                if tokens is not None and ts is not None:
                    if tokens < 0:
                        problems.append(f"tokens: below zero ({_excerpt(state[0])})")
                        tokens = 0.0
                    left = min(capacity, tokens + max(0.0, now - ts) * rate / 1000.0)
            row |= {"capacity": int(capacity), "left": round(left, 3)}
            row["used"] = round(capacity - left, 3)
        else:
            cap = int(figures[0])
            used = 0 if isinstance(state, BaseException) else int(state)
            row |= {"capacity": cap, "used": used, "left": max(0, cap - used)}
        row["queued"] = 0 if isinstance(queued, BaseException) else int(queued)
        row["tickets"] = 0 if isinstance(live, BaseException) else int(live)
        wait = None if isinstance(oldest, BaseException) else _wait_ms(now, oldest)
        row["oldest_wait"] = None if wait is None else round(wait / 1000.0, 1)
    except (TypeError, ValueError, IndexError) as exc:  # a reply of an unexpected shape
        problems.append(f"unreadable: {type(exc).__name__}")
    row["malformed"] = "; ".join(sorted(problems))
    return row


# -- concurrency limits ---------------------------------------------------------------------


def task_concurrency_limits(tasks: Iterable[Any]) -> tuple[dict, dict]:
    """The concurrency limits the tasks' ``concurrency_limit`` options name.

    Args:
        tasks: Task objects.

    Returns:
        ``(named, templated)``: ``named`` maps a limit key that is one name to
        ``(limit, [task names])``; ``templated`` maps a task's name to its key template (a
        limit keyed per arguments; the limit is then read from the slots' metadata).
    """
    from .patterns.concurrency import ConcurrencyLimit

    named: dict[str, tuple[int, list[str]]] = {}
    templated: dict[str, tuple[int, str]] = {}
    for task in tasks:
        value = _task_option(task, "concurrency_limit")
        if value is None:
            continue
        try:
            limit = value if isinstance(value, ConcurrencyLimit) else ConcurrencyLimit(value)
        except StepLockError:
            continue
        key = _task_option(task, "concurrency_limit_key")
        template = key if key is not None else limit.key
        name = _plain_name(template, task.name)
        if name is not None:
            _count, names = named.setdefault(name, (limit.limit, []))
            names.append(task.name)
        else:
            templated[task.name] = (
                limit.limit,
                template if isinstance(template, str) else "a callable",
            )
    return named, templated


def concurrency_rows(
    app: Any,
    *,
    tasks: Iterable[Any] = (),
    limit: int = MAX_LIMITS,
    max_slots: int = MAX_SLOTS,
    max_steps: int = MAX_SCAN_STEPS,
) -> Listing:
    """Every concurrency limit there is (the tasks' first, then those whose slots SCAN finds
    held, ``<prefix>:lease:{*}#*}``, then those with waiters, ``<prefix>:bulkhead:{*}:queue``),
    at most ``limit``, with the slots held, by whom, and the waiters.

    Args:
        app: The Celery app (its lease store's client and prefix).
        tasks: Task objects whose ``concurrency_limit`` options name limits.
        limit: Limit keys at most.
        max_slots: Slot hashes read at most.
        max_steps: SCAN round trips per walk at most.

    Returns:
        A :class:`Listing`; ``extra["templated"]`` the tasks limited per arguments
        (``{task: (limit, template)}``). Each row: ``name`` (the limit key), ``limit`` (its
        slots: the task's option, else the slots' metadata; None: unknown), ``tasks``,
        ``held`` (slots held), ``slots`` (dicts of
        :meth:`~celery_steplock.lock.RedisLeaseStore.inspect` plus ``index``, ``age``
        seconds held, ``malformed``), ``queued`` (waiters in the queue), ``waiting``
        (those whose entry is still alive), ``oldest_wait`` (seconds the first queued
        waiter has waited; None: none), ``malformed``.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or a command.
    """
    store = get_lease_store(app)
    client, prefix = store.client, store.prefix
    named, templated = task_concurrency_limits(tasks)
    limits: dict[str, dict[str, Any]] = {
        key: {"name": key, "limit": count, "tasks": names, "slot_keys": {}}
        for key, (count, names) in sorted(named.items())[:limit]
    }
    listing = Listing(extra={"templated": templated})
    slot_match = lease_key(glob_escape(prefix), "*}#*")
    queue_match = concurrency_keys(glob_escape(prefix), "*")[1]
    head = f"{prefix}:lease:{{"
    slot_total = 0
    complete = True
    with translated("concurrency limit listing", key=slot_match):
        walk = _Scan(client, slot_match, max_steps)
        for key in walk:
            name = key[len(head) : -1] if key.startswith(head) and key.endswith("}") else key
            parsed = parse_slot_name(name)
            limit_key, index = parsed if parsed is not None else (name.rpartition("}#")[0], -1)
            entry = limits.get(limit_key)
            if entry is None:
                if len(limits) >= limit:
                    complete = False
                    break
                entry = limits[limit_key] = {
                    "name": limit_key,
                    "limit": None,
                    "tasks": [],
                    "slot_keys": {},
                }
            if slot_total >= max_slots:
                complete = False
                break
            if key not in entry["slot_keys"]:
                entry["slot_keys"][key] = index
                slot_total += 1
        listing.scan_steps += walk.steps
        complete = complete and walk.complete
        # no room left for a limit with waiters only: its walk would find nothing to show
        walk = _Scan(client, queue_match, max_steps if len(limits) < limit else 0)
        queue_head, queue_tail = f"{prefix}:bulkhead:{{", "}:queue"
        for key in walk:
            if not (key.startswith(queue_head) and key.endswith(queue_tail)):
                continue
            limit_key = key[len(queue_head) : -len(queue_tail)]
            if limit_key not in limits:
                if len(limits) >= limit:
                    complete = False
                    break
                limits[limit_key] = {
                    "name": limit_key,
                    "limit": None,
                    "tasks": [],
                    "slot_keys": {},
                }
        listing.scan_steps += walk.steps
        listing.complete = complete and walk.complete
        slot_keys = [
            key for entry in limits.values() for key in entry["slot_keys"] if "\ufffd" not in key
        ]
        leases = store.read_leases(slot_keys) if slot_keys else {}
        gone = [key for key in slot_keys if leases.get(key) is None]
        types = _types(client, gone) if gone else {}
        # Every slot of a limit whose size is known (the task's option, or a slot's
        # metadata), not only those the walk met: a bounded walk stops between two slots
        # of one limit, and a slot taken during the walk may be missed.
        missing: list[str] = []
        for name, entry in limits.items():
            size = entry["limit"] or _declared_limit(entry["slot_keys"], leases)
            if size is None or "\ufffd" in name:
                continue
            for index in range(min(size, MAX_LIMIT_SLOTS)):
                key = slot_key(prefix, name, index)
                if key in entry["slot_keys"]:
                    continue
                if slot_total >= max_slots:
                    listing.complete = False
                    break
                entry["slot_keys"][key] = index
                missing.append(key)
                slot_total += 1
        if missing:
            leases.update(store.read_leases(missing))
        now = listing.now_ms = _redis_now_ms(client)
        commands: list[tuple[Any, ...]] = []
        readable = [name for name in limits if "\ufffd" not in name]
        for name in readable:
            _, queue, alive = concurrency_keys(prefix, name)
            commands += [
                ("ZCARD", queue),
                ("ZRANGE", queue, 0, 0, "WITHSCORES"),
                ("ZCOUNT", alive, f"({now}", "+inf"),
            ]
        replies = _pipelined(client, commands)
    waiters = {name: replies[3 * i : 3 * i + 3] for i, name in enumerate(readable)}
    rows = []
    for name, entry in limits.items():
        rows.append(_concurrency_row(entry, leases, types, waiters.get(name), now, prefix))
    rows.sort(key=lambda row: row["name"])
    listing.rows = rows
    return listing


def _declared_limit(slot_keys: dict[str, int], leases: dict[str, Any]) -> int | None:
    """The largest limit the slots' metadata declares (``limit``), None when none does."""
    sizes = [
        int(text)
        for text in (str((leases.get(key) or {}).get("limit") or "") for key in slot_keys)
        if text.isascii() and text.isdigit() and len(text) < 7
    ]
    return max(sizes) if sizes else None


def _concurrency_row(
    entry: dict[str, Any],
    leases: dict[str, Any],
    types: dict[str, str],
    waiters: list[Any] | None,
    now: int,
    prefix: str,
) -> dict[str, Any]:
    """One limit's row from what was read, whatever it holds (never raises)."""
    problems: list[str] = []
    slots: list[dict[str, Any]] = []
    if "\ufffd" in entry["name"]:
        problems.append(_UNREADABLE_NAME)
    declared: set[str] = set()
    for key, index in sorted(entry["slot_keys"].items(), key=lambda item: item[1]):
        if "\ufffd" in key:
            slots.append({"index": index, "key": printable(key), "malformed": _UNREADABLE_NAME})
            continue
        info = leases.get(key)
        if info is None:
            kind = types.get(key, "none")
            if kind != "none":
                slots.append(
                    {
                        "index": index,
                        "key": printable(key),
                        "malformed": f"key: a {kind}, not a hash",
                    }
                )
            continue  # released between the listing and the read
        slot = dict(info)
        slot["index"] = index
        slot["key"] = printable(key)
        if index < 0:
            slot["malformed"] = "; ".join(
                filter(None, [slot.get("malformed"), "name: no slot index"])
            )
        try:
            slot["age"] = max(0.0, now - int(info.get("acquired_ms") or "")) / 1000.0
        except ValueError:
            slot["age"] = None
        if info.get("limit"):
            declared.add(str(info["limit"]))
        slots.append(slot)
    count = entry["limit"]
    if count is None and declared:
        numbers = sorted(int(d) for d in declared if d.isascii() and d.isdigit() and len(d) < 7)
        count = numbers[-1] if numbers else None
        if len(numbers) != len(declared):
            problems.append(
                f"limit: not an integer in a slot's metadata ({sorted(declared)[0]!r})"
            )
    row: dict[str, Any] = {
        "name": printable(entry["name"]),
        "key": printable(concurrency_keys(prefix, entry["name"])[1]),
        "limit": count,
        "tasks": entry["tasks"],
        "slots": slots,
        "held": sum(1 for slot in slots if slot.get("owner")),
        "queued": 0,
        "waiting": 0,
        "oldest_wait": None,
    }
    if waiters is not None:
        queued, oldest, alive = waiters
        if isinstance(queued, BaseException) or isinstance(alive, BaseException):
            problems.append("waiters' keys: not sorted sets")
        else:
            row["queued"], row["waiting"] = int(queued), int(alive)
            wait = None if isinstance(oldest, BaseException) else _wait_ms(now, oldest)
            row["oldest_wait"] = None if wait is None else round(wait / 1000.0, 1)
    row["malformed"] = "; ".join(sorted(problems))
    return row


# -- idempotency records --------------------------------------------------------------------

_STATUSES = ("locked", "completed", "failed")


def idempotency_summary(
    client: Any,
    prefix: str,
    *,
    max_records: int = MAX_RECORDS,
    max_steps: int = MAX_SCAN_STEPS,
    examples: int = 5,
) -> Listing:
    """The idempotency records Redis holds (the Redis store's, and the database store's
    cached copies: ``<prefix>:idem:{*}``), counted by status, and the oldest in progress.

    Args:
        client: A redis-py client.
        prefix: The key prefix.
        max_records: Records read at most.
        max_steps: SCAN round trips at most.
        examples: Malformed records listed at most.

    Returns:
        A :class:`Listing` whose ``extra`` holds ``counts`` (``{status: n}``, with
        ``malformed``), ``records`` (read), ``oldest_locked`` (None, or a dict: ``key``,
        ``namespace``, ``age`` seconds since it was locked, ``attempts``) and ``malformed``
        (up to ``examples`` rows: ``key``, ``malformed``); ``rows`` is empty.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or a command.
    """
    match = f"{glob_escape(prefix)}:idem:{{*}}"
    counts = dict.fromkeys(_STATUSES, 0) | {"malformed": 0}
    bad: list[dict[str, str]] = []
    oldest: dict[str, Any] | None = None
    listing = Listing()
    with translated("idempotency records listing", key=match):
        walk = _Scan(client, match, max_steps)
        keys: list[str] = []
        seen: set[str] = set()
        for key in walk:
            if key in seen:
                continue
            if len(keys) >= max_records:
                break
            seen.add(key)
            keys.append(key)
        listing.scan_steps = walk.steps
        listing.complete = walk.complete and len(keys) < max_records
        now = listing.now_ms = _redis_now_ms(client)
        readable = [key for key in keys if "\ufffd" not in key]
        replies = _pipelined(
            client,
            [("HMGET", key, "status", "locked_ms", "ns", "attempts") for key in readable],
        )
        refused = [key for key, r in zip(readable, replies) if isinstance(r, BaseException)]
        types = _types(client, refused) if refused else {}

    def malformed(key: str, why: str) -> None:
        counts["malformed"] += 1
        if len(bad) < examples:
            bad.append({"key": printable(key), "malformed": why})

    for key in keys:
        if "\ufffd" in key:
            malformed(key, _UNREADABLE_NAME)
    for key, reply in zip(readable, replies):
        if isinstance(reply, BaseException):
            malformed(key, f"key: a {types.get(key, 'unknown')}, not a hash")
            continue
        status, locked_ms, namespace, attempts = (None if v is None else _text(v) for v in reply)
        if status is None and locked_ms is None and namespace is None:
            continue  # gone between the listing and the read
        if status not in _STATUSES:
            malformed(key, f"status: not locked, completed or failed ({_excerpt(status or '')})")
            continue
        if status != "locked":
            counts[status] += 1
            continue
        digits = (locked_ms or "").strip()
        if not (digits.isascii() and digits.isdigit() and len(digits) < 20):
            malformed(key, f"locked_ms: not an integer ({_excerpt(locked_ms or '')})")
            continue
        counts[status] += 1
        if oldest is None or int(digits) < oldest["locked_ms"]:
            oldest = {
                "key": printable(key),
                "namespace": printable(namespace or ""),
                "locked_ms": int(digits),
                "attempts": printable(attempts or ""),
            }
    if oldest is not None:
        oldest["age"] = max(0.0, now - oldest["locked_ms"]) / 1000.0
    listing.extra = {
        "counts": counts,
        "records": len(keys),
        "oldest_locked": oldest,
        "malformed": bad,
    }
    return listing
