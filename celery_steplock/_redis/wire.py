"""EVALSHA on a redis-py client's pooled connections: the one module that knows redis-py's
connection internals (pool, packed commands, the connection's retry policy).

Commands are packed here in RESP rather than by redis-py's encoder, which costs several times
more per argument: that counts when a renewal call carries thousands of arguments, and a
lock cycle's client time is mostly what surrounds its two commands.
"""

from __future__ import annotations

import hashlib
import re
import ssl
from typing import Any, Iterable

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


def _closed_without_client_certificate(conn: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is the server closing ``conn`` (a connection, or the pool it would
    come from) made over TLS without a client certificate."""
    if isinstance(conn, redis.ConnectionPool):
        tls = issubclass(conn.connection_class, redis.SSLConnection)
        certfile = conn.connection_kwargs.get("ssl_certfile")
    else:
        tls = isinstance(conn, redis.SSLConnection)
        certfile = getattr(conn, "certfile", None)
    return (
        tls
        and certfile is None
        and isinstance(exc, redis.ConnectionError)
        and any(marker in str(exc) for marker in _CLOSED)
    )


def _refused_without_client_certificate(exc: BaseException) -> TLSClientCertificateRefused:
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
    """``value`` decoded when it is bytes, else unchanged."""
    return value.decode() if isinstance(value, bytes) else value


def socket_timeout(client: redis.Redis) -> float | None:
    """The single-node client's per-call socket timeout, seconds (None: none set)."""
    return client.connection_pool.connection_kwargs.get("socket_timeout")


#: redis-py before 5.3 requires a command name for ``get_connection``; 5.3+ deprecates passing one.
_POOL_WANTS_COMMAND = redis.VERSION < (5, 3)


def connection(pool: redis.ConnectionPool) -> Any:
    """A connection checked out of ``pool`` (give it back with ``pool.release``)."""
    try:
        return pool.get_connection("EVALSHA") if _POOL_WANTS_COMMAND else pool.get_connection()
    except redis.ConnectionError as exc:
        if _closed_without_client_certificate(pool, exc):
            raise _refused_without_client_certificate(exc) from exc
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
        if _closed_without_client_certificate(conn, exc):
            raise _refused_without_client_certificate(exc) from exc
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
        if _closed_without_client_certificate(conn, exc):
            raise _refused_without_client_certificate(exc) from exc
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
