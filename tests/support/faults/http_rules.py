"""The rules of the HTTP idempotency workload (``http_load.py``): pure functions over
what the server's bodies recorded and what the clients received.

Inputs:

- **executions**: one dict per body execution (:func:`executions_from_history` builds them
  from the ``http_body_start`` / ``http_body_end`` entries of ``faults:history`` that
  ``django_app/faults/http_views.py`` writes): ``view`` (``"guarded/sync"``...), ``key``,
  ``principal`` (``"user:alice"``, ``"anonymous"``), ``body`` (its id), ``pid`` (the
  server process that ran it), ``start`` and ``end`` (wall clock seconds; ``end`` None when
  no end was recorded), ``outcome`` (``"ok"``, ``"cancelled"`` or None), ``status`` and
  ``payload`` (what an ``"ok"`` body returned).
- **responses**: one dict per HTTP response a client received: ``view``, ``key``,
  ``principal`` (whose credential sent it), ``status`` (None: the client timed out),
  ``payload`` (the parsed JSON body or None), ``replayed`` (the ``Idempotent-Replayed``
  header was ``true``), ``retry_after`` (that header or None), ``t0`` / ``t1``.
- **store_lost_at**: wall clock instants at which the guard's store lost its data (a restart
  of a Redis without persistence, a failover to a lagging replica), or ``(start, end)``
  windows (a split brain, from the split to its heal).

Rules, each from docs/patterns/idempotency.md:

- ``cross_principal``: a response to principal P carries only a body executed for P, for
  the same key and view ("a replay only ever reaches the principal that recorded it"; the
  anonymous scope is one principal per host). A response with a body id no execution
  recorded is ``unknown_body``.
- ``second_body``: per (view, key, principal) at most one execution completes ``"ok"``
  ("the first request with a key runs the view and records its response"; a cancelled
  view releases its record, so a cancelled execution is followed by another lawfully).
  ``concurrent_bodies``: two executions of one (view, key, principal) never overlap in
  time, whatever their outcome ("lock before the side effect": a duplicate meets 409).
  Both are excused (listed in ``excused``, not ``violations``) when a store loss falls
  between the earlier execution's start and the later one's start: "a record lost with a
  Redis restart lets its key run once more" (Redis without persistence); or when the store
  did not answer (``store_down``) while the earlier one ran or was being recorded: its
  completion refused, "the lock TTL frees the key" and it runs again.
- ``replay_mismatch``: a replayed response equals the original: the status and payload its
  execution returned, and that execution completed ``"ok"``. A response not marked replayed
  equals its own execution's status and payload too.
- ``conflict_without_retry_after``: a 409 carries ``Retry-After``.
- ``conflict_without_runner``: a 409 ("same key while the first still runs") meets an
  execution of its (view, key, principal) that started by the time the 409 arrived and had
  not ended ``grace`` seconds before it was sent (the record completes, or is released,
  just after the body's end entry). Excused when a store loss falls within ``lock_ttl``
  before it: a body whose completion the outage refused leaves its key locked until the
  lock TTL ("an error while recording the end of a call ... the lock TTL frees the key");
  so is one within ``lock_ttl`` after an outage (``store_down``).

503s (fail closed, the store down) and client timeouts are counted only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

RULES = (
    "cross_principal",
    "unknown_body",
    "second_body",
    "concurrent_bodies",
    "replay_mismatch",
    "conflict_without_retry_after",
    "conflict_without_runner",
)
#: Seconds after a body's end entry during which its key may still answer 409 (its record
#: is being completed or released).
GRACE = 0.5

Entry = dict[str, Any]


@dataclass
class Verdict:
    """``violations`` and ``excused`` findings (dicts with ``rule`` and the facts), and
    ``counts``: ``requests``, ``timeouts``, ``bodies``, ``ok_bodies``, ``cancelled_bodies``,
    ``replays``, ``conflicts`` (409), ``unavailable`` (503), ``status_<code>``."""

    violations: list[Entry] = field(default_factory=list)
    excused: list[Entry] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_rule(self) -> dict[str, int]:
        found: dict[str, int] = defaultdict(int)
        for violation in self.violations:
            found[violation["rule"]] += 1
        return dict(found)


def executions_from_history(entries: Iterable[Entry]) -> dict[str, Entry]:
    """The executions (by body id) of the ``http_body_start`` / ``http_body_end`` entries;
    other entries are ignored. An end without a start keeps ``start`` None."""
    found: dict[str, Entry] = {}
    for entry in entries:
        event = entry.get("ev")
        if event not in ("http_body_start", "http_body_end"):
            continue
        one = found.setdefault(
            entry["body"],
            {
                "view": entry.get("view"),
                "key": entry.get("key"),
                "principal": entry.get("principal"),
                "body": entry["body"],
                "pid": entry.get("pid"),
                "start": None,
                "end": None,
                "outcome": None,
                "status": None,
                "payload": None,
            },
        )
        if event == "http_body_start":
            one["start"] = entry.get("t")
        else:
            one["end"] = entry.get("t")
            one["outcome"] = entry.get("outcome")
            one["status"] = entry.get("status")
            one["payload"] = entry.get("payload")
    return found


def _body_of(response: Entry) -> str | None:
    payload = response.get("payload")
    if isinstance(payload, dict) and isinstance(payload.get("body"), str):
        return payload["body"]
    return None


def _lost_between(store_lost_at: Iterable[Any], after: float | None, before: float | None):
    """The first loss (an instant, or a ``(start, end)`` window such as a split brain's) that
    falls between ``after`` and ``before``, or None."""
    if after is None or before is None:
        return None
    for loss in store_lost_at:
        first, last = loss if isinstance(loss, (tuple, list)) else (loss, loss)
        if first < before and last > after:
            return loss
    return None


def _killed(execution: Entry, killed_at: dict[int, float]) -> Entry:
    killed = killed_at.get(execution.get("pid"))  # type: ignore[arg-type]
    start = execution.get("start")
    if execution.get("end") is not None or killed is None or start is None or start > killed:
        return execution
    return {**execution, "end": killed, "outcome": "killed"}


def check(
    executions: dict[str, Entry] | Iterable[Entry],
    responses: Iterable[Entry],
    store_lost_at: Iterable[Any] = (),
    lock_ttl: float = 600.0,
    grace: float = GRACE,
    killed_at: dict[int, float] | None = None,
    store_down: Iterable[Any] = (),
) -> Verdict:
    """Apply the module's rules.

    Args:
        executions: By body id (as :func:`executions_from_history` returns) or a list.
        responses: The clients' responses (shape in the module docstring).
        store_lost_at: Instants (wall clock seconds) the store lost its data, or
            ``(start, end)`` windows.
        lock_ttl: The views' lock TTL in seconds (``steplock_idempotency_lock_ttl``, 600 by
            default; the fault app sets 8): how long after a loss a 409 is excused.
        grace: Seconds a 409 may follow its execution's end entry (default :data:`GRACE`).
        store_down: ``(start, end)`` windows the store did not answer (paused, cut off) but
            kept its data: a body running or being recorded in one may have had its
            renewals or its completion refused, so its key runs again after the lock TTL
            and answers 409 until then (documented under "Outage behaviour").
        killed_at: Server process id -> when it was SIGKILLed: an execution of that process
            with no end entry that started before then ended then (outcome ``"killed"``; its
            record expires after the lock TTL and the key runs again, as documented).

    Returns:
        A :class:`Verdict`.
    """
    if not isinstance(executions, dict):
        executions = {one["body"]: one for one in executions}
    if killed_at:
        executions = {body: _killed(one, killed_at) for body, one in executions.items()}
    responses = list(responses)
    losses = list(store_lost_at)
    downs = [tuple(window) for window in store_down]

    def excuse(earlier: Entry, later: Entry) -> Any:
        """The loss between the two starts, or the outage while the earlier ran or was
        being recorded (its renewals or its completion refused), or None."""
        lost = _lost_between(losses, earlier["start"], later["start"])
        if lost is None and earlier["start"] is not None:
            until = earlier["end"] + grace if earlier["end"] is not None else later["start"]
            lost = _lost_between(downs, earlier["start"], until)
        return lost

    verdict = Verdict()
    counts: dict[str, int] = defaultdict(int)

    for response in responses:
        counts["requests"] += 1
        status = response.get("status")
        if status is None:
            counts["timeouts"] += 1
            continue
        counts[f"status_{status}"] += 1
        if status == 409:
            counts["conflicts"] += 1
            if response.get("retry_after") in (None, ""):
                verdict.violations.append(
                    {"rule": "conflict_without_retry_after", "response": response}
                )
        if status == 503:
            counts["unavailable"] += 1
        if response.get("replayed"):
            counts["replays"] += 1
        body = _body_of(response)
        if status >= 400 or body is None:
            continue
        execution = executions.get(body)
        if execution is None:
            verdict.violations.append({"rule": "unknown_body", "body": body, "response": response})
            continue
        for what in ("principal", "key", "view"):
            if execution.get(what) != response.get(what):
                verdict.violations.append(
                    {
                        "rule": "cross_principal",
                        "differs": what,
                        "body": body,
                        "produced_for": execution.get(what),
                        "served_to": response.get(what),
                        "response": response,
                    }
                )
                break
        if execution.get("outcome") != "ok" or (status, response.get("payload")) != (
            execution.get("status"),
            execution.get("payload"),
        ):
            verdict.violations.append(
                {
                    "rule": "replay_mismatch",
                    "body": body,
                    "replayed": bool(response.get("replayed")),
                    "original": (
                        execution.get("outcome"),
                        execution.get("status"),
                        execution.get("payload"),
                    ),
                    "served": (status, response.get("payload")),
                    "response": response,
                }
            )

    groups: dict[tuple, list[Entry]] = defaultdict(list)
    for execution in executions.values():
        groups[(execution["view"], execution["key"], execution["principal"])].append(execution)
    for response in responses:
        if response.get("status") != 409:
            continue
        t0, t1 = response.get("t0"), response.get("t1")
        found = groups.get((response.get("view"), response.get("key"), response.get("principal")))
        if (
            t0 is None
            or t1 is None
            or any(
                one["start"] is not None
                and one["start"] <= t1
                and (one["end"] is None or one["end"] + grace >= t0)
                for one in found or ()
            )
        ):
            continue
        finding = {"rule": "conflict_without_runner", "response": response}
        lost = _lost_between([*losses, *downs], t0 - lock_ttl - grace, t1)
        if lost is None:
            verdict.violations.append(finding)
        else:
            verdict.excused.append({**finding, "store_lost_at": lost})

    for execution in executions.values():
        counts["bodies"] += 1
        if execution.get("outcome") == "ok":
            counts["ok_bodies"] += 1
        elif execution.get("outcome") == "cancelled":
            counts["cancelled_bodies"] += 1

    for (view, key, principal), found in groups.items():
        found.sort(key=lambda one: (one["start"] is None, one["start"] or 0.0))
        facts = {"view": view, "key": key, "principal": principal}
        previous_ok: Entry | None = None
        for index, later in enumerate(found):
            for earlier in found[:index]:
                running_until = earlier["end"] if earlier["end"] is not None else float("inf")
                if later["start"] is not None and later["start"] < running_until:
                    finding = {
                        "rule": "concurrent_bodies",
                        "bodies": [earlier["body"], later["body"]],
                        **facts,
                    }
                    lost = excuse(earlier, later)
                    if lost is None:
                        verdict.violations.append(finding)
                    else:
                        verdict.excused.append({**finding, "store_lost_at": lost})
            if later.get("outcome") != "ok":
                continue
            if previous_ok is not None:
                finding = {
                    "rule": "second_body",
                    "bodies": [previous_ok["body"], later["body"]],
                    **facts,
                }
                lost = excuse(previous_ok, later)
                if lost is None:
                    verdict.violations.append(finding)
                else:
                    verdict.excused.append({**finding, "store_lost_at": lost})
            previous_ok = later

    verdict.counts = dict(counts)
    return verdict
