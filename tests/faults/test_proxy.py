"""The fault-injecting TCP proxy (tests/support/faults/proxy.py) against real servers.

Every test talks to a real redis-server (and one to a real PostgreSQL, when installed)
through the proxy with real clients. Timing bounds leave wide margins for a loaded 2-core
machine: lower bounds are exact (latency can only add), upper bounds are generous.
"""

from __future__ import annotations

import resource
import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support import servers
from tests.support.faults.proxy import TcpProxy

PING = b"*1\r\n$4\r\nPING\r\n"
PONG = b"+PONG\r\n"


@pytest.fixture(scope="module")
def server_a():
    server = servers.RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server_b():
    server = servers.RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def direct(server_a):
    """A client straight to server A (not through the proxy), on a flushed database."""
    client = redis.Redis(port=server_a.port, socket_timeout=5)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def proxy(server_a, direct):
    proxy = TcpProxy("127.0.0.1", server_a.port).start()
    yield proxy
    proxy.stop()


def client(port: int, timeout: float = 5.0) -> redis.Redis:
    """A redis-py client on one connection with retries off, so every fault surfaces.

    (A pooled client would notice a dropped idle connection when taking it from the pool
    and silently reconnect.)"""
    return redis.Redis(
        port=port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        single_connection_client=True,
    )


def raw(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError(f"EOF after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def recv_until_eof(sock: socket.socket) -> bytes:
    data = bytearray()
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return bytes(data)
        data += chunk


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


def timed(fn, *args):
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_forwards_and_counts_bytes(proxy):
    sock = raw(proxy.port)
    sock.sendall(PING)
    assert recv_exactly(sock, len(PONG)) == PONG
    # The loop thread counts bytes_down just after writing them: it may not have yet.
    wait_until(lambda: proxy.stats["bytes_down"] == len(PONG))
    stats = proxy.stats
    assert stats["connections_total"] == 1
    assert stats["connections_open"] == 1
    assert stats["bytes_up"] == len(PING)
    assert stats["bytes_down"] == len(PONG)
    assert stats["dropped"] == 0
    sock.close()
    wait_until(lambda: proxy.stats["connections_open"] == 0)

    r = client(proxy.port)
    assert r.set("greeting", "hello")
    assert r.get("greeting") == b"hello"
    assert proxy.stats["connections_total"] == 2
    r.close()


def test_url_lifecycle_and_restart(server_a):
    proxy = TcpProxy("127.0.0.1", server_a.port)
    port = proxy.port
    assert proxy.url() == f"redis://127.0.0.1:{port}/0"
    assert (
        proxy.url("postgresql", "/steplock", user="postgres")
        == f"postgresql://postgres@127.0.0.1:{port}/steplock"
    )
    with proxy as started:
        assert started is proxy
        assert client(port).ping()
    proxy.stop()  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # Restarting listens on the same port again.
    with proxy:
        assert proxy.port == port
        assert client(port).ping()
    TcpProxy("127.0.0.1", server_a.port).stop()  # never started: just releases the port


def test_latency_round_trip(proxy):
    r = client(proxy.port)
    assert r.ping()  # connect and handshake first
    proxy.set_latency(0.2)
    assert proxy.latency == 0.2
    ok, elapsed = timed(r.ping)
    assert ok
    assert 0.4 <= elapsed < 0.4 + 2.0  # 0.2 s each way, and nothing like a stall of it
    proxy.set_latency(0)
    # With the latency still there every PING would take 0.4 s: the quickest of a few shows
    # it is gone, whatever a loaded machine does to one of them.
    fastest = min(timed(r.ping)[1] for _ in range(5))
    assert fastest < 0.2
    with pytest.raises(ValueError):
        proxy.set_latency(-1)


def test_latency_is_per_chunk_not_cumulative(proxy):
    r = client(proxy.port)
    r.ping()
    proxy.set_latency(0.05)
    pipe = r.pipeline(transaction=False)
    for i in range(1000):
        pipe.incr("counter")
    results, elapsed = timed(pipe.execute)
    assert results == list(range(1, 1001))
    assert 0.1 <= elapsed < 0.1 + 2.0


def test_thousands_of_small_chunks_keep_their_order(proxy):
    """3,000 separate writes; latency drops from 20 ms to 0 halfway: nothing overtakes."""
    proxy.set_latency(0.02)
    sock = raw(proxy.port)
    expected = bytearray()
    start = time.monotonic()
    for i in range(3000):
        word = str(i).encode()
        sock.send(b"*2\r\n$4\r\nECHO\r\n$%d\r\n%s\r\n" % (len(word), word))
        expected += b"$%d\r\n%s\r\n" % (len(word), word)
        if i == 1500:
            proxy.set_latency(0)
    assert recv_exactly(sock, len(expected)) == bytes(expected)
    assert time.monotonic() - start < 15.0  # cumulative delays would take a minute
    sock.close()


def test_large_values_with_backpressure(proxy, direct):
    value = bytes(range(256)) * (16 * 1024)  # 4 MiB, more than the proxy buffers
    proxy.set_latency(0.01)
    r = client(proxy.port)
    assert r.set("big", value)
    assert r.get("big") == value
    assert direct.strlen("big") == len(value)


def test_half_close_is_forwarded(proxy, server_a):
    # Redis answers, then closes when it sees our EOF.
    sock = raw(proxy.port)
    sock.sendall(PING)
    sock.shutdown(socket.SHUT_WR)
    assert recv_until_eof(sock) == PONG
    sock.close()

    # A server that only answers after the client's EOF: data must still flow back.
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)

    def upper_after_eof():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            conn.sendall(recv_until_eof(conn).upper())

    thread = threading.Thread(target=upper_after_eof, daemon=True)
    thread.start()
    proxy.retarget("127.0.0.1", listener.getsockname()[1])
    sock = raw(proxy.port)
    sock.sendall(b"hello, ")
    sock.sendall(b"world")
    sock.shutdown(socket.SHUT_WR)
    assert recv_until_eof(sock) == b"HELLO, WORLD"
    sock.close()
    thread.join(5)
    listener.close()
    wait_until(lambda: proxy.stats["connections_open"] == 0)


def test_stall_holds_then_delivers_in_order(proxy, direct):
    old = client(proxy.port)
    old.ping()
    proxy.stall()
    results = {}

    def run(name, fn):
        try:
            results[name] = (fn(), time.monotonic())
        except Exception as exc:  # reported by the assertions below
            results[name] = (exc, time.monotonic())

    threads = [
        threading.Thread(target=run, args=("set", lambda: old.set("stalled", "yes"))),
        # A new connection is accepted, but its handshake is held too.
        threading.Thread(target=run, args=("new", lambda: client(proxy.port).get("stalled"))),
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: proxy.stats["connections_total"] == 2)  # the new one was accepted
    time.sleep(0.5)  # time enough for held data to leak through, if it would
    assert direct.get("stalled") is None  # nothing reached the server
    assert not results
    unstalled = time.monotonic()
    proxy.unstall()
    for thread in threads:
        thread.join(10)
    value, done = results["set"]
    assert value is True and done >= unstalled  # held until unstall(), then delivered
    value, done = results["new"]
    assert value in (b"yes", None)  # ordered per connection, not across connections
    assert done >= unstalled
    assert direct.get("stalled") == b"yes"
    assert old.ping()


def test_blackhole_discards_and_unblackhole_closes_corrupt_connections(proxy, direct):
    idle = client(proxy.port)
    assert idle.ping()  # connected before, idle during the black hole
    victim = client(proxy.port, timeout=0.5)
    victim.ping()
    proxy.blackhole()

    with pytest.raises(redis.TimeoutError):
        victim.set("lost", "1")
    assert direct.get("lost") is None  # the command never reached the server

    fresh = raw(proxy.port, timeout=0.3)  # a new connection is accepted...
    fresh.sendall(PING)
    with pytest.raises(socket.timeout):  # ...but nothing comes back
        fresh.recv(100)
    wait_until(lambda: proxy.stats["bytes_discarded"] > 0)

    proxy.unblackhole()
    fresh.settimeout(10)
    try:  # its stream lost bytes: the proxy closes it
        assert fresh.recv(100) == b""
    except ConnectionResetError:
        pass
    fresh.close()
    assert idle.ping()  # lost nothing: still open and working
    assert client(proxy.port).ping()  # new connections work
    assert proxy.stats["dropped"] >= 1


def test_drop_connections(proxy):
    first, second = client(proxy.port), client(proxy.port)
    assert first.ping() and second.ping()
    assert proxy.drop_connections() == 2
    with pytest.raises(redis.ConnectionError):
        first.ping()
    with pytest.raises(redis.ConnectionError):
        second.get("anything")
    third = client(proxy.port)
    assert third.ping()
    stats = proxy.stats
    assert stats["dropped"] == 2
    assert stats["connections_open"] == 1
    assert proxy.drop_connections() == 1


def test_drop_next_reply_loses_the_reply_not_the_write(proxy, direct):
    r = client(proxy.port)
    assert r.ping()  # established before arming: SET is its next chunk
    proxy.drop_next_reply()
    with pytest.raises(redis.ConnectionError):
        r.set("k", "v")
    assert direct.get("k") == b"v"  # the server did the work
    stats = proxy.stats
    assert stats["replies_dropped"] == 1
    assert stats["dropped"] == 1
    proxy.disarm()
    assert r.get("k") == b"v"  # reconnects through the disarmed proxy


def test_drop_next_reply_match_applies_to_new_connections(proxy, direct):
    proxy.drop_next_reply(match=b"INCR")
    r = client(proxy.port)
    assert r.ping()  # handshake and PING do not match: forwarded normally
    with pytest.raises(redis.ConnectionError):
        r.incr("counter")
    assert direct.get("counter") == b"1"
    other = client(proxy.port)  # armed too (until disarm), one-shot per connection
    with pytest.raises(redis.ConnectionError):
        other.incr("counter")
    assert direct.get("counter") == b"2"
    proxy.disarm()
    assert client(proxy.port).incr("counter") == 3
    assert proxy.stats["replies_dropped"] == 2


def test_retarget_failover(proxy, server_a, server_b, direct):
    other = redis.Redis(port=server_b.port)
    other.flushall()
    direct.set("who", "a")
    other.set("who", "b")
    old = client(proxy.port)
    assert old.get("who") == b"a"

    proxy.retarget("127.0.0.1", server_b.port, drop=False)
    assert proxy.target == ("127.0.0.1", server_b.port)
    assert old.get("who") == b"a"  # existing connection still on A
    new = client(proxy.port)
    assert new.get("who") == b"b"
    assert new.info("server")["process_id"] == server_b.pid

    proxy.retarget("127.0.0.1", server_a.port)  # drop=True: a failover
    with pytest.raises(redis.ConnectionError):
        new.get("who")
    with pytest.raises(redis.ConnectionError):
        old.get("who")
    assert client(proxy.port).info("server")["process_id"] == server_a.pid
    assert proxy.stats["dropped"] == 2
    other.close()


def test_upstream_refused_closes_the_client(server_a):
    with TcpProxy("127.0.0.1", servers.free_port()) as proxy:
        start = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            client(proxy.port, timeout=20).ping()  # connects at construction
        assert time.monotonic() - start < 10  # closed at once, not left to time out (20 s)
        assert proxy.stats["connect_failures"] >= 1
        wait_until(lambda: proxy.stats["connections_open"] == 0)
        proxy.retarget("127.0.0.1", server_a.port)
        assert client(proxy.port).ping()


def test_upstream_connect_timeout():
    """A target whose accept queue is full never completes the handshake."""
    target = socket.socket()
    target.bind(("127.0.0.1", 0))
    target.listen(0)
    fillers = []
    for _ in range(8):  # fill the accept queue (nobody accepts)
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(target.getsockname())
        fillers.append(sock)
    time.sleep(0.1)
    try:
        with TcpProxy(*target.getsockname(), connect_timeout=0.3) as proxy:
            start = time.monotonic()
            sock = raw(proxy.port, timeout=20)
            try:
                assert sock.recv(100) == b""
            except ConnectionResetError:
                pass
            # Closed once its connect timeout passed, long before our own 20 s one.
            assert 0.3 <= time.monotonic() - start < 10
            wait_until(lambda: proxy.stats["connect_failures"] == 1)
            sock.close()
    finally:
        for sock in fillers:
            sock.close()
        target.close()


def test_stop_with_open_connections_is_quick(proxy):
    clients = [client(proxy.port) for _ in range(20)]
    for r in clients:
        r.ping()
    blocked = client(proxy.port, timeout=30)
    blocked.ping()
    proxy.stall()
    outcome = []

    def wait_for_ping():
        try:
            outcome.append(blocked.ping())
        except redis.ConnectionError as exc:
            outcome.append(exc)
        outcome.append(time.monotonic())

    thread = threading.Thread(target=wait_for_ping, daemon=True)
    thread.start()
    time.sleep(0.1)  # most likely its PING is held by now; told it is closed either way
    stopping = time.monotonic()
    _, elapsed = timed(proxy.stop)
    assert elapsed < 5.0  # no waiting for the held data or the clients' timeouts
    thread.join(20)
    assert isinstance(outcome[0], redis.ConnectionError)
    assert outcome[1] - stopping < 10.0  # the blocked client is told, not left to its 30 s
    with pytest.raises(redis.ConnectionError):
        clients[0].ping()
    proxy.stop()


def test_many_concurrent_clients(proxy, direct):
    errors = []
    barrier = threading.Barrier(100)

    def work():
        r = client(proxy.port, timeout=10)
        try:
            barrier.wait(10)
            for _ in range(100):
                r.incr("hits")
        except Exception as exc:
            errors.append(exc)
        finally:
            r.close()

    threads = [threading.Thread(target=work) for _ in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert direct.get("hits") == b"10000"
    assert proxy.stats["connections_total"] >= 100


def test_idle_proxy_uses_no_cpu(proxy):
    idle = [client(proxy.port) for _ in range(20)]
    for r in idle:
        r.ping()
    proxy.set_latency(0.3)
    proxy.stall()
    held = raw(proxy.port)
    held.sendall(PING)  # data waiting in a stalled proxy
    time.sleep(0.05)
    before = cpu_seconds()
    time.sleep(0.5)
    assert cpu_seconds() - before < 0.05
    proxy.unstall()
    assert recv_exactly(held, len(PONG)) == PONG
    proxy.blackhole()
    before = cpu_seconds()
    time.sleep(0.5)
    assert cpu_seconds() - before < 0.05
    held.close()


@pytest.mark.faults  # PostgreSQL pass only, like the other scenarios that need it
def test_postgres_lost_commit_reply():
    """The case the proxy is for: COMMIT happens on the server, its reply never arrives."""
    import psycopg

    pg = servers.PostgresServer().start()
    try:
        params = {
            "host": "127.0.0.1",
            "user": pg.user,
            "dbname": pg.dbname,
            "connect_timeout": 5,
            "sslmode": "disable",
        }
        with (
            TcpProxy("127.0.0.1", pg.port) as proxy,
            psycopg.connect(port=pg.port, autocommit=True, **params) as direct_pg,
        ):
            direct_pg.execute("CREATE TABLE steps (id int PRIMARY KEY)")
            conn = psycopg.connect(port=proxy.port, **params)
            conn.execute("INSERT INTO steps VALUES (1)")
            proxy.drop_next_reply(match=b"COMMIT")
            with pytest.raises(psycopg.OperationalError):
                conn.commit()
            conn.close()
            proxy.disarm()
            assert direct_pg.execute("SELECT count(*) FROM steps").fetchone()[0] == 1

            proxy.set_latency(0.1)
            with psycopg.connect(port=proxy.port, **params) as slow:
                start = time.monotonic()
                assert slow.execute("SELECT 42").fetchone()[0] == 42
                assert time.monotonic() - start >= 0.2
    finally:
        pg.stop()
