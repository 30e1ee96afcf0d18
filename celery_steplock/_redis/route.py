"""One entry per Redis call for either kind of client: a single node (or Sentinel) client
goes through :mod:`~celery_steplock._redis.wire`, a ``RedisCluster`` through
:mod:`~celery_steplock._redis.cluster` (slot routing, ``MOVED``/``ASK`` followed)."""

from __future__ import annotations

from typing import Any, Iterable

from . import cluster, wire


def evalsha(client: Any, script: wire.Script, keys: list[str], args: list[str]) -> Any:
    """Run ``script`` once with ``keys``/``args``; see :func:`wire.evalsha` (a single node)
    and :func:`cluster.evalsha` (the primary owning the keys' slot). Returns the decoded
    reply.

    Raises:
        ResponseError: Redis refused the call.
        RedisError, OSError: Redis could not be reached.
    """
    if hasattr(client, "connection_pool"):
        return wire.evalsha(client, script, keys, args)
    return cluster.evalsha(cluster.resolve(client), script, keys, args)


def evalsha_many(client: Any, script: wire.Script, calls: Iterable[wire.Call]) -> list[Any]:
    """Run ``script`` once per ``(keys, args)`` of ``calls``, pipelined (one pipeline per
    node on a cluster). Returns the replies in order, a refused call's as its
    ``ResponseError`` instance.

    Raises:
        RedisError, OSError: the round trip failed (not retried).
    """
    if hasattr(client, "connection_pool"):
        return wire.evalsha_many(client, script, calls)
    return cluster.evalsha_many(cluster.resolve(client), script, calls)


def socket_timeout(client: Any) -> float | None:
    """The client's per-call socket timeout, seconds (None: none set)."""
    if cluster.is_cluster(client):
        return cluster.socket_timeout(client)
    return wire.socket_timeout(client)


def derived_client(client: Any, max_connections: int) -> Any:
    """A client like ``client`` on a pool of its own of at most ``max_connections``
    connections (:func:`wire.derived_client`); a cluster client itself (a deferred one must
    not be built here)."""
    if cluster.is_cluster(client):
        return client
    return wire.derived_client(client, max_connections)


def deferred(client: Any) -> wire.Deferred | None:
    """A :class:`wire.Deferred` (calls written now, replies read later) on ``client``'s
    server, or None when its shape keeps waiting for each reply: a cluster (a connection per
    node, ``MOVED`` followed per call), TLS, Sentinel or a pool of a client factory's own
    (:func:`wire.deferred_for`)."""
    if cluster.is_cluster(client):
        return None
    return wire.deferred_for(client)
