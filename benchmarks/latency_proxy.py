"""A TCP proxy that adds a fixed latency to every chunk it forwards, both ways: a lock store
in another zone, without root (``tc``/``netem`` needs root and a kernel module).

Each chunk read from one side is written to the other ``delay`` seconds after it was read,
in order, so a request/reply round trip costs ``2 * delay`` more while pipelined writes are
not serialised behind one another (a chunk's delay runs while the next is read). Threads,
one pair per connection: the figures it is for are milliseconds, far above its own cost.

    proxy = LatencyProxy(("127.0.0.1", 6379), delay=0.0005).start()   # 1 ms a round trip
    ... redis://127.0.0.1:{proxy.port}/0 ...
    proxy.stop()

``python -m benchmarks.latency_proxy --target 127.0.0.1:6379 --delay-ms 0.5`` runs one until
interrupted, printing its port.
"""

from __future__ import annotations

import argparse
import collections
import socket
import threading
import time

__all__ = ["LatencyProxy"]


class LatencyProxy:
    """Listens on ``127.0.0.1:<port>`` (a free port unless given) and forwards to
    ``target`` (host, port), each chunk delayed by ``delay`` seconds each way."""

    def __init__(self, target: tuple[str, int], delay: float, port: int = 0):
        self.target = target
        self.delay = delay
        self._listener = socket.create_server(("127.0.0.1", port))
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._guard = threading.Lock()

    @property
    def url(self) -> str:
        """A ``redis://`` URL through the proxy (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> LatencyProxy:
        threading.Thread(target=self._accept, name="latency-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._guard:
            for sock in self._sockets:
                try:
                    sock.close()
                except OSError:
                    pass
            self._sockets.clear()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._guard:
                self._sockets += [client, server]
            self._pipe(client, server)
            self._pipe(server, client)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        queue: collections.deque[tuple[float, bytes]] = collections.deque()
        ready = threading.Condition()

        def read() -> None:
            try:
                while True:
                    chunk = source.recv(65536)
                    with ready:
                        queue.append((time.monotonic() + self.delay, chunk))
                        ready.notify()
                    if not chunk:
                        return
            except OSError:
                with ready:
                    queue.append((0.0, b""))
                    ready.notify()

        def write() -> None:
            while True:
                with ready:
                    while not queue:
                        ready.wait()
                    due, chunk = queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if not chunk:
                    try:
                        sink.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                try:
                    sink.sendall(chunk)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


def measure(round_trip_ms: float, cycles: int, reps: int) -> dict[str, float]:
    """A task's lock-store cycle (acquire, ownership check, release) through a proxy adding
    ``round_trip_ms`` to every round trip, the release waited for and not, interleaved in
    ``reps`` rounds of ``cycles`` each (``round_trip_ms`` 0: no proxy): the median µs of wall time per cycle of each, and
    the lock store's commands per cycle (INFO commandstats: the same for both)."""
    import statistics

    from celery_steplock.lock import RedisLeaseStore, make_client, release_after_commit
    from tests.support import servers

    server = servers.RedisServer().start()
    # 0: straight to the server, no proxy in between.
    proxy = (
        LatencyProxy(("127.0.0.1", server.port), round_trip_ms / 2000).start()
        if round_trip_ms
        else None
    )
    try:
        store = RedisLeaseStore(make_client(proxy.url if proxy else server.url), prefix="lat")
        direct = make_client(server.url)
        per: dict[str, list[float]] = {"wait": [], "deferred": []}
        calls: dict[str, list[float]] = {"wait": [], "deferred": []}
        for rep in range(reps):
            for mode in ("wait", "deferred") if rep % 2 == 0 else ("deferred", "wait"):
                direct.config_resetstat()
                t0 = time.perf_counter()
                for n in range(cycles):
                    lease = store.acquire(f"c{n % 50}", ttl=30.0)
                    assert lease is not None
                    store.owned(lease.name, lease.owner)
                    release_after_commit(store, lease, None, wait=mode == "wait")
                per[mode].append((time.perf_counter() - t0) / cycles * 1e6)
                stats = direct.info("commandstats")
                calls[mode].append(stats.get("cmdstat_evalsha", {}).get("calls", 0) / cycles)
        if store.deferred is not None:
            store.deferred.drain()
        return {
            "round_trip_ms_added": round_trip_ms,
            "cycles": cycles,
            "reps": reps,
            **{f"{m}_us_per_cycle": round(statistics.median(v), 1) for m, v in per.items()},
            **{f"{m}_evalsha_per_cycle": statistics.median(v) for m, v in calls.items()},
        }
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="added each way, ms")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument(
        "--measure",
        action="store_true",
        help="measure a lease cycle through a proxy of its own (2 * --delay-ms a round "
        "trip), the release waited for vs not; prints JSON",
    )
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    if args.measure:
        import json

        for added in (0.0, 2 * args.delay_ms):
            print(json.dumps(measure(added, args.cycles, args.reps)), flush=True)
        return 0
    if not args.target:
        parser.error("--target is required (or --measure)")
    host, _, port = args.target.rpartition(":")
    proxy = LatencyProxy((host, int(port)), args.delay_ms / 1000, args.port).start()
    print(proxy.port, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
