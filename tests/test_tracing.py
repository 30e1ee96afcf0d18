"""OpenTelemetry spans of an execution (celery_steplock.tracing), recorded by the SDK's
in-memory exporter around real executions (``apply()``) on real Redis and the real DB."""

import json
import subprocess
import sys
import time

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from celery_steplock import tracing
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step
from tests.support import ROOT

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "4111111111111111"  # an argument value: it must appear in no span


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.tracing.charge",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
)
def charge(self, step_id, card, fail=False):
    with PROVIDER.get_tracer("user").start_as_current_span("user.gateway"):
        time.sleep(0.01)
    if fail:
        raise ValueError(f"declined {card}")
    return self.lease.fence


@celery_app.task(bind=True, base=StepLockedTask, name="tests.tracing.lease_only")
def lease_only(self, card):
    return self.lease.fence


# A provider of this module's own (the process's global one stays unset for other tests).
PROVIDER = TracerProvider()


@pytest.fixture(scope="module")
def exporter():
    exporter = InMemorySpanExporter()
    PROVIDER.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(PROVIDER)
    yield exporter
    tracing.use_tracer_provider(None)
    exporter.clear()


@pytest.fixture
def spans(exporter, app, redis_client):
    exporter.clear()

    def finished():
        return {span.name: span for span in exporter.get_finished_spans()}

    yield finished
    exporter.clear()


def attribute_values(span):
    return [str(v) for v in span.attributes.values()]


def test_one_execution_is_a_tree_of_phases_with_lease_attributes(spans, events):
    step = Step.objects.create(name="s")
    result = charge.apply(args=(step.pk, SECRET), task_id="tid-1")
    assert result.successful(), result.traceback
    found = spans()
    assert sorted(found) == [
        "steplock.body",
        "steplock.cas",
        "steplock.commit",
        "steplock.execution",
        "steplock.hold",
        "steplock.release",
        "steplock.wait",
        "user.gateway",
    ]
    root = found["steplock.execution"]
    parents = {name: span.parent.span_id if span.parent else None for name, span in found.items()}
    ids = {name: span.context.span_id for name, span in found.items()}
    assert parents == {
        "steplock.execution": None,
        "steplock.wait": ids["steplock.execution"],
        "steplock.hold": ids["steplock.execution"],
        "steplock.body": ids["steplock.hold"],
        "user.gateway": ids["steplock.body"],  # the body's own spans nest
        "steplock.cas": ids["steplock.hold"],
        "steplock.commit": ids["steplock.hold"],
        "steplock.release": ids["steplock.hold"],
    }
    assert {span.context.trace_id for span in found.values()} == {root.context.trace_id}
    acquired = dict(events)["lock_acquired"]
    lease = {
        "steplock.task.name": "tests.tracing.charge",
        "steplock.task.id": "tid-1",
        "steplock.lease.name": acquired["name"],
        "steplock.lease.key": acquired["key"],
        "steplock.lease.ttl": acquired["ttl"],
        "steplock.lease.owner": acquired["owner"],
        "steplock.lease.fence": result.result,
    }
    assert dict(root.attributes) == lease
    for name in (
        "steplock.hold",
        "steplock.body",
        "steplock.cas",
        "steplock.commit",
        "steplock.release",
    ):
        assert dict(found[name].attributes) == lease, name
    wait = dict(found["steplock.wait"].attributes)
    assert wait == {
        k: v for k, v in lease.items() if k not in ("steplock.lease.owner", "steplock.lease.fence")
    }
    for span in found.values():
        assert SECRET not in " ".join(attribute_values(span)), span.name
        assert str(step.pk) not in attribute_values(span), span.name
    # Each phase lies within its parent, in the order of the flow.
    for name, span in found.items():
        if parents[name] is not None:
            parent = next(s for s in found.values() if s.context.span_id == parents[name])
            assert parent.start_time <= span.start_time <= span.end_time <= parent.end_time
    order = [
        "steplock.wait",
        "steplock.body",
        "steplock.cas",
        "steplock.commit",
        "steplock.release",
    ]
    assert [found[n].start_time for n in order] == sorted(found[n].start_time for n in order)
    assert found["steplock.wait"].end_time <= found["steplock.hold"].start_time
    assert found["steplock.body"].end_time - found["steplock.body"].start_time >= 10_000_000
    assert all(span.status.status_code is trace.StatusCode.UNSET for span in found.values())
    by_id = {span.context.span_id: name for name, span in found.items()}
    print("\nspans of one execution (name <- parent: duration, attributes):")
    for span in sorted(found.values(), key=lambda s: s.start_time):
        parent = by_id.get(span.parent.span_id) if span.parent else "-"
        print(
            f"  {span.name} <- {parent}: {(span.end_time - span.start_time) / 1e6:.3f} ms "
            f"{dict(span.attributes)}"
        )


def test_signals_carry_the_phase_durations(spans, events):
    step = Step.objects.create(name="s")
    assert charge.apply(args=(step.pk, SECRET)).successful()
    by_name = dict(events)
    found = spans()

    def seconds(name):
        span = found[name]
        return (span.end_time - span.start_time) / 1e9

    wait = by_name["lock_acquired"]["wait_seconds"]
    cas = by_name["transition_applied"]["cas_seconds"]
    commit = by_name["transition_applied"]["commit_seconds"]
    held = by_name["lock_released"]["hold_seconds"]
    assert all(isinstance(v, float) and v > 0 for v in (wait, cas, commit, held))
    # The span and the payload time the same phase with two clocks: both sit inside the
    # execution span, and the hold covers the body.
    total = seconds("steplock.execution")
    assert max(wait, cas, commit, held) <= total
    assert held >= seconds("steplock.body") >= 0.01


def test_a_conflict_records_no_body_and_says_duplicate(spans):
    step = Step.objects.create(name="s", status="done")
    result = charge.apply(args=(step.pk, SECRET))
    assert result.successful() and result.result["steplock"] == "duplicate"
    found = spans()
    assert sorted(found) == [
        "steplock.execution",
        "steplock.hold",
        "steplock.release",
        "steplock.wait",
    ]
    assert found["steplock.execution"].attributes["steplock.outcome"] == "duplicate"
    assert "steplock.control" not in found["steplock.execution"].attributes
    assert found["steplock.execution"].status.status_code is trace.StatusCode.UNSET


def test_an_ignored_conflict_ends_as_ignore(spans):
    step = Step.objects.create(name="s", status="done")
    charge.on_conflict = "ignore"
    try:
        result = charge.apply(args=(step.pk, SECRET))
    finally:
        del charge.on_conflict
    assert result.state == "IGNORED" or result.result is None
    found = spans()
    assert found["steplock.execution"].attributes["steplock.control"] == "ignore"
    assert found["steplock.execution"].status.status_code is trace.StatusCode.UNSET


def test_a_failing_body_is_an_error_by_type_only_and_rolls_back(spans):
    step = Step.objects.create(name="s")
    result = charge.apply(args=(step.pk, SECRET), kwargs={"fail": True})
    assert result.failed() and isinstance(result.result, ValueError)
    found = spans()
    assert "steplock.commit" not in found and "steplock.cas" not in found
    for name in ("steplock.body", "steplock.rollback", "steplock.execution"):
        span = found[name]
        assert span.status.status_code is trace.StatusCode.ERROR, name
        assert span.status.description == "ValueError"
        assert span.attributes["exception.type"] == "builtins.ValueError"
        assert span.events == ()  # no exception event: its message quotes the card
        assert SECRET not in " ".join(attribute_values(span))
    assert found["steplock.hold"].status.status_code is trace.StatusCode.UNSET
    step.refresh_from_db()
    assert step.status == "pending"


def test_a_task_without_step_model_has_body_and_no_commit(spans):
    result = lease_only.apply(args=(SECRET,))
    assert result.successful()
    found = spans()
    assert sorted(found) == [
        "steplock.body",
        "steplock.execution",
        "steplock.hold",
        "steplock.release",
        "steplock.wait",
    ]
    assert found["steplock.execution"].attributes["steplock.lease.fence"] == result.result


OVERHEAD = r"""
import json, sys, time
mode = sys.argv[1]
if mode == "absent":
    sys.modules["opentelemetry"] = None  # import fails as if not installed
elif mode == "sdk":
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
from celery_steplock import tracing

class Task:
    name = "t"
    class request:
        id = "tid"

class Lease:
    owner, fence = "o", 1

class Atomic:
    def __enter__(self): return self
    def __exit__(self, *exc): self.steps.run(); return False

class Steps:
    def __init__(self): self.hooks = []
    def on_commit(self, f): self.hooks.append(f)
    def run(self):
        hooks, self.hooks = self.hooks, []
        for f in hooks: f()

task, lease, steps, base = Task(), Lease(), Steps(), {"name": "n", "key": "k", "ttl": 30.0}

def one():
    with tracing.execution(task):
        with tracing.phase("wait", base):
            pass
        held = tracing.hold(lease)
        atomic = Atomic(); atomic.steps = steps
        with tracing.committing(atomic, steps):
            with tracing.phase("body"):
                pass
            with tracing.phase("cas"):
                pass
        with tracing.releasing(held):
            pass

def empty():
    pass

def best(f, n):
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t) / n)
        if mode == "sdk":
            exporter.clear()
    return min(runs)

n = 2000 if mode == "sdk" else 20000
print(json.dumps({"mode": mode, "enabled": tracing.enabled(),
                  "api": tracing._trace is not None,
                  "us": (best(one, n) - best(empty, n)) * 1e6}))
"""


def test_overhead_per_execution_is_printed_and_spans_only_with_a_provider(capsys):
    """Micro-benchmark of the tracing calls of one execution (7 phases), in fresh
    processes: the API absent, the API without a provider, the SDK with an in-memory
    exporter. Printed, not asserted (machine speed)."""
    results = {}
    for mode in ("absent", "no-provider", "sdk"):
        out = subprocess.run(
            [sys.executable, "-c", OVERHEAD, mode],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    assert {m: (r["api"], r["enabled"]) for m, r in results.items()} == {
        "absent": (False, False),
        "no-provider": (True, False),
        "sdk": (True, True),
    }
    with capsys.disabled():
        print(
            "\ntracing overhead per execution: "
            + ", ".join(f"{m} {r['us']:.2f} us" for m, r in results.items())
        )


def test_enabled_follows_the_provider(exporter):
    assert tracing.enabled() is True
    tracing.use_tracer_provider(None)
    try:
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
        assert tracing.enabled() is False  # the global default: no provider set
        tracing.use_tracer_provider(trace.NoOpTracerProvider())
        assert tracing.enabled() is False
    finally:
        tracing.use_tracer_provider(PROVIDER)
    assert tracing.enabled() is True
