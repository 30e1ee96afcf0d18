"""Redis Cluster support: the client, slot routing of script calls, per-node batching of
renewals and scans that walk every primary.

Every key of one lease (hash, fencing counter, waiters, wake-up list) carries the name as a
hash tag (``steplock:lease:{order:42}``; see :mod:`celery_steplock.keys`), so one lease's
scripts run on one node. What spans leases (the heartbeat's renewals, the reaper's deletes,
the admin's reads) is split here: one script call per slot (Redis refuses a call whose keys
hash to different slots, ``CROSSSLOT``, even on one node), every call of one node pipelined
on one of its connections, every node's calls written before any reply is read. So a
renewal cycle costs one round trip per node holding leases, all of them in flight at once.

Redirections are followed here rather than by redis-py's cluster client (whose per-command
path cannot pipeline our packed calls): ``MOVED`` refreshes the slot table and resends,
``ASK`` sends ``ASKING`` then the call to the importing node, ``TRYAGAIN`` (a multi-key call
while a migration has moved some of its keys) waits and resends, ``NOSCRIPT`` loads the
script on that node; all bounded by :data:`MAX_REDIRECTS` and :data:`TRYAGAIN_WAIT`.

A plain ``redis.Redis`` never reaches this module: :mod:`celery_steplock._redis.wire` hands a
client over only when it has no ``connection_pool`` (a ``RedisCluster`` has one per node).
"""

from __future__ import annotations

import re
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import redis.cluster as _redis_cluster
from redis import __version__ as _redis_version
from redis.backoff import FullJitterBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry

from ..exceptions import LockStoreUnavailable
from ..keys import lease_key, lease_keys
from . import wire
from .scripts.lease import EXTEND_CHUNK

__all__ = [
    "is_cluster",
    "resolve",
    "make_client",
    "DeferredCluster",
    "socket_timeout",
    "slot_of",
    "by_slot",
    "typed",
    "redirect_hint",
    "evalsha",
    "evalsha_many",
    "primaries",
    "scan_keys",
    "encode_cursor",
    "decode_cursor",
    "ClusterStoreMixin",
    "MAX_REDIRECTS",
    "TRYAGAIN_WAIT",
    "SlotUnavailable",
]


class SlotUnavailable(RedisClusterException):
    """A call still redirected (``TRYAGAIN``, ``MOVED``, ``ASK``, ``CLUSTERDOWN``) when its
    retries ran out (:data:`TRYAGAIN_WAIT` seconds, :data:`MAX_REDIRECTS` redirections): its
    slot's migration or failover outlasted them. Not a refusal (not a ``ResponseError``): the
    lease store reports it as ``LockStoreUnavailable``, retried like an outage (docs/cluster.md).
    The last redirection is its ``__cause__``; ``kind`` names it (``"TRYAGAIN"``,
    ``"MOVED"``, ``"ASK"``, ``"CLUSTERDOWN"``)."""

    def __init__(self, message: str, kind: str = "") -> None:
        super().__init__(message)
        self.kind = kind


#: Redirections (MOVED, ASK) and connection failures one call follows before giving up.
MAX_REDIRECTS = 5
#: Seconds a call keeps resending on TRYAGAIN (a migration of its slot in progress).
TRYAGAIN_WAIT = 2.0
_TRYAGAIN_DELAY = 0.05

#: A cluster cursor is ``(lowest slot of the primary + 1) << 64 | that primary's cursor``:
#: Redis's own cursors are unsigned 64-bit, and 0 still means "start" and "complete".
_CURSOR_SHIFT = 64
SLOTS = 16384

_CONNECTION_ERRORS = (RedisError, OSError, RedisClusterException)
# How redis-py's cluster client refuses a URL before connecting (a database other than 0,
# a Unix socket).
_URL_REFUSED = re.compile(r"\bdb\b|Unix Domain Socket", re.IGNORECASE)


def is_cluster(client: Any) -> bool:
    """Whether ``client`` is a redis-py ``RedisCluster`` (or stands for one)."""
    return isinstance(client, (RedisCluster, DeferredCluster))


def resolve(client: Any) -> RedisCluster:
    """The ``RedisCluster`` behind ``client``; AttributeError when it is not a cluster
    client. Raises what building a deferred one raises."""
    if isinstance(client, RedisCluster):
        return client
    if isinstance(client, DeferredCluster):
        return client.get()
    raise AttributeError(
        f"{type(client).__name__} has no connection_pool: neither a "
        f"redis.Redis nor a redis.cluster.RedisCluster"
    )


def make_client(url: str, socket_timeout: float = 5.0, **options: Any) -> RedisCluster:
    """A ``RedisCluster`` that discovers the cluster from the node of ``url`` (any node,
    primary or replica; ``rediss://`` and credentials as in the URL): ``socket_timeout``
    seconds per attempt and one quick retry per node, as the single-node client.
    ``options``: connection options for every node's connections (``client_name``,
    ``socket_keepalive``... and the ``ssl_*`` TLS options with
    ``connection_class=redis.SSLConnection``, which turns TLS on with a ``redis://`` URL).

    Building one reads the slot table. When no node answers, a :class:`DeferredCluster` is
    returned instead, which builds the client at its first use (each use raising the store
    error until the cluster answers), so an outage at start is an outage, not a crash.
    Raises ImproperlyConfigured (``steplock_redis_cluster``) when the node is not in
    cluster mode, (``steplock_redis_url``) when ``url`` names a database other than 0 or
    a Unix socket, and (``steplock_redis_use_ssl``/``steplock_redis_transport_options``)
    when redis-py's cluster client does not pass one of ``options`` to its connections.
    """
    from ..exceptions import ImproperlyConfigured

    allowed = getattr(_redis_cluster, "REDIS_ALLOWED_KEYS", None)
    if allowed is not None:
        dropped = sorted(k for k in options if k not in allowed)
        if dropped:
            setting = (
                "steplock_redis_use_ssl"
                if all(k.startswith("ssl") for k in dropped)
                else "steplock_redis_transport_options"
            )
            raise ImproperlyConfigured(
                f"{setting}: redis-py's cluster client (redis {_redis_version}) does not "
                f"pass {', '.join(dropped)} to its connections; remove it with "
                f"steplock_redis_cluster=True",
                setting=setting,
            )

    def build() -> RedisCluster:
        try:
            return RedisCluster.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                retry=Retry(FullJitterBackoff(cap=0.2, base=0.05), 1),
                decode_responses=True,
                encoding_errors="replace",
                **options,
            )
        except RedisClusterException as exc:
            message = str(exc)
            if "cluster mode is not enabled" in message.lower():
                raise ImproperlyConfigured(
                    f"steplock_redis_cluster is True but the Redis at the lock store's URL "
                    f"is not in cluster mode ({exc}); set it to False",
                    setting="steplock_redis_cluster",
                ) from exc
            if _URL_REFUSED.search(message):
                # Refused before anything connects: no retry can fix it.
                raise ImproperlyConfigured(
                    f"steplock_redis_url with steplock_redis_cluster=True must be a "
                    f"redis:// or rediss:// URL of database 0 (a cluster has no other): "
                    f"{exc}",
                    setting="steplock_redis_url",
                ) from exc
            raise

    try:
        return build()
    except _CONNECTION_ERRORS:
        return DeferredCluster(build, socket_timeout)  # type: ignore[return-value]


class DeferredCluster:
    """Stands for a ``RedisCluster`` that could not be built yet (no node answered): builds
    it at the first use that finds the cluster, and delegates every attribute to it."""

    def __init__(self, build, socket_timeout: float | None = None):
        self._build = build
        #: The socket timeout the client will have, seconds.
        self.socket_timeout = socket_timeout
        self._client: RedisCluster | None = None
        self._guard = threading.Lock()

    def get(self) -> RedisCluster:
        """The client; raises ``RedisClusterException``/``RedisError`` while no node answers."""
        client = self._client
        if client is None:
            with self._guard:
                if self._client is None:
                    self._client = self._build()
                client = self._client
        return client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def __repr__(self) -> str:
        return f"<DeferredCluster {self._client!r}>"


def socket_timeout(client: RedisCluster) -> float | None:
    """The per-call socket timeout of ``client``'s node connections, seconds (None: none)."""
    if isinstance(client, DeferredCluster):
        return client.socket_timeout
    manager = client.nodes_manager
    return wire.effective_socket_timeout(
        manager.connection_kwargs,
        manager.connection_kwargs.get("connection_class", Connection),
    )


_TYPED: dict[str, type[ResponseError]] = {
    "MOVED": MovedError,
    "ASK": AskError,
    "TRYAGAIN": TryAgainError,
    "CLUSTERDOWN": ClusterDownError,
    "NOSCRIPT": NoScriptError,
}


def typed(error: Exception) -> Exception:
    """``error`` as redis-py's class for its Redis error code (``MOVED``, ``ASK``,
    ``TRYAGAIN``, ``CLUSTERDOWN``, ``NOSCRIPT``) when the connection's parser left it a plain
    ``ResponseError`` (older redis-py versions map them for cluster connections only)."""
    if type(error) is ResponseError:
        message = str(error)
        code, _, rest = message.partition(" ")
        cls = _TYPED.get(code)
        if cls is not None:
            return cls(rest) if issubclass(cls, AskError) else cls(message)
    return error


def redirect_hint(error: Exception) -> str:
    """What to add to the message of a refusal: a ``MOVED``/``ASK`` reached a plain client
    because the URL names a Redis Cluster node."""
    error = typed(error)
    if isinstance(error, AskError):
        kind = "MOVED" if isinstance(error, MovedError) else "ASK"
        return (
            f" ({kind}: the Redis URL names a Redis Cluster node; set "
            f"steplock_redis_cluster = True, CELERY_STEPLOCK_REDIS_CLUSTER in Django "
            f"settings)"
        )
    return ""


def slot_of(key: str) -> int:
    """The hash slot of ``key`` (its ``{hash tag}`` when it has one)."""
    return key_slot(key.encode())


def _refresh(client: RedisCluster) -> None:
    """Reload the slot table from the cluster; a failure leaves the old one."""
    try:
        client.nodes_manager.initialize()
    except _CONNECTION_ERRORS:
        pass


def _node_at(client: RedisCluster, host: str, port: int):
    nodes = client.nodes_manager
    node = nodes.get_node(host=host, port=port)
    if node is None:
        _refresh(client)
        node = nodes.get_node(host=host, port=port)
    return node


def evalsha(client: RedisCluster, script: wire.Script, keys: list[str], args: list[str]) -> Any:
    """:func:`celery_steplock._redis.wire.evalsha` on the primary owning ``keys``' slot (all of
    ``keys`` must share one), redirections followed. Raises ``ResponseError`` when Redis
    refuses the call (``CROSSSLOT`` included), ``RedisError``/``OSError`` when the node cannot
    be reached or the redirections run out."""
    [reply] = _run(client, script, [(keys, args)])
    if isinstance(reply, BaseException):
        raise reply
    return reply


def evalsha_many(
    client: RedisCluster, script: wire.Script, calls: Iterable[wire.Call]
) -> list[Any]:
    """:func:`celery_steplock._redis.wire.evalsha_many` over a cluster: each call goes to the
    primary owning its keys' slot, the calls of one node pipelined on one connection, every
    node written before any is read (one round trip per node, concurrently). Returns the
    replies in order, a call that failed as its exception instance (a refusal's
    ``ResponseError``, or the ``RedisError``/``OSError`` of a node that could not be reached).

    Raises the ``RedisError``/``OSError`` when no call got through at all.
    """
    calls = list(calls)
    replies = _run(client, script, calls)
    if calls and all(
        isinstance(r, BaseException) and not isinstance(r, (ResponseError, SlotUnavailable))
        for r in replies
    ):
        raise replies[0]
    return replies


def _run(client: RedisCluster, script: wire.Script, calls: Sequence[wire.Call]) -> list[Any]:
    replies: list[Any] = [None] * len(calls)
    pending = list(range(len(calls)))
    asked: dict[int, tuple[str, int]] = {}  # call -> importing node (host, port) after ASK
    redirects = 0
    tryagain_until = None
    while pending:
        failures = _round_trip(client, script, calls, pending, asked, replies)
        retry: list[int] = []
        refresh = tryagain = False
        for i in pending:
            reply = replies[i]
            if not isinstance(reply, BaseException):
                asked.pop(i, None)
                continue
            if isinstance(reply, MovedError):
                asked.pop(i, None)
                refresh = True
            elif isinstance(reply, AskError):
                asked[i] = (reply.host, int(reply.port))
            elif isinstance(reply, TryAgainError):
                tryagain = True
            elif isinstance(reply, NoScriptError):
                pass  # loaded on that node by _round_trip; resending is not a redirection
            elif isinstance(reply, ClusterDownError) or (
                not isinstance(reply, ResponseError) and i in failures
            ):
                asked.pop(i, None)
                refresh = True
            else:
                continue
            retry.append(i)
        if not retry:
            break
        if tryagain:
            now = time.monotonic()
            tryagain_until = tryagain_until or now + TRYAGAIN_WAIT
            if now >= tryagain_until:
                return _gave_up(replies, retry)
            time.sleep(_TRYAGAIN_DELAY)
        if any(not isinstance(replies[i], TryAgainError) for i in retry):
            redirects += 1
            if redirects > MAX_REDIRECTS:
                return _gave_up(replies, retry)
        if refresh:
            _refresh(client)
        pending = retry
    return replies


def _gave_up(replies: list[Any], retry: list[int]) -> list[Any]:
    """``replies`` with each redirection of ``retry`` (the calls still to resend) as a
    :class:`SlotUnavailable`; a connection failure stays as it is."""
    for i in retry:
        reply = replies[i]
        if isinstance(reply, (AskError, TryAgainError, ClusterDownError)):
            kind = (
                "TRYAGAIN"
                if isinstance(reply, TryAgainError)
                else "MOVED"
                if isinstance(reply, MovedError)
                else "ASK"
                if isinstance(reply, AskError)
                else "CLUSTERDOWN"
            )
            gone = SlotUnavailable(
                f"{kind} after {TRYAGAIN_WAIT:g} s of resends or {MAX_REDIRECTS} redirections "
                f"(a migration or failover of the slot in progress): {reply}",
                kind=kind,
            )
            gone.__cause__ = reply
            replies[i] = gone
    return replies


def _round_trip(
    client: RedisCluster,
    script: wire.Script,
    calls: Sequence[wire.Call],
    pending: list[int],
    asked: dict[int, tuple[str, int]],
    replies: list[Any],
) -> set[int]:
    """Send the ``pending`` calls, grouped by node, then read every reply into ``replies``.
    Returns the calls whose node could not be reached (their reply is the error)."""
    nodes = client.nodes_manager
    groups: dict[str, tuple[Any, list[int]]] = {}
    failed: set[int] = set()
    for i in pending:
        try:
            if i in asked:
                node = _node_at(client, *asked[i])
                if node is None:
                    raise MovedError(f"0 {asked[i][0]}:{asked[i][1]}")
            else:
                node = nodes.get_node_from_slot(slot_of(calls[i][0][0]))
        except (RedisError, RedisClusterException) as exc:
            # No node serves the slot (yet): a failure of this call, retried after a refresh.
            replies[i] = exc if isinstance(exc, RedisError) else ClusterError(str(exc))
            failed.add(i)
            continue
        group = groups.get(node.name)
        if group is None:
            group = groups[node.name] = (node, [])
        group[1].append(i)
    sha = script.sha
    open_: list[tuple[Any, Any, list[int]]] = []
    try:
        for node, members in groups.values():
            redis_node = client.get_redis_connection(node)
            pool = redis_node.connection_pool
            conn = None
            try:
                conn = wire.connection(pool)
                open_.append((redis_node, conn, members))
                packed: list[bytes] = []
                for i in members:
                    keys, argv = calls[i]
                    if i in asked:
                        packed.append(wire.pack(["ASKING"]))
                    packed.append(wire.pack(["EVALSHA", sha, str(len(keys))], keys, argv))
                conn.send_packed_command([b"".join(packed)])  # one write per node
            except _CONNECTION_ERRORS as exc:
                if conn is not None:
                    conn.disconnect()
                    open_.pop()
                    pool.release(conn)
                for i in members:
                    replies[i] = exc
                    failed.add(i)
        for redis_node, conn, members in open_:
            loaded = False
            for n, i in enumerate(members):
                try:
                    if i in asked:
                        try:
                            conn.read_response()  # ASKING's +OK
                        except ResponseError:
                            pass
                    replies[i] = conn.read_response()
                except ResponseError as exc:
                    replies[i] = exc = typed(exc)  # type: ignore[assignment]
                    if isinstance(exc, NoScriptError) and not loaded:
                        loaded = True
                        _load(redis_node, script)
                except _CONNECTION_ERRORS as exc:
                    conn.disconnect()
                    for j in members[n:]:
                        replies[j] = exc
                        failed.add(j)
                    break
    except BaseException:
        for _node, conn, _members in open_:
            conn.disconnect()  # replies may be left unread on it
        raise
    finally:
        for redis_node, conn, _members in open_:
            redis_node.connection_pool.release(conn)
    return failed


def _load(redis_node: Any, script: wire.Script) -> None:
    try:
        redis_node.script_load(script.source)
    except _CONNECTION_ERRORS:
        pass  # the resend fails the same way and reports it


def primaries(client: RedisCluster) -> list[tuple[int, Any]]:
    """``(lowest slot served, node)`` of every primary in the client's slot table, by slot."""
    lowest: dict[str, tuple[int, Any]] = {}
    for slot, nodes in client.nodes_manager.slots_cache.items():
        if nodes:
            primary = nodes[0]
            seen = lowest.get(primary.name)
            if seen is None or slot < seen[0]:
                lowest[primary.name] = (slot, primary)
    return sorted(lowest.values(), key=lambda item: item[0])


def encode_cursor(slot: int, node_cursor: int) -> int:
    """The cluster cursor resuming the primary serving ``slot`` at its ``node_cursor``."""
    return ((slot + 1) << _CURSOR_SHIFT) | node_cursor


def decode_cursor(cursor: int) -> tuple[int, int]:
    """``(slot, node_cursor)`` of :func:`encode_cursor`; cursor 0: the first primary from 0
    (slot -1: before every slot)."""
    if cursor <= 0:
        return -1, 0
    return (cursor >> _CURSOR_SHIFT) - 1, cursor & ((1 << _CURSOR_SHIFT) - 1)


def scan_keys(client: RedisCluster, cursor: int, count: int, match: str) -> tuple[int, list[str]]:
    """One ``SCAN`` step on one primary: ``(next_cursor, keys)``. The walk visits the
    primaries by their lowest slot, each from its cursor 0 to 0 again, and ends (cursor 0)
    after the last; a primary is found again by a slot it serves, so a failover during the
    walk resumes on the promoted replica. Raises ``RedisError``/``OSError``."""
    slot, node_cursor = decode_cursor(cursor)
    walk = primaries(client)
    if not walk or slot >= SLOTS:  # no slot table, or not a cursor of ours: nothing left
        return 0, []
    if slot < 0:
        slot, node = walk[0]
    else:
        node = client.nodes_manager.get_node_from_slot(slot)
    redis_node = client.get_redis_connection(node)
    try:
        next_cursor, keys = redis_node.scan(cursor=node_cursor, match=match, count=count)
    except _CONNECTION_ERRORS:
        _refresh(client)
        raise
    next_cursor = int(next_cursor)
    if next_cursor:
        return encode_cursor(slot, next_cursor), [wire.text(k) for k in keys]
    later = [s for s, other in walk if s > slot and other.name != node.name]
    return (encode_cursor(later[0], 0) if later else 0), [wire.text(k) for k in keys]


def by_slot(keys: Iterable[str]) -> dict[int, list[int]]:
    """Positions of ``keys`` grouped by hash slot, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for n, key in enumerate(keys):
        slot = slot_of(key)
        group = groups.get(slot)
        if group is None:
            groups[slot] = [n]
        else:
            group.append(n)
    return groups


class ClusterStoreMixin:
    """The lease store's methods that span leases, split by slot for a ``RedisCluster``
    (mixed before :class:`celery_steplock.lock.RedisLeaseStore`, whose one-lease methods
    are routed by :mod:`celery_steplock._redis.wire`)."""

    if TYPE_CHECKING:  # the attributes of RedisLeaseStore, which this is mixed into

        def __getattr__(self, name: str) -> Any: ...

    def extend_many(self, items, chunk: int | None = None) -> list[bool]:
        """Extend many leases ``(name, owner, ttl seconds)``: one script call per slot (at
        most ``chunk`` leases each), pipelined per node, every node at once (one round trip
        per node). Returns one bool per item, as :meth:`extend`.

        Raises LockStoreUnavailable when a node cannot be reached or refuses; its
        ``context["results"]`` then holds, per item, True/False as above for the nodes that
        answered and None for the others (unknown: neither renewed nor lost).
        """
        chunk = chunk or EXTEND_CHUNK
        items = self._checked_items(items)
        keys = lease_keys(self.prefix, [name for name, _owner, _ttl in items])
        calls: list[wire.Call] = []
        members: list[list[int]] = []
        for positions in by_slot(keys).values():
            for start in range(0, len(positions), chunk):
                part = positions[start : start + chunk]
                argv: list[str] = []
                for n in part:
                    argv.append(items[n][1])
                    argv.append(str(max(1, int(items[n][2] * 1000))))
                calls.append(([keys[n] for n in part], argv))
                members.append(part)
        if not calls:
            return []
        replies = self._split_tryagain(calls, members)
        results: list[bool | None] = [None] * len(items)
        error = None
        for part, reply in zip(members, replies):
            if isinstance(reply, BaseException):
                error = error or reply
                continue
            for n, c in zip(part, wire.text(reply)):
                results[n] = c == "1"
        if error is not None:
            what = (
                "refused a renewal"
                if isinstance(error, ResponseError)
                else "unavailable during renewal"
            )
            raise LockStoreUnavailable(f"lock store {what}: {error}", results=results)
        return results  # type: ignore[return-value]

    def _split_tryagain(self, calls: list[wire.Call], members: list[list[int]]) -> list[Any]:
        """The replies of ``calls``; a call of several leases that kept getting TRYAGAIN (a
        migration has moved some of its slot's keys) is resent one lease per call, which
        each follow ASK on their own."""
        try:
            replies = evalsha_many(self.client, self._extend_many, calls)
        except _CONNECTION_ERRORS as exc:
            raise LockStoreUnavailable(
                f"lock store unavailable during renewal: {exc}",
                results=[None] * sum(map(len, members)),
            ) from exc
        for c, reply in enumerate(replies):
            tryagain = isinstance(reply, TryAgainError) or (
                isinstance(reply, SlotUnavailable) and reply.kind == "TRYAGAIN"
            )
            if tryagain and len(members[c]) > 1:
                keys, argv = calls[c]
                singles = [([key], argv[2 * k : 2 * k + 2]) for k, key in enumerate(keys)]
                try:
                    parts = evalsha_many(self.client, self._extend_many, singles)
                except _CONNECTION_ERRORS as exc:
                    parts = [exc]
                if any(isinstance(p, BaseException) for p in parts):
                    replies[c] = next(p for p in parts if isinstance(p, BaseException))
                else:
                    replies[c] = "".join(wire.text(p) for p in parts)
        return replies

    def scan_keys(
        self, cursor: int = 0, count: int = 500, match: str = "*"
    ) -> tuple[int, list[str]]:
        """One ``SCAN`` step on one primary (see :func:`scan_keys` for the walk):
        ``(next_cursor, keys)``; ``next_cursor`` 0 when every primary was walked."""
        cursor, count, match = self._checked_scan(cursor, count, match)
        try:
            return scan_keys(self.client, cursor, count, lease_key(self.prefix, match))
        except _CONNECTION_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during scan: {exc}") from exc

    def read_leases(self, keys: list[str]) -> dict[str, dict[str, Any] | None]:
        """As the single-node store's, with one script call per slot (pipelined per node)."""
        keys = self._checked_keys(keys)
        if not keys:
            return {}
        groups = list(by_slot(keys).values())
        calls: list[wire.Call] = [([keys[n] for n in group], []) for group in groups]
        try:
            replies = evalsha_many(self.client, self._scan_fields, calls)
        except _CONNECTION_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable during scan: {exc}") from exc
        flat: list[Any] = [None] * (2 * len(keys))
        for group, reply in zip(groups, replies):
            if isinstance(reply, BaseException):
                raise LockStoreUnavailable(f"lock store refused the scan: {reply}")
            for n, doc, pttl in zip(group, reply[::2], reply[1::2]):
                flat[2 * n], flat[2 * n + 1] = doc, pttl
        return self._parse_scan_fields(keys, flat)

    def time_and_size(self) -> tuple[int, int]:
        """Redis server time (ms, one primary's clock) and the number of keys of every
        primary. Raises LockStoreUnavailable."""
        try:
            seconds, micros = self.client.time()
            size = sum(
                int(self.client.get_redis_connection(node).dbsize())
                for _slot, node in primaries(self.client)
            )
        except _CONNECTION_ERRORS as exc:
            raise LockStoreUnavailable(f"lock store unavailable: {exc}") from exc
        return int(seconds) * 1000 + int(micros) // 1000, size
