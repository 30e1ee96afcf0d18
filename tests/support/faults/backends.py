"""The fault labs' broker and step database choices: Redis or RabbitMQ as the Celery broker,
PostgreSQL or MariaDB as the database of steps (``scripts/nemesis.py --broker``,
``--database``).

A broker (:func:`make_broker`) is started by :meth:`Lab.start <tests.support.faults.lab.Lab>`
beside the control Redis, which keeps the run's history (``faults:history``) whichever broker
carries the tasks:

* :class:`RedisBroker` (``"redis"``, the default): the control Redis is the broker too, as
  before.
* :class:`RabbitBroker` (``"rabbitmq"``): a throwaway rabbitmq-server
  (:class:`RestartableRabbitMQ`) that the workers reach through a
  :class:`~tests.support.faults.proxy.TcpProxy` (``proxy``) and the controller's publisher
  directly. Its faults: ``broker_restart`` (the server process stopped cleanly, down for a
  while, started again on the same node, ports and data: durable queues and persistent
  messages survive, every connection is lost) and ``broker_channel_close`` (every worker's
  AMQP connection, with its channels, reset at the proxy; the broker requeues what they held
  unacknowledged at once, while their tasks may still run).

A database (:func:`database_of`) is chosen by the engine of Django's settings: PostgreSQL or
MariaDB (``mysql://``; :func:`start_database` starts a throwaway
:class:`~tests.support.servers.MariaDBServer`). The ``pg_*`` kinds keep their names on
MariaDB: latency, black hole and drop act on the proxy (``pg_proxy``) whatever the protocol;
``lost_commit_reply`` matches the COMMIT on the wire (:attr:`Database.commit_match`);
``pg_terminate`` ends a worker's session with ``KILL CONNECTION`` (workers log in as their
own user, :data:`MYSQL_WORKER_USER`, so the processlist tells their sessions from the
controller's).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import quote

from tests.support import rabbitmq
from tests.support.faults.proxy import TcpProxy
from tests.support.processes import _stop_popen

BROKERS = ("redis", "rabbitmq")
DATABASES = ("postgresql", "mysql")
#: The RabbitMQ broker's fault kinds and their weights (``kinds_of(broker="rabbitmq")``).
BROKER_KINDS = {"broker_restart": 1, "broker_channel_close": 2}
#: The MariaDB user the workers log in as (no password, every privilege): ``pg_terminate``
#: picks among its sessions in the processlist, never the controller's (root's).
MYSQL_WORKER_USER = "steplock_worker"
QUEUE = "celery"


# -- brokers ------------------------------------------------------------------------------------


class RedisBroker:
    """The control Redis as the broker (the fault suite's default)."""

    name = "redis"
    kinds: dict = {}

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.control = None

    def start(self, control) -> RedisBroker:
        """``control``: the lab's control :class:`~tests.support.servers.RedisServer`."""
        self.control = control
        return self

    def stop(self) -> None:
        pass

    @property
    def worker_url(self) -> str:
        return self.control.url

    @property
    def publisher_url(self) -> str:
        return self.control.url

    def idle(self, r) -> bool:
        """No message queued, none delivered and unacknowledged (``r``: the control client)."""
        return r.llen(QUEUE) == 0 and r.hlen("unacked") == 0

    def describe(self, r) -> str:
        return f"queue {r.llen(QUEUE)}, unacked {r.hlen('unacked')}"

    def heal(self) -> None:
        pass


class RestartableRabbitMQ(rabbitmq.RabbitMQServer):
    """A :class:`~tests.support.rabbitmq.RabbitMQServer` whose server process can be
    restarted in place (:meth:`restart`): same node name, ports, Mnesia directory and epmd."""

    def restart(self, down: float = 0.0, timeout: float = 90.0) -> float:
        """SIGTERM the server (a clean shutdown: durable queues and persistent messages are
        kept; SIGKILL after 30 s), wait ``down`` seconds, start it again and wait until it
        takes AMQP connections; returns the seconds it took. epmd stays up throughout."""
        began = time.monotonic()
        _stop_popen(self.proc, signal.SIGTERM, 30.0, group=False)
        time.sleep(down)
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                [rabbitmq.find_rabbitmq_server()],
                cwd=self.workdir,
                env=self.server_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=rabbitmq._preexec(self.epmd.pid),
            )
        self._wait(self._amqp_ready, self.proc, "rabbitmq-server (restart)", timeout)
        return time.monotonic() - began


class RabbitBroker:
    """RabbitMQ as the broker: the workers through ``proxy``, the publisher directly; see the
    module docstring. :meth:`idle` asks ``rabbitmqctl list_queues`` (ready plus unacknowledged
    messages; about 0.5 s a call), so an unacknowledged redelivery in flight is not idle."""

    name = "rabbitmq"
    kinds = BROKER_KINDS

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.server = None
        self.proxy: TcpProxy | None = None
        self.restarting: threading.Thread | None = None
        self.restart_result: dict = {}

    def start(self, control=None) -> RabbitBroker:
        self.server = RestartableRabbitMQ().start()
        self.proxy = TcpProxy("127.0.0.1", self.server.port).start()
        return self

    def stop(self) -> None:
        if self.restarting is not None:
            self.restarting.join(120)
        for thing in (self.proxy, self.server):
            if thing is not None:
                thing.stop()

    @property
    def worker_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.proxy.port}//"

    @property
    def publisher_url(self) -> str:
        return self.server.url

    def messages(self) -> int | None:
        """Messages in the queue, ready plus unacknowledged; None while the broker does not
        answer (restarting) and 0 before the queue exists."""
        try:
            out = self.server.rabbitmqctl("list_queues", "-q", "name", "messages", timeout=20)
        except (RuntimeError, subprocess.TimeoutExpired):
            return None
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == QUEUE:
                return int(parts[1])
        return 0

    def idle(self, r=None) -> bool:
        if self.restarting is not None and self.restarting.is_alive():
            return False
        return self.messages() == 0

    def describe(self, r=None) -> str:
        return f"rabbitmq messages {self.messages()}"

    # -- faults ---------------------------------------------------------------------------------

    def close_channels(self) -> int:
        """Reset every worker's AMQP connection (and so its channels) at the proxy; returns
        how many. The workers reconnect; their unacknowledged deliveries are requeued."""
        return self.proxy.drop_connections()

    def begin_restart(self, down: float) -> bool:
        """Restart the server in a thread (down ``down`` seconds between stop and start);
        False while an earlier restart is under way."""
        if self.restarting is not None and self.restarting.is_alive():
            return False
        self.restart_result = {}

        def run():
            try:
                self.restart_result["restart_s"] = round(self.server.restart(down), 3)
            except Exception as exc:  # noqa: BLE001 - reported by finish_restart
                self.restart_result["error"] = f"{type(exc).__name__}: {exc}"

        self.restarting = threading.Thread(target=run, name="broker-restart", daemon=True)
        self.restarting.start()
        return True

    def finish_restart(self, timeout: float = 120.0) -> dict:
        """Wait for the restart to end; returns ``{"restart_s"}``. Raises RuntimeError when
        it failed (the server is started afresh on its data first, if it is down)."""
        if self.restarting is not None:
            self.restarting.join(timeout)
        result = dict(self.restart_result)
        if "error" in result or not self.server.alive():
            if not self.server.alive():
                self.server.restart(0.0)
            raise RuntimeError(f"broker_restart: {result.get('error', 'server down')}")
        return result

    def heal(self) -> None:
        """Whatever happened, a running server at the end (the run's settle needs it)."""
        if self.restarting is not None:
            self.restarting.join(120)
        if not self.server.alive():
            self.server.restart(0.0)


def inject_broker(lab, fault: dict) -> dict | None:
    """Apply the broker fault ``fault`` (a planned fault of :data:`BROKER_KINDS`) in ``lab``
    (a :class:`~tests.support.faults.nemesis.NemesisLab` on RabbitMQ); returns its history
    entry, or None when it has no target now (no worker connected, a restart under way).

    ``broker_restart`` is a lasting fault: the server is down ``seconds`` (the plan's, 0.5 to
    3 TTLs) between its stop and its start, in a thread; its heal waits for the start to end
    (planned at the down time plus the server's first start time, 2 s more)."""
    broker, kind = lab.broker, fault["kind"]
    if broker.name != "rabbitmq":
        raise ValueError(f"{kind} needs the rabbitmq broker, not {broker.name}")
    if kind == "broker_channel_close":
        dropped = broker.close_channels()
        if not dropped:
            return None
        return lab.note("fault", kind=kind, dropped=dropped, via="proxy")
    if kind == "broker_restart":
        down = fault["seconds"]
        if not broker.begin_restart(down):
            return None
        lasts = down + (broker.server.start_seconds or 10.0) + 2.0
        return lab._last(
            kind, kind, lasts, broker.finish_restart, down=down, port=broker.server.port
        )
    raise ValueError(f"unknown broker fault kind {kind!r}")


def make_broker(name: str, workdir: Path):
    """The broker ``name`` (one of :data:`BROKERS`), not started. Raises ValueError."""
    if name == "redis":
        return RedisBroker(workdir)
    if name == "rabbitmq":
        return RabbitBroker(workdir)
    raise ValueError(f"broker must be one of {BROKERS}, got {name!r}")


# -- databases ----------------------------------------------------------------------------------


def engine_of(settings_dict: dict) -> str:
    """``"postgresql"`` or ``"mysql"`` from Django's ``settings_dict``; RuntimeError else."""
    engine = settings_dict["ENGINE"]
    if "postgresql" in engine:
        return "postgresql"
    if "mysql" in engine:
        return "mysql"
    raise RuntimeError(
        "the fault suite runs on PostgreSQL or MariaDB (DATABASE_URL=postgresql://... or "
        f"mysql://...); this database is {engine}"
    )


def database_url(settings_dict, host=None, port=None, user=None) -> str:
    """A ``postgresql://`` or ``mysql://`` URL for Django's ``settings_dict`` (optionally at
    another host, port, or as another user without a password)."""
    engine = engine_of(settings_dict)
    default_user, default_port = ("postgres", 5432) if engine == "postgresql" else ("root", 3306)
    if user is None:
        user = settings_dict.get("USER") or default_user
        password = settings_dict.get("PASSWORD")
    else:
        password = None
    secret = f":{quote(password, safe='')}" if password else ""
    host = host or settings_dict.get("HOST") or "127.0.0.1"
    port = port or settings_dict.get("PORT") or default_port
    return f"{engine}://{user}{secret}@{host}:{port}/{settings_dict['NAME']}"


class Database:
    """The step database's fault-relevant differences (see the module docstring)."""

    def __init__(self, settings_dict: dict):
        self.settings = dict(settings_dict)
        self.engine = engine_of(self.settings)

    @property
    def commit_match(self) -> bytes:
        """Bytes of the client's COMMIT on the wire: PostgreSQL's simple query; MariaDB
        Connector/C's ``mysql_commit``, a COM_QUERY (0x03) ``COMMIT``."""
        return b"COMMIT" if self.engine == "postgresql" else b"\x03COMMIT"

    def prepare(self) -> None:
        """On MariaDB, the workers' user (:data:`MYSQL_WORKER_USER`)."""
        if self.engine != "mysql":
            return
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute(f"CREATE USER IF NOT EXISTS '{MYSQL_WORKER_USER}'@'%'")
            cursor.execute(f"GRANT ALL PRIVILEGES ON *.* TO '{MYSQL_WORKER_USER}'@'%'")

    def worker_url(self, port: int, app_name: str) -> str:
        """The workers' DATABASE_URL through the proxy on ``port``: tagged with
        ``application_name=app_name`` on PostgreSQL, as :data:`MYSQL_WORKER_USER` on
        MariaDB (mysqlclient takes no application name)."""
        if self.engine == "postgresql":
            url = database_url(self.settings, "127.0.0.1", port)
            return f"{url}?application_name={app_name}"
        return database_url(self.settings, "127.0.0.1", port, user=MYSQL_WORKER_USER)

    def worker_sessions(self, app_name: str) -> list[int]:
        """The workers' open sessions (:meth:`worker_url`): backend pids (PostgreSQL) or
        processlist ids (MariaDB), ascending."""
        from django.db import connection

        with connection.cursor() as cursor:
            if self.engine == "postgresql":
                cursor.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = %s ORDER BY pid",
                    [app_name],
                )
            else:
                cursor.execute(
                    "SELECT ID FROM information_schema.PROCESSLIST WHERE USER = %s "
                    "AND DB = DATABASE() ORDER BY ID",
                    [MYSQL_WORKER_USER],
                )
            return [int(row[0]) for row in cursor.fetchall()]

    def terminate(self, session: int) -> bool:
        """End the session ``session``: ``pg_terminate_backend`` or ``KILL CONNECTION``;
        True when it was ended (False: it was gone already)."""
        from django.db import DatabaseError, connection

        with connection.cursor() as cursor:
            if self.engine == "postgresql":
                cursor.execute("SELECT pg_terminate_backend(%s)", [session])
                return bool(cursor.fetchone()[0])
            try:
                cursor.execute(f"KILL CONNECTION {int(session)}")
            except DatabaseError:  # 1094 Unknown thread id: it closed meanwhile
                return False
            return True


def start_database(database: str, say=print):
    """For the controller: a throwaway server of ``database`` (one of :data:`DATABASES`)
    unless ``DATABASE_URL`` names one of that kind; sets ``DATABASE_URL``; returns the
    started server (stop it by its ``stop()``) or None."""
    if database not in DATABASES:
        raise ValueError(f"database must be one of {DATABASES}, got {database!r}")
    from tests.support import servers

    url = os.environ.get("DATABASE_URL", "")
    scheme = "postgres" if database == "postgresql" else "mysql"
    if url.startswith(scheme):
        return None
    if url:
        say(f"DATABASE_URL is not {database}: a {database} server of the run's own instead")
    server = servers.PostgresServer() if database == "postgresql" else servers.MariaDBServer()
    server.start()
    os.environ["DATABASE_URL"] = server.url
    say(f"started {database} {server.url} (pid {server.pid})")
    return server


__all__ = [
    "BROKERS",
    "DATABASES",
    "BROKER_KINDS",
    "MYSQL_WORKER_USER",
    "Database",
    "RabbitBroker",
    "RedisBroker",
    "RestartableRabbitMQ",
    "database_url",
    "engine_of",
    "inject_broker",
    "make_broker",
    "start_database",
]
