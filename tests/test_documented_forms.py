"""Every task option form the settings reference's "Accepted forms of each task option"
table (docs/reference/settings.md) documents, given both ways
Celery users give options: as a class attribute of a StepLockedTask subclass and as an
``@app.task(...)`` keyword. Each form runs one real execution (real Redis, the real
database) and is checked for its effect, not only for being accepted.
"""

import re
from pathlib import Path

import pytest

from celery_steplock.patterns.breaker import CircuitBreaker
from celery_steplock.patterns.retry import RetryPolicy
from celery_steplock.patterns.concurrency import ConcurrencyLimit, current_slot
from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step

# The database holds at most audit rows here: one pass (db_incidental).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.db_incidental]

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "settings.md"


def key_of_step(step_id):
    return f"step:{step_id}"


def key_of_tenant(step_id):
    return f"tenant:{step_id}"


#: option -> [(form id, value, what the execution must show)]; "plan" checks compare an
#: attribute of the task's execution plan, "name" the lease's lock name.
FORMS = {
    "lock_key": [
        ("template", "step:{step_id}", ("name", "step:{id}")),
        ("function", key_of_step, ("name", "step:{id}")),
        ("lambda", lambda step_id: f"step:{step_id}", ("name", "step:{id}")),
        ("staticmethod", staticmethod(key_of_step), ("name", "step:{id}")),
        ("none", None, ("name", r"forms\.[a-z_.]+:[0-9a-f]{{64}}")),
    ],
    "lock_ttl": [("int", 10, ("plan", "ttl", 10.0)), ("float", 7.5, ("plan", "ttl", 7.5))],
    "lock_wait": [("zero", 0, ("plan", "wait", 0.0)), ("float", 2.5, ("plan", "wait", 2.5))],
    "lock_max_hold": [
        ("none", None, ("plan", "max_hold", None)),
        ("seconds", 300, ("plan", "max_hold", 300.0)),
    ],
    "lock_retry_max": [
        ("none", None, ("plan", "retry_max", None)),
        ("int", 3, ("plan", "retry_max", 3)),
    ],
    "on_contended": [
        (v, v, ("plan", "on_contended", v)) for v in ("retry", "skip", "ignore", "raise")
    ],
    "on_conflict": [
        (v, v, ("plan", "on_conflict", v)) for v in ("return", "return_winner", "ignore", "raise")
    ],
    "on_store_error": [
        (v, v, ("plan", "on_store_error", v)) for v in ("fail_closed", "fail_open")
    ],
    "lock_precheck": [
        ("true", True, ("plan", "precheck", True)),
        ("false", False, ("plan", "precheck", False)),
    ],
    "step_model": [("label", "workflows.Step", ("model", Step)), ("class", Step, ("model", Step))],
    "step_id_arg": [("name", "step_id", ("plan", "step_id_arg", "step_id"))],
    "transition": [
        ("tuple", ("pending", "done"), ("plan", "transition", ("pending", "done"))),
        ("list", ["pending", "done"], ("plan", "transition", ("pending", "done"))),
    ],
    "step_transitions": [
        ("table", {"pending": ["done"]}, ("plan", "transition", ("pending", "done")))
    ],
    "step_database": [
        ("none", None, ("plan", "transition", ("pending", "done"))),
        ("alias", "default", ("plan", "transition", ("pending", "done"))),
    ],
    "idempotency_key": [
        ("template", "order:{step_id}", ("gate", "template", "order:{step_id}")),
        ("function", key_of_step, ("gate", "template", key_of_step)),
        ("true", True, ("gate", "template", True)),
    ],
    "idempotency_version": [
        ("str", "2", ("gate", "version", "2")),
        ("int", 3, ("gate", "version", "3")),
    ],
    "idempotency_ttl": [
        ("none", None, ("gate", "ttl", 86400.0)),
        ("seconds", 3600, ("gate", "ttl", 3600.0)),
    ],
    "circuit_breaker": [
        ("name", "forms-payments", ("gates", ["circuit_breaker"])),
        (
            "object",
            CircuitBreaker("forms-payments", failure_threshold=5),
            ("gates", ["circuit_breaker"]),
        ),
        ("none", None, ("gates", [])),
    ],
    "retry_policy": [
        ("object", RetryPolicy(max_attempts=5, backoff=1.0), ("gates", [])),
        ("none", None, ("gates", [])),
    ],
    "concurrency_limit": [
        ("int", 2, ("slot", r"forms\.[a-z_.]+", 2)),
        ("object", ConcurrencyLimit(2), ("slot", r"forms\.[a-z_.]+", 2)),
    ],
    "concurrency_limit_key": [
        ("template", "tenant:{step_id}", ("slot", "tenant:{id}", 1)),
        ("function", key_of_tenant, ("slot", "tenant:{id}", 1)),
        ("lambda", lambda step_id: f"tenant:{step_id}", ("slot", "tenant:{id}", 1)),
        ("none", None, ("slot", r"forms\.[a-z_.]+", 1)),
    ],
    "cluster_rate_limit": [
        ("string", "10/s", ("limiters", ["10/1s window"])),
        ("multiple", "5/10s", ("limiters", ["5/10s window"])),
        ("bucket", TokenBucket("5/s", capacity=2), ("limiters", ["5/s bucket of 2"])),
        ("window", SlidingWindow(100, 60), ("limiters", ["100/60s window"])),
        ("list", ["10/s", TokenBucket(2.0)], ("limiters", ["10/1s window", "2/s bucket of 2"])),
    ],
    "cluster_rate_limit_key": [
        ("none", None, ("gate_key", None)),
        ("template", "rl:{step_id}", ("gate_key", "rl:{step_id}")),
    ],
}

#: Options a form needs beside its own (the key of a limit needs the limit).
NEEDS = {
    "concurrency_limit_key": {"concurrency_limit": 1},
    "cluster_rate_limit_key": {"cluster_rate_limit": "100/s"},
}

#: What every task of this module has unless the option under test replaces it.
BASE = {
    "step_model": "workflows.Step",
    "step_id_arg": "step_id",
    "transition": ("pending", "done"),
    "lock_key": "step:{step_id}",
}

SEEN = {}


def body(self, step_id):
    SEEN[self.name] = {
        "name": self.lease.name,
        "ttl": self.lease.ttl,
        "pttl": self.lease_store_pttl(),
        "max_hold_until": self.lease.max_hold_until,
        "slot": (lambda slot: slot and (slot.key, slot.limit.limit))(current_slot()),
    }
    return "ran"


class FormTask(StepLockedTask):
    """The base of this module's tasks: reads the lease's TTL in Redis from the body."""

    def lease_store_pttl(self):
        return self.steplock_plan.store.client.pttl(self.lease.key)


def documented_options() -> set[str]:
    """The options of the reference's "Accepted forms" table (first column)."""
    text = REFERENCE.read_text()
    heading = "\n## Accepted forms of each task option\n"
    section = re.split(r"\n#{1,3} ", text.split(heading, 1)[1], maxsplit=1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|", section, re.M)}


def test_every_documented_option_has_its_forms_tested():
    assert documented_options() == set(FORMS)


def make_task(option, form, value, how):
    options = dict(BASE, **NEEDS.get(option, {}))
    options[option] = value
    if option.startswith("idempotency_") and option != "idempotency_key":
        options["idempotency_key"] = "idem:{step_id}"  # the pattern's switch
    name = f"forms.{how}.{option}.{form}"
    if name in celery_app.tasks:
        return celery_app.tasks[name]
    # acks_late and reject_on_worker_lost as the docs say: this module's tasks stay in
    # the example app's registry, and must not add warnings to its checks.
    if how == "keyword":
        return celery_app.task(
            bind=True,
            base=FormTask,
            name=name,
            acks_late=True,
            reject_on_worker_lost=True,
            **options,
        )(body)
    subclass = type(f"Form_{option}_{form}", (FormTask,), dict(options))
    return celery_app.task(
        bind=True, base=subclass, name=name, acks_late=True, reject_on_worker_lost=True
    )(body)


CASES = [
    pytest.param(option, form, value, expected, how, id=f"{option}-{form}-{how}")
    for option, forms in FORMS.items()
    for form, value, expected in forms
    for how in ("class_attribute", "keyword")
]


@pytest.mark.parametrize("option,form,value,expected,how", CASES)
def test_documented_form(app, option, form, value, expected, how, request):
    if option.startswith("idempotency_"):
        request.getfixturevalue("redis_client")  # flushed: no record of an earlier run
    task = make_task(option, form, value, how)
    step = Step.objects.create(name="forms")
    result = task.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    assert result.result == "ran"
    step.refresh_from_db()
    assert step.status == "done"
    seen = SEEN.pop(task.name)
    plan = task.steplock_plan
    kind = expected[0]
    if kind == "name":
        assert re.fullmatch(expected[1].format(id=step.pk), seen["name"]), seen["name"]
    elif kind == "slot":
        assert re.fullmatch(expected[1].format(id=step.pk), seen["slot"][0]), seen["slot"]
        assert seen["slot"][1] == expected[2]
    elif kind == "model":
        assert plan.steps.model is expected[1]
    elif kind == "gate":
        gate = plan.gates[0]
        target = gate if hasattr(gate, expected[1]) else gate.policy
        assert getattr(target, expected[1]) == expected[2]
    elif kind == "gates":
        assert [gate.option for gate in plan.gates] == expected[1]
    elif kind == "limiters":
        assert [str(limiter) for limiter in plan.gates[-1].limiters] == expected[1]
    elif kind == "gate_key":
        assert plan.gates[-1].key == expected[1]
    else:
        assert getattr(plan, expected[1]) == expected[2]
    if option == "lock_ttl":
        assert seen["ttl"] == expected[2]
        assert expected[2] * 1000 - 2000 < seen["pttl"] <= expected[2] * 1000
    if option == "lock_max_hold":
        assert (seen["max_hold_until"] is None) == (value is None)
