#!/usr/bin/env python3
"""The version corners that `make test` runs besides the main venv: one venv per corner.

A corner is a constraints file ``requirements/corners/<name>.txt`` whose first line names the
interpreter (``# python: 3.10``); its venv is ``.venv-corners/<name>``, holding the project
(editable, with the ``django`` extra) and ``requirements/test.txt`` under those constraints.

    corners.py build [NAME ...]     create or update the venvs (all corners when no name)
    corners.py list                 name, interpreter and venv state of each corner

Building is idempotent: a stamp keys the venv on the interpreter and on the packaging and
requirements files, so an unchanged corner costs one file read. The interpreter is looked for
on PATH (``python3.10``) and among pyenv's versions (``$(pyenv root)/versions/3.10.*``). When
it is missing the corner is skipped with a message, except under ``CI=true``, where that is an
error: CI must run every corner.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORNER_DIR = ROOT / "requirements" / "corners"
VENVS = ROOT / ".venv-corners"
#: Files whose content the corner venvs are built from.
KEY_FILES = ("setup.cfg", "pyproject.toml", "requirements/test.txt", "requirements/demo.txt")
#: Packages whose versions a corner reports (what its compatibility row names).
REPORTED = ("Django", "celery", "kombu", "redis", "django-celery-results")
#: What a corner pass runs (on SQLite) when no test paths are given: the modules that touch the
#: versioned APIs (redis-py's client and scripts, Celery's task, retry, configuration and
#: command-line machinery, Django's ORM, transactions, checks and migrations, the interpreter's
#: threads and fork), not the whole suite, which the main venv runs on SQLite and PostgreSQL.
TESTS = (
    "tests/test_lock.py",
    "tests/test_task.py",
    "tests/test_plan.py",
    "tests/test_conf.py",
    "tests/test_steps.py",
    "tests/test_validate.py",
    "tests/test_heartbeat.py",
    "tests/test_cli.py",
    "tests/test_task_celery_worker.py",
    "tests/contrib/test_django_steps.py",
    "tests/contrib/test_checks.py",
    "tests/contrib/test_models.py",
    # redis-py's clients, pools, credentials and ACL errors; Django's routers
    "tests/test_clients.py",
    "tests/test_acl.py",
    "tests/test_connection_pools.py",
    "tests/contrib/test_routing.py",
    # every pattern on every topology (one node, Sentinel, Cluster, the ACL user)
    "tests/patterns/test_topologies.py",
    # the distributed patterns: their scripts through redis-py, Celery's retry and headers,
    # the admission gates in a task, the idempotency records' migration and ORM store
    "tests/patterns/test_gates.py",
    "tests/patterns/test_ratelimit.py",
    "tests/patterns/test_concurrency.py",
    "tests/patterns/test_breaker.py",
    "tests/patterns/test_breaker_tasks.py",
    "tests/patterns/test_retry.py",
    "tests/patterns/test_idempotency.py",
    "tests/patterns/test_idempotency_django.py",
)
#: redis-py's Cluster and Sentinel clients at both ends of the redis-py range.
TOPOLOGIES = ("tests/test_cluster.py", "tests/test_topologies_sentinel_tls.py")
#: Real prefork workers (Celery's worker, billiard, the worker signals): duplicates commit once,
#: a child keeps its lease over three TTLs, a SIGKILL leaves the lease to its TTL, a bad setting
#: stops the worker at start. The rest of tests/test_workers.py runs on the main venv.
WORKERS = tuple(
    f"tests/test_workers.py::{name}"
    for name in (
        "test_two_workers_on_one_step_commit_once",
        "test_prefork_child_keeps_its_lease_over_three_ttls",
        "test_sigkilled_worker_leaves_its_lease_to_the_ttl",
        "test_worker_with_an_invalid_setting_refuses_to_start",
    )
)
#: Per corner, run in addition to TESTS: the workers at both ends of the Celery range, and the
#: admin (with the browser) on both Django 6 releases.
EXTRA_TESTS = {
    "oldest": WORKERS + TOPOLOGIES,
    "middle": (
        "tests/contrib/test_admin.py",
        "tests/contrib/test_browser.py",
        "tests/contrib/test_browser_operators.py",
    ),
    "newest": WORKERS
    + TOPOLOGIES
    + (
        # gevent's and eventlet's native renewal thread and unpatched sockets (TCP, Unix, TLS)
        "tests/test_pools.py::test_green_heartbeat_renews_from_a_native_thread_or_refuses",
        "tests/contrib/test_admin.py",
        "tests/contrib/test_browser.py",
        "tests/contrib/test_browser_operators.py",
    ),
}


def say(message: str) -> None:
    print(f"corners: {message}", flush=True)


class MissingInterpreter(RuntimeError):
    """No interpreter of the corner's Python version on this machine."""


@dataclass(frozen=True)
class Corner:
    name: str
    python: str  # "3.10"
    constraints: Path

    @property
    def venv(self) -> Path:
        return VENVS / self.name

    @property
    def executable(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.venv / ".corner-stamp"

    def versions(self) -> dict[str, str]:
        """The reported packages' versions installed in the venv (read at build time)."""
        try:
            return json.loads(self.stamp.read_text())["versions"]
        except (OSError, ValueError, KeyError):
            return {}

    @property
    def tests(self) -> tuple[str, ...]:
        return TESTS + EXTRA_TESTS.get(self.name, ())

    def built(self) -> bool:
        return self.executable.exists() and self.stamp.exists()


def load(name: str) -> Corner:
    path = CORNER_DIR / f"{name}.txt"
    if not path.is_file():
        known = ", ".join(all_names()) or "none"
        raise SystemExit(f"corners: unknown corner {name!r} (known: {known})")
    first = (path.read_text().splitlines() or [""])[0]
    match = re.fullmatch(r"#\s*python:\s*(3\.\d+)\s*", first)
    if not match:
        raise SystemExit(f"corners: {path} must start with a line '# python: 3.N'")
    return Corner(name, match.group(1), path)


def all_names() -> list[str]:
    return sorted(p.stem for p in CORNER_DIR.glob("*.txt"))


def _reports(executable: str, version: str) -> bool:
    try:
        out = subprocess.run(
            [executable, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == version


def _pyenv_root() -> Path | None:
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    pyenv = shutil.which("pyenv")
    if pyenv:
        out = subprocess.run([pyenv, "root"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    default = Path.home() / ".pyenv"
    return default if default.is_dir() else None


def _patch_key(path: Path) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in path.name.split("."))


def find_python(version: str) -> str:
    """An interpreter reporting ``version`` ("3.10"): PATH first (a pyenv shim counts only if
    it runs), then pyenv's newest patch release of it. Raises MissingInterpreter."""
    candidates: list[str] = []
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(on_path)
    root = _pyenv_root()
    if root is not None:
        installed = [
            p
            for p in (root / "versions").glob(f"{version}.*")
            if re.fullmatch(rf"{re.escape(version)}\.\d+", p.name)
        ]
        candidates += [
            str(p / "bin" / f"python{version}")
            for p in sorted(installed, key=_patch_key, reverse=True)
        ]
    candidates += [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for candidate in candidates:
        if Path(candidate).exists() and _reports(candidate, version):
            return candidate
    raise MissingInterpreter(
        f"no Python {version} found (looked on PATH and in pyenv's versions: "
        f"install it, e.g. `pyenv install {version}`)"
    )


def _key(corner: Corner, interpreter: str) -> str:
    digest = hashlib.sha256()
    for rel in (*KEY_FILES, corner.constraints.relative_to(ROOT)):
        digest.update(str(rel).encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")
    digest.update(interpreter.encode())
    return digest.hexdigest()


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"},
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"corners: FAILED: {' '.join(cmd)}")


def build(corner: Corner) -> bool:
    """Create or update the corner's venv; False when its interpreter is missing (not in CI)."""
    try:
        interpreter = find_python(corner.python)
    except MissingInterpreter as exc:
        if os.environ.get("CI") == "true":
            raise SystemExit(
                f"corners: ERROR: corner {corner.name}: {exc}; CI=true requires every corner"
            ) from None
        say(f"{corner.name}: skipped, {exc}")
        return False
    want = _key(corner, interpreter)
    if corner.built() and _reports(str(corner.executable), corner.python):
        try:
            if json.loads(corner.stamp.read_text()).get("key") == want:
                say(
                    f"{corner.name}: up to date (Python {corner.python}, "
                    + describe_versions(corner.versions())
                    + ")"
                )
                return True
        except ValueError:
            pass
    say(f"{corner.name}: building {corner.venv.relative_to(ROOT)} with {interpreter}")
    shutil.rmtree(corner.venv, ignore_errors=True)
    _run([interpreter, "-m", "venv", str(corner.venv)])
    py = str(corner.executable)
    _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    _run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "-e",
            ".[django]",
            "-r",
            "requirements/test.txt",
            "-c",
            str(corner.constraints.relative_to(ROOT)),
        ]
    )
    _run([py, "-m", "pip", "check"])
    out = subprocess.run(
        [
            py,
            "-c",
            "import json, sys; from importlib.metadata import version\n"
            "print(json.dumps({n: version(n) for n in sys.argv[1:]}))",
            *REPORTED,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    versions = json.loads(out.stdout)
    corner.stamp.write_text(
        json.dumps({"key": want, "interpreter": interpreter, "versions": versions}, indent=1)
        + "\n"
    )
    say(f"{corner.name}: built (Python {corner.python}, {describe_versions(versions)})")
    return True


def describe_versions(versions: dict[str, str]) -> str:
    return ", ".join(f"{name} {versions[name]}" for name in REPORTED if name in versions)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("build", "list"):
        print(__doc__)
        return 2
    names = argv[1:] or all_names()
    corners = [load(name) for name in names]
    if argv[0] == "list":
        for corner in corners:
            state = (
                ("built: " + describe_versions(corner.versions()))
                if corner.built()
                else "not built"
            )
            print(f"{corner.name}: Python {corner.python}, {state}")
        return 0
    for corner in corners:
        build(corner)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
