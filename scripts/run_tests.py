#!/usr/bin/env python3
"""Run pytest against SQLite and then PostgreSQL, with a throwaway Redis (what `make test` runs).

Extra arguments are passed to pytest. The tests wipe their servers (FLUSHDB, test databases
created and dropped), so they use only servers this script starts, unless a test-only variable
names one: STEPLOCK_TEST_REDIS_URL is used instead of starting a Redis server, and
STEPLOCK_TEST_DATABASE_URL makes a single run against that database. REDIS_URL and
DATABASE_URL (the demo's) are ignored: this script sets them for pytest and its workers. No
URL is printed with its password.

Leading options of this script (before any pytest argument):

    --corner NAME    after the main passes, run a version corner (scripts/corners.py builds its
                     venv): its own interpreter and pinned Django/Celery/kombu/redis-py, on
                     SQLite. It runs the corner's modules, or the pytest arguments given when
                     they name test paths. Repeatable; ``--corner oldest,newest`` too.
    --corners-only   skip the main passes (SQLite, PostgreSQL): run the corners only.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from celery_steplock.redact import redact, url_secrets  # noqa: E402
from tests.support.servers import (  # noqa: E402
    ROOT,
    TEST_DATABASE_URL_ENV,
    TEST_REDIS_URL_ENV,
    TEST_URL_ENV,
    PostgresServer,
    RedisServer,
    foreign_urls,
)

import corners as corner_venvs  # noqa: E402  (scripts/corners.py)

PG_MISSING = (
    "PostgreSQL not found: skipped the PostgreSQL run (install postgresql or set "
    f"{TEST_DATABASE_URL_ENV})"
)


class Interrupted(BaseException):
    """Raised from the SIGINT/SIGTERM handler so that every finally block runs."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


#: The passwords of the server URLs this script was given, masked wherever they appear.
_SECRETS = url_secrets(
    [os.environ.get(name, "") for name in (*TEST_URL_ENV, *TEST_URL_ENV.values())]
)


def say(message: str) -> None:
    print(f"run_tests: {redact(message, _SECRETS)}", flush=True)


def suite_environment(environ: dict) -> dict:
    """``environ`` as the passes start from: the user's REDIS_URL and DATABASE_URL (the
    demo's) dropped, each noted; a server named by a test-only variable is REDIS_URL or
    DATABASE_URL for pytest and the workers it starts."""
    env = dict(environ)
    for name, url in foreign_urls(env).items():
        say(f"ignoring {name}={url}: the tests use servers of their own or {TEST_URL_ENV[name]}")
        env.pop(name)
    for name, test_name in TEST_URL_ENV.items():
        if env.get(test_name):
            env[name] = env[test_name]
    return env


def _stop_pytest(proc: subprocess.Popen, signum: int) -> None:
    """Give pytest the chance to run its teardown (it handles SIGINT), then kill it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # On Ctrl-C the terminal already sent SIGINT to pytest: let it finish on its own first.
    waits = [(10, None)] if signum == signal.SIGINT else []
    waits += [(20, signal.SIGINT), (5, signal.SIGKILL)]
    for timeout, sig in waits:
        if proc.poll() is not None:
            return
        if sig is not None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def _counts(junit: Path) -> dict | None:
    """passed/failed/skipped from pytest's JUnit XML report, or None if there is none."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = failed = skipped = 0
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return {"passed": max(total - failed - skipped, 0), "failed": failed, "skipped": skipped}


def run_pytest(
    label: str, args: list[str], env: dict, workdir: Path, python: str = sys.executable
) -> tuple[int, dict | None]:
    """Run pytest once; returns its exit code and its counts."""
    junit = workdir / f"{label}.xml"
    # Ours goes first so that a --junitxml among `args` wins.
    cmd = [python, "-m", "pytest", f"--junitxml={junit}", *args]
    say(f"{label}: python -m pytest {shlex.join(args)}".rstrip())
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        code = proc.wait()
    except Interrupted as exc:
        _stop_pytest(proc, exc.signum)
        raise
    return code, _counts(junit)


def describe(counts: dict | None) -> str:
    if counts is None:
        return "no report"
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"


def parse_options(args: list[str]) -> tuple[list[str], bool, list[str]]:
    """(corner names, corners only, pytest arguments) from the leading options of `args`."""
    names: list[str] = []
    only = False
    while args:
        head = args[0]
        if head == "--corner" and len(args) > 1:
            names += [n for n in args[1].split(",") if n]
            args = args[2:]
        elif head.startswith("--corner="):
            names += [n for n in head.split("=", 1)[1].split(",") if n]
            args = args[1:]
        elif head == "--corners-only":
            only = True
            args = args[1:]
        else:
            break
    if only and not names:
        raise SystemExit("run_tests: --corners-only needs --corner NAME")
    return list(dict.fromkeys(names)), only, args


def names_tests(args: list[str]) -> bool:
    """Whether pytest arguments select tests by path (then a corner runs those, not its own)."""
    return any(not a.startswith("-") and a.split("::")[0].startswith("tests") for a in args)


def main(args: list[str]) -> int:
    corner_names, corners_only, args = parse_options(args)
    corners = [corner_venvs.load(name) for name in corner_names]
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, _raise_interrupted)
    base_env = suite_environment(dict(os.environ))
    results: list[tuple[str, str, str]] = []  # (label, "ok" | "FAILED" | "skipped", detail)
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    redis_server = pg_server = None

    def record(label: str, code: int | None, counts: dict | None, elapsed: float) -> None:
        if counts:
            for key in totals:
                totals[key] += counts[key]
        # 5: nothing selected in this pass (e.g. ARGS=tests/faults on SQLite, where the fault
        # scenarios are deselected); fine unless no pass ran anything.
        note = " (no tests selected in this pass)" if code == 5 else ""
        status = "ok" if code == 0 else "empty" if code == 5 else "FAILED"
        results.append((label, status, f"{describe(counts)}, exit {code}, {elapsed:.1f}s{note}"))

    try:
        with tempfile.TemporaryDirectory(prefix="steplock-run-tests-") as tmp:
            workdir = Path(tmp)
            if base_env.get(TEST_REDIS_URL_ENV):
                say(f"using {TEST_REDIS_URL_ENV}={base_env[TEST_REDIS_URL_ENV]}")
            else:
                redis_server = RedisServer().start()
                base_env["REDIS_URL"] = base_env[TEST_REDIS_URL_ENV] = redis_server.url
                say(f"started redis-server {redis_server.url} (pid {redis_server.pid})")

            if corners_only:
                runs = []
            elif base_env.get(TEST_DATABASE_URL_ENV):
                say(f"using {TEST_DATABASE_URL_ENV}={base_env[TEST_DATABASE_URL_ENV]}")
                runs = [TEST_DATABASE_URL_ENV]
            else:
                runs = ["sqlite", "postgresql"]

            for label in runs:
                env = dict(base_env)
                if label == "sqlite":
                    env.pop("DATABASE_URL", None)
                    env.pop(TEST_DATABASE_URL_ENV, None)
                elif label == "postgresql":
                    if not PostgresServer.available():
                        if os.environ.get("CI") == "true":
                            say(
                                "ERROR: PostgreSQL not found, and CI=true requires the "
                                f"PostgreSQL run (install postgresql or set {TEST_DATABASE_URL_ENV})"
                            )
                            results.append((label, "FAILED", "PostgreSQL not found"))
                        else:
                            say(PG_MISSING)
                            results.append((label, "skipped", PG_MISSING))
                        continue
                    try:
                        pg_server = PostgresServer().start()
                    except Exception as exc:
                        say(f"ERROR: could not start PostgreSQL: {exc}")
                        results.append((label, "FAILED", "PostgreSQL did not start"))
                        continue
                    env["DATABASE_URL"] = env[TEST_DATABASE_URL_ENV] = pg_server.url
                    say(f"started postgres {pg_server.url} (pid {pg_server.pid})")
                if redis_server is not None and results:  # a clean Redis for each run
                    import redis

                    with redis.Redis.from_url(redis_server.url) as client:
                        client.flushall()
                started = time.monotonic()
                code, counts = run_pytest(label, args, env, workdir)
                record(label, code, counts, time.monotonic() - started)
                if pg_server is not None:
                    pg_server.stop()
                    pg_server = None

            for corner in corners:
                label = f"corner-{corner.name}"
                if not corner.built():
                    why = (
                        f"venv {corner.venv.relative_to(ROOT)} not built "
                        f"(Python {corner.python} missing? run scripts/corners.py build)"
                    )
                    if os.environ.get("CI") == "true":
                        say(f"ERROR: {label}: {why}; CI=true requires every corner")
                        results.append((label, "FAILED", why))
                    else:
                        say(f"{label}: skipped, {why}")
                        results.append((label, "skipped", why))
                    continue
                env = dict(base_env)
                env.pop("DATABASE_URL", None)
                env.pop(TEST_DATABASE_URL_ENV, None)
                if redis_server is not None and results:
                    import redis

                    with redis.Redis.from_url(redis_server.url) as client:
                        client.flushall()
                corner_args = args if names_tests(args) else [*corner.tests, *args]
                say(
                    f"{label}: Python {corner.python}, "
                    f"{corner_venvs.describe_versions(corner.versions())}, SQLite"
                )
                started = time.monotonic()
                code, counts = run_pytest(
                    label, corner_args, env, workdir, python=str(corner.executable)
                )
                record(label, code, counts, time.monotonic() - started)
    except Interrupted as exc:
        say(f"interrupted by signal {exc.signum}")
        return 128 + exc.signum
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for server in (pg_server, redis_server):
            if server is not None:
                server.stop()

    print(flush=True)
    for label, status, detail in results:
        say(f"{label}: {status} ({detail})")
    print(f"total: {describe(totals)}", flush=True)
    if results and all(status == "empty" for _, status, _ in results):
        say("no test was selected in any pass")
        return 1
    return 0 if all(status != "FAILED" for _, status, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
