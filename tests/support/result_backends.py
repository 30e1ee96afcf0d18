"""Celery's Redis result backend for a test and its workers (tests/test_outcomes*_workers.py)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import redis


def forget_backend(app) -> None:
    """Drop the app's cached backend (Celery keeps it once made), so that the next
    ``app.backend`` is made from ``result_backend``."""
    app._backend_cache = None
    vars(app._local).pop("backend", None)


@contextmanager
def redis_result_backend(app, redis_server_url: str) -> Iterator[tuple[redis.Redis, str]]:
    """``app``'s result backend set, for the block, to database 1 of the session's Redis
    (fixtures flush database 0), flushed before and after; yields ``(client on that
    database, its URL)`` (the URL for the workers' ``STEPLOCK_RESULT_BACKEND``)."""
    url = urlunsplit(urlsplit(redis_server_url)._replace(path="/1"))
    client = redis.Redis.from_url(url)
    client.flushdb()
    saved = app.conf.result_backend
    app.conf.result_backend = url
    forget_backend(app)
    try:
        yield client, url
    finally:
        app.conf.result_backend = saved
        forget_backend(app)
        client.flushdb()
        client.close()
