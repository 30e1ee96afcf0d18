"""The lease store and StepLockedTask over a real Redis Cluster: 3 primaries + 3 replicas on
loopback (tests/support/cluster.py), with a primary failover and a slot migration while
leases are held."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster as RedisClusterClient
from redis.connection import Connection

from celery_steplock._redis import cluster as _cluster
from celery_steplock._redis import wire as _wire
from celery_steplock.conf import Settings
from celery_steplock.exceptions import ImproperlyConfigured, LockError, LockNameError
from celery_steplock.heartbeat import Heartbeat
from celery_steplock.keys import check_name, fence_key, lease_key, wake_key, waiters_key
from celery_steplock.lock import ClusterLeaseStore, RedisLeaseStore, get_lease_store, make_client
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord
from tests.support.cluster import RedisCluster
from tests.support.servers import wait_until
from tests.helpers import set_settings

pytestmark = pytest.mark.redis_shape

PREFIX = "ct"


@pytest.fixture
def cluster(redis_cluster):
    """The session's cluster (tests/support/topologies.py), shared with the patterns' tests:
    a failover or a slot migration here leaves it serving every slot."""
    return redis_cluster


@pytest.fixture
def client(cluster):
    cluster.wait_ok()
    client = make_client(cluster.url, cluster=True)
    for node in client.get_primaries():
        client.get_redis_connection(node).flushdb()
    yield client
    client.close()


@pytest.fixture
def store(client):
    return RedisLeaseStore(client, prefix=PREFIX)


@pytest.fixture
def cluster_app(app, cluster, client):
    """The Celery app with its lease store on the cluster (the session Redis stays the
    broker)."""
    set_settings(app, steplock_redis_url=cluster.url, steplock_redis_cluster=True)
    return app


def names_on_every_primary(cluster, count: int, stem: str, prefix: str = PREFIX) -> list[str]:
    """``count`` names whose leases are spread over every primary (asserted)."""
    names = [f"{stem}:{n}" for n in range(count)]
    owners = cluster.slot_owners()
    ports = {owners[_cluster.slot_of(lease_key(prefix, name))] for name in names}
    assert ports == {node.port for node in cluster.primaries()}
    return names


def primary_of(cluster, key: str):
    return cluster.node_by_port(cluster.slot_owners()[_cluster.slot_of(key)])


class CountingConnection(Connection):
    """A redis-py connection that counts its round trips (a write followed by a read) per
    server port, to check what the client does on the wire."""

    round_trips: dict[int, int] = {}
    _guard = threading.Lock()

    def send_packed_command(self, command, check_health=True):
        self._pending = True
        return super().send_packed_command(command, check_health)

    def read_response(self, *args, **kwargs):
        if getattr(self, "_pending", False):
            self._pending = False
            with self._guard:
                self.round_trips[self.port] = self.round_trips.get(self.port, 0) + 1
        return super().read_response(*args, **kwargs)


# -- configuration and key layout -----------------------------------------------------------


def test_every_key_of_a_lease_is_in_one_slot():
    for name in ("order:42", "a", "tests.finish:" + "f" * 64, "naïve:ü"):
        slots = {
            _cluster.slot_of(key(PREFIX, name))
            for key in (lease_key, fence_key, waiters_key, wake_key)
        }
        assert len(slots) == 1, name
    # The hash tag is the whole name: two names never share a tag, whatever they contain.
    assert _cluster.slot_of(lease_key(PREFIX, "order:42")) == redis.crc.key_slot(b"order:42")
    for bad in ("a{b}", "{x}", "a}b", "a{b"):
        with pytest.raises(LockNameError, match="braces"):
            check_name(bad)


def test_setting_validated_and_selects_the_cluster_client(cluster_app):
    assert Settings(cluster_app).redis_cluster is True
    store = get_lease_store(cluster_app)
    assert isinstance(store, ClusterLeaseStore)
    assert isinstance(store.client, RedisClusterClient)
    set_settings(cluster_app, steplock_redis_cluster="yes")
    with pytest.raises(ImproperlyConfigured, match="steplock_redis_cluster"):
        Settings(cluster_app).redis_cluster
    set_settings(cluster_app, steplock_redis_cluster=False)
    assert type(get_lease_store(cluster_app)) is RedisLeaseStore


def test_plain_client_on_a_cluster_node_names_the_setting(cluster, store):
    # A key the URL's node does not serve: the plain client gets MOVED.
    node = cluster.primaries()[0]
    name = next(
        f"elsewhere:{n}"
        for n in range(1000)
        if primary_of(cluster, lease_key(PREFIX, f"elsewhere:{n}")) is not node
    )
    plain = RedisLeaseStore(make_client(node.url), prefix=PREFIX)
    with pytest.raises(LockError, match="MOVED.*steplock_redis_cluster = True"):
        plain.acquire(name, ttl=5)


def test_cluster_unreachable_at_start_is_an_outage_not_a_crash(cluster):
    from celery_steplock.exceptions import LockStoreUnavailable
    from tests.helpers import closed_port_url

    down = RedisLeaseStore(make_client(closed_port_url(), 0.3, cluster=True), prefix=PREFIX)
    assert isinstance(down, ClusterLeaseStore)
    assert isinstance(down.client, _cluster.DeferredCluster)
    for call in (
        lambda: down.acquire("a", ttl=5),
        lambda: down.acquire("a", ttl=5, wait=0.2),
        lambda: down.extend_many([("a", "o", 5.0)]),
        lambda: list(down.iter_leases()),
        lambda: down.release("a", "o"),
        lambda: down.inspect("a"),
    ):
        with pytest.raises(LockStoreUnavailable):
            call()
    # Built at the first use that finds the cluster.
    late = _cluster.DeferredCluster(lambda: make_client(cluster.url, cluster=True), 5.0)
    store = RedisLeaseStore(late, prefix=PREFIX)
    lease = store.acquire("late", ttl=5)
    assert lease is not None and store.extend_many([("late", lease.owner, 5.0)]) == [True]
    assert isinstance(late.get(), RedisClusterClient)
    assert store.release("late", lease.owner) is True


def test_cluster_setting_on_a_single_node_is_a_configuration_error(redis_server_url):
    with pytest.raises(ImproperlyConfigured, match="not in cluster mode") as caught:
        make_client(redis_server_url, cluster=True)
    assert caught.value.setting == "steplock_redis_cluster"


def test_cluster_url_with_a_database_other_than_0_is_refused(cluster):
    url = cluster.url.rsplit("/", 1)[0] + "/3"
    with pytest.raises(ImproperlyConfigured, match="database 0") as caught:
        make_client(url, cluster=True)
    assert caught.value.setting == "steplock_redis_url"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_task_on_a_cluster_url_with_a_database_never_runs(cluster_app, cluster, policy):
    set_settings(cluster_app, steplock_redis_url=cluster.url.rsplit("/", 1)[0] + "/3")
    set_settings(cluster_app, steplock_on_store_error=policy)
    step = Step.objects.create(name="db3")
    result = cluster_finish.apply(args=(step.pk,))
    assert result.failed()
    assert isinstance(result.result, ImproperlyConfigured), result.result
    assert result.result.setting == "steplock_redis_url"
    assert TransitionRecord.objects.filter(step_id=step.pk).count() == 0
    assert Step.objects.get(pk=step.pk).status == "pending"


def test_cluster_connection_options_reach_every_node(cluster, client):
    named = make_client(
        cluster.url,
        cluster=True,
        transport_options={"client_name": "steplock-cluster-x", "socket_keepalive": True},
    )
    store = RedisLeaseStore(named, prefix=PREFIX)
    try:
        names = names_on_every_primary(cluster, 12, "named")
        leases = [store.acquire(name, ttl=5) for name in names]
        assert all(lease is not None for lease in leases)
        for node in cluster.primaries():
            admin = cluster.client(node)
            try:
                clients = [c["name"] for c in admin.client_list()]
            finally:
                admin.close()
            assert "steplock-cluster-x" in clients, (node.port, clients)
        for node in named.get_nodes():
            kwargs = node.redis_connection.connection_pool.connection_kwargs
            assert kwargs["client_name"] == "steplock-cluster-x"
            assert kwargs["socket_keepalive"] is True
        assert [store.release(n, lease.owner) for n, lease in zip(names, leases)] == [True] * len(
            names
        )
    finally:
        named.close()


def test_cluster_tls_options_are_used_not_dropped(cluster):
    """TLS options with a redis:// URL turn TLS on for every node: against this plaintext
    cluster no node completes a handshake, so the client stays deferred (an outage), where
    dropping the options would have connected in plain text."""
    from celery_steplock.exceptions import LockStoreUnavailable

    tls = make_client(cluster.url, 0.5, cluster=True, use_ssl={"ssl_cert_reqs": "none"})
    assert isinstance(tls, _cluster.DeferredCluster)
    with pytest.raises(LockStoreUnavailable):
        RedisLeaseStore(tls, prefix=PREFIX).acquire("tls", ttl=5)
    assert tls._client is None


def test_cluster_options_redis_py_would_drop_are_refused(cluster):
    allowed = getattr(redis.cluster, "REDIS_ALLOWED_KEYS", ())
    dropped = [key for key in ("health_check_interval",) if key not in allowed]
    if not dropped:
        client = make_client(
            cluster.url, cluster=True, transport_options={"health_check_interval": 5}
        )
        assert all(
            n.redis_connection.connection_pool.connection_kwargs["health_check_interval"] == 5
            for n in client.get_nodes()
        )
        client.close()
        return
    with pytest.raises(ImproperlyConfigured, match="health_check_interval") as caught:
        make_client(cluster.url, cluster=True, transport_options={"health_check_interval": 5})
    assert caught.value.setting == "steplock_redis_transport_options"


def test_ignored_combinations_are_refused(app, tmp_path):
    from celery_steplock.clients import ClientConfig

    def factory(settings):
        return redis.Redis()

    set_settings(app, steplock_redis_client_factory=factory)
    set_settings(app, steplock_redis_cluster=True)
    with pytest.raises(ImproperlyConfigured, match="steplock_redis_client_factory") as caught:
        ClientConfig(Settings(app))
    assert caught.value.setting == "steplock_redis_cluster"
    set_settings(app, steplock_redis_client_factory=None)
    set_settings(app, steplock_redis_cluster=False)
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    set_settings(app, steplock_redis_url="unix:///tmp/redis-none.sock")
    set_settings(
        app, steplock_redis_use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": str(ca)}
    )
    with pytest.raises(ImproperlyConfigured, match="unix://") as caught:
        ClientConfig(Settings(app))
    assert caught.value.setting == "steplock_redis_use_ssl"
    with pytest.raises(ImproperlyConfigured) as caught:
        make_client("unix:///tmp/redis-none.sock", use_ssl={"ssl_cert_reqs": "none"})
    assert caught.value.setting == "steplock_redis_use_ssl"


def test_green_pool_refuses_a_deferred_cluster_without_building_it():
    from celery_steplock import _green
    from tests.helpers import closed_port_url

    builds = []

    def build():
        builds.append(1)
        raise AssertionError("built")

    deferred = _cluster.DeferredCluster(build, 0.3)
    with pytest.raises(_green.GreenPoolUnsupported, match="RedisCluster") as caught:
        _green.native_client(deferred, "gevent")
    assert caught.value.pool == "gevent"
    assert builds == []
    down = RedisLeaseStore(make_client(closed_port_url(), 0.3, cluster=True), prefix=PREFIX)
    with pytest.raises(_green.GreenPoolUnsupported):
        _green.native_store(down, "eventlet")


@pytest.mark.django_db(transaction=True)
def test_task_with_the_cluster_down_follows_the_store_error_policy(cluster_app):
    from celery_steplock.exceptions import LockStoreUnavailable
    from tests.helpers import closed_port_url

    set_settings(cluster_app, steplock_redis_url=closed_port_url(), steplock_socket_timeout=0.3)
    step = Step.objects.create(name="down")
    result = cluster_finish.apply(args=(step.pk,))
    assert isinstance(result.result, LockStoreUnavailable)  # fail_closed: retried, then failed
    assert TransitionRecord.objects.filter(step_id=step.pk).count() == 0
    assert Step.objects.get(pk=step.pk).status == "pending"


# -- the lock cycle -------------------------------------------------------------------------


def test_lock_cycle_over_the_cluster(cluster, store):
    lease = store.acquire("order:42", ttl=10, metadata={"task_id": "t-1"})
    assert lease is not None and lease.fence > 0
    assert store.acquire("order:42", ttl=10) is None  # contention
    again = store.acquire("order:42", owner=lease.owner, ttl=10)  # re-entrant
    assert again is not None and again.fence == lease.fence
    assert 9 < store.owned("order:42", lease.owner) <= 10
    assert store.owned("order:42", "someone-else") is None
    info = store.inspect("order:42")
    assert info["owner"] == lease.owner and info["task_id"] == "t-1"
    assert info["key"] == f"{PREFIX}:lease:{{order:42}}"
    assert store.extend("order:42", lease.owner, 20) is True
    assert 19 < store.owned("order:42", lease.owner) <= 20

    # wait/wake: a waiter blocked on the slot's node is woken by the release, long before
    # the holder's TTL (20 s) would have let it in.
    got = []
    waiter = threading.Thread(
        target=lambda: got.append((store.acquire("order:42", ttl=10, wait=8.0), time.monotonic()))
    )
    waiter.start()
    wait_until(
        lambda: store.client.zcard(waiters_key(PREFIX, "order:42")) == 1,
        5,
        what="the waiter to be recorded",
    )
    released_at = time.monotonic()
    assert store.release("order:42", lease.owner) is True
    waiter.join(10)
    [(second, woke_at)] = got
    assert second is not None and second.owner != lease.owner
    assert second.fence > lease.fence
    assert woke_at - released_at < 5.0
    assert store.release("order:42", lease.owner) is False  # not ours any more

    # reap: only while owner and renewal time are what was observed
    seen = store.inspect("order:42")
    assert store.reap("order:42", second.owner, "0") is False
    assert store.reap("order:42", second.owner, seen["renewed_ms"]) is True
    assert store.inspect("order:42") is None


def test_one_round_trip_per_node_per_renewal_cycle(cluster):
    CountingConnection.round_trips.clear()
    client = RedisClusterClient.from_url(
        cluster.url, connection_class=CountingConnection, decode_responses=True
    )
    store = RedisLeaseStore(client, prefix=PREFIX)
    names = names_on_every_primary(cluster, 60, "rt")
    slots = {_cluster.slot_of(lease_key(PREFIX, name)) for name in names}
    assert len(slots) > len(cluster.primaries())  # many slots per node: many script calls
    leases = [store.acquire(name, ttl=3.0) for name in names]
    assert all(leases)
    # A first renewal loads the script on each node (NOSCRIPT: two more round trips there).
    assert store.extend_many([(le.name, le.owner, 3.0) for le in leases]) == [True] * 60
    before = {name: store.inspect(name)["renewed_ms"] for name in names}
    time.sleep(0.01)

    heartbeat = Heartbeat()
    CountingConnection.round_trips.clear()
    for lease in leases:
        heartbeat.register(lease, store, ratio=0.5)  # every 1.5 s
    wait_until(lambda: heartbeat.round_trips >= 1, 10, what="one renewal cycle")
    counted = dict(CountingConnection.round_trips)
    for lease in leases:
        heartbeat.unregister(lease)
    assert heartbeat.cycles == 1 and heartbeat.round_trips == 1
    assert counted == {node.port: 1 for node in cluster.primaries()}
    assert all(not lease.lost for lease in leases)
    after = {name: store.inspect(name)["renewed_ms"] for name in names}
    assert all(int(after[name]) > int(before[name]) for name in names)
    for lease in leases:
        store.release(lease.name, lease.owner)
    client.close()


def test_reap_many_and_read_leases_span_slots(cluster, store):
    names = names_on_every_primary(cluster, 12, "rm")
    leases = [store.acquire(name, ttl=30) for name in names]
    infos = store.read_leases([lease_key(PREFIX, name) for name in names])
    assert [infos[lease_key(PREFIX, n)]["owner"] for n in names] == [le.owner for le in leases]
    items = [(le.name, le.owner, infos[le.key]["renewed_ms"]) for le in leases]
    items[0] = (items[0][0], items[0][1], "0")  # renewed since: spared
    assert store.reap_many(items) == [False] + [True] * (len(names) - 1)
    assert store.inspect(names[0]) is not None
    assert all(store.inspect(name) is None for name in names[1:])


# -- scans ----------------------------------------------------------------------------------


def test_scan_walks_every_primary(cluster, store):
    names = names_on_every_primary(cluster, 30, "scan")
    for name in names:
        assert store.acquire(name, ttl=30, metadata={"task_name": "t"})
    assert sorted(info["name"] for info in store.iter_leases()) == sorted(names)
    assert sorted(i["name"] for i in store.iter_leases(match="scan:1*")) == sorted(
        n for n in names if n.startswith("scan:1")
    )

    # Small steps: the cursor goes through every primary; each step stays on one.
    cursor, seen, primaries_seen, steps = 0, set(), [], 0
    while True:
        cursor, keys = store.scan_keys(cursor, count=2)
        seen.update(keys)
        steps += 1
        if cursor:
            slot, _node_cursor = _cluster.decode_cursor(cursor)
            owner = cluster.slot_owners()[slot]
            if not primaries_seen or primaries_seen[-1] != owner:
                primaries_seen.append(owner)
        if cursor == 0:
            break
        assert steps < 10000
    assert seen == {lease_key(PREFIX, name) for name in names}
    assert set(primaries_seen) <= {n.port for n in cluster.primaries()}
    assert len(set(primaries_seen)) >= 2


def test_admin_page_walk_sees_leases_on_every_primary(cluster, store):
    from celery_steplock.contrib.django.leases import lease_page

    names = names_on_every_primary(cluster, 25, "adm")
    for name in names:
        assert store.acquire(name, ttl=30, metadata={"task_name": "t"})
    found, cursor, pages = [], 0, 0
    while True:
        page = lease_page(store, cursor, per_page=10)
        found.extend(info["name"] for info in page.leases)
        cursor, pages = page.next_cursor, pages + 1
        if page.complete:
            break
        assert pages < 100
    assert sorted(set(found)) == sorted(names)
    # lease + fencing counter + history (issue 30), every primary counted
    assert page.db_keys == 3 * len(names)


def test_cli_ls_and_the_reaper_see_every_primary(cluster, cluster_app, worker_env):
    import json
    import subprocess
    import sys

    from celery_steplock.reaper import reap

    store = get_lease_store(cluster_app)
    names = names_on_every_primary(cluster, 9, "cli", prefix=store.prefix)
    for name in names:
        assert store.acquire(name, ttl=60, metadata={"task_name": "t", "worker": "w@x"})
    env = {**worker_env, "STEPLOCK_REDIS_URL": cluster.url, "STEPLOCK_REDIS_CLUSTER": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "ls", "--json"],
        env=env,
        cwd=worker_env["PYTHONPATH"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(row["name"] for row in json.loads(done.stdout)) == sorted(names)

    # The reaper: silent holders on every primary, last renewed a minute ago, are reaped.
    dead = names_on_every_primary(cluster, 9, "dead", prefix=store.prefix)
    for name in dead:
        assert store.acquire(
            name,
            ttl=60,
            metadata={
                "task_name": "t",
                "worker": "ghost@nowhere.invalid",
                "hostname": "elsewhere.invalid",
                "pid": "4242",
            },
        )
        now_s, now_us = store.client.time()
        store.client.hset(
            store.key(name), "renewed_ms", int(now_s) * 1000 + int(now_us) // 1000 - 60_000
        )
    report = reap(cluster_app, ping_timeout=0.3)
    assert report.ok, report.errors
    assert report.leases_scanned == len(names) + len(dead)
    assert sorted(r["name"] for r in report.leases_reaped) == sorted(dead)
    assert all(store.inspect(name) is None for name in dead)
    assert all(store.inspect(name) is not None for name in names)


# -- faults ---------------------------------------------------------------------------------


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.cluster_finish",
    lock_key="cstep:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
    lock_ttl=3.0,
)
def cluster_finish(self, step_id, hold=0.0):
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        time.sleep(0.05)
        self.lease.check()
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status="done",
        owner=self.lease.owner,
        fence=self.lease.fence,
        task_id=self.request.id or "",
    )
    return self.lease.fence


def run_until_done(steps, attempts=40):
    """Run the task again on every step not yet done (a Celery retry, in-process)."""
    for _ in range(attempts):
        pending = [s for s in steps if Step.objects.get(pk=s.pk).status != "done"]
        if not pending:
            return
        for step in pending:
            cluster_finish.apply(args=(step.pk,))
        time.sleep(0.25)
    raise AssertionError("steps still not done")


@pytest.mark.django_db(transaction=True)
def test_step_locked_task_end_to_end_on_the_cluster(cluster_app):
    step = Step.objects.create(name="c")
    result = cluster_finish.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    fence = result.result
    assert fence > 0
    step.refresh_from_db()
    assert step.status == "done" and step.lock_fence == fence
    assert TransitionRecord.objects.filter(step_id=step.pk).count() == 1
    store = get_lease_store(cluster_app)
    assert store.inspect(f"cstep:{step.pk}") is None  # released
    duplicate = cluster_finish.apply(args=(step.pk,))  # another task id: the body is skipped
    assert (duplicate.state, duplicate.result["steplock"]) == ("SUCCESS", "duplicate")
    assert TransitionRecord.objects.filter(step_id=step.pk).count() == 1


def _hold_and_run_through(cluster, cluster_app, fault, ttl):
    """Hold leases on every primary (renewed by the process heartbeat), run the task on
    several steps (each twice, at once) while ``fault()`` runs, then check: no crash, every
    held lease renewed or reported lost, every step committed exactly once."""
    from celery_steplock.heartbeat import get_heartbeat

    store = get_lease_store(cluster_app)
    heartbeat = get_heartbeat()
    names = names_on_every_primary(cluster, 24, "h", prefix=store.prefix)
    held = [store.acquire(name, ttl=ttl) for name in names]
    assert all(held)
    for lease in held:
        heartbeat.register(lease, store)
    steps = [Step.objects.create(name=f"f{n}") for n in range(6)]
    outcomes: list[str] = []

    def run(step):
        from django.db import connection

        try:
            result = cluster_finish.apply(args=(step.pk,), kwargs={"hold": 1.0})
            outcomes.append(result.state if result.successful() else type(result.result).__name__)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(s,)) for s in steps for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    fault()
    for t in threads:
        t.join(60)
    assert len(outcomes) == len(threads)
    run_until_done(steps)
    cycles = heartbeat.cycles
    wait_until(
        lambda: heartbeat.cycles >= cycles + 2, 4 * ttl, what="two renewal cycles after the fault"
    )
    try:
        assert heartbeat.thread is not None and heartbeat.thread.is_alive()
        for lease in held:
            if not lease.lost:
                assert store.owned(lease.name, lease.owner) is not None, lease.name
        for step in steps:
            assert TransitionRecord.objects.filter(step_id=step.pk).count() == 1
            assert Step.objects.get(pk=step.pk).status == "done"
    finally:
        for lease in held:
            heartbeat.unregister(lease)
    return held, outcomes


@pytest.mark.django_db(transaction=True)
def test_coordinated_failover_while_leases_are_held(cluster, cluster_app):
    def fault():
        cluster.failover(cluster.primaries()[0])

    # TTL 9 s: renewals every 3 s outlast the pause of a manual failover (at most 5 s).
    held, outcomes = _hold_and_run_through(cluster, cluster_app, fault, ttl=9.0)
    # A coordinated failover loses nothing acknowledged: the held leases keep being renewed.
    assert [lease.name for lease in held if lease.lost] == []
    assert "SUCCESS" in outcomes


@pytest.mark.django_db(transaction=True)
def test_killed_primary_while_leases_are_held(cluster_app):
    with RedisCluster(primaries=3, replicas_per_primary=1, node_timeout=1000) as own:
        set_settings(cluster_app, steplock_redis_url=own.url)
        victim = own.primaries()[1]
        owners = own.slot_owners()

        held, _outcomes = _hold_and_run_through(
            own, cluster_app, lambda: own.kill_primary(victim), ttl=6.0
        )
        # Leases on the surviving primaries were renewed throughout (each cycle renews what
        # the nodes that answered hold); those of the killed one are renewed on its promoted
        # replica or reported lost, never silently kept.
        lost = {lease.name for lease in held if lease.lost}
        on_victim = {
            lease.name for lease in held if owners[_cluster.slot_of(lease.key)] == victim.port
        }
        assert lost <= on_victim


def test_slot_migration_while_a_lease_is_held(cluster, store):
    name = "migrating"
    key = lease_key(PREFIX, name)
    slot = _cluster.slot_of(key)
    # A second lease in the same slot: one EXTEND_MANY call carries both.
    twin = next(
        f"twin:{n}"
        for n in range(200000)
        if _cluster.slot_of(lease_key(PREFIX, f"twin:{n}")) == slot
    )
    lease = store.acquire(name, ttl=30)
    other = store.acquire(twin, ttl=30)
    source = primary_of(cluster, key)
    target = next(node for node in cluster.primaries() if node is not source)
    items = [(name, lease.owner, 30.0), (twin, other.owner, 30.0)]

    cluster.begin_migration(slot, target)  # keys still on the source
    assert store.extend_many(items) == [True, True]
    assert store.owned(name, lease.owner) is not None

    cluster.move_keys(slot, source, target)  # keys on the target: ASK
    assert store.owned(name, lease.owner) is not None
    assert store.extend(name, lease.owner, 30) is True
    assert store.extend_many(items) == [True, True]
    assert store.inspect(name)["owner"] == lease.owner

    # A release touches three keys of the slot, two of them absent: Redis answers TRYAGAIN
    # until the migration completes; the store waits it out.
    done = []
    releaser = threading.Thread(target=lambda: done.append(store.release(name, lease.owner)))
    releaser.start()
    time.sleep(0.3)
    cluster.finish_migration(slot, target)  # MOVED from now on
    releaser.join(10)
    assert done == [True]
    assert store.owned(name, lease.owner) is None

    assert store.extend_many([(twin, other.owner, 30.0)]) == [True]
    again = store.acquire(name, ttl=30)
    assert again is not None and again.fence > lease.fence
    assert store.release(name, again.owner) is True
    assert store.release(twin, other.owner) is True
    assert primary_of(cluster, key) is target


def test_a_migration_that_outlasts_the_tryagain_wait_is_an_outage(cluster, store, monkeypatch):
    # docs/cluster.md: TRYAGAIN is resent for TRYAGAIN_WAIT, then the store is reported
    # unavailable (the task retries as in an outage), never refused (a LockError fails it)
    from celery_steplock.exceptions import LockStoreUnavailable

    monkeypatch.setattr(_cluster, "TRYAGAIN_WAIT", 0.3)
    name = "stuck-migration"
    key = lease_key(PREFIX, name)
    slot = _cluster.slot_of(key)
    lease = store.acquire(name, ttl=30)
    source = primary_of(cluster, key)
    target = next(node for node in cluster.primaries() if node is not source)
    cluster.begin_migration(slot, target)
    cluster.move_keys(slot, source, target)
    began = time.monotonic()
    with pytest.raises(LockStoreUnavailable) as caught:
        store.release(name, lease.owner)  # three keys of the slot, two absent: TRYAGAIN
    assert 0.3 <= time.monotonic() - began < 5
    assert isinstance(caught.value.__cause__, _cluster.SlotUnavailable)
    assert "TRYAGAIN after 0.3 s" in str(caught.value)
    cluster.finish_migration(slot, target)
    assert store.release(name, lease.owner) is True
    assert store.owned(name, lease.owner) is None


def test_a_renewal_of_a_half_migrated_slot_is_resent_one_lease_per_call(
    cluster, store, monkeypatch
):
    # One EXTEND_MANY call carries both leases of a slot; one of them has moved to the
    # importing node (ASK) and the other not: the call meets TRYAGAIN until the migration
    # ends. After TRYAGAIN_WAIT it is resent one lease per call, each following ASK: both
    # renewed, none reported unavailable or lost.
    monkeypatch.setattr(_cluster, "TRYAGAIN_WAIT", 0.3)
    name = "half-migrated"
    key = lease_key(PREFIX, name)
    slot = _cluster.slot_of(key)
    twin = next(
        f"half:{n}"
        for n in range(200000)
        if _cluster.slot_of(lease_key(PREFIX, f"half:{n}")) == slot
    )
    lease = store.acquire(name, ttl=30)
    other = store.acquire(twin, ttl=30)
    source = primary_of(cluster, key)
    target = next(node for node in cluster.primaries() if node is not source)
    cluster.begin_migration(slot, target)
    src = cluster.client(source)
    src.execute_command("MIGRATE", "127.0.0.1", target.port, key, 0, 5000)
    items = [(name, lease.owner, 30.0), (twin, other.owner, 30.0)]
    assert store.extend_many(items) == [True, True]
    cluster.move_keys(slot, source, target)
    cluster.finish_migration(slot, target)
    assert store.release(name, lease.owner) is True
    assert store.release(twin, other.owner) is True


@pytest.mark.django_db
def test_admin_changelist_pages_through_every_primary(
    cluster, cluster_app, admin_client, monkeypatch
):
    from collections import Counter

    from django.urls import reverse

    from celery_steplock.contrib.django.admin import LeaseAdmin
    from celery_steplock.lock import holder_metadata
    from django_app.workflows.tasks import advance

    monkeypatch.setattr(LeaseAdmin, "list_per_page", 10)
    store = get_lease_store(cluster_app)
    names = names_on_every_primary(cluster, 35, "page", prefix=store.prefix)
    for n, name in enumerate(names):
        assert store.acquire(
            name, ttl=60, metadata=holder_metadata(f"task-{n}", advance.name, 0, worker="w@box")
        )
    url, seen, query, pages = reverse("admin:celery_steplock_lease_changelist"), Counter(), "?", 0
    while query is not None:
        response = admin_client.get(url + query)
        assert response.status_code == 200
        assert response.context["page"] is not None  # no store error
        seen.update(row["lease"].name for row in response.context["rows"])
        query = response.context["next_url"]
        pages += 1
        assert pages < 100
    assert set(seen) == set(names) and set(seen.values()) == {1}
    assert pages >= 4


# -- the asyncio client ---------------------------------------------------------------------


def test_async_client_of_a_cluster_routes_each_call_to_its_slot(cluster, store):
    """The asyncio twin of the cluster client (redis.asyncio.cluster.RedisCluster, from the
    same startup node and options) runs the lease scripts on the primary owning each name's
    slot, one call and a pipelined batch spanning every primary."""
    import asyncio

    from celery_steplock import calls
    from celery_steplock._redis.scripts import lease as lease_scripts
    from celery_steplock.clients import async_client_for

    names = names_on_every_primary(cluster, 12, "async")
    owners = [f"owner-{n}" for n in range(len(names))]
    extend = _wire.Script(lease_scripts.EXTEND)

    def steps():
        replies = []
        for name, owner in zip(names, owners):
            key = lease_key(PREFIX, name)
            replies.append((yield calls.Command(("HSET", key, "owner", owner), "seed", key=key)))
            yield calls.Command(("PEXPIRE", key, 60000), "seed", key=key)
        one = yield calls.Eval(
            extend, [lease_key(PREFIX, names[0])], [owners[0], "30000"], "extend"
        )
        many = yield calls.EvalMany(
            extend,
            [([lease_key(PREFIX, n)], [o, "40000"]) for n, o in zip(names, owners)],
            "renewal",
        )
        return replies, one, many

    async def main():
        client = async_client_for(store.client)
        try:
            return await calls.arun(steps(), client)
        finally:
            await (getattr(client, "aclose", None) or client.close)()  # redis-py 5.0: close

    replies, one, many = asyncio.run(main())
    assert replies == [1] * len(names)
    assert one == 1 and many == [1] * len(names)
    for name, owner in zip(names, owners):
        key = lease_key(PREFIX, name)
        node = cluster.client(primary_of(cluster, key))
        try:
            assert node.hget(key, "owner") == owner
            assert 30_000 < node.pttl(key) <= 40_000
        finally:
            node.close()
