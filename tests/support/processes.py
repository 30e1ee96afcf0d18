"""Supervised processes for tests, benchmarks and demos: process groups, celery workers, polling.

Every process group started here is stopped by an atexit handler too (with the servers of
:mod:`tests.support.servers`, which register here). Processes started from the main thread
also get a parent-death signal, so they do not outlive a killed parent.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support import ROOT

__all__ = [
    "ROOT",
    "wait_until",
    "ProcessGroup",
    "WorkerProcess",
    "celery_worker",
    "stop_all",
]

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
    """Stop every server and process group started through ``tests.support``, newest first."""
    with _registry_lock:
        items = list(reversed(_registry))
    for item in items:
        try:
            item.stop()
        except Exception as exc:  # keep stopping the others
            print(f"tests.support: could not stop {item!r}: {exc}", file=sys.stderr)


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


def wait_until(
    predicate,
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "condition",
    describe=None,
):
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
        fields = data[data.rfind(")") + 2 :].split()
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


class ProcessGroup:
    """A command in its own session (so its own process group), stdout+stderr to a log file.

    `env` is merged over os.environ (PYTHONUNBUFFERED=1 is added so logs arrive promptly);
    `cwd` defaults to the repository root; `logfile` to a new file in a temporary directory
    that is removed when this Python process exits.
    """

    def __init__(
        self,
        argv,
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        logfile: str | os.PathLike | None = None,
    ):
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
                self.argv,
                env=env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_death_signal_preexec(signal.SIGTERM),
            )
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
                raise RuntimeError(
                    f"{self!r} exited with code {self.returncode} before its log "
                    f"matched {regex.pattern!r}; log tail:\n{_tail(self.logfile)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self!r}: log did not match {regex.pattern!r} within "
                    f"{timeout:g}s; log tail:\n{_tail(self.logfile)}"
                )
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
        return [
            pid for pid, _, pgrp, state in _proc_stats() if pgrp == self.proc.pid and state != "Z"
        ]

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

    def __init__(
        self,
        argv,
        name: str = "worker",
        ready_pattern: str = r"\bready\.",
        env: dict | None = None,
        cwd: str | os.PathLike | None = None,
        logfile: str | os.PathLike | None = None,
    ):
        super().__init__(argv, env=env, cwd=cwd, logfile=logfile)
        self.name = name
        self.ready_pattern = ready_pattern

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid}>"

    def start(self, timeout: float = 60.0, wait: bool = True) -> WorkerProcess:
        """Start and (unless ``wait`` is false) wait for the ready line; on failure stop it
        and re-raise."""
        super().start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60.0) -> WorkerProcess:
        """Wait for the ready line of the last start(); on failure stop it and re-raise."""
        try:
            self.wait_for_log(self.ready_pattern, timeout)
        except BaseException:
            self.kill()
            raise
        return self


def celery_worker(
    app: str = "django_app",
    name: str = "w1",
    concurrency: int = 2,
    pool: str = "prefork",
    env: dict | None = None,
    logfile: str | os.PathLike | None = None,
    extra_args=(),
    timeout: float = 60.0,
    cwd: str | os.PathLike | None = None,
    wait: bool = True,
) -> WorkerProcess:
    """Start `celery -A app worker` as `name@host` and return it once it logged "ready."
    (with ``wait=False`` at once: call its wait_ready() later, so that several workers start
    side by side)."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        app,
        "worker",
        "-l",
        "INFO",
        "-n",
        f"{name}@%h",
        "-c",
        str(concurrency),
        "-P",
        pool,
        "--without-mingle",
        "--without-gossip",
        "-O",
        "fair",
        *extra_args,
    ]
    if logfile is None:
        logfile = _default_logfile(f"celery-{name}-")
    worker = WorkerProcess(argv, name=name, env=env, cwd=cwd, logfile=logfile)
    return worker.start(timeout, wait=wait)


def uvicorn_command(app: str, port: int, *, factory: bool = False) -> list[str]:
    """The command of one uvicorn worker serving ``app`` (``module:attribute``; with
    ``factory``, a callable returning the application) on ``127.0.0.1:port``: the asyncio
    loop, h11, no lifespan, no access log (the tests' ASGI servers)."""
    import sys

    return [
        sys.executable,
        "-m",
        "uvicorn",
        *(["--factory"] if factory else []),
        app,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--loop",
        "asyncio",
        "--http",
        "h11",
        "--lifespan",
        "off",
        "--no-access-log",
    ]
