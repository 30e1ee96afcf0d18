"""Lock names from task signatures (celery_steplock.keys)."""
import datetime
import decimal
import uuid

import pytest
from celery import Celery

from celery_steplock.exceptions import LockNameError
from celery_steplock.keys import (bind_arguments, canonical_json, fence_key, lease_key,
                                  lock_name, name_from_key)

app = Celery("keys-tests", set_as_current=False)


@app.task(bind=True, name="t.bound")
def bound(self, x, y=2, *, z="zz"):
    return x


@app.task(name="t.unbound")
def unbound(x, y=2):
    return x


def name(task, *args, lock_key=None, **kwargs):
    return lock_name(task.name, task.run, args, kwargs, lock_key)


def test_equivalent_calls_give_one_name():
    names = {
        name(bound, 1),
        name(bound, x=1),
        name(bound, 1, 2),
        name(bound, 1, y=2),
        name(bound, y=2, x=1),
        name(bound, 1, z="zz"),
        name(bound, z="zz", y=2, x=1),
    }
    assert len(names) == 1
    (only,) = names
    assert only.startswith("t.bound:") and len(only) == len("t.bound:") + 64


def test_different_arguments_give_different_names():
    assert name(bound, 1) != name(bound, 2)
    assert name(bound, 1) != name(bound, 1, y=3)
    assert name(unbound, 1) != name(bound, 1)


def test_bound_self_never_enters_the_name():
    arguments = bind_arguments(bound.run, (1,), {})
    assert arguments == {"x": 1, "y": 2, "z": "zz"}
    assert "self" not in canonical_json(arguments)


def test_unbound_task_binds_all_parameters():
    assert bind_arguments(unbound.run, (5,), {}) == {"x": 5, "y": 2}


def test_rich_types_are_encoded_deterministically():
    when = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    first = name(unbound, ident, y=[when, decimal.Decimal("1.50"), b"\x00\xff",
                                    datetime.date(2026, 1, 2)])
    again = name(unbound, x=uuid.UUID(str(ident)),
                 y=[when, decimal.Decimal("1.50"), b"\x00\xff", datetime.date(2026, 1, 2)])
    assert first == again
    assert first != name(unbound, ident, y=[when, decimal.Decimal("1.51"), b"\x00\xff",
                                            datetime.date(2026, 1, 2)])
    assert '"__type__":"uuid"' in canonical_json({"u": ident})


def test_kwargs_order_inside_dict_arguments_does_not_matter():
    assert name(unbound, {"a": 1, "b": 2}) == name(unbound, {"b": 2, "a": 1})


def test_unserialisable_argument_is_named():
    with pytest.raises(LockNameError) as info:
        name(unbound, 1, y=object())
    assert info.value.argument == "y"
    assert "'y'" in str(info.value) and "object" in str(info.value)
    assert isinstance(info.value, TypeError)


def test_signature_mismatch_is_a_lock_name_error():
    with pytest.raises(LockNameError, match="bind"):
        name(unbound, 1, 2, 3)


def test_template_lock_key():
    assert name(bound, 7, lock_key="order:{x}") == "order:7"
    assert name(bound, x=7, y=9, lock_key="order:{x}:{y}:{z}") == "order:7:9:zz"


def test_template_naming_an_unknown_argument_is_rejected():
    with pytest.raises(LockNameError) as info:
        name(bound, 7, lock_key="order:{order_id}")
    assert "order_id" in str(info.value) and "x, y, z" in str(info.value)
    assert info.value.argument == "order_id"


def test_callable_lock_key_receives_bound_arguments():
    seen = {}

    def key(**arguments):
        seen.update(arguments)
        return f"k:{arguments['x'] * 2}"

    assert name(bound, 4, lock_key=key) == "k:8"
    assert seen == {"x": 4, "y": 2, "z": "zz"}


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "x" * 513])
def test_invalid_names_are_rejected(bad):
    with pytest.raises(LockNameError):
        name(bound, bad, lock_key="{x}")


def test_keys_share_a_cluster_hash_tag():
    assert lease_key("steplock", "order:42") == "steplock:lease:{order:42}"
    assert fence_key("steplock", "order:42") == "steplock:fence:{order:42}"
    assert name_from_key(b"steplock:lease:{order:42}") == "order:42"
    with pytest.raises(LockNameError):
        name_from_key("no-tag")


def test_var_keyword_names_join_the_declared_ones():
    @app.task(name="t.varkw")
    def varkw(a, **extra):
        return a

    assert bind_arguments(varkw.run, (1,), {"order_id": 9}) == {"a": 1, "order_id": 9}
    assert name(varkw, 1, order_id=9, lock_key="order:{order_id}") == "order:9"
    assert name(varkw, 1, b=2, c=3) == name(varkw, c=3, a=1, b=2)


def test_bad_template_and_odd_values_raise_lock_name_errors():
    with pytest.raises(LockNameError, match="format template"):
        name(bound, 1, lock_key="order:{x")
    with pytest.raises(LockNameError, match="printable"):
        name(bound, "a\nb", lock_key="{x}")
    surrogate = name(unbound, "\ud800")  # a lone surrogate still hashes
    assert surrogate.startswith("t.unbound:")
    with pytest.raises(LockNameError) as info:
        name(unbound, {1: "a", "b": 2})
    assert info.value.argument == "x" and "'<' not supported" in str(info.value)
