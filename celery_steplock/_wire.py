"""EVALSHA on a redis-py client's pooled connections: the one module that knows redis-py's
connection internals (pool, packed commands, the connection's retry policy).

Commands are packed here in RESP rather than by redis-py's encoder, which costs several times
more per argument: that counts when a renewal call carries thousands of arguments, and a
lock cycle's client time is mostly what surrounds its two commands.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterable

import redis
from redis.exceptions import NoScriptError, ResponseError

__all__ = ["Script", "pack", "text", "evalsha", "evalsha_many", "socket_timeout"]

Call = tuple[list[str], list[str]]  # (KEYS, ARGV) of one EVALSHA


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
    """The client's per-call socket timeout, seconds (None: none set)."""
    return client.connection_pool.connection_kwargs.get("socket_timeout")


#: redis-py before 5.3 requires a command name for ``get_connection``; 5.3+ deprecates passing one.
_POOL_WANTS_COMMAND = redis.VERSION < (5, 3)


def _connection(pool: redis.ConnectionPool) -> Any:
    """A connection checked out of ``pool`` (give it back with ``pool.release``)."""
    return pool.get_connection("EVALSHA") if _POOL_WANTS_COMMAND else pool.get_connection()


def evalsha(client: redis.Redis, script: Script, keys: list[str], args: list[str]) -> Any:
    """Run ``script`` once with ``keys``/``args`` on a connection of ``client``'s pool, with
    the connection's retry policy, loading the script again if Redis does not have it
    (``NOSCRIPT``: a restart, a failover, ``SCRIPT FLUSH``). Returns the decoded reply.

    Raises ``ResponseError`` when Redis refuses the call, ``RedisError``/``OSError`` when it
    cannot be reached.
    """
    pool = client.connection_pool
    conn = _connection(pool)
    try:
        def send() -> Any:
            conn.send_packed_command(
                [pack(["EVALSHA", script.sha, str(len(keys))], keys, args)])
            return conn.read_response()

        def fail(_error: Exception) -> None:
            conn.disconnect()

        try:
            return conn.retry.call_with_retry(send, fail)
        except NoScriptError:
            script.sha = client.script_load(script.source)
            return conn.retry.call_with_retry(send, fail)
    except ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def evalsha_many(client: redis.Redis, script: Script, calls: Iterable[Call]) -> list[Any]:
    """Run ``script`` once per ``(keys, args)`` of ``calls``, pipelined on one connection:
    every call is written as ``calls`` yields it (Redis runs the first while the next is
    encoded), then every reply is read. Returns the replies in order, a refused call's as
    its ``ResponseError`` instance (not raised). A ``NOSCRIPT`` reply loads the script and
    sends the whole batch again (each of our scripts is idempotent for its arguments).

    Raises ``RedisError``/``OSError`` when the round trip fails; not retried.
    """
    sent: list[Call] = []
    replies = _pipelined(client, script, calls, sent)
    if any(isinstance(r, NoScriptError) for r in replies):
        script.sha = client.script_load(script.source)
        replies = _pipelined(client, script, sent, [])
    return replies


def _pipelined(client: redis.Redis, script: Script, calls: Iterable[Call],
               sent: list[Call]) -> list[Any]:
    pool = client.connection_pool
    conn = _connection(pool)
    try:
        for keys, argv in calls:
            conn.send_packed_command(
                [pack(["EVALSHA", script.sha, str(len(keys))], keys, argv)])
            sent.append((keys, argv))
        replies: list[Any] = []
        for _ in sent:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
