"""A Redis kept busy for a while by a Lua loop: a call written meanwhile is read and run
once the loop ends, with its caller already gone (a cancellation lands while the script's
reply is in flight, deterministically, without pausing the server)."""

from __future__ import annotations

import threading
import time

from celery_steplock.lock import make_client

#: A Lua loop that keeps Redis busy ARGV[1] microseconds: it reads no other connection
#: meanwhile (under the 5 s busy-script threshold).
BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
"""


def keep_busy(url: str, seconds: float) -> threading.Thread:
    """Keep the Redis of ``url`` busy ``seconds`` (:data:`BUSY` from a thread), returning
    the thread once it is (a PING with a 50 ms timeout goes unanswered)."""
    import redis

    client = make_client(url, socket_timeout=seconds + 5)
    thread = threading.Thread(
        target=lambda: (client.eval(BUSY, 0, int(seconds * 1e6)), client.close())
    )
    thread.start()
    probe = make_client(url, socket_timeout=0.05)
    try:
        while True:
            try:
                probe.ping()
            except redis.TimeoutError:
                return thread
            time.sleep(0.005)
    finally:
        probe.close()
