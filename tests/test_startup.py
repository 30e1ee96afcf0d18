"""The operators' own tools and a worker's start (issue 24): ``celery inspect conf`` and
``celery report`` show no password of a ``steplock_*`` setting; a worker whose lock store does
not answer warns at start, naming the setting; a step row whose fence is ahead of every fence
the store can grant (the store's clock went back) ends in a typed error and a signal after a
bounded number of attempts, its body run once."""

from __future__ import annotations

import time

import functools
import json
import logging
import subprocess
import sys

import celery.app.utils
import pytest
from celery import Celery

from celery_steplock import _startup, signals
from celery_steplock.exceptions import FenceAhead, LockLost
from celery_steplock.task import FENCE_AHEAD_RETRY_MAX, StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step, TransitionRecord
from tests.helpers import free_port, set_settings
from tests.support import ROOT

PW = "s3cr3t-Pw7f"  # never in any output
PW2 = "Qx7zK2vRw9Lp"
PW3 = "Zq4uT8mWy2Hj"


def assert_masked(text: str, *secrets: str) -> None:
    for secret in secrets or (PW, PW2, PW3):
        assert secret not in text
        for start in range(len(secret) - 3):
            assert secret[start : start + 4] not in text, (secret[start : start + 4], text)


def _factory(url):  # a client factory whose repr quotes a URL
    raise AssertionError("never called")


def steplock_app():
    """A Celery app (no namespace) whose steplock settings hold three secrets."""
    app = Celery("masked", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        steplock_redis_url=f"redis://:{PW}@cache-1.internal:6380/2",
        steplock_redis_transport_options={
            "sentinel_kwargs": {"password": PW2, "username": "watcher"},
            "client_name": "orders",
        },
        steplock_redis_client_factory=functools.partial(
            _factory, f"rediss://app:{PW3}@cache-2.internal:6390/0"
        ),
        steplock_name_secret=PW3,
        steplock_default_ttl=12.5,
        # Celery's own settings: masked by Celery as before.
        result_backend=f"redis://:{PW}@backend.internal:6379/1",
    )
    return app


# -- 1. celery inspect conf / celery report --------------------------------------------------


def test_bugreport_and_the_conf_table_mask_every_steplock_secret():
    """Before: ``steplock_redis_url: 'redis://:s3cr3t-Pw7f@cache-1...'`` in ``celery
    report`` (and ``inspect conf``, the same table). Now the credentials are masked, the
    server still named."""
    app = steplock_app()
    report = app.bugreport()
    assert_masked(report)
    assert "cache-1.internal:6380" in report and "cache-2.internal:6390" in report
    table = app.conf.table(with_defaults=True)
    assert_masked(json.dumps(table, default=repr))
    assert table["steplock_redis_url"] == "redis://:***@cache-1.internal:6380/2"
    assert table["steplock_redis_transport_options"]["client_name"] == "orders"
    assert table["steplock_default_ttl"] == 12.5  # values without secrets unchanged


def test_a_namespaced_django_configuration_is_masked_too(app):
    """``CELERY_STEPLOCK_REDIS_URL`` (a Django project's app.conf keys) as well."""
    set_settings(app, steplock_redis_url=f"redis://:{PW}@127.0.0.1:6379/0")
    text = app.conf.humanize(with_defaults=False)
    assert "CELERY_STEPLOCK_REDIS_URL" in text and "127.0.0.1:6379" in text
    assert_masked(text, PW)


def test_celery_keeps_its_own_masking():
    """Celery's settings are shown as Celery shows them (only ``steplock_*`` keys change)."""
    original = celery.app.utils.filter_hidden_settings.__wrapped__
    conf = {
        "broker_url": f"redis://:{PW}@b:6379/0",
        "result_backend": f"redis://:{PW}@r:6379/0",
        "database_url": "x",
        "task_routes": {"a": {"queue": "q"}},
        "other_url": f"redis://:{PW}@c:6379/0",  # a user's key: Celery shows it
    }
    assert celery.app.utils.filter_hidden_settings(conf) == original(conf)


def test_the_masking_is_installed_once():
    _startup.mask_steplock_settings()
    _startup.mask_steplock_settings()
    installed = celery.app.utils.filter_hidden_settings
    assert getattr(installed, "__steplock_masks__", False)
    assert not getattr(installed.__wrapped__, "__steplock_masks__", False)


def test_the_celery_report_command_masks_the_lock_store_password(worker_env):
    env = {**worker_env, "STEPLOCK_REDIS_URL": f"redis://:{PW}@127.0.0.1:{free_port()}/0"}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "django_app", "report"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "CELERY_STEPLOCK_REDIS_URL" in out.stdout and "127.0.0.1:" in out.stdout
    assert_masked(out.stdout + out.stderr, PW)


# -- 2. a worker whose lock store does not answer ---------------------------------------------


def test_the_startup_ping_warns_about_an_unreachable_store(app, caplog):
    set_settings(
        app,
        steplock_redis_url=f"redis://:{PW}@127.0.0.1:{free_port()}/0",
        steplock_socket_timeout=0.5,
    )
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        assert _startup.ping_lock_store(app) is False
    text = caplog.text
    assert "event=lock_store_unreachable" in text and "steplock_redis_url" in text
    assert "retr" in text and "127.0.0.1" in text
    assert_masked(text, PW)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_the_startup_ping_is_silent_when_the_store_answers(app, redis_server_url, caplog):
    set_settings(app, steplock_redis_url=redis_server_url)
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        assert _startup.ping_lock_store(app) is True
    assert caplog.records == []


@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_a_worker_with_an_unreachable_store_warns_and_inspect_conf_masks_it(start_worker):
    """Before: the worker said "ready." with no warning, and ``inspect conf`` showed
    ``CELERY_STEPLOCK_REDIS_URL`` with its password. Now its log has one WARNING naming
    steplock_redis_url (password masked) and what tasks will do; it still starts; ``inspect
    conf`` masks the password."""
    url = f"redis://:{PW}@127.0.0.1:{free_port()}/0"
    worker = start_worker("unreachable", concurrency=1, STEPLOCK_REDIS_URL=url)
    log = worker.log_text()
    assert " ready." in log
    warning = [line for line in log.splitlines() if "event=lock_store_unreachable" in line]
    assert len(warning) == 1 and "WARNING" in warning[0], log
    assert "steplock_redis_url" in warning[0] and "retr" in warning[0]
    replies = celery_app.control.inspect(timeout=10).conf(with_defaults=True) or {}
    mine = {k: v for k, v in replies.items() if k.startswith("unreachable@")}
    assert mine, replies
    conf = next(iter(mine.values()))
    assert "127.0.0.1" in conf["CELERY_STEPLOCK_REDIS_URL"]
    assert_masked(json.dumps(replies) + log, PW)


# -- 3. a row whose fence is ahead of every fence the store can grant --------------------------

BODY_RUNS: list = []


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.startup_finish",
    lock_key="skew:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="retry",
    max_retries=20,
)
def skew_finish(self, step_id):
    BODY_RUNS.append(step_id)
    return "done"


def redis_now_us(client) -> int:
    seconds, micros = client.time()
    return seconds * 1_000_000 + micros


def skew_events(events):
    return [kw for name, kw in events if name == "fence_ahead"]


@pytest.mark.django_db(transaction=True)
def test_a_row_fence_far_ahead_fails_at_once_with_a_typed_error(redis_client, events):
    """Before: LockLost, retried (20 eager retries here, without end in a worker), the body
    run every time. Now: FenceAhead naming the skew, one ``fence_ahead`` signal, the body run
    once, the step left as it was."""
    BODY_RUNS.clear()
    step = Step.objects.create(name="s", lock_fence=2**62)
    result = skew_finish.apply(args=(step.pk,))
    assert isinstance(result.result, FenceAhead), result.traceback
    assert isinstance(result.result, LockLost) and "newer fencing token" in str(result.result)
    assert result.result.row_fence == 2**62 and result.result.skew > 3600
    assert "ahead" in str(result.result)
    assert BODY_RUNS == [step.pk]
    sent = skew_events(events)
    assert len(sent) == 1 and sent[0]["step_id"] == step.pk and sent[0]["skew"] > 3600
    step.refresh_from_db()
    assert step.status == "pending" and step.lock_fence == 2**62
    assert TransitionRecord.objects.count() == 0


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.startup_paused_finish",
    lock_key="paused:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    max_retries=0,
)
def paused_finish(self, step_id, pause=0.0, expire=False):
    """Holds its lease ``pause`` seconds (a process paused, or on the minority side of a
    split), then, with ``expire``, finds it run out since its last check."""
    BODY_RUNS.append(step_id)
    time.sleep(pause)
    if expire:
        lease = self.lease
        lease.check()
        lease.check = lambda: None  # the check was made before the pause
        lease.valid_until = lease.clock() - 0.001
    return "done"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("expire", [False, True], ids=["lease-valid", "lease-ran-out"])
def test_a_newer_holders_token_is_the_fence_doing_its_job_not_a_clock_going_back(
    redis_client, events, expire
):
    """A row token ahead of ours by less than the time since our grant was granted after
    ours by the store's clock: a newer holder's (we paused past our lease, or sat on the
    minority side of a split). A plain LockLost, no ``fence_ahead`` (whose ERROR says the
    store's clock went back), whether or not our lease has run out by then."""
    BODY_RUNS.clear()
    newer = redis_now_us(redis_client) + 200_000  # granted 0.2 s after ours
    step = Step.objects.create(name="s", lock_fence=newer)
    result = paused_finish.apply(args=(step.pk,), kwargs={"pause": 0.5, "expire": expire})
    assert isinstance(result.result, LockLost), result.traceback
    assert not isinstance(result.result, FenceAhead)
    assert "a newer fencing token already wrote it" in str(result.result)
    assert BODY_RUNS == [step.pk]
    assert skew_events(events) == []
    step.refresh_from_db()
    assert step.status == "pending" and step.lock_fence == newer
    assert TransitionRecord.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_token_ahead_of_the_store_clock_is_fence_ahead_even_after_a_pause(redis_client, events):
    """A row token further ahead of ours than the time since our grant is ahead of the
    store's clock: FenceAhead, even when our lease ran out meanwhile (a retry would be
    refused again)."""
    BODY_RUNS.clear()
    ahead = redis_now_us(redis_client) + 60_000_000
    step = Step.objects.create(name="s", lock_fence=ahead)
    result = paused_finish.apply(args=(step.pk,), kwargs={"pause": 0.2, "expire": True})
    assert isinstance(result.result, FenceAhead), result.traceback
    assert 50 < result.result.skew <= 60
    assert len(skew_events(events)) == 1


@pytest.mark.django_db(transaction=True)
def test_a_row_fence_a_few_seconds_ahead_is_retried_a_bounded_number_of_times(
    redis_client, events
):
    """A skew below ``steplock_retry_backoff_max``: retried (after the skew, in a worker) at
    most FENCE_AHEAD_RETRY_MAX times; a retry whose new lease is still behind the row stops
    before the body. Eager retries run at once, so the store never catches up here."""
    BODY_RUNS.clear()
    step = Step.objects.create(name="s", lock_fence=redis_now_us(redis_client) + 30_000_000)
    result = skew_finish.apply(args=(step.pk,))
    assert isinstance(result.result, FenceAhead), result.traceback
    assert 20 < result.result.skew <= 30
    assert BODY_RUNS == [step.pk]
    assert len(skew_events(events)) == FENCE_AHEAD_RETRY_MAX + 1
    step.refresh_from_db()
    assert step.status == "pending"


@pytest.mark.django_db(transaction=True)
def test_the_retry_waits_out_the_skew(redis_client, monkeypatch):
    """The retry's countdown is at least the skew: by then the store grants a fence past the
    row's (its fences follow its clock)."""
    seen = {}

    def retry(self, exc, headers=None, countdown=None):
        seen.update(exc=exc, headers=headers, countdown=countdown)
        raise exc

    monkeypatch.setattr(StepLockedTask, "steplock_retry", retry)
    step = Step.objects.create(name="s", lock_fence=redis_now_us(redis_client) + 5_000_000)
    skew_finish.apply(args=(step.pk,))
    assert isinstance(seen["exc"], FenceAhead)
    assert seen["countdown"] >= seen["exc"].skew > 4
    assert seen["headers"] == {"steplock_fence_ahead": 1}


def test_the_signal_is_declared():
    assert signals.fence_ahead in signals.ALL_SIGNALS
