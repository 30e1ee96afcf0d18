"""celery_steplock.contrib.prometheus: metrics from the signals, in this process (apply()) and
scraped over HTTP from a real prefork worker in Prometheus multiprocess mode."""

import os
import threading
import urllib.request
import warnings

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from celery_steplock import signals
from celery_steplock.contrib import prometheus
from celery_steplock.contrib.django import outbox
from celery_steplock.events import emit
from celery_steplock.exceptions import LockContended
from celery_steplock.lock import get_lease_store
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance, hold
from tests.support import ROOT, servers
from tests.support.servers import free_port
from helpers import drained, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "tests.prometheus.finish"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name=TASK,
    lock_key="step:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
)
def finish(self, step_id):
    metrics = prometheus.install()
    return metrics.registry.get_sample_value("steplock_leases_held", {"task": TASK})


@pytest.fixture
def metrics(app, redis_client):
    prometheus.uninstall()
    metrics = prometheus.install(registry=CollectorRegistry())
    yield metrics
    prometheus.uninstall()


def value(metrics, name, **labels):
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_counters_histograms_and_the_gauge_follow_real_executions(metrics):
    first, second = Step.objects.create(name="a"), Step.objects.create(name="b")
    assert finish.apply(args=(first.pk,)).result == 1.0  # the gauge, read inside the body
    assert finish.apply(args=(second.pk,)).successful()
    finish.apply(args=(first.pk,))  # already done: a conflict, the body skipped
    busy = Step.objects.create(name="busy")
    store = get_lease_store(celery_app)
    other = store.acquire(f"step:{busy.pk}", "someone-else", 30.0)
    try:
        result = finish.apply(args=(busy.pk,))
    finally:
        store.release(other.name, other.owner)
    assert isinstance(result.result, LockContended)

    events = {
        e: value(metrics, "steplock_events_total", event=e, task=TASK)
        for e in (
            "lock_acquired",
            "lock_released",
            "transition_applied",
            "transition_conflict",
            "lock_contended",
            "lock_lost",
        )
    }
    assert events == {
        "lock_acquired": 3,
        "lock_released": 3,
        "transition_applied": 2,
        "transition_conflict": 1,
        "lock_contended": 1,
        "lock_lost": 0,
    }
    outcomes = {
        o: value(metrics, "steplock_outcomes_total", task=TASK, outcome=o)
        for o in ("committed", "conflict", "contended", "lost")
    }
    assert outcomes == {"committed": 2, "conflict": 1, "contended": 1, "lost": 0}
    counts = {
        h: value(metrics, f"steplock_{h}_seconds_count", task=TASK)
        for h in ("wait", "hold", "cas", "commit")
    }
    assert counts == {"wait": 4, "hold": 3, "cas": 2, "commit": 2}
    for h in ("wait", "hold", "cas", "commit"):
        assert value(metrics, f"steplock_{h}_seconds_sum", task=TASK) > 0, h
    assert value(metrics, "steplock_leases_held", task=TASK) == 0


def test_the_gauge_counts_each_of_its_own_leases_once(metrics):
    lease = {
        "key": "steplock:lease:x",
        "name": "x",
        "owner": "o1",
        "fence": 1,
        "task_id": "t",
        "task_name": TASK,
        "ttl": 3.0,
    }
    emit(signals.lock_acquired, None, **lease)
    emit(signals.lock_acquired, None, **dict(lease, key="steplock:lease:y", owner="o2"))
    assert value(metrics, "steplock_leases_held", task=TASK) == 2
    emit(signals.lock_lost, None, reason="max hold", **lease)
    emit(signals.lock_released, None, forced=False, **lease)  # lost, then released: once
    assert value(metrics, "steplock_leases_held", task=TASK) == 1
    # An operator's release of a lease this process never held changes nothing here.
    emit(signals.lock_released, None, forced=True, **dict(lease, owner="elsewhere"))
    assert value(metrics, "steplock_leases_held", task=TASK) == 1
    assert value(metrics, "steplock_outcomes_total", task=TASK, outcome="force_released") == 1
    assert value(metrics, "steplock_outcomes_total", task=TASK, outcome="lost") == 1


def test_nothing_is_measured_before_install():
    prometheus.uninstall()
    before = {s: len(s.receivers) for s in signals.ALL_SIGNALS}
    metrics = prometheus.install(registry=CollectorRegistry())
    try:
        assert all(len(s.receivers) == before[s] + 1 for s in signals.ALL_SIGNALS)
        assert prometheus.install() is metrics
    finally:
        prometheus.uninstall()
    assert {s: len(s.receivers) for s in signals.ALL_SIGNALS} == before
    with pytest.raises(ValueError):
        prometheus.install(port=70000)


def test_a_file_not_yet_sized_by_a_starting_process_does_not_fail_the_scrape(tmp_path):
    """A new prefork child creates its file empty and sizes it a moment later; the stock
    collector fails the whole scrape on it (struct.error: HTTP 500), ours leaves it out."""
    import struct

    from prometheus_client import generate_latest
    from prometheus_client import multiprocess as stock
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(
        mmap_key(
            "steplock_events",
            "steplock_events_total",
            ["event", "task"],
            ["lock_acquired", "t"],
            "help",
        ),
        3.0,
        0.0,
    )
    written.close()
    (tmp_path / "counter_102.db").touch()  # created, not yet sized
    registry = CollectorRegistry()
    prometheus.MultiProcessCollector(registry, path=str(tmp_path))
    assert (
        registry.get_sample_value("steplock_events_total", {"event": "lock_acquired", "task": "t"})
        == 3.0
    )
    assert b"steplock_events_total" in generate_latest(registry)
    broken = CollectorRegistry()
    stock.MultiProcessCollector(broken, path=str(tmp_path))
    with pytest.raises(struct.error):
        generate_latest(broken)


def test_a_worker_that_loses_the_bind_to_a_sibling_starting_with_it_names_the_sibling(
    tmp_path, monkeypatch, caplog
):
    """Two workers of one host start together: the one whose bind fails may look for the
    sibling's marker before the sibling, which bound first, has written it. It waits for
    the marker (up to MARKER_WAIT) rather than report another program on the port."""
    import socket
    import subprocess
    import sys

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    standbys = []
    monkeypatch.setattr(prometheus, "_standby", lambda port, addr: standbys.append(port))
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        marker = threading.Timer(
            0.3,
            lambda: (tmp_path / f"exporter-{port}.pid").write_text(str(sibling.pid)),
        )
        marker.start()
        with caplog.at_level("INFO", logger="celery_steplock"):
            assert prometheus._export(port, "127.0.0.1", standby=False) is False
        marker.join()
        events = [getattr(r, "steplock", {}) for r in caplog.records]
        assert [(e["event"], e["sibling"]) for e in events if "sibling" in e] == [
            ("metrics_served_by_sibling", sibling.pid)
        ]
        assert not [e for e in events if e.get("event") == "metrics_address_in_use"]
        assert standbys == [port]

        # No marker at all: another program holds the port, said after MARKER_WAIT.
        (tmp_path / f"exporter-{port}.pid").unlink()
        monkeypatch.setattr(prometheus, "MARKER_WAIT", 0.2)
        caplog.clear()
        with caplog.at_level("INFO", logger="celery_steplock"):
            assert prometheus._export(port, "127.0.0.1", standby=False) is False
        assert [getattr(r, "steplock", {}).get("event") for r in caplog.records] == [
            "metrics_address_in_use"
        ]
    finally:
        taken.close()
        sibling.kill()
        sibling.wait()


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return text, samples


def sample(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.workers
# Every database: the scrape reads the effects outbox from the step database in the worker's
# main process while it forks children (a child forked mid-read hung on MariaDB).
def test_scrape_of_a_prefork_worker_in_multiprocess_mode(worker_env, redis_client, tmp_path):
    """Two prefork children that are replaced after every task (--max-tasks-per-child 1):
    counters of exited children still count, the gauge counts live processes only, and an
    exited child's gauge files are gone."""
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    port = free_port()
    worker = servers.celery_worker(
        app="tests.support.prometheus_app",
        name="metrics",
        concurrency=2,
        env={
            **worker_env,
            "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
            "STEPLOCK_METRICS_PORT": str(port),
        },
        logfile=tmp_path / "metrics.log",
        extra_args=("--max-tasks-per-child", "1"),
        cwd=ROOT,
    )
    try:
        steps = [Step.objects.create(name=f"s{i}") for i in range(3)]
        for step in steps:
            advance.delay(step.pk, delay=0.2)
        wait_until(
            lambda: Step.objects.filter(status="done").count() == 3 and drained(redis_client),
            timeout=60,
            what="three steps done",
        )
        advance.delay(steps[0].pk)  # a duplicate: the step is done, a conflict
        hold.delay(steps[1].pk, 3.0)
        wait_until(
            lambda: redis_client.exists(f"steplock:lease:{{step:{steps[1].pk}}}"),
            timeout=30,
            what="the hold task's lease",
        )
        wait_until(
            lambda: sample(scrape(port)[1], "steplock_leases_held", task=hold.name) == 1,
            timeout=10,
            what="the gauge to show the held lease",
        )
        adv = advance.name
        wait_until(
            lambda: (
                drained(redis_client)
                and sample(
                    scrape(port)[1], "steplock_events_total", event="transition_conflict", task=adv
                )
                == 1
                and sample(
                    scrape(port)[1], "steplock_events_total", event="lock_released", task=hold.name
                )
                == 1
            ),
            # Generous: a child is replaced after each task, and a busy machine forks slowly;
            # the time is the machine's, the counts are the test's.
            timeout=90,
            what="every event in the scrape",
            describe=lambda: (
                f"queue drained: {drained(redis_client)}; "
                + "; ".join(
                    line
                    for line in scrape(port)[0].splitlines()
                    if line.startswith("steplock_events_total")
                )
            ),
        )
        text, samples = scrape(port)
        (tmp_path / "metrics.txt").write_text(text)
        print(
            "\n"
            + "\n".join(
                line
                for line in text.splitlines()
                if line.startswith("steplock_") and "_bucket" not in line
            )
        )
        assert {
            e: sample(samples, "steplock_events_total", event=e, task=adv)
            for e in (
                "lock_acquired",
                "transition_applied",
                "transition_conflict",
                "lock_released",
                "lock_contended",
                "lock_lost",
            )
        } == {
            "lock_acquired": 4,
            "transition_applied": 3,
            "transition_conflict": 1,
            "lock_released": 4,
            "lock_contended": 0,
            "lock_lost": 0,
        }
        assert sample(samples, "steplock_outcomes_total", task=adv, outcome="committed") == 3
        assert sample(samples, "steplock_outcomes_total", task=adv, outcome="conflict") == 1
        assert {
            h: sample(samples, f"steplock_{h}_seconds_count", task=adv)
            for h in ("wait", "hold", "cas", "commit")
        } == {"wait": 4, "hold": 4, "cas": 3, "commit": 3}
        assert sample(samples, "steplock_hold_seconds_sum", task=adv) >= 3 * 0.2
        assert sample(samples, "steplock_hold_seconds_sum", task=hold.name) >= 3.0
        assert sample(samples, "steplock_leases_held", task=adv) == 0
        assert sample(samples, "steplock_leases_held", task=hold.name) == 0
        # Five tasks, one per child: at least five processes wrote counters ...
        counter_pids = {p.stem.rsplit("_", 1)[1] for p in multiproc.glob("counter_*.db")}
        assert len(counter_pids) >= 5
        # ... and the live gauge files are those of running processes only.
        wait_until(
            lambda: all(
                os.path.exists(f"/proc/{p.stem.rsplit('_', 1)[1]}")
                for p in multiproc.glob("gauge_livesum_*.db")
            ),
            timeout=10,
            what="exited children's gauge files removed",
        )
    finally:
        worker.terminate()


@pytest.mark.workers
def test_a_sigkilled_childs_held_lease_leaves_the_gauge(worker_env, redis_client, tmp_path):
    """A child SIGKILLed while it holds a lease runs no worker_process_shutdown: its gauge
    file stays, with "1 lease held", and the scrape leaves it out because its pid is gone."""
    from celery_steplock.lock import unpack_fields
    from helpers import lease_key

    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    port = free_port()
    worker = servers.celery_worker(
        app="tests.support.prometheus_app",
        name="killed",
        concurrency=1,
        # A 30 s TTL: the redelivered message cannot take the dead child's lease (and
        # set the gauge again) before the scrapes below.
        env={
            **worker_env,
            "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
            "STEPLOCK_METRICS_PORT": str(port),
            "STEPLOCK_TTL": "30",
        },
        logfile=tmp_path / "killed.log",
        cwd=ROOT,
    )
    try:
        step = Step.objects.create(name="kill")
        hold.apply_async((step.pk, 60))
        holder = wait_until(
            lambda: unpack_fields(redis_client.hgetall(lease_key(step))),
            timeout=30,
            what="the lease to be taken",
        )
        pid = int(holder["pid"])
        wait_until(
            lambda: sample(scrape(port)[1], "steplock_leases_held", task=hold.name) == 1,
            timeout=10,
            what="the gauge at 1",
        )
        os.kill(pid, 9)
        wait_until(
            lambda: not os.path.exists(f"/proc/{pid}"), timeout=10, what="the child to be gone"
        )
        stale = multiproc / f"gauge_livesum_{pid}.db"
        assert stale.exists()  # nothing removed it: the child never ran its shutdown
        assert sample(scrape(port)[1], "steplock_leases_held", task=hold.name) == 0
        assert (
            sample(scrape(port)[1], "steplock_events_total", event="lock_acquired", task=hold.name)
            == 1
        )  # the dead child's counters still count
        assert (
            unpack_fields(redis_client.hgetall(lease_key(step)))["owner"] == holder["owner"]
        )  # still the dead child's lease: nobody else took it meanwhile
    finally:
        worker.kill()


_FORKING_WATCHED, _FORKING = threading.Event(), threading.Event()
os.register_at_fork(before=lambda: _FORKING.set() if _FORKING_WATCHED.is_set() else None)


def test_a_fork_waits_for_a_scrape_reading_the_database(monkeypatch):
    """A prefork worker's main process forks children while its exporter thread scrapes: a
    child forked in the middle of the outbox read would inherit that thread's import lock or
    database socket, held for ever (a replacement child hung in Django's lazy import of the
    MySQL compiler). The fork waits for the read; nothing in the child is half done."""
    in_read, release = threading.Event(), threading.Event()
    order = []

    def slow_stats():
        in_read.set()
        release.wait(30)
        order.append("read done")
        return 0, None

    monkeypatch.setattr(outbox, "pending_stats", slow_stats)
    scrape = threading.Thread(target=prometheus.OutboxCollector().collect)
    scrape.start()
    assert in_read.wait(10)

    def release_once_the_fork_started():
        _FORKING.wait(30)  # our at-fork hook runs before the gate's (reverse order)
        order.append("fork not returned" if not forked.is_set() else "fork returned")
        release.set()

    forked = threading.Event()
    releaser = threading.Thread(target=release_once_the_fork_started)
    releaser.start()
    _FORKING_WATCHED.set()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
            pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked.set()
    finally:
        _FORKING_WATCHED.clear()
        _FORKING.clear()
    order.append("forked")
    assert os.waitpid(pid, 0)[1] == 0
    releaser.join(10)
    scrape.join(10)
    assert order == ["fork not returned", "read done", "forked"]


def _fork_and_report(child_check) -> int:
    """Fork; the child exits with ``child_check()`` (0 or 1); the child's exit code."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:
        os._exit(child_check())
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_scrape_that_hangs_delays_one_fork_and_the_child_starts_with_a_free_gate():
    """A scrape stuck past FORK_WAIT (a database that never answers): the fork goes ahead,
    later forks do not wait for that scrape again, and each child has a gate of its own
    (the parent's is held by a thread the child does not have)."""
    gate = prometheus._FORK_GATE
    inside, release = threading.Event(), threading.Event()

    def stuck_scrape():
        with gate.scraping():
            inside.set()
            release.wait(30)

    scrape = threading.Thread(target=stuck_scrape)
    scrape.start()
    try:
        assert inside.wait(10)
        free_in_child = lambda: 0 if prometheus._FORK_GATE._lock.acquire(blocking=False) else 1  # noqa: E731
        assert _fork_and_report(free_in_child) == 0
        assert gate._given_up  # the first fork waited FORK_WAIT and gave up on this scrape
        assert _fork_and_report(free_in_child) == 0
    finally:
        release.set()
        scrape.join(10)
    assert not gate._given_up  # the scrape ended: the next one is waited for again
    assert gate._lock.acquire(blocking=False)
    gate._lock.release()


def test_a_fork_from_inside_a_scrape_does_not_wait_on_itself():
    """A collector that forks (a subprocess with preexec_fn, multiprocessing's fork) holds the
    gate in the forking thread: the fork takes it again at once (re-entrant)."""
    gate = prometheus._FORK_GATE
    with gate.scraping():
        assert _fork_and_report(lambda: 0) == 0
        assert not gate._given_up  # it never waited
        with gate.scraping():  # a scrape inside a scrape: no deadlock
            pass
