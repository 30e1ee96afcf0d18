"""EVALSHA on a redis-py client's pooled connections: the one module that knows redis-py's
connection internals (pool, packed commands, the connection's retry policy).

Commands are packed here in RESP rather than by redis-py's encoder, which costs several times
more per argument: that counts when a renewal call carries thousands of arguments, and a
lock cycle's client time is mostly what surrounds its two commands.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import re
import ssl
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable, Iterable

import redis
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)
from redis.sentinel import MasterNotFoundError

from ..redact import redact

__all__ = [
    "Script",
    "pack",
    "text",
    "evalsha",
    "evalsha_many",
    "socket_timeout",
    "connection",
    "misconfiguration",
    "refused_command",
    "derived_client",
    "SentinelDiscoveryError",
    "sentinel_discovery_error",
    "SENTINEL_AUTH",
    "SENTINEL_UNKNOWN_MASTER",
    "Deferred",
    "deferred_for",
    "drain_all",
]

# How Redis and Valkey word an ACL refusal of a command run inside a script (redis-py raises
# those as a plain ResponseError): "... can't run this command or subcommand" (Redis 6.2,
# 7.0), "ACL failure in script: ..." (Valkey, Redis 7.2+), "no permissions to ..." (a key).
_REFUSAL = re.compile(
    r"NOPERM|can't run this command|ACL failure|no permissions to", re.IGNORECASE
)
_AUTH = re.compile(r"^(WRONGPASS|NOAUTH)\b|invalid username-password|invalid password")
_COMMAND = re.compile(r"run the '([^']+)' command")
_POOL_OWN = frozenset({"maint_notifications_pool_handler", "connection_pool"})

Call = tuple[list[str], list[str]]  # (KEYS, ARGV) of one EVALSHA

#: :func:`misconfiguration`'s reasons for a Sentinel primary that cannot be found.
SENTINEL_AUTH = "sentinel authentication failed"
SENTINEL_UNKNOWN_MASTER = "primary unknown to the sentinels"
# A sentinel's error in redis-py's "No master found" message ("... - AuthenticationError(...)"
# up to redis-py 7, "... - auth:AuthenticationError" in 8).
_SENTINEL_ERROR = re.compile(r" - (?:\w+:)?(\w+Error)\b")


class SentinelDiscoveryError(MasterNotFoundError):
    """redis-py's ``MasterNotFoundError`` with a short message (the sentinels' addresses,
    not their clients' reprs) and ``reason``: :data:`SENTINEL_AUTH` or
    :data:`SENTINEL_UNKNOWN_MASTER` when the sentinels answered but refused us or do not
    know the primary (a configuration error), None when none could be asked (an outage) or
    the primary is down."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


def sentinel_discovery_error(
    sentinel: Any, service_name: str, exc: MasterNotFoundError
) -> SentinelDiscoveryError:
    """The :class:`SentinelDiscoveryError` for ``exc``, raised by ``sentinel``'s (a
    ``redis.sentinel.Sentinel``) ``discover_master(service_name)``. When no sentinel
    reported an error, asks each once more whether it monitors ``service_name``."""
    addresses = []
    for node in sentinel.sentinels:
        kwargs = node.connection_pool.connection_kwargs
        addresses.append(f"{kwargs.get('host')}:{kwargs.get('port')}")
    errors = _SENTINEL_ERROR.findall(str(exc))
    where = f"for {service_name!r} from the sentinels at {', '.join(addresses)}"
    if any(e in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError") for e in errors):
        return SentinelDiscoveryError(
            f"No primary found {where}: {errors.count('AuthenticationError')} of "
            f"{len(addresses)} refused the credentials (sentinel_kwargs)",
            SENTINEL_AUTH,
        )
    if not errors:
        known = False
        for node in sentinel.sentinels:
            try:
                known = service_name in node.sentinel_masters()
            except (redis.RedisError, OSError):
                continue
            if known:
                break
        if not known:
            return SentinelDiscoveryError(
                f"No primary found {where}: none of them monitors a primary of that name "
                f"(master_name)",
                SENTINEL_UNKNOWN_MASTER,
            )
        return SentinelDiscoveryError(f"No primary found {where}: they report it down")
    listed = ", ".join(sorted(set(errors)))
    return SentinelDiscoveryError(
        f"No primary found {where}: {len(errors)} of {len(addresses)} did not answer ({listed})"
    )


class TLSClientCertificateRefused(redis.ConnectionError):
    """A TLS connection made without a client certificate was closed by the server before
    it answered (a reset, or an EOF, when the command was written): under TLS 1.3 a server
    that requires a client certificate checks it after the handshake, then alerts and
    closes, and whether the client reads that alert or finds the socket reset depends on
    timing. It persists on the retry, which a restarted server would refuse instead."""


_CLOSED = ("Connection reset by peer", "EOF occurred in violation of protocol", "Broken pipe")


def closed_without_client_certificate(conn: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is the server closing ``conn`` (a connection, or the pool it would
    come from; sync or asyncio) made over TLS without a client certificate."""
    import redis.asyncio

    ssl_classes = (redis.SSLConnection, redis.asyncio.SSLConnection)
    if isinstance(conn, (redis.ConnectionPool, redis.asyncio.ConnectionPool)):
        tls = issubclass(conn.connection_class, ssl_classes)
        certfile = conn.connection_kwargs.get("ssl_certfile")
    else:
        tls = isinstance(conn, ssl_classes)
        context = getattr(conn, "ssl_context", None)  # an asyncio connection keeps it there
        certfile = getattr(conn, "certfile", getattr(context, "certfile", None))
    return (
        tls
        and certfile is None
        and isinstance(exc, redis.ConnectionError)
        and any(marker in str(exc) for marker in _CLOSED)
    )


def refused_without_client_certificate(exc: BaseException) -> TLSClientCertificateRefused:
    return TLSClientCertificateRefused(
        f"{redact(exc)} (the server closed a TLS connection "
        f"made without a client certificate: it requires "
        f"one?)"
    )


class Script:
    """A Lua script and its SHA1 digest (what ``EVALSHA`` names it by)."""

    __slots__ = ("source", "sha")

    def __init__(self, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"<Script {self.sha[:12]}>"


def pack(*parts: list[str]) -> bytes:
    """One command in RESP, from lists of string arguments taken in order."""
    count = sum(len(part) for part in parts)
    out = [f"*{count}\r\n"]
    for part in parts:
        for arg in part:
            out.append(f"${len(arg) if arg.isascii() else len(arg.encode())}\r\n{arg}\r\n")
    return "".join(out).encode()


def text(value: Any) -> Any:
    """``value`` decoded when it is bytes (a client without ``decode_responses``), else
    unchanged; a byte that is not UTF-8 becomes U+FFFD, as the clients the settings build
    decode (``encoding_errors="replace"``), and readers then call the field malformed."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def socket_timeout(client: redis.Redis) -> float | None:
    """The single-node client's per-call socket timeout, seconds (None: none): its pool's
    ``socket_timeout``, else the connection class's default (redis-py 6+ gives a client
    built by ``from_url`` without one a 5 s timeout that its pool's arguments do not show)."""
    pool = client.connection_pool
    return effective_socket_timeout(pool.connection_kwargs, pool.connection_class)


def effective_socket_timeout(kwargs: dict[str, Any], connection_class: type) -> float | None:
    """The socket timeout, seconds, that connections of ``connection_class`` made with
    ``kwargs`` have (None or 0: none)."""
    value = kwargs["socket_timeout"] if "socket_timeout" in kwargs else _default(connection_class)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


@functools.cache
def _default(connection_class: type) -> Any:
    for klass in connection_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameter = inspect.signature(init).parameters.get("socket_timeout")
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return None


#: redis-py before 5.3 requires a command name for ``get_connection``; 5.3+ deprecates passing one.
POOL_WANTS_COMMAND = redis.VERSION < (5, 3)


def connection(pool: redis.ConnectionPool) -> Any:
    """A connection checked out of ``pool`` (give it back with ``pool.release``)."""
    try:
        return pool.get_connection("EVALSHA") if POOL_WANTS_COMMAND else pool.get_connection()
    except redis.ConnectionError as exc:
        if closed_without_client_certificate(pool, exc):
            raise refused_without_client_certificate(exc) from exc
        raise


def evalsha(client: redis.Redis, script: Script, keys: list[str], args: list[str]) -> Any:
    """Run ``script`` once with ``keys``/``args`` on a connection of ``client``'s pool, with
    the connection's retry policy, loading the script again if Redis does not have it
    (``NOSCRIPT``: a restart, a failover, ``SCRIPT FLUSH``). Returns the decoded reply.

    Raises ``ResponseError`` when Redis refuses the call, ``RedisError``/``OSError`` when it
    cannot be reached. Single node only: :func:`celery_steplock._redis.route.evalsha` takes
    either kind of client.
    """
    pool = client.connection_pool
    conn = connection(pool)
    try:

        def send() -> Any:
            conn.send_packed_command([pack(["EVALSHA", script.sha, str(len(keys))], keys, args)])
            return conn.read_response()

        def fail(_error: Exception) -> None:
            conn.disconnect()

        try:
            return conn.retry.call_with_retry(send, fail)
        except NoScriptError:
            script.sha = client.script_load(script.source)
            return conn.retry.call_with_retry(send, fail)
    except ReadOnlyError:
        # A replica answered (a demoted primary behind a fixed address): the next call
        # connects again, and so reaches whatever the address points at by then. Behind
        # Sentinel redis-py already turned this into a ConnectionError and retried.
        conn.disconnect()
        raise
    except ResponseError:
        raise
    except BaseException as exc:
        conn.disconnect()
        if closed_without_client_certificate(conn, exc):
            raise refused_without_client_certificate(exc) from exc
        raise
    finally:
        pool.release(conn)


def evalsha_many(client: redis.Redis, script: Script, calls: Iterable[Call]) -> list[Any]:
    """Run ``script`` once per ``(keys, args)`` of ``calls``, pipelined on one connection:
    every call is written as ``calls`` yields it (Redis runs the first while the next is
    encoded), then every reply is read. Returns the replies in order, a refused call's as
    its ``ResponseError`` instance (not raised). A ``NOSCRIPT`` reply loads the script and
    sends the whole batch again (each of our scripts is idempotent for its arguments).

    Raises ``RedisError``/``OSError`` when the round trip fails; not retried. Single node
    only: :func:`celery_steplock._redis.route.evalsha_many` takes either kind of client.
    """
    sent: list[Call] = []
    replies = _pipelined(client, script, calls, sent)
    if any(isinstance(r, NoScriptError) for r in replies):
        script.sha = client.script_load(script.source)
        replies = _pipelined(client, script, sent, [])
    return replies


def _pipelined(
    client: redis.Redis, script: Script, calls: Iterable[Call], sent: list[Call]
) -> list[Any]:
    pool = client.connection_pool
    conn = connection(pool)
    try:
        for keys, argv in calls:
            conn.send_packed_command([pack(["EVALSHA", script.sha, str(len(keys))], keys, argv)])
            sent.append((keys, argv))
        replies: list[Any] = []
        for _ in sent:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        if any(isinstance(r, ReadOnlyError) for r in replies):
            conn.disconnect()  # as in evalsha: reconnect on the next call
        return replies
    except BaseException as exc:
        conn.disconnect()
        if closed_without_client_certificate(conn, exc):
            raise refused_without_client_certificate(exc) from exc
        raise
    finally:
        pool.release(conn)


def misconfiguration(exc: BaseException) -> str | None:
    """Why ``exc`` (raised by redis-py) is a configuration error rather than an outage: a
    short reason ("permission refused", "authentication failed", "TLS certificate
    verification failed"), or None when it is not one (a retry may succeed).

    Looks at the exception and the chain of its causes: redis-py wraps a TLS verification
    failure (``ssl.SSLCertVerificationError``) or unusable TLS material (no client
    certificate under mutual TLS, a file that is not PEM, a key not matching its certificate)
    in a ``ConnectionError``. A :class:`SentinelDiscoveryError` gives its ``reason``.
    """
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, ssl.SSLCertVerificationError):
            return "TLS certificate verification failed"
        if isinstance(error, TLSClientCertificateRefused):
            return "TLS connection closed by the server (a client certificate it requires?)"
        if isinstance(error, SentinelDiscoveryError):
            if error.reason is not None:
                return error.reason
        else:
            # redis-py wraps the ssl.SSLError (or only its text) in a ConnectionError.
            tls = _tls_reason(error)
            if tls is not None:
                return tls
        if isinstance(error, NoPermissionError):
            return "permission refused"
        if isinstance(error, (AuthenticationError, AuthenticationWrongNumberOfArgsError)):
            return "authentication failed"
        if isinstance(error, ResponseError):
            message = str(error)
            if _AUTH.search(message):
                return "authentication failed"
            if _REFUSAL.search(message):
                return "permission refused"
        error = error.__cause__ or error.__context__
    return None


# OpenSSL's reasons for TLS material that no retry can fix (the peer's alert that it requires
# a client certificate, a file that is not PEM, a key that is not the certificate's).
_TLS_MATERIAL = (
    ("CERTIFICATE_REQUIRED", "TLS client certificate required by the server"),
    ("PEM lib", "TLS certificate or key file unreadable (not PEM)"),
    ("NO_START_LINE", "TLS certificate or key file unreadable (not PEM)"),
    ("KEY_VALUES_MISMATCH", "TLS client key does not match the certificate"),
    ("NO_CERTIFICATE_OR_CRL_FOUND", "TLS CA file holds no certificate (not PEM)"),
)


def _tls_reason(error: BaseException) -> str | None:
    found = " ".join(str(x) for x in (getattr(error, "reason", None), error) if x)
    if "EOF occurred in violation of protocol" in found and "writing" in found:
        # TLS 1.3: the handshake completes before the server checks the client's
        # certificate, then it alerts and closes, and the first command written finds the
        # connection closed (the alert unread). A restarted server is refused connections
        # on the retry instead, so this persists only when the server rejects the client.
        return "TLS connection closed by the server (a client certificate it requires?)"
    for marker, reason in _TLS_MATERIAL:
        if marker in found:
            return reason
    return None


def refused_command(exc: BaseException) -> str | None:
    """The command an ACL refusal names (lower case), when its message names one."""
    found = _COMMAND.search(str(exc))
    return found.group(1).lower() if found else None


def derived_client(client: Any, max_connections: int) -> Any:
    """A client like ``client`` (same class, server, credentials, TLS and timeouts: its
    pool's connection class and keyword arguments) on a pool of its own of at most
    ``max_connections`` connections; or ``client`` itself when its pool cannot be rebuilt
    that way (a pool class of unknown signature). A Sentinel pool
    (``SentinelConnectionPool``) is rebuilt on the same sentinels and service name."""
    from redis.sentinel import SentinelConnectionPool

    pool: Any = getattr(client, "connection_pool", None)
    sentinel = type(pool) is SentinelConnectionPool
    if not sentinel and type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return client
    # Entries a pool puts there for itself (redis-py 7+, and a Sentinel pool's reference to
    # itself) are the new pool's to make.
    kwargs = {k: v for k, v in pool.connection_kwargs.items() if k not in _POOL_OWN}
    if sentinel:
        own = SentinelConnectionPool(
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            is_master=pool.is_master,
            check_connection=pool.check_connection,
            max_connections=max_connections,
            **kwargs,
        )
    else:
        own = type(pool)(
            connection_class=pool.connection_class, max_connections=max_connections, **kwargs
        )
    try:
        return type(client)(connection_pool=own)
    except TypeError:
        own.disconnect()
        return client


# -- calls whose replies are read later --------------------------------------------------------

#: A :class:`Deferred` reads its replies with a blocking read once this many are pending.
MAX_PENDING = 64

#: Seconds a :class:`Deferred`'s drainer thread waits after a write before it reads the
#: replies arrived (at most one wake-up per that interval, whatever the rate of calls).
DRAIN_AFTER = 0.01

#: Called with ``(reply, error)`` when a deferred call's reply is read: the decoded reply
#: and None, or None and what redis-py raised (a refusal, or the connection's failure).
Done = Callable[[Any, "BaseException | None"], None]


class Deferred:
    """EVALSHA calls written without waiting for their replies, on a connection of their own
    (never one of ``client``'s pool, so an unread reply is never read by another caller as
    its own). A reply is read later: before the next call is written (only the replies
    already arrived: no wait), by a daemon thread of its own :data:`DRAIN_AFTER` seconds
    after a write (those arrived by then: an idle process still hears of its last call), by
    :meth:`drain_ready`, or by :meth:`drain` (blocking, at a worker's shutdown); each is
    handed to the call's ``done`` in that reader's thread.

    A ``NOSCRIPT`` reply (Redis restarted, failed over or flushed its scripts) runs the call
    again at once with :func:`evalsha`, which loads the script: the call's effect (a
    release's waiter wake-up) is never lost to it. A write or read that fails closes the
    connection and hands the error to every pending call; none is raised into a later call.

    Only for a single node reached by plain TCP or a Unix socket (``redis.Connection``,
    ``redis.UnixDomainSocketConnection``, see :func:`deferred_for`); forks: a child starts
    with no connection and no pending call (its parent's replies are the parent's).
    """

    def __init__(self, client: redis.Redis):
        self.client = client
        self.pid = os.getpid()
        self._guard = threading.Lock()
        self._conn: Any = None
        self._pending: deque[tuple[Script, list[str], list[str], Done]] = deque()
        self._wake = threading.Event()
        self._drainer: threading.Thread | None = None
        #: Calls written, replies read (for tests and benchmarks).
        self.sent = 0
        self.read = 0
        _deferreds.add(self)

    @property
    def pending(self) -> int:
        """Calls written whose reply is not read yet."""
        return len(self._pending)

    def _forked(self) -> None:
        # The parent's connection and replies are not this process's: dropped, not closed
        # (redis-py's disconnect only shuts a socket down in the process that opened it).
        self.pid = os.getpid()
        self._guard = threading.Lock()
        self._conn = None
        self._pending = deque()
        self._wake = threading.Event()
        self._drainer = None

    def _drain_later(self) -> None:
        # The drainer thread: DRAIN_AFTER after a write, read what arrived; again while
        # replies are pending. A daemon: a process exits without waiting for it.
        wake = self._wake
        while self.pid == os.getpid() and wake is self._wake:
            wake.wait()
            time.sleep(DRAIN_AFTER)
            wake.clear()
            try:
                self._drain(block=False)
            except BaseException:  # noqa: BLE001 - a done's error must not end the thread
                pass
            if self._pending:
                wake.set()

    def send(self, script: Script, keys: list[str], args: list[str], done: Done) -> None:
        """Write one EVALSHA of ``script`` and return without reading its reply; ``done``
        gets it later. Never raises a Redis error: a failed write is handed to ``done``."""
        if self.pid != os.getpid():
            self._forked()
        failed: list[tuple[Done, BaseException]] = []
        ready: list[tuple[Done, Any, BaseException | None]] = []
        with self._guard:
            if len(self._pending) >= MAX_PENDING:
                self._read(ready, failed, block=True)
            elif self._pending:
                self._read(ready, failed, block=False)
            if self._conn is not None and not self._pending and self._closed(self._conn):
                # The server closed it while no reply was due (its idle ``timeout``, a
                # CLIENT KILL, a restart): a write would be lost with it, so a new one.
                self._conn.disconnect()
                self._conn = None
            if self._conn is None:
                pool = self.client.connection_pool
                self._conn = pool.connection_class(
                    **{k: v for k, v in pool.connection_kwargs.items() if k not in _POOL_OWN}
                )
            conn = self._conn
            try:
                conn.send_packed_command(
                    [pack(["EVALSHA", script.sha, str(len(keys))], keys, args)],
                    check_health=False,
                )
                self._pending.append((script, keys, args, done))
                self.sent += 1
                if self._drainer is None:
                    self._drainer = threading.Thread(
                        target=self._drain_later, name="steplock-deferred-replies", daemon=True
                    )
                    self._drainer.start()
                self._wake.set()
            except BaseException as exc:  # noqa: BLE001 - handed to every pending call
                failed.extend(self._fail(exc))
                failed.append((done, exc))
        self._deliver(ready, failed)

    def settle(self, key: str) -> None:
        """When a pending call's first key is ``key``, read the replies up to it (waiting):
        Redis has then run it, before any command sent after this returns. Calls on other
        connections are not ordered with ours otherwise."""
        if any(entry[1][:1] == [key] for entry in list(self._pending)):
            self._drain(block=True)

    def drain_ready(self) -> int:
        """Read the replies already arrived (no wait); returns how many were read."""
        return self._drain(block=False)

    def drain(self) -> int:
        """Read every pending reply, each waiting at most the client's socket timeout;
        returns how many were read (or failed)."""
        return self._drain(block=True)

    def _drain(self, block: bool) -> int:
        if self.pid != os.getpid():
            self._forked()
            return 0
        if not self._pending:
            return 0
        failed: list[tuple[Done, BaseException]] = []
        ready: list[tuple[Done, Any, BaseException | None]] = []
        with self._guard:
            self._read(ready, failed, block=block)
        self._deliver(ready, failed)
        return len(ready) + len(failed)

    def _read(
        self,
        ready: list[tuple[Done, Any, BaseException | None]],
        failed: list[tuple[Done, BaseException]],
        block: bool,
    ) -> None:
        # Under the guard: the replies in the order the calls were written.
        conn = self._conn
        while self._pending:
            try:
                if not block and not conn.can_read(timeout=0):
                    return
                reply = conn.read_response()
                error: BaseException | None = None
            except ResponseError as exc:
                reply, error = None, exc
            except BaseException as exc:  # noqa: BLE001 - handed to every pending call
                failed.extend(self._fail(exc))
                return
            self.read += 1
            script, keys, args, done = self._pending[0]
            if isinstance(error, NoScriptError):
                # The script is gone from Redis: run the call again, loading it first. The
                # call stays pending meanwhile, so that settle() waits for this run.
                try:
                    reply, error = evalsha(self.client, script, keys, args), None
                except BaseException as exc:  # noqa: BLE001 - handed to done
                    error = exc
            self._pending.popleft()
            ready.append((done, reply, error))

    @staticmethod
    def _closed(conn: Any) -> bool:
        # With no reply due, anything readable is the server's close (or a stray byte).
        try:
            return bool(conn.can_read(timeout=0))
        except Exception:  # noqa: BLE001 - the close itself, as redis-py raises it
            return True

    def _fail(self, exc: BaseException) -> list[tuple[Done, BaseException]]:
        # Under the guard: the connection closed, every pending call failed with ``exc``.
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None
        failed = [(entry[3], exc) for entry in self._pending]
        self.read += len(failed)
        self._pending.clear()
        return failed

    @staticmethod
    def _deliver(
        ready: list[tuple[Done, Any, BaseException | None]],
        failed: list[tuple[Done, BaseException]],
    ) -> None:
        # Outside the guard: a callback may send again.
        for done, reply, error in ready:
            done(reply, error)
        for done, exc in failed:
            done(None, exc)


#: The connection classes a :class:`Deferred` may use: plain TCP and Unix sockets. A TLS
#: socket is not read and written by two threads at once safely, a Sentinel connection
#: finds its primary per pool, a cluster has one per node: those keep waiting.
_DEFERRABLE = (redis.Connection, redis.UnixDomainSocketConnection)

_deferreds: weakref.WeakSet[Deferred] = weakref.WeakSet()


def deferred_for(client: Any) -> Deferred | None:
    """A :class:`Deferred` on ``client``'s server, or None when its shape cannot defer
    safely: a pool of another class than redis-py's own two, a connection class other than
    ``redis.Connection``/``redis.UnixDomainSocketConnection`` (TLS, Sentinel, a factory's
    own) or a client-side cache."""
    pool: Any = getattr(client, "connection_pool", None)
    if type(pool) not in (redis.ConnectionPool, redis.BlockingConnectionPool):
        return None
    if pool.connection_class not in _DEFERRABLE or getattr(pool, "cache", None) is not None:
        return None
    return Deferred(client)


def drain_all(block: bool = True) -> int:
    """Read the pending replies of every :class:`Deferred` of this process (``block``:
    waiting for them, else only those arrived); returns how many."""
    return sum(d._drain(block) for d in list(_deferreds))


def _after_fork_in_child() -> None:
    for deferred in list(_deferreds):
        deferred._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
