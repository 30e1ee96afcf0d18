"""The randomized fault run (``tests/support/faults/nemesis.py``): its plan is a function of the
seed, and a short run with a few fault kinds forced writes the run directory of the interface
and passes the checker."""

import json

import pytest

from tests.support.faults import nemesis

SEED = 16
DURATION = 40.0
TTL = 2.0
KINDS = {
    "kill_child": 2,
    "pause": 2,
    "redis_drop": 1,
    "pg_drop": 1,
    "redis_failover": 1,
    "split_brain": 1,
}


def test_the_plan_is_a_function_of_the_seed():
    first = nemesis.plan(SEED, 1800, TTL)
    assert nemesis.plan(SEED, 1800, TTL) == first
    assert nemesis.plan(SEED + 1, 1800, TTL) != first
    assert [f["at"] for f in first["faults"]] == sorted(f["at"] for f in first["faults"])
    assert [c["at"] for c in first["client"]] == sorted(c["at"] for c in first["client"])
    kinds = {f["kind"] for f in first["faults"]}
    assert kinds == set(nemesis.KINDS)  # every kind of the catalogue is planned in 30 minutes
    assert len(first["faults"]) >= 500
    lasting = [f for f in first["faults"] if f["kind"] in nemesis.LASTING]
    assert all(0.5 * TTL <= f["seconds"] <= 3 * TTL for f in lasting)
    assert all(f["seconds"] > TTL for f in first["faults"] if f["kind"] == "pause")
    steps = [c for c in first["client"] if c["action"] == "step"]
    assert {c["kind"] for c in steps} == set(nemesis.ACTIONS)
    assert [c["n"] for c in steps] == list(range(len(steps)))


def test_a_shorter_run_on_the_same_seed_plays_the_start_of_a_longer_ones_schedule():
    short, full = nemesis.plan(SEED, 120, TTL), nemesis.plan(SEED, 300, TTL)
    for part in ("client", "faults"):
        assert short[part] == [item for item in full[part] if item["at"] < 120]
        assert len(full[part]) > len(short[part]) > 0


def test_forced_kinds_only():
    faults = nemesis.plan(SEED, 600, TTL, KINDS)["faults"]
    assert {f["kind"] for f in faults} == set(KINDS)


@pytest.mark.faults
@pytest.mark.workers
@pytest.mark.django_db(transaction=True)
def test_a_short_run_writes_its_directory_and_passes_the_checker(tmp_path):
    from django.db import connection

    out = tmp_path / "run"
    lab = nemesis.NemesisLab(
        tmp_path / "lab",
        dict(connection.settings_dict),
        seed=SEED,
        duration=DURATION,
        out=out,
        ttl=TTL,
        kinds=KINDS,
        fault_gap=2.0,
    )
    assert lab.schedule == nemesis.plan(SEED, DURATION, TTL, KINDS, fault_gap=2.0)
    try:
        lab.start()
        run = lab.run()
    finally:
        lab.stop()
    connection.close()

    assert run["settle"]["settled"] is True
    for name in ("history.jsonl", "steps.json", "records.json", "store.json", "run.json"):
        assert (out / name).exists(), name
    written = json.loads((out / "run.json").read_text())
    assert written["seed"] == SEED and written["unguarded"] is False and written["ttl"] == TTL
    assert [w["pool"] for w in written["workers"]] == ["prefork", "prefork", "prefork", "threads"]
    assert written["limits"]["concurrency"] == {"nemesis-slots": 2}
    assert list(written["limits"]["rate"].values()) == [{"limit": 5, "window": 1.0}]
    assert set(written["faults"]) <= set(KINDS) and sum(written["faults"].values()) >= 5

    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert all({"ev", "t"} <= set(e) for e in history)
    faults = [e for e in history if e["ev"] == "fault" and not e.get("follow_up")]
    assert len(faults) == sum(written["faults"].values())
    for e in faults:
        if e["kind"] == "kill_child":
            assert e["signal"] == "SIGKILL" and isinstance(e["pid"], int)
        if e["kind"] == "pause":
            assert e["signal"] == "SIGSTOP" and e["seconds"] > TTL
    heals = [e for e in history if e["ev"] == "heal"]
    paused = {e["t"] for e in faults if e["kind"] == "pause" and "extends" not in e}
    assert {h["fault_t"] for h in heals if h["kind"] == "pause"} == paused
    executions = sum(1 for e in history if e["ev"] in ("acquired", "contended"))
    assert written["executions"] == executions

    steps = json.loads((out / "steps.json").read_text())
    assert len(steps) == written["steps"] >= 20
    assert set(steps.values()) <= {"done", "cancelled"}
    records = json.loads((out / "records.json").read_text())
    assert {r["step"] for r in records} == {int(s) for s in steps}
    assert executions >= len(steps)
    store = json.loads((out / "store.json").read_text())
    assert store == {"keys_without_ttl": [], "leftover": []}

    assert written["errors"] == []  # every fault injected and healed, every replica prepared

    verdict = nemesis.check(out)
    assert (verdict["checker"], verdict["runcheck_returncode"]) == ("runcheck", 0)
    assert verdict["violations"] == []
    assert verdict["leftover"] == []
    assert verdict["counts"]["steps"] == len(steps)


def test_the_sentinel_topology_plans_sentinel_failovers_and_no_proxy_fault():
    kinds = nemesis.kinds_of("patterns", "sentinel")
    assert kinds["sentinel_failover"] == 2
    assert not set(kinds) & set(nemesis.SINGLE_STORE_KINDS)
    assert {"redis_failover", "split_brain"} <= set(nemesis.SINGLE_STORE_KINDS)
    # every other kind keeps its weight; the outbox workload keeps its own kind
    assert kinds == {
        **{k: w for k, w in nemesis.KINDS.items() if k not in nemesis.SINGLE_STORE_KINDS},
        "sentinel_failover": 2,
    }
    assert nemesis.kinds_of("outbox", "sentinel")["receiver_down"] == 2
    faults = nemesis.plan(SEED, 1800, TTL, kinds)["faults"]
    planned = {f["kind"] for f in faults}
    assert planned == set(kinds)
    assert sum(1 for f in faults if f["kind"] == "sentinel_failover") >= 20
    assert not planned & {"redis_failover", "split_brain", "redis_latency", "redis_drop"}


def test_the_single_node_topology_is_the_default_and_unchanged():
    assert nemesis.kinds_of() == nemesis.kinds_of("patterns", "single") == nemesis.KINDS
    assert "sentinel_failover" not in nemesis.kinds_of("outbox")
    with pytest.raises(ValueError, match="store must be one of"):
        nemesis.kinds_of("patterns", "cluster")


@pytest.mark.no_database
def test_a_sentinel_failover_fault_moves_the_primary_and_notes_it(tmp_path):
    """The Sentinel topology's lab without workers: the workers' environment names the
    sentinels, a failover waits for a held lease, and its fault and heal entries name the old
    and the new primary."""
    lab = nemesis.NemesisLab(
        tmp_path / "lab",
        {"ENGINE": "django.db.backends.postgresql", "NAME": "unused", "PORT": 5432},
        seed=SEED,
        duration=10.0,
        out=tmp_path / "run",
        store="sentinel",
    )
    try:
        lab.start()
        env = lab.worker_env()
        assert env["STEPLOCK_REDIS_URL"] == lab.sentinel.url
        assert env["STEPLOCK_REDIS_URL"].count("sentinel://") == 3
        assert json.loads(env["STEPLOCK_REDIS_TRANSPORT_OPTIONS"]) == {
            "master_name": nemesis.SENTINEL_MASTER
        }
        old = lab.sentinel.primary_port()
        assert lab.store_client().connection_pool.connection_kwargs["port"] == old
        assert lab.do_sentinel_failover() is None  # no lease held: no target yet
        store = lab.store_client()
        store.set("steplock:lease:{step:1}", "owner", px=60_000)
        store.set("steplock:lease:{nemesis-slots}#0}", "owner", px=60_000)
        store.zadd("steplock:breaker-probes:{nemesis-dep}", {"a": 1, "b": 2})
        assert lab.held() == {"leases": 1, "slots": 1, "probes": 2}
        entry = lab.do_sentinel_failover()
        assert entry["kind"] == "sentinel_failover" and entry["from_port"] == old
        assert entry["held"] == {"leases": 1, "slots": 1, "probes": 2}
        assert lab.do_sentinel_failover() is None  # one failover at a time
        lab.sentinel_thread.join(90)
        new = lab.sentinel.primary_port()
        assert new != old and lab.primary_port == new
        assert lab.store_client().connection_pool.connection_kwargs["port"] == new
        history = lab.history()
        # the two primaries' window, in the checker's terms: a split brain, not counted as a
        # fault, from the promotion until the old primary replicates from the new one
        split = [e for e in history if e.get("kind") == "split_brain"]
        assert [(e["ev"], e["follow_up"], e["cause"]) for e in split] == [
            ("fault", True, "sentinel_failover"),
            ("heal", True, "sentinel_failover"),
        ]
        assert split[0]["primaries"] == [old, new] and split[1]["fault_t"] == split[0]["t"]
        assert entry["t"] < split[0]["t"] < split[1]["t"]
        heal = [e for e in history if e["ev"] == "heal" and e["kind"] == "sentinel_failover"]
        assert len(heal) == 1 and heal[0]["fault_t"] == entry["t"]
        assert (heal[0]["from_port"], heal[0]["to_port"], heal[0]["aborted"]) == (old, new, False)
        assert heal[0]["settled_s"] > heal[0]["promoted_s"] > 0
        assert lab.sentinel.converged() == new
        assert lab.errors == []
    finally:
        lab.stop()
