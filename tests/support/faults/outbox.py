"""The effects outbox's fault trials: workloads of ``django_app/faults/effects.py`` on a
:class:`~tests.support.faults.lab.Lab`, an idempotent HTTP receiver on loopback
(:class:`~tests.support.faults.receiver.Receiver`), a step-locked receiver task
(``effect_sink``), a periodic relay in the controller (as the ``celery_steplock.relay_effects``
beat task or the reaper would run it) and the outbox checker (``checker.check_effects``).

Each trial creates a step and its sink step, publishes ``effect_forward`` (or the negative
control's ``effect_in_body``) with the receiver's URL, injects one fault, waits until both
steps are terminal, the broker idle and no effect pending, waits one more relay period past
the relay's delay, and judges: the step invariants of ``checker.check`` on both steps (the
sink applies a publication once: one terminal commit), and ``check_effects`` on the outbox's
rows and what the two receivers saw.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from tests.support.faults import checker, scenarios
from tests.support.faults.receiver import Receiver

EFFECTS = "django_app.faults.effects"
SINK = f"{EFFECTS}.effect_sink"
DECLARES = {"done": 2}  # django_app.faults.effects.DECLARES (not imported: a worker module)
RELAY_DELAY = 2.0  # the workers' steplock_effect_relay_delay (django_app/faults/effects.py)
RELAY_PERIOD = 0.5  # seconds between the controller's relay passes


class Relay:
    """``outbox.relay()`` every ``period`` seconds in a thread of the controller, sending
    published effects through ``app`` (the lab's publisher); :attr:`reports` keeps the
    RelayReports, :attr:`errors` what a pass raised (the database path may be faulted)."""

    def __init__(self, app, period: float = RELAY_PERIOD):
        self.app = app
        self.period = period
        self.reports: list = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def once(self):
        from celery_steplock.contrib.django import outbox

        report = outbox.relay(app=self.app)
        self.reports.append(report)
        return report

    def _loop(self) -> None:
        from django.db import connection

        try:
            while not self._stop.is_set():
                try:
                    self.once()
                except Exception as exc:  # noqa: BLE001 - noted, the next pass tries again
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    connection.close()
                self._stop.wait(self.period)
        finally:
            connection.close()

    def start(self) -> Relay:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None

    def totals(self) -> dict:
        return {
            what: sum(getattr(r, what, 0) or 0 for r in self.reports)
            for what in ("dispatched", "retried", "dead")
        }


@dataclass
class Trial:
    """One outbox trial's identities: the step, its sink, the task sent, the start time."""

    step: int
    sink: int
    task: str
    started: float
    receiver: Receiver
    relay: Relay
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OutboxScenario:
    name: str
    fault: str
    inject: Callable  # inject(lab, trial) -> wall-clock time of the fault
    overlap: bool = False
    timeout: float = 90.0


@dataclass
class OutboxOutcome:
    scenario: OutboxScenario
    verdict: checker.Verdict
    effects: checker.EffectVerdict
    relay: dict
    seconds: float


def _trial_rows(trial: Trial) -> list:
    from celery_steplock.contrib.django.models import Effect

    return [
        r
        for r in Effect.objects.filter(created_at__gte=_aware(trial.started - 1)).order_by("id")
        if _source_step(r) == trial.step
    ]


def _aware(wall: float):
    import datetime as dt

    return dt.datetime.fromtimestamp(wall, tz=dt.timezone.utc)


def _source_step(row) -> int | None:
    payload = row.payload or {}
    if row.kind == "http":
        body = payload.get("json") or {}
        return body.get("step")
    if row.kind == "task":
        return (payload.get("kwargs") or {}).get("step")
    return None


def _to_of(key: str) -> str:
    return key.rsplit(":", 3)[-2]


def effect_rows(rows) -> list[checker.EffectRow]:
    return [
        checker.EffectRow(
            key=r.key,
            step=_source_step(r),
            fence=r.fence,
            to=_to_of(r.key),
            position=r.position,
            status=r.status,
            attempts=r.attempts,
        )
        for r in rows
    ]


def applied(lab, steps_to_sinks: dict[int, int], receiver: Receiver) -> list[checker.Applied]:
    """What the two receivers did with the effects of ``steps_to_sinks`` (step -> its sink):
    the HTTP receiver's keys whose body names one of the steps, and each committed terminal
    transition of a sink (the key: the task id it ran under) with its deliveries (the
    ``sink_received`` and ``task_end`` entries of that task id; at least 1)."""
    from django_app.workflows.models import TransitionRecord

    out = []
    for key, receipt in receiver.snapshot().items():
        body = receipt.body
        if body.get("step") in steps_to_sinks:
            out.append(
                checker.Applied(
                    key=key,
                    step=body["step"],
                    fence=body.get("fence"),
                    to=body.get("to", "done"),
                    position=body.get("position", 0),
                    receipts=receipt.count,
                    applied=receipt.applied,
                )
            )
    sinks = {sink: step for step, sink in steps_to_sinks.items() if sink is not None}
    history = lab.history()
    received: dict[str, dict] = {}
    deliveries: dict[str, int] = {}
    for e in history:  # a delivery ends once (task_end), a delivery that ran its body is received
        if e.get("ev") == "sink_received" and e.get("step") in sinks:
            received.setdefault(e["task_id"], e)
        elif e.get("ev") == "task_end" and e.get("task") == SINK:
            deliveries[e.get("task_id")] = deliveries.get(e.get("task_id"), 0) + 1
    commits: dict[str, int] = {}
    for r in TransitionRecord.objects.filter(step_id__in=list(sinks), to_status="done"):
        commits[r.task_id] = commits.get(r.task_id, 0) + 1
    for task_id, n in commits.items():
        seen = received.get(task_id, {})
        out.append(
            checker.Applied(
                key=task_id,
                step=seen.get("source", sinks.get(seen.get("step"))),
                fence=seen.get("source_fence"),
                to=seen.get("source_to") or "done",
                position=seen.get("position", 1),
                receipts=max(1, deliveries.get(task_id, 0)),
                applied=n,
            )
        )
    return out


def _no_pending(trial: Trial) -> bool:
    return not any(r.status == "pending" for r in _trial_rows(trial))


def run(lab, scenario: OutboxScenario, receiver: Receiver, task: str = "effect_forward"):
    """One trial of ``scenario`` on a fresh step and sink; the relay runs in the controller
    for the whole trial. Returns an :class:`OutboxOutcome`."""
    began = time.monotonic()
    lab.new_trial()
    if not receiver.up:
        receiver.start()
    relay = Relay(lab.publisher).start()
    try:
        step = lab.new_step(f"outbox-{scenario.name}")
        sink = lab.new_step(f"sink-{scenario.name}")
        trial = Trial(step, sink, task, time.time(), receiver, relay)
        lab.note("trial", step=step, sink=sink, scenario=scenario.name)
        fault_at = scenario.inject(lab, trial)
        if not receiver.up:
            receiver.start()
        settled_at = lab.settle([step, sink], timeout=scenario.timeout, resume=False)
        if task == "effect_forward":
            lab.wait_for(lambda: _no_pending(trial), scenario.timeout, "no effect pending")
        time.sleep(RELAY_DELAY + 2 * RELAY_PERIOD)  # the relay's period: nothing more to send
    finally:
        relay.stop()
    from django_app.workflows.models import TransitionRecord

    verdict = lab.verdict([step, sink], fault_at, settled_at)
    records = [
        checker.Record.of(r) for r in TransitionRecord.objects.filter(step_id=step).order_by("id")
    ]
    effects_verdict = checker.check_effects(
        records,
        effect_rows(_trial_rows(trial)),
        applied(lab, {step: sink}, receiver),
        DECLARES,
        outbox=task == "effect_forward",
    )
    return OutboxOutcome(
        scenario,
        verdict,
        effects_verdict,
        {**relay.totals(), "errors": relay.errors[:5]},
        time.monotonic() - began,
    )


# -- faults -------------------------------------------------------------------------------------


def publish(lab, task: str, step: int, task_id: str | None = None, **options) -> str:
    """Send ``django_app.faults.effects.<task>(step)`` (``lab.publish`` sends the tasks of
    ``django_app.faults.tasks``); returns the task id."""
    kwargs = options.pop("kwargs", {})
    task_id = task_id or str(uuid.uuid4())
    lab.publisher.send_task(
        f"{EFFECTS}.{task}", args=(step,), kwargs=kwargs, task_id=task_id, **options
    )
    lab.note("publish", step=step, task=task, task_id=task_id)
    return task_id


def held_pair(lab, trial: Trial, point: str, duplicate: bool = True) -> tuple[dict, str]:
    """``scenarios.held_pair`` for the trial's task: publish it, stop its first attempt at
    ``point``, and (``duplicate``) deliver the same task id again."""
    task_id = str(uuid.uuid4())
    lab.arm(trial.step, point)
    publish(lab, trial.task, trial.step, task_id=task_id, kwargs=_kwargs(trial))
    arrival = lab.wait_arrival(trial.step, point)
    if duplicate:
        publish(lab, trial.task, trial.step, task_id=task_id, kwargs=_kwargs(trial))
    return arrival, task_id


def _kwargs(trial: Trial, work: float = 0.0) -> dict:
    return {"url": trial.receiver.url, "sink": trial.sink, "work": work}


def kill_child(point):
    """SIGKILL the holder at ``point``; ``after_commit`` is between COMMIT and the on-commit
    dispatch (the probe's callback is registered by the CAS, before the outbox's): the relay
    must send what the dead process wrote."""

    def inject(lab, trial):
        arrival, _ = held_pair(lab, trial, point)
        return lab.signal_pid(arrival["pid"], signal.SIGKILL)["t"]

    return inject


def pause(point):
    """SIGSTOP the holder past its TTL until another attempt committed (its CAS refused
    then): no effect of the paused attempt may be written or received."""

    def inject(lab, trial):
        arrival, _ = held_pair(lab, trial, point)
        fault = lab.signal_pid(arrival["pid"], signal.SIGSTOP)
        lab.go(trial.step, point)
        lab.wait_for(
            lambda: scenarios.other_owner(lab, trial.step, arrival["owner"], "committed"),
            60,
            "another attempt to commit the paused holder's step",
        )
        lab.signal_pid(arrival["pid"], signal.SIGCONT)
        return fault["t"]

    return inject


def receiver_down(seconds: float):
    """The HTTP receiver is down (its port closed) when the step commits and for ``seconds``
    more: the dispatch fails with a connection error, the relay retries it after backoff."""

    def inject(lab, trial):
        trial.receiver.stop()
        fault = lab.note("fault", kind="receiver_down", seconds=seconds)
        publish(lab, trial.task, trial.step, kwargs=_kwargs(trial))
        lab.wait_event("committed", 30, step=trial.step)
        time.sleep(seconds)
        trial.receiver.start()
        lab.note("heal", kind="receiver_down")
        return fault["t"]

    return inject


def lost_commit_reply(lab, trial):
    """COMMIT reaches PostgreSQL and commits the step and its effects; its reply never comes
    back, so the on-commit dispatch never runs: the relay sends them."""
    arrival, _ = held_pair(lab, trial, "before_commit", duplicate=False)
    lab.pg_proxy.drop_next_reply(match=b"COMMIT")
    fault = lab.note("fault", kind="lost_commit_reply")
    lab.go(trial.step, "before_commit")
    lab.wait_event("task_end", 30, pid=arrival["pid"])
    lab.pg_proxy.disarm()
    return fault["t"]


def duplicate_delivery(lab, trial):
    arrival, task_id = held_pair(lab, trial, "after_acquire")
    fault = lab.note("fault", kind="duplicate_delivery", task_id=task_id)
    lab.wait_event("contended", 30, step=trial.step)
    lab.go(trial.step, "after_acquire")
    return fault["t"]


def _outbox_scenarios() -> list[OutboxScenario]:
    return [
        OutboxScenario(
            "outbox-kill@after_commit",
            "SIGKILL between COMMIT and dispatch",
            kill_child("after_commit"),
        ),
        OutboxScenario(
            "outbox-kill@before_cas", "SIGKILL before the CAS", kill_child("before_cas")
        ),
        OutboxScenario(
            "outbox-pause@before_cas",
            "SIGSTOP past TTL (CAS refused)",
            pause("before_cas"),
            overlap=True,
        ),
        OutboxScenario("outbox-receiver-down", "HTTP receiver down, then up", receiver_down(3.0)),
        OutboxScenario("outbox-lost-commit-reply", "lost COMMIT reply", lost_commit_reply),
        OutboxScenario(
            "outbox-duplicate-task-id", "duplicate delivery (same task id)", duplicate_delivery
        ),
    ]


OUTBOX_SCENARIOS = {s.name: s for s in _outbox_scenarios()}

#: The negative control (``effect_in_body``): scenarios where a first attempt performs its
#: effects and is then refused; the checker must catch an effect applied twice.
CONTROLS = ("outbox-kill@before_cas", "outbox-pause@before_cas")


# -- the randomized run (tests/support/faults/nemesis.py, workload "outbox") ----------------------


def rows_of(steps) -> list:
    """The outbox rows whose effect belongs to one of ``steps`` (ids; a dict: its keys)."""
    from celery_steplock.contrib.django.models import Effect

    wanted = set(steps)
    return [r for r in Effect.objects.order_by("id") if _source_step(r) in wanted]


def run_effects(lab, sinks: dict[int, int], receiver: Receiver, workload: str) -> dict:
    """The run directory's ``effects.json``: what ``runcheck`` needs to judge the effects of
    the steps ``sinks`` (step -> its sink): ``declares``, ``outbox`` (False for the negative
    control ``outbox-in-body``), ``sources`` (the step ids), ``rows`` (``EffectRow`` fields),
    ``applied`` (``Applied`` fields) and the receiver's counts."""
    return {
        "workload": workload,
        "declares": DECLARES,
        "outbox": workload == "outbox",
        "sources": sorted(sinks),
        "rows": [r.__dict__ for r in effect_rows(rows_of(sinks))],
        "applied": [a.__dict__ for a in applied(lab, sinks, receiver)],
        "receiver": receiver.counts(),
    }
