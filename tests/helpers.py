"""Small helpers shared by the tests."""
import time

from scripts.servers import free_port


def wait_until(predicate, timeout=30.0, interval=0.05, what="condition", describe=None):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after
    ``timeout`` seconds with ``what`` and, when given, ``describe()`` of the state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    state = f" ({describe()})" if describe else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{state}")


def all_keys_have_ttl(client, pattern="*"):
    """``(keys, keys_without_ttl)`` for the keys matching ``pattern`` (SCAN, not KEYS)."""
    keys = sorted(client.scan_iter(match=pattern, count=1000))
    return keys, [k for k in keys if client.pttl(k) < 0]


def closed_port_url():
    """A redis:// URL on a loopback port nothing listens on."""
    return f"redis://127.0.0.1:{free_port()}/0"
