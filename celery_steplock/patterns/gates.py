"""Admission control: the gates an execution passes between its lease and its body.

The distributed patterns (idempotency records, the circuit breaker, the concurrency limit,
the cluster-wide rate limits) each contribute one gate per task, built by the execution plan
from the task's options. An execution enters the gates in the order of
:data:`celery_steplock.patterns.GATE_REGISTRY` after its lease is acquired and the precheck
passed, runs its body and transaction, then exits the gates in reverse order: after COMMIT
(or the rollback, or the body's exception).

A gate module (registered in :data:`celery_steplock.patterns.GATE_REGISTRY`) provides:

``OPTIONS``
    frozenset of the task option names it reads, as registered (they join the plan's option
    names, so assigning one drops the plan, and the validator knows them).
``gate(task, settings) -> Gate | None``
    the task's gate, or None when its options leave the pattern off; raises
    ImproperlyConfigured naming the option for a bad value.

A :class:`Gate` has ``enter(context) -> Admission | None``, which either admits the
execution (returning what to exit later, or None when there is nothing to undo), raises an
:class:`~celery_steplock.exceptions.AdmissionDenied` (the task is re-queued with a countdown
of its ``retry_after``: :meth:`StepLockedTask.handle_denied`), raises :class:`Replay` (the
task ends with ``Replay.result`` without running its body) or raises
:class:`~celery_steplock.exceptions.LockStoreUnavailable` (fail closed: the task is retried
like any lock-store outage; a gate that fails open returns None itself). An
:class:`Admission` has ``exit(exc, result)``: ``exc`` is the exception that ended the
execution (None on success), ``result`` its return value, or :data:`NOT_RUN` when a later
gate refused the execution before its body. ``exit`` must not raise; its errors are logged
and never mask the task's outcome.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..events import log_event

__all__ = [
    "Gate",
    "Admission",
    "AdmissionContext",
    "Replay",
    "NOT_RUN",
    "Entered",
]


class _NotRun:
    def __repr__(self) -> str:
        return "NOT_RUN"


#: The ``result`` given to :meth:`Admission.exit` when the body never ran.
NOT_RUN: Any = _NotRun()


class Replay(Exception):
    """Raised by a gate's ``enter``: end the execution with ``result`` (a recorded result)
    without running the body. Control flow, not an error."""

    def __init__(self, result: Any, *, gate: str = ""):
        super().__init__(gate)
        self.result = result
        self.gate = gate


@dataclass(frozen=True)
class AdmissionContext:
    """What a gate sees of one execution: the task (its ``request``), the plan, the bound
    arguments (``{name: value}``, for key templates), the lease (None when running fail-open
    during an outage) and the step id (None without a step model)."""

    task: Any
    plan: Any
    arguments: dict[str, Any]
    lease: Any
    step_id: Any = None


class Admission(Protocol):
    def exit(self, exc: BaseException | None, result: Any) -> None: ...


class Gate(Protocol):
    #: The task option the gate comes from (for messages and logs).
    option: str

    def enter(self, context: AdmissionContext) -> Admission | None: ...


@dataclass
class Entered:
    """The gates one execution entered, exited in reverse order exactly once."""

    context: AdmissionContext
    admissions: list[tuple[str, Admission]] = field(default_factory=list)

    @classmethod
    def enter(cls, context: AdmissionContext) -> Entered:
        """Enter every gate of ``context.plan``; a refusal (AdmissionDenied, Replay,
        LockStoreUnavailable or any error) exits the gates already entered with
        :data:`NOT_RUN` (and the refusal as ``exc``; None for a Replay) and propagates."""
        entered = cls(context)
        for gate in context.plan.gates:
            try:
                admission = gate.enter(context)
            except BaseException as exc:
                entered.exit(None if isinstance(exc, Replay) else exc, NOT_RUN)
                raise
            if admission is not None:
                entered.admissions.append((gate.option, admission))
        return entered

    def exit(self, exc: BaseException | None, result: Any) -> None:
        admissions, self.admissions = self.admissions, []
        for option, admission in reversed(admissions):
            try:
                admission.exit(exc, result)
            except Exception as error:  # noqa: BLE001 - never masks the task's outcome
                request = self.context.task.request
                log_event(
                    "admission_exit_failed",
                    logging.ERROR,
                    task_id=request.id,
                    task_name=self.context.task.name,
                    gate=option,
                    error=error,
                )
