"""Step tasks of the randomized fault run (``tests/support/faults/nemesis.py``) that use the
distributed patterns on the fault suite's step model: a cluster-wide rate limit, a
concurrency limit, a circuit breaker around a fake dependency and an idempotency key.

Each moves its step ``pending -> done`` through :class:`~django_app.faults.tasks.FaultTask`
(the probe's barriers, a ``TransitionRecord`` per committed transition), so the run's checker
sees them as it sees ``forward``. The limits are module constants: the controller writes them
into the run's description (``run.json``, ``limits``) and the checker holds the history to
them.

The fake dependency fails while the control Redis key ``faults:dep:failing`` exists (the
controller sets it, with an expiry, for bursts): its failures open the breaker, its recovery
lets the half-open probes close it again.

The breaker's admissions and the dependency's calls go into the history for the checker's
breaker invariants (``tests/support/faults/runcheck.py``): each call of the fake dependency
is a ``dep_call`` entry (when the body decides to call it) carrying what the breaker's
admission said (``admitted``, ``probe``, ``generation``, ``guarded``, ``admit_t0`` /
``admit_t1``: the wall clock before and after :meth:`CircuitBreaker.admit`, ``state_cache``
and ``probe_timeout`` in seconds, ``half_open_probes``), then a ``dep_done`` entry when it
returns; a probe's outcome writes a ``breaker_outcome`` entry just before it goes to Redis
(:class:`RecordedCall`). ``STEPLOCK_FAULTS_BREAKER=bypass`` is their negative control: a
refused admission does not stop the call (while OPEN the body calls without an admission;
while HALF_OPEN with its probes taken it is let through as one more probe, as a breaker
without a cluster-wide probe limit would, its outcome in the history only).

``STEPLOCK_FAULTS_PATTERNS=bypass`` is the negative control of the rate, concurrency and
idempotency rules: ``rate_forward``, ``slot_forward`` and ``idem_forward`` are declared without
their limit or key (``idem_forward`` has no status pre-check in either mode: it alone would
skip a duplicate's body), and their bodies write the entries the checker judges
(``rate_granted``, ``slot_acquired``/``slot_released``, ``idem_body``/``idem_completed``)
themselves, marked ``bypass``: what a worker that ignored the pattern would have done.
"""

import dataclasses
import os
import threading
import time

from celery import current_app, shared_task

from celery_steplock import CircuitBreaker, CircuitOpen, SlidingWindow
from celery_steplock.patterns.breaker import HALF_OPEN, AdmittedCall

from . import probe
from .tasks import OPTIONS, _body

RATE_NAME = "nemesis"
RATE = "5/s"
RATE_LIMIT = 5  # grants
RATE_WINDOW = 1.0  # seconds
SLOTS_KEY = "nemesis-slots"
SLOTS = 2
BREAKER_NAME = "nemesis-dep"
DEP_FAILING = "faults:dep:failing"

# A killed idempotent holder keeps its record locked for this long (600 s by default): a run
# that must settle within a bound needs it short (a live body's record is renewed by its
# heartbeat, so it need not outlast the longest body).
if probe.enabled():
    current_app.conf.steplock_idempotency_lock_ttl = float(
        os.environ.get("STEPLOCK_FAULTS_IDEMPOTENCY_LOCK_TTL", "8")
    )


def patterns_mode() -> str:
    """``"bypass"`` (the rate, concurrency and idempotency rules' negative control) or
    ``"guarded"``, from ``STEPLOCK_FAULTS_PATTERNS``."""
    return os.environ.get("STEPLOCK_FAULTS_PATTERNS") or "guarded"


BYPASS = patterns_mode() == "bypass"


def breaker_mode() -> str:
    """``"bypass"`` (the breaker invariants' negative control) or ``"guarded"``, from
    ``STEPLOCK_FAULTS_BREAKER``."""
    return os.environ.get("STEPLOCK_FAULTS_BREAKER") or "guarded"


_admission = threading.local()  # the admission of the execution running in this thread


class RecordedBreaker(CircuitBreaker):
    """A :class:`CircuitBreaker` that remembers, per thread, what its last admission said, for
    the ``dep_call`` entry of the body that follows it (the task's breaker gate admits in the
    thread that runs the body)."""

    def admit(self, owner=None, *, sender=None, on_store_error=None):
        task_id = getattr(getattr(sender, "request", None), "id", None)
        _admission.info = None
        t0 = time.time()
        try:
            call = super().admit(owner, sender=sender, on_store_error=on_store_error)
        except CircuitOpen as exc:
            if breaker_mode() != "bypass":
                raise
            # the negative control: a refusal does not stop the call; a half-open refusal
            # (its probes taken) lets it through as one more probe
            extra = exc.context.get("state") == HALF_OPEN
            _admission.info = self._info(task_id, t0, extra, extra, None, False)
            if not extra:
                return AdmittedCall(self, 0, owner or "", False, guarded=False, sender=sender)
            # a probe no permit backs: its outcome is recorded in the history, not in Redis
            return RecordedCall(self, 0, owner or "", False, sender=sender, fake=True)
        _admission.info = self._info(task_id, t0, True, call.probe, call.generation, call.guarded)
        if not call.probe:
            return call
        fields = {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}
        return RecordedCall(**fields)

    def _info(self, task_id, t0, admitted, is_probe, generation, guarded) -> dict:
        return {
            "task_id": task_id,
            "admitted": admitted,
            "probe": is_probe,
            "generation": generation,
            "guarded": guarded,
            "admit_t0": t0,
            "admit_t1": time.time(),
            "state_cache": self._cache(self._target())[1],
            "probe_timeout": self.probe_timeout,
            "half_open_probes": self.half_open_probes,
        }


@dataclasses.dataclass
class RecordedCall(AdmittedCall):
    """A probe's :class:`AdmittedCall` that writes a ``breaker_outcome`` history entry just
    before its outcome goes to Redis (so before its permit is given back: the checker's
    lower bound of the permit's end). ``fake``: the negative control's probe, which no
    permit backs: its outcome is recorded in the history only."""

    fake: bool = False

    def record(self, exc):
        self._noted("record", exc)
        if not self.fake:
            super().record(exc)

    def release(self):
        self._noted("release", None)
        if not self.fake:
            super().release()

    def _noted(self, how, exc) -> None:
        if not self.done:
            task_id = getattr(getattr(self.sender, "request", None), "id", None)
            probe.record(
                "breaker_outcome",
                name=self.breaker.name,
                task_id=task_id,
                how=how,
                error=type(exc).__name__ if exc is not None else None,
            )
        if self.fake:
            self.done = True


def admission_of(task_id) -> dict:
    """What the breaker's admission of execution ``task_id`` said in this thread (``admitted``
    False and no times when it did not admit it, or holds another execution's admission)."""
    info = getattr(_admission, "info", None)
    if info is None or info["task_id"] != task_id:
        return {"admitted": False, "probe": False, "generation": None, "guarded": False}
    return {k: v for k, v in info.items() if k != "task_id"}


breaker = RecordedBreaker(
    BREAKER_NAME,
    failure_threshold=2,
    window=4,
    recovery_timeout=1.5,
    half_open_probes=1,
    success_threshold=1,
    probe_timeout=15.0,
)


class DependencyDown(Exception):
    """The fake dependency failed (the controller's burst)."""


def rate_key(prefix: str = "steplock") -> str:
    """The lock-store key of the rate limit (the ``key`` of its ``rate_limit_allowed``)."""
    return SlidingWindow(RATE).redis_key(prefix, RATE_NAME)[0]


def limits(prefix: str = "steplock") -> dict:
    """The configured limits, in the shape of the run description's ``limits``."""
    return {
        "rate": {rate_key(prefix): {"limit": RATE_LIMIT, "window": RATE_WINDOW}},
        "concurrency": {SLOTS_KEY: SLOTS},
        "breaker": {
            BREAKER_NAME: {
                "half_open_probes": breaker.half_open_probes,
                "probe_timeout": breaker.probe_timeout,
            }
        },
    }


def _bypassed(self, event: str, **fields) -> None:
    probe.record(
        event,
        task_id=self.request.id,
        owner=self.lease.owner if self.lease else None,
        bypass=True,
        **fields,
    )


def _prefix() -> str:
    return getattr(current_app.conf, "steplock_key_prefix", None) or "steplock"


@shared_task(
    transition=("pending", "done"),
    **({} if BYPASS else {"cluster_rate_limit": RATE, "cluster_rate_limit_key": RATE_NAME}),
    **OPTIONS,
)
def rate_forward(self, step_id, work=0.0):
    """pending -> done, at most ``RATE`` across the cluster."""
    if BYPASS:
        _bypassed(self, "rate_granted", key=rate_key(_prefix()), granted_at=time.time())
    return _body(self, step_id, work)


@shared_task(
    transition=("pending", "done"),
    **({} if BYPASS else {"concurrency_limit": SLOTS, "concurrency_limit_key": SLOTS_KEY}),
    **OPTIONS,
)
def slot_forward(self, step_id, work=0.5):
    """pending -> done holding one of ``SLOTS`` slots for ``work`` seconds."""
    if not BYPASS:
        return _body(self, step_id, work)
    _bypassed(self, "slot_acquired", limit_key=SLOTS_KEY, limit=SLOTS, slot=0)
    try:
        return _body(self, step_id, work)
    finally:
        _bypassed(self, "slot_released", limit_key=SLOTS_KEY, limit=SLOTS, slot=0)


@shared_task(transition=("pending", "done"), circuit_breaker=breaker, **OPTIONS)
def breaker_forward(self, step_id, work=0.0):
    """pending -> done after calling the fake dependency, which fails while the controller
    says so: ``DependencyDown`` fails the task (a Celery retry would be a control exception
    the breaker does not count), the step stays pending until it is sent again."""
    probe.barrier("after_acquire", self, step_id)
    ids = {
        "step": step_id,
        "task_id": self.request.id,
        "owner": self.lease.owner if self.lease else None,
        "name": BREAKER_NAME,
    }
    # the call: from this entry to its dep_done (the checker's breaker invariants)
    probe.record("dep_call", **ids, **admission_of(self.request.id))
    failing = None
    try:
        failing = bool(probe._redis().exists(DEP_FAILING))
    finally:
        probe.record("dep_done", **ids, failed=failing)
    if failing:
        raise DependencyDown("the fake dependency is failing")
    probe.work(self, work)
    return {"step_id": step_id, "owner": self.lease.owner, "fence": self.lease.fence}


@shared_task(
    transition=("pending", "done"),
    # no status pre-check in either mode: it alone would skip a duplicate's body, and the
    # idempotency record is what is judged (its control differs from it in the key only)
    **{**OPTIONS, "lock_precheck": False},
    **({} if BYPASS else {"idempotency_key": "idem:{step_id}"}),
)
def idem_forward(self, step_id, work=0.0):
    """pending -> done with an idempotency record per step: the body runs once per key."""
    key = f"bypass:idem:{step_id}" if BYPASS else probe.idempotency_key_of(self.request.id)
    probe.record(
        "idem_body",
        key=key,
        task_id=self.request.id,
        step=step_id,
        owner=self.lease.owner if self.lease else None,
    )
    result = _body(self, step_id, work)
    if BYPASS:
        _bypassed(self, "idem_completed", key=key)
    return result
