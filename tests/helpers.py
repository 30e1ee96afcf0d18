"""Small helpers shared by the tests."""
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
    return {key.rsplit(":", 1)[1]: int(client.get(key))
            for key in client.scan_iter(match="demo:stats:*")}


def drained(client):
    """No message queued, reserved or waiting for an ETA, and no lease held."""
    return (client.llen("celery") == 0 and client.hlen("unacked") == 0
            and not list(client.scan_iter(match="steplock:lease:*")))


def lease_key(step):
    """The Redis key of a workflow step's lease (default prefix)."""
    return f"steplock:lease:{{step:{step.pk}}}"
