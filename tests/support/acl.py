"""Redis ACL users for tests: the least-privilege user of the lease store, and variants of it.

``STEPLOCK_COMMANDS`` is every command the library sends (directly or from its Lua scripts,
which Redis checks against the ACL too); :func:`acl_rules` turns it into the rules of
``ACL SETUSER`` for a key prefix, and :func:`create_user` creates such a user on a running
server (a :class:`~tests.support.servers.RedisServer` or a URL of a user allowed to run
``ACL``) and returns the URL to log in as it.
"""

from __future__ import annotations

from typing import Iterable
from urllib.parse import quote, urlsplit, urlunsplit

import redis

__all__ = ["STEPLOCK_COMMANDS", "acl_rules", "acl_setuser_line", "create_user", "drop_user"]

#: Every command of the lease store, sorted: the client's own (EVALSHA, SCRIPT LOAD after a
#: NOSCRIPT, BLPOP and ZREM of a waiter, SCAN, HGETALL and PTTL of inspect, TIME of the
#: reaper/admin/`ls`, DBSIZE of the admin page, PING of the Django check), those of the
#: Lua scripts (celery_steplock/_lua.py) and those of the patterns' scripts and calls: GET,
#: ZCARD, ZRANGEBYSCORE, ZRANK (bulkhead slots), ZCARD, ZRANGE, ZRANGEBYSCORE, ZRANK, ZSCORE
#: (rate limits), HDEL, HINCRBY, PERSIST, ZCARD, ZCOUNT, ZRANGE, ZSCORE (circuit breaker); the
#: idempotency records need nothing more (DEL and HGETALL of invalidate and get). A name's
#: history (issue 30): LPUSH and LTRIM in the lease scripts, LRANGE of its reader.
STEPLOCK_COMMANDS = (
    "blpop",
    "dbsize",
    "del",
    "evalsha",
    "exists",
    "get",
    "hdel",
    "hget",
    "hgetall",
    "hincrby",
    "hmget",
    "hset",
    "lpush",
    "lrange",
    "ltrim",
    "persist",
    "pexpire",
    "ping",
    "pttl",
    "rpush",
    "scan",
    "script|load",
    "set",
    "time",
    "type",
    "zadd",
    "zcard",
    "zcount",
    "zrange",
    "zrangebyscore",
    "zrank",
    "zrem",
    "zremrangebyscore",
    "zscore",
)


def acl_rules(
    prefix: str = "steplock",
    password: str = "steplock-secret",
    *,
    without: Iterable[str] = (),
    keys: Iterable[str] | None = None,
) -> list[str]:
    """The ``ACL SETUSER`` rules of the least-privilege user: on, ``password``, only the keys
    ``<prefix>:*`` (or the patterns ``keys``), no channel, no command but
    :data:`STEPLOCK_COMMANDS` less ``without``."""
    skipped = {c.lower() for c in without}
    patterns = list(keys) if keys is not None else [f"{prefix}:*"]
    return [
        "reset",
        "on",
        f">{password}",
        "resetkeys",
        *[f"~{p}" for p in patterns],
        "resetchannels",
        "-@all",
    ] + [f"+{c}" for c in STEPLOCK_COMMANDS if c not in skipped]


def acl_setuser_line(
    user: str = "steplock", prefix: str = "steplock", password: str = "<password>"
) -> str:
    """The ``ACL SETUSER`` command line the docs give (without ``reset``)."""
    return " ".join(["ACL SETUSER", user, *acl_rules(prefix, password)[1:]])


def _admin(server) -> redis.Redis:
    url = server if isinstance(server, str) else server.url
    return redis.Redis.from_url(url, socket_timeout=5)


def create_user(
    server,
    user: str = "steplock",
    password: str = "steplock-secret",
    prefix: str = "steplock",
    *,
    without: Iterable[str] = (),
    keys: Iterable[str] | None = None,
) -> str:
    """Create (or redefine) the ACL user ``user`` on ``server`` with :func:`acl_rules` and
    return the server's URL with that user's credentials."""
    admin = _admin(server)
    try:
        admin.execute_command(
            "ACL", "SETUSER", user, *acl_rules(prefix, password, without=without, keys=keys)
        )
    finally:
        admin.close()
    url = server if isinstance(server, str) else server.url
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(
        (
            parts.scheme,
            f"{quote(user)}:{quote(password)}@{host}",
            parts.path,
            parts.query,
            parts.fragment,
        )
    )


def drop_user(server, user: str = "steplock") -> None:
    """Delete the ACL user ``user`` (its open connections are closed by Redis)."""
    admin = _admin(server)
    try:
        admin.execute_command("ACL", "DELUSER", user)
    finally:
        admin.close()
