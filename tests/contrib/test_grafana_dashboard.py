"""docs/grafana/celery-steplock.json: a Grafana dashboard of the shape Grafana imports (panels
with PromQL targets on a data source variable, no data source of one installation), whose every
metric name is one that celery_steplock.contrib.prometheus exposes."""

import json
import re

import pytest
from prometheus_client import CollectorRegistry

from celery_steplock import signals
from celery_steplock.contrib import prometheus
from celery_steplock.events import emit
from celery_steplock.lock import WAITS
from tests.support import ROOT

pytestmark = pytest.mark.no_database

DASHBOARD = ROOT / "docs" / "grafana" / "celery-steplock.json"

#: A metric name in a PromQL expression (PromQL functions and labels are not prefixed so).
METRIC = re.compile(r"\b(steplock_[a-z0-9_]+)\b")


def load():
    return json.loads(DASHBOARD.read_text())


def panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions(dashboard):
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield target["expr"]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            yield query["query"]


def test_the_dashboard_has_the_shape_grafana_imports():
    dashboard = load()
    assert dashboard["title"] and dashboard["uid"] == "celery-steplock"
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    graphs = [p for p in panels(dashboard) if p["type"] != "row"]
    assert len(graphs) >= 12
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in graphs:
        assert panel["title"] and panel["targets"], panel["title"]
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for where in (panel, *panel["targets"]):
            # the variable, never the uid of one Grafana's data source
            assert where["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"] for t in panel["targets"])
    titles = " | ".join(p["title"] for p in graphs)
    for wanted in ("Leases held", "waiting for a lease", "Oldest lease wait", "p50 / p95"):
        assert wanted in titles
    text = DASHBOARD.read_text()
    assert '"uid": "${datasource}"' in text
    assert not re.search(r'"uid": "(?!\$\{datasource\}|celery-steplock")', text)


def test_every_metric_of_the_dashboard_is_exposed(monkeypatch):
    """After install() and one event of every kind (every signal, a lease wait and a limit
    wait in progress), each name the expressions use is a sample name of the registry (the
    effects outbox's gauges: their registered families, read from a database at scrape)."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    prometheus.uninstall()
    metrics = prometheus.install(registry=CollectorRegistry())
    waits = [WAITS.start("lease", "t.task"), WAITS.start("concurrency", "pool")]
    try:
        lease = dict(key="steplock:lease:k", name="k", owner="o", fence=1, task_name="t.task")
        for signal in signals.ALL_SIGNALS:
            emit(
                signal,
                None,
                **lease,
                wait_seconds=0.01,
                hold_seconds=0.5,
                cas_seconds=0.001,
                commit_seconds=0.001,
                state="open",
                decision="retry",
                limit="10/s",
                kind="task",
                policy="skip",
            )
        exposed = {
            sample.name for family in metrics.registry.collect() for sample in family.samples
        }
        # The outbox's gauges are read from the database at scrape (none here): their
        # families, as registered.
        exposed |= {family.name for family in prometheus.OutboxCollector().describe()}
    finally:
        for token in waits:
            WAITS.end(token)
        prometheus.uninstall()
    used = {name for expr in expressions(load()) for name in METRIC.findall(expr)}
    assert len(used) >= 15
    assert used - exposed == set()
    # a name is the family's or one of its samples' suffixes (histograms, counters)
    for name in used:
        assert re.fullmatch(r"steplock_[a-z_]+?(_bucket|_sum|_count|_total)?", name)
