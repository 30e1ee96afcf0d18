"""RedisLeaseStore against a real redis-server (celery_steplock.lock)."""

import json
import threading
import time

import pytest
import redis

from celery_steplock.keys import idempotency_key

from celery_steplock.exceptions import LockLost, LockStoreUnavailable
from celery_steplock.lease import drift
from celery_steplock.lock import RedisLeaseStore, make_client, new_owner_token
from helpers import all_keys_have_ttl, wait_until

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


def ttl_left_ok(left: float, ttl: float, since: float, ms: bool = False) -> bool:
    """True when ``left`` lies between ``ttl`` and ``ttl`` less the time elapsed since
    ``since`` (a ``time.monotonic()`` reading taken before the call that set the TTL),
    however long the process stalled in between. Seconds, or milliseconds with ``ms``
    (Redis rounds those to whole ones)."""
    elapsed = time.monotonic() - since
    if ms:
        return ttl - elapsed * 1000 - 2 <= left <= ttl
    return ttl - elapsed - 0.002 <= left <= ttl


def a_waiter_blocks(client, count: int) -> bool:
    """True once ``count`` clients are blocked in BLPOP on this Redis."""
    return client.info("clients")["blocked_clients"] >= count


def test_acquire_returns_a_lease_with_metadata(lock, redis_client):
    before = time.monotonic()
    lease = lock.acquire(
        "a", "owner-1", 5.0, metadata={"task_id": "tid", "task_name": "tn", "pid": 42}
    )
    assert lease.owner == "owner-1" and lease.name == "a" and lease.key == "t:lease:{a}"
    assert lease.task_id == "tid" and lease.task_name == "tn"
    assert lease.fence > 0 and not lease.lost
    assert ttl_left_ok(lease.remaining(), 5.0 - drift(5.0), before)
    stored = redis_client.hgetall("t:lease:{a}")
    assert set(stored) == {"owner", "fence", "acquired_ms", "renewed_ms", "ttl_ms", "meta"}
    assert stored["owner"] == "owner-1" and int(stored["fence"]) == lease.fence
    assert json.loads(stored["meta"]) == {"task_id": "tid", "task_name": "tn", "pid": "42"}
    assert stored["ttl_ms"] == "5000" and stored["acquired_ms"] == stored["renewed_ms"]
    assert ttl_left_ok(redis_client.pttl("t:lease:{a}"), 5000, before, ms=True)


def test_second_owner_is_refused(lock):
    before = time.monotonic()
    assert lock.acquire("a", "o1", 5.0) is not None
    assert lock.acquire("a", "o2", 5.0) is None
    lease, holder, ttl = lock.try_acquire("a", "o3", 5.0)
    assert lease is None and holder == "o1" and ttl_left_ok(ttl, 5.0, before)


def test_same_owner_reacquire_is_idempotent(lock):
    first = lock.acquire("a", "o1", 5.0)
    again = lock.acquire("a", "o1", 5.0)
    assert again.fence == first.fence


def test_one_winner_among_concurrent_acquirers(redis_server_url, redis_client):
    contenders = 24
    barrier = threading.Barrier(contenders)
    winners, errors = [], []

    def contend(i):
        own = RedisLeaseStore(make_client(redis_server_url), prefix="t")
        barrier.wait()
        try:
            if own.acquire("race", f"owner-{i}", 10.0) is not None:
                winners.append(i)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(winners) == 1
    assert redis_client.hget("t:lease:{race}", "owner") == f"owner-{winners[0]}"


def test_every_key_has_a_ttl(lock, redis_client):
    for i in range(5):
        lock.acquire(f"n{i}", new_owner_token(), 5.0)
    lock.release("n0", redis_client.hget("t:lease:{n0}", "owner"))
    keys, without = all_keys_have_ttl(redis_client, "t:*")
    # 4 leases, 5 fencing counters, 5 histories (celery_steplock.history): all with a TTL.
    assert len(keys) == 14 and without == []
    assert sum(key.startswith("t:history:") for key in keys) == 5


def test_non_owner_release_and_extend_change_nothing(lock, redis_client):
    lock.acquire("a", "o1", 5.0)
    time.sleep(0.2)
    before = redis_client.hgetall("t:lease:{a}")
    ttl_before = redis_client.pttl("t:lease:{a}")
    assert lock.release("a", "intruder") is False
    assert lock.extend("a", "intruder", 60.0) is False
    assert redis_client.hgetall("t:lease:{a}") == before
    ttl_after = redis_client.pttl("t:lease:{a}")
    assert ttl_after <= ttl_before and ttl_after < 5000


def test_release_is_owner_checked_and_idempotent(lock, redis_client):
    lock.acquire("a", "o1", 5.0)
    assert lock.release("a", "o1") is True
    assert redis_client.exists("t:lease:{a}") == 0
    assert lock.release("a", "o1") is False
    assert lock.extend("a", "o1", 5.0) is False


def test_extend_resets_the_ttl_for_the_owner(lock, redis_client):
    lock.acquire("a", "o1", 1.0)
    time.sleep(0.3)
    before = time.monotonic()
    assert lock.extend("a", "o1", 3.0) is True
    assert ttl_left_ok(redis_client.pttl("t:lease:{a}"), 3000, before, ms=True)
    assert redis_client.hget("t:lease:{a}", "ttl_ms") == "3000"


def test_owned_reports_seconds_left_or_none(lock):
    before = time.monotonic()
    lock.acquire("a", "o1", 2.0)
    assert ttl_left_ok(lock.owned("a", "o1"), 2.0, before)
    assert lock.owned("a", "o2") is None
    assert lock.owned("missing", "o1") is None


def test_fencing_token_strictly_increases_across_expiry_and_reacquire(lock, redis_client):
    fences = []
    for i in range(5):
        lease = lock.acquire("f", f"o{i}", 0.1)
        fences.append(lease.fence)
        if i % 2:
            lock.release("f", lease.owner)
        else:
            time.sleep(0.15)  # let it expire
            assert redis_client.exists("t:lease:{f}") == 0
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


def test_fencing_token_survives_loss_of_its_counter(lock, redis_client):
    first = lock.acquire("f", "o1", 5.0)
    lock.release("f", "o1")
    redis_client.delete("t:fence:{f}")  # as after a failover to a replica that lacked it
    second = lock.acquire("f", "o2", 5.0)
    assert second.fence > first.fence


def test_fencing_tokens_of_back_to_back_grants_differ(lock):
    fences = []
    for i in range(50):
        lease = lock.acquire("fast", f"o{i}", 5.0)
        fences.append(lease.fence)
        lock.release("fast", lease.owner)
    assert all(b > a for a, b in zip(fences, fences[1:]))


def test_wait_gets_the_lease_when_the_holder_releases(lock):
    lock.acquire("w", "holder", 60.0)
    released = []
    started = time.monotonic()
    timer = threading.Timer(0.3, lambda: released.append(lock.release("w", "holder")))
    timer.start()
    lease = lock.acquire("w", "waiter", 5.0, wait=20.0)
    waited = time.monotonic() - started
    timer.join(5)
    # Granted once released (not before), long before the holder's 60 s TTL or the wait ran
    # out: the release handed it over.
    assert lease is not None and lease.owner == "waiter" and released == [True]
    assert 0.3 <= waited < 10.0


def test_wait_gives_up_after_the_deadline(lock):
    lock.acquire("w", "holder", 60.0)
    started = time.monotonic()
    assert lock.acquire("w", "waiter", 5.0, wait=0.3) is None
    # Not before the deadline, and not at the holder's TTL (60 s) either.
    assert 0.3 <= time.monotonic() - started < 5.0


def test_extend_many_renews_in_one_call(lock, redis_client):
    for i in range(20):
        lock.acquire(f"m{i}", f"o{i}", 1.0)
    before = time.monotonic()
    results = lock.extend_many([(f"m{i}", f"o{i}" if i % 4 else "wrong", 4.0) for i in range(20)])
    assert results == [bool(i % 4) for i in range(20)]
    assert ttl_left_ok(redis_client.pttl("t:lease:{m1}"), 4000, before, ms=True)
    assert redis_client.pttl("t:lease:{m0}") <= 1000


def test_extend_many_reloads_flushed_scripts(lock, redis_client):
    lock.acquire("s", "o", 1.0)
    redis_client.script_flush()
    assert lock.extend_many([("s", "o", 3.0)]) == [True]


def test_inspect_shows_the_holder(lock):
    before = time.monotonic()
    lock.acquire("i", "o1", 5.0, metadata={"task_id": "abc", "hostname": "h", "pid": 7})
    info = lock.inspect("i")
    assert info["owner"] == "o1" and info["task_id"] == "abc" and info["pid"] == "7"
    assert info["name"] == "i" and info["key"] == "t:lease:{i}"
    assert ttl_left_ok(info["ttl"], 5.0, before)
    assert lock.inspect("nobody") is None


def test_inspect_of_a_key_that_is_not_a_lease_hash_reads_as_none(
    lock, redis_client, redis_server_url, caplog
):
    # Corrupt data where a lease should be: read as a scan reads it (none, logged), by the
    # sync and the async store alike, never a raw redis-py error.
    redis_client.set("t:lease:{str}", "x", px=5000)
    with caplog.at_level("WARNING", logger="celery_steplock"):
        assert lock.inspect("str") is None
    assert "WRONGTYPE a string" in caplog.text
    redis_client.hset("t:lease:{odd}", mapping={"owner": "o1", "fence": "not a number"})
    info = lock.inspect("odd")
    assert info is not None
    assert (info["owner"], info["name"], info["ttl"]) == ("o1", "odd", None)
    assert "fence" not in info and "fence" in info["malformed"]
    # An owner that is not UTF-8, read through a client that does not decode (bytes).
    redis_client.hset("t:lease:{raw}", mapping={"owner": b"\xff\xfe", "fence": "1"})
    undecoded = redis.Redis.from_url(redis_server_url)  # replies as bytes
    try:
        raw = RedisLeaseStore(undecoded, prefix="t").inspect("raw")
    finally:
        undecoded.close()
    assert raw is not None
    assert (raw["owner"], raw["malformed"]) == ("\ufffd\ufffd", "owner: not UTF-8")


@pytest.mark.parametrize("fence", ["not a number", None])
def test_a_regrant_of_a_hash_with_no_readable_fence_is_a_typed_error(lock, redis_client, fence):
    from celery_steplock.exceptions import LockError

    lock.acquire("bad-fence", "o1", 5.0)
    if fence is None:
        redis_client.hdel("t:lease:{bad-fence}", "fence")
    else:
        redis_client.hset("t:lease:{bad-fence}", "fence", fence)
    with pytest.raises(LockError) as info:
        lock.acquire("bad-fence", "o1", 5.0)
    assert (info.value.key, info.value.name, info.value.owner) == (
        "t:lease:{bad-fence}",
        "bad-fence",
        "o1",
    )
    assert "fencing token is not a number" in str(info.value)
    assert "celery steplock release bad-fence --owner o1" in str(info.value)
    assert lock.acquire("bad-fence", "o2", 5.0) is None  # still held: nothing changed hands


def test_unreachable_store_raises_a_typed_retryable_error():
    from helpers import closed_port_url

    lock = RedisLeaseStore(make_client(closed_port_url(), socket_timeout=0.5), prefix="t")
    started = time.monotonic()
    with pytest.raises(LockStoreUnavailable, match="acquire"):
        lock.acquire("a", "o", 5.0)
    with pytest.raises(LockStoreUnavailable):
        lock.release("a", "o")
    with pytest.raises(LockStoreUnavailable):
        lock.extend_many([("a", "o", 5.0)])
    assert time.monotonic() - started < 10


def test_lease_local_validity_and_check(redis_client):
    now = [500.0]  # the leases' clock, moved by the test (Redis's TTL is long: 30 s)
    lock = RedisLeaseStore(redis_client, prefix="t", clock=lambda: now[0], name_secret="k" * 32)
    lease = lock.acquire("v", "o", 30.0)
    lease.check()
    assert lease.idempotency_key == idempotency_key(b"k" * 32, None, "v")
    named = lock.acquire("w", "o", 5.0, metadata={"task_name": "shop.charge"})
    assert named.idempotency_key == idempotency_key(b"k" * 32, "shop.charge", "w")
    assert "shop.charge" not in named.idempotency_key and len(named.idempotency_key) == 64
    now[0] = 500.0 + 30.0 - drift(30.0) - 0.001
    lease.check()  # valid up to the TTL less the drift allowance
    now[0] = lease.valid_until
    assert lease.lost and "local validity" in lease.lost_reason
    with pytest.raises(LockLost) as info:
        lease.check()
    assert info.value.key == "t:lease:{v}"


def test_scan_pages_through_leases_without_keys(lock, redis_client):
    before = time.monotonic()
    for i in range(120):
        lock.acquire(f"s:{i}", f"o{i}", 5.0, metadata={"task_name": "t" if i % 2 else "u"})
    redis_client.set("t:fence:{unrelated}", 1, ex=5)
    seen, cursor, steps = [], 0, 0
    while True:
        cursor, page = lock.scan(cursor, count=25)
        seen.extend(page)
        steps += 1
        if cursor == 0:
            break
    assert steps > 1
    assert sorted(info["name"] for info in seen) == sorted(f"s:{i}" for i in range(120))
    first = next(info for info in seen if info["name"] == "s:3")
    assert first["owner"] == "o3" and first["task_name"] == "t"
    assert ttl_left_ok(first["ttl"], 5.0, before)
    assert [i["name"] for i in lock.iter_leases(match="s:1?")] and all(
        i["name"].startswith("s:1") and len(i["name"]) == 4 for i in lock.iter_leases("s:1?")
    )


def test_waiter_wakes_on_release_without_polling(lock, redis_client, redis_server_url):
    lock.acquire("n", "holder", 60.0)
    # A socket timeout of 30 s lets one BLPOP block for the whole 20 s wait.
    waiter = RedisLeaseStore(make_client(redis_server_url, socket_timeout=30.0), prefix="t")
    woke = []

    def wait():
        woke.append(waiter.acquire("n", "waiter", 5.0, wait=20.0))

    thread = threading.Thread(target=wait)
    redis_client.config_resetstat()
    thread.start()
    wait_until(
        lambda: redis_client.zscore("t:waiters:{n}", "waiter") is not None,
        timeout=10,
        interval=0.005,
        what="the waiter to register",
    )
    released_at = time.monotonic()
    assert lock.release("n", "holder") is True
    thread.join(30)
    assert woke and woke[0].owner == "waiter"
    # Woken by the release's wake-up: one BLPOP, not one per poll, and it returned long
    # before its own deadline (20 s) or the holder's TTL (60 s) could have let it in.
    blpop = redis_client.info("commandstats").get("cmdstat_blpop", {})
    assert blpop.get("calls") == 1
    assert time.monotonic() - released_at < 10.0


def test_waiter_takes_over_when_the_holder_expires(lock, redis_server_url):
    # A socket timeout of 30 s: the waiter's BLPOP is bounded by the holder's TTL only.
    waiter = RedisLeaseStore(make_client(redis_server_url, socket_timeout=30.0), prefix="t")
    started = time.monotonic()
    lock.acquire("e", "dead-holder", 0.4)
    lease = waiter.acquire("e", "waiter", 5.0, wait=20.0)
    waited = time.monotonic() - started
    # Not before the holder's TTL ran out; then at once (nobody announces a dead holder),
    # not at the end of its 20 s wait.
    assert lease is not None and lease.owner == "waiter"
    assert 0.4 - 0.002 <= waited < 5.0


def test_many_waiters_one_winner_per_release(lock, redis_client, redis_server_url):
    lock.acquire("m", "holder", 60.0)
    winners = []

    def wait(i):
        own = RedisLeaseStore(make_client(redis_server_url, socket_timeout=30.0), prefix="t")
        lease = own.acquire("m", f"w{i}", 60.0, wait=20.0)
        if lease:
            winners.append(i)

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    wait_until(
        lambda: redis_client.zcard("t:waiters:{m}") == 8,
        timeout=10,
        interval=0.005,
        what="8 waiters",
    )
    owner = "holder"
    for k in range(1, 9):  # each release hands the lease to exactly one more waiter
        assert lock.release("m", owner) is True
        wait_until(lambda: len(winners) >= k, timeout=10, interval=0.005, what=f"winner {k}")
        assert len(winners) == k  # the others still wait: the winner holds it for 60 s
        assert redis_client.zcard("t:waiters:{m}") == 8 - k
        owner = f"w{winners[-1]}"
    for t in threads:
        t.join(10)
    assert sorted(winners) == list(range(8))


def test_a_refusal_is_not_an_outage(lock, redis_client):
    from celery_steplock.exceptions import LockError

    redis_client.set("t:lease:{typed}", "not a hash", ex=5)
    with pytest.raises(LockError, match="refused") as info:
        lock.acquire("typed", "o", 5.0)
    assert not isinstance(info.value, LockStoreUnavailable)


def test_reap_spares_a_lease_renewed_since_it_was_read(lock, redis_client):
    lock.acquire("r", "o", 5.0)
    seen = redis_client.hget("t:lease:{r}", "renewed_ms")
    assert lock.reap("r", "someone-else", seen) is False
    time.sleep(0.01)
    lock.extend("r", "o", 5.0)
    assert lock.reap("r", "o", seen) is False and redis_client.exists("t:lease:{r}")
    fresh = redis_client.hget("t:lease:{r}", "renewed_ms")
    assert lock.reap("r", "o", fresh) is True and not redis_client.exists("t:lease:{r}")


def test_scan_skips_keys_that_are_not_leases(lock, redis_client):
    lock.acquire("good", "o", 5.0)
    redis_client.set("t:lease:{stray}", "not a hash", ex=5)
    assert [info["name"] for info in lock.iter_leases()] == ["good"]


# -- batched renewal, batched reap, one waiter woken per release ---------------------------


def test_extend_many_renews_each_lease_as_extend_would(lock, redis_client):
    names = ["m:a", "m:b", "m:ü", "m:stolen", "m:gone"]
    for name in names:
        lock.acquire(name, f"own-{name}", 1.0)
    redis_client.hset("t:lease:{m:stolen}", "owner", "thief")
    redis_client.delete("t:lease:{m:gone}")
    before = {n: redis_client.hgetall(lock.key(n)) for n in names}
    time.sleep(0.02)
    ttls = {"m:a": 7.0, "m:b": 3.0, "m:ü": 5.0, "m:stolen": 9.0, "m:gone": 9.0}
    # chunk=2: three script calls in one round trip, results in the items' order.
    sent = time.monotonic()
    results = lock.extend_many([(n, f"own-{n}", ttls[n]) for n in names], chunk=2)
    assert results == [True, True, True, False, False]
    for name in ("m:a", "m:b", "m:ü"):
        after = redis_client.hgetall(lock.key(name))
        assert after["ttl_ms"] == str(int(ttls[name] * 1000))
        assert int(after["renewed_ms"]) > int(before[name]["renewed_ms"])
        assert after["acquired_ms"] == before[name]["acquired_ms"]
        assert ttl_left_ok(redis_client.pttl(lock.key(name)), ttls[name] * 1000, sent, ms=True)
    assert redis_client.hgetall("t:lease:{m:stolen}") == before["m:stolen"]
    assert redis_client.pttl("t:lease:{m:stolen}") <= 1000
    assert redis_client.exists("t:lease:{m:gone}") == 0
    assert lock.extend_many([]) == []


def test_extend_many_reloads_a_script_redis_lost(lock, redis_client):
    lock.acquire("lost-script", "o", 1.0)
    redis_client.script_flush()
    assert lock.extend_many([("lost-script", "o", 4.0), ("nobody", "o", 4.0)]) == [True, False]
    assert redis_client.hget("t:lease:{lost-script}", "ttl_ms") == "4000"


def test_reap_many_compares_owner_and_renewal_per_lease(lock, redis_client):
    from celery_steplock.exceptions import LockError

    for name in ("r1", "r2", "r3"):
        lock.acquire(name, f"o-{name}", 5.0)
    seen = {n: redis_client.hget(lock.key(n), "renewed_ms") for n in ("r1", "r2", "r3")}
    time.sleep(0.01)
    lock.extend("r2", "o-r2", 5.0)  # renewed since it was read: spared
    redis_client.set("t:lease:{typed}", "not a hash", ex=5)
    results = lock.reap_many(
        [
            ("r1", "o-r1", seen["r1"]),
            ("r2", "o-r2", seen["r2"]),
            ("r3", "someone-else", seen["r3"]),
            ("typed", "o", "1"),
        ]
    )
    assert results[:3] == [True, False, False]
    assert isinstance(results[3], LockError) and not isinstance(results[3], LockStoreUnavailable)
    assert redis_client.exists("t:lease:{r1}") == 0
    assert redis_client.hget("t:lease:{r2}", "owner") == "o-r2"
    assert redis_client.hget("t:lease:{r3}", "owner") == "o-r3"
    assert lock.reap_many([]) == []


def test_a_release_wakes_one_waiter_in_arrival_order(lock, redis_client, redis_server_url):
    lock.acquire("q", "holder", 60.0)
    order, errors = [], []

    def wait(i):
        # A socket timeout of 30 s: each waiter blocks in one BLPOP until woken.
        own = RedisLeaseStore(make_client(redis_server_url, socket_timeout=30.0), prefix="t")
        try:
            lease = own.acquire("q", f"w{i}", 60.0, wait=20.0)
            order.append(i)
            time.sleep(0.05)
            own.release("q", lease.owner)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    blocked = redis_client.info("clients")["blocked_clients"]
    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        # Each one blocks (BLPOP) before the next arrives.
        wait_until(
            lambda: a_waiter_blocks(redis_client, blocked + i + 1),
            timeout=10,
            interval=0.005,
            what=f"waiter {i} to block",
        )
    assert redis_client.zcard("t:waiters:{q}") == 4

    def evalsha_calls():  # a first call of a script not loaded yet fails and is repeated
        stats = redis_client.info("commandstats").get("cmdstat_evalsha", {})
        return stats.get("calls", 0) - stats.get("failed_calls", 0)

    calls = evalsha_calls()
    lock.release("q", "holder")
    for t in threads:
        t.join(5)
    assert errors == [] and order == [0, 1, 2, 3]
    # 1 release + per waiter 1 acquire and 1 release: nobody retried for nothing.
    assert evalsha_calls() - calls == 1 + 4 * 2
    assert redis_client.exists("t:waiters:{q}") == 0  # the last one took itself out


def test_a_waiter_that_gives_up_leaves_nothing_behind(lock, redis_client):
    lock.acquire("g", "holder", 10.0)
    assert lock.acquire("g", "waiter", 5.0, wait=0.2) is None
    assert redis_client.exists("t:waiters:{g}") == 0
    assert lock.release("g", "holder") is True
    assert redis_client.exists("t:wake:{g}") == 0  # nobody waits: no wake-up is pushed
    keys, without = all_keys_have_ttl(redis_client, "t:*")
    assert without == []


def test_wait_keys_expire(lock, redis_client):
    lock.acquire("x", "holder", 60.0)
    thread = threading.Thread(target=lock.acquire, args=("x", "waiter", 5.0), kwargs={"wait": 5.0})
    thread.start()
    wait_until(
        lambda: redis_client.exists("t:waiters:{x}"),
        timeout=4,
        interval=0.005,
        what="the waiter to register",
    )
    assert 0 < redis_client.pttl("t:waiters:{x}") <= 5000  # as long as the wait, no longer
    lock.release("x", "holder")
    thread.join(10)
    keys, without = all_keys_have_ttl(redis_client, "t:*")
    assert without == []


# -- the stored shape, the fencing counter, errors' attributes -------------------------------

TASK_META = {
    "task_id": "6f1c2a47",
    "task_name": "shop.charge",
    "hostname": "web-1",
    "pid": 4242,
    "retries": 2,
    "worker": "celery@web-1",
    "step": "workflows.step:42",
    "renew_ms": 10000,
}
META_FIELDS = {
    "owner",
    "fence",
    "acquired_ms",
    "renewed_ms",
    "ttl_ms",
    "task_id",
    "task_name",
    "hostname",
    "pid",
    "retries",
    "worker",
    "step",
    "renew_ms",
}


def test_metadata_round_trips_through_inspect_and_scan(lock):
    before = time.monotonic()
    lease = lock.acquire("meta", "o1", 5.0, metadata=TASK_META)
    info = lock.inspect("meta")
    assert set(info) == META_FIELDS | {"name", "key", "ttl"}
    assert {k: info[k] for k in TASK_META} == {k: str(v) for k, v in TASK_META.items()}
    assert info["owner"] == "o1" and info["fence"] == str(lease.fence)
    assert info["acquired_ms"] == info["renewed_ms"] and info["ttl_ms"] == "5000"
    [scanned] = lock.iter_leases("meta")
    assert scanned == {**info, "ttl": scanned["ttl"]} and ttl_left_ok(scanned["ttl"], 5.0, before)


def test_leases_stored_field_by_field_read_the_same(lock, redis_client):
    # As written by an earlier version: every metadata entry a field of its own.
    lease = lock.acquire("new", "o1", 5.0, metadata=TASK_META)
    new = lock.inspect("new")
    fields = {k: v for k, v in new.items() if k in META_FIELDS}
    redis_client.hset("t:lease:{old}", mapping=fields)
    redis_client.pexpire("t:lease:{old}", 5000)
    old = lock.inspect("old")
    assert {k: old[k] for k in META_FIELDS} == {k: new[k] for k in META_FIELDS}
    assert {i["name"]: i["task_id"] for i in lock.iter_leases()} == {
        "new": "6f1c2a47",
        "old": "6f1c2a47",
    }
    assert lock.release("old", "o1") and lock.release("new", lease.owner)


def test_a_field_of_the_hash_wins_over_a_metadata_entry(lock, redis_client):
    lock.acquire("w", "o1", 5.0, metadata=TASK_META)
    # The API refuses reserved metadata keys (MetadataError); a hash written otherwise:
    meta = json.loads(redis_client.hget("t:lease:{w}", "meta"))
    redis_client.hset(
        "t:lease:{w}",
        mapping={
            "step": "workflows.step:43",
            "meta": json.dumps({**meta, "owner": "forged", "fence": "1"}),
        },
    )
    info = lock.inspect("w")
    assert info["owner"] == "o1" and int(info["fence"]) > 1
    assert info["step"] == "workflows.step:43" and info["task_id"] == "6f1c2a47"
    assert info["malformed"] == "meta: reserved key 'fence'; meta: reserved key 'owner'"


def test_fence_counter_has_a_ttl_of_two_periods_when_new(redis_client):
    store = RedisLeaseStore(redis_client, prefix="t", fence_ttl=60.0)
    before = time.monotonic()
    lease = store.acquire("c", "o1", 5.0)
    assert int(redis_client.get("t:fence:{c}")) == lease.fence
    assert ttl_left_ok(redis_client.pttl("t:fence:{c}"), 120_000, before, ms=True)


def test_fence_counter_ttl_is_reset_once_per_period(redis_client):
    period_us = 60_000_000
    store = RedisLeaseStore(redis_client, prefix="t", fence_ttl=60.0)
    # A counter written 1.5 periods ago: this grant is the first of a new period.
    sec, usec = redis_client.time()
    redis_client.set("t:fence:{c}", sec * 1_000_000 + usec - period_us * 3 // 2, px=5000)
    before = time.monotonic()
    first = store.acquire("c", "o1", 5.0)
    assert ttl_left_ok(redis_client.pttl("t:fence:{c}"), 120_000, before, ms=True)
    store.release("c", "o1")
    # The next grant keeps the TTL unless a period boundary lies between the two grants.
    redis_client.pexpire("t:fence:{c}", 5000)
    before = time.monotonic()
    second = store.acquire("c", "o2", 5.0)
    assert second.fence > first.fence
    same_period = first.fence // period_us == second.fence // period_us
    pttl = redis_client.pttl("t:fence:{c}")
    assert (0 < pttl <= 5000) if same_period else ttl_left_ok(pttl, 120_000, before, ms=True)


def test_fence_counter_ahead_of_the_clock_is_followed(lock, redis_client):
    # As after a failover to a Redis whose clock is behind: the counter, not the clock, wins.
    sec, usec = redis_client.time()
    ahead = (sec + 3600) * 1_000_000 + usec
    redis_client.set("t:fence:{ahead}", ahead, px=5000)
    first = lock.acquire("ahead", "o1", 0.05)
    assert first.fence == ahead + 1 and int(redis_client.get("t:fence:{ahead}")) == ahead + 1
    assert redis_client.pttl("t:fence:{ahead}") > 5000  # a fresh TTL of two periods
    redis_client.delete("t:lease:{ahead}")  # as if it expired
    second = lock.acquire("ahead", "o2", 5.0)
    assert second.fence == ahead + 2


def test_fence_increases_across_expiry_with_the_counter_kept(lock, redis_client):
    first = lock.acquire("exp", "o1", 0.05)
    wait_gone = time.monotonic() + 10
    while redis_client.exists("t:lease:{exp}") and time.monotonic() < wait_gone:
        time.sleep(0.01)
    assert redis_client.exists("t:lease:{exp}") == 0
    assert int(redis_client.get("t:fence:{exp}")) == first.fence  # the counter outlives it
    second = lock.acquire("exp", "o2", 5.0)
    assert second.fence > first.fence
    assert int(redis_client.get("t:fence:{exp}")) == second.fence


def test_refused_acquire_reports_the_holder_and_its_ttl(lock):
    before = time.monotonic()
    lock.acquire("h", "holder", 5.0)
    lease, holder, ttl = lock.try_acquire("h", "other", 5.0)
    assert lease is None and holder == "holder" and ttl_left_ok(ttl, 5.0, before)


def test_release_does_not_publish(lock, redis_client):
    lock.acquire("p", "o1", 5.0)
    redis_client.config_resetstat()
    assert lock.release("p", "o1") is True
    assert "cmdstat_publish" not in redis_client.info("commandstats")
    with pytest.warns(DeprecationWarning):
        assert lock.channel("p") == "t:released:{p}"


def test_errors_carry_the_lock_name_and_owner(lock, redis_client):
    from celery_steplock.exceptions import LockError

    redis_client.set("t:lease:{typed}", "not a hash", ex=5)
    for call in (
        lambda: lock.acquire("typed", "o7", 5.0),
        lambda: lock.release("typed", "o7"),
        lambda: lock.extend("typed", "o7", 5.0),
        lambda: lock.owned("typed", "o7"),
        lambda: lock.reap("typed", "o7", "1"),
    ):
        with pytest.raises(LockError, match="refused") as info:
            call()
        err = info.value
        assert not isinstance(err, LockStoreUnavailable)
        assert (err.name, err.owner, err.key) == ("typed", "o7", "t:lease:{typed}")
    [refused] = lock.reap_many([("typed", "o7", "1")])
    assert (refused.name, refused.owner) == ("typed", "o7")


def test_unreachable_store_errors_carry_the_lock_name_and_owner():
    from helpers import closed_port_url

    store = RedisLeaseStore(make_client(closed_port_url(), socket_timeout=0.5), prefix="t")
    with pytest.raises(LockStoreUnavailable) as info:
        store.acquire("a", "o1", 5.0)
    assert (info.value.name, info.value.owner, info.value.key) == ("a", "o1", "t:lease:{a}")
    with pytest.raises(LockStoreUnavailable) as info:
        store.release("a", "o1")
    assert (info.value.name, info.value.owner) == ("a", "o1")
    with pytest.raises(LockStoreUnavailable) as info:
        store.inspect("a")
    assert info.value.name == "a" and info.value.owner is None


def test_leases_use_the_store_clock(redis_client):
    now = [500.0]
    store = RedisLeaseStore(redis_client, prefix="t", clock=lambda: now[0])
    lease = store.acquire("clk", "o1", 2.0)
    assert lease.acquired_at == 500.0 and lease.valid_until == pytest.approx(502.0 - 0.022)
    now[0] = 501.0
    assert lease.remaining() == pytest.approx(0.978) and not lease.lost
    now[0] = 502.0
    assert lease.lost


def test_a_flushed_script_is_loaded_again(lock, redis_client):
    lease = lock.acquire("fl", "o1", 5.0)
    redis_client.script_flush()
    assert lock.owned("fl", "o1") is not None
    redis_client.script_flush()
    assert lock.release("fl", lease.owner) is True


# -- issue 12, finding 6: the primitive API validates its arguments as the settings are ----------

from celery_steplock.exceptions import InvalidArgument, LockNameError  # noqa: E402

BAD_CALLS = [
    ("acquire ttl=1e20", lambda s: s.acquire("a", "o", 1e20), "ttl"),
    ("acquire ttl=0", lambda s: s.acquire("a", "o", 0), "ttl"),
    ("acquire ttl=-5", lambda s: s.acquire("a", "o", -5.0), "ttl"),
    ("acquire ttl='10'", lambda s: s.acquire("a", "o", "10"), "ttl"),
    ("acquire ttl=None", lambda s: s.acquire("a", "o", None), "ttl"),
    ("acquire ttl=nan", lambda s: s.acquire("a", "o", float("nan")), "ttl"),
    ("acquire wait=1e9", lambda s: s.acquire("a", "o", 5.0, wait=1e9), "wait"),
    ("acquire wait=-1", lambda s: s.acquire("a", "o", 5.0, wait=-1), "wait"),
    ("acquire wait='1'", lambda s: s.acquire("a", "o", 5.0, wait="1"), "wait"),
    ("acquire owner=''", lambda s: s.acquire("a", "", 5.0), "owner"),
    ("acquire owner=5", lambda s: s.acquire("a", 5, 5.0), "owner"),
    ("acquire owner huge", lambda s: s.acquire("a", "o" * 257, 5.0), "owner"),
    ("acquire metadata=[]", lambda s: s.acquire("a", "o", 5.0, metadata=[1]), "metadata"),
    ("try_acquire ttl=1e300", lambda s: s.try_acquire("a", "o", 1e300), "ttl"),
    ("extend ttl=1e20", lambda s: s.extend("a", "o", 1e20), "ttl"),
    ("extend ttl=0", lambda s: s.extend("a", "o", 0.0), "ttl"),
    ("extend ttl='x'", lambda s: s.extend("a", "o", "x"), "ttl"),
    ("extend_many ttl=-1", lambda s: s.extend_many([("a", "o", -1.0)]), "ttl"),
    ("extend_many owner=None", lambda s: s.extend_many([("a", None, 5.0)]), "owner"),
    ("extend_many chunk=0", lambda s: s.extend_many([("a", "o", 5.0)], chunk=0), "chunk"),
    ("release owner=None", lambda s: s.release("a", None), "owner"),
    ("owned owner=b''", lambda s: s.owned("a", b""), "owner"),
    ("reap renewed_ms='x'", lambda s: s.reap("a", "o", "x"), "renewed_ms"),
    ("scan_keys count=0", lambda s: s.scan_keys(0, 0), "count"),
    ("scan_keys count=1e9", lambda s: s.scan_keys(0, 10**9), "count"),
    ("scan cursor=-1", lambda s: s.scan(-1), "cursor"),
    ("scan match=''", lambda s: s.scan(0, 10, ""), "match"),
]


@pytest.mark.parametrize(
    "call, argument", [(c, a) for _, c, a in BAD_CALLS], ids=[i for i, _, _ in BAD_CALLS]
)
def test_bad_arguments_are_refused_by_name_and_nothing_is_written(
    lock, redis_client, call, argument
):
    with pytest.raises(InvalidArgument) as info:
        call(lock)
    assert info.value.argument == argument == info.value.setting
    assert argument in str(info.value) and len(str(info.value)) < 400
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    assert redis_client.dbsize() == 0


@pytest.mark.parametrize("name", ["", "a{b}", "x" * 513, "a\nb", None, 5])
def test_bad_lock_names_are_lock_name_errors(lock, redis_client, name):
    for call in (
        lambda: lock.acquire(name, "o", 5.0),
        lambda: lock.release(name, "o"),
        lambda: lock.extend(name, "o", 5.0),
        lambda: lock.inspect(name),
        lambda: lock.owned(name, "o"),
    ):
        with pytest.raises(LockNameError) as info:
            call()
        assert len(str(info.value)) < 400
    assert redis_client.dbsize() == 0


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"fence_ttl": 1e20}, "fence_ttl"),
        ({"fence_ttl": 0.1}, "fence_ttl"),
        ({"fence_ttl": "7d"}, "fence_ttl"),
        ({"max_waiters": 0}, "max_waiters"),
        ({"max_waiters": 10**9}, "max_waiters"),
        ({"max_waiters": 2.5}, "max_waiters"),
        ({"prefix": "a b"}, "prefix"),
        ({"prefix": "p" * 65}, "prefix"),
        ({"prefix": ""}, "prefix"),
        ({"clock": 5}, "clock"),
        ({"name_secret": "short"}, "name_secret"),
    ],
)
def test_bad_store_arguments_are_refused_by_name(redis_client, kwargs, argument):
    with pytest.raises(InvalidArgument) as info:
        RedisLeaseStore(redis_client, **kwargs)
    assert info.value.argument == argument
    if argument == "name_secret":
        assert "short" not in str(info.value)


def test_values_at_the_bounds_are_used_as_given_never_clamped(lock, redis_client):
    lease = lock.acquire("long", "o", 86400)
    assert lease is not None and lease.ttl == 86400
    assert 86_390_000 < redis_client.pttl("t:lease:{long}") <= 86_400_000
    assert lock.extend("long", "o", 0.05) is True
    assert 0 < redis_client.pttl("t:lease:{long}") <= 50
    short = lock.acquire("short", "o", 0.05)
    assert short is not None and short.ttl == 0.05
    store = RedisLeaseStore(redis_client, prefix="t", fence_ttl=366 * 24 * 3600)
    assert store.fence_ttl == 366 * 24 * 3600
    assert store.acquire("fenced", "o", 5.0) is not None
    # kept at least fence_ttl after the grant, at most twice that (RedisLeaseStore's doc)
    assert (
        366 * 24 * 3600 * 1000 - 10_000
        < redis_client.pttl("t:fence:{fenced}")
        <= 2 * 366 * 24 * 3600 * 1000
    )


def test_reap_many_refuses_a_malformed_item_alone(lock, redis_client):
    lease = lock.acquire("dead", "o", 30.0)
    renewed = redis_client.hget("t:lease:{dead}", "renewed_ms")
    results = lock.reap_many(
        [("odd", "o" * 300, "1"), ("dead", "o", renewed), ("gone", "p", None), ("a{b", "o", "1")]
    )
    assert [type(r).__name__ for r in results] == [
        "InvalidArgument",
        "bool",
        "InvalidArgument",
        "LockNameError",
    ]
    assert results[1] is True and lease is not None
    assert [r.argument for r in (results[0], results[2])] == ["owner", "renewed_ms"]
    assert redis_client.exists("t:lease:{dead}") == 0


def test_deprecated_alias_validates_the_same(redis_client):
    import warnings

    import celery_steplock.lock as lock_module

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        alias = lock_module.RedisStepLock
    with pytest.raises(InvalidArgument) as info:
        alias(redis_client, prefix="t").acquire("a", "o", 1e20)
    assert info.value.argument == "ttl"


# -- hostile review, findings 7 and 8: store arguments; a lease key that is not UTF-8 ----------


@pytest.mark.parametrize(
    "client",
    [None, "redis://127.0.0.1:6379/0", 42, object()],
    ids=["None", "a URL", "int", "object"],
)
def test_a_store_without_a_client_is_refused_by_name(client):
    with pytest.raises(InvalidArgument) as info:
        RedisLeaseStore(client)
    assert info.value.argument == "client" and "client must be" in str(info.value)
    assert len(str(info.value)) < 300


@pytest.mark.parametrize(
    "keys",
    ["abc", b"t:lease:{a}", [1], ["t:lease:{a}", None], 5],
    ids=["str", "bytes", "an int item", "a None item", "int"],
)
def test_read_leases_refuses_what_is_not_a_list_of_keys(lock, redis_client, keys):
    lock.acquire("a", "o", 30.0)
    with pytest.raises(InvalidArgument) as info:
        lock.read_leases(keys)
    assert info.value.argument == "keys" and len(str(info.value)) < 300
    assert list(lock.read_leases(iter(["t:lease:{a}"]))) == ["t:lease:{a}"]


def test_a_lease_key_that_is_not_utf8_is_listed_as_malformed(lock, redis_client):
    import redis

    kwargs = redis_client.connection_pool.connection_kwargs
    raw = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))
    raw.hset(b"t:lease:{\xff\xfe\x1b[2J}", mapping={"owner": "c" * 32, "fence": "1"})
    raw.pexpire(b"t:lease:{\xff\xfe\x1b[2J}", 60_000)
    raw.close()
    lock.acquire("fine", "o", 30.0)
    leases = sorted(lock.iter_leases(), key=lambda lease: lease["name"])
    assert [lease["name"] for lease in leases] == ["fine", "\ufffd\ufffd\\x1b[2J"]
    odd = leases[1]
    assert odd == {
        "key": "t:lease:{\ufffd\ufffd\\x1b[2J}",
        "name": "\ufffd\ufffd\\x1b[2J",
        "ttl": None,
        "malformed": "key: not UTF-8 (cannot be read back)",
    }
    assert all(c.isprintable() for c in odd["name"] + odd["key"])
    cursor, keys = lock.scan_keys(0, 1000)
    assert cursor == 0 and len(keys) == 2
    assert sum(1 for info in lock.read_leases(keys).values() if info is not None) == 2
    assert "malformed" not in leases[0] and leases[0]["owner"] == "o"


# -- issue 24: the permission probe's reserved name --------------------------------------------


def test_the_probes_reserved_name_is_refused_by_every_call(lock, redis_client):
    from celery_steplock.lock import PROBE_NAME

    for call in (
        lambda: lock.acquire(PROBE_NAME, "o", 5.0),
        lambda: lock.try_acquire(PROBE_NAME, "o", 5.0),
        lambda: lock.release(PROBE_NAME, "o"),
        lambda: lock.extend(PROBE_NAME, "o", 5.0),
        lambda: lock.inspect(PROBE_NAME),
        lambda: lock.owned(PROBE_NAME, "o"),
    ):
        with pytest.raises(LockNameError) as info:
            call()
        assert PROBE_NAME in str(info.value) and "reserved" in str(info.value)
    assert redis_client.dbsize() == 0


def test_the_probe_never_touches_a_lease_it_does_not_own(redis_client):
    """A lease of the reserved name written by another version or by hand, and its fencing
    counter, waiters and wake list: a starting store's probe leaves each as it was."""
    from celery_steplock.lock import PROBE_NAME

    theirs = {
        f"t:lease:{{{PROBE_NAME}}}": ("hash", {"owner": "theirs", "fence": "7"}),
        f"t:fence:{{{PROBE_NAME}}}": ("string", "7"),
        f"t:waiters:{{{PROBE_NAME}}}": ("zset", {"someone": 1.0}),
        f"t:wake:{{{PROBE_NAME}}}": ("list", ["someone"]),
    }

    def snapshot(key):
        kind = redis_client.type(key)
        read = {
            "hash": redis_client.hgetall,
            "string": redis_client.get,
            "zset": lambda k: redis_client.zrange(k, 0, -1, withscores=True),
            "list": lambda k: redis_client.lrange(k, 0, -1),
            "none": lambda k: None,
        }[kind]
        return kind, read(key)

    for present in [*theirs, "all"]:  # each key alone, then all of them
        redis_client.flushdb()
        for key, (kind, value) in theirs.items():
            if key != present and present != "all":
                continue
            if kind == "hash":
                redis_client.hset(key, mapping=value)
            elif kind == "string":
                redis_client.set(key, value)
            elif kind == "zset":
                redis_client.zadd(key, value)
            else:
                redis_client.rpush(key, *value)
            redis_client.expire(key, 60)
        before = {key: snapshot(key) for key in redis_client.keys("*")}
        store = RedisLeaseStore(redis_client, prefix="t")
        lease = store.acquire("mine", "o1", 5.0)  # the probe runs before the first write
        assert lease is not None and store._probed
        after = {key: snapshot(key) for key in before}
        assert after == before, present
        assert all(redis_client.ttl(key) > 50 for key in before)
        assert set(redis_client.keys("*")) == {
            *before,
            "t:lease:{mine}",
            "t:fence:{mine}",
            "t:history:{mine}",
        }
        assert store.release("mine", "o1")


def test_the_probe_as_a_restricted_user_names_what_is_missing_and_touches_no_lease(acl_server):
    """With the reserved name's lease held by someone else, a user lacking HSET is still told
    so (the probe ran on a name of its own); a user lacking EXISTS is refused before the
    probe writes anything, since nothing then says its keys are free."""
    from celery_steplock.exceptions import LockStoreMisconfigured
    from celery_steplock.lock import PROBE_NAME
    from tests.support import acl

    admin = make_client(acl_server.url)
    admin.flushdb()
    theirs = f"steplock:lease:{{{PROBE_NAME}}}"
    try:
        admin.hset(theirs, mapping={"owner": "theirs", "fence": "7"})
        for without, named in (("hset", "hset steplock:lease:{"), ("exists", "exists ")):
            client = make_client(acl.create_user(acl_server, without=[without]))
            try:
                with pytest.raises(LockStoreMisconfigured) as caught:
                    RedisLeaseStore(client).acquire("m", "o", 30.0)
            finally:
                client.close()
            assert any(p.startswith(named) for p in caught.value.permissions), caught.value
            assert admin.hgetall(theirs) == {"owner": "theirs", "fence": "7"}
            assert admin.keys("*") == [theirs]
    finally:
        admin.flushdb()
        admin.close()


def _grant_script(t1: str, t2: str) -> str:
    # fragments.FENCE and fragments.GRANT run on a TIME reply given by the test (KEYS[1]
    # lease, KEYS[2] counter; ARGV[1] owner, ARGV[2] ttl ms, ARGV[3] period ms, ARGV[4] meta).
    from celery_steplock._redis.scripts.fragments import FENCE, GRANT

    return (
        f"local t = {{'{t1}', '{t2}'}}\n"
        "local lease, counter, owner, ttl_ms, period_ms, meta ="
        " KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV[4]\n"
        "local refresh_counter = false\n" + FENCE + GRANT + "return {fence_s, now_s, fence}\n"
    )


@pytest.mark.parametrize("usec", ["0", "5", "999", "1000", "100000", "123456", "999999"])
def test_fence_and_grant_times_are_spliced_from_time_exactly(redis_client, usec):
    # The token and acquired_ms are spliced from TIME's strings (no strtod/sprintf): every
    # width of the microseconds gives the same digits as the arithmetic would.
    sec = "1764700000"
    script = _grant_script(sec, usec)
    fence_s, now_s, fence = redis_client.eval(
        script, 2, "t:lease:{s}", "t:fence:{s}", "o1", "5000", "60000", ""
    )
    expected = int(sec) * 1_000_000 + int(usec)
    assert fence_s == str(expected) and fence == expected
    assert now_s == str(int(sec) * 1000 + int(usec) // 1000)
    assert redis_client.get("t:fence:{s}") == str(expected)
    stored = redis_client.hgetall("t:lease:{s}")
    assert stored == {
        "owner": "o1",
        "fence": str(expected),
        "acquired_ms": now_s,
        "renewed_ms": now_s,
        "ttl_ms": "5000",
    }
    # A second grant in the same microsecond (or with the clock behind): counter + 1.
    redis_client.delete("t:lease:{s}")
    fence_s, _now_s, fence = redis_client.eval(
        script, 2, "t:lease:{s}", "t:fence:{s}", "o2", "5000", "60000", '{"a": "b"}'
    )
    assert fence == expected + 1 and fence_s == str(expected + 1)
    assert redis_client.hget("t:lease:{s}", "meta") == '{"a": "b"}'


def test_fence_and_acquired_ms_come_from_redis_time(lock, redis_client):
    sec, usec = redis_client.time()
    lease = lock.acquire("clock", "o1", 5.0)
    sec2, usec2 = redis_client.time()
    assert sec * 1_000_000 + usec <= lease.fence <= sec2 * 1_000_000 + usec2
    stored = redis_client.hgetall("t:lease:{clock}")
    assert int(stored["acquired_ms"]) == lease.fence // 1000 == int(stored["renewed_ms"])
    assert lock.extend("clock", "o1", 5.0)
    sec3, usec3 = redis_client.time()
    renewed = int(redis_client.hget("t:lease:{clock}", "renewed_ms"))
    assert lease.fence // 1000 <= renewed <= sec3 * 1000 + usec3 // 1000


def test_a_lease_without_metadata_has_no_meta_field_and_reads_as_an_empty_one(lock, redis_client):
    lease = lock.acquire("bare", "o1", 5.0)
    stored = redis_client.hgetall("t:lease:{bare}")
    assert set(stored) == {"owner", "fence", "acquired_ms", "renewed_ms", "ttl_ms"}
    info = lock.inspect("bare")
    # The same hash with an empty meta field (as earlier versions wrote it) reads the same.
    redis_client.hset("t:lease:{bare2}", mapping={**stored, "meta": ""})
    redis_client.pexpire("t:lease:{bare2}", 5000)
    other = lock.inspect("bare2")
    assert info is not None and other is not None
    assert {k: v for k, v in info.items() if k not in ("name", "key", "ttl")} == {
        k: v for k, v in other.items() if k not in ("name", "key", "ttl")
    }
    assert info["owner"] == "o1" and info["fence"] == str(lease.fence)
    [scanned] = lock.iter_leases("bare")
    assert "malformed" not in scanned


def test_a_wait_is_cut_to_the_socket_timeout_a_connection_class_defaults_to(
    lock, redis_client, redis_server_url
):
    # A client built by hand whose connections time out by their class's default (5 s in
    # redis-py 6+, invisible in the pool's arguments; 2 s here): a BLPOP as long as the
    # holder's TTL would outlast the socket and fail the wait.
    import redis

    class QuickConnection(redis.Connection):
        def __init__(self, socket_timeout=2.0, **kwargs):
            super().__init__(socket_timeout=socket_timeout, **kwargs)

    pool = redis.ConnectionPool.from_url(
        redis_server_url, connection_class=QuickConnection, decode_responses=True
    )
    assert "socket_timeout" not in pool.connection_kwargs
    waiter = RedisLeaseStore(redis.Redis(connection_pool=pool), prefix="t")
    holder = lock.acquire("cut", "holder", 8.0)
    # Released after the waiter's first BLPOP (1.6 s: 80% of the socket timeout) returned.
    threading.Timer(2.5, lock.release, args=("cut", "holder")).start()
    started = time.monotonic()
    lease = waiter.acquire("cut", "waiter", 5.0, wait=7.0)
    assert lease is not None and lease.owner == "waiter" and lease.fence > holder.fence
    assert 2.0 < time.monotonic() - started < 6.0
    pool.disconnect()


def test_a_wait_cut_short_after_taking_a_wake_up_passes_it_on(
    lock, redis_client, redis_server_url
):
    # A wait interrupted by an exception (Celery's soft time limit) right after its BLPOP
    # took the one wake-up a release pushed: the next waiter is woken at once, not when its
    # own BLPOP times out. The interruption is injected where a signal would raise it.
    import redis

    class Interrupted(Exception):
        pass

    class InterruptedAfterWakeUp(redis.Redis):
        def blpop(self, *args, **kwargs):
            reply = super().blpop(*args, **kwargs)
            if reply:
                raise Interrupted
            return reply

    def blocked() -> int:
        return int(redis_client.info("clients")["blocked_clients"])

    interrupted_client = InterruptedAfterWakeUp.from_url(redis_server_url, decode_responses=True)
    first = RedisLeaseStore(interrupted_client, prefix="t")
    lock.acquire("passed-on", "holder", 60.0)
    outcome = {}

    def wait_first():
        try:
            first.acquire("passed-on", "first", 5.0, wait=20.0)
        except Interrupted:
            outcome["first"] = "interrupted"

    def wait_second():
        outcome["second"] = lock.acquire("passed-on", "second", 5.0, wait=20.0)
        outcome["second_at"] = time.monotonic()

    threads = [threading.Thread(target=wait_first), threading.Thread(target=wait_second)]
    threads[0].start()
    wait_until(lambda: blocked() == 1, timeout=5)
    threads[1].start()
    wait_until(lambda: blocked() == 2, timeout=5)
    released_at = time.monotonic()
    assert lock.release("passed-on", "holder")
    for thread in threads:
        thread.join(25)
    assert outcome["first"] == "interrupted"
    assert outcome["second"] is not None and outcome["second"].owner == "second"
    assert outcome["second_at"] - released_at < 2.0
    assert redis_client.zscore("t:waiters:{passed-on}", "first") is None
    interrupted_client.close()


def test_a_waiter_rides_out_a_primary_that_is_gone_for_a_second(private_redis):
    # A failover drops the wait and leaves no primary for a moment: the acquire attempts
    # that follow are tried again (for at most FAILOVER_GRACE seconds) instead of the first
    # one raising. Here the server is killed and back 1.5 s later (its data lost, as after
    # a failover to a replica the lease had not reached).
    store = RedisLeaseStore(make_client(private_redis.url), prefix="t")
    store.acquire("ride", "holder", 30.0)
    outcome = {}

    def wait():
        try:
            outcome["lease"] = store.acquire("ride", "waiter", 5.0, wait=20.0)
        except Exception as exc:  # noqa: BLE001 - the assertion reports it
            outcome["error"] = exc

    thread = threading.Thread(target=wait)
    thread.start()
    probe = make_client(private_redis.url)
    wait_until(lambda: probe.zscore("t:waiters:{ride}", "waiter") is not None, timeout=5)
    probe.close()
    private_redis.kill()
    time.sleep(1.5)
    private_redis.start()
    thread.join(15)
    assert "error" not in outcome, outcome
    assert outcome["lease"] is not None and outcome["lease"].owner == "waiter"
    store.client.close()
