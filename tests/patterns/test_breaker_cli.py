"""``celery -A django_app steplock breaker show|open|close NAME`` as real subprocesses, and the
audited override they share with the admin (celery_steplock.ops.override_breaker): the
LeaseEvent row is committed before Redis is written, and a forced-open breaker refuses calls
in every process until it is closed."""

import json
import os
import socket
import subprocess
import sys

import pytest

from celery_steplock import ops
from celery_steplock.patterns.breaker import CLOSED, OPEN, CircuitBreaker
from celery_steplock.exceptions import AuditRecordFailed, CircuitOpen

# The database holds at most audit rows here: one pass (db_incidental).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.db_incidental]


@pytest.fixture
def cli(worker_env, app):
    def run(*args, **env):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "breaker", *args],
            env={**worker_env, **env},
            cwd=worker_env["PYTHONPATH"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


def os_account():
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def test_open_show_close_from_the_command_line_are_audited(cli, app, redis_client):
    from celery_steplock.contrib.django.models import LeaseEvent

    breaker = CircuitBreaker("payments", app=app)
    opened = cli("open", "payments", "--reason", "provider incident 42")
    assert opened.returncode == 0, opened.stderr
    assert "closed -> open (forced, until closed)" in opened.stdout
    with pytest.raises(CircuitOpen) as refused:
        breaker.call(lambda: "never")
    assert refused.value.context["forced"] is True
    shown = cli("show", "payments", "--json")
    assert shown.returncode == 0, shown.stderr
    state = json.loads(shown.stdout)
    assert (state["state"], state["forced"], state["name"]) == (OPEN, True, "payments")
    closed = cli("close", "payments")
    assert closed.returncode == 0, closed.stderr
    assert breaker.call(lambda: "through") == "through"
    rows = list(LeaseEvent.objects.filter(event="circuit_override").order_by("id"))
    assert [(r.name, r.outcome, r.via, r.actor_host) for r in rows] == [
        ("payments", "done", "cli", socket.gethostname())
    ] * 2
    assert rows[0].reason == "open: provider incident 42"
    assert rows[0].actor.split(" ")[0] == os_account()
    assert rows[1].reason.startswith("close: close by ")
    assert f"audit: LeaseEvent {rows[0].pk}" in opened.stdout


def test_show_on_a_breaker_never_used(cli):
    shown = cli("show", "unknown-dependency")
    assert shown.returncode == 0, shown.stderr
    lines = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert (lines["state"], lines["forced"], lines["calls"]) == ("closed", "False", "0")


def test_no_record_no_override(app, redis_client, events):
    class Refusing(ops.BreakerAudit):
        def requested(self, record):
            raise RuntimeError("database down")

    breaker = CircuitBreaker("payments", app=app)
    with pytest.raises(AuditRecordFailed):
        ops.override_breaker(breaker, "open", actor="alice", auditor=Refusing())
    assert breaker.state().state == CLOSED
    record = ops.override_breaker(
        breaker, "open", actor="alice", via="api", auditor=ops.BreakerAudit()
    )
    assert (record.previous, record.outcome, breaker.state().forced) == (CLOSED, "done", True)
    audits = [kw["outcome"] for name, kw in events if name == "circuit_override_audit"]
    assert audits == ["requested", "requested", "done"]
    opened = [kw for name, kw in events if name == "circuit_opened"]
    assert len(opened) == 1 and opened[0]["manual"] is True and opened[0]["actor"] == "alice"


def corrupt(app, redis_client):
    """Breakers corrupted by a foreign client: ``{name: what show must name}``."""
    import redis as redis_py

    from celery_steplock.keys import breaker_key, breaker_probes_key
    from celery_steplock.lock import get_lease_store

    prefix = get_lease_store(app).prefix
    key = {
        name: breaker_key(prefix, name)
        for name in ("words", "string", "list", "huge", "bytes", "probes")
    }
    redis_client.hset(
        key["words"], mapping={"state": "open", "gen": "x", "opened_ms": "yesterday"}
    )
    redis_client.set(key["string"], "not a hash")
    redis_client.rpush(key["list"], "a")
    redis_client.hset(key["huge"], mapping={"gen": "9" * 5000, "ring": "1" * 100_000})
    redis_client.hset(key["probes"], "state", "half_open")
    redis_client.set(breaker_probes_key(prefix, "probes"), "x")
    raw = redis_client.connection_pool.connection_kwargs
    binary = redis_py.Redis(host=raw["host"], port=raw["port"], db=raw.get("db", 0))
    binary.hset(key["bytes"], mapping={"state": b"\xff\x1b[2J", "successes": b"\xfe"})
    binary.close()
    return {
        "words": "gen: not an integer",
        "string": "key: a string, not a hash",
        "list": "key: a list, not a hash",
        "huge": "gen: out of range",
        "bytes": "state: not UTF-8",
        "probes": "probes key: a string, not a sorted set",
    }


def test_show_prints_a_corrupt_breaker_as_malformed_never_a_traceback(cli, app, redis_client):
    for name, problem in corrupt(app, redis_client).items():
        shown = cli("show", name)
        assert shown.returncode == 0, (name, shown.stderr)
        assert "Traceback" not in shown.stderr, name
        lines = dict(line.split(None, 1) for line in shown.stdout.splitlines())
        assert problem in lines["malformed"], (name, lines)
        assert lines["key"].endswith("{" + name + "}")
        assert "\x1b" not in shown.stdout
        as_json = cli("show", name, "--json")
        assert as_json.returncode == 0, (name, as_json.stderr)
        assert problem in json.loads(as_json.stdout)["malformed"]
    healthy = cli("show", "healthy", "--json")
    assert json.loads(healthy.stdout)["malformed"] == ""


def test_an_override_refused_by_a_corrupt_key_exits_1_never_a_traceback(cli, app, redis_client):
    corrupt(app, redis_client)
    refused = cli("close", "string")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "Traceback" not in refused.stderr
    assert "not changed: circuit breaker 'string'" in refused.stderr
    assert "show string" in refused.stderr
    assert redis_client.get(CircuitBreaker("string", app=app).key) == "not a hash"
