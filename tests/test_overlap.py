"""The overlap guard (task option ``overlap``, setting ``steplock_overlap``): the decisions of
skip, queue and coalesce with two executions at once on a real Redis, the coalesce follower
marker (its expiry, its compare-and-delete), and the options it refuses."""

from __future__ import annotations

import itertools
import logging
import threading
import time

import pytest
from celery import Celery
from helpers import wait_until

from celery_steplock import signals
from celery_steplock.exceptions import ImproperlyConfigured, LockContended
from celery_steplock.outcomes import (
    FOLLOWER_HEADER,
    claim_follower,
    clear_follower,
    overlap_key,
)
from celery_steplock.task import StepLockedTask
from celery_steplock.validate import problems

pytestmark = pytest.mark.no_database

_names = itertools.count()
NAME = "periodic"  # the tasks' lock_key: one lock name


@pytest.fixture
def make(redis_server_url, redis_client):
    """Factory: ``make(**options)`` -> (task, list of body runs ``(task id, start, end)``)
    on an app of its own; the body waits for ``gate`` (a threading.Event) when given one."""

    def build(app_conf=None, **options):
        app = Celery(f"overlap{next(_names)}", set_as_current=False)
        app.conf.update(
            broker_url=redis_server_url,
            steplock_redis_url=redis_server_url,
            steplock_key_prefix="ovt",
            steplock_default_ttl=2.0,
            **(app_conf or {}),
        )
        runs = []

        def body(self, gate=None):
            start = time.monotonic()
            if gate is not None:
                assert gate.wait(10)
            runs.append((self.request.id, start, time.monotonic()))
            return "ran"

        task = app.task(
            bind=True,
            base=StepLockedTask,
            name=f"overlap.task{next(_names)}",
            shared=False,
            lock_key=NAME,
            **options,
        )(body)
        return task, runs

    return build


@pytest.fixture
def seen():
    found = []

    def receiver(sender=None, signal=None, **kw):
        found.append((signal.name, kw))

    watched = (signals.overlap_skipped, signals.overlap_coalesced, signals.lock_contended)
    for sig in watched:
        sig.connect(receiver, weak=False)
    yield found
    for sig in watched:
        sig.disconnect(receiver)


class Running:
    """A first execution holding the lease in a thread of its own until ``finish()``."""

    def __init__(self, task, redis_client):
        self.gate = threading.Event()
        self.result = None
        self.task = task
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        key = task.steplock_plan.store.key(NAME)
        wait_until(lambda: redis_client.exists(key), timeout=10, what="the first run's lease")

    def _run(self):
        self.result = self.task.apply(kwargs={"gate": self.gate}, task_id="first")

    def finish(self):
        self.gate.set()
        self.thread.join(10)
        return self.result


def test_skip_a_send_during_a_run_ends_skipped(make, redis_client, seen):
    task, runs = make(overlap="skip")
    first = Running(task, redis_client)
    second = task.apply(task_id="second")
    assert second.state == "SUCCESS"
    assert second.result == {
        "steplock": "skipped",
        "task": task.name,
        "step_id": None,
        "expected": None,
        "found": None,
        "committed_by": None,
        "held_by": "first",
    }
    assert first.finish().result == "ran"
    assert [r[0] for r in runs] == ["first"]
    skipped = [kw for name, kw in seen if name == "overlap_skipped"]
    assert len(skipped) == 1
    assert (skipped[0]["policy"], skipped[0]["reason"], skipped[0]["holder"]) == (
        "skip",
        "held",
        "first",
    )
    assert skipped[0]["task_id"] == "second" and skipped[0]["follower"] is None
    # Once the run ended, the next send runs.
    assert task.apply(task_id="third").result == "ran"


def test_a_skipped_send_is_one_info_line_naming_the_overlap(make, redis_client, caplog):
    task, _runs = make(overlap="skip")
    first = Running(task, redis_client)
    with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
        task.apply(task_id="second")
    first.finish()
    ours = [r for r in caplog.records if getattr(r, "steplock", {}).get("task_id") == "second"]
    info = [r.steplock for r in ours if r.levelno >= logging.INFO]
    assert [(e["event"], e["outcome"], e["reason"]) for e in info] == [
        ("execution_done", "skipped", "overlap_held")
    ]
    assert [r.levelname for r in ours if r.steplock["event"] == "overlap_skipped"] == ["DEBUG"]


def test_queue_a_send_during_a_run_waits_its_turn(make, redis_client, seen):
    task, runs = make(overlap="queue")
    assert (task.steplock_plan.on_contended, task.steplock_plan.overlap) == ("retry", "queue")
    first = Running(task, redis_client)

    def end_the_first(sender=None, **kw):
        if kw.get("task_id") == "second":
            first.gate.set()
            wait_until(lambda: not redis_client.exists(kw["key"]), timeout=10, what="release")

    signals.lock_contended.connect(end_the_first, weak=False)
    try:
        second = task.apply(task_id="second")  # an eager lease retry after the release
    finally:
        signals.lock_contended.disconnect(end_the_first)
    first.finish()
    assert second.result == "ran"
    assert [r[0] for r in runs] == ["first", "second"]
    assert runs[1][1] >= runs[0][2]  # the second started after the first ended
    assert not [name for name, _ in seen if name.startswith("overlap_")]


def test_coalesce_one_follower_runs_after_the_run_others_skip(make, redis_client, seen):
    task, runs = make(overlap="coalesce")
    plan = task.steplock_plan
    assert (plan.on_contended, plan.wait, plan.overlap) == ("retry", 0.0, "coalesce")
    marker = overlap_key("ovt", NAME)
    first = Running(task, redis_client)
    during = {}

    def while_following(sender=None, **kw):
        # The second send is the follower now: a third send finds the marker taken.
        during["marker"] = redis_client.get(marker)
        during["pttl"] = redis_client.pttl(marker)
        third = threading.Thread(
            target=lambda: during.setdefault("third", task.apply(task_id="third"))
        )
        third.start()
        third.join(10)
        first.gate.set()
        wait_until(lambda: not redis_client.exists(kw["key"]), timeout=10, what="release")

    signals.overlap_coalesced.connect(while_following, weak=False)
    try:
        second = task.apply(task_id="second")
    finally:
        signals.overlap_coalesced.disconnect(while_following)
    assert first.finish().result == "ran"
    assert during["marker"] == "second"
    assert 0 < during["pttl"] <= (2.0 + 2.0) * 1000  # countdown (<= lease TTL) + lease TTL
    assert during["third"].result["steplock"] == "skipped"
    assert during["third"].result["held_by"] == "first"
    assert second.result == "ran"
    assert [r[0] for r in runs] == ["first", "second"]
    assert runs[1][1] >= runs[0][2]
    assert redis_client.exists(marker) == 0  # the follower deleted its marker once it ran
    coalesced = [kw for name, kw in seen if name == "overlap_coalesced"]
    skipped = [kw for name, kw in seen if name == "overlap_skipped"]
    assert [(kw["task_id"], kw["follower"], kw["holder"]) for kw in coalesced] == [
        ("second", "second", "first")
    ]
    assert [(kw["task_id"], kw["reason"], kw["follower"]) for kw in skipped] == [
        ("third", "follower", "second")
    ]


def test_coalesce_follower_out_of_retries_gives_the_marker_back(make, redis_client):
    task, runs = make(overlap="coalesce", lock_retry_max=1)
    marker = overlap_key("ovt", NAME)
    store = task.steplock_plan.store
    store.acquire(NAME, "holder", 10.0)
    result = task.apply(task_id="follower")
    assert isinstance(result.result, LockContended)
    assert runs == []
    assert redis_client.exists(marker) == 0


def test_follower_marker_claim_refresh_expiry_and_compare_and_delete(make, redis_client):
    task, _ = make(overlap="coalesce")
    store = task.steplock_plan.store
    marker = overlap_key("ovt", NAME)
    assert marker == "ovt:overlap:{periodic}"
    assert claim_follower(store, NAME, "a", 0.3) == (1, None)
    assert claim_follower(store, NAME, "b", 5.0) == (0, "a")  # taken: nothing written
    assert 0 < redis_client.pttl(marker) <= 300
    assert claim_follower(store, NAME, "a", 5.0) == (2, "a")  # refreshed
    assert redis_client.pttl(marker) > 4000
    assert clear_follower(store, NAME, "b") is False  # not b's: kept
    assert redis_client.get(marker) == "a"
    assert clear_follower(store, NAME, "a") is True
    assert redis_client.exists(marker) == 0
    # A follower that died: its marker expires, and the next send becomes the follower.
    assert claim_follower(store, NAME, "dead", 0.2) == (1, None)
    assert claim_follower(store, NAME, "next", 5.0) == (0, "dead")
    time.sleep(0.3)
    assert claim_follower(store, NAME, "next", 5.0) == (1, None)
    assert redis_client.get(marker) == "next"


def test_a_follower_whose_marker_another_send_took_is_skipped(make, redis_client):
    task, runs = make(overlap="coalesce")
    store = task.steplock_plan.store
    store.acquire(NAME, "holder", 10.0)
    claim_follower(store, NAME, "newer", 5.0)  # this send's marker expired; another took it
    result = task.apply(task_id="old", headers={FOLLOWER_HEADER: 1, "steplock_retries": 1})
    assert result.result["steplock"] == "skipped"
    assert redis_client.get(overlap_key("ovt", NAME)) == "newer"
    assert runs == []


def test_options_that_contradict_the_policy_are_refused_by_name(make):
    for options, words in (
        ({"overlap": "skip", "on_contended": "raise"}, "on_contended='raise'"),
        ({"overlap": "skip", "lock_wait": 2.0}, "lock_wait=2.0"),
        ({"overlap": "coalesce", "lock_wait": 1}, "lock_wait=1"),
        ({"overlap": "coalesce", "on_contended": "skip"}, "on_contended='skip'"),
        ({"overlap": "queue", "on_contended": "ignore"}, "on_contended='ignore'"),
    ):
        task, _ = make(**options)
        with pytest.raises(ImproperlyConfigured) as caught:
            task.steplock_plan
        assert caught.value.setting == "overlap"
        assert words in str(caught.value) and task.name in str(caught.value)
        found = [p for p in problems(task.app) if p.id == "celery_steplock.E004"]
        assert [p.obj for p in found] == [task.name]
        assert "overlap=" in found[0].message and words in found[0].message
    task, _ = make(overlap="often")
    with pytest.raises(ImproperlyConfigured, match="'skip', 'coalesce', 'queue'"):
        task.steplock_plan
    # Consistent ones: queue may wait; skip with its own on_contended.
    task, _ = make(overlap="queue", lock_wait=2.0)
    assert (task.steplock_plan.wait, task.steplock_plan.on_contended) == (2.0, "retry")
    task, _ = make(overlap="skip", on_contended="skip", lock_wait=0)
    assert (task.steplock_plan.wait, task.steplock_plan.on_contended) == (0.0, "skip")


def test_the_setting_is_the_default_and_task_options_win_over_it(make):
    task, _ = make(app_conf={"steplock_overlap": "coalesce", "steplock_lock_wait": 3.0})
    plan = task.steplock_plan
    assert (plan.overlap, plan.on_contended, plan.wait) == ("coalesce", "retry", 0.0)
    task, _ = make(app_conf={"steplock_overlap": "skip"}, on_contended="raise")
    plan = task.steplock_plan
    assert (plan.overlap, plan.on_contended) == (None, "raise")  # the task's own option
    task, _ = make(app_conf={"steplock_overlap": "skip"}, overlap="queue")
    assert task.steplock_plan.overlap == "queue"
    task, _ = make()
    assert (task.steplock_plan.overlap, task.steplock_plan.on_contended) == (None, "retry")
    task, _ = make(app_conf={"steplock_overlap": "always"})
    found = [p for p in problems(task.app) if p.id == "celery_steplock.E003"]
    assert [p.obj for p in found] == ["steplock_overlap"]
