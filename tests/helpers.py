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
