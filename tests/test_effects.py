"""Declaring effects (celery_steplock.effects, issue 28): what each declaration records, what
it refuses (InvalidEffect naming the argument, before anything is recorded), the key's shape,
and EffectsUnavailable outside a step transaction. No database, no Redis: the write side is
tests/contrib/test_effects_commit.py."""

from __future__ import annotations

import math

import pytest
from celery import Celery

from celery_steplock import effects
from celery_steplock.effects import Declared, Outbox, collecting, effect_key
from celery_steplock.exceptions import (
    EffectsUnavailable,
    ImproperlyConfigured,
    InvalidEffect,
    StepLockError,
)

pytestmark = pytest.mark.no_database


@pytest.fixture
def outbox():
    with collecting(Outbox()) as box:
        yield box


@effects.register("tests.effects.seen")
def _seen(*args, idempotency_key, **kwargs):
    return idempotency_key


def test_each_kind_is_recorded_in_order_with_its_position(outbox):
    app = Celery("effects-test", set_as_current=False)

    @app.task(name="shop.notify")
    def notify(order_id):
        return order_id

    first = effects.publish(notify, args=(7,), kwargs={"urgent": True}, queue="mail")
    second = effects.http("https://hooks.example/paid", json={"order": 7, "amount": 1.5})
    third = effects.email(subject="Paid", body="Thanks", to=["a@example.com", "b@example.com"])
    fourth = effects.call("tests.effects.seen", 7, reason="paid")

    assert outbox.declared == [first, second, third, fourth]
    assert first == Declared(
        "task",
        "shop.notify",
        {"args": [7], "kwargs": {"urgent": True}, "options": {"queue": "mail"}},
        0,
    )
    assert second == Declared(
        "http",
        "https://hooks.example/paid",
        {"method": "POST", "headers": {}, "timeout": None, "json": {"order": 7, "amount": 1.5}},
        1,
    )
    assert third == Declared(
        "email",
        "a@example.com, b@example.com",
        {
            "subject": "Paid",
            "body": "Thanks",
            "to": ["a@example.com", "b@example.com"],
            "from_email": None,
            "headers": {},
        },
        2,
    )
    assert fourth == Declared(
        "call", "tests.effects.seen", {"args": [7], "kwargs": {"reason": "paid"}}, 3
    )


def test_publish_takes_a_name_or_a_signature_whose_arguments_come_first(outbox):
    app = Celery("effects-test", set_as_current=False)

    @app.task(name="shop.ship")
    def ship(order_id, carrier=None):
        return order_id

    by_name = effects.publish("shop.ship", args=[1])
    by_sig = effects.publish(
        ship.s(2, carrier="ups").set(priority=3), args=(9,), kwargs={"x": 1}, countdown=5
    )
    assert (by_name.target, by_name.payload) == (
        "shop.ship",
        {"args": [1], "kwargs": {}, "options": {}},
    )
    assert by_sig.target == "shop.ship"
    assert by_sig.payload == {
        "args": [2, 9],
        "kwargs": {"carrier": "ups", "x": 1},
        "options": {"priority": 3, "countdown": 5},
    }
    assert [d.position for d in outbox.declared] == [0, 1]


def test_http_normalises_the_method_and_keeps_a_text_body(outbox):
    declared = effects.http(
        "http://127.0.0.1:8000/hook",
        method="put",
        data="paid",
        headers={"X-Shop": "1"},
        timeout=2,
    )
    assert declared.payload == {
        "method": "PUT",
        "headers": {"X-Shop": "1"},
        "timeout": 2.0,
        "data": "paid",
    }


@pytest.mark.parametrize(
    "declare,argument",
    [
        (lambda: effects.publish("shop.notify", args=[object()]), "args"),
        (lambda: effects.publish("shop.notify", args="abc"), "args"),
        (lambda: effects.publish("shop.notify", kwargs={1: "x"}), "kwargs"),
        (lambda: effects.publish("shop.notify", kwargs={"x": math.nan}), "kwargs"),
        (lambda: effects.publish("shop.notify", task_id="mine"), "task_id"),
        (lambda: effects.publish("shop notify"), "task"),
        (lambda: effects.publish(42), "task"),
        (lambda: effects.publish("shop.notify", eta=object()), "options"),
        (lambda: effects.http("ftp://example.com/x"), "url"),
        (lambda: effects.http("https:///nohost"), "url"),
        (lambda: effects.http("https://example.com", method="BREW"), "method"),
        (lambda: effects.http("https://example.com", json={"a": 1}, data="x"), "data"),
        (lambda: effects.http("https://example.com", data=b"x"), "data"),
        (lambda: effects.http("https://example.com", json={1.5, 2}), "json"),
        (lambda: effects.http("https://example.com", timeout=0), "timeout"),
        (lambda: effects.http("https://example.com", timeout=math.inf), "timeout"),
        (lambda: effects.http("https://example.com", timeout=True), "timeout"),
        (lambda: effects.http("https://example.com", headers={"Idempotency-Key": "k"}), "headers"),
        (lambda: effects.http("https://example.com", headers={"X": "a\nb"}), "headers"),
        (lambda: effects.http("https://example.com", headers={"X Y": "a"}), "headers"),
        (lambda: effects.email(subject="a\nb", body="", to=["a@x.org"]), "subject"),
        (lambda: effects.email(subject="s", body=None, to=["a@x.org"]), "body"),
        (lambda: effects.email(subject="s", body="", to="a@x.org"), "to"),
        (lambda: effects.email(subject="s", body="", to=[]), "to"),
        (lambda: effects.email(subject="s", body="", to=["nobody"]), "to"),
        (lambda: effects.email(subject="s", body="", to=["a@x.org"], from_email=1), "from_email"),
        (
            lambda: effects.email(
                subject="s", body="", to=["a@x.org"], headers={"Message-ID": "m"}
            ),
            "headers",
        ),
        (lambda: effects.call("tests.effects.unknown"), "name"),
        (lambda: effects.call("tests.effects.seen", idempotency_key="k"), "kwargs"),
        (lambda: effects.call("tests.effects.seen", object()), "args"),
    ],
)
def test_an_invalid_argument_is_refused_by_name_and_nothing_is_recorded(outbox, declare, argument):
    with pytest.raises(InvalidEffect) as raised:
        declare()
    assert raised.value.argument == argument
    assert isinstance(raised.value, (StepLockError, ValueError))
    assert outbox.declared == []


def test_register_refuses_a_second_callable_under_one_name():
    def other(*, idempotency_key):
        return None

    assert effects.register("tests.effects.seen")(_seen) is _seen  # the same one: fine
    with pytest.raises(InvalidEffect) as raised:
        effects.register("tests.effects.seen")(other)
    assert raised.value.argument == "name"
    assert effects.registered("tests.effects.seen") is _seen
    with pytest.raises(InvalidEffect):
        effects.register("")


def test_the_key_names_the_step_the_fence_the_status_and_the_position():
    assert effect_key("shop.order:42", 1718000000123456, "shipped", 0) == (
        "shop.order:42:1718000000123456:shipped:0"
    )
    assert (
        effect_key("shop.order:42", "tabc-123", "shipped", 3) == "shop.order:42:tabc-123:shipped:3"
    )
    with pytest.raises(InvalidEffect) as raised:
        effect_key("shop.order:" + "x" * 300, 1, "done", 0)
    assert raised.value.argument == "step"


@pytest.mark.parametrize(
    "declare",
    [
        lambda: effects.publish("shop.notify"),
        lambda: effects.http("https://example.com"),
        lambda: effects.email(subject="s", body="b", to=["a@x.org"]),
        lambda: effects.call("tests.effects.seen"),
    ],
)
def test_outside_a_step_transaction_declaring_is_unavailable(declare):
    assert effects.current_outbox() is None
    with pytest.raises(EffectsUnavailable) as raised:
        declare()
    assert isinstance(raised.value, ImproperlyConfigured)
    assert "inside a step-locked task body with a step_model, or a guarded_step block" in str(
        raised.value
    )


def test_collecting_none_hides_an_outer_outbox_and_restores_it():
    outer = Outbox()
    with collecting(outer):
        with collecting(None):
            with pytest.raises(EffectsUnavailable):
                effects.publish("shop.notify")
        effects.publish("shop.notify")
    assert [d.target for d in outer.declared] == ["shop.notify"]
    assert effects.current_outbox() is None


def test_a_sealed_or_unavailable_outbox_refuses_new_effects():
    box = Outbox()
    with collecting(box):
        effects.publish("shop.notify")
        assert box.seal() == box.declared
        with pytest.raises(EffectsUnavailable, match="already written"):
            effects.publish("shop.notify")
    with collecting(Outbox(unavailable="the step store X has no write_effects")):
        with pytest.raises(EffectsUnavailable, match="no write_effects"):
            effects.publish("shop.notify")


class _Store:
    """The smallest store write_declared talks to: it records what it is given."""

    def __init__(self):
        self.written: list[tuple] = []
        self.callbacks: list = []
        self.dispatched: list[list[int]] = []

    def step_ref(self, step_id):
        return f"shop.order:{step_id}"

    def write_effects(self, declared, **fields):
        self.written.append((list(declared), fields))
        return [100 + d.position for d in declared]

    def dispatch_effects(self, ids):
        self.dispatched.append(ids)

    def on_commit(self, func):
        self.callbacks.append(func)


def test_write_declared_passes_the_key_base_and_dispatches_on_commit():
    store, box = _Store(), Outbox()
    with collecting(box):
        effects.publish("shop.notify", args=[1])
        effects.publish("shop.notify", args=[2])
    ids = effects.write_declared(
        box,
        store,
        step_id=42,
        to="shipped",
        fence=77,
        tag="tid-1",
        owner="own",
        task_id="tid-1",
        task_name="shop.ship",
    )
    assert ids == [100, 101]
    ((declared, fields),) = store.written
    assert [d.position for d in declared] == [0, 1]
    assert fields == {
        "step": "shop.order:42",
        "fence": 77,
        "key_base": "shop.order:42:77:shipped",
        "owner": "own",
        "task_id": "tid-1",
        "task_name": "shop.ship",
    }
    assert store.dispatched == []  # not before COMMIT
    (callback,) = store.callbacks
    callback()
    assert store.dispatched == [[100, 101]]
    assert box.sealed


def test_write_declared_without_a_lease_keys_by_the_tag_and_without_effects_writes_nothing():
    store = _Store()
    box = Outbox()
    with collecting(box):
        effects.publish("shop.notify")
    effects.write_declared(
        box,
        store,
        step_id=1,
        to="done",
        fence=None,
        tag="tabc",
        owner="o",
        task_id="abc",
        task_name="t",
    )
    assert store.written[0][1]["key_base"] == "shop.order:1:tabc:done"
    assert store.written[0][1]["fence"] is None

    empty = _Store()
    assert (
        effects.write_declared(
            Outbox(),
            empty,
            step_id=1,
            to=None,
            fence=1,
            tag="",
            owner="o",
            task_id=None,
            task_name="t",
        )
        == []
    )
    assert empty.written == [] and empty.callbacks == []


def test_effects_without_an_applied_transition_are_unavailable():
    box = Outbox()
    with collecting(box):
        effects.publish("shop.notify")
    store = _Store()
    with pytest.raises(EffectsUnavailable, match="no transition applied"):
        effects.write_declared(
            box,
            store,
            step_id=None,
            to=None,
            fence=1,
            tag="",
            owner="o",
            task_id=None,
            task_name="t",
        )
    assert store.written == []
