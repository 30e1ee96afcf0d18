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
        nemesis.kinds_of("patterns", "raft")


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


def test_the_cluster_topology_plans_its_own_kinds_and_no_single_node_fault():
    kinds = nemesis.kinds_of("patterns", "cluster")
    assert kinds == {
        **{k: w for k, w in nemesis.KINDS.items() if k not in nemesis.SINGLE_STORE_KINDS},
        "cluster_failover": 2,
        "slot_migration": 2,
    }
    assert "sentinel_failover" not in kinds
    assert nemesis.kinds_of("outbox", "cluster")["receiver_down"] == 2
    assert "cluster" in nemesis.STORES
    faults = nemesis.plan(SEED, 1800, TTL, kinds)["faults"]
    planned = {f["kind"] for f in faults}
    assert planned == set(kinds)
    for kind in ("cluster_failover", "slot_migration"):
        assert sum(1 for f in faults if f["kind"] == kind) >= 20
    assert not planned & set(nemesis.SINGLE_STORE_KINDS)


@pytest.mark.no_database
def test_cluster_faults_move_a_held_lease_and_note_it(tmp_path):
    """The cluster topology's lab without workers: the workers' environment turns the cluster
    client on, the store client scans every primary, a failover (coordinated, then a killed
    primary, whose data-loss window is a split_brain follow-up) and a slot migration wait for
    a held lease and note their fault and heal entries."""
    lab = nemesis.NemesisLab(
        tmp_path / "lab",
        {"ENGINE": "django.db.backends.postgresql", "NAME": "unused", "PORT": 5432},
        seed=SEED,
        duration=10.0,
        out=tmp_path / "run",
        store="cluster",
    )
    try:
        lab.start()
        env = lab.worker_env()
        assert env["STEPLOCK_REDIS_CLUSTER"] == "1"
        assert env["STEPLOCK_REDIS_URL"] == lab.cluster_store.url()
        store = lab.store_client()
        store.flushdb()
        fault = {"target": 0, "target2": 0, "lag": 0.0}
        assert lab.cluster_store.failover(fault) is None  # no lease held: no target yet
        # leases on several slots, spread over the primaries: every one is seen
        for step in range(12):
            store.set(f"steplock:lease:{{step:{step}}}", "owner", px=120_000)
        store.set("steplock:lease:{nemesis-slots}#0}", "owner", px=120_000)
        assert lab.held()["leases"] == 12 and lab.held()["slots"] == 1
        assert len(lab.leases()) == 13
        for how in ("coordinated", "kill"):
            entry = lab.cluster_store.failover(fault)
            assert (entry["kind"], entry["how"]) == ("cluster_failover", how)
            assert lab.cluster_store.failover(fault) is None  # one change at a time
            lab.cluster_store.join(90)
            heal = [e for e in lab.history() if e["ev"] == "heal" and e["kind"] == entry["kind"]]
            assert heal[-1]["fault_t"] == entry["t"] and "error" not in heal[-1], heal[-1]
            owner = lab.cluster_store.cluster.slot_owners()[entry["slot"]]
            assert owner == heal[-1]["to_port"] != entry["from_port"]
        split = [e for e in lab.history() if e.get("kind") == "split_brain"]
        assert [(e["ev"], e["follow_up"], e["cause"]) for e in split] == [
            ("fault", True, "cluster_failover"),
            ("heal", True, "cluster_failover"),
        ]
        assert split[1]["fault_t"] == split[0]["t"]
        assert len(lab.cluster_store.cluster.live()) == 6  # the killed node is back
        entry = lab.cluster_store.migrate({"target": 1, "target2": 1, "lag": 0.0})
        assert entry["kind"] == "slot_migration" and entry["to_port"] != entry["from_port"]
        lab.cluster_store.join(90)
        heal = [e for e in lab.history() if e["ev"] == "heal" and e["kind"] == entry["kind"]]
        assert heal[0]["fault_t"] == entry["t"] and "error" not in heal[0], heal[0]
        assert heal[0]["moved"] >= 1
        assert lab.cluster_store.cluster.slot_owners()[entry["slot"]] == entry["to_port"]
        assert len(lab.leases()) == 13  # nothing acknowledged was lost on the way
        lab.cluster_store.heal()
        assert lab.errors == []
    finally:
        lab.stop()


def test_the_stale_aba_shape_is_planned_more_than_once_a_minute():
    """The fence-decides shape (``stale_aba``, tests/support/faults/loads.py) is one more
    client action at the end of the catalogue: at the default client gap, each minute
    plans a few of it (each one a stale commit the fence alone can refuse)."""
    assert list(nemesis.ACTIONS)[-1] == "stale_aba"
    client = nemesis.plan(SEED, 600, TTL)["client"]
    per_minute = [0] * 10
    for item in client:
        if item["action"] == "step" and item["kind"] == "stale_aba":
            per_minute[int(item["at"] // 60)] += 1
    assert min(per_minute) >= 2, per_minute


def test_the_loads_flag_names_its_workloads():
    from tests.support.faults import loads

    assert loads.parse(None) == loads.parse("") == loads.parse("none") == ()
    assert loads.parse("all") == ("http", "writers", "periodic")
    assert loads.parse("periodic,http") == ("http", "periodic")
    with pytest.raises(ValueError):
        loads.parse("http,nope")


def test_the_store_windows_of_the_http_rules_come_from_the_faults():
    from tests.support.faults import loads

    history = [
        {"ev": "fault", "t": 1.0, "kind": "redis_restart"},
        {"ev": "fault", "t": 2.0, "kind": "redis_blackhole", "seconds": 1.0},
        {"ev": "heal", "t": 3.0, "kind": "redis_blackhole", "fault_t": 2.0},
        {"ev": "fault", "t": 4.0, "kind": "split_brain"},
        {"ev": "heal", "t": 6.0, "kind": "split_brain", "fault_t": 4.0},
        {"ev": "fault", "t": 7.0, "kind": "pg_latency"},
        {"ev": "fault", "t": 8.0, "kind": "redis_drop"},
        {"ev": "other", "t": 20.0},
    ]
    lost, down = loads.store_windows(history, lock_ttl=8.0)
    assert lost == [1.0, (4.0, 6.0)]
    assert down == [(1.0, 9.0), (2.0, 3.0), (8.0, 16.0)]


def test_each_load_control_is_caught_only_by_its_own_rules():
    from tests.support.faults import loads

    counts = {"http": {"violations": 3}, "writer_step_violations": 0, "periodic": {}}
    assert loads.controls_caught(counts, ["http-unguarded", "writers-plain"]) == {
        "http-unguarded": True,
        "writers-plain": False,
    }
    assert loads.controls_caught({"periodic": {"violations": 1}}, ["periodic-unguarded"]) == {
        "periodic-unguarded": True
    }


# -- the broker and database choices (tests/support/faults/backends.py) -------------------------


def test_the_rabbitmq_broker_adds_its_kinds_and_the_database_keeps_the_catalogue():
    """``--broker rabbitmq`` adds broker_restart and broker_channel_close (weights 1 and 2)
    and nothing else; the database does not change the catalogue (the pg_* kinds keep their
    names on MariaDB, so a seed plans the same faults on either)."""
    from tests.support.faults import backends

    redis_kinds = nemesis.kinds_of("patterns", "single", "redis")
    rabbit = nemesis.kinds_of("patterns", "single", "rabbitmq")
    assert redis_kinds == nemesis.kinds_of()
    assert not set(backends.BROKER_KINDS) & set(redis_kinds)
    assert rabbit == {**redis_kinds, "broker_restart": 1, "broker_channel_close": 2}
    with pytest.raises(ValueError, match="broker must be one of"):
        nemesis.kinds_of("patterns", "single", "kafka")


def test_database_urls_sessions_and_the_commit_on_the_wire():
    """The workers' URLs through the proxy: PostgreSQL's tagged with application_name,
    MariaDB's as the workers' own user; the COMMIT the lost-reply fault waits for is a
    COM_QUERY on MariaDB."""
    from tests.support.faults import backends

    pg = backends.Database({"ENGINE": "django.db.backends.postgresql", "NAME": "s"})
    my = backends.Database(
        {"ENGINE": "django.db.backends.mysql", "NAME": "s", "USER": "root", "PORT": 3306}
    )
    tagged = "postgresql://postgres@127.0.0.1:5000/s?application_name=app"
    assert pg.worker_url(5000, "app") == tagged
    assert my.worker_url(5000, "app") == f"mysql://{backends.MYSQL_WORKER_USER}@127.0.0.1:5000/s"
    assert backends.database_url(my.settings) == "mysql://root@127.0.0.1:3306/s"
    assert (pg.commit_match, my.commit_match) == (b"COMMIT", b"\x03COMMIT")
    with pytest.raises(RuntimeError, match="PostgreSQL or MariaDB"):
        backends.Database({"ENGINE": "django.db.backends.sqlite3", "NAME": "x"})


@pytest.mark.no_database
def test_a_lost_commit_reply_on_mariadb_is_a_commit_whose_answer_never_came():
    """lost_commit_reply on MariaDB: the proxy matches the client's COMMIT (MariaDB
    Connector/C's ``mysql_commit``), drops its OK and closes; the client sees an error, the
    row is committed."""
    from tests.support import servers
    from tests.support.faults import backends
    from tests.support.faults.proxy import TcpProxy

    if not servers.MariaDBServer.available():
        pytest.skip("MariaDB is not installed (STEPLOCK_WANT_MYSQL=1 scripts/bootstrap.sh)")
    import MySQLdb

    db = backends.Database({"ENGINE": "django.db.backends.mysql", "NAME": "steplock"})
    with servers.MariaDBServer() as server, TcpProxy("127.0.0.1", server.port) as proxy:
        direct = MySQLdb.connect(host="127.0.0.1", port=server.port, user="root", db="steplock")
        direct.autocommit(True)
        direct.cursor().execute("CREATE TABLE t (x INT)")
        client = MySQLdb.connect(host="127.0.0.1", port=proxy.port, user="root", db="steplock")
        client.autocommit(False)
        client.cursor().execute("INSERT INTO t VALUES (1)")
        proxy.drop_next_reply(match=db.commit_match)
        with pytest.raises(MySQLdb.OperationalError):
            client.commit()
        cursor = direct.cursor()
        cursor.execute("SELECT COUNT(*) FROM t")
        assert cursor.fetchone()[0] == 1
        assert proxy.stats["replies_dropped"] == 1
        direct.close()


@pytest.mark.no_database
def test_rabbitmq_broker_faults_keep_the_queue_and_reset_the_workers_connections(tmp_path):
    """The RabbitMQ broker's lab without workers: the workers' broker URL is the proxy's, a
    published task waits in the queue (not idle), a broker_restart keeps it (durable queue,
    persistent message) and its heal notes the restart; broker_channel_close resets what is
    connected through the proxy and has no target when nothing is."""
    import amqp

    from tests.support.rabbitmq import RabbitMQServer

    if not RabbitMQServer.available():
        pytest.skip("rabbitmq-server is not installed (STEPLOCK_WANT_RABBITMQ=1)")
    lab = nemesis.NemesisLab(
        tmp_path / "lab",
        {"ENGINE": "django.db.backends.postgresql", "NAME": "unused", "PORT": 5432},
        seed=SEED,
        duration=10.0,
        out=tmp_path / "run",
        broker="rabbitmq",
    )
    try:
        lab.start()
        broker = lab.broker
        via_proxy = f"amqp://guest:guest@127.0.0.1:{broker.proxy.port}//"
        assert lab.worker_env()["REDIS_URL"] == via_proxy
        assert lab.broker_idle()
        lab.publisher.send_task("django_app.faults.tasks.forward", args=(1,))
        assert broker.messages() == 1 and not lab.broker_idle()
        fault = {"kind": "broker_channel_close", "target": 0, "seconds": 1.0}
        assert lab.inject(fault) is None  # no worker connected
        conn = amqp.Connection(f"127.0.0.1:{broker.proxy.port}", userid="guest", password="guest")
        conn.connect()
        entry = lab.inject(fault)
        assert entry["dropped"] == 1
        with pytest.raises(OSError):
            conn.drain_events(timeout=5)
        entry = lab.inject({"kind": "broker_restart", "target": 0, "seconds": 0.5})
        assert entry["kind"] == "broker_restart" and entry["down"] == 0.5
        assert lab.inject({"kind": "broker_restart", "target": 0, "seconds": 0.5}) is None
        lab.heal_due(force=True)
        heal = [e for e in lab.history() if e["ev"] == "heal"]
        assert heal[-1]["kind"] == "broker_restart" and heal[-1]["restart_s"] > 0.5
        assert broker.server.alive() and broker.messages() == 1
        assert lab.errors == []
    finally:
        lab.stop()
