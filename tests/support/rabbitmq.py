"""A throwaway rabbitmq-server on free loopback ports, for the tests that run Celery on AMQP.

``RabbitMQServer().start()`` runs Debian's rabbitmq-server (``/usr/lib/rabbitmq/bin``) as the
current user, with everything of its own in a temporary directory: the AMQP port, the
Erlang distribution port (RABBITMQ_DIST_PORT), an epmd of its own on a port of its own
(ERL_EPMD_PORT, so no shared epmd), a unique node name, the Mnesia and log directories, the
configuration file (``rabbitmq.conf``: ``consumer_timeout`` among others), an empty enabled
plugins file and HOME (the Erlang cookie). Nothing of the system's RabbitMQ (its service,
/etc/rabbitmq, /var/lib/rabbitmq) is read or touched.

The server and its epmd share one process group; :meth:`RabbitMQServer.stop` SIGTERMs the
server by PID, then SIGKILLs that group. Run it from the repository root:
``python -m tests.support.rabbitmq`` starts one, prints its URL and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.support.processes import (
    _death_signal_preexec,
    _signal_group,
    _stop_popen,
    _tail,
    _track,
    _untrack,
)
from tests.support.servers import free_port

__all__ = ["RabbitMQServer", "find_rabbitmq_server", "DEFAULT_CONSUMER_TIMEOUT"]

#: RabbitMQ's default ``consumer_timeout`` (3.8.15+), seconds: 30 minutes.
DEFAULT_CONSUMER_TIMEOUT = 1800.0

_DEBIAN_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")


def find_rabbitmq_server() -> str | None:
    """Path of the rabbitmq-server start script to run as any user, or None.

    STEPLOCK_RABBITMQ_SERVER when set, else Debian's ``/usr/lib/rabbitmq/bin/rabbitmq-server``
    (``/usr/sbin/rabbitmq-server`` is a wrapper that switches to the ``rabbitmq`` user and
    its /var/lib/rabbitmq), else ``rabbitmq-server`` on PATH.
    """
    chosen = os.environ.get("STEPLOCK_RABBITMQ_SERVER")
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    if os.access(_DEBIAN_SERVER, os.X_OK):
        return str(_DEBIAN_SERVER)
    found = shutil.which("rabbitmq-server")
    if found and not found.startswith("/usr/sbin/"):
        return found
    return None


def _find_epmd(server: str) -> str | None:
    return shutil.which("epmd") or (
        str(Path(server).parent / "epmd") if (Path(server).parent / "epmd").exists() else None
    )


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _preexec(pgid: int | None):
    """setpgid into ``pgid`` (a new group when None) plus the parent-death signal."""
    death = _death_signal_preexec(signal.SIGKILL)

    def preexec() -> None:
        os.setpgid(0, pgid or 0)
        if death is not None:
            death()

    return preexec


class RabbitMQServer:
    """A rabbitmq-server on 127.0.0.1, without plugins, in a temporary directory.

    Args:
        consumer_timeout: Seconds RabbitMQ lets a delivery stay unacknowledged before it
            closes the consumer's channel (``consumer_timeout`` of rabbitmq.conf), or None
            for the server's default (30 minutes).
        tick_interval: Seconds between the channel's checks of that timeout (the rabbit
            application's ``channel_tick_interval``; its default is 60 s), or None for the
            default.
        port: The AMQP port; a free one when None.
    """

    user = "guest"
    password = "guest"

    def __init__(
        self,
        consumer_timeout: float | None = None,
        tick_interval: float | None = None,
        port: int | None = None,
    ):
        self.port = port or free_port()
        self.dist_port = free_port()
        self.epmd_port = free_port()
        self.consumer_timeout = consumer_timeout
        self.tick_interval = tick_interval
        self.nodename = f"steplock-{uuid.uuid4().hex[:12]}@localhost"
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None
        self.epmd: subprocess.Popen | None = None
        #: Seconds the last start() took until the server accepted an AMQP connection.
        self.start_seconds: float | None = None

    def __repr__(self) -> str:
        return f"<RabbitMQServer {self.url} pid={self.pid}>"

    @staticmethod
    def available() -> bool:
        """True when a rabbitmq-server start script and epmd are installed."""
        server = find_rabbitmq_server()
        return server is not None and _find_epmd(server) is not None

    @property
    def url(self) -> str:
        return f"amqp://{self.user}:{self.password}@127.0.0.1:{self.port}//"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def pgid(self) -> int | None:
        """The process group of the server and its epmd (epmd's PID)."""
        return self.epmd.pid if self.epmd else None

    @property
    def logfile(self) -> Path | None:
        return self.workdir / "rabbitmq.out" if self.workdir else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _config(self) -> str:
        lines = [
            f"listeners.tcp.1 = 127.0.0.1:{self.port}",
            # What the readiness check recognises this node by (connection.start's properties).
            f"cluster_name = {self.nodename}",
            "loopback_users.guest = true",
            # A small CI disk must not raise the free-disk alarm (it blocks publishers).
            "disk_free_limit.absolute = 1MB",
            "log.console = false",
            "log.file.level = info",
        ]
        if self.consumer_timeout is not None:
            lines.append(f"consumer_timeout = {round(self.consumer_timeout * 1000)}")
        return "\n".join(lines) + "\n"

    def server_env(self) -> dict:
        """The environment the server (and its epmd) runs with: this server's node name,
        ports and files under its work directory, the caller's environment without
        ``RABBITMQ_*``/``ERL_*``."""
        work = self.workdir
        erl_args = ["-kernel", "inet_dist_use_interface", "{127,0,0,1}", "-noinput"]
        if self.tick_interval is not None:
            erl_args += ["-rabbit", "channel_tick_interval", str(round(self.tick_interval * 1000))]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            HOME=str(work),
            LC_ALL="C.UTF-8",
            ERL_EPMD_PORT=str(self.epmd_port),
            ERL_EPMD_ADDRESS="127.0.0.1",
            RABBITMQ_NODENAME=self.nodename,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(work / "mnesia"),
            RABBITMQ_LOG_BASE=str(work / "log"),
            RABBITMQ_CONFIG_FILE=str(work / "rabbitmq.conf"),
            RABBITMQ_ADVANCED_CONFIG_FILE=str(work / "advanced.config"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(work / "enabled_plugins"),
            RABBITMQ_CONF_ENV_FILE=str(work / "rabbitmq-env.conf"),
            RABBITMQ_PID_FILE=str(work / "rabbitmq.pid"),
            # Exec the VM in place of the start script (no shell proxy in between), so the
            # PID is the server's and the parent-death signal reaches it.
            RABBITMQ_ALLOW_INPUT="1",
            RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=" ".join(erl_args),
        )
        return env

    def start(self, timeout: float = 60.0) -> RabbitMQServer:
        """Start epmd and the server, and wait until an AMQP connection opens.

        Raises:
            RuntimeError: rabbitmq-server or epmd is missing, exited, or did not accept a
                connection within ``timeout`` seconds.
        """
        if self.alive():
            raise RuntimeError(f"{self!r} is already running")
        server = find_rabbitmq_server()
        epmd = _find_epmd(server) if server else None
        if server is None or epmd is None:
            raise RuntimeError(
                "rabbitmq-server not found: install Debian's rabbitmq-server "
                "(STEPLOCK_WANT_RABBITMQ=1 bash scripts/bootstrap.sh, as root)"
            )
        began = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix="steplock-rabbitmq-"))
        _track(self)
        work = self.workdir
        (work / "mnesia").mkdir()
        (work / "log").mkdir()
        (work / "rabbitmq.conf").write_text(self._config())
        (work / "advanced.config").write_text("[].\n")
        (work / "enabled_plugins").write_text("[].\n")
        (work / "rabbitmq-env.conf").write_text("")
        env = self.server_env()
        with open(self.logfile, "ab") as log:
            self.epmd = subprocess.Popen(
                [epmd, "-port", str(self.epmd_port), "-address", "127.0.0.1"],
                cwd=work,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_preexec(None),
            )
        try:
            self._wait(lambda: _port_open(self.epmd_port), self.epmd, "epmd", 10.0)
            with open(self.logfile, "ab") as log:
                self.proc = subprocess.Popen(
                    [server],
                    cwd=work,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_preexec(self.epmd.pid),
                )
            self._wait(self._amqp_ready, self.proc, "rabbitmq-server", timeout)
        except BaseException:
            self._kill()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def _amqp_ready(self) -> bool:
        import amqp

        if not _port_open(self.port):
            return False
        conn = amqp.Connection(
            f"127.0.0.1:{self.port}",
            userid=self.user,
            password=self.password,
            connect_timeout=1.0,
        )
        try:
            conn.connect()
        except Exception:  # noqa: BLE001 - not ready yet (booting: refused, reset, 541)
            conn.collect()
            return False
        try:
            # Check the node too: another server may have grabbed the port first.
            return conn.server_properties.get("cluster_name") == self.nodename
        finally:
            conn.close()

    def _wait(self, ready, proc: subprocess.Popen, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{what} exited with code {proc.returncode}; log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{what} was not ready on 127.0.0.1 within {timeout:g}s; log tail:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def rabbitmqctl(self, *args: str, timeout: float = 30.0) -> str:
        """Run ``rabbitmqctl -n <node> *args`` against this server (its cookie, its epmd);
        returns its output.

        Raises:
            RuntimeError: rabbitmqctl exited with an error.
        """
        ctl = Path(find_rabbitmq_server() or _DEBIAN_SERVER).parent / "rabbitmqctl"
        work = self.workdir
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))}
        env.update(
            HOME=str(work),
            LC_ALL="C.UTF-8",
            ERL_EPMD_PORT=str(self.epmd_port),
            RABBITMQ_CONF_ENV_FILE=str(work / "rabbitmq-env.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(work / "enabled_plugins"),
        )
        done = subprocess.run(
            [str(ctl), "-n", self.nodename, *args],
            env=env,
            cwd=work,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def configure(self, consumer_timeout: float | None, tick_interval: float | None) -> None:
        """Change ``consumer_timeout`` and the channels' ``channel_tick_interval`` (seconds;
        None: back to this server's start values, else RabbitMQ's 1800 s and 60 s) while it
        runs. Channels read both when they open: connections opened later see the change."""
        timeout = consumer_timeout or self.consumer_timeout or DEFAULT_CONSUMER_TIMEOUT
        tick = tick_interval or self.tick_interval or 60.0
        self.rabbitmqctl(
            "eval",
            f"ok = application:set_env(rabbit, consumer_timeout, {round(timeout * 1000)}), "
            f"ok = application:set_env(rabbit, channel_tick_interval, {round(tick * 1000)}).",
        )

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the start script's output and of the node's log."""
        if self.workdir is None:
            return "<no log>"
        node_log = self.workdir / "log" / f"{self.nodename}.log"
        return f"{_tail(self.logfile, lines)}\n--- {node_log.name}:\n{_tail(node_log, lines)}"

    def node_log(self) -> str:
        """The node's log file (``<nodename>.log``), '' when there is none yet."""
        if self.workdir is None:
            return ""
        try:
            return (self.workdir / "log" / f"{self.nodename}.log").read_text(errors="replace")
        except OSError:
            return ""

    def _kill(self) -> None:
        _stop_popen(self.proc, signal.SIGKILL, 5.0, group=False)
        _signal_group(self.pgid, signal.SIGKILL)
        if self.epmd is not None:
            self.epmd.wait(5.0)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server by PID (a clean shutdown; SIGKILL after ``timeout``), then
        SIGKILL its process group (epmd and any helper left), and remove its directory."""
        _stop_popen(self.proc, signal.SIGTERM, timeout, group=True)
        self._kill()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _untrack(self)

    def __enter__(self) -> RabbitMQServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumer-timeout", type=float, default=None, help="seconds")
    args = parser.parse_args(argv)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    server = RabbitMQServer(consumer_timeout=args.consumer_timeout)
    try:
        server.start()
        print(f"{server.url} (started in {server.start_seconds:.1f} s)", flush=True)
        while not stopping and server.alive():
            time.sleep(0.2)
        return 0 if stopping else 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())


# -- pytest fixtures (registered in tests/conftest.py's pytest_plugins) ------------------------


def _unavailable() -> None:
    """Skip (fail under CI=true) a test that needs rabbitmq-server when none is installed."""
    missing = "rabbitmq-server is not installed"
    install = "run `make test` as root, or STEPLOCK_WANT_RABBITMQ=1 bash scripts/bootstrap.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{missing}, and CI=true requires the RabbitMQ broker tests ({install})")
    pytest.skip(f"{missing}: the RabbitMQ broker tests are skipped ({install})")


@pytest.fixture(scope="session")
def rabbitmq_server():
    """A :class:`RabbitMQServer` of the session (default ``consumer_timeout``), started the
    first time a test asks for it; skipped (failed under CI=true) without rabbitmq-server."""
    if not RabbitMQServer.available():
        _unavailable()
    server = RabbitMQServer().start()
    print(f"\nrabbitmq-server started in {server.start_seconds:.1f} s at {server.url}")
    try:
        yield server
    finally:
        server.stop()


def purge_queue(url: str, queue: str = "celery", timeout: float = 30.0) -> None:
    """Empty ``queue`` once no consumer is left on it: the workers of an earlier test are
    gone and every message they held unacknowledged is back in the queue, then purged."""
    import amqp

    from tests.support.processes import wait_until

    conn = amqp.Connection(url.split("@", 1)[1].rstrip("/"), userid="guest", password="guest")
    conn.connect()
    try:
        channel = conn.channel()

        def idle():
            try:
                _, _, consumers = channel.queue_declare(queue, passive=True)
            except amqp.exceptions.NotFound:
                return True
            return consumers == 0

        wait_until(idle, timeout=timeout, what=f"no consumer on {queue}")
        try:
            channel.queue_purge(queue)
        except amqp.exceptions.NotFound:
            pass
    finally:
        conn.close()


def use_broker(app, url: str) -> str:
    """Point ``app``'s producers at ``url``, dropping its connection pools; returns the
    broker URL it had."""
    before = app.conf.broker_url
    # What Celery itself does after a fork: the pools are rebuilt from broker_url on next use
    # (kombu keeps one pool per connection URL, so the old broker's is reused when restored).
    app._pool = None
    app.amqp._producer_pool = None
    app.conf.broker_url = url
    return before
