"""Throwaway Redis and PostgreSQL servers and supervised process groups, for tests and demos.

Import it (``from servers import RedisServer``) or run it:
``python scripts/servers.py redis|postgres`` starts a server, prints its URL and runs until
Ctrl-C or SIGTERM.

Everything started here is stopped by an atexit handler too. Servers and processes started
from the main thread also get a parent-death signal, so they do not outlive a killed parent.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = [
    "ROOT",
    "free_port",
    "find_redis_server",
    "RedisServer",
    "PostgresServer",
    "ProcessGroup",
    "WorkerProcess",
    "celery_worker",
    "stop_all",
]

ROOT = Path(__file__).resolve().parent.parent
_VENV_REDIS = ROOT / ".venv" / "bin" / "redis-server"
_PR_SET_PDEATHSIG = 1

_registry: list = []
_registry_lock = threading.Lock()


def _track(obj) -> None:
    with _registry_lock:
        if obj not in _registry:
            _registry.append(obj)


def _untrack(obj) -> None:
    with _registry_lock:
        if obj in _registry:
            _registry.remove(obj)


def stop_all() -> None:
    """Stop every server and process group started by this module, newest first."""
    with _registry_lock:
        items = list(reversed(_registry))
    for item in items:
        try:
            item.stop()
        except Exception as exc:  # keep stopping the others
            print(f"servers: could not stop {item!r}: {exc}", file=sys.stderr)


_logdir: Path | None = None


def _default_logfile(prefix: str) -> Path:
    """A new log file in a directory of this process's own, removed at exit."""
    global _logdir
    with _registry_lock:
        if _logdir is None:
            _logdir = Path(tempfile.mkdtemp(prefix="steplock-logs-"))
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log", dir=_logdir)
    os.close(fd)
    return Path(path)


def _at_exit() -> None:
    stop_all()
    if _logdir is not None:
        shutil.rmtree(_logdir, ignore_errors=True)


def _forget_all() -> None:
    """In a forked child: what the parent started is the parent's to stop."""
    global _logdir, _registry_lock
    _registry_lock = threading.Lock()
    _registry.clear()
    _logdir = None


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_forget_all)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition",
               describe=None):
    """Poll ``predicate`` until it returns something truthy (returned), or raise TimeoutError
    after ``timeout`` seconds naming ``what`` and, when given, ``describe()`` of the state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    state = f" ({describe()})" if describe else ""
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}{state}")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _death_signal_preexec(sig: int):
    """A preexec_fn making the child receive `sig` when this process dies, or None.

    Linux delivers the parent-death signal when the *thread* that forked exits, so it is
    only armed for children started from the main thread.
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log: {exc}>"
    return "\n".join(text.splitlines()[-lines:]) or "<empty log>"


def _signal_pid(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int | None, sig: int) -> None:
    if pgid is None:
        return
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _proc_stats() -> list[tuple[int, int, int, str]]:
    """(pid, ppid, pgrp, state) of every process, read from /proc."""
    stats = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                data = fh.read().decode(errors="replace")
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = data[data.rfind(")") + 2:].split()
        stats.append((int(entry), int(fields[1]), int(fields[2]), fields[0]))
    return stats


def _stop_popen(proc: subprocess.Popen | None, sig: int, timeout: float, group: bool) -> None:
    """Send `sig` (plus SIGCONT, in case it is paused), wait `timeout`, then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    _signal_pid(proc.pid, sig)
    _signal_pid(proc.pid, signal.SIGCONT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        if group:
            _signal_group(proc.pid, signal.SIGKILL)
        _signal_pid(proc.pid, signal.SIGKILL)
        proc.wait()


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then .venv/bin/redis-server."""
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

    def __init__(self, port: int | None = None, workdir: str | os.PathLike | None = None,
                 args=()):
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
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--logfile", str(self.logfile),
            *self.args,
        ]
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_death_signal_preexec(signal.SIGKILL),
            )
        client = redis.Redis(host="127.0.0.1", port=self.port,
                             socket_connect_timeout=0.5, socket_timeout=1.0)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    log = _tail(self.logfile)
                    if "Address already in use" in log:
                        raise _PortTaken(f"port {self.port} is taken")
                    raise RuntimeError(
                        f"redis-server exited with code {self.proc.returncode}; log tail:\n{log}")
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
                        f"{timeout:g}s; log tail:\n{_tail(self.logfile)}")
                time.sleep(0.05)
        finally:
            client.close()

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

    candidates = [p for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")
                  if os.access(Path(p).parent / "postgres", os.X_OK)]
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
            raise RuntimeError("PostgreSQL not found (initdb/postgres on PATH or in "
                               "/usr/lib/postgresql/*/bin): install postgresql")
        run_as = self._run_as()
        # /tmp explicitly: `nobody` must be able to traverse every parent directory.
        self.workdir = Path(tempfile.mkdtemp(prefix="steplock-pg-",
                                             dir="/tmp" if run_as else None))
        _track(self)
        if run_as:
            os.chmod(self.workdir, 0o755)
            os.chown(self.workdir, run_as["user"], run_as["group"])
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(LC_ALL="C", LANG="C", HOME=str(self.workdir))
        data = self.workdir / "data"
        with open(self.logfile, "ab") as log:
            result = subprocess.run(
                [str(bindir / "initdb"), "-D", str(data), "--auth=trust", "-U", self.user,
                 "--encoding=UTF8", "--locale=C", "--no-sync"],
                cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, timeout=120, **run_as)
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed with code {result.returncode}; log tail:\n"
                               f"{_tail(self.logfile)}")
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
                argv, cwd=self.workdir, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_death_signal_preexec(signal.SIGKILL), **run_as)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                log = _tail(self.logfile)
                if "could not bind" in log or "Address already in use" in log:
                    raise _PortTaken(f"port {self.port} is taken")
                raise RuntimeError(
                    f"postgres exited with code {self.proc.returncode}; log tail:\n{log}")
            try:
                with psycopg.connect(host="127.0.0.1", port=self.port, user=self.user,
                                     dbname="postgres", connect_timeout=2) as conn:
                    # Check the data directory: another server may have grabbed the port first.
                    row = conn.execute("SHOW data_directory").fetchone()
                    if row and Path(row[0]) == data:
                        return
            except psycopg.Error:
                pass
            if time.monotonic() > deadline:
                _stop_popen(self.proc, signal.SIGKILL, 5, group=True)
                raise RuntimeError(f"postgres did not accept connections on port {self.port} "
                                   f"within {timeout:g}s; log tail:\n{_tail(self.logfile)}")
            time.sleep(0.1)

    def _create_database(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(host="127.0.0.1", port=self.port, user=self.user,
                             dbname="postgres", autocommit=True) as conn:
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


class ProcessGroup:
    """A command in its own session (so its own process group), stdout+stderr to a log file.

    `env` is merged over os.environ (PYTHONUNBUFFERED=1 is added so logs arrive promptly);
    `cwd` defaults to the repository root; `logfile` to a new file in a temporary directory
    that is removed when this Python process exits.
    """

    def __init__(self, argv, env: dict | None = None, cwd: str | os.PathLike | None = None,
                 logfile: str | os.PathLike | None = None):
        self.argv = [str(a) for a in argv]
        self.env = dict(env or {})
        self.cwd = Path(cwd) if cwd else ROOT
        self.logfile = Path(logfile) if logfile else _default_logfile("proc-")
        self.proc: subprocess.Popen | None = None
        self.log_offset = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self.pid} {self.argv[:4]!r}>"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def start(self) -> ProcessGroup:
        """Start the command; log output from earlier runs is kept but not matched again."""
        if self.alive():
            raise RuntimeError(f"{self!r} is already running")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.logfile.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = len(self.log_text())
        with open(self.logfile, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_death_signal_preexec(signal.SIGTERM))
        _track(self)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, pattern, timeout: float = 30.0, since: int | None = None) -> re.Match:
        """Poll the log until `pattern` (a regex) matches after offset `since`.

        `since` defaults to where the log stood at start(); match.end() is an absolute offset,
        usable as the next `since`. Raises TimeoutError, or RuntimeError when the process
        exits without having printed it; both carry the log tail.
        """
        regex = re.compile(pattern)
        pos = self.log_offset if since is None else since
        deadline = time.monotonic() + timeout
        while True:
            exited = not self.alive()
            match = regex.search(self.log_text(), pos)
            if match:
                return match
            if exited:
                raise RuntimeError(f"{self!r} exited with code {self.returncode} before its log "
                                   f"matched {regex.pattern!r}; log tail:\n{_tail(self.logfile)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self!r}: log did not match {regex.pattern!r} within "
                                   f"{timeout:g}s; log tail:\n{_tail(self.logfile)}")
            time.sleep(0.05)

    def signal(self, sig: int, group: bool = False) -> None:
        """Send `sig` to the main process, or to its whole process group."""
        if self.proc is None:
            return
        if group:
            _signal_group(self.proc.pid, sig)
        elif self.proc.poll() is None:
            _signal_pid(self.proc.pid, sig)

    def group_pids(self) -> list[int]:
        """Live (non-zombie) members of the process group."""
        if self.proc is None:
            return []
        return [pid for pid, _, pgrp, state in _proc_stats()
                if pgrp == self.proc.pid and state != "Z"]

    def children_pids(self, recursive: bool = False) -> list[int]:
        """PIDs of the main process's children (all descendants when `recursive`)."""
        if self.proc is None:
            return []
        by_parent: dict[int, list[int]] = {}
        for pid, ppid, _, state in _proc_stats():
            if state != "Z":
                by_parent.setdefault(ppid, []).append(pid)
        found, todo = [], [self.proc.pid]
        while todo:
            kids = by_parent.get(todo.pop(), [])
            found += kids
            if recursive:
                todo += kids
        return sorted(found)

    def terminate(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the process group, wait `timeout`, then SIGKILL it; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            _signal_group(self.proc.pid, signal.SIGCONT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._kill_leftovers()
        _untrack(self)
        return self.proc.returncode

    stop = terminate

    def kill(self) -> int | None:
        """SIGKILL the whole process group; returns the exit code."""
        if self.proc is None:
            return None
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._kill_leftovers()
        _untrack(self)
        return self.proc.returncode

    def _kill_leftovers(self) -> None:
        """SIGKILL group members that outlived the main process and wait briefly for them."""
        deadline = time.monotonic() + 5
        while self.group_pids() and time.monotonic() < deadline:
            _signal_group(self.proc.pid, signal.SIGKILL)
            time.sleep(0.02)

    def __enter__(self) -> ProcessGroup:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.terminate()


class WorkerProcess(ProcessGroup):
    """A ProcessGroup whose start() waits until the log matches `ready_pattern`."""

    def __init__(self, argv, name: str = "worker", ready_pattern: str = r"\bready\.",
                 env: dict | None = None, cwd: str | os.PathLike | None = None,
                 logfile: str | os.PathLike | None = None):
        super().__init__(argv, env=env, cwd=cwd, logfile=logfile)
        self.name = name
        self.ready_pattern = ready_pattern

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid}>"

    def start(self, timeout: float = 60.0) -> WorkerProcess:
        """Start and wait for the ready line; on failure stop it and re-raise."""
        super().start()
        try:
            self.wait_for_log(self.ready_pattern, timeout)
        except BaseException:
            self.kill()
            raise
        return self


def celery_worker(app: str = "django_app", name: str = "w1", concurrency: int = 2,
                  pool: str = "prefork", env: dict | None = None,
                  logfile: str | os.PathLike | None = None, extra_args=(),
                  timeout: float = 60.0, cwd: str | os.PathLike | None = None) -> WorkerProcess:
    """Start `celery -A app worker` as `name@host` and return it once it logged "ready."."""
    argv = [sys.executable, "-m", "celery", "-A", app, "worker", "-l", "INFO",
            "-n", f"{name}@%h", "-c", str(concurrency), "-P", pool,
            "--without-mingle", "--without-gossip", "-O", "fair", *extra_args]
    if logfile is None:
        logfile = _default_logfile(f"celery-{name}-")
    worker = WorkerProcess(argv, name=name, env=env, cwd=cwd, logfile=logfile)
    return worker.start(timeout)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["redis", "postgres"])
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)

    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server = RedisServer(args.port) if args.kind == "redis" else PostgresServer(args.port)
    try:
        server.start()
        print(server.url, flush=True)
        while not stopping:
            if not server.alive():
                print(f"servers: {args.kind} server exited unexpectedly; log tail:\n"
                      f"{_tail(server.logfile)}", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
