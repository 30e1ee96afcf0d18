"""A fault-injecting TCP proxy on loopback, for the fault-injection suite.

Put it between real processes and a real server (redis-server, PostgreSQL) and inject
latency, stalls, black holes, dropped connections, a lost reply, and a failover::

    from tests.support.faults.proxy import TcpProxy

    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        env["REDIS_URL"] = proxy.url()          # redis://127.0.0.1:<proxy port>/0
        proxy.set_latency(0.2)                  # +0.2 s each way
        proxy.stall(); ...; proxy.unstall()
        proxy.drop_next_reply(match=b"COMMIT")  # "the COMMIT happened, its reply was lost"

Design: one daemon thread runs a ``selectors`` event loop (epoll on Linux) with non-blocking
sockets; latency is a per-direction FIFO of chunks stamped with their release time
(``time.monotonic()``) and a timer heap, so there is no thread or timer per chunk and an idle
proxy sleeps in ``epoll_wait``. The control methods are thread-safe: they run their change
inside the loop thread and return once it is applied. Standard library only.

Units: every duration is in seconds (float).

What a user must know:

* Chunks are whatever ``recv()`` returned (at most 256 KiB); the proxy does not parse any
  protocol. Latency, stall and black hole act on chunks, in arrival order.
* ``drop_next_reply`` treats the first server->client bytes read *after* the triggering
  client chunk was completely written upstream as "its reply". With pipelined requests whose
  earlier replies are still on their way, an earlier reply may be the one that is lost. For a
  connection opened after arming, the first client chunk is usually a handshake (redis-py's
  ``CLIENT SETINFO``, PostgreSQL's startup packet): arm after the connection is established,
  or pass ``match`` (e.g. ``b"COMMIT"``) so that only a chunk containing those bytes triggers.
  ``match`` is searched for within single chunks, case-sensitively.
* Each direction buffers at most about 1 MiB before it stops reading from its source (TCP
  back-pressure); stalled data beyond that waits in the kernel, nothing is lost.
* Bytes counted in ``stats`` are bytes *delivered* (written to the upstream for ``bytes_up``,
  to the client for ``bytes_down``); discarded bytes are counted in ``bytes_discarded``.
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import math
import selectors
import socket
import struct
import threading
import time

__all__ = ["TcpProxy"]

log = logging.getLogger("steplock.faults.proxy")

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE
_RECV_SIZE = 256 * 1024
_HIGH_WATER = 1024 * 1024  # per-direction buffered bytes before reading pauses
_ACCEPT_BATCH = 128
_ACCEPT_BACKOFF = 0.1  # s, after EMFILE & co.
_CONTROL_TIMEOUT = 30.0  # s, a control call waiting for the loop thread
_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST

# Markers travelling through a direction's queue, in order with the data.
_EOF = "EOF"  # the source half-closed: shutdown(SHUT_WR) the destination
_CLOSE = "CLOSE"  # drop_next_reply: close the connection once earlier data is delivered

_CLIENT, _UPSTREAM = 0, 1
_LISTENER = "listener"
_WAKEUP = "wakeup"

# drop_next_reply state of one connection.
_IDLE, _ARMED, _SENDING, _AWAITING = range(4)

_IN_PROGRESS = {errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN, errno.EALREADY, errno.EINTR}
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Direction:
    """One direction of a connection: client->upstream (``upward``) or upstream->client."""

    __slots__ = (
        "conn",
        "upward",
        "queue",
        "queued",
        "outbuf",
        "last_due",
        "timer_due",
        "enqueued_total",
        "sent_total",
        "eof_read",
        "eof_pending",
        "eof_sent",
        "close_pending",
    )

    def __init__(self, conn: _Conn, upward: bool):
        self.conn = conn
        self.upward = upward
        self.queue: collections.deque = collections.deque()  # (due, bytes | marker)
        self.queued = 0  # bytes in queue
        self.outbuf = bytearray()  # released, not yet written (partial writes)
        self.last_due = 0.0  # release time of the newest chunk (keeps order)
        self.timer_due: float | None = None
        self.enqueued_total = 0
        self.sent_total = 0
        self.eof_read = False  # the source gave EOF: stop reading it
        self.eof_pending = False  # EOF released: shut down the destination's write side
        self.eof_sent = False
        self.close_pending = False

    def backlog(self) -> int:
        return self.queued + len(self.outbuf)

    def discard(self) -> bool:
        """Drop everything buffered; True when something (data or a marker) was dropped."""
        lost = bool(self.queue or self.outbuf or (self.eof_pending and not self.eof_sent))
        self.queue.clear()
        self.queued = 0
        self.outbuf.clear()
        if self.eof_pending and not self.eof_sent:
            self.eof_pending = False
        return lost


class _Conn:
    __slots__ = (
        "id",
        "client",
        "upstream",
        "up",
        "down",
        "connecting",
        "closed",
        "lost_data",
        "drop_state",
        "drop_end",
        "draining",
        "masks",
    )

    def __init__(self, conn_id: int, client: socket.socket):
        self.id = conn_id
        self.client = client
        self.upstream: socket.socket | None = None
        self.up = _Direction(self, True)
        self.down = _Direction(self, False)
        self.connecting = False
        self.closed = False
        self.lost_data = False  # the black hole swallowed some of its bytes
        self.drop_state = _IDLE
        self.drop_end = 0  # up-stream offset just after the triggering chunk
        self.draining = False  # its reply was dropped: closing, discard everything
        self.masks = [0, 0]  # registered selector events: client, upstream


class _Command:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn, args):
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # handed back to the caller
            self.error = exc
        finally:
            self.done.set()


def _set_nodelay(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass


class TcpProxy:
    """A TCP proxy listening on 127.0.0.1 that forwards to ``target_host:target_port``.

    ``listen_port=None`` picks a free port; the port is bound at construction, so ``port``
    and ``url()`` are usable before ``start()``. ``connect_timeout`` (seconds) bounds the
    connection to the target; when it fails (refused, unreachable, timeout) the client's
    connection is reset.

    All control methods are thread-safe and take effect before they return.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        listen_port: int | None = None,
        *,
        connect_timeout: float = 5.0,
    ):
        self._target = (target_host, int(target_port))
        self.connect_timeout = float(connect_timeout)
        self._lifecycle_lock = threading.Lock()
        self._cmd_lock = threading.Lock()
        self._commands: collections.deque = collections.deque()
        self._running = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._listener: socket.socket | None = self._bind(listen_port or 0)
        self.port: int = self._listener.getsockname()[1]
        """Listening port on 127.0.0.1."""

        # State below is only touched by the loop thread (or inline when it is not running).
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._timers: list = []  # (due, seq, _Direction): latency releases
        self._deadlines: list = []  # (deadline, seq, _Conn): upstream connects
        self._accept_resume: float | None = None
        self._latency = 0.0
        self._stalled = False
        self._blackholed = False
        self._drop_armed = False
        self._drop_match: bytes | None = None
        self._stats = {
            "connections_total": 0,
            "bytes_up": 0,
            "bytes_down": 0,
            "bytes_discarded": 0,
            "dropped": 0,
            "replies_dropped": 0,
            "connect_failures": 0,
        }

    # ------------------------------------------------------------------ lifecycle

    def __repr__(self) -> str:
        host, port = self._target
        state = "running" if self._running else "stopped"
        return f"<TcpProxy 127.0.0.1:{self.port} -> {host}:{port} {state}>"

    @staticmethod
    def _bind(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
        except BaseException:
            sock.close()
            raise
        return sock

    def start(self) -> TcpProxy:
        """Listen and start the loop thread; returns (self) once connections are accepted.

        Calling it on a running proxy does nothing; after ``stop()`` it listens again on
        the same port.
        """
        with self._lifecycle_lock:
            if self._thread is not None:
                return self
            if self._listener is None:
                self._listener = self._bind(self.port)
            self._listener.listen(1024)
            self._listener.setblocking(False)
            self._sel = selectors.DefaultSelector()
            self._wake_r, self._wake_w = socket.socketpair()
            self._wake_r.setblocking(False)
            self._wake_w.setblocking(False)
            self._sel.register(self._listener, _READ, _LISTENER)
            self._sel.register(self._wake_r, _READ, _WAKEUP)
            self._stopping = False
            with self._cmd_lock:
                self._running = True
            self._thread = threading.Thread(
                target=self._run, name=f"TcpProxy:{self.port}", daemon=True
            )
            self._thread.start()
            return self

    def stop(self) -> None:
        """Close the listener and reset every connection. Idempotent; returns within ~5 s
        even in the worst case (normally at once)."""
        with self._lifecycle_lock:
            thread = self._thread
            if thread is None:
                if self._listener is not None:  # bound but never started
                    self._listener.close()
                    self._listener = None
                return
            self._stopping = True
            self._wake()
            if thread is not threading.current_thread():
                thread.join(5.0)
                if thread.is_alive():
                    log.warning("%r: loop thread did not exit within 5 s", self)
            self._thread = None

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def url(self, scheme: str = "redis", path: str = "/0", user: str | None = None) -> str:
        """URL of the proxy, e.g. ``redis://127.0.0.1:<port>/0``;
        ``url("postgresql", "/steplock", user="postgres")`` for PostgreSQL."""
        auth = f"{user}@" if user else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}{path}"

    @property
    def target(self) -> tuple[str, int]:
        """(host, port) that new connections go to."""
        return self._target

    @property
    def latency(self) -> float:
        """Current one-way latency in seconds."""
        return self._latency

    @property
    def stats(self) -> dict:
        """A snapshot: connections_total, connections_open, bytes_up (delivered to the
        target), bytes_down (delivered to clients), dropped (connections the proxy closed on
        purpose: drop_connections, retarget, drop_next_reply, unblackhole), plus
        bytes_discarded, replies_dropped and connect_failures."""
        snapshot = dict(self._stats)
        snapshot["connections_open"] = len(self._conns)
        return snapshot

    # ------------------------------------------------------------------ faults

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk by ``seconds`` in each direction (so a round trip gains
        2 x ``seconds``), order preserved. Applies to data arriving after the call; a chunk's
        delay counts from its own arrival, so a stream of chunks arrives ``seconds`` late,
        not cumulatively later. 0 removes it (chunks still queued keep their release time,
        and later chunks never overtake them)."""
        seconds = float(seconds)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"latency must be a finite number of seconds >= 0, not {seconds!r}")
        self._call(setattr, self, "_latency", seconds)

    def stall(self) -> None:
        """Hold all data in both directions (buffered, nothing lost), new connections'
        too (they are still accepted and connected upstream). ``unstall()`` delivers it."""
        self._call(self._do_stall)

    def unstall(self) -> None:
        """Deliver what ``stall()`` held, in order (chunks whose latency has not yet
        elapsed still wait for it)."""
        self._call(self._do_unstall)

    def blackhole(self) -> None:
        """Silently discard data in both directions, including data buffered in the proxy
        (as with packet loss that never recovers). Connections stay open; new ones are
        accepted and connected upstream, but no byte reaches either side."""
        self._call(self._do_blackhole)

    def unblackhole(self) -> None:
        """End the black hole: connections that lost data (in either direction) are reset,
        since their byte streams are corrupt; the others, and new ones, work normally."""
        self._call(self._do_unblackhole)

    def drop_connections(self) -> int:
        """Reset (RST, via SO_LINGER 0) every current connection on both sides; returns how
        many. New connections keep working."""
        return self._call(self._do_drop_connections)

    def drop_next_reply(self, match: bytes | None = None) -> None:
        """Arm the "lost reply" fault (e.g. a COMMIT that happened but whose answer never
        arrived).

        On each connection open now, and on every connection opened until ``disarm()``, the
        next client->server chunk (with ``match``: the next chunk containing those bytes) is
        forwarded; the first server->client bytes read after it was completely written are
        discarded, and the connection is closed: the client gets the data that was ahead of
        the reply, then EOF; the server gets a reset. One-shot per connection.
        """
        if match is not None:
            match = bytes(match)
            if not match:
                raise ValueError("match must not be empty")
        self._call(self._do_drop_next_reply, match)

    def disarm(self) -> None:
        """Cancel ``drop_next_reply`` on every connection and for new ones."""
        self._call(self._do_disarm)

    def retarget(self, host: str, port: int, drop: bool = True) -> None:
        """Send new connections to ``host:port``; with ``drop`` (a failover) reset the
        existing connections too, else they keep talking to the old target."""
        self._call(self._do_retarget, (host, int(port)), drop)

    # ------------------------------------------------------------------ control plumbing

    def _call(self, fn, *args):
        """Run fn(*args) in the loop thread (inline when the loop is not running)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        command = _Command(fn, args)
        with self._cmd_lock:
            if not self._running:
                command.run()
            else:
                self._commands.append(command)
        if not command.done.is_set():
            self._wake()
            if not command.done.wait(_CONTROL_TIMEOUT):
                raise RuntimeError(
                    f"{self!r}: the loop thread did not answer in {_CONTROL_TIMEOUT:g} s"
                )
        if command.error is not None:
            raise command.error
        return command.result

    def _wake(self) -> None:
        sock = self._wake_w
        if sock is None:
            return
        try:
            sock.send(b"\0")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def _do_stall(self) -> None:
        self._stalled = True
        for conn in list(self._conns.values()):
            self._update(conn)

    def _do_unstall(self) -> None:
        self._stalled = False
        self._pump_all()

    def _do_blackhole(self) -> None:
        self._blackholed = True
        for conn in list(self._conns.values()):
            lost_up = conn.up.discard()
            lost_down = conn.down.discard()
            if lost_up or lost_down:
                conn.lost_data = True
            self._update(conn)

    def _do_unblackhole(self) -> None:
        self._blackholed = False
        for conn in list(self._conns.values()):
            if conn.lost_data:
                self._stats["dropped"] += 1
                self._close(conn)
        self._pump_all()

    def _do_drop_connections(self) -> int:
        conns = list(self._conns.values())
        for conn in conns:
            self._close(conn)
        self._stats["dropped"] += len(conns)
        return len(conns)

    def _do_drop_next_reply(self, match: bytes | None) -> None:
        self._drop_armed = True
        self._drop_match = match
        for conn in self._conns.values():
            if conn.drop_state == _IDLE and not conn.draining:
                conn.drop_state = _ARMED

    def _do_disarm(self) -> None:
        self._drop_armed = False
        self._drop_match = None
        for conn in self._conns.values():
            conn.drop_state = _IDLE

    def _do_retarget(self, target: tuple[str, int], drop: bool) -> None:
        self._target = target
        if drop:
            self._do_drop_connections()

    def _pump_all(self) -> None:
        for conn in list(self._conns.values()):
            self._pump(conn.up)
            self._pump(conn.down)

    # ------------------------------------------------------------------ event loop

    def _run(self) -> None:
        sel = self._sel
        try:
            while not self._stopping:
                events = sel.select(self._next_timeout())
                for key, mask in events:
                    data = key.data
                    if data is _LISTENER:
                        self._accept()
                    elif data is _WAKEUP:
                        self._drain_wakeups()
                    else:
                        conn, side = data
                        if conn.closed:
                            continue
                        try:
                            self._handle(conn, side, mask)
                        except Exception:
                            log.exception("%r: connection %d failed", self, conn.id)
                            self._close(conn)
                    if self._stopping:
                        break
                self._run_commands()
                self._run_timers()
        except Exception:
            log.exception("%r: event loop crashed", self)
        finally:
            self._shutdown_loop()

    def _shutdown_loop(self) -> None:
        for conn in list(self._conns.values()):
            try:
                self._close(conn)
            except Exception:
                log.exception("%r: closing connection %d", self, conn.id)
        self._timers.clear()
        self._deadlines.clear()
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        self._listener = self._wake_r = self._wake_w = None
        try:
            self._sel.close()
        except Exception:
            pass
        with self._cmd_lock:
            self._running = False
            pending = list(self._commands)
            self._commands.clear()
        for command in pending:  # nothing is left waiting: run them against the empty proxy
            command.run()

    def _next_timeout(self) -> float | None:
        due = None
        if self._timers and not self._stalled:
            due = self._timers[0][0]
        if self._deadlines and (due is None or self._deadlines[0][0] < due):
            due = self._deadlines[0][0]
        if self._accept_resume is not None and (due is None or self._accept_resume < due):
            due = self._accept_resume
        if due is None:
            return None
        return max(0.0, due - time.monotonic())

    def _run_commands(self) -> None:
        while True:
            with self._cmd_lock:
                if not self._commands:
                    return
                command = self._commands.popleft()
            command.run()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _run_timers(self) -> None:
        now = time.monotonic()
        if not self._stalled:
            timers = self._timers
            while timers and timers[0][0] <= now:
                due, _, d = heapq.heappop(timers)
                if d.conn.closed or d.timer_due != due:
                    continue  # stale
                d.timer_due = None
                self._pump(d)
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            _, _, conn = heapq.heappop(deadlines)
            if not conn.closed and conn.connecting:
                log.debug(
                    "%r: connection %d: connect to %s timed out", self, conn.id, self._target
                )
                self._connect_failed(conn)
        if self._accept_resume is not None and self._accept_resume <= now:
            self._accept_resume = None
            try:
                self._sel.register(self._listener, _READ, _LISTENER)
            except (KeyError, ValueError, OSError):
                pass

    def _schedule(self, d: _Direction, due: float) -> None:
        if d.timer_due == due:
            return
        d.timer_due = due
        heapq.heappush(self._timers, (due, next(self._seq), d))

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                client, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_RESOURCES:
                    log.warning("%r: accept failed (%s); pausing accepts", self, exc)
                    self._sel.unregister(self._listener)
                    self._accept_resume = time.monotonic() + _ACCEPT_BACKOFF
                    return
                continue  # e.g. ECONNABORTED: that client gave up
            try:
                self._open(client)
            except Exception:
                log.exception("%r: could not set up a connection", self)
                try:
                    client.close()
                except OSError:
                    pass

    def _open(self, client: socket.socket) -> None:
        client.setblocking(False)
        _set_nodelay(client)
        conn = _Conn(next(self._ids), client)
        self._conns[conn.id] = conn
        self._stats["connections_total"] += 1
        if self._drop_armed:
            conn.drop_state = _ARMED
        host, port = self._target
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            # IPv4 first: "localhost" may resolve to ::1 first while the server binds 127.0.0.1.
            infos.sort(key=lambda info: info[0] != socket.AF_INET)
            family, type_, proto, _, addr = infos[0]
            upstream = socket.socket(family, type_, proto)
        except OSError as exc:
            log.debug("%r: cannot reach %s:%s: %s", self, host, port, exc)
            self._connect_failed(conn)
            return
        conn.upstream = upstream
        upstream.setblocking(False)
        _set_nodelay(upstream)
        err = upstream.connect_ex(addr)
        if err == 0:
            conn.connecting = False
        elif err in _IN_PROGRESS:
            conn.connecting = True
            deadline = time.monotonic() + self.connect_timeout
            heapq.heappush(self._deadlines, (deadline, next(self._seq), conn))
        else:
            log.debug(
                "%r: connect to %s:%s failed: %s", self, host, port, errno.errorcode.get(err, err)
            )
            self._connect_failed(conn)
            return
        self._update(conn)

    def _connect_failed(self, conn: _Conn) -> None:
        self._stats["connect_failures"] += 1
        self._close(conn)

    def _finish_connect(self, conn: _Conn) -> None:
        err = conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            log.debug(
                "%r: connection %d: connect to %s failed: %s",
                self,
                conn.id,
                self._target,
                errno.errorcode.get(err, err),
            )
            self._connect_failed(conn)
            return
        conn.connecting = False
        self._pump(conn.up)  # sends what the client said meanwhile; updates interests

    def _close(self, conn: _Conn, rst_client: bool = True, rst_upstream: bool = True) -> None:
        """Close both sockets (RST unless told otherwise) and forget the connection."""
        if conn.closed:
            return
        conn.closed = True
        self._conns.pop(conn.id, None)
        for index, sock, rst in (
            (_CLIENT, conn.client, rst_client),
            (_UPSTREAM, conn.upstream, rst_upstream),
        ):
            if sock is None:
                continue
            if conn.masks[index]:
                try:
                    self._sel.unregister(sock)
                except (KeyError, ValueError):
                    pass
                conn.masks[index] = 0
            if rst:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                except OSError:
                    pass
            try:
                sock.close()
            except OSError:
                pass
        conn.up.discard()
        conn.down.discard()

    def _set_mask(self, conn: _Conn, index: int, sock: socket.socket, mask: int) -> None:
        current = conn.masks[index]
        if mask == current:
            return
        if current == 0:
            self._sel.register(sock, mask, (conn, index))
        elif mask == 0:
            self._sel.unregister(sock)
        else:
            self._sel.modify(sock, mask, (conn, index))
        conn.masks[index] = mask

    def _update(self, conn: _Conn) -> None:
        """Register exactly the events this connection can act on now (no busy loops)."""
        if conn.closed:
            return
        up, down = conn.up, conn.down
        # While data is being thrown away, keep reading so that the sender never blocks.
        discarding = self._blackholed or conn.draining
        can_send = not (self._stalled or self._blackholed)
        mask = 0
        if not up.eof_read and (discarding or up.backlog() < _HIGH_WATER):
            mask |= _READ
        if down.outbuf and can_send:
            mask |= _WRITE
        self._set_mask(conn, _CLIENT, conn.client, mask)
        if conn.upstream is None:
            return
        if conn.connecting:
            mask = _WRITE
        else:
            mask = 0
            if not down.eof_read and (discarding or down.backlog() < _HIGH_WATER):
                mask |= _READ
            if up.outbuf and can_send:
                mask |= _WRITE
        self._set_mask(conn, _UPSTREAM, conn.upstream, mask)

    def _handle(self, conn: _Conn, side: int, mask: int) -> None:
        if side == _UPSTREAM and conn.connecting:
            if mask & (_WRITE | _READ):
                self._finish_connect(conn)
            return
        source_dir = conn.up if side == _CLIENT else conn.down  # this socket is its source
        sink_dir = conn.down if side == _CLIENT else conn.up  # this socket is its sink
        if mask & _READ and not source_dir.eof_read:
            self._read(source_dir)
            if conn.closed:
                return
        if mask & _WRITE:  # selectors reports errors and hang-ups as READ | WRITE
            self._flush(sink_dir)

    def _read(self, d: _Direction) -> None:
        conn = d.conn
        sock = conn.client if d.upward else conn.upstream
        try:
            data = sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.debug(
                "%r: connection %d: %s side: %s",
                self,
                conn.id,
                "client" if d.upward else "upstream",
                exc,
            )
            self._close(conn)
            return
        if data:
            self._on_data(d, data)
        else:
            self._on_eof(d)
        self._update(conn)

    def _on_data(self, d: _Direction, data: bytes) -> None:
        conn = d.conn
        if self._blackholed:
            conn.lost_data = True
            self._stats["bytes_discarded"] += len(data)
            return
        if conn.draining:
            self._stats["bytes_discarded"] += len(data)
            return
        if d.upward:
            if conn.drop_state == _ARMED and (
                self._drop_match is None or self._drop_match in data
            ):
                conn.drop_state = _SENDING
                conn.drop_end = d.enqueued_total + len(data)
        elif conn.drop_state == _AWAITING:
            # The lost reply: discard it, stop forwarding, close once earlier data is out.
            conn.drop_state = _IDLE
            conn.draining = True
            self._stats["bytes_discarded"] += len(data) + conn.up.backlog()
            self._stats["replies_dropped"] += 1
            self._stats["dropped"] += 1
            conn.up.discard()
            self._enqueue(d, _CLOSE)
            return
        self._enqueue(d, data)

    def _on_eof(self, d: _Direction) -> None:
        d.eof_read = True
        conn = d.conn
        if self._blackholed:
            self._close(conn)  # the stream is gone either way; do not leak the other side
            return
        if conn.draining:
            return  # the pending _CLOSE ends the connection
        self._enqueue(d, _EOF)

    def _enqueue(self, d: _Direction, item) -> None:
        now = time.monotonic()
        due = now + self._latency
        if due < d.last_due:
            due = d.last_due  # never overtake an earlier chunk
        d.last_due = due
        d.queue.append((due, item))
        if isinstance(item, bytes):
            d.queued += len(item)
            d.enqueued_total += len(item)
        if len(d.queue) == 1:
            if due <= now:
                self._pump(d)
            else:
                self._schedule(d, due)

    def _pump(self, d: _Direction) -> None:
        """Release the chunks whose time has come (unless stalled), then write."""
        if d.conn.closed:
            return
        queue = d.queue
        if queue and not self._stalled:
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, item = queue.popleft()
                if item is _EOF:
                    d.eof_pending = True
                elif item is _CLOSE:
                    d.close_pending = True
                else:
                    d.outbuf += item
                    d.queued -= len(item)
            if queue:
                self._schedule(d, queue[0][0])
        self._flush(d)

    def _flush(self, d: _Direction) -> None:
        conn = d.conn
        if conn.closed:
            return
        if not (self._stalled or self._blackholed or (d.upward and conn.connecting)):
            sock = conn.upstream if d.upward else conn.client
            if d.outbuf:
                try:
                    sent = sock.send(d.outbuf)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError as exc:
                    log.debug(
                        "%r: connection %d: sending to %s: %s",
                        self,
                        conn.id,
                        "upstream" if d.upward else "client",
                        exc,
                    )
                    self._close(conn)
                    return
                if sent:
                    del d.outbuf[:sent]
                    d.sent_total += sent
                    if d.upward:
                        self._stats["bytes_up"] += sent
                        if conn.drop_state == _SENDING and d.sent_total >= conn.drop_end:
                            conn.drop_state = _AWAITING
                    else:
                        self._stats["bytes_down"] += sent
            if not d.outbuf:
                if d.close_pending:
                    # drop_next_reply: the client sees EOF after the data ahead of the lost
                    # reply; the server sees a reset.
                    self._close(conn, rst_client=False, rst_upstream=True)
                    return
                if d.eof_pending and not d.eof_sent:
                    d.eof_sent = True
                    try:
                        sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        self._close(conn)
                        return
                    if conn.up.eof_sent and conn.down.eof_sent:
                        self._close(conn, rst_client=False, rst_upstream=False)
                        return
        self._update(conn)
