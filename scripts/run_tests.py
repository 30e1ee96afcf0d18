#!/usr/bin/env python3
"""Run pytest against SQLite, PostgreSQL and MariaDB, with throwaway servers: ``make test`` runs
the three default passes (SQLite, PostgreSQL, common), ``make test-mysql`` the MariaDB pass.

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
    --corners-only   skip the main passes (SQLite, PostgreSQL, MariaDB): run the corners only.
    --only LABEL     run only the main pass LABEL (postgresql, sqlite, mariadb or common);
                     repeatable, ``--only sqlite,mariadb`` too. Without it, the default passes
                     (``DEFAULT_PASSES``: all but mariadb). Corners given with --corner still
                     run.
    --jobs N         passes side by side (default 2 on two cores or more, else 1). Each pass has
                     a redis-server, a PostgreSQL or MariaDB (when it needs one), SQLite files
                     and a pytest temporary directory of its own, and its output lines carry
                     its label. With STEPLOCK_TEST_REDIS_URL the passes share that server and
                     run one at a time.

The main passes: ``sqlite``, ``postgresql`` and ``mariadb`` run the tests about the step
database, each on its database (tests marked ``postgresql`` or ``mysql`` on theirs only; the
MariaDB pass leaves out what ``MARIADB_LEAVES_OUT`` lists unless the arguments name test
paths); ``common`` runs, on SQLite, the tests whose database is incidental (marked
``redis_shape``, ``no_database``, ``rabbitmq`` or ``db_incidental``), once. Two at a time by
default, the longest first. The MariaDB pass runs only when named (``--only mariadb``, ``make
test-mysql``, which CI runs after ``make test``): it repeats the step-database tests of the
other two database passes on a third vendor, and with it ``make test`` took about 40 minutes
on two cores instead of about 20.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from celery_steplock.redact import redact, url_secrets  # noqa: E402
from tests.support.servers import (  # noqa: E402
    ROOT,
    TEST_DATABASE_URL_ENV,
    TEST_REDIS_URL_ENV,
    TEST_SCOPE_ENV,
    TEST_URL_ENV,
    MariaDBServer,
    PostgresServer,
    RedisServer,
    foreign_urls,
)

import corners as corner_venvs  # noqa: E402  (scripts/corners.py)

PG_MISSING = (
    "PostgreSQL not found: skipped the PostgreSQL run (install postgresql or set "
    f"{TEST_DATABASE_URL_ENV})"
)

MARIADB_MISSING = (
    "MariaDB not found: skipped the MariaDB run (install mariadb-server, and mysqlclient into "
    ".venv: `make test` does both as root, or pip install -r requirements/mysql.txt)"
)
#: The main passes, longest first (the order they start in: with passes side by side, the
#: longest runs beside the others in turn). ``sqlite``, ``postgresql`` and ``mariadb`` run the
#: tests about the step database on each; ``common`` (on SQLite) the ones whose database is
#: incidental (``tests.conftest.SINGLE_PASS``: Redis shapes, the broker, validation, the
#: command-line tools), once.
MAIN_PASSES = ("postgresql", "sqlite", "mariadb", "common")
#: The passes run when ``--only`` names none (``make test``); ``--only mariadb`` (``make
#: test-mysql``) runs the MariaDB pass.
DEFAULT_PASSES = ("postgresql", "sqlite", "common")
#: What the MariaDB pass leaves to PostgreSQL when no test path is named: the fault suite's own
#: units (the suite itself is PostgreSQL's), which judge recorded runs, not the database.
MARIADB_LEAVES_OUT = ("--ignore=tests/faults",)


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
    DATABASE_URL for pytest and the workers it starts. A pass's scope (``TEST_SCOPE_ENV``) is
    this script's to set: one inherited (a run of this script inside a test) is dropped."""
    env = dict(environ)
    env.pop(TEST_SCOPE_ENV, None)
    for name, url in foreign_urls(env).items():
        say(f"ignoring {name}={url}: the tests use servers of their own or {TEST_URL_ENV[name]}")
        env.pop(name)
    for name, test_name in TEST_URL_ENV.items():
        if env.get(test_name):
            env[name] = env[test_name]
    return env


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


def _failures(junit: Path, limit: int = 20) -> list[str]:
    """``node id: first line of the message`` of each failed or erroring test in a JUnit XML
    report (at most ``limit``): the summary names them, since CI keeps only its tail."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return []
    found: list[str] = []
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                where = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (child.get("message") or "").strip().splitlines()
                found.append(f"{where}: {message[0][:200] if message else child.tag}")
                break
        if len(found) >= limit:
            break
    return found


def _pump(stream, label: str, log: Path) -> None:
    """Copy a pass's output line by line, each line prefixed by the pass's label, to this
    process's stdout and to ``log``."""
    with open(log, "w", encoding="utf-8", errors="replace") as out:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            out.write(line)
            sys.stdout.write(f"[{label}] {line}" if line.strip() else line)
            sys.stdout.flush()


def run_pytest(
    label: str,
    args: list[str],
    env: dict,
    workdir: Path,
    python: str = sys.executable,
    prefixed: bool = False,
    running: list | None = None,
) -> tuple[int, dict | None]:
    """Run pytest once; returns its exit code and its counts. ``prefixed``: its output goes
    through :func:`_pump` (passes side by side), else straight to the terminal. ``running``
    gets the process while it runs (the interrupt handler stops what is in it: a pass runs
    on a thread of its own, and only the main thread receives signals)."""
    junit = workdir / f"{label}.xml"
    # Ours goes first so that a --junitxml among `args` wins.
    cmd = [python, "-m", "pytest", f"--junitxml={junit}", *args]
    say(f"{label}: python -m pytest {shlex.join(args)}".rstrip())
    pipe = subprocess.PIPE if prefixed else None
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=pipe, stderr=subprocess.STDOUT if prefixed else None
    )
    if running is not None:
        running.append(proc)
    pump = None
    if prefixed:
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, label, workdir / f"{label}.log"), daemon=True
        )
        pump.start()
    try:
        code = proc.wait()  # on a pass's thread: the main thread stops it (_stop_all)
    finally:
        if pump is not None:
            pump.join(timeout=10)
        if running is not None and proc in running:
            running.remove(proc)
    return code, _counts(junit)


def failures_of(label: str, workdir: Path) -> list[str]:
    return _failures(workdir / f"{label}.xml")


def describe(counts: dict | None) -> str:
    if counts is None:
        return "no report"
    return f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"


def parse_options(
    args: list[str],
) -> tuple[list[str], bool, int | None, list[str], list[str]]:
    """(corner names, corners only, jobs or None, main passes chosen with --only (empty: the default ones),
    pytest arguments) from the leading options of `args`."""
    names: list[str] = []
    only = False
    jobs: int | None = None
    chosen: list[str] = []
    while args:
        head = args[0]
        if head == "--only" and len(args) > 1 or head.startswith("--only="):
            value = head.split("=", 1)[1] if "=" in head else args[1]
            args = args[1:] if "=" in head else args[2:]
            for label in (n for n in value.split(",") if n):
                if label not in MAIN_PASSES:
                    raise SystemExit(
                        f"run_tests: --only takes one of {', '.join(MAIN_PASSES)}, got {label!r}"
                    )
                chosen.append(label)
            continue
        if head == "--corner" and len(args) > 1:
            names += [n for n in args[1].split(",") if n]
            args = args[2:]
        elif head.startswith("--corner="):
            names += [n for n in head.split("=", 1)[1].split(",") if n]
            args = args[1:]
        elif head == "--corners-only":
            only = True
            args = args[1:]
        elif head in ("--jobs", "-j") and len(args) > 1 or head.startswith("--jobs="):
            value = head.split("=", 1)[1] if "=" in head else args[1]
            args = args[1:] if "=" in head else args[2:]
            if not value.isdigit() or int(value) < 1:
                raise SystemExit(f"run_tests: --jobs takes a whole number above 0, got {value!r}")
            jobs = int(value)
        else:
            break
    if only and not names:
        raise SystemExit("run_tests: --corners-only needs --corner NAME")
    return list(dict.fromkeys(names)), only, jobs, list(dict.fromkeys(chosen)), args


def names_tests(args: list[str]) -> bool:
    """Whether pytest arguments select tests by path (then a corner runs those, not its own)."""
    return any(not a.startswith("-") and a.split("::")[0].startswith("tests") for a in args)


@dataclass
class Pass:
    """One pytest run of ``make test``: its label, arguments, environment and interpreter;
    ``postgres``/``mariadb``: it needs a PostgreSQL/MariaDB server of its own; ``note``: said
    before it starts."""

    label: str
    args: list[str]
    env: dict
    python: str = sys.executable
    postgres: bool = False
    mariadb: bool = False
    note: str = ""


def default_jobs() -> int:
    """Passes side by side: two where there are two cores or more (each pass spends much of
    its time waiting on worker processes and servers), else one. Three on two cores made the
    passes 1.4 times as long each and the renewal timings of the green-pool tests flaky."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def main(args: list[str]) -> int:
    corner_names, corners_only, jobs, chosen, args = parse_options(args)
    corners = [corner_venvs.load(name) for name in corner_names]
    signal.signal(signal.SIGTERM, _raise_interrupted)
    signal.signal(signal.SIGINT, _raise_interrupted)
    base_env = suite_environment(dict(os.environ))
    results: dict[str, tuple[str, str]] = {}  # label -> ("ok" | "FAILED" | ..., detail)
    order: list[str] = []
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    lock = threading.Lock()
    running: list[subprocess.Popen] = []
    shared_redis = base_env.get(TEST_REDIS_URL_ENV)

    failed_tests: dict[str, list[str]] = {}  # label -> "node id: message" of its failures

    def record(
        label: str, code: int | None, counts: dict | None, elapsed: float, failures: list[str]
    ) -> None:
        with lock:
            if failures:
                failed_tests[label] = failures
            if counts:
                for key in totals:
                    totals[key] += counts[key]
            # 5: nothing selected in this pass (e.g. ARGS=tests/faults on SQLite, where the
            # fault scenarios are deselected); fine unless no pass ran anything.
            note = " (no tests selected in this pass)" if code == 5 else ""
            status = "ok" if code == 0 else "empty" if code == 5 else "FAILED"
            detail = f"{describe(counts)}, exit {code}, {elapsed:.1f}s{note}"
            results[label] = (status, detail)

    def note(label: str, status: str, detail: str) -> None:
        with lock:
            results[label] = (status, detail)

    passes: list[Pass] = []
    if shared_redis:
        say(f"using {TEST_REDIS_URL_ENV}={shared_redis}")
    if not corners_only:
        if base_env.get(TEST_DATABASE_URL_ENV):
            say(f"using {TEST_DATABASE_URL_ENV}={base_env[TEST_DATABASE_URL_ENV]}")
            passes.append(Pass(TEST_DATABASE_URL_ENV, args, dict(base_env)))
        else:

            def wanted(label: str) -> bool:
                return label in (chosen or DEFAULT_PASSES)

            if wanted("sqlite"):
                sqlite_env = dict(base_env)
                sqlite_env.pop("DATABASE_URL", None)
                passes.append(Pass("sqlite", args, {**sqlite_env, TEST_SCOPE_ENV: "database"}))
            if wanted("common"):
                common_env = dict(base_env)
                common_env.pop("DATABASE_URL", None)
                passes.append(Pass("common", args, {**common_env, TEST_SCOPE_ENV: "common"}))
            if not wanted("postgresql"):
                pass  # --only left it out
            elif PostgresServer.available():
                passes.append(Pass("postgresql", args, dict(base_env), postgres=True))
            elif os.environ.get("CI") == "true":
                say(
                    "ERROR: PostgreSQL not found, and CI=true requires the PostgreSQL run "
                    f"(install postgresql or set {TEST_DATABASE_URL_ENV})"
                )
                note("postgresql", "FAILED", "PostgreSQL not found")
                order.append("postgresql")
            else:
                say(PG_MISSING)
                note("postgresql", "skipped", PG_MISSING)
                order.append("postgresql")
            if not wanted("mariadb"):
                pass  # --only left it out
            elif MariaDBServer.available():
                mariadb_args = args if names_tests(args) else [*MARIADB_LEAVES_OUT, *args]
                passes.append(Pass("mariadb", mariadb_args, dict(base_env), mariadb=True))
            elif os.environ.get("CI") == "true":
                say(
                    "ERROR: MariaDB not found, and CI=true requires the MariaDB run "
                    "(install mariadb-server and requirements/mysql.txt)"
                )
                note("mariadb", "FAILED", "MariaDB not found")
                order.append("mariadb")
            else:
                say(MARIADB_MISSING)
                note("mariadb", "skipped", MARIADB_MISSING)
                order.append("mariadb")
    for corner in corners:
        label = f"corner-{corner.name}"
        if not corner.built():
            why = (
                f"venv {corner.venv.relative_to(ROOT)} not built "
                f"(Python {corner.python} missing? run scripts/corners.py build)"
            )
            if os.environ.get("CI") == "true":
                say(f"ERROR: {label}: {why}; CI=true requires every corner")
                note(label, "FAILED", why)
            else:
                say(f"{label}: skipped, {why}")
                note(label, "skipped", why)
            order.append(label)
            continue
        env = dict(base_env)
        env.pop("DATABASE_URL", None)
        env.pop(TEST_DATABASE_URL_ENV, None)
        passes.append(
            Pass(
                label,
                args if names_tests(args) else [*corner.tests, *args],
                env,
                python=str(corner.executable),
                note=(
                    f"{label}: Python {corner.python}, "
                    f"{corner_venvs.describe_versions(corner.versions())}, SQLite"
                ),
            )
        )
    rank = {label: i for i, label in enumerate(MAIN_PASSES)}
    passes.sort(key=lambda p: rank.get(p.label, len(rank)))  # stable: corners keep theirs
    order += [p.label for p in passes]
    # Side by side only with a Redis of each pass's own: the tests flush their server.
    jobs = 1 if shared_redis else (jobs or default_jobs())
    jobs = max(1, min(jobs, len(passes)))
    prefixed = jobs > 1

    try:
        with tempfile.TemporaryDirectory(prefix="steplock-run-tests-") as tmp:
            workdir = Path(tmp)
            if prefixed:
                say(
                    f"{len(passes)} passes, {jobs} side by side (--jobs 1 for one at a time); "
                    "each line is prefixed with its pass"
                )
            waiting = list(passes)  # taken in order: the longest passes start first
            taking = threading.Lock()

            def run() -> None:
                while True:
                    with taking:
                        if not waiting:
                            return
                        p = waiting.pop(0)
                    try:
                        run_pass(p, workdir, shared_redis, prefixed, running, record, note)
                    except BaseException as exc:  # noqa: BLE001 - reported in the summary
                        note(p.label, "FAILED", f"{type(exc).__name__}: {exc}")

            threads = [threading.Thread(target=run, daemon=True) for _ in range(jobs)]
            try:
                for thread in threads:
                    thread.start()
                for thread in threads:
                    while thread.is_alive():
                        thread.join(0.5)
            except Interrupted as exc:
                _stop_all(list(running), exc.signum)
                for thread in threads:
                    thread.join(60)
                raise
    except Interrupted as exc:
        say(f"interrupted by signal {exc.signum}")
        return 128 + exc.signum
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    print(flush=True)
    for label in order:
        if label in results:
            status, detail = results[label]
            say(f"{label}: {status} ({detail})")
            for failure in failed_tests.get(label, []):
                say(f"  failed: {failure}")
    print(f"total: {describe(totals)}", flush=True)
    statuses = [results[label][0] for label in order if label in results]
    if statuses and all(status == "empty" for status in statuses):
        say(
            "no test was selected in any pass"
            + (
                f" (--only {','.join(chosen)}: tests that need no particular database run in "
                "the common pass; try --only common, or leave --only out)"
                if chosen
                else ""
            )
        )
        return 1
    return 0 if all(status != "FAILED" for status in statuses) else 1


def run_pass(p: Pass, workdir: Path, shared_redis, prefixed, running, record, note) -> None:
    """Run one pass with servers of its own (a redis-server unless ``shared_redis``, and
    PostgreSQL or MariaDB when it needs one), its own SQLite files and pytest temporary directory, and
    stop them after."""
    home = workdir / p.label
    (home / "var").mkdir(parents=True)
    env = dict(p.env)
    env.update(
        STEPLOCK_VAR_DIR=str(home / "var"),
        STEPLOCK_SQLITE=str(home / "var" / "steplock.sqlite3"),
        STEPLOCK_TEST_SQLITE=str(home / "var" / "test_steplock.sqlite3"),
        PYTEST_DEBUG_TEMPROOT=str(home),
    )
    redis_server = db_server = None
    try:
        if shared_redis:
            import redis

            with redis.Redis.from_url(shared_redis) as client:  # a clean Redis for each pass
                client.flushall()
        else:
            redis_server = RedisServer(workdir=home / "redis").start()
            env["REDIS_URL"] = env[TEST_REDIS_URL_ENV] = redis_server.url
            say(f"{p.label}: started redis-server {redis_server.url} (pid {redis_server.pid})")
        for wanted, server_class, name, program in (
            (p.postgres, PostgresServer, "PostgreSQL", "postgres"),
            (p.mariadb, MariaDBServer, "MariaDB", "mariadbd"),
        ):
            if not wanted:
                continue
            try:
                db_server = server_class().start()
            except Exception as exc:  # noqa: BLE001 - reported as this pass's failure
                say(f"ERROR: could not start {name}: {exc}")
                note(p.label, "FAILED", f"{name} did not start")
                return
            env["DATABASE_URL"] = env[TEST_DATABASE_URL_ENV] = db_server.url
            say(f"{p.label}: started {program} {db_server.url} (pid {db_server.pid})")
        if p.note:
            say(p.note)
        started = time.monotonic()
        code, counts = run_pytest(
            p.label, p.args, env, workdir, python=p.python, prefixed=prefixed, running=running
        )
        record(p.label, code, counts, time.monotonic() - started, failures_of(p.label, workdir))
    finally:
        for server in (db_server, redis_server):
            if server is not None:
                server.stop()


def _stop_all(procs: list[subprocess.Popen], signum: int) -> None:
    """Give every running pass the chance to run its teardown (pytest handles SIGINT), then
    kill it. On Ctrl-C the terminal already sent SIGINT to each: let them finish first."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    waits = [(10, None)] if signum == signal.SIGINT else []
    waits += [(20, signal.SIGINT), (5, signal.SIGKILL)]
    for timeout, sig in waits:
        alive = [proc for proc in procs if proc.poll() is None]
        if not alive:
            return
        for proc in alive:
            if sig is not None:
                proc.send_signal(sig)
        deadline = time.monotonic() + timeout
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
