"""The suite keeps off servers it did not start (scripts/run_tests.py, tests/conftest.py).

The README tells users to export ``REDIS_URL`` and ``DATABASE_URL`` for the demo; the tests'
fixtures flush their Redis and create and drop their database. Only the test-only variables
``STEPLOCK_TEST_REDIS_URL`` and ``STEPLOCK_TEST_DATABASE_URL`` name an existing server for
the tests, and no password is ever printed. Each case runs the runner (or a bare pytest) in a
subprocess on one tiny test of this module, against a password-protected redis-server of its
own that holds a sentinel key.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_steplock.lock import make_client
from tests.support import servers

ROOT = Path(__file__).resolve().parent.parent
PASSWORD = "s3cret-Pa55word-of-the-demo"
DB_PASSWORD = "db-Pa55word-of-the-demo"
SENTINEL = "users:data:keep-me"
INNER = "tests/test_run_tests.py::test_inner_flushes_its_own_redis"


def test_inner_flushes_its_own_redis(redis_client):
    """The inner test of the runs below (and a plain test here, in both passes): the
    ``redis_client`` fixture flushed its database, then this leaves a mark in it."""
    assert redis_client.dbsize() == 0
    redis_client.set("inner-test-ran", "1")


def test_inner_reports_what_its_pass_gave_it(redis_server_url):
    """The inner test of the side-by-side run below: writes the servers and files its pass
    gave it to the file named in STEPLOCK_TEST_REPORT (nothing when unset)."""
    from django.conf import settings

    report = os.environ.get("STEPLOCK_TEST_REPORT")
    if report:
        engine = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
        line = " ".join([engine, redis_server_url, os.environ["STEPLOCK_VAR_DIR"]])
        with open(f"{report}.{engine}", "w") as out:
            out.write(line)
    assert os.environ["REDIS_URL"] == redis_server_url


def test_inner_fails_when_asked():
    """The inner test of the failure-summary run below: fails, with a message of its own, when
    STEPLOCK_TEST_FAIL_INNER is set (the value it fails with), else checks that it is unset."""
    asked = os.environ.get("STEPLOCK_TEST_FAIL_INNER", "")
    assert asked == "", f"asked to fail: {asked}"


@pytest.fixture
def users_redis(private_redis):
    """A user's own Redis, with a password and a key of theirs; ``(url, admin client)``."""
    admin = make_client(private_redis.url)
    admin.set(SENTINEL, "precious")
    admin.config_set("requirepass", PASSWORD)
    admin.close()
    url = f"redis://:{PASSWORD}@127.0.0.1:{private_redis.port}/0"
    client = make_client(url)
    yield url, client
    client.close()


def _env(tmp_path: Path, **extra: str) -> dict:
    """This process's environment without any server URL of this run, plus ``extra``."""
    drop = {
        "REDIS_URL",
        "DATABASE_URL",
        "PYTEST_ADDOPTS",
        servers.TEST_REDIS_URL_ENV,
        servers.TEST_DATABASE_URL_ENV,
    }
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        STEPLOCK_SQLITE=str(tmp_path / "s.sqlite3"),
        STEPLOCK_TEST_SQLITE=str(tmp_path / "t.sqlite3"),
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def _run(argv: list[str], env: dict) -> tuple[int, str]:
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _runner(*args: str) -> list[str]:
    return [sys.executable, "scripts/run_tests.py", *args]


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]


def assert_no_password(output: str) -> None:
    for secret in (PASSWORD, DB_PASSWORD):
        assert secret not in output, output
        for start in range(len(secret) - 5):
            assert secret[start : start + 6] not in output, output


@pytest.mark.no_database  # runs once, in the SQLite pass
def test_make_test_leaves_an_exported_redis_url_and_database_url_alone(tmp_path, users_redis):
    url, users = users_redis
    env = _env(
        tmp_path,
        REDIS_URL=url,
        DATABASE_URL=f"postgresql://shop:{DB_PASSWORD}@127.0.0.1:{servers.free_port()}/shop",
        # One pass, on SQLite: the PostgreSQL pass would start a server this test needs not.
        STEPLOCK_TEST_DATABASE_URL=f"sqlite:///{tmp_path / 'named.sqlite3'}",
    )
    code, output = _run(_runner("-p", "no:cacheprovider", INNER), env)
    assert code == 0, output
    assert "1 passed" in output, output
    assert users.get(SENTINEL) == "precious"  # never flushed
    assert users.get("inner-test-ran") is None  # the test ran on the runner's own Redis
    assert "started redis-server" in output
    assert_no_password(output)


@pytest.mark.no_database  # runs once, in the SQLite pass
def test_a_bare_pytest_refuses_an_exported_redis_url_or_database_url(tmp_path, users_redis):
    url, users = users_redis
    database = f"postgresql://shop:{DB_PASSWORD}@127.0.0.1:{servers.free_port()}/shop"
    for name, value in (("REDIS_URL", url), ("DATABASE_URL", database)):
        code, output = _run(_pytest(INNER), _env(tmp_path, **{name: value}))
        assert code == pytest.ExitCode.USAGE_ERROR, output
        test_name = servers.TEST_URL_ENV[name]
        assert f"{name}=" in output and test_name in output, output
        assert "***" in output, output
        assert_no_password(output)
    assert users.get(SENTINEL) == "precious"
    assert users.get("inner-test-ran") is None


@pytest.mark.no_database  # runs once, in the SQLite pass
def test_the_test_only_variable_names_a_server_the_tests_may_flush(tmp_path, users_redis):
    url, users = users_redis
    env = _env(
        tmp_path,
        STEPLOCK_TEST_REDIS_URL=url,
        STEPLOCK_TEST_DATABASE_URL=f"sqlite:///{tmp_path / 'named.sqlite3'}",
    )
    code, output = _run(_runner("-p", "no:cacheprovider", INNER), env)
    assert code == 0, output
    assert "1 passed" in output, output
    assert users.get("inner-test-ran") == "1" and users.get(SENTINEL) is None
    assert f"using {servers.TEST_REDIS_URL_ENV}=redis://:***@127.0.0.1:" in output, output
    assert "started redis-server" not in output
    assert_no_password(output)


@pytest.mark.no_database  # runs once, in the SQLite pass
def test_which_urls_are_a_users_own():
    named = "redis://127.0.0.1:7/0"
    assert servers.foreign_urls({"REDIS_URL": named}) == {"REDIS_URL": named}
    assert servers.foreign_urls({"REDIS_URL": named, "STEPLOCK_TEST_REDIS_URL": named}) == {}
    assert servers.foreign_urls(
        {"DATABASE_URL": "sqlite:///a", "STEPLOCK_TEST_DATABASE_URL": "sqlite:///b"}
    ) == {"DATABASE_URL": "sqlite:///a"}
    assert servers.foreign_urls({"REDIS_URL": "", "STEPLOCK_TEST_REDIS_URL": named}) == {}


@pytest.mark.no_database  # runs once, in the SQLite pass
@pytest.mark.skipif(not servers.PostgresServer.available(), reason="needs PostgreSQL")
def test_the_passes_run_side_by_side_on_servers_of_their_own(tmp_path):
    report = tmp_path / "pass"
    env = _env(tmp_path, STEPLOCK_TEST_REPORT=str(report))
    inner = "tests/test_run_tests.py::test_inner_reports_what_its_pass_gave_it"
    code, output = _run(_runner("--jobs", "2", "-p", "no:cacheprovider", inner), env)
    assert code == 0, output
    # The default passes: MariaDB's runs only when named (make test-mysql).
    passes = {"sqlite": "sqlite3", "postgresql": "postgresql"}
    # The third, ``common``, runs the tests whose database is incidental: not this one.
    assert f"{len(passes) + 1} passes, 2 side by side" in output, output
    assert "mariadb" not in output, output
    assert "run_tests: common: empty (0 passed, 0 failed, 0 skipped" in output, output
    started = [
        line.split(":")[1].strip() for line in output.splitlines() if " python -m pytest" in line
    ]
    assert set(started[:2]) == {"postgresql", "sqlite"}, started  # the longest first
    for label in passes:
        lines = [line for line in output.splitlines() if line.startswith(f"[{label}] ")]
        assert any(" 1 passed" in line for line in lines), output
    seen = {
        engine: (report.parent / f"pass.{engine}").read_text().split()
        for engine in passes.values()
    }
    assert len({redis for _, redis, _ in seen.values()}) == len(passes)
    assert len({var for _, _, var in seen.values()}) == len(passes)
    assert f"total: {len(passes)} passed, 0 failed, 0 skipped" in output, output


@pytest.mark.no_database  # runs once, in the SQLite pass
@pytest.mark.skipif(not servers.MariaDBServer.available(), reason="needs MariaDB and mysqlclient")
def test_only_runs_the_named_pass_on_its_own_mariadb(tmp_path):
    report = tmp_path / "pass"
    env = _env(tmp_path, STEPLOCK_TEST_REPORT=str(report))
    inner = "tests/test_run_tests.py::test_inner_reports_what_its_pass_gave_it"
    code, output = _run(_runner("--only", "mariadb", "-p", "no:cacheprovider", inner), env)
    assert code == 0, output
    assert "started mariadbd mysql://" in output and "started postgres" not in output
    assert [p.name for p in tmp_path.glob("pass.*")] == ["pass.mysql"]
    assert "run_tests: mariadb: ok (1 passed, 0 failed, 0 skipped" in output, output
    assert "total: 1 passed, 0 failed, 0 skipped" in output, output
    code, output = _run(_runner("--only", "oracle", inner), env)
    assert code != 0 and "--only takes one of postgresql, sqlite, mariadb, common" in output, (
        output
    )


@pytest.mark.no_database  # runs once, in the SQLite pass
def test_the_summary_names_each_failed_test_and_its_message(tmp_path):
    """CI keeps only the tail of the output: the summary at the end names what failed."""
    inner = "tests/test_run_tests.py::test_inner_fails_when_asked"
    env = _env(tmp_path, STEPLOCK_TEST_FAIL_INNER="marker-4711")
    code, output = _run(_runner("--only", "sqlite", "-p", "no:cacheprovider", inner), env)
    assert code == 1, output
    tail = output[output.index("run_tests: sqlite: FAILED") :]
    assert (
        "run_tests:   failed: tests.test_run_tests::test_inner_fails_when_asked: "
        "AssertionError: asked to fail: marker-4711"
    ) in tail, tail
    assert "total: 0 passed, 1 failed, 0 skipped" in tail, tail
