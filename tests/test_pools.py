"""Every Celery worker pool (prefork, threads, solo, gevent, eventlet) with real workers on a
real Redis and the test database: duplicates commit once, and a lease held for 3x its TTL
survives a CPU-bound body (the ``spin`` task: ``lock_ttl=3``, no I/O for 9 s), which under
the green pools only a native renewal thread can keep (docs/pools.md).
"""

import importlib.util
import shutil
import signal
import subprocess
import sys
import textwrap

import helpers
import pytest
from helpers import drained, lease_key, stats, stats_settled

from django_app.workflows.models import Step, TransitionRecord
from django_app.workflows.tasks import advance, spin
from tests.support import ROOT
from tests.support.tls import make_certificates

POOLS = ["prefork", "threads", "solo", "gevent", "eventlet"]
GREEN = ("gevent", "eventlet")
SPIN_TTL = 3.0  # spin's lock_ttl
SPIN_SECONDS = 3 * SPIN_TTL
STEPS = 2  # steps sent as duplicates
DUPLICATES = 5  # deliveries per step


def needs(pool):
    if pool in GREEN and importlib.util.find_spec(pool) is None:
        pytest.skip(f"{pool} is not installed")


def records(step):
    return list(TransitionRecord.objects.filter(step=step).values_list("to_status", flat=True))


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pool", POOLS)
def test_pool_commits_duplicates_once_and_keeps_a_lease_through_a_cpu_bound_body(
    pool, start_worker, redis_client
):
    from django.db import connection

    needs(pool)
    # SQLite waits for its write lock inside the C library, which blocks a green pool's
    # whole hub: on SQLite a green worker runs one task at a time (docs/pools.md).
    one = pool == "solo" or (pool in GREEN and connection.vendor == "sqlite")
    workers = [
        start_worker(
            f"{pool}-{i}",
            concurrency=1 if one else 2,
            pool=pool,
            STEPLOCK_DEMO_STATS=1,
            STEPLOCK_RETRY_BACKOFF=0.05,
            STEPLOCK_RETRY_BACKOFF_MAX=0.2,
        )
        for i in (1, 2)
    ]
    for worker in workers:
        if pool in GREEN:
            assert f"event=heartbeat_native pool={pool}" in worker.log_text()
        else:
            assert "heartbeat_native" not in worker.log_text()

    # Rows first: on SQLite the spin's transaction holds the write lock for its whole body.
    long_step = Step.objects.create(name=f"spin-{pool}")
    dup_steps = [Step.objects.create(name=f"dup-{pool}-{i}") for i in range(STEPS)]
    result = spin.apply_async((long_step.pk, SPIN_SECONDS))
    # Seen from outside while the body computes: the fence the lease was granted with and
    # every renewal Redis recorded (its server time in ms).
    first = helpers.wait_until(
        lambda: redis_client.hgetall(lease_key(long_step)),
        timeout=60,
        interval=0.02,
        what="the spin lease",
    )
    # The duplicates go out once the body computes. Sent earlier, while the spin's precheck
    # waits on the database, a green worker could start one beside it whose acquire reply
    # then waits out the 9 s of computing: a lease granted and expired before it was ever
    # registered for renewal, reported lost (rightly; the CAS still commits once).
    helpers.wait_until(
        lambda: redis_client.exists(f"tests:spin-body:{long_step.pk}"),
        timeout=60,
        interval=0.02,
        what="the spin body to start",
    )
    renewals = []

    def finished():
        fields = redis_client.hgetall(lease_key(long_step))
        if fields:
            assert fields["fence"] == first["fence"]  # never re-acquired
            if fields["renewed_ms"] != fields["acquired_ms"] and (
                not renewals or renewals[-1] != int(fields["renewed_ms"])
            ):
                renewals.append(int(fields["renewed_ms"]))
        return result.ready()

    for _ in range(DUPLICATES):
        for step in dup_steps:
            advance.apply_async((step.pk,), {"delay": 0.3})
    helpers.wait_until(finished, timeout=SPIN_SECONDS + 60, interval=0.02, what="the spin task")

    value = result.get(timeout=10)
    assert value["retries"] == 0 and value["fence"] == int(first["fence"])
    assert value["owner"] == first["owner"]
    long_step.refresh_from_db()
    assert long_step.status == "done" and records(long_step) == ["done"]
    assert long_step.attempts == 1
    assert renewals, "Redis never recorded a renewal"

    helpers.wait_until(
        lambda: (
            drained(redis_client)
            and stats(redis_client).get("transition_conflict", 0) >= STEPS * (DUPLICATES - 1)
        ),
        timeout=90,
        what="every duplicate to finish",
    )
    for step in dup_steps:
        step.refresh_from_db()
        assert step.status == "done" and records(step) == ["done"] and step.attempts == 1
    counts = stats_settled(redis_client)
    # Each delivery ends once: committed, or found its step already done.
    assert counts["transition_applied"] == STEPS + 1
    assert counts["transition_conflict"] == STEPS * (DUPLICATES - 1)
    assert counts.get("lock_lost", 0) == 0, [
        line for worker in workers for line in worker.log_text().splitlines() if "lost" in line
    ]
    # 9 s of body under a 3 s TTL needs at least 3 renewals of spin's lease alone.
    assert counts["lock_extended"] >= 3
    assert counts["lock_acquired"] == counts["lock_released"]
    gaps = [(b - a) / 1000 for a, b in zip([int(first["acquired_ms"])] + renewals, renewals)]
    for worker in workers:  # stop them together: a green worker's warm shutdown takes ~5 s
        worker.signal(signal.SIGTERM, group=True)
    print(
        f"\n{pool}: renewals seen {len(renewals)} during {SPIN_SECONDS:g} s, interval "
        f"mean {sum(gaps) / len(gaps):.3f} s max {max(gaps):.3f} s (ttl/3 = "
        f"{SPIN_TTL / 3:.3f} s)"
    )


NATIVE_CHECK = textwrap.dedent("""
    import sys, time
    pool, urls = sys.argv[1], sys.argv[2:]
    if pool == "gevent":
        from gevent import monkey
        monkey.patch_all()
    else:
        import eventlet
        eventlet.monkey_patch()
    import _socket
    import socket
    import redis
    from redis.connection import Connection, ConnectionPool
    from celery_steplock import _green
    from celery_steplock._redis import wire as _wire
    from celery_steplock.heartbeat import Heartbeat
    from celery_steplock.lock import RedisLeaseStore, make_client

    assert _green.green_pool() == pool
    import contextlib
    import redis.utils
    # redis-py 8.2 shares TLS contexts under a lock made after the patching (a green one):
    # held by this greenlet while the renewal thread connects again, it must not stop it
    shared_contexts = getattr(redis.utils, "_SHARED_SSL_CONTEXTS_LOCK", None)
    hb = Heartbeat()
    for url in urls:
        store = RedisLeaseStore(make_client(url), prefix="native-check")
        lease = store.acquire("x", ttl=1.5)  # renewed every 0.5 s: room for a loaded machine
        hb.register(lease, store)
        hb.renewal_store(store).client.connection_pool.disconnect()
        deadline = time.monotonic() + 4.5  # 3 x the TTL without yielding once
        with shared_contexts or contextlib.nullcontext():
            while time.monotonic() < deadline:
                pass
        alive = not lease.lost and store.owned("x", lease.owner) is not None
        pool_ = hb.renewal_store(store).client.connection_pool
        conn = _wire.connection(pool_)
        sock = conn._sock
        print(url.split(":")[0], type(hb.thread).__name__, "renewed", alive, "native",
              isinstance(sock, _socket.socket) and not isinstance(sock, socket.socket))
        pool_.release(conn)
        hb.unregister(lease)
        store.release("x", lease.owner)

    class OwnConnection(Connection):
        def _connect(self):
            return super()._connect()

    # A TLS class of the user's own: the one of its methods that makes the SSLContext
    # (redis-py 8.2), wraps the socket (5.1) or connects (5.0) is overridden.
    from redis.connection import SSLConnection
    helper = next((name for name in ("_build_ssl_context", "_wrap_socket_with_ssl")
                   if hasattr(SSLConnection, name)), "_connect")
    inherited = getattr(SSLConnection, helper)
    OwnTLS = type("OwnTLS", (SSLConnection,), {helper: lambda self, *a: inherited(self, *a)})

    for bad in (redis.Redis(connection_pool=ConnectionPool(connection_class=OwnConnection)),
                redis.Redis(connection_pool=ConnectionPool(connection_class=OwnTLS)),
                redis.Redis(connection_pool=ConnectionPool(
                    connection_class=SSLConnection, ssl_validate_ocsp=True)),
                redis.Redis(connection_pool=type("OwnPool", (ConnectionPool,), {})())):
        try:
            _green.native_client(bad)
        except _green.GreenPoolUnsupported as exc:
            print("refused", exc.pool, exc.setting, pool in str(exc))

    # The worker_init receiver: a worker whose store can be renewed natively starts, one
    # whose client cannot be given unpatched sockets does not.
    from types import SimpleNamespace
    from celery import Celery
    import celery_steplock.lock
    from celery_steplock.heartbeat import _refuse_green_pool_without_native_renewals as hook

    app = Celery("native-check", set_as_current=False)
    app.conf.steplock_redis_url = urls[0]
    hook(sender=SimpleNamespace(app=app))
    print("starts")
    celery_steplock.lock.get_lease_store = lambda app, settings=None: RedisLeaseStore(bad)
    try:
        hook(sender=SimpleNamespace(app=app))
    except SystemExit as exc:
        print("refuses to start", f"the {pool} pool" in str(exc))
""")


@pytest.fixture(scope="module")
def redis_on_three_transports(tmp_path_factory):
    """One redis-server on TCP, TLS (a self-signed CA) and a Unix socket: its three URLs,
    TLS left out where openssl or the server's TLS support is missing."""
    from tests.support import servers

    work = tmp_path_factory.mktemp("transports")
    sock = work / "redis.sock"
    tls_args, tls_url = [], None
    if shutil.which("openssl"):
        certs = make_certificates(work / "certs")
        tls_port = helpers.free_port()
        tls_args = [
            "--tls-port",
            tls_port,
            "--tls-cert-file",
            certs.server_cert,
            "--tls-key-file",
            certs.server_key,
            "--tls-ca-cert-file",
            certs.ca_cert,
            "--tls-auth-clients",
            "no",
        ]
        tls_url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs.ca_cert}"
    server = None
    for args in ([*tls_args, "--unixsocket", sock], ["--unixsocket", sock]):
        try:
            server = servers.RedisServer(workdir=work / "data", args=args).start()
            break
        except Exception:  # noqa: BLE001 - a server built without TLS: go on without it
            tls_url = None
    assert server is not None
    yield [server.url, f"unix://{sock}?db=0"] + ([tls_url] if tls_url else [])
    server.stop()


@pytest.mark.no_database  # a process of its own on Redis alone: once, in the common pass
@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_green_heartbeat_renews_from_a_native_thread_or_refuses(pool, redis_on_three_transports):
    needs(pool)
    urls = redis_on_three_transports
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", NATIVE_CHECK, pool, *urls],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"{url.split(':')[0]} NativeThread renewed True native True" for url in urls
    ] + [
        f"refused {pool} worker_pool True",
        f"refused {pool} worker_pool True",
        f"refused {pool} worker_pool True",
        f"refused {pool} worker_pool True",
        "starts",
        "refuses to start True",
    ]
