"""Lock names from task signatures (celery_steplock.keys)."""

import datetime
import re
import decimal
import uuid

import pytest
from celery import Celery

from celery_steplock.exceptions import LockNameError
from celery_steplock import keys
from celery_steplock.keys import (
    bind_arguments,
    canonical_json,
    fence_key,
    lease_key,
    lock_name,
    name_from_key,
)

# Key formats: the database holds at most a row to name (db_incidental).
pytestmark = pytest.mark.db_incidental

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
    first = name(
        unbound, ident, y=[when, decimal.Decimal("1.50"), b"\x00\xff", datetime.date(2026, 1, 2)]
    )
    again = name(
        unbound,
        x=uuid.UUID(str(ident)),
        y=[when, decimal.Decimal("1.50"), b"\x00\xff", datetime.date(2026, 1, 2)],
    )
    assert first == again
    assert first != name(
        unbound, ident, y=[when, decimal.Decimal("1.51"), b"\x00\xff", datetime.date(2026, 1, 2)]
    )
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


# -- issue 12, finding 1: names that reveal no arguments ----------------------------------------

SECRET = b"n" * 32


def test_default_name_is_an_hmac_of_the_task_and_arguments_keyed_with_the_secret():
    import hashlib
    import hmac

    canonical = canonical_json(bind_arguments(bound.run, (1,), {}))
    expected = hmac.new(
        SECRET, b"lock-name\0t.bound\0" + canonical.encode(), hashlib.sha256
    ).hexdigest()
    assert lock_name("t.bound", bound.run, (1,), {}, secret=SECRET) == f"t.bound:{expected}"
    # ... not the unsalted SHA-256 of the landed code, which anyone could recompute
    assert expected != hashlib.sha256(canonical.encode()).hexdigest()
    assert lock_name("t.bound", bound.run, (1,), {}, secret=b"m" * 32) != f"t.bound:{expected}"
    # the task's name is in the message: the same arguments of two tasks do not correlate
    other = lock_name("t.other", bound.run, (1,), {}, secret=SECRET)
    assert other.split(":", 1)[1] != expected


def test_default_name_without_a_secret_uses_the_public_key():
    import hashlib
    import hmac

    from celery_steplock.keys import PUBLIC_NAME_KEY

    canonical = canonical_json({"x": 1, "y": 2, "z": "zz"})
    assert (
        name(bound, 1)
        == "t.bound:"
        + hmac.new(
            PUBLIC_NAME_KEY, b"lock-name\0t.bound\0" + canonical.encode(), hashlib.sha256
        ).hexdigest()
    )


# -- issue 12, finding 6: bounds and types of what enters a name ---------------------------------


def test_a_huge_argument_gives_a_bounded_lock_name_error():
    huge = "9" * (10 * 1024 * 1024)
    with pytest.raises(LockNameError) as info:
        name(bound, huge, lock_key="order:{x}")
    assert len(str(info.value)) < 400
    assert "at most 512 characters" in str(info.value) and str(len("order:") + len(huge)) in str(
        info.value
    )
    with pytest.raises(LockNameError) as info:
        name(bound, 1, lock_key=lambda **kw: "\n" * (10 * 1024 * 1024))
    assert len(str(info.value)) < 400


def test_an_unencodable_huge_argument_gives_a_bounded_message():
    class Opaque:
        def __repr__(self):
            return "r" * (10 * 1024 * 1024)

    with pytest.raises(LockNameError) as info:
        name(bound, Opaque())
    assert info.value.argument == "x" and len(str(info.value)) <= 2100


@pytest.mark.parametrize("depth", [1000, 10000])
def test_deep_nesting_is_a_lock_name_error_not_a_recursion_error(depth):
    nested = []
    for _ in range(depth):
        nested = [nested]
    with pytest.raises(LockNameError) as info:
        name(bound, nested)
    assert info.value.argument == "x" and "nested too deep" in str(info.value)
    with pytest.raises(LockNameError, match="nested too deep"):
        name(bound, nested, lock_key="n:{x}")


@pytest.mark.parametrize(
    "template", ["n:{x.__class__}", "n:{x[0]}", "n:{x.real}", "n:{}", "n:{0}", "n:{y:{x.imag}}"]
)
def test_templates_refuse_attribute_index_and_positional_fields(template):
    with pytest.raises(LockNameError) as info:
        name(bound, 5, lock_key=template)
    assert "no attribute or index access" in str(info.value) or "positional" in str(info.value)


def test_a_template_may_use_a_whole_numbers_format_spec_but_no_conversion():
    assert name(bound, 5, lock_key="n:{x:04d}") == "n:0005"
    # !r would write 1 and "1" as two names of one value (and !s is the plain field).
    for template in ("n:{x!r}", "n:{x!s}", "n:{x!a}"):
        with pytest.raises(LockNameError, match="conversion is not allowed"):
            name(bound, "a", lock_key=template)


def test_the_documented_rule_for_1_1_0_true_and_the_string_1():
    # Default names keep JSON's types: four values, four locks.
    defaults = {name(bound, value) for value in (1, 1.0, True, "1")}
    assert len(defaults) == 4
    # A template formats the values: "1", 1 and 1.0 name one lock; a bool names none.
    assert [name(bound, value, lock_key="n:{x}") for value in (1, "1", 1.0)] == [
        "n:1",
        "n:1",
        "n:1",
    ]
    with pytest.raises(LockNameError):
        name(bound, True, lock_key="n:{x}")


# -- the same against a real task, Redis and database ---------------------------------------------


def _card_task():
    from celery_steplock.task import StepLockedTask
    from django_app.celery import app as celery_app

    if "tests.keys.card" in celery_app.tasks:
        return celery_app.tasks["tests.keys.card"], celery_app.tasks["tests.keys.card_by_number"]

    @celery_app.task(bind=True, base=StepLockedTask, name="tests.keys.card")
    def card(self, number, cvv):
        store = self.steplock_plan.store
        SEEN_LEASES.append(
            {
                "name": self.lease.name,
                "key": self.lease.idempotency_key,
                "listed": [lease["name"] for lease in store.iter_leases()],
            }
        )
        return "charged"

    @celery_app.task(
        bind=True, base=StepLockedTask, name="tests.keys.card_by_number", lock_key="card:{number}"
    )
    def card_by_number(self, number, cvv):
        SEEN_LEASES.append({"name": self.lease.name, "key": self.lease.idempotency_key})
        return "charged"

    return card, card_by_number


SEEN_LEASES = []
CARD = "4111111111111111"


@pytest.mark.django_db(transaction=True)
def test_a_task_lock_name_resists_brute_force_of_a_low_entropy_argument(app, redis_client):
    import hashlib
    import hmac

    from helpers import set_settings

    card, _ = _card_task()
    set_settings(app, steplock_name_secret="s" * 32)
    SEEN_LEASES.clear()
    assert card.apply(args=(CARD, "123")).get() == "charged"
    [seen] = SEEN_LEASES
    assert seen["listed"] == [seen["name"]]  # the name as the admin, ls and logs show it
    digest = seen["name"].split(":", 1)[1]

    def arguments(cvv):
        return canonical_json({"number": CARD, "cvv": cvv}).encode()

    candidates = [f"{n:03d}" for n in range(1000)]
    # What a viewer of names could try on the landed code: the unsalted SHA-256.
    assert [c for c in candidates if hashlib.sha256(arguments(c)).hexdigest() == digest] == []
    # Without the secret a guess of it finds nothing either; with it, exactly the CVV.
    for key, found in ((b"guess" * 8, []), (b"s" * 32, ["123"])):
        assert [
            c
            for c in candidates
            if hmac.new(
                key, b"lock-name\0tests.keys.card\0" + arguments(c), hashlib.sha256
            ).hexdigest()
            == digest
        ] == found
    assert re.fullmatch(r"[0-9a-f]{64}", seen["key"]) and CARD not in seen["key"]


@pytest.mark.django_db(transaction=True)
def test_a_templated_name_shows_its_values_but_the_idempotency_key_does_not(app, redis_client):
    from helpers import set_settings

    _, card_by_number = _card_task()
    set_settings(app, steplock_name_secret="s" * 32)
    SEEN_LEASES.clear()
    assert card_by_number.apply(args=(CARD, "123")).get() == "charged"
    [seen] = SEEN_LEASES
    assert seen["name"] == f"card:{CARD}"  # documented: a template exposes the raw value
    assert CARD not in seen["key"] and "card" not in seen["key"]
    assert re.fullmatch(r"[0-9a-f]{64}", seen["key"])


@pytest.mark.django_db(transaction=True)
def test_rotating_the_secret_gives_a_running_lease_and_a_new_delivery_different_names(
    app, redis_client
):
    from helpers import set_settings

    from celery_steplock.keys import name_from_arguments

    card, _ = _card_task()
    set_settings(app, steplock_name_secret="a" * 32)
    store = card.steplock_plan.store
    old_name = name_from_arguments(
        card.name, {"number": CARD, "cvv": "1"}, secret=store.name_secret
    )
    running = store.acquire(old_name, ttl=30.0)  # a delivery running under the old secret
    assert running is not None
    set_settings(app, steplock_name_secret="b" * 32)
    SEEN_LEASES.clear()
    assert card.apply(args=(CARD, "1")).get() == "charged"  # not contended: another name
    [seen] = SEEN_LEASES
    assert seen["name"] != old_name
    assert sorted(seen["listed"]) == sorted([old_name, seen["name"]])


@pytest.mark.django_db(transaction=True)
def test_a_huge_argument_of_a_task_gives_a_bounded_stored_result(app, redis_client):
    _, card_by_number = _card_task()
    # a newline too: the name is refused as unprintable, an error that quoted it whole
    result = card_by_number.apply(args=("9" * (10 * 1024 * 1024) + "\n", "1"))
    assert result.failed() and isinstance(result.result, LockNameError)
    assert len(str(result.result)) < 400
    assert len(result.traceback) < 10_000
    assert redis_client.dbsize() == 0  # refused before any lease was taken


# -- hostile review, finding 7: a typed error never chains a caller-controlled huge cause ------


def test_a_huge_keyword_name_gives_a_bounded_error_without_its_cause():
    import traceback

    from celery_steplock.keys import bind_arguments, canonical_json

    def run(a):
        return a

    with pytest.raises(LockNameError) as caught:
        bind_arguments(run, (), {"k" * 1_000_000: 1})
    error = caught.value
    assert error.__cause__ is None and error.__suppress_context__
    assert "cannot bind the task's arguments to its signature" in str(error)
    assert len("".join(traceback.format_exception(error))) < 5000
    with pytest.raises(LockNameError) as caught:
        canonical_json({"x": {"k" * 1_000_000: 1j}})
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert caught.value.argument == "x"
    assert len("".join(traceback.format_exception(caught.value))) < 5000


# -- issue 23: every Redis key layout in keys.py, pinned to the strings deployments hold ----------


def test_every_key_layout_is_pinned_to_todays_string():
    from celery_steplock import keys

    assert keys.lease_key("steplock", "order:42") == "steplock:lease:{order:42}"
    assert keys.fence_key("steplock", "order:42") == "steplock:fence:{order:42}"
    assert keys.waiters_key("steplock", "order:42") == "steplock:waiters:{order:42}"
    assert keys.wake_key("steplock", "order:42") == "steplock:wake:{order:42}"
    assert keys.lease_keys("p", ["a", "b:1"]) == ["p:lease:{a}", "p:lease:{b:1}"]
    assert keys.released_channel("steplock", "order:42") == "steplock:released:{order:42}"
    assert keys.breaker_key("steplock", "payments") == "steplock:breaker:{payments}"
    assert keys.breaker_probes_key("steplock", "payments") == "steplock:breaker-probes:{payments}"
    assert keys.breaker_keys("steplock", "payments") == [
        "steplock:breaker:{payments}",
        "steplock:breaker-probes:{payments}",
    ]
    assert keys.slot_name("tenant:42", 7) == "tenant:42}#7"
    assert keys.slot_key("steplock", "tenant:42", 7) == "steplock:lease:{tenant:42}#7}"
    assert keys.concurrency_keys("steplock", "tenant:42") == (
        "steplock:bulkhead:{tenant:42}:fence",
        "steplock:bulkhead:{tenant:42}:queue",
        "steplock:bulkhead:{tenant:42}:alive",
    )
    assert keys.rate_limit_keys("steplock", "sw", "5:10.0", "t.a") == (
        "steplock:rate:sw:5:10.0:{t.a}",
        "steplock:rate:sw:5:10.0:queue:{t.a}",
        "steplock:rate:sw:5:10.0:due:{t.a}",
    )
    assert keys.idempotency_record_key("steplock", "ab12") == "steplock:idem:{ab12}"


def test_the_inverses_of_the_layouts():
    from celery_steplock import keys

    assert keys.name_from_key("steplock:lease:{tenant:42}#7}") == "tenant:42}#7"
    assert keys.parse_slot_name(keys.slot_name("tenant:42", 7)) == ("tenant:42", 7)
    assert keys.parse_slot_name("tenant:42") is None and keys.parse_slot_name("a}#x") is None
    assert keys.breaker_name_from_key("p", keys.breaker_key("p", "pay")) == "pay"
    assert keys.breaker_name_from_key("p", "p:breaker-probes:{pay}") is None
    assert keys.breaker_name_from_key("p", "q:breaker:{pay}") is None


def test_the_patterns_build_their_keys_with_todays_layouts(redis_client):
    """The keys each pattern and the lease store hand Redis, byte for byte as before issue 23
    (what a running deployment holds must stay readable)."""
    import warnings

    from celery_steplock.lock import RedisLeaseStore
    from celery_steplock.patterns.breaker import CircuitBreaker
    from celery_steplock.patterns.concurrency import ConcurrencyLimit
    from celery_steplock.patterns.idempotency import RedisRecords
    from celery_steplock.patterns.ratelimit import SlidingWindow, TokenBucket

    breaker = CircuitBreaker("payments", client=redis_client)
    assert breaker.key == "steplock:breaker:{payments}"
    assert breaker._keys("steplock") == [
        "steplock:breaker:{payments}",
        "steplock:breaker-probes:{payments}",
    ]
    assert ConcurrencyLimit.redis_keys("steplock", "tenant:42", 2) == [
        "steplock:lease:{tenant:42}#0}",
        "steplock:lease:{tenant:42}#1}",
        "steplock:bulkhead:{tenant:42}:fence",
        "steplock:bulkhead:{tenant:42}:queue",
        "steplock:bulkhead:{tenant:42}:alive",
    ]
    assert SlidingWindow(5, 10).redis_key("steplock", "t.a") == (
        "steplock:rate:sw:5:10.0:{t.a}",
        "steplock:rate:sw:5:10.0:queue:{t.a}",
        "steplock:rate:sw:5:10.0:due:{t.a}",
    )
    assert SlidingWindow(5, 1.5).redis_key("s", "n")[0] == "s:rate:sw:5:1.5:{n}"
    assert TokenBucket(0.5, capacity=3).redis_key("steplock", "t.a") == (
        "steplock:rate:tb:0.5:3:{t.a}",
        "steplock:rate:tb:0.5:3:queue:{t.a}",
        "steplock:rate:tb:0.5:3:due:{t.a}",
    )
    assert (
        TokenBucket(1 / 3, capacity=3).redis_key("s", "n")[0]
        == "s:rate:tb:0.3333333333333333:3:{n}"
    )
    assert RedisRecords(redis_client, "steplock").redis_key("abc") == "steplock:idem:{abc}"
    store = RedisLeaseStore(redis_client, prefix="t")
    assert store.key("order:42") == "t:lease:{order:42}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert store.channel("order:42") == "t:released:{order:42}"
    # a renewal batch writes the same keys (seen in Redis: the hash it renews)
    lease = store.acquire("order:42", ttl=5.0)
    assert store.extend_many([("order:42", lease.owner, 9.0)]) == [True]
    assert 5000 < redis_client.pttl("t:lease:{order:42}") <= 9000
    assert sorted(redis_client.keys("t:*")) == [
        "t:fence:{order:42}",
        "t:history:{order:42}",  # the name's history (issue 30)
        "t:lease:{order:42}",
    ]


# -- issue 24: globs built from a prefix or a name match it literally -----------------------------


def test_glob_escape_makes_every_redis_glob_character_literal(redis_client):
    from celery_steplock.keys import glob_escape

    assert glob_escape("app*") == "app\\*"
    assert glob_escape("a?[b]\\c") == "a\\?\\[b\\]\\\\c"
    assert glob_escape("plain:prefix-1") == "plain:prefix-1"
    literals = ["app*", "a?p", "[ab]pp", "ap\\p", "x]y", "^!-"]
    neighbours = ["appserver", "a-p", "app", "bpp", "aXp", "ap\\\\p", "xy", "-"]
    for text in literals + neighbours:
        redis_client.set(f"{text}:k", "1")
    for text in literals:
        found = list(redis_client.scan_iter(match=f"{glob_escape(text)}:*", count=1000))
        assert found == [f"{text}:k"], (text, found)


def test_the_probes_reserved_name_is_refused_naming_it():
    from celery_steplock.keys import PROBE_NAME, check_name

    assert PROBE_NAME == "steplock-acl-probe"
    with pytest.raises(LockNameError) as caught:
        check_name(PROBE_NAME)
    assert PROBE_NAME in str(caught.value) and "reserved" in str(caught.value)
    assert check_name(f"{PROBE_NAME}-2") == f"{PROBE_NAME}-2"  # only the name itself
    with pytest.raises(LockNameError, match="reserved"):
        name(unbound, PROBE_NAME, lock_key="{x}")
    with pytest.raises(LockNameError, match="reserved"):
        name(unbound, "steplock-acl", lock_key=lambda x, y: f"{x}-probe")


# -- issue 24: a template's names are injective -------------------------------------------------


@app.task(name="t.three")
def three(x, y=None, z=None):
    return x


def test_template_values_cannot_forge_the_separator():
    def two(x, y, template="{x}:{y}"):
        return lock_name("t", three.run, (x, y), {}, template)

    assert two("acme:bob", "x") != two("acme", "bob:x")
    assert two("a\\", ":b") != two("a\\:", "b")
    # Every pair of short values over an alphabet of the separators and the escape gives
    # its own name, for a few templates.
    alphabet = ["", "a", ":", "\\", "-", "/", "7"]
    values = {a + b for a in alphabet for b in alphabet}
    for template in ("{x}:{y}", "t:{x}-{y}/", "{x}/x/{y}", "{x}::{y}"):
        names = {}
        for x in values:
            for y in values:
                name = two(x, y, template)
                assert names.setdefault(name, (x, y)) == (x, y), (template, name)
    three_names = {
        lock_name("t", three.run, (x, y, z), {}, "{x}:{y}-{z}")
        for x in ("a", "a:b", "a-b")
        for y in ("", ":", "-")
        for z in ("b", "-b", "b:")
    }
    assert len(three_names) == 27


def test_ordinary_values_keep_todays_names():
    def named(*args, template):
        return lock_name("t", three.run, args, {}, template)

    assert named("acme", "bob", template="{x}:{y}") == "acme:bob"
    assert named(7, 9, template="order:{x}:{y}") == "order:7:9"
    assert named("a.b", "c-d", template="{x}:{y}") == "a.b:c-d"
    # One field: nothing can be confused, the value is written as it is.
    assert named("order:42", template="{x}") == "order:42"
    assert named("a\\b:c", template="n:{x}") == "n:a\\b:c"
    # Two fields: ':' (what stands between them) and the escape are escaped.
    assert named("acme:bob", "x", template="{x}:{y}") == "acme\\:bob:x"
    assert named("a\\b", "x", template="{x}:{y}") == "a\\\\b:x"
    assert named("a-b:c", "x", template="{x}-{y}") == "a\\-b:c-x"


def test_numbers_are_canonical():
    def tenant(value):
        return lock_name("t", three.run, (value,), {}, "tenant:{x}")

    for value in (7, 7.0, decimal.Decimal("7"), decimal.Decimal("7.00"), decimal.Decimal("7E0")):
        assert tenant(value) == "tenant:7", value
    assert tenant(-0.0) == tenant(0) == "tenant:0"
    assert tenant(10**20) == tenant(1e20) == "tenant:100000000000000000000"
    # A string is a string: "07" is not 7 (normalise before the call to make it so).
    assert tenant("07") == "tenant:07" and tenant("7") == "tenant:7"


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        7.5,
        float("nan"),
        float("inf"),
        decimal.Decimal("7.5"),
        decimal.Decimal("NaN"),
        " 7",
        "7 ",
        "\u20037",
        "7\u00a0",
    ],
)
def test_values_that_could_escape_a_limit_are_refused_naming_the_argument(value):
    with pytest.raises(LockNameError) as info:
        lock_name("t", three.run, (value,), {}, "tenant:{x}")
    assert info.value.argument == "x" and "'x'" in str(info.value)


@pytest.mark.parametrize(
    "template",
    [
        "{x}{y}",
        "a{x}{y}b",
        "{x}\\{y}",
        "n:{x:>{y}}",
        "n:{x:*>5}",
        "n:{x:0>5}",
        "n:{x:.3}",
        "n:{x:.2f}",
        "n:{x:e}",
        "n:{x:9999d}",
    ],
)
def test_ambiguous_templates_are_refused(template):
    from celery_steplock.keys import template_fields

    with pytest.raises(LockNameError):
        template_fields(template)
    with pytest.raises(LockNameError):
        lock_name("t", three.run, (5, 6), {}, template)


def test_a_format_spec_applies_to_whole_numbers_only():
    def named(value, template):
        return lock_name("t", three.run, (value,), {}, template)

    assert named(5, "n:{x:04d}") == named(5.0, "n:{x:04d}") == "n:0005"
    assert named(5, "n:{x:>3}") == "n:  5"
    assert named(255, "n:{x:#x}") == "n:0xff"
    for value, template in (("ab", "n:{x:>5}"), ("ab", "n:{x:05}"), ("ab", "n:{x!r:>6}")):
        with pytest.raises(LockNameError) as info:
            named(value, template)
        assert info.value.argument == "x"


def test_the_patterns_options_refuse_an_ambiguous_template_naming_themselves():
    from celery_steplock.exceptions import ImproperlyConfigured
    from celery_steplock.patterns.concurrency import ConcurrencyLimit, check_key_template
    from celery_steplock.patterns.ratelimit import SlidingWindow

    with pytest.raises(ImproperlyConfigured) as info:
        check_key_template("{x}{y}")
    assert info.value.setting == "concurrency_limit_key"
    with pytest.raises(ImproperlyConfigured) as info:
        SlidingWindow(1, 1, key="{x}{y}")
    assert info.value.setting == "cluster_rate_limit"
    limit = ConcurrencyLimit(1, key="{x}:{y}")
    assert limit.render("", {"x": "acme:bob", "y": "x"}) != limit.render(
        "", {"x": "acme", "y": "bob:x"}
    )
    assert limit.render("", {"x": 7.0, "y": "b"}) == limit.render("", {"x": 7, "y": "b"})
    with pytest.raises(LockNameError) as info:
        limit.render("", {"x": True, "y": "b"})
    assert info.value.argument == "x"


def test_a_rate_limit_key_template_gives_one_limit_per_value_pair(app, redis_client):
    from celery_steplock import RateLimited, SlidingWindow
    from celery_steplock.task import StepLockedTask

    @app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.keys.rl",
        lock_key="tests.keys.rl:{n}",
        cluster_rate_limit=SlidingWindow(1, 60),
        cluster_rate_limit_key="{tenant}:{user}",
        lock_retry_max=0,
        shared=False,
    )
    def limited(self, tenant, user, n):
        return n

    try:
        assert limited.apply(args=("acme:bob", "x", 1)).get() == 1
        assert limited.apply(args=("acme", "bob:x", 2)).get() == 2  # another pair, its own limit
        assert limited.apply(args=(7, "u", 3)).get() == 3
        for tenant in (7.0, decimal.Decimal("7")):  # the same tenant 7: its limit is used up
            assert isinstance(limited.apply(args=(tenant, "u", 4)).result, RateLimited)
        refused = limited.apply(args=(" 7", "u", 5)).result
        assert isinstance(refused, LockNameError) and refused.argument == "tenant"
    finally:
        app.tasks.pop("tests.keys.rl", None)


def test_an_idempotency_key_template_never_confuses_two_value_pairs(redis_client):
    from celery_steplock.patterns.idempotency import idempotent

    calls = []

    @idempotent(key="{a}:{b}", client=redis_client)
    def pay(a, b):
        calls.append((a, b))
        return f"{a}|{b}"

    assert pay("acme:bob", "x") == "acme:bob|x"
    assert pay("acme", "bob:x") == "acme|bob:x"  # not a replay, not a key reused
    assert pay("acme:bob", "x") == "acme:bob|x"  # the replay of the first
    assert calls == [("acme:bob", "x"), ("acme", "bob:x")]


@pytest.mark.parametrize(
    "template, arguments, says",
    [
        ("order:{a!r}", {"a": "1"}, "conversion is not allowed"),
        ("order:{a!s}", {"a": 1}, "conversion is not allowed"),
        ("{a.x}", {"a": 1}, "only plain argument names"),
        ("{0}", {"a": 1}, "positional field"),
        ("{}", {"a": 1}, "positional field"),
        ("{a", {"a": 1}, "not a valid format template"),
        ("order:{b}", {"a": 1}, "not an argument"),
    ],
)
def test_render_template_refuses_what_a_task_option_refuses(template, arguments, says):
    """Called directly (docs/step-tasks.md names it), render_template raises LockNameError for
    every template the task options refuse at check time, never a bare KeyError."""
    with pytest.raises(LockNameError, match=says):
        keys.render_template(template, arguments)


def test_a_value_whose_format_raises_is_the_arguments_error():
    class Hostile:
        def __format__(self, spec):
            raise RuntimeError("no")

    with pytest.raises(LockNameError, match="cannot be formatted: RuntimeError") as caught:
        keys.render_template("order:{a}:{b}", {"a": Hostile(), "b": 1})
    assert caught.value.argument == "a"
    assert keys.render_template("n:{a}:{b}", {"a": decimal.Decimal("0E+1000"), "b": 1}) == "n:0:1"
