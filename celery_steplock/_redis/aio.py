"""The Redis calls of the asyncio API: the same :class:`~celery_steplock._redis.wire.Script`
objects (one script room: the same Lua, SHA and contracts as the synchronous calls), sent
through a ``redis.asyncio`` client (``Redis``, Sentinel's ``master_for``, or
``redis.asyncio.cluster.RedisCluster``, which routes a call by its keys' slot).

Errors are redis-py's (translated by the callers with
:func:`celery_steplock.lock.store_error`, as the synchronous calls are).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable

from redis.exceptions import ConnectionError, NoScriptError, ReadOnlyError, ResponseError

from . import wire

__all__ = ["is_async_client", "is_async_cluster", "evalsha", "evalsha_many", "command"]


def is_async_cluster(client: Any) -> bool:
    """Whether ``client`` is a ``redis.asyncio.cluster.RedisCluster``."""
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def is_async_client(client: Any) -> bool:
    """Whether ``client`` is a redis-py asyncio client (single node, Sentinel or Cluster)."""
    import redis.asyncio

    return isinstance(client, redis.asyncio.Redis) or is_async_cluster(client)


async def _dropped(client: Any) -> None:
    # A replica answered (a demoted primary behind a fixed address): the next call connects
    # again, and so reaches whatever the address points at by then (as wire.evalsha does).
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        await pool.disconnect(inuse_connections=False)


def _refusal(client: Any, exc: ConnectionError) -> ConnectionError:
    # The server closing a TLS connection made without the client certificate it requires
    # is a configuration error, as on the synchronous path (wire.connection).
    pool = getattr(client, "connection_pool", None)
    if pool is not None and wire.closed_without_client_certificate(pool, exc):
        return wire.refused_without_client_certificate(exc)
    return exc


async def evalsha(client: Any, script: wire.Script, keys: list[str], args: list[str]) -> Any:
    """Run ``script`` once with ``keys``/``args``, loading it again when Redis does not have
    it (``NOSCRIPT``: a restart, a failover, ``SCRIPT FLUSH``).

    On a single node (or Sentinel) client the call is packed once and written to a
    connection of the client's pool with the connection's retry policy, as
    :func:`celery_steplock._redis.wire.evalsha` does (redis-py's generic command path costs
    more than the call); a Cluster client routes it by the keys' slot.

    Args:
        client: A redis-py asyncio client.
        script: The script.
        keys: Its KEYS (on a Cluster, of one slot).
        args: Its ARGV.

    Returns:
        The reply, as the client decodes it.

    Raises:
        ResponseError: Redis refused the call.
        RedisError, OSError: Redis could not be reached.
    """
    packed = _packs(client)
    try:
        try:
            if packed:
                return await _packed(client, script, keys, args)
            return await client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            script.sha = wire.text(await _load(client, script))
            if packed:
                return await _packed(client, script, keys, args)
            return await client.evalsha(script.sha, len(keys), *keys, *args)
    except ReadOnlyError:
        await _dropped(client)
        raise
    except ConnectionError as exc:
        refusal = _refusal(client, exc)
        if refusal is exc:
            raise
        raise refusal from exc


def _packs(client: Any) -> bool:
    # A client of one connection (single_connection_client) serialises its commands with a
    # lock of its own: its generic path is kept.
    return getattr(client, "connection", True) is None and hasattr(client, "connection_pool")


async def _packed(client: Any, script: wire.Script, keys: list[str], args: list[str]) -> Any:
    pool = client.connection_pool
    conn = await (
        pool.get_connection("EVALSHA") if wire.POOL_WANTS_COMMAND else pool.get_connection()
    )
    command = wire.pack(["EVALSHA", script.sha, str(len(keys))], keys, args)
    try:
        stale = await _readable(conn)
    except (ConnectionError, OSError):
        stale = True
    if stale:
        # The server closed it while it sat in the pool (a restart, its idle timeout): opened
        # again before the call is written, as the sync pool does. redis-py's asyncio pool
        # reads the same end of stream as "readable" and keeps the connection when
        # maintenance notifications are on (redis-py 8's default), so the call would fail.
        await conn.disconnect()

    async def send() -> Any:
        await conn.send_packed_command(command)
        return await conn.read_response()

    async def fail(_error: BaseException) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(send, fail)
    except ResponseError:
        raise
    except BaseException:
        # a cancellation mid-reply leaves the connection's stream unreadable
        await asyncio.shield(conn.disconnect())
        raise
    finally:
        await pool.release(conn)


async def _readable(conn: Any) -> bool:
    # redis-py 8 names it can_read; earlier versions can_read_destructive.
    check = getattr(conn, "can_read", None) or conn.can_read_destructive
    return bool(await check())


async def _load(client: Any, script: wire.Script) -> Any:
    # On a Cluster, redis-py loads it on every primary (rare: after a restart or a flush).
    reply = await client.script_load(script.source)
    if isinstance(reply, dict):
        reply = next(iter(reply.values()))
    return reply


async def evalsha_many(client: Any, script: wire.Script, calls: Iterable[wire.Call]) -> list[Any]:
    """Run ``script`` once per ``(keys, args)`` of ``calls`` in one pipelined round trip (on
    a Cluster, every call in flight at once, each on its slot's primary). Returns the replies in
    order, a refused call's as its ``ResponseError`` instance (not raised); a ``NOSCRIPT``
    reply loads the script and sends the whole batch again (each of our scripts is
    idempotent for its arguments).

    Raises:
        RedisError, OSError: The round trip failed (not retried).
    """
    sent = list(calls)
    if not sent:
        return []
    try:
        replies = await _pipelined(client, script, sent)
        if any(isinstance(r, NoScriptError) for r in replies):
            script.sha = wire.text(await _load(client, script))
            replies = await _pipelined(client, script, sent)
    except ConnectionError as exc:
        refusal = _refusal(client, exc)
        if refusal is exc:
            raise
        raise refusal from exc
    if any(isinstance(r, ReadOnlyError) for r in replies):
        await _dropped(client)
    return replies


async def _pipelined(client: Any, script: wire.Script, calls: list[wire.Call]) -> list[Any]:
    if is_async_cluster(client):
        # redis-py's asyncio cluster pipeline refuses EVALSHA: the calls go out at once,
        # each routed to its slot's primary, and are awaited together.
        async def one(keys: list[str], args: list[str]) -> Any:
            try:
                return await client.evalsha(script.sha, len(keys), *keys, *args)
            except ResponseError as exc:
                return exc

        return list(await asyncio.gather(*(one(keys, args) for keys, args in calls)))
    pipe = client.pipeline(transaction=False)
    for keys, args in calls:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    return list(await pipe.execute(raise_on_error=False))


async def command(client: Any, *args: Any, **options: Any) -> Any:
    """One plain command (``BLPOP``, ``ZREM``, ``TIME``...) through the client's own path.

    Raises:
        ResponseError, RedisError, OSError: as redis-py raises them.
    """
    try:
        return await client.execute_command(*args, **options)
    except ConnectionError as exc:
        refusal = _refusal(client, exc)
        if refusal is exc:
            raise
        raise refusal from exc
