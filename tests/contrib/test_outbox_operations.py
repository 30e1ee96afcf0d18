"""The effects outbox for operators: its gauges and counters in a real scrape of the
Prometheus exporter (celery_steplock.contrib.prometheus), and the reaper's pass 3
(``manage.py reap_expired_leases``: relay, report, ``--no-effects``, ``--dry-run``). Rows are
made with the ORM; the relay sends to a registered callable and to a real HTTP receiver on
loopback."""

from __future__ import annotations

import datetime as dt
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections
from django.utils import timezone
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from celery_steplock import effects, signals
from celery_steplock.contrib import prometheus
from celery_steplock.contrib.django.models import Effect
from celery_steplock.events import emit
from celery_steplock.reaper import ReapReport
from tests.support.servers import free_port

pytestmark = pytest.mark.django_db(transaction=True)

CALL = "tests.outbox_operations.record"
RECEIVED: list[tuple[str, tuple, dict]] = []


@effects.register(CALL)
def record(*args, idempotency_key, **kwargs):
    RECEIVED.append((idempotency_key, args, kwargs))
    return f"recorded {idempotency_key}"


def make(n, *, status="pending", age=300.0, due=True, kind="call", target=CALL, **extra):
    """A row as the outbox writes it, ``age`` seconds old, due now (a process that died
    after COMMIT left it) or in an hour."""
    now = timezone.now()
    values = dict(
        key=f"workflows.step:{n}:3:done:0",
        step=f"workflows.step:{n}",
        fence=3,
        position=0,
        kind=kind,
        target=target,
        payload={"args": [n], "kwargs": {"n": n}},
        status=status,
        created_at=now - dt.timedelta(seconds=age),
        next_attempt_at=now + (dt.timedelta(seconds=-1) if due else dt.timedelta(hours=1)),
    )
    values.update(extra)
    return Effect.objects.create(**values)


# -- metrics ---------------------------------------------------------------------------------


@pytest.fixture
def exporter(app):
    """install() on a registry of its own, served over HTTP on loopback."""
    prometheus.uninstall()
    metrics = prometheus.install(registry=CollectorRegistry())
    port = free_port()
    server, thread = prometheus.serve(port)
    yield metrics, port
    server.shutdown()
    server.server_close()
    prometheus.uninstall()


def scrape(port):
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return text, samples


def test_scrape_reads_the_outbox_depth_and_age(exporter):
    metrics, port = exporter
    text, samples = scrape(port)
    assert samples[("steplock_effects_pending", ())] == 0.0
    assert samples[("steplock_effects_oldest_pending_seconds", ())] == 0.0
    make(1, age=120.0)
    make(2, age=30.0, due=False)
    make(3, status="dead", age=900.0)
    make(4, status="dispatched", age=1800.0)
    text, samples = scrape(port)
    assert "# TYPE steplock_effects_pending gauge" in text
    assert samples[("steplock_effects_pending", ())] == 2.0
    assert 120.0 <= samples[("steplock_effects_oldest_pending_seconds", ())] < 180.0
    Effect.objects.filter(step="workflows.step:1").update(status="dispatched")
    _, samples = scrape(port)
    assert samples[("steplock_effects_pending", ())] == 1.0
    assert 30.0 <= samples[("steplock_effects_oldest_pending_seconds", ())] < 90.0


def test_scrape_counts_the_effect_signals(exporter):
    metrics, port = exporter
    fields = dict(key="k", target="t", step="s", attempts=1, error=None)
    emit(signals.effect_dispatched, "celery_steplock.outbox", kind="http", **fields)
    emit(signals.effect_dispatched, "celery_steplock.outbox", kind="http", **fields)
    emit(signals.effect_retry, "celery_steplock.outbox", kind="task", countdown=1.0, **fields)
    emit(signals.effect_dead, "celery_steplock.outbox", kind="email", reason="permanent", **fields)
    _, samples = scrape(port)
    total = "steplock_effects_total"
    assert samples[(total, (("kind", "http"), ("result", "dispatched")))] == 2.0
    assert samples[(total, (("kind", "task"), ("result", "retry")))] == 1.0
    assert samples[(total, (("kind", "email"), ("result", "dead")))] == 1.0
    assert (total, (("kind", "http"), ("result", "dead"))) not in samples


def test_scrape_counts_the_overlap_guard_decisions(exporter):
    """steplock_overlap_total: one sample per task, policy and decision (the two signals)."""
    metrics, port = exporter
    fields = dict(task_name="beat.tick", task_id="t1", key="k", holder="h", follower=None)
    emit(signals.overlap_skipped, "beat.tick", policy="skip", reason="held", **fields)
    emit(signals.overlap_skipped, "beat.tick", policy="coalesce", reason="follower", **fields)
    emit(signals.overlap_skipped, "beat.tick", policy="coalesce", reason="follower", **fields)
    emit(signals.overlap_coalesced, "beat.tick", policy="coalesce", countdown=0.5, **fields)
    _, samples = scrape(port)
    total = "steplock_overlap_total"
    assert (
        samples[(total, (("decision", "skipped"), ("policy", "skip"), ("task", "beat.tick")))]
        == 1.0
    )
    assert (
        samples[(total, (("decision", "skipped"), ("policy", "coalesce"), ("task", "beat.tick")))]
        == 2.0
    )
    assert (
        samples[
            (total, (("decision", "coalesced"), ("policy", "coalesce"), ("task", "beat.tick")))
        ]
        == 1.0
    )


def test_a_scrape_thread_closes_the_connection_it_opened(app):
    """The exporter's threads are not Django requests: the collector closes what it opened,
    and leaves a connection it found open alone."""
    make(1)
    collector = prometheus.OutboxCollector()
    seen = {}

    def scrape_in_a_thread():
        families = collector.collect()
        seen["values"] = [f.samples[0].value for f in families]
        seen["closed"] = connections["default"].connection is None

    thread = threading.Thread(target=scrape_in_a_thread)
    thread.start()
    thread.join(30)
    assert seen == {"values": [1.0, pytest.approx(300.0, abs=60.0)], "closed": True}
    connections["default"].ensure_connection()
    collector.collect()
    assert connections["default"].connection is not None  # the test's own: left open


# -- the reaper's pass 3 ---------------------------------------------------------------------


class Receiver(BaseHTTPRequestHandler):
    """Answers the status in the path (``/200``, ``/503``, ``/400``); records the keys."""

    keys: list[tuple[str, str]] = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status = int(self.path.strip("/"))
        self.keys.append((self.path, self.headers.get("Idempotency-Key")))
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    Receiver.keys = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def http(n, url, **extra):
    payload = {"method": "POST", "headers": {}, "timeout": 5.0, "json": {"n": n}}
    return make(n, kind="http", target=url, payload=payload, **extra)


def reap_command(*args):
    out, err = StringIO(), StringIO()
    call_command("reap_expired_leases", *args, "--ping-timeout", "0.3", stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def left_behind(app, redis_client, receiver):
    RECEIVED.clear()
    rows = {
        "call": make(1, age=600.0),
        "ok": http(2, f"{receiver}/200", age=400.0),
        "busy": http(3, f"{receiver}/503", age=200.0),
        "refused": http(4, f"{receiver}/400", age=100.0),
        "fresh": make(5, age=2.0, due=False),  # its committing process still has it
    }
    return rows


def test_the_reaper_relays_what_dead_processes_left_and_reports_it(left_behind):
    rows = left_behind
    out, err = reap_command("--json")
    assert err == ""
    report = json.loads(out)
    assert report["ok"]
    effects_report = report["effects"]
    assert {k: effects_report[k] for k in ("relayed", "retried", "dead", "pending")} == {
        "relayed": 2,
        "retried": 1,
        "dead": 1,
        "pending": 2,  # the 503 waiting for its next attempt, and the fresh row
    }
    assert effects_report["skipped"] == []
    assert 200.0 <= effects_report["oldest_pending_seconds"] < 260.0  # the 503's row
    assert RECEIVED == [(rows["call"].key, (1,), {"n": 1})]
    assert sorted(Receiver.keys) == [
        ("/200", rows["ok"].key),
        ("/400", rows["refused"].key),
        ("/503", rows["busy"].key),
    ]
    status = dict(Effect.objects.values_list("key", "status"))
    assert status == {
        rows["call"].key: "dispatched",
        rows["ok"].key: "dispatched",
        rows["busy"].key: "pending",
        rows["refused"].key: "dead",
        rows["fresh"].key: "pending",
    }
    # The 503's next attempt is after a full-jitter backoff that may be under a second: put
    # it out of reach of the second run, which must relay nothing.
    Effect.objects.filter(key=rows["busy"].key).update(
        next_attempt_at=timezone.now() + dt.timedelta(hours=1)
    )
    # Human output: the one summary of both reap commands (ReapReport.human_lines).
    out, _ = reap_command()
    lines = out.splitlines()
    assert lines[:3] == ["leases scanned: 0", "leases reaped: 0", "steps recovered: 0"]
    assert lines[3].startswith("effects relayed: 0, retried: 0, dead: 0; still pending: 2 (")
    assert lines[4] == "errors: 0" and lines[5].startswith("duration: ")


def test_no_effects_and_dry_run(left_behind):
    rows = left_behind
    out, _ = reap_command("--json", "--no-effects")
    assert "effects" not in json.loads(out)
    out, _ = reap_command("--no-effects")
    assert "effects" not in out
    out, _ = reap_command("--json", "--dry-run")
    dry = json.loads(out)["effects"]
    assert (dry["relayed"], dry["retried"], dry["dead"], dry["pending"]) == (0, 0, 0, 5)
    assert 600.0 <= dry["oldest_pending_seconds"] < 660.0
    out, _ = reap_command("--dry-run")
    assert "effects pending: 5 (oldest 6" in out and "dry run: none relayed" in out
    assert RECEIVED == [] and Receiver.keys == []
    assert set(Effect.objects.values_list("status", flat=True)) == {"pending"}
    assert Effect.objects.get(pk=rows["call"].pk).attempts == 0


def test_the_effects_line_is_the_one_summary():
    report = ReapReport()
    assert report.effects_line() is None and "effects" not in report.as_dict()
    report.effects = {
        "relayed": 3,
        "retried": 1,
        "dead": 0,
        "pending": 2,
        "oldest_pending_seconds": 12.34,
        "skipped": ["replica"],
    }
    line = "effects relayed: 3, retried: 1, dead: 0; still pending: 2 (oldest 12.3s); databases skipped: replica"
    assert report.effects_line() == line
    assert line in report.summary_lines()  # what `celery steplock reap` prints
    assert report.as_dict()["effects"]["relayed"] == 3
    report.effects.update(pending=0, oldest_pending_seconds=None, skipped=[])
    report.dry_run = True
    assert report.effects_line() == "effects pending: 0; dry run: none relayed"


def test_without_django_settings_the_scrape_has_no_outbox_gauges(tmp_path):
    """Without a configured Django project the exporter scrapes as before: the outbox gauges
    are absent (the collector asks celery_steplock._django first; no database, no error)."""
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    code = (
        "from prometheus_client import CollectorRegistry, generate_latest\n"
        "from celery_steplock.contrib import prometheus\n"
        "metrics = prometheus.install(registry=CollectorRegistry())\n"
        "text = generate_latest(metrics.registry).decode()\n"
        "assert 'steplock_events_total' in text or 'steplock_effects_total' in text, text\n"
        "print('steplock_effects_pending' in text, 'steplock_effects_total' in text)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
    assert "metrics_effects_unavailable" not in done.stderr


def test_celery_steplock_reap_prints_the_same_summary(worker_env, app, receiver):
    """``celery steplock reap`` (another process, the project's Django settings): the same
    effects line, from ReapReport.summary_lines; ``--no-effects`` leaves the outbox alone."""
    import subprocess
    import sys

    def cli(*args):
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "reap", *args],
            env=worker_env,
            cwd=worker_env["PYTHONPATH"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    Receiver.keys = []
    row = http(1, f"{receiver}/200", age=90.0)
    skipped = cli("--no-effects", "--ping-timeout", "0.3")
    assert not [line for line in skipped if "effects" in line]
    assert Effect.objects.get(pk=row.pk).status == "pending" and Receiver.keys == []
    lines = cli("--ping-timeout", "0.3")
    assert "effects relayed: 1, retried: 0, dead: 0; still pending: 0" in lines
    assert Receiver.keys == [("/200", row.key)]
    assert Effect.objects.get(pk=row.pk).status == "dispatched"


def test_a_reap_inside_a_transaction_counts_the_effects_and_sends_none(left_behind, app):
    """reap() in a caller's atomic() block recovers steps there (the caller commits them);
    the relay's sends could not be undone by that transaction's rollback: it only counts,
    and the run is no error."""
    from django.db import transaction

    from celery_steplock.reaper import reap

    with transaction.atomic():
        report = reap(app, ping_timeout=0.3)
    assert report.ok and report.errors == []
    assert report.effects == {
        "relayed": 0,
        "retried": 0,
        "dead": 0,
        "pending": 5,
        "oldest_pending_seconds": pytest.approx(600.0, abs=60.0),
        "skipped": ["every database: reap() ran inside a transaction"],
    }
    assert RECEIVED == [] and Receiver.keys == []
    assert set(Effect.objects.values_list("status", flat=True)) == {"pending"}
