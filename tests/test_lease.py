"""The Lease value object (celery_steplock.lease), on a clock the test moves."""

import re
import threading

import pytest

from celery_steplock.exceptions import LockLost
from celery_steplock.lease import (
    CLOCK_DRIFT_FACTOR,
    Lease,
    drift,
    holder_metadata,
    new_owner_token,
)

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_lease(clock, ttl=10.0, **kwargs):
    sent = clock()
    return Lease(
        name="order:42",
        key="t:lease:{order:42}",
        owner="o" * 32,
        fence=17,
        ttl=ttl,
        acquired_at=sent,
        valid_until=sent + ttl - drift(ttl),
        clock=clock,
        **kwargs,
    )


def test_drift_is_a_share_of_the_ttl_plus_a_round_trip():
    assert CLOCK_DRIFT_FACTOR == 0.01
    assert drift(10.0) == pytest.approx(0.102)
    assert drift(1.0) == pytest.approx(0.012)


def test_valid_until_the_ttl_less_the_drift_then_lost_for_good():
    clock = Clock()
    lease = make_lease(clock)
    clock.now += 10.0 - 0.102 - 0.001
    assert not lease.lost and lease.remaining() == pytest.approx(0.001)
    clock.now += 0.001
    assert lease.lost and lease.remaining() == 0.0
    assert lease.lost_reason == "local validity ran out without a successful renewal"
    lease.renewed(clock.now)  # a renewal that arrives too late changes nothing
    assert lease.lost


def test_a_renewal_moves_the_deadline_from_when_it_was_sent():
    clock = Clock()
    lease = make_lease(clock)
    clock.now += 5.0
    sent = clock.now
    clock.now += 0.5  # the round trip
    lease.renewed(sent)
    assert lease.valid_until == pytest.approx(sent + 10.0 - 0.102)
    assert lease.remaining() == pytest.approx(10.0 - 0.102 - 0.5)
    lease.renewed(sent, ttl=2.0)
    assert lease.ttl == 2.0 and lease.valid_until == pytest.approx(sent + 2.0 - 0.022)


def test_max_hold_wins_over_a_fresh_renewal():
    clock = Clock()
    lease = make_lease(clock, max_hold_until=clock() + 3.0)
    clock.now += 2.0
    lease.renewed(clock.now)
    assert not lease.lost
    clock.now += 1.0
    assert lease.lost and lease.lost_reason == "max hold reached: renewal stopped"


def test_mark_lost_keeps_the_first_reason():
    lease = make_lease(Clock())
    assert lease.mark_lost("stolen") is True
    assert lease.mark_lost("expired") is False
    assert lease.lost and lease.lost_reason == "stolen" and lease.remaining() == 0.0


def test_check_raises_lock_lost_with_name_owner_fence():
    clock = Clock()
    lease = make_lease(clock)
    lease.check()  # still valid: no exception, and still not lost
    assert not lease.lost
    lease.mark_lost("renewal found the key gone or held by another owner")
    with pytest.raises(LockLost, match="renewal found the key gone") as info:
        lease.check()
    err = info.value
    assert (err.name, err.key, err.owner, err.fence) == (
        "order:42",
        "t:lease:{order:42}",
        "o" * 32,
        17,
    )


def test_lost_is_visible_to_another_thread_at_once():
    lease = make_lease(Clock())
    seen = []
    thread = threading.Thread(target=lambda: (lease._lost.wait(5), seen.append(lease.lost)))
    thread.start()
    lease.mark_lost("stolen")
    thread.join(5)
    assert seen == [True]


def test_idempotency_key_is_keyed_and_reveals_neither_the_task_nor_the_lock():
    import hashlib
    import hmac

    from celery_steplock.exceptions import ImproperlyConfigured

    clock = Clock()
    secret = b"s" * 32
    key = make_lease(clock, task_name="shop.charge", secret=secret).idempotency_key
    assert (
        key
        == hmac.new(secret, b"idempotency-key\0shop.charge\0order:42", hashlib.sha256).hexdigest()
    )
    assert re.fullmatch(r"[0-9a-f]{64}", key) and "42" not in key
    assert make_lease(clock, task_name="shop.charge", secret=secret).idempotency_key == key
    assert make_lease(clock, secret=secret).idempotency_key != key
    assert make_lease(clock, task_name="shop.charge", secret=b"t" * 32).idempotency_key != key
    with pytest.raises(ImproperlyConfigured) as info:
        make_lease(clock).idempotency_key
    assert info.value.setting == "steplock_name_secret"


def test_owner_tokens_are_32_hex_digits_and_unique():
    tokens = {new_owner_token() for _ in range(1000)}
    assert len(tokens) == 1000 and all(re.fullmatch(r"[0-9a-f]{32}", t) for t in tokens)


def test_holder_metadata_drops_none_and_names_this_process():
    import os
    import socket

    meta = holder_metadata("tid", None, 0, worker="celery@w1", step=None, renew_ms=3333)
    assert meta == {
        "task_id": "tid",
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "retries": 0,
        "worker": "celery@w1",
        "renew_ms": 3333,
    }


def test_old_import_paths_still_work():
    from celery_steplock import lock

    assert lock.Lease is Lease and lock.new_owner_token is new_owner_token
    assert lock.holder_metadata is holder_metadata
    assert lock.CLOCK_DRIFT_FACTOR == CLOCK_DRIFT_FACTOR
    assert lock.RedisLeaseStore is lock.RedisLeaseStore


# -- one tolerant reader of a lease hash; reserved fields (issue 12, finding 5) --------------

from celery_steplock.exceptions import MetadataError, StepLockError  # noqa: E402
from celery_steplock.lease import RESERVED_FIELDS, parse_lease  # noqa: E402


def binary_client(redis_client):
    """A client that writes raw bytes (no decoding), on the same Redis."""
    import redis

    kwargs = redis_client.connection_pool.connection_kwargs
    return redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))


def test_malformed_fields_are_left_out_and_described_by_every_reader(lock, redis_client):
    good = lock.acquire("good", ttl=60.0, metadata={"task_name": "shop.charge", "pid": 42})
    lock.acquire("bad", ttl=60.0, metadata={"task_name": "shop.charge", "pid": "9" * 30})
    redis_client.hset(lock.key("bad"), mapping={"acquired_ms": "12abc", "fence": "-5"})
    raw = binary_client(redis_client)
    raw.hset(
        lock.key("bytes"),
        mapping={
            "owner": b"o\xff",
            "fence": b"7",
            "meta": b'{"worker": "w\xfe@box", "retries": 2}',
        },
    )
    raw.hset(lock.key("meta"), mapping={"owner": "x", "meta": b"[1, 2]"})
    raw.close()
    by_scan = {lease["name"]: lease for lease in lock.scan(0, 1000)[1]}
    assert sorted(by_scan) == ["bad", "bytes", "good", "meta"]
    for name in ("good", "bad", "bytes", "meta"):
        inspected = lock.inspect(name)
        assert inspected == {**by_scan[name], "ttl": inspected["ttl"]}
    assert "malformed" not in by_scan["good"] and by_scan["good"]["pid"] == "42"
    assert by_scan["good"]["fence"] == str(good.fence)
    bad = by_scan["bad"]
    assert bad["malformed"] == (
        "acquired_ms: not an integer ('12abc'); fence: out of "
        "range ('-5'); pid: out of range ('" + "9" * 30 + "')"
    )
    assert not {"fence", "acquired_ms", "pid"} & set(bad) and bad["task_name"] == "shop.charge"
    assert by_scan["bytes"]["owner"] == "o\ufffd" and by_scan["bytes"]["retries"] == "2"
    assert by_scan["bytes"]["malformed"] == "owner: not UTF-8; worker: not UTF-8"
    assert by_scan["meta"]["malformed"] == "meta: not a JSON object ('[1, 2]')"
    assert all(
        isinstance(v, str) for lease in by_scan.values() for k, v in lease.items() if k != "ttl"
    )


def test_parse_lease_never_raises_and_meta_cannot_shadow_the_hash():
    assert parse_lease(
        {"owner": "a", "fence": "3", "meta": '{"owner": "b", "fence": "9", "step": "x:1"}'}
    ) == {
        "owner": "a",
        "fence": "3",
        "step": "x:1",
        "malformed": "meta: reserved key 'fence'; meta: reserved key 'owner'",
    }
    # a hash without an owner cannot borrow one from its metadata
    assert parse_lease({"meta": '{"owner": "b"}'})["malformed"] == (
        "meta: reserved key 'owner'; owner: missing"
    )
    assert "owner" not in parse_lease({"meta": '{"owner": "b"}'})
    assert parse_lease(None) == {"malformed": "hash: unreadable"}
    assert parse_lease({}) == {}  # no key: nothing held (callers test it for truth)
    assert parse_lease({"owner": "a", "meta": "{not json"})["malformed"].startswith(
        "meta: not a JSON object"
    )
    long = "x" * 10_000
    assert len(parse_lease({"owner": "a", "pid": long})["malformed"]) < 100


@pytest.mark.parametrize("key", sorted(RESERVED_FIELDS))
def test_metadata_cannot_use_a_reserved_field(lock, key):
    with pytest.raises(MetadataError) as caught:
        lock.acquire("order:1", ttl=30.0, metadata={"task_id": "t", key: "forged"})
    assert caught.value.keys == (key,) and isinstance(caught.value, StepLockError)
    assert isinstance(caught.value, ValueError) and key in str(caught.value)
    assert lock.inspect("order:1") is None  # refused before anything was written
    with pytest.raises(MetadataError):
        holder_metadata("t", "shop.charge", 0, **{key: "forged"})


def test_the_holder_still_releases_after_an_overwrite_attempt(lock):
    lease = lock.acquire("order:1", ttl=30.0, metadata={"task_name": "shop.charge"})
    for forged in (
        {"owner": "evil"},
        {"fence": "1"},
        {"acquired_ms": "0", "x": "1"},
        {1: "not a string key"},
    ):
        with pytest.raises(MetadataError):
            lock.acquire("order:1", owner=lease.owner, ttl=30.0, metadata=forged)
        with pytest.raises(MetadataError):
            lock.acquire("order:1", owner="another", ttl=30.0, metadata=forged)
    held = lock.inspect("order:1")
    assert held["owner"] == lease.owner and held["fence"] == str(lease.fence)
    assert "malformed" not in held
    assert lock.release("order:1", lease.owner) is True
    assert lock.inspect("order:1") is None


# -- hostile review, finding 1: a meta nested too deep or too large; metadata bounds ------------

import hashlib  # noqa: E402
import json  # noqa: E402

from celery_steplock.lease import (
    MAX_HOLDER_TEXT,
    MAX_META_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY,
    MAX_METADATA_SIZE,
    MAX_METADATA_VALUE,
    bounded_text,
)


def test_a_meta_nested_too_deep_or_too_large_is_malformed_and_never_raised(lock, redis_client):
    lock.acquire("good", ttl=60.0, metadata={"task_name": "shop.charge"})
    hostile = {
        "deep": "[" * 1200,
        "deep-object": '{"a":' * 10_000,
        "huge-int": '{"x": ' + "1" * 5000 + "}",
        "too-large": json.dumps({"x": "y" * MAX_META_BYTES}),
    }
    for name, meta in hostile.items():
        redis_client.hset(lock.key(name), mapping={"owner": "b" * 32, "fence": "1", "meta": meta})
        redis_client.pexpire(lock.key(name), 60_000)
    by_scan = {lease["name"]: lease for lease in lock.iter_leases()}
    assert sorted(by_scan) == ["deep", "deep-object", "good", "huge-int", "too-large"]
    assert "malformed" not in by_scan["good"]
    for name in ("deep", "deep-object", "huge-int"):
        assert by_scan[name]["malformed"].startswith("meta: not a JSON object (")
        assert len(by_scan[name]["malformed"]) < 100
    assert by_scan["too-large"]["malformed"] == (
        f"meta: larger than {MAX_META_BYTES} bytes ({MAX_META_BYTES + 9} characters)"
    )
    for name in hostile:
        inspected = lock.inspect(name)
        assert inspected["owner"] == "b" * 32 and inspected["fence"] == "1"
        assert inspected["malformed"] == by_scan[name]["malformed"]
    # every kind of stored value, directly: a dict of strings, never an exception
    for meta in ("[" * 100_000, "{" * 100_000, "1e999999", '"\\ud800"', "\x00", "[]" * 10**6):
        info = parse_lease({"owner": "a", "meta": meta})
        assert info["owner"] == "a" and info["malformed"].startswith("meta: ")


BAD_METADATA = [
    ("int 10**5000", {"x": 10**5000}, "integers must fit 64 bits"),
    ("int 2**63", {"x": 2**63}, "integers must fit 64 bits"),
    ("int -2**63-1", {"x": -(2**63) - 1}, "integers must fit 64 bits"),
    ("nan", {"x": float("nan")}, "floats must be finite"),
    ("inf", {"x": float("-inf")}, "floats must be finite"),
    ("list", {"x": [1, 2]}, "got list"),
    ("dict", {"x": {"y": 1}}, "got dict"),
    ("deep", {"x": [[[[[]]]]] * 3}, "got list"),
    ("bytes", {"x": b"raw"}, "got bytes"),
    ("object", {"x": object()}, "got object"),
    ("key with newline", {"a\nb": "v"}, "keys may not hold control characters"),
    ("key with escape", {"\x1b[2J": "v"}, "keys may not hold control characters"),
    ("value with escape", {"x": "\x1b[2Jgone"}, "strings may not hold control characters"),
    ("value with C1 control", {"x": "a\x9bb"}, "strings may not hold control characters"),
    ("empty key", {"": "v"}, "keys must be 1 to 64 characters"),
    ("long key", {"k" * (MAX_METADATA_KEY + 1): "v"}, "keys must be 1 to 64 characters"),
    ("long value", {"x": "v" * (MAX_METADATA_VALUE + 1)}, "strings must be at most 1024"),
    ("huge value", {"x": "v" * 10**6}, "strings must be at most 1024"),
    ("too many", {f"k{n}": n for n in range(MAX_METADATA_ENTRIES + 1)}, "at most 64 entries"),
    ("too large", {f"k{n}": "\u20ac" * 1000 for n in range(8)}, "at most 16384 bytes"),
    ("not a string key", {1: "v"}, "keys must be strings"),
]


@pytest.mark.parametrize(
    "metadata, message", [(m, s) for _, m, s in BAD_METADATA], ids=[i for i, _, _ in BAD_METADATA]
)
def test_metadata_beyond_its_bounds_is_refused_before_any_write(
    lock, redis_client, metadata, message
):
    with pytest.raises(MetadataError) as caught:
        lock.acquire("order:1", ttl=30.0, metadata=metadata)
    assert type(caught.value) is MetadataError and message in str(caught.value)
    assert len(str(caught.value)) < 300 and all(len(k) <= 45 for k in caught.value.keys)
    assert redis_client.dbsize() == 0  # nothing written, not even the fencing counter
    if all(isinstance(k, str) for k in metadata):  # keyword arguments are strings
        with pytest.raises(MetadataError) as again:
            holder_metadata("t", "shop.charge", 0, **metadata)
        assert len(str(again.value)) < 300


def test_metadata_at_its_bounds_is_stored_as_given(lock, redis_client):
    at_bounds = {
        "k" * MAX_METADATA_KEY: "v" * MAX_METADATA_VALUE,
        "big": 2**63 - 1,
        "small": -(2**63),
        "ratio": 0.5,
        "flag": True,
        "gone": None,
        "text": "caf\u00e9 \u20ac tab-free",
    }
    lock.acquire("order:1", ttl=30.0, metadata=at_bounds)
    held = lock.inspect("order:1")
    assert held["k" * MAX_METADATA_KEY] == "v" * MAX_METADATA_VALUE
    assert (held["big"], held["small"], held["ratio"], held["flag"]) == (
        str(2**63 - 1),
        str(-(2**63)),
        "0.5",
        "True",
    )
    assert held["text"] == "caf\u00e9 \u20ac tab-free" and "malformed" not in held
    many = {f"k{n}": "v" * 200 for n in range(MAX_METADATA_ENTRIES)}  # about 13.5 KiB
    lock.acquire("order:2", ttl=30.0, metadata=many)
    assert len(redis_client.hget(lock.key("order:2"), "meta").encode()) <= MAX_METADATA_SIZE
    assert {k: lock.inspect("order:2")[k] for k in many} == many


def test_holder_metadata_bounds_the_client_chosen_texts(lock, redis_client):
    task_id = "A" * 1_000_000
    meta = holder_metadata(
        task_id,
        "shop.charge",
        0,
        worker="celery@w1",
        step="workflows.step:" + "9" * 400,
        renew_ms=3333,
    )
    digest = hashlib.sha256(task_id.encode()).hexdigest()[:35]
    assert meta["task_id"] == "A" * (MAX_HOLDER_TEXT - 45) + "...sha256:" + digest
    assert len(meta["task_id"]) == MAX_HOLDER_TEXT == 255
    assert len(meta["step"]) == 255 and meta["step"].startswith("workflows.step:999")
    assert (meta["task_name"], meta["worker"], meta["renew_ms"]) == (
        "shop.charge",
        "celery@w1",
        3333,
    )
    # two long ids that share their first 210 characters still differ
    assert bounded_text("A" * 300) != bounded_text("A" * 301)
    assert bounded_text("t" * 255) == "t" * 255 and bounded_text("ok-id") == "ok-id"
    assert bounded_text("id\x1b[2J\n") == "id\\x1b[2J\\x0a"
    escaped = bounded_text("\x00" * 255)  # 1020 characters once escaped: cut, with a digest
    assert len(escaped) == 255 and escaped.startswith("\\x00\\x00") and "...sha256:" in escaped
    lease = lock.acquire("order:1", ttl=30.0, metadata=meta)
    stored = redis_client.hget(lock.key("order:1"), "meta")
    assert len(stored) < 1024 and lock.inspect("order:1")["task_id"] == meta["task_id"]
    assert lease.task_id == meta["task_id"]
