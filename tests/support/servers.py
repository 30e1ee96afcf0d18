"""Throwaway Redis, PostgreSQL and MariaDB servers on free loopback ports, for tests, benchmarks
and demos.

Import it (``from tests.support.servers import RedisServer``) or run it from the repository
root: ``python -m tests.support.servers redis|postgres|mariadb`` starts a server, prints its
URL and runs until Ctrl-C or SIGTERM.

Servers are stopped by their PID (never by name), and by an atexit handler too; started from
the main thread they also get a parent-death signal. The process helpers of
:mod:`tests.support.processes` (``celery_worker``, ``ProcessGroup``, ``wait_until``,
``stop_all``) are re-exported here, so one import serves a caller that starts servers and
workers.
"""

from __future__ import annotations

import argparse
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support import ROOT
from tests.support.processes import (
    ProcessGroup,
    WorkerProcess,
    _death_signal_preexec,
    _signal_pid,
    _stop_popen,
    _tail,
    _track,
    _untrack,
    celery_worker,
    stop_all,
    wait_until,
)

__all__ = [
    "ROOT",
    "free_port",
    "find_redis_server",
    "RedisServer",
    "PostgresServer",
    "MariaDBServer",
    "TEST_REDIS_URL_ENV",
    "TEST_DATABASE_URL_ENV",
    "TEST_URL_ENV",
    "foreign_urls",
    # re-exported from tests.support.processes
    "ProcessGroup",
    "WorkerProcess",
    "celery_worker",
    "stop_all",
    "wait_until",
]

_VENV_REDIS = ROOT / ".venv" / "bin" / "redis-server"

#: The test-only variables naming an existing server the tests may use (and flush, and create
#: and drop databases on). The README tells users to export REDIS_URL and DATABASE_URL for the
#: demo: the suite never reads those as the user's, it sets them for its own processes.
TEST_REDIS_URL_ENV = "STEPLOCK_TEST_REDIS_URL"
TEST_DATABASE_URL_ENV = "STEPLOCK_TEST_DATABASE_URL"
#: The example project's variable -> the test-only variable that may name its server.
TEST_URL_ENV = {"REDIS_URL": TEST_REDIS_URL_ENV, "DATABASE_URL": TEST_DATABASE_URL_ENV}
#: Which part of the SQLite tests a pass runs (tests/conftest.py): ``database`` the tests about
#: the step database, ``common`` those whose database is incidental; unset, both.
TEST_SCOPE_ENV = "STEPLOCK_TEST_SCOPE"


def foreign_urls(environ) -> dict[str, str]:
    """The example project's server URLs in ``environ`` that no test-only variable names.

    Args:
        environ: An environment (``os.environ``).

    Returns:
        ``{"REDIS_URL": url, ...}``: each of REDIS_URL and DATABASE_URL that is set and
        differs from its test-only variable (:data:`TEST_URL_ENV`), a user's server the
        suite must not touch.
    """
    return {
        name: environ[name]
        for name, test_name in TEST_URL_ENV.items()
        if environ.get(name) and environ.get(name) != environ.get(test_name)
    }


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def find_redis_server() -> str:
    """Path of a redis-server binary: STEPLOCK_REDIS_SERVER when set (e.g. a Redis 6.2 or a
    valkey-server binary), else PATH, then .venv/bin/redis-server."""
    chosen = os.environ.get("STEPLOCK_REDIS_SERVER")
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise RuntimeError(f"STEPLOCK_REDIS_SERVER={chosen!r} is not an executable file")
        return os.path.abspath(chosen)
    found = shutil.which("redis-server")
    if found:
        return found
    if os.access(_VENV_REDIS, os.X_OK):
        return str(_VENV_REDIS)
    raise RuntimeError(
        "redis-server not found on PATH nor at .venv/bin/redis-server: "
        "run `bash scripts/bootstrap.sh` (or `make venv`) to provide one"
    )


class _PortTaken(RuntimeError):
    pass


class RedisServer:
    """A redis-server on 127.0.0.1 without persistence, in a temporary directory."""

    def __init__(self, port: int | None = None, workdir: str | os.PathLike | None = None, args=()):
        self.port = port or free_port()
        self.args = [str(a) for a in args]  # extra redis-server options, e.g. ("--replicaof", ...)
        self._port_fixed = port is not None
        self._workdir_arg = Path(workdir) if workdir else None
        self.workdir: Path | None = self._workdir_arg
        self.proc: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"<RedisServer {self.url} pid={self.pid}>"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def logfile(self) -> Path | None:
        return self.workdir / "redis.log" if self.workdir else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.alive():
            raise RuntimeError(f"{self!r} is already running")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="steplock-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        _track(self)
        for attempt in range(5):
            try:
                self._spawn(timeout)
                break
            except _PortTaken:
                if self._port_fixed or attempt == 4:
                    raise
                self.port = free_port()
        # From now on restart() must come back on the same port.
        self._port_fixed = True
        return self

    def _spawn(self, timeout: float) -> None:
        import redis

        argv = [
            find_redis_server(),
            *self._leading_args(),
            *self._port_args(),
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
            "--logfile",
            str(self.logfile),
            *self.args,
        ]
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_death_signal_preexec(signal.SIGKILL),
            )
        client = self._probe_client()
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    log = _tail(self.logfile)
                    if "Address already in use" in log:
                        raise _PortTaken(f"port {self.port} is taken")
                    raise RuntimeError(
                        f"redis-server exited with code {self.proc.returncode}; log tail:\n{log}"
                    )
                try:
                    # Check the pid too: another server may have grabbed the port first.
                    if client.info("server").get("process_id") == self.proc.pid:
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    _stop_popen(self.proc, signal.SIGKILL, 5, group=False)
                    raise RuntimeError(
                        f"redis-server did not answer PING on port {self.port} within "
                        f"{timeout:g}s; log tail:\n{_tail(self.logfile)}"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    # Hooks of servers that listen otherwise (TLS) or need a config file first (Sentinel).
    def _leading_args(self) -> list[str]:
        return []

    def _port_args(self) -> list[str]:
        return ["--port", str(self.port)]

    def _probe_client(self):
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_connect_timeout=0.5, socket_timeout=1.0
        )

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the server (SIGKILL after `timeout`) and remove its temporary directory."""
        _stop_popen(self.proc, signal.SIGTERM, timeout, group=False)
        if self._workdir_arg is None and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _untrack(self)

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Stop the server (data is lost) and start it again on the same port."""
        _stop_popen(self.proc, signal.SIGTERM, 5.0, group=False)
        return self.start(timeout)

    def kill(self) -> None:
        """SIGKILL the server; start() or restart() brings it back on the same port."""
        _stop_popen(self.proc, signal.SIGKILL, 5.0, group=False)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing."""
        _signal_pid(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after pause()."""
        _signal_pid(self.pid, signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _pg_bindir() -> Path | None:
    """Directory holding initdb and postgres: PATH, else the newest /usr/lib/postgresql/*/bin."""
    initdb = shutil.which("initdb")
    if initdb and (Path(initdb).parent / "postgres").exists():
        return Path(initdb).parent

    def version(path: str) -> tuple:
        name = Path(path).parts[-3]
        return tuple(int(p) if p.isdigit() else 0 for p in name.split("."))

    candidates = [
        p
        for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")
        if os.access(Path(p).parent / "postgres", os.X_OK)
    ]
    if not candidates:
        return None
    return Path(max(candidates, key=version)).parent


class PostgresServer:
    """A PostgreSQL server on 127.0.0.1 in a temporary directory, trust auth, database `steplock`.

    PostgreSQL refuses to run as root, so as root it runs as the user `nobody`.
    """

    user = "postgres"

    def __init__(self, port: int | None = None, dbname: str = "steplock"):
        self.port = port or free_port()
        self._port_fixed = port is not None
        self.dbname = dbname
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"<PostgresServer {self.url} pid={self.pid}>"

    @staticmethod
    def available() -> bool:
        """True when initdb and postgres are installed (and, as root, the user nobody exists)."""
        if _pg_bindir() is None:
            return False
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("nobody")
            except KeyError:
                return False
        return True

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{self.dbname}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def logfile(self) -> Path | None:
        return self.workdir / "postgres.log" if self.workdir else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _run_as(self) -> dict:
        if os.geteuid() != 0:
            return {}
        nobody = pwd.getpwnam("nobody")
        return {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}

    def start(self, timeout: float = 30.0) -> PostgresServer:
        """initdb, start postgres, wait until it accepts connections, create the database."""
        if self.alive():
            raise RuntimeError(f"{self!r} is already running")
        bindir = _pg_bindir()
        if bindir is None:
            raise RuntimeError(
                "PostgreSQL not found (initdb/postgres on PATH or in "
                "/usr/lib/postgresql/*/bin): install postgresql"
            )
        run_as = self._run_as()
        # /tmp explicitly: `nobody` must be able to traverse every parent directory.
        self.workdir = Path(
            tempfile.mkdtemp(prefix="steplock-pg-", dir="/tmp" if run_as else None)
        )
        _track(self)
        if run_as:
            os.chmod(self.workdir, 0o755)
            os.chown(self.workdir, run_as["user"], run_as["group"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C", HOME=str(self.workdir))
        data = self.workdir / "data"
        with open(self.logfile, "ab") as log:
            result = subprocess.run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(data),
                    "--auth=trust",
                    "-U",
                    self.user,
                    "--encoding=UTF8",
                    "--locale=C",
                    "--no-sync",
                ],
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=120,
                **run_as,
            )
        if result.returncode != 0:
            raise RuntimeError(
                f"initdb failed with code {result.returncode}; log tail:\n{_tail(self.logfile)}"
            )
        for attempt in range(5):
            try:
                self._spawn(bindir, data, env, run_as, timeout)
                break
            except _PortTaken:
                if self._port_fixed or attempt == 4:
                    raise
                self.port = free_port()
        self._create_database()
        return self

    def _spawn(self, bindir: Path, data: Path, env: dict, run_as: dict, timeout: float) -> None:
        import psycopg

        settings = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.workdir),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
        argv = [str(bindir / "postgres"), "-D", str(data), "-p", str(self.port)]
        for name, value in settings.items():
            argv += ["-c", f"{name}={value}"]
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_death_signal_preexec(signal.SIGKILL),
                **run_as,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = _tail(self.logfile)
                if "could not bind" in log or "Address already in use" in log:
                    raise _PortTaken(f"port {self.port} is taken")
                raise RuntimeError(
                    f"postgres exited with code {self.proc.returncode}; log tail:\n{log}"
                )
            try:
                with psycopg.connect(
                    host="127.0.0.1",
                    port=self.port,
                    user=self.user,
                    dbname="postgres",
                    connect_timeout=2,
                ) as conn:
                    # Check the data directory: another server may have grabbed the port first.
                    row = conn.execute("SHOW data_directory").fetchone()
                    if row and Path(row[0]) == data:
                        return
            except psycopg.Error:
                pass
            if time.monotonic() > deadline:
                _stop_popen(self.proc, signal.SIGKILL, 5, group=True)
                raise RuntimeError(
                    f"postgres did not accept connections on port {self.port} "
                    f"within {timeout:g}s; log tail:\n{_tail(self.logfile)}"
                )
            time.sleep(0.1)

    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user=self.user, dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))

    def stop(self, timeout: float = 10.0) -> None:
        """Fast shutdown (SIGINT, SIGKILL to its group after `timeout`); remove its files."""
        _stop_popen(self.proc, signal.SIGINT, timeout, group=True)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _untrack(self)

    def __enter__(self) -> PostgresServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _mariadb_binaries() -> tuple[str, str] | None:
    """Paths of (mariadb-install-db, mariadbd): PATH, then /usr/sbin (Debian's mariadbd)."""
    install_db = shutil.which("mariadb-install-db")
    server = shutil.which("mariadbd") or (
        "/usr/sbin/mariadbd" if os.access("/usr/sbin/mariadbd", os.X_OK) else None
    )
    if install_db and server:
        return install_db, server
    return None


class MariaDBServer:
    """A MariaDB server on 127.0.0.1 in a temporary directory, user ``root`` without a password,
    database `steplock`.

    Never the system's service: ``--no-defaults`` (no /etc/mysql/*.cnf), a data directory and
    socket of its own, a free port (never 3306). Tuned for tests, not durability: the redo log
    is flushed once a second, no binary log, a small buffer pool.
    """

    user = "root"

    def __init__(self, port: int | None = None, dbname: str = "steplock"):
        self.port = port or free_port()
        self._port_fixed = port is not None
        self.dbname = dbname
        self.workdir: Path | None = None
        self.proc: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"<MariaDBServer {self.url} pid={self.pid}>"

    @staticmethod
    def available() -> bool:
        """True when mariadb-install-db and mariadbd are installed and MySQLdb (mysqlclient,
        requirements/mysql.txt) imports."""
        if _mariadb_binaries() is None:
            return False
        try:
            import MySQLdb  # noqa: F401
        except ImportError:
            return False
        return True

    @property
    def url(self) -> str:
        return f"mysql://{self.user}@127.0.0.1:{self.port}/{self.dbname}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def logfile(self) -> Path | None:
        return self.workdir / "mariadb.log" if self.workdir else None

    @property
    def socket(self) -> Path | None:
        return self.workdir / "mariadb.sock" if self.workdir else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _user_args(self) -> list[str]:
        # mariadbd refuses to run as root unless told to; it never switches user here.
        return ["--user=root"] if os.geteuid() == 0 else []

    def start(self, timeout: float = 60.0) -> MariaDBServer:
        """mariadb-install-db, start mariadbd, wait until it accepts connections, create the
        database.

        Raises:
            RuntimeError: MariaDB is not installed, or did not start within ``timeout``
                seconds (the log's tail is in the message).
        """
        if self.alive():
            raise RuntimeError(f"{self!r} is already running")
        binaries = _mariadb_binaries()
        if binaries is None:
            raise RuntimeError(
                "MariaDB not found (mariadb-install-db and mariadbd): install mariadb-server"
            )
        install_db, server = binaries
        self.workdir = Path(tempfile.mkdtemp(prefix="steplock-mariadb-"))
        _track(self)
        env = {k: v for k, v in os.environ.items() if not k.startswith("MYSQL")}
        env.update(LC_ALL="C", LANG="C", HOME=str(self.workdir))
        data = self.workdir / "data"
        with open(self.logfile, "ab") as log:
            result = subprocess.run(
                [
                    install_db,
                    "--no-defaults",
                    f"--datadir={data}",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    *self._user_args(),
                ],
                cwd=self.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=120,
            )
        if result.returncode != 0:
            raise RuntimeError(
                f"mariadb-install-db failed with code {result.returncode}; "
                f"log tail:\n{_tail(self.logfile)}"
            )
        for attempt in range(5):
            try:
                self._spawn(server, data, env, timeout)
                break
            except _PortTaken:
                if self._port_fixed or attempt == 4:
                    raise
                self.port = free_port()
        self._create_database()
        return self

    def _connect(self, **kwargs):
        import MySQLdb

        return MySQLdb.connect(
            host="127.0.0.1", port=self.port, user=self.user, connect_timeout=2, **kwargs
        )

    def _spawn(self, server: str, data: Path, env: dict, timeout: float) -> None:
        import MySQLdb

        argv = [
            server,
            "--no-defaults",
            f"--datadir={data}",
            f"--socket={self.socket}",
            f"--pid-file={self.workdir / 'mariadb.pid'}",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            "--skip-networking=0",
            *self._user_args(),
            "--skip-log-bin",
            "--innodb-flush-log-at-trx-commit=2",
            "--innodb-doublewrite=0",
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-file-size=32M",
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_unicode_ci",
            "--max-connections=300",
            "--skip-name-resolve",
            f"--log-error={self.logfile}",
        ]
        self.proc = subprocess.Popen(
            argv,
            cwd=self.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_death_signal_preexec(signal.SIGKILL),
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = _tail(self.logfile)
                if "Address already in use" in log or "Can't start server: Bind" in log:
                    raise _PortTaken(f"port {self.port} is taken")
                raise RuntimeError(
                    f"mariadbd exited with code {self.proc.returncode}; log tail:\n{log}"
                )
            try:
                conn = self._connect()
                try:
                    cursor = conn.cursor()
                    cursor.execute("SELECT @@datadir")
                    row = cursor.fetchone()
                finally:
                    conn.close()
                # Check the data directory: another server may have grabbed the port first.
                if row and Path(row[0]) == data:
                    return
            except MySQLdb.Error:
                pass
            if time.monotonic() > deadline:
                _stop_popen(self.proc, signal.SIGKILL, 5, group=True)
                raise RuntimeError(
                    f"mariadbd did not accept connections on port {self.port} "
                    f"within {timeout:g}s; log tail:\n{_tail(self.logfile)}"
                )
            time.sleep(0.1)

    def _create_database(self) -> None:
        conn = self._connect()
        try:
            conn.cursor().execute(
                f"CREATE DATABASE `{self.dbname}` CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
            )
        finally:
            conn.close()

    def stop(self, timeout: float = 20.0) -> None:
        """Shut down (SIGTERM, SIGKILL to its group after `timeout` seconds); remove its files."""
        _stop_popen(self.proc, signal.SIGTERM, timeout, group=True)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _untrack(self)

    def __enter__(self) -> MariaDBServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["redis", "postgres", "mariadb"])
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)

    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    kinds = {"redis": RedisServer, "postgres": PostgresServer, "mariadb": MariaDBServer}
    server = kinds[args.kind](args.port)
    try:
        server.start()
        print(server.url, flush=True)
        while not stopping:
            if not server.alive():
                print(
                    f"servers: {args.kind} server exited unexpectedly; log tail:\n"
                    f"{_tail(server.logfile)}",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.2)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
