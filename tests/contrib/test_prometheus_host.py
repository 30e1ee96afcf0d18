"""celery_steplock.contrib.prometheus on one host without configuration: several real workers
with ``install(port=P)`` and no ``PROMETHEUS_MULTIPROC_DIR`` share the library's default
directory, one of them serves every worker's metrics at the one ``/metrics`` (the others log
that a sibling serves it, no traceback, and take over when it stops), a new run starts from an
emptied directory, and the Django view serves the same metrics to staff or a bearer token.

Each worker's ``TMPDIR`` is the test's own, so the default directory
(``<tempdir>/celery-steplock-prometheus-<uid>``) is private to the test."""

import os
import re
import subprocess
import sys
import urllib.request

import pytest
from django.test import Client, override_settings
from django.urls import path
from prometheus_client import CollectorRegistry
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from celery_steplock import signals
from celery_steplock.contrib import prometheus
from celery_steplock.contrib.django.metrics import metrics_view
from celery_steplock.events import emit
from django_app.workflows.tasks import hold
from tests.support import ROOT, servers
from tests.support.servers import free_port
from helpers import wait_until

TOKEN = "s3cret-scrape-token"

urlpatterns = [
    path("metrics", metrics_view, name="metrics-staff"),
    path("scrape", metrics_view, {"bearer_token": TOKEN}, name="metrics-token"),
]


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples_of(response.read().decode())


def samples_of(text):
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def acquired(samples, task=hold.name):
    key = ("steplock_events_total", (("event", "lock_acquired"), ("task", task)))
    return samples.get(key, 0.0)


@pytest.fixture
def host(worker_env, tmp_path):
    """``start(name, queue)`` -> a prefork worker of ``tests.support.prometheus_app``
    consuming ``queue``, on the test's one metrics port, with the test's ``TMPDIR`` and
    no ``PROMETHEUS_MULTIPROC_DIR``; ``.dir`` is the default directory they share."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = free_port()
    env = {k: v for k, v in worker_env.items() if k.lower() != "prometheus_multiproc_dir"}
    env.update(TMPDIR=str(tmp), STEPLOCK_METRICS_PORT=str(port), STEPLOCK_LOG_LEVEL="INFO")
    started = []

    class Host:
        dir = tmp / f"celery-steplock-prometheus-{os.getuid()}"

        def start(self, name, queue, wait=True):
            worker = servers.celery_worker(
                app="tests.support.prometheus_app",
                name=name,
                concurrency=1,
                env=env,
                logfile=tmp_path / f"{name}-{len(started)}.log",
                extra_args=("-Q", queue),
                cwd=ROOT,
                wait=wait,
            )
            started.append(worker)
            return worker

    Host.port = port
    yield Host()
    for worker in started:
        worker.kill()


def run(queue, count, first=0):
    for i in range(first, first + count):
        hold.apply_async((1000 + i, 0.01), queue=queue)


def served_by(*workers):
    line = re.compile(r"event=metrics_served url=http://127\.0\.0\.1:(\d+)/metrics")
    return [w for w in workers if line.search(w.log_text())]


@pytest.mark.workers
@pytest.mark.db_incidental
def test_two_workers_on_one_host_one_exporter_serves_both(host, redis_client, monkeypatch):
    first = host.start("one", "q1", wait=False)
    second = host.start("two", "q2", wait=False)
    first.wait_ready()
    second.wait_ready()
    run("q1", 2)
    run("q2", 3, first=10)
    wait_until(lambda: acquired(scrape(host.port)) == 5, timeout=60, what="five acquisitions")
    with urllib.request.urlopen(f"http://127.0.0.1:{host.port}/metrics", timeout=10) as r:
        text = r.read().decode()
    print("\n" + "\n".join(line for line in text.splitlines() if line.startswith("steplock_")))
    # q1 reaches the first worker only, q2 the second: 5 is 2 of one and 3 of the other.
    # Both workers' children wrote files of the one directory the exporter reads.
    pids = {int(p.stem.rsplit("_", 1)[1]) for p in host.dir.glob("counter_*.db")}
    assert pids & set(first.group_pids()) and pids & set(second.group_pids()), pids

    (server,) = served_by(first, second)
    other = second if server is first else first
    assert f"url=http://127.0.0.1:{host.port}/metrics" in server.log_text()
    wait_until(
        lambda: "event=metrics_served_by_sibling" in other.log_text(),
        timeout=10,
        what="the sibling's line",
    )
    assert f"sibling={server.pid}" in other.log_text()
    for worker in (first, second):
        assert "Traceback" not in worker.log_text()
        assert "Address already in use" not in worker.log_text()

    # The web process's view reads the same directory: the same sums.
    from django.contrib.auth import get_user_model

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(host.dir))
    staff = get_user_model().objects.create_user("ops", password="x", is_staff=True)
    client = Client()
    client.force_login(staff)
    with override_settings(ROOT_URLCONF=__name__):
        response = client.get("/metrics")
    assert response.status_code == 200
    assert acquired(samples_of(response.content.decode())) == 5

    # The serving worker stops: the sibling takes the address over, with every count
    # (the stopped worker's files stay while a sibling runs).
    server.terminate()
    wait_until(
        lambda: "took_over=True" in other.log_text(),
        timeout=prometheus.STANDBY_INTERVAL + 20,
        what="the sibling to take the address over",
    )
    assert acquired(scrape(host.port)) == 5
    run("q1" if other is first else "q2", 1, first=20)
    wait_until(lambda: acquired(scrape(host.port)) == 6, timeout=30, what="one more")


@pytest.mark.workers
@pytest.mark.db_incidental
def test_a_new_run_starts_empty_and_a_sibling_drops_dead_pids_gauges(host, redis_client):
    first = host.start("one", "q1")
    run("q1", 2)
    wait_until(lambda: acquired(scrape(host.port)) == 2, timeout=60, what="two acquisitions")

    # A live gauge file of a process that is gone (SIGKILLed, its pid to be reused) with
    # one lease held, and a counter of that process.
    dead = subprocess.Popen(["true"])
    dead.wait()
    for kind, metric, name, value in (
        ("gauge_livesum", "steplock_leases_held", "steplock_leases_held", 1.0),
        ("counter", "steplock_events", "steplock_events_total", 7.0),
    ):
        labels = (
            (["task"], ["stale"])
            if kind != "counter"
            else (
                ["event", "task"],
                ["lock_acquired", "stale"],
            )
        )
        mmap = MmapedDict(str(host.dir / f"{kind}_{dead.pid}.db"))
        mmap.write_value(mmap_key(metric, name, *labels, "help"), value, 0.0)
        mmap.close()
    # A sibling starts while the first runs: the dead pid's live gauge goes, counters stay
    # (a sum that went down would read as a counter reset).
    second = host.start("two", "q2")
    assert not (host.dir / f"gauge_livesum_{dead.pid}.db").exists()
    assert (host.dir / f"counter_{dead.pid}.db").exists()
    samples = scrape(host.port)
    assert acquired(samples) == 2
    assert acquired(samples, task="stale") == 7.0

    # Every worker stops; the next start is a new run: the previous run's files are gone
    # and nothing of it is counted again.
    first.terminate()
    second.terminate()
    again = host.start("three", "q1")
    assert sorted(p.name for p in host.dir.glob("*.db")) == []
    run("q1", 1, first=30)
    wait_until(lambda: acquired(scrape(host.port)) == 1, timeout=60, what="one acquisition")
    samples = scrape(host.port)
    assert acquired(samples, task="stale") == 0.0
    assert "event=metrics_served url=" in again.log_text()


@pytest.mark.db_incidental
@override_settings(ROOT_URLCONF=__name__)
def test_the_django_view_serves_staff_and_the_token_and_refuses_others(
    django_user_model, monkeypatch
):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    prometheus.uninstall()
    metrics = prometheus.install(registry=CollectorRegistry())
    try:
        emit(signals.lock_acquired, None, key="k", owner="o", fence=1, task_name="t.view")
        line = 'steplock_events_total{event="lock_acquired",task="t.view"} 1.0'

        anonymous = Client().get("/metrics")
        assert anonymous.status_code == 401
        assert line not in anonymous.content.decode()

        user = django_user_model.objects.create_user("user", password="x")
        client = Client()
        client.force_login(user)
        assert client.get("/metrics").status_code == 403

        staff = django_user_model.objects.create_user("staff", password="x", is_staff=True)
        client.force_login(staff)
        response = client.get("/metrics")
        assert response.status_code == 200
        assert line in response.content.decode()
        assert response["Content-Type"].startswith("text/plain")
        assert client.post("/metrics").status_code == 405

        scraper = Client()
        assert scraper.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 403
        refused = scraper.get("/scrape")
        assert refused.status_code == 401
        assert refused["WWW-Authenticate"].startswith("Bearer")
        assert scraper.get("/scrape", HTTP_AUTHORIZATION="Bearer nope").status_code == 403
        served = scraper.get("/scrape", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
        assert served.status_code == 200
        assert line in served.content.decode()
        openmetrics = scraper.get(
            "/scrape",
            HTTP_AUTHORIZATION=f"Bearer {TOKEN}",
            HTTP_ACCEPT="application/openmetrics-text; version=1.0.0",
        )
        assert openmetrics["Content-Type"].startswith("application/openmetrics-text")
        assert openmetrics.content.decode().rstrip().endswith("# EOF")
        assert metrics.registry is prometheus.scrape_registry()
    finally:
        prometheus.uninstall()


# -- a directory other programs (or an attacker) write -----------------------------------------


@pytest.mark.no_database
def test_files_that_are_not_prometheus_client_s_never_fail_the_scrape(tmp_path):
    """The directory may hold other programs' files: a name prometheus_client never writes
    (``gauge.db``: no mode, no pid) and a file that cannot be read are left out; the other
    files' samples are served."""
    (tmp_path / "gauge.db").write_bytes(b"\x00" * 16)
    (tmp_path / "notes_1.db").write_bytes(b"\x00" * 16)
    (tmp_path / "counter_2.db").write_bytes(b"\xff" * 64)  # used-bytes header past the end
    mmap = MmapedDict(str(tmp_path / "counter_3.db"))
    key = mmap_key("steplock_events", "steplock_events_total", ["event"], ["x"], "help")
    mmap.write_value(key, 5.0, 0.0)
    mmap.close()
    collector = prometheus.MultiProcessCollector(None, path=str(tmp_path))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in collector.collect()
        for s in metric.samples
    }
    assert samples == {("steplock_events_total", (("event", "x"),)): 5.0}


PROBE = "from celery_steplock.contrib import prometheus as p; print(repr(p._multiprocess_mode()))"


def _default_dir_probe(tmp):
    env = {k: v for k, v in os.environ.items() if "multiproc" not in k.lower()}
    env["TMPDIR"] = str(tmp)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, cwd=ROOT
    )
    return out.stdout.strip(), out.stderr


@pytest.mark.no_database
def test_a_symlink_at_the_default_directory_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (target / "counter_1.db").write_text("keep me")
    os.symlink(target, tmp_path / f"celery-steplock-prometheus-{os.getuid()}")
    stdout, err = _default_dir_probe(tmp_path)
    assert stdout == "None", err
    assert sorted(os.listdir(target)) == ["counter_1.db"]


@pytest.mark.no_database
def test_a_world_writable_default_directory_is_refused_and_kept(tmp_path):
    path = tmp_path / f"celery-steplock-prometheus-{os.getuid()}"
    path.mkdir()
    os.chmod(path, 0o777)
    (path / "counter_1.db").write_text("keep me")
    stdout, err = _default_dir_probe(tmp_path)
    assert stdout == "None", err
    assert (path / "counter_1.db").read_text() == "keep me"


@pytest.mark.no_database
def test_our_own_default_directory_is_used(tmp_path):
    stdout, err = _default_dir_probe(tmp_path)
    assert stdout.strip("'") == str(tmp_path / f"celery-steplock-prometheus-{os.getuid()}"), err


# -- the Django view's access checks (each refusal before any metric is rendered) --------------


def _view_status(method="get", token=None, auth=None, user=None):
    from django.contrib.auth.models import AnonymousUser
    from django.test import RequestFactory

    headers = {"HTTP_AUTHORIZATION": auth} if auth is not None else {}
    request = getattr(RequestFactory(), method)("/metrics", **headers)
    request.user = user or AnonymousUser()
    return metrics_view(request, bearer_token=token).status_code


@pytest.mark.django_db
@pytest.mark.db_incidental
@pytest.mark.parametrize(
    ("method", "token", "auth", "expected"),
    [
        ("get", None, None, 401),
        ("head", None, None, 401),
        ("options", "s3cret", "Bearer s3cret", 405),
        ("post", "s3cret", "Bearer s3cret", 405),
        ("get", "", "Bearer ", 403),
        ("get", "", "Bearer", 403),
        ("get", None, "Bearer None", 403),
        ("get", "s3cret", "Bearer s3cre", 403),
        ("get", "s3cret", "Bearer s3cret ", 200),
        ("get", "s3cret", "bearer s3cret", 200),
        ("get", "s3cret", "Basic s3cret", 403),
        ("get", " ", "Bearer  ", 403),
        ("get", "s3cret", "Bearer s3cret\x00", 403),
        ("get", "sécret", "Bearer s\xc3\xa9cret", 403),
    ],
)
def test_the_view_s_token_check(method, token, auth, expected):
    assert _view_status(method, token, auth) == expected


@pytest.mark.django_db
@pytest.mark.db_incidental
def test_the_view_refuses_inactive_or_non_staff_users(django_user_model):
    inactive = django_user_model.objects.create_user(
        "i", password="pw", is_staff=True, is_active=False
    )
    plain = django_user_model.objects.create_user("p", password="pw")
    assert _view_status(user=inactive) == 403
    assert _view_status(user=plain) == 403
