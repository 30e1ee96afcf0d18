"""Shared fixtures: a real redis-server, the Django test database, real celery workers.

Servers and workers come from ``tests/support`` (servers.py, processes.py). ``make test``
(scripts/run_tests.py) starts a Redis for each pass and names it in
STEPLOCK_TEST_REDIS_URL; a bare ``pytest`` starts its own here. The suite never touches a
server it did not start unless a test-only variable names it: a REDIS_URL or DATABASE_URL of
the user's (the demo's) is refused before anything connects.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent

# Test support, not tests. Collected, its modules would also be imported a second time under
# another name (``support.servers``), with a registry of started servers of their own.
collect_ignore = ["support", "userproject"]  # userproject: a user's suite, run by test_testing

# pytest-celery 1.x shadows Celery's in-process fixtures with container-based ones; the
# project runs with ``-p no:celery`` and loads Celery's own fixtures explicitly. The Sentinel,
# Cluster and ACL servers are session fixtures of tests/support/topologies.py.
pytest_plugins = ("celery.contrib.pytest", "tests.support.topologies", "tests.support.rabbitmq")


def pytest_configure(config):
    """Refuse a REDIS_URL or DATABASE_URL that no test-only variable names.

    The example project's settings read both at import (pytest-django imported them before
    this file), and the fixtures flush that Redis and create and drop databases on that
    server: stop before anything connects, showing no password.
    """
    from celery_steplock.redact import redact

    foreign = servers.foreign_urls(os.environ)
    if foreign:
        raise pytest.UsageError(
            "; ".join(
                f"{name}={redact(url)} is set, and the tests never use a server they did not "
                f"start: unset it (the demo's), run `make test` (it ignores it), or name a "
                f"server the tests may wipe in {servers.TEST_URL_ENV[name]}"
                for name, url in foreign.items()
            )
        )


#: Markers of the tests whose database is incidental: they run once, on SQLite.
SINGLE_PASS = ("redis_shape", "no_database", "sqlite", "rabbitmq", "db_incidental")
#: ``make test`` splits the SQLite run in two passes (scripts/run_tests.py), named in
#: ``servers.TEST_SCOPE_ENV``: ``database`` runs the SQLite tests about the step database,
#: ``common`` the ones marked with one of ``SINGLE_PASS`` but ``sqlite``. Unset (a bare pytest,
#: a corner): both.


@pytest.hookimpl(trylast=True)  # after -k/-m, so the count is of what would have run
def pytest_collection_modifyitems(config, items):
    """Each test runs in one pass of ``make test`` or several; elsewhere it is deselected (not
    skipped). Tests marked ``postgresql`` run on PostgreSQL only, ``mysql`` on MariaDB/MySQL
    only, ``row_locks`` on both; ``redis_shape``, ``no_database``, ``sqlite``, ``rabbitmq`` and
    ``db_incidental`` on SQLite only (with ``STEPLOCK_TEST_SCOPE=common``, only those but
    ``sqlite``; with ``database``, all but those)."""
    from django.conf import settings

    engine = settings.DATABASES["default"]["ENGINE"]
    if "postgresql" in engine:
        other_pass = (*SINGLE_PASS, "mysql")
    elif "mysql" in engine:
        other_pass = (*SINGLE_PASS, "postgresql")
    else:
        other_pass = ("postgresql", "mysql", "row_locks")
    scope = os.environ.get(servers.TEST_SCOPE_ENV, "")
    common = tuple(name for name in SINGLE_PASS if name != "sqlite")

    def marked(item, names) -> bool:
        return any(item.get_closest_marker(name) for name in names)

    def elsewhere(item) -> bool:
        if marked(item, other_pass):
            return True
        if scope == "database":
            return marked(item, common)
        if scope == "common":
            return not marked(item, common)
        return False

    deselected = [item for item in items if elsewhere(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not elsewhere(item)]


@pytest.fixture(scope="session")
def redis_server_url():
    """URL of the session's redis-server: STEPLOCK_TEST_REDIS_URL when set (``make test``
    names its own there), else one started here. Either is REDIS_URL for the processes the
    tests start (workers read it)."""
    url = os.environ.get(servers.TEST_REDIS_URL_ENV)
    if url:
        os.environ["REDIS_URL"] = url
        yield url
        return
    server = servers.RedisServer().start()
    os.environ["REDIS_URL"] = server.url
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def celery_app_configured(redis_server_url):
    """The example project's Celery app pointed at the session's Redis."""
    from django_app.celery import app

    app.conf.broker_url = redis_server_url
    app.conf.steplock_redis_url = redis_server_url
    return app


@pytest.fixture
def app(celery_app_configured):
    """The Celery app, with every steplock setting restored to its value before the test."""
    from celery_steplock.conf import DEFAULTS, RENAMED, setting_name

    app = celery_app_configured
    # Named reads only: while Django settings are overridden (live_server), iterating
    # Celery's view of them lists keys it cannot get. Former names are still read.
    names = [setting_name(name) for name in (*DEFAULTS, *RENAMED)]
    saved = {name: app.conf.get(name) for name in names}
    yield app
    namespace = getattr(app, "namespace", None)
    for name in names:
        if namespace:  # what tests.helpers.set_settings wrote
            app.conf.changes.pop(f"{namespace}_{name.upper()}", None)
        app.conf[name] = saved[name]


@pytest.fixture
def redis_client(redis_server_url):
    """A client on a flushed database of the session's Redis."""
    from celery_steplock.lock import make_client

    client = make_client(redis_server_url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def lock(redis_client):
    from celery_steplock.lock import RedisLeaseStore

    return RedisLeaseStore(redis_client, prefix="t")


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of the test's own, for tests that stop, restart or pause it."""
    server = servers.RedisServer(workdir=tmp_path / "redis").start()
    yield server
    server.stop()


def database_url(settings_dict) -> str:
    """A DATABASE_URL for worker processes that points at the test database."""
    engine = settings_dict["ENGINE"]
    if engine.endswith("sqlite3"):
        return f"sqlite:///{settings_dict['NAME']}"
    if "postgresql" in engine:
        user = settings_dict.get("USER") or "postgres"
        password = f":{settings_dict['PASSWORD']}" if settings_dict.get("PASSWORD") else ""
        host = settings_dict.get("HOST") or "127.0.0.1"
        port = settings_dict.get("PORT") or 5432
        return f"postgresql://{user}{password}@{host}:{port}/{settings_dict['NAME']}"
    if engine.endswith("mysql"):
        user = settings_dict.get("USER") or "root"
        password = f":{settings_dict['PASSWORD']}" if settings_dict.get("PASSWORD") else ""
        host = settings_dict.get("HOST") or "127.0.0.1"
        port = settings_dict.get("PORT") or 3306
        return f"mysql://{user}{password}@{host}:{port}/{settings_dict['NAME']}"
    raise RuntimeError(f"no worker DATABASE_URL for engine {engine}")


@pytest.fixture
def worker_env(transactional_db, redis_client, celery_app_configured, tmp_path):
    """Environment for real worker processes: the test DB, the session's Redis (flushed),
    and a short lease TTL."""
    from django.db import connection

    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": database_url(connection.settings_dict),
            "REDIS_URL": celery_app_configured.conf.broker_url,
            "STEPLOCK_TTL": "2",
            "STEPLOCK_LOG_LEVEL": "DEBUG",
            "PYTHONUNBUFFERED": "1",
            "DJANGO_SETTINGS_MODULE": "django_app.settings",
            "PYTHONPATH": str(ROOT),
        }
    )
    return env


@pytest.fixture
def start_worker(worker_env, tmp_path):
    """Factory: ``start_worker(name, concurrency=2, **env)`` -> a running celery worker
    process (prefork), stopped at the end of the test."""
    started = []

    def start(name="w1", concurrency=2, pool="prefork", extra_args=(), wait=True, **env):
        worker = servers.celery_worker(
            app="django_app",
            name=name,
            concurrency=concurrency,
            pool=pool,
            env={**worker_env, **{k: str(v) for k, v in env.items()}},
            logfile=tmp_path / f"{name}.log",
            extra_args=tuple(extra_args),
            cwd=ROOT,
            wait=wait,
        )
        started.append(worker)
        return worker

    yield start
    # The test is over: SIGKILL rather than a warm shutdown (about 1.2 s a worker, in both
    # passes). What a worker leaves behind, the next test's fixtures flush (its Redis, its
    # database); a test about shutting down calls worker.terminate() itself.
    for worker in started:
        worker.kill()


@pytest.fixture
def start_workers(start_worker):
    """Factory: ``start_workers(dict(name="w1", ...), dict(name="w2", ...))`` -> the workers of
    those ``start_worker`` arguments, started side by side (a start is mostly the interpreter
    importing Celery and Django: on two cores two of them take the time of one)."""

    def start(*specs):
        workers = [start_worker(**spec, wait=False) for spec in specs]
        return [worker.wait_ready() for worker in workers]

    return start


@pytest.fixture
def events():
    """Every celery-steplock signal sent during the test, as ``(signal name, kwargs)``."""
    from celery_steplock import signals

    seen = []

    def receiver(sender=None, signal=None, **kw):
        seen.append((signal.name, kw))

    for sig in signals.ALL_SIGNALS:
        sig.connect(receiver, weak=False)
    yield seen
    for sig in signals.ALL_SIGNALS:
        sig.disconnect(receiver)
