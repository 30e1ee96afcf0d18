"""Shared helpers of the benchmark groups: figures, statistics, context, the group CLI.

Every group module has ``run(quick: bool) -> dict`` and is started by ``run.py`` as
``python -m benchmarks.<group> --out FILE [--quick]`` in a process of its own (Django settings,
threads and peak memory of one group never leak into another). The dict it returns::

    {"group": "lock", "figures": [{"name", "unit", "value", ...labels}], "notes": [...],
     "context": {...}, "elapsed_s": ...}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import servers  # noqa: E402  (needs ROOT on sys.path)

#: The peers, by distribution name, and the module each one is imported as.
PEERS = {
    "redis": "redis",  # redis-py's Lock
    "python-redis-lock": "redis_lock",
    "pottery": "pottery",
    "celery-once": "celery_once",
    "celery-singleton": "celery_singleton",
}


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def peer_status() -> dict[str, dict[str, Any]]:
    """For each peer: its version, whether it imports, and why not."""
    status = {}
    for dist, module in PEERS.items():
        info: dict[str, Any] = {"version": version_of(dist), "module": module}
        try:
            __import__(module)
            info["ok"] = True
        except Exception as exc:  # noqa: BLE001 - reported, never hidden
            info["ok"] = False
            info["error"] = f"{type(exc).__name__}: {exc}"
        status[dist] = info
    return status


def peer_ok(dist: str) -> tuple[bool, str | None]:
    info = peer_status()[dist]
    return info["ok"], info.get("error")


# -- statistics ------------------------------------------------------------------------------


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``; NaN when empty."""
    data = sorted(values)
    if not data:
        return math.nan
    rank = max(1, math.ceil(q / 100.0 * len(data)))
    return data[min(rank, len(data)) - 1]


def median(values: Iterable[float]) -> float:
    data = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(data) if data else math.nan


def rep_figures(
    rep_rounds: list[dict[str, float]], samples: list[float], busy_ns: float, variant: str
) -> dict[str, float]:
    """One repetition's figures of ``variant``: ``p50``, the median of its blocks' medians
    (µs; a burst of load that slows some blocks moves it less than it moves the median of
    all samples), ``p99`` of every sample (``samples`` in ns, given in µs) and ``rate``
    (cycles per busy second, ``busy_ns`` the time spent in its blocks)."""
    return {
        "p50": median(r[variant] for r in rep_rounds),
        "p99": percentile(samples, 99) / 1000.0,
        "rate": len(samples) / (busy_ns / 1e9),
    }


def spread(values: Iterable[float]) -> tuple[float, float]:
    data = [v for v in values if v is not None and not math.isnan(v)]
    return (min(data), max(data)) if data else (math.nan, math.nan)


# -- figures ---------------------------------------------------------------------------------


class Recorder:
    """Collects the figures and notes of one group."""

    def __init__(self, group: str):
        self.group = group
        self.figures: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.started = time.monotonic()
        self.load_start = os.getloadavg()

    def add(self, name: str, value: Any, unit: str, **labels: Any) -> Any:
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            value = None
        self.figures.append({"name": name, "unit": unit, "value": value, **labels})
        return value

    def note(self, text: str) -> None:
        print(f"[{self.group}] note: {text}", flush=True)
        self.notes.append(text)

    def say(self, text: str) -> None:
        print(f"[{self.group}] {text}", flush=True)

    def result(self, **extra: Any) -> dict[str, Any]:
        return {
            "group": self.group,
            "figures": self.figures,
            "notes": self.notes,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "loadavg_start": self.load_start,
            "loadavg_end": os.getloadavg(),
            "peak_rss_mb": peak_rss_mb(),
            **extra,
        }


def peak_rss_mb() -> float:
    """Peak resident set size of this process, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


# -- context ---------------------------------------------------------------------------------


def redis_version(url: str) -> str | None:
    import redis

    try:
        with redis.Redis.from_url(url) as client:
            return client.info("server").get("redis_version")
    except Exception:  # noqa: BLE001
        return None


def machine_context() -> dict[str, Any]:
    """The run's context: machine, interpreter, libraries, load."""
    try:
        uptime = subprocess.run(
            ["uptime"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uptime = None
    try:
        redis_server = subprocess.run(
            [servers.find_redis_server(), "--version"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        redis_server = None

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty_library": git("status", "--short", "--", "celery_steplock"),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "redis_server": redis_server,
        "libraries": {
            name: version_of(name)
            for name in (
                "celery-steplock",
                "celery",
                "kombu",
                "redis",
                "Django",
                "psycopg",
                "billiard",
                "python-redis-lock",
                "pottery",
                "celery-once",
                "celery-singleton",
                "pyinstrument",
            )
        },
        "loadavg": os.getloadavg(),
        "uptime": uptime,
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def installed_variants(
    rec: "Recorder", labels: dict[str, str], peer_of: dict[str, str]
) -> list[str]:
    """The variants of ``labels`` whose peer library (``peer_of``) is installed; a note on
    ``rec`` for each one left out."""
    peers = peer_status()
    kept = []
    for variant, label in labels.items():
        dist = peer_of.get(variant)
        if dist and not peers[dist]["ok"]:
            rec.note(f"{label} skipped: {peers[dist].get('error')}")
            continue
        kept.append(variant)
    return kept


def join_or_kill(procs, timeout: float) -> int:
    """Join every process within ``timeout`` seconds each, SIGKILL the ones still alive;
    returns how many had to be killed."""
    for p in procs:
        p.join(timeout=timeout)
    stuck = 0
    for p in procs:
        if p.is_alive():
            stuck += 1
            p.kill()
            p.join(5)
    return stuck


# -- the group CLI ---------------------------------------------------------------------------


def group_main(group: str, run: Callable[..., dict[str, Any]]) -> int:
    """``python -m benchmarks.<group> --out FILE [--quick]``: run the group, write its JSON."""
    parser = argparse.ArgumentParser(description=f"celery-steplock benchmark group {group}")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", help="write the result JSON here (default: stdout)")
    args = parser.parse_args()
    return write_result(group, lambda: run(quick=args.quick), args.out)


def write_result(group: str, run: Callable[[], dict[str, Any]], out: str | None) -> int:
    """Run ``run()``, stop every server it started, and write its JSON result to ``out``
    (stdout when None); a failure is written as a result with ``error``. Returns 0 or 1."""
    try:
        result = run()
        code = 0
    except Exception as exc:  # noqa: BLE001 - the runner reports the failure
        traceback.print_exc()
        result = {
            "group": group,
            "figures": [],
            "notes": [],
            "error": f"{type(exc).__name__}: {exc}",
        }
        code = 1
    finally:
        servers.stop_all()
    text = json.dumps(result, indent=1, default=str)
    if out:
        Path(out).write_text(text)
    else:
        print(text)
    return code


def wait_until(
    predicate: Callable[[], Any], timeout: float, interval: float = 0.01, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


# -- Redis command capture -------------------------------------------------------------------


class MonitorCapture:
    """Record every command a Redis server executes (``MONITOR``), in phases.

    ``with MonitorCapture(url) as mon: ...; mon.phase("drain"); ...`` — afterwards
    ``mon.commands`` is a list of ``(phase, client_type, command_name, full_command)``;
    ``client_type`` is ``"lua"`` for commands run inside a script, else the connection type.
    A command sent by a client is one round trip unless the client pipelines.
    """

    MARK = "steplock-bench-monitor"

    def __init__(self, url: str):
        import redis

        self.url = url
        self._redis = redis
        self._client = redis.Redis.from_url(url)
        self._ctl = redis.Redis.from_url(url)
        self.commands: list[tuple[str, str, str, str]] = []
        self._phase = "start"
        self._thread = None
        self._error: BaseException | None = None

    def __enter__(self) -> MonitorCapture:
        import threading

        self._monitor = self._client.monitor()
        self._monitor.__enter__()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self._thread.start()
        self.phase("start")
        return self

    def _loop(self) -> None:
        try:
            while True:
                cmd = self._monitor.next_command()
                if cmd is None:
                    continue
                text = cmd["command"]
                if self.MARK in text:
                    parts = text.split()
                    marker = parts[-1] if parts else ""
                    if marker.endswith(":stop"):
                        return
                    if ":phase:" in marker:
                        self._phase = marker.split(":phase:", 1)[1]
                    continue
                name = text.split(" ", 1)[0].upper() if text else ""
                self.commands.append((self._phase, cmd["client_type"], name, text))
        except BaseException as exc:  # noqa: BLE001
            self._error = exc

    def phase(self, name: str) -> None:
        """Tag the commands that follow with ``name`` (an ECHO seen in order by MONITOR)."""
        self._ctl.echo(f"{self.MARK}:phase:{name}")
        # MONITOR is asynchronous to us: wait until the monitor thread has seen it.
        deadline = time.monotonic() + 10
        while self._phase != name and time.monotonic() < deadline and self._error is None:
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._ctl.echo(f"{self.MARK}:stop")
        self._thread.join(30)
        self._monitor.__exit__()
        self._client.close()
        self._ctl.close()
        if self._error is not None:
            raise RuntimeError(f"MONITOR capture failed: {self._error}")

    def count(self, phase: str | None = None, lua: bool = False) -> dict[str, int]:
        """Commands by name in ``phase`` (all when None): sent by clients, or run by scripts
        when ``lua``."""
        counts: dict[str, int] = {}
        for ph, ctype, name, _text in self.commands:
            if phase is not None and ph != phase:
                continue
            if (ctype == "lua") != lua:
                continue
            counts[name] = counts.get(name, 0) + 1
        return counts


def commands_processed(client) -> int:
    return int(client.info("stats")["total_commands_processed"])


# -- profiles --------------------------------------------------------------------------------


def profile_breakdown(
    session, categories: dict[str, Callable[[str, str], bool]]
) -> dict[str, float]:
    """Share of a pyinstrument session's time spent inside each category of frames.

    ``categories`` maps a name to ``predicate(file_path, function)``; a category's time is the
    inclusive time of its outermost matching frames (categories may overlap each other).
    Returns ``{name: share 0..1}`` plus ``"total_s"``.
    """
    root = session.root_frame()
    if root is None:
        return {"total_s": 0.0}
    total = root.time
    out: dict[str, float] = {"total_s": total}
    for name, pred in categories.items():
        acc = 0.0
        stack = [root]
        while stack:
            frame = stack.pop()
            if pred(frame.file_path or "", frame.function or ""):
                acc += frame.time
                continue
            stack.extend(frame.children)
        out[name] = acc / total if total else 0.0
    return out


def profile_text(profiler) -> str:
    return profiler.output_text(unicode=False, color=False, show_all=False)
