"""A lock name's history (celery_steplock.history) against a real redis-server."""

import time

import pytest

from celery_steplock.exceptions import InvalidArgument, TransitionConflict
from celery_steplock.heartbeat import announce_lost
from celery_steplock.history import HistoryEntry, outcome_of, parse_entries
from celery_steplock.lock import RedisLeaseStore, release_after_commit
from celery_steplock.ops import LogAudit, force_release

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass

KEY = "t:history:{a}"


def events(store, name="a", count=50):
    return [e.event for e in store.history(name, count)]


def test_acquire_and_release_write_one_entry_each_with_the_outcome(lock, redis_client):
    lease = lock.acquire("a", "o1", 5.0, metadata={"task_id": "tid-1"})
    release_after_commit(lock, lease, None, outcome="committed")
    newest, oldest = lock.history("a")
    assert (oldest.event, oldest.owner, oldest.fence, oldest.task_id) == (
        "acquired",
        "o1",
        lease.fence,
        "tid-1",
    )
    assert (newest.event, newest.owner, newest.fence, newest.task_id) == (
        "released",
        "o1",
        lease.fence,
        "tid-1",
    )
    assert newest.outcome == "committed" and newest.contended == 0
    # Times come from the stream ids (Redis time, ms), newest first.
    seconds, micros = redis_client.time()
    assert 0 <= seconds + micros / 1e6 - newest.at < 5 and newest.at >= oldest.at
    assert redis_client.llen(KEY) == 2 and 0 < redis_client.pttl(KEY) <= 7 * 24 * 3600 * 1000
    # The stored form: fields in order joined by U+001F, trailing empty ones left out.
    stored = redis_client.lrange(KEY, 0, -1)
    assert stored[1].split("\x1f")[1:] == ["acquired", "o1", str(lease.fence), "tid-1"]
    assert stored[0].split("\x1f")[1:] == [
        "released",
        "o1",
        str(lease.fence),
        "tid-1",
        "committed",
        "0",
        "",  # the holder (a contended entry's)
        "",  # who released it (a force release's)
    ]


def test_contention_writes_one_entry_per_grant_and_counts_the_refusals(lock):
    first = lock.acquire("a", "o1", 5.0)
    for i in range(20):  # retries and polling: one entry, not twenty
        assert lock.acquire("a", f"c{i}", 5.0) is None
    assert lock.acquire("a", "waiter", 5.0, wait=0.05) is None  # a waiter (KEYS[3]) too
    assert events(lock) == ["contended", "acquired"]
    contended = lock.history("a")[0]
    assert contended.owner == "c0" and contended.holder == "o1" and contended.fence == first.fence
    # The lease hash counts every refusal (the waiter's attempts too: at least 21).
    refused = int(lock.inspect("a")["contended"])
    assert refused >= 21
    assert lock.release("a", "o1", outcome="done")
    assert lock.history("a")[0].contended == refused
    second = lock.acquire("a", "o2", 5.0)
    assert lock.acquire("a", "c-again", 5.0) is None  # a new grant: a new contended entry
    assert events(lock) == ["contended", "acquired", "released", "contended", "acquired"]
    assert lock.history("a")[0].fence == second.fence


def test_a_force_release_is_recorded_as_forced_naming_the_operator(lock):
    lease = lock.acquire("a", "o1", 5.0, metadata={"task_id": "tid-1"})
    force_release(lock, "a", "o1", actor="alice", auditor=LogAudit())
    forced = lock.history("a")[0]
    assert (forced.event, forced.owner, forced.fence, forced.by) == (
        "forced",
        "o1",
        lease.fence,
        "alice",
    )
    assert forced.outcome is None


def test_a_lost_lease_is_recorded_by_its_holder(lock):
    lease = lock.acquire("a", "o1", 5.0, metadata={"task_id": "tid-1"})
    lease.mark_lost("the key vanished")
    announce_lost(lock, None, lease)
    lost = lock.history("a")[0]
    assert (lost.event, lost.owner, lost.fence, lost.task_id, lost.reason) == (
        "lost",
        "o1",
        lease.fence,
        "tid-1",
        "the key vanished",
    )


def test_a_reaped_lease_is_recorded_with_its_task_id(lock, redis_client):
    lease = lock.acquire("a", "o1", 5.0, metadata={"task_id": "tid-9"})
    renewed = redis_client.hget("t:lease:{a}", "renewed_ms")
    assert lock.reap_many([("a", "o1", renewed)]) == [True]
    reaped = lock.history("a")[0]
    assert (reaped.event, reaped.owner, reaped.fence, reaped.task_id) == (
        "reaped",
        "o1",
        lease.fence,
        "tid-9",
    )


def test_an_expired_lease_is_inferred_between_two_grants(lock, redis_client):
    first = lock.acquire("a", "o1", 0.05)
    time.sleep(0.12)
    lock.acquire("a", "o2", 5.0)
    newest, expired, oldest = lock.history("a")
    assert [newest.event, expired.event, oldest.event] == ["acquired", "expired", "acquired"]
    assert expired.inferred and expired.owner == "o1" and expired.fence == first.fence
    assert redis_client.llen(KEY) == 2  # inferred, never stored


def test_the_length_is_capped(redis_client):
    store = RedisLeaseStore(redis_client, prefix="t", history_max_entries=10)
    for i in range(400):
        lease = store.acquire("a", f"o{i}", 5.0)
        store.release("a", lease.owner)
    assert redis_client.llen(KEY) == 10
    newest = store.history("a", 10_000)
    assert len(newest) == 10 and newest[0].owner == newest[1].owner == "o399"


def test_the_age_is_bounded_by_the_streams_ttl_and_the_reader(redis_client):
    store = RedisLeaseStore(redis_client, prefix="t", history_max_age=1.0)
    # An entry older than the max age is left out by the reader even while the key lives.
    redis_client.lpush(KEY, "1000\x1facquired\x1fold")
    lease = store.acquire("a", "o1", 5.0)
    assert 0 < redis_client.pttl(KEY) <= 1000
    store.release("a", lease.owner)
    assert [e.owner for e in store.history("a")] == ["o1", "o1"]
    time.sleep(1.1)
    assert redis_client.exists(KEY) == 0 and store.history("a") == []


def test_history_off_writes_nothing(redis_client):
    store = RedisLeaseStore(redis_client, prefix="t", history=False)
    lease = store.acquire("a", "o1", 5.0, metadata={"task_id": "x"})
    assert store.acquire("a", "o2", 5.0, wait=0.05) is None
    assert store.record_history("a", "lost", owner="o1") is None
    store.release("a", lease.owner, outcome="committed")
    renewed = None
    lease = store.acquire("a", "o3", 5.0)
    renewed = redis_client.hget("t:lease:{a}", "renewed_ms")
    assert store.reap("a", "o3", renewed)
    assert redis_client.keys("t:history:*") == []
    assert "contended" not in redis_client.hgetall("t:lease:{a}")


def test_a_corrupt_history_never_refuses_a_lease_and_reads_as_malformed(lock, redis_client):
    redis_client.set(KEY, "not a stream", ex=60)
    lease = lock.acquire("a", "o1", 5.0)  # the XADD is pcall'ed: refused, ignored
    assert lease is not None and lock.release("a", "o1")
    [entry] = lock.history("a")
    assert entry.event == "malformed" and "is a string, not a list" in entry.reason
    redis_client.delete(KEY)
    seconds, _micros = redis_client.time()
    ms = str(seconds * 1000)
    redis_client.rpush(
        KEY,
        ms + "\x1facquired\x1fo9" + "\x1f" * 7 + "why\x1ffuture",
        ms + "\x1freleased\x1fo9\x1fnot-a-number",
        ms + "\x1fexploded\x1fx",
        "no time at all",
        b"\xff\xfe",
    )
    newest, bad_fence, unknown, no_time, binary = lock.history("a")
    assert newest.event == "acquired" and newest.extra == {"10": "future"}
    assert newest.reason == "why"
    assert bad_fence.event == "malformed" and "not a number" in bad_fence.reason
    assert unknown.event == "malformed" and "exploded" in unknown.reason
    assert no_time.event == binary.event == "malformed"


def test_pages_go_back_with_an_offset(lock):
    for i in range(5):
        lease = lock.acquire("a", f"o{i}", 5.0)
        lock.release("a", lease.owner)
    first = lock.history("a", 4)
    rest = lock.history("a", 50, offset=4)
    assert len(first) == 4 and len(rest) == 6
    assert [e.id for e in first + rest] == [str(n) for n in range(10)]
    assert [e.owner for e in first + rest] == [f"o{i}" for i in (4, 4, 3, 3, 2, 2, 1, 1, 0, 0)]
    with pytest.raises(InvalidArgument):
        lock.history("a", offset=-1)
    with pytest.raises(InvalidArgument):
        lock.history("a", 0)
    with pytest.raises(InvalidArgument):
        lock.record_history("a", "expired")


def test_outcome_of_an_execution():
    assert outcome_of(True, None, None) == "committed"
    assert outcome_of(False, {"steplock": "duplicate"}, None) == "duplicate"
    assert outcome_of(False, {"steplock": "skipped"}, None) == "skipped"
    assert outcome_of(False, 42, None) == "done"
    assert outcome_of(False, None, TransitionConflict("moved on")) == "conflict"
    assert outcome_of(False, None, TransitionConflict("fence", stale_fence=True)) == "fenced"
    assert outcome_of(False, None, ValueError()) == "error"


def test_parse_entries_never_raises():
    entries = parse_entries([None, 42, "5\x1flost\x1fo\x1f" + "1" * 30, "\x1f\x1f"])
    assert [e.event for e in entries] == ["malformed"] * 4
    assert HistoryEntry(id="1-0", at=0.001, event="lost", fence=3).as_dict() == {
        "id": "1-0",
        "at": 0.001,
        "event": "lost",
        "fence": 3,
    }


# -- Redis shapes: a Cluster, and a least-privilege ACL user -----------------------------------


@pytest.mark.redis_shape
def test_the_history_is_written_in_the_lease_scripts_on_a_cluster(redis_cluster):
    from celery_steplock.lock import make_client

    redis_cluster.wait_ok()
    client = make_client(redis_cluster.url, cluster=True)
    try:
        for node in client.get_primaries():
            client.get_redis_connection(node).flushdb()
        store = RedisLeaseStore(client, prefix="hc")
        for n in range(12):  # names spread over the primaries: one slot per name's keys
            name = f"order:{n}"
            lease = store.acquire(name, ttl=5.0, metadata={"task_id": f"t{n}"})
            assert store.acquire(name, ttl=5.0) is None
            reaped = store.acquire(f"dead:{n}", ttl=5.0)
            renewed = client.hget(f"hc:lease:{{dead:{n}}}", "renewed_ms")
            assert store.reap_many([(f"dead:{n}", reaped.owner, renewed)]) == [True]
            lease.mark_lost("gone")
            announce_lost(store, None, lease)
            assert store.release(name, lease.owner, outcome="committed", task_id=f"t{n}")
            assert events(store, name) == ["released", "lost", "contended", "acquired"]
            assert store.history(name)[0].outcome == "committed"
            assert events(store, f"dead:{n}") == ["reaped", "acquired"]
    finally:
        client.close()


@pytest.mark.redis_shape
def test_a_user_without_the_history_commands_keeps_its_leases(acl_server):
    from tests.support import acl

    url = acl.create_user(acl_server, prefix="t", without=["lpush", "ltrim", "lrange"])
    from celery_steplock.lock import make_client

    client = make_client(url)
    try:
        store = RedisLeaseStore(client, prefix="t")
        lease = store.acquire("acl", ttl=5.0)
        assert lease is not None and store.acquire("acl", ttl=5.0) is None
        assert store.release("acl", lease.owner, outcome="committed")
        # The LPUSH refused inside the scripts (pcall): no history, no half-written lease.
        assert store.history("acl") == [] and store.inspect("acl") is None
    finally:
        client.close()


def test_outcome_of_a_known_kind():
    assert outcome_of(False, "duplicate", None) == "duplicate"  # outcomes.outcome_kind's
    assert outcome_of(False, "something else", None) == "done"


# -- hostile input: planted entries and fields ---------------------------------------------


def test_a_separator_in_a_released_task_id_or_actor_forges_no_field(lock, redis_client):
    """RELEASE's task id and forced_by come from the caller (release(task_id=...), the
    force release's actor): U+001F in them is taken out, as encode() does."""
    forged = "\x1f".join(["tid", "applied", "99", "someone-else", "admin@ops", "forged"])
    lease = lock.acquire("a", "o1", 5.0)
    assert lock.release("a", lease.owner, outcome="error", task_id=forged)
    newest = lock.history("a")[0]
    assert newest.event == "released" and newest.outcome == "error"
    assert newest.by is None and newest.reason is None and newest.extra == {}
    assert newest.task_id == forged.replace("\x1f", " ")
    lease = lock.acquire("a", "o2", 5.0)
    force_release(lock, "a", lease.owner, actor="ops\x1fforged\x1fx", auditor=LogAudit())
    forced = lock.history("a")[0]
    assert forced.event == "forced" and forced.by == "ops forged x" and forced.extra == {}


def test_a_non_integer_contended_field_still_refuses_the_contender(lock, redis_client):
    """The refusal path's HINCRBY of the history's count goes through pcall: a lease hash
    whose ``contended`` is not an integer still answers "held by o1", never an error."""
    lock.acquire("a", "o1", 5.0)
    redis_client.hset("t:lease:{a}", "contended", "x")
    lease, holder, _ = lock.try_acquire("a", "o2", 5.0)
    assert lease is None and holder == "o1"
    assert lock.release("a", "o1")


def test_a_lost_entry_on_a_wrong_type_key_never_breaks_the_report(lock, redis_client):
    lease = lock.acquire("a", "o1", 5.0)
    redis_client.delete(KEY)
    redis_client.set(KEY, "not a list")
    redis_client.delete("t:lease:{a}")
    lease.mark_lost("gone")
    announce_lost(lock, None, lease)  # must not raise
    assert lock.history("a")[0].event == "malformed"


@pytest.mark.parametrize(
    "planted",
    [
        b"\xff\xfe\x00",
        b"{}",
        b"9" * 30 + b"\x1facquired",
        b"1\x1facquired\x1fo\x1f-1",
        b"x" * 2_000_000,
        b"9999999999999999999\x1facquired\x1fo1",
    ],
)
def test_planted_entries_read_as_malformed(lock, redis_client, planted):
    lock.acquire("a", "o1", 5.0)
    redis_client.lpush(KEY, planted)
    got = lock.history("a")
    assert got[0].event == "malformed" and len(got[0].reason or "") < 200


def test_an_entry_far_ahead_of_redis_time_is_malformed(lock, redis_client):
    """Entries are stamped with Redis time: one over a day ahead of it is planted or
    corrupt (and one past year 9999 cannot be shown as a date)."""
    seconds, _micros = redis_client.time()
    redis_client.lpush(KEY, "99999999999999\x1facquired\x1fo1")  # year 5138
    redis_client.lpush(KEY, f"{(seconds + 3600) * 1000}\x1facquired\x1fo2")
    near, far = lock.history("a")
    assert near.event == "acquired" and near.owner == "o2"
    assert far.event == "malformed" and far.at == 0.0 and "time ahead" in far.reason
    [beyond] = parse_entries(["253402300800000\x1facquired\x1fo1"])
    assert beyond.event == "malformed" and "out of range" in beyond.reason
