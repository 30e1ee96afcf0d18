"""Small helpers shared by the tests."""

import time

from tests.support.processes import wait_until  # noqa: F401 - shared with the tests
from tests.support.servers import free_port


def all_keys_have_ttl(client, pattern="*"):
    """``(keys, keys_without_ttl)`` for the keys matching ``pattern`` (SCAN, not KEYS)."""
    keys = sorted(client.scan_iter(match=pattern, count=1000))
    return keys, [k for k in keys if client.pttl(k) < 0]


def closed_port_url():
    """A redis:// URL on a loopback port nothing listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"


def set_settings(app, **values):
    """Set ``steplock_*`` settings on ``app.conf`` at run time so that they win over the Django
    settings module on every supported Celery: on a namespaced configuration Celery 5.5 and 5.6
    look the namespaced name (``CELERY_STEPLOCK_DEFAULT_TTL``) up in every layer before the
    plain one, so a plain ``app.conf.steplock_default_ttl = x`` loses to the Django setting
    there (Celery 5.7 reads the layers in order). The ``app`` fixture undoes both names."""
    updates = dict(values)
    namespace = getattr(app, "namespace", None)
    if namespace:
        updates.update({f"{namespace}_{name.upper()}": v for name, v in values.items()})
    app.conf.update(updates)


def stats(client):
    """The demo tasks' counters (``demo:stats:<name>``) as ``{name: int}``."""
    return {
        key.rsplit(":", 1)[1]: int(client.get(key))
        for key in client.scan_iter(match="demo:stats:*")
    }


def stats_settled(client, timeout=30.0):
    """:func:`stats` once every ``lock_acquired`` has its ``lock_released`` (or a
    ``lock_lost``/``lock_expired``): a worker's release after COMMIT is not waited for
    (``steplock_release_wait`` off), so its ``lock_released`` is sent when the reply is read,
    about 10 ms after the task ended. Returns the last counters read after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        counts = stats(client)
        ended = sum(counts.get(k, 0) for k in ("lock_released", "lock_lost", "lock_expired"))
        if counts.get("lock_acquired", 0) <= ended or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def drained(client):
    """No message queued, reserved or waiting for an ETA, and no lease held."""
    return (
        client.llen("celery") == 0
        and client.hlen("unacked") == 0
        and not list(client.scan_iter(match="steplock:lease:*"))
    )


def lease_key(step):
    """The Redis key of a workflow step's lease (default prefix)."""
    return f"steplock:lease:{{step:{step.pk}}}"


#: What the CLI and the reaper list for the key :func:`write_hostile_leases` makes unreadable.
UNREADABLE_NAME = "\ufffd\ufffd\\x1b[2J"


def write_hostile_leases(redis_client, lease_store, deep_name):
    """Write, as a raw Redis user could, a lease ``deep_name`` whose ``meta`` is 1200 ``[``
    and a lease whose key is not UTF-8; returns ``(raw client, that key)`` (close the client)."""
    import redis

    redis_client.hset(
        lease_store.key(deep_name), mapping={"owner": "b" * 32, "fence": "1", "meta": "[" * 1200}
    )
    redis_client.pexpire(lease_store.key(deep_name), 60_000)
    kwargs = redis_client.connection_pool.connection_kwargs
    raw = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))
    odd = lease_store.key("").encode()[:-1] + b"\xff\xfe\x1b[2J}"
    raw.hset(odd, mapping={"owner": "c" * 32, "fence": "1"})
    raw.pexpire(odd, 60_000)
    return raw, odd
