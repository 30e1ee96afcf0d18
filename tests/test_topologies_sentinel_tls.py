"""The lease store and StepLockedTask through Redis Sentinel and over TLS / mutual TLS, on real
servers on loopback (tests/support/sentinel.py, tests/support/tls.py), configured only through
the settings a user writes (steplock_redis_url, steplock_redis_transport_options,
steplock_redis_use_ssl).

Sentinel: 1 primary, 1 replica, 3 sentinels, passwords on the data nodes (in the URL) and on
the sentinels (``sentinel_kwargs``). The failover tests force ``SENTINEL FAILOVER`` while
leases are held and check that renewals, releases and waiters reach the new primary and that
every step commits once.
"""

import json
import threading
import time

import pytest
import redis

from celery_steplock.exceptions import LockContended, LockStoreMisconfigured, LockStoreUnavailable
from celery_steplock._redis import wire as _wire
from celery_steplock.lock import get_lease_store
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord
from tests.helpers import set_settings, wait_until
from tests.support.sentinel import SentinelGroup
from tests.support.topologies import PRIMARY_PASSWORD, SENTINEL_PASSWORD
from tests.support.tls import TLSRedisServer, make_certificates, redis_has_tls

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_shape]

# The session's group (``sentinel_group``) is tests/support/topologies.py's.

HOLD = {"entered": {}, "go": threading.Event()}


def _record(task, step_id):
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status="done",
        owner=task.lease.owner,
        fence=task.lease.fence,
        task_id=task.request.id or "",
    )


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.topo_finish",
    lock_key="topo:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
)
def topo_finish(self, step_id):
    _record(self, step_id)
    return {"fence": self.lease.fence, "owner": self.lease.owner, "key": self.lease.key}


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.topo_held",
    lock_key="topo:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
    max_retries=0,
)
def topo_held(self, step_id):
    """Holds its lease until HOLD["go"] is set, then records the transition."""
    HOLD["entered"][step_id].set()
    assert HOLD["go"].wait(120), "never released"
    _record(self, step_id)
    return {"fence": self.lease.fence, "owner": self.lease.owner}


def configure(app, url, options=None, use_ssl=None, timeout=2.0):
    set_settings(
        app,
        steplock_redis_url=url,
        steplock_redis_transport_options=options,
        steplock_redis_use_ssl=use_ssl,
        steplock_socket_timeout=timeout,
        steplock_retry_backoff=0.01,
    )


def run_in_thread(target, *args):
    """Start ``target(*args)`` in a thread; returns (thread, outcome list)."""
    outcome = []

    def run():
        try:
            outcome.append(target(*args))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            outcome.append(exc)
        finally:
            from django.db import connection

            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def lease_cycle(store, primary, prefix):
    """Acquire, renew (one and pipelined), inspect, scan, wait, reap and release through
    ``store``; ``primary`` is a plain client of the server that must hold the keys."""
    lease = store.acquire(f"{prefix}-a", ttl=30)
    assert lease is not None and lease.fence > 0
    assert primary.hget(store.key(f"{prefix}-a"), "owner") == lease.owner
    assert store.acquire(f"{prefix}-a", ttl=30) is None  # held
    assert store.extend(f"{prefix}-a", lease.owner, 25) is True
    assert 20 < store.owned(f"{prefix}-a", lease.owner) <= 25
    others = [store.acquire(f"{prefix}-{n}", ttl=30) for n in range(3)]
    renewed = store.extend_many(
        [(f"{prefix}-{n}", o.owner, 40) for n, o in enumerate(others)]
        + [(f"{prefix}-gone", "nobody", 40)]
    )
    assert renewed == [True, True, True, False]
    assert all(35_000 < primary.pttl(store.key(f"{prefix}-{n}")) <= 40_000 for n in range(3))
    info = store.inspect(f"{prefix}-a")
    assert info["owner"] == lease.owner and int(info["fence"]) == lease.fence
    names = {i["name"] for i in store.iter_leases(match=f"{prefix}-*", count=2)}
    assert names == {f"{prefix}-a", f"{prefix}-0", f"{prefix}-1", f"{prefix}-2"}
    # A waiter blocks until the release wakes it (the TTL, 30 s, is longer than its wait).
    thread, outcome = run_in_thread(lambda: store.acquire(f"{prefix}-a", ttl=10, wait=20))
    wait_until(
        lambda: primary.zcard(f"{store.prefix}:waiters:{{{prefix}-a}}") == 1,
        timeout=10,
        what="the waiter to register",
    )
    assert store.release(f"{prefix}-a", lease.owner) is True
    thread.join(25)
    [waiter] = outcome
    assert waiter is not None and not isinstance(waiter, Exception), waiter
    assert waiter.fence > lease.fence
    assert primary.hget(store.key(f"{prefix}-a"), "owner") == waiter.owner
    # Reaping compares the renewal stamp read before; a pipelined reap_many too.
    info = store.inspect(f"{prefix}-0")
    assert store.reap(f"{prefix}-0", others[0].owner, "1") is False
    assert store.reap(f"{prefix}-0", others[0].owner, info["renewed_ms"]) is True
    stamps = [store.inspect(f"{prefix}-{n}")["renewed_ms"] for n in (1, 2)]
    assert store.reap_many(
        [(f"{prefix}-1", others[1].owner, stamps[0]), (f"{prefix}-2", others[2].owner, stamps[1])]
    ) == [True, True]
    assert store.release(f"{prefix}-a", waiter.owner) is True
    assert primary.exists(*(store.key(f"{prefix}-{n}") for n in ("a", 0, 1, 2))) == 0


def run_task_once(step):
    result = topo_finish.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    step.refresh_from_db()
    assert step.status == "done"
    assert (step.lock_owner, step.lock_fence) == (result.result["owner"], result.result["fence"])
    assert list(TransitionRecord.objects.filter(step=step).values_list("owner", flat=True)) == [
        result.result["owner"]
    ]
    return result.result


# -- Sentinel ------------------------------------------------------------------------------


@pytest.fixture
def fresh_sentinel_group(tmp_path):
    """A group of the test's own (a failover changes which node is the primary)."""
    group = SentinelGroup(
        password=PRIMARY_PASSWORD,
        sentinel_password=SENTINEL_PASSWORD,
        workdir=tmp_path / "sentinel",
    ).start()
    yield group
    group.stop()


def sentinel_store(app, group):
    configure(app, group.url, group.transport_options)
    store = get_lease_store(app)
    assert type(store.client.connection_pool).__name__ == "SentinelConnectionPool"
    return store


def test_sentinel_lease_cycle(app, sentinel_group):
    store = sentinel_store(app, sentinel_group)
    primary = sentinel_group.node_client(sentinel_group.primary_port())
    try:
        primary.flushdb()
        lease_cycle(store, primary, "sentinel")
    finally:
        primary.close()


def test_sentinel_a_dead_sentinel_is_skipped(app, sentinel_group):
    """The first sentinel of the URL does not listen: the next ones are asked at once (no
    per-sentinel retry with backoff, redis-py's default, which costs seconds per call)."""
    from tests.support.servers import free_port

    dead = f"sentinel://:{PRIMARY_PASSWORD}@127.0.0.1:{free_port()}"
    configure(app, f"{dead};{sentinel_group.url}", sentinel_group.transport_options)
    store = get_lease_store(app)
    started = time.monotonic()
    lease = store.acquire("dead-sentinel", ttl=5)
    elapsed = time.monotonic() - started
    assert lease is not None
    assert store.release("dead-sentinel", lease.owner) is True
    assert elapsed < 3.0, elapsed  # connection refused on loopback, then the next sentinel


@pytest.mark.parametrize(
    "case", ["wrong sentinel password", "no sentinel password", "unknown master_name"]
)
def test_sentinel_refusal_is_a_configuration_error(app, sentinel_group, case):
    """The sentinels answer but refuse the credentials or do not know the primary: redis-py
    says only "No master found"; the store error names the setting, briefly."""
    options = {
        "wrong sentinel password": {
            "master_name": sentinel_group.master_name,
            "sentinel_kwargs": {"password": "wrong"},
        },
        "no sentinel password": {"master_name": sentinel_group.master_name},
        "unknown master_name": {
            "master_name": "nosuch",
            "sentinel_kwargs": {"password": SENTINEL_PASSWORD},
        },
    }
    configure(app, sentinel_group.url, options[case])
    store = get_lease_store(app)
    with pytest.raises(LockStoreMisconfigured) as info:
        store.acquire("sentinel-auth", ttl=5)
    error = info.value
    print(f"{case}: {error!r}")
    assert error.setting == "steplock_redis_transport_options"
    wanted = "master_name" if case == "unknown master_name" else "sentinel_kwargs"
    assert wanted in str(error)
    assert len(str(error)) < 600, str(error)  # addresses, not the sentinel clients' reprs
    for sentinel in sentinel_group.sentinels:
        assert f"127.0.0.1:{sentinel.port}" in str(error)


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_sentinel_refusal_never_runs_the_task_body(app, sentinel_group, policy):
    configure(
        app,
        sentinel_group.url,
        {"master_name": sentinel_group.master_name, "sentinel_kwargs": {"password": "wrong"}},
    )
    app.conf.steplock_on_store_error = policy
    step = Step.objects.create(name="sentinel refused")
    result = topo_finish.apply(args=(step.pk,))
    assert result.failed()
    assert isinstance(result.result, LockStoreMisconfigured), result.result
    assert result.result.setting == "steplock_redis_transport_options"
    assert TransitionRecord.objects.filter(step=step).count() == 0
    step.refresh_from_db()
    assert step.status == "pending"


def test_sentinels_all_unreachable_stay_an_outage(app):
    from tests.support.servers import free_port

    configure(
        app,
        f"sentinel://127.0.0.1:{free_port()};sentinel://127.0.0.1:{free_port()}",
        {"master_name": "mymaster"},
        timeout=0.5,
    )
    store = get_lease_store(app)
    with pytest.raises(LockStoreUnavailable) as info:
        store.acquire("sentinel-down", ttl=5)
    assert not isinstance(info.value, LockStoreMisconfigured)
    assert "2 of 2 did not answer" in str(info.value), str(info.value)
    assert len(str(info.value)) < 600, str(info.value)


def test_sentinel_step_locked_task(app, sentinel_group):
    store = sentinel_store(app, sentinel_group)
    step = Step.objects.create(name="via sentinel")
    done = run_task_once(step)
    primary = sentinel_group.node_client(sentinel_group.primary_port())
    try:
        assert primary.exists(done["key"]) == 0  # released on the primary
        assert int(primary.get(f"steplock:fence:{{topo:{step.pk}}}")) == done["fence"]
    finally:
        primary.close()
    assert store.inspect(f"topo:{step.pk}") is None
    # Run again: the step already left "pending", so nothing more commits.
    topo_finish.apply(args=(step.pk,))
    assert TransitionRecord.objects.filter(step=step).count() == 1


def test_sentinel_failover_while_tasks_hold_leases(app, fresh_sentinel_group):
    """A task holds its lease (TTL 40 s, renewed every 2 s by the heartbeat), the store holds
    two more, and a waiter blocks on a third name, while SENTINEL FAILOVER moves the primary.
    Afterwards renewals reach the new primary, a duplicate finds the lease held there, every
    step commits once, and releases delete the leases on the new primary. (One holding task:
    SQLite serializes the transactions its bodies run in.)"""
    group = fresh_sentinel_group
    store = sentinel_store(app, group)
    set_settings(app, steplock_default_ttl=40)
    set_settings(app, steplock_renewal_ratio=0.05)
    held_step, *later_steps = [Step.objects.create(name=f"failover {n}") for n in range(3)]
    HOLD["go"].clear()
    HOLD["entered"].clear()
    HOLD["entered"][held_step.pk] = threading.Event()
    holder_thread, holder = run_in_thread(lambda: topo_held.apply(args=(held_step.pk,)))
    assert HOLD["entered"][held_step.pk].wait(30), holder
    held = [store.acquire(f"failover-{n}", ttl=40) for n in range(2)]
    blocker = store.acquire("failover-waited", ttl=60)
    waiter_thread, waiter = run_in_thread(
        lambda: store.acquire("failover-waited", ttl=30, wait=60)
    )
    task_key = store.key(f"topo:{held_step.pk}")
    keys = (
        [task_key]
        + [store.key(f"failover-{n}") for n in range(2)]
        + [store.key("failover-waited")]
    )
    old_port = group.primary_port()
    old = group.node_client(old_port)
    try:
        wait_until(
            lambda: old.zcard(f"{store.prefix}:waiters:{{failover-waited}}") == 1,
            timeout=10,
            what="the waiter to register",
        )
        replica = group.node_client(next(n.port for n in group.nodes if n.port != old_port))
        try:  # the leases reached the replica before it is promoted
            wait_until(
                lambda: replica.exists(*keys) == len(keys),
                timeout=10,
                what="the leases to replicate",
            )
        finally:
            replica.close()
    finally:
        old.close()

    try:
        old_port, new_port = group.failover()
        assert new_port != old_port
        new = group.node_client(new_port)
        assert new.info("replication")["role"] == "master"
        # The heartbeat's renewals reach the new primary: the renewal stamp moves there.
        stamp = new.hget(task_key, "renewed_ms")
        assert stamp
        wait_until(
            lambda: new.hget(task_key, "renewed_ms") not in (None, stamp),
            timeout=30,
            what="a renewal on the new primary",
        )
        assert store.client.connection_pool.get_master_address() == ("127.0.0.1", new_port)
        # Pipelined renewals of the store's leases reach it too.
        assert store.extend_many(
            [(f"failover-{n}", lease.owner, 40) for n, lease in enumerate(held)]
        ) == [True, True]
        assert all(35_000 < new.pttl(store.key(f"failover-{n}")) <= 40_000 for n in range(2))
        # A duplicate meets the held lease on the new primary.
        duplicate = topo_finish.apply(args=(held_step.pk,))
        assert isinstance(duplicate.result, LockContended), duplicate.result
        # The waiter, whose wait the failover dropped once, waits on; a release wakes it.
        assert store.release("failover-waited", blocker.owner) is True
        waiter_thread.join(70)
        [got] = waiter
        print(f"failover timings {group.timings}; waiter outcome {got!r}")
        assert got is not None and not isinstance(got, Exception), got
        assert got.fence > blocker.fence
        assert new.hget(store.key("failover-waited"), "owner") == got.owner
        assert store.release("failover-waited", got.owner) is True
        HOLD["go"].set()
        holder_thread.join(60)
        [result] = holder
        assert result.successful(), result.traceback
        held_step.refresh_from_db()
        assert held_step.status == "done"
        records = list(
            TransitionRecord.objects.filter(step=held_step).values_list("owner", "fence")
        )
        assert records == [(result.result["owner"], result.result["fence"])]
        assert (held_step.lock_owner, held_step.lock_fence) == records[0]
        # New tasks (after the holder's transaction) run the whole flow on the new primary,
        # once per step.
        for step in later_steps:
            done = run_task_once(step)
            assert new.exists(done["key"]) == 0
            assert int(new.get(f"steplock:fence:{{topo:{step.pk}}}")) == done["fence"]
        for n, lease in enumerate(held):
            assert store.release(f"failover-{n}", lease.owner) is True
        assert new.exists(*keys) == 0  # every lease released on the new primary
        new.close()
    finally:
        HOLD["go"].set()
        holder_thread.join(60)


@pytest.mark.workers
def test_sentinel_real_workers_commit_once(start_workers, sentinel_group, redis_client):
    """Two prefork workers (the broker on the session's Redis, the lease store through
    Sentinel, configured by Django settings) race on one step: one commit."""
    from django_app.workflows.tasks import advance

    env = {
        "STEPLOCK_REDIS_URL": sentinel_group.url,
        "STEPLOCK_REDIS_TRANSPORT_OPTIONS": json.dumps(sentinel_group.transport_options),
        "STEPLOCK_DEMO_STATS": 1,
    }
    start_workers(dict(name="s1", concurrency=1, **env), dict(name="s2", concurrency=1, **env))
    primary = sentinel_group.node_client(sentinel_group.primary_port())
    try:
        primary.flushdb()
        steps = [Step.objects.create(name=f"workers {n}") for n in range(3)]
        for step in steps:
            advance.apply_async((step.pk,), {"delay": 0.5})
            advance.apply_async((step.pk,), {"delay": 0.5})

        def settled():
            return (
                redis_client.llen("celery") == 0
                and redis_client.hlen("unacked") == 0
                and all(
                    s.status == "done" for s in Step.objects.filter(pk__in=[s.pk for s in steps])
                )
                and not list(primary.scan_iter(match="steplock:lease:*"))
            )

        wait_until(settled, timeout=90, what="both deliveries of every step to finish")
        for step in steps:
            assert list(
                TransitionRecord.objects.filter(step=step).values_list("to_status", flat=True)
            ) == ["done"]
        # The leases lived on the Sentinel primary (fence counters there), not the broker.
        assert all(primary.exists(f"steplock:fence:{{step:{s.pk}}}") for s in steps)
        assert not any(redis_client.exists(f"steplock:fence:{{step:{s.pk}}}") for s in steps)
    finally:
        primary.close()


# -- TLS and mutual TLS --------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    ok, detail = redis_has_tls()
    assert ok, f"the redis-server used by the tests has no TLS support: {detail}"
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_server(certs, tmp_path_factory):
    server = TLSRedisServer(certs, workdir=tmp_path_factory.mktemp("tls")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(certs, tmp_path_factory):
    server = TLSRedisServer(
        certs, client_auth=True, workdir=tmp_path_factory.mktemp("mtls")
    ).start()
    yield server
    server.stop()


def plain_tls_client(server):
    import redis

    return redis.Redis(
        host="127.0.0.1",
        port=server.port,
        decode_responses=True,
        socket_timeout=2.0,
        **server.client_kwargs(),
    )


def test_tls_lease_cycle_and_task_with_ca_verification(app, tls_server, certs):
    configure(
        app,
        tls_server.url,
        use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.ca_cert)},
    )
    store = get_lease_store(app)
    pool = store.client.connection_pool
    conn = _wire.connection(pool)
    pool.release(conn)
    assert type(conn).__name__ == "SSLConnection"
    primary = plain_tls_client(tls_server)
    try:
        primary.flushdb()
        lease_cycle(store, primary, "tls")
        step = Step.objects.create(name="over tls")
        done = run_task_once(step)
        assert primary.exists(done["key"]) == 0
        assert int(primary.get(f"steplock:fence:{{topo:{step.pk}}}")) == done["fence"]
    finally:
        primary.close()


def test_tls_certificate_options_in_the_url(app, tls_server, certs):
    configure(app, f"{tls_server.url}?ssl_cert_reqs=required&ssl_ca_certs={certs.ca_cert}")
    store = get_lease_store(app)
    lease = store.acquire("tls-url", ttl=5)
    assert lease is not None
    assert store.release("tls-url", lease.owner) is True


def test_tls_wrong_ca_fails_verification(app, tls_server, certs):
    configure(
        app,
        tls_server.url,
        use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.other_ca_cert)},
    )
    store = get_lease_store(app)
    started = time.monotonic()
    with pytest.raises(LockStoreMisconfigured) as info:  # not an outage: never retried
        store.acquire("tls-wrong-ca", ttl=5)
    assert info.value.setting == "steplock_redis_use_ssl"
    print(
        f"wrong CA: {time.monotonic() - started:.3f}s {info.value!r} <- {info.value.__cause__!r}"
    )
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)
    assert time.monotonic() - started < 20  # a bounded number of attempts, then raised
    primary = plain_tls_client(tls_server)
    try:
        assert primary.exists(store.key("tls-wrong-ca")) == 0
    finally:
        primary.close()


def test_mtls_client_certificate_required(app, mtls_server, certs):
    with_cert = {
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": str(certs.ca_cert),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }
    configure(app, mtls_server.url, use_ssl=with_cert)
    store = get_lease_store(app)
    primary = plain_tls_client(mtls_server)
    try:
        primary.flushdb()
        lease_cycle(store, primary, "mtls")
        step = Step.objects.create(name="over mtls")
        run_task_once(step)

        # Without a certificate the server ends the handshake: a configuration error naming
        # the TLS setting, raised after a bounded number of attempts, and nothing written.
        configure(
            app,
            mtls_server.url,
            use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.ca_cert)},
        )
        refused = get_lease_store(app)
        assert refused is not store
        started = time.monotonic()
        with pytest.raises(LockStoreMisconfigured) as info:
            refused.acquire("mtls-no-cert", ttl=5)
        print(
            f"mTLS without a certificate: {time.monotonic() - started:.3f}s "
            f"{info.value!r} <- {info.value.__cause__!r}"
        )
        assert info.value.setting == "steplock_redis_use_ssl"
        assert "client certificate" in str(info.value)
        assert time.monotonic() - started < 20
        assert info.value.__cause__ is not None
        assert primary.exists(refused.key("mtls-no-cert")) == 0
        # The library's own check reports the same store unreachable.
        from celery_steplock.contrib.django.checks import check_lock_store

        [error] = check_lock_store(app)
        assert error.id == "celery_steplock.E001"
    finally:
        primary.close()


@pytest.mark.parametrize(
    "case", ["client certificate not PEM", "key not the certificate's", "CA file not PEM"]
)
@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_unusable_tls_material_is_a_configuration_error(
    app, mtls_server, certs, tmp_path, case, policy
):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a PEM file\n")
    base = {
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": str(certs.ca_cert),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }
    use_ssl = {
        "client certificate not PEM": {**base, "ssl_certfile": str(junk)},
        "key not the certificate's": {**base, "ssl_keyfile": str(certs.server_key)},
        "CA file not PEM": {**base, "ssl_ca_certs": str(junk)},
    }[case]
    configure(app, mtls_server.url, use_ssl=use_ssl)
    app.conf.steplock_on_store_error = policy
    store = get_lease_store(app)
    with pytest.raises(LockStoreMisconfigured) as info:
        store.acquire("tls-material", ttl=5)
    print(f"{case}: {info.value!r}")
    assert info.value.setting == "steplock_redis_use_ssl"
    reason = {
        "client certificate not PEM": "not PEM",
        "key not the certificate's": "does not match",
        "CA file not PEM": "not PEM",
    }[case]
    assert reason in str(info.value)
    step = Step.objects.create(name=f"tls {case}")
    result = topo_finish.apply(args=(step.pk,))
    assert result.failed() and isinstance(result.result, LockStoreMisconfigured)
    assert TransitionRecord.objects.filter(step=step).count() == 0
    step.refresh_from_db()
    assert step.status == "pending"


# -- a replica behind a fixed address -----------------------------------------------------


def test_readonly_reply_drops_the_connection(app, tmp_path):
    """A URL that points at a replica (a demoted primary behind a fixed address): the
    refusal is a LockError, and the connection is dropped so that the next call connects
    again (and reaches whatever the address points at by then)."""
    from celery_steplock.exceptions import LockError
    from tests.support.servers import RedisServer

    primary = RedisServer(workdir=tmp_path / "primary").start()
    replica = RedisServer(
        workdir=tmp_path / "replica", args=("--replicaof", "127.0.0.1", primary.port)
    ).start()
    try:
        configure(app, replica.url)
        store = get_lease_store(app)
        admin = redis.Redis(port=replica.port, decode_responses=True)
        for attempt in range(2):
            with pytest.raises(LockError) as info:
                store.acquire("on-a-replica", ttl=5)
            assert "read only replica" in str(info.value)
            # The server sees no connection left whose last command was the refused EVALSHA.
            assert [c for c in admin.client_list() if c["cmd"] == "evalsha"] == []
        assert store.owned("on-a-replica", "nobody") is None  # reads still work
        admin.close()
    finally:
        replica.stop()
        primary.stop()


# -- the asyncio clients: the same settings, the same server, the same errors --------------


def async_round_trip(store, key):
    """A script call and a read through the asyncio twin of ``store``'s client (built from
    the same settings), in a fresh event loop; returns ``(script reply, value read)``."""
    import asyncio

    from celery_steplock import calls
    from celery_steplock.clients import async_client_for

    script = _wire.Script("return redis.call('SET', KEYS[1], ARGV[1], 'PX', 60000)")

    def steps():
        reply = yield calls.Eval(script, [key], ["async"], "async check", name=key)
        value = yield calls.Command(("GET", key), "async read", key=key)
        return reply, value

    async def main():
        return await calls.arun(steps(), async_client_for(store.client))

    return asyncio.run(main())


def test_sentinel_async_client_reaches_the_primary(app, sentinel_group):
    store = sentinel_store(app, sentinel_group)
    primary = sentinel_group.node_client(sentinel_group.primary_port())
    try:
        assert async_round_trip(store, "async:sentinel") == ("OK", "async")
        assert primary.get("async:sentinel") == "async"
    finally:
        primary.delete("async:sentinel")
        primary.close()


def test_tls_async_client_verifies_the_ca(app, tls_server, certs):
    configure(
        app,
        tls_server.url,
        use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.ca_cert)},
    )
    assert async_round_trip(get_lease_store(app), "async:tls") == ("OK", "async")
    configure(
        app,
        tls_server.url,
        use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.other_ca_cert)},
    )
    with pytest.raises(LockStoreMisconfigured) as info:
        async_round_trip(get_lease_store(app), "async:tls-wrong-ca")
    assert info.value.setting == "steplock_redis_use_ssl"
    assert "certificate verification failed" in str(info.value).lower()  # any redis-py
    primary = plain_tls_client(tls_server)
    try:
        assert primary.get("async:tls") == "async"
        assert primary.exists("async:tls-wrong-ca") == 0
    finally:
        primary.close()


def test_mtls_async_client_sends_the_client_certificate(app, mtls_server, certs):
    with_cert = {
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": str(certs.ca_cert),
        "ssl_certfile": str(certs.client_cert),
        "ssl_keyfile": str(certs.client_key),
    }
    configure(app, mtls_server.url, use_ssl=with_cert)
    assert async_round_trip(get_lease_store(app), "async:mtls") == ("OK", "async")
    configure(
        app,
        mtls_server.url,
        use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.ca_cert)},
    )
    with pytest.raises((LockStoreMisconfigured, LockStoreUnavailable)) as info:
        async_round_trip(get_lease_store(app), "async:mtls-no-cert")
    print(f"async mTLS without a certificate: {info.value!r} <- {info.value.__cause__!r}")
    assert isinstance(info.value, LockStoreMisconfigured)
    assert info.value.setting == "steplock_redis_use_ssl"


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize(
    "message",
    [
        "Error while reading from 127.0.0.1:37659 : (104, 'Connection reset by peer')",
        "Error UNEXPECTED_EOF_WHILE_READING: EOF occurred in violation of protocol",
    ],
)
def test_a_reset_of_a_tls_connection_without_a_client_certificate_is_a_refusal(
    flavour, message, certs
):
    # Under TLS 1.3 the server checks the client's certificate after the handshake: whether
    # the client then reads the alert or finds the socket reset is a race, and either way
    # the answer must be the configuration error, from both clients.
    import redis.asyncio

    module = redis if flavour == "sync" else redis.asyncio
    tls = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(certs.ca_cert)}
    without = module.ConnectionPool(connection_class=module.SSLConnection, **tls)
    with_cert = module.ConnectionPool(
        connection_class=module.SSLConnection,
        ssl_certfile=str(certs.client_cert),
        ssl_keyfile=str(certs.client_key),
        **tls,
    )
    plain = module.ConnectionPool()
    reset = redis.ConnectionError(message)
    assert _wire.closed_without_client_certificate(without, reset)
    assert _wire.closed_without_client_certificate(without.make_connection(), reset)
    assert not _wire.closed_without_client_certificate(with_cert, reset)
    assert not _wire.closed_without_client_certificate(with_cert.make_connection(), reset)
    assert not _wire.closed_without_client_certificate(plain, reset)
    refusal = _wire.refused_without_client_certificate(reset)
    assert _wire.misconfiguration(refusal) == (
        "TLS connection closed by the server (a client certificate it requires?)"
    )
    assert not _wire.closed_without_client_certificate(without, redis.TimeoutError("Timeout"))
