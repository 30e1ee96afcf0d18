"""One write database per execution, whatever the database router does (docs/databases.md).

The test project has three databases (django_app/settings.py): ``default``, ``replica`` (a
separate database that nothing ever writes: a read replica lagging without end) and
``other`` (a second primary). :class:`django_app.routers.ProjectRouter` sends reads of
``routing.Invoice`` to ``replica`` and its writes to ``default``, and keeps
``routing.Parcel`` on ``other``, where its only table is; ``routing.Ledger`` has a table on
``default`` and on ``other`` and a task names the one it writes with ``step_database``.
Everything runs against real Redis and the real databases (SQLite files, or databases of
one PostgreSQL server), in-process and in real ``celery worker`` processes.
"""

from __future__ import annotations

import contextvars
import threading

import pytest
from django.db import connections, transaction
from django.test import override_settings

from celery_steplock import signals
from celery_steplock.contrib.django.steps import DjangoStepStore
from celery_steplock.contrib.django.task import DjangoStepLockedTask
from celery_steplock.exceptions import (
    ImproperlyConfigured,
    LockContended,
    LockLost,
    OuterTransactionError,
    TransitionConflict,
)
from celery_steplock.lock import get_lease_store
from celery_steplock.plan import build_plan, option_problems
from celery_steplock.reaper import Reaper, ReapReport, reap
from celery_steplock.outcomes import is_outcome
from celery_steplock.task import StepLockedTask
from celery_steplock import validate
from django_app.celery import app as celery_app
from django_app.routers import ProjectRouter
from django_app.routing.models import Invoice, Ledger, Parcel
from django_app.routing.tasks import pay_invoice, post_ledger, ship_parcel
from tests.helpers import set_settings

DATABASES = ["default", "replica", "other"]
pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

PING = 0.3
GHOST = "ghost@nowhere.invalid"


@pytest.fixture(autouse=True)
def clean(app, redis_client):
    set_settings(app, steplock_retry_backoff=0.01)
    yield


def named(events, name):
    return [kw for event, kw in events if event == name]


def row(model, pk, using):
    """(status, attempts, note) of the row on ``using``, None when it has none."""
    found = list(
        model._base_manager.db_manager(using)
        .filter(pk=pk)
        .values_list("status", "attempts", "note")
    )
    return found[0] if found else None


def leases(redis_client):
    return sorted(
        k.decode() if isinstance(k, bytes) else k
        for k in redis_client.scan_iter(match="steplock:lease:*")
    )


# -- tasks of this module (the project's own are in django_app/routing/tasks.py) ---------------


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.routing.blind_pay",
    lock_key="invoice:{invoice_id}",
    step_model="routing.Invoice",
    step_id_arg="invoice_id",
    transition=("pending", "paid"),
    lock_precheck=False,
    on_conflict="raise",
)
def blind_pay(self, invoice_id):
    Invoice.objects.filter(pk=invoice_id).update(attempts=1, note="blind body")
    return "body done"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.routing.ship_and_lose",
    lock_key="parcel:{parcel_id}",
    step_model="routing.Parcel",
    step_id_arg="parcel_id",
    transition=("pending", "shipped"),
    on_contended="raise",
)
def ship_and_lose(self, parcel_id, steal=True):
    Parcel.objects.filter(pk=parcel_id).update(attempts=1, note="written by the loser")
    if steal:  # another owner takes the lease before the commit
        get_lease_store(self.app).client.hset(
            self.lease.key, mapping={"owner": "thief", "task_id": "thief-task"}
        )
    return "body done"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.routing.post_default_ledger",
    lock_key="ledger:{ledger_id}",
    step_model="routing.Ledger",
    step_id_arg="ledger_id",
    transition=("pending", "posted"),
)
def post_routed_ledger(self, ledger_id):
    """No ``step_database``: the setting's, else the router's."""
    return self.steplock_plan.steps.using


TENANT = contextvars.ContextVar("tenant", default="default")


class TenantRouter(ProjectRouter):
    """Ledger goes wherever the current tenant lives: an answer that depends on the context."""

    def db_for_write(self, model, **hints):
        if model is Ledger:
            return TENANT.get()
        return super().db_for_write(model, **hints)

    db_for_read = db_for_write


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.routing.switch_tenant",
    lock_key="ledger:{ledger_id}",
    step_model="routing.Ledger",
    step_id_arg="ledger_id",
    transition=("pending", "posted"),
)
def switch_tenant(self, ledger_id):
    TENANT.set("other")  # the body changes the context: the execution's database stays
    return "switched"


class Inspecting(StepLockedTask):
    """Reads each database's ``lock_timeout`` just before COMMIT (PostgreSQL)."""

    abstract = True
    seen: dict = {}

    def before_commit(self, lease, step_id):
        for alias in ("default", "other"):
            with connections[alias].cursor() as cursor:
                cursor.execute("SHOW lock_timeout")
                type(self).seen[alias] = cursor.fetchone()[0]


@celery_app.task(
    bind=True,
    base=Inspecting,
    name="tests.routing.inspect_parcel",
    lock_key="parcel:{parcel_id}",
    step_model="routing.Parcel",
    step_id_arg="parcel_id",
    transition=("pending", "shipped"),
)
def inspect_parcel(self, parcel_id):
    return "ok"


@celery_app.task(
    bind=True,
    base=DjangoStepLockedTask,
    name="tests.routing.later",
    lock_key="parcel:{parcel_id}",
    step_model="routing.Parcel",
    step_id_arg="parcel_id",
    transition=("pending", "shipped"),
)
def ship_later(self, parcel_id):
    return "ok"


# -- where the statements go -----------------------------------------------------------------


def test_the_write_database_is_the_routers_and_bind_fixes_it():
    assert DjangoStepStore(Invoice).using == "default"
    assert DjangoStepStore(Parcel).using == "other"
    assert DjangoStepStore(Ledger).using == "default"
    assert DjangoStepStore(Ledger, using="other").using == "other"
    store = DjangoStepStore(Parcel)
    bound = store.bind()
    assert bound.using == "other" and bound.bind() is bound and store.bind() is bound
    explicit = DjangoStepStore(Ledger, using="other")
    assert explicit.bind() is explicit
    with override_settings(DATABASE_ROUTERS=[TenantRouter()]):
        tenant = DjangoStepStore(Ledger)
        at_start = tenant.bind()
        token = TENANT.set("other")
        try:
            assert tenant.using == "other" and tenant.bind().using == "other"
            assert at_start.using == "default"  # fixed when it was bound
        finally:
            TENANT.reset(token)


def test_a_router_that_names_an_unknown_database_is_a_configuration_error(redis_client):
    class Nowhere(ProjectRouter):
        def db_for_write(self, model, **hints):
            return "nowhere" if model is Parcel else None

    parcel = Parcel.objects.create()
    with override_settings(DATABASE_ROUTERS=[Nowhere()]):
        result = ship_parcel.apply(args=(parcel.pk,))
    assert isinstance(result.result, ImproperlyConfigured)
    assert result.result.setting == "DATABASE_ROUTERS" and "'nowhere'" in str(result.result)
    assert leases(redis_client) == []  # refused before any lease
    assert row(Parcel, parcel.pk, "other") == ("pending", 0, "")


# -- (a) reads sent to a lagging replica ---------------------------------------------------------


def test_a_step_the_replica_lacks_runs_once_on_the_write_database(redis_client, events):
    invoice = Invoice.objects.create()
    assert not Invoice.objects.filter(pk=invoice.pk).exists()  # the router reads the replica
    first = pay_invoice.apply(args=(invoice.pk,))
    assert first.successful() and first.result["database"] == "default"
    again = pay_invoice.apply(args=(invoice.pk,))
    # the precheck read the write database: "paid"
    assert (again.state, again.result["steplock"], again.result["found"]) == (
        "SUCCESS",
        "duplicate",
        "paid",
    )
    status, attempts, note = row(Invoice, invoice.pk, "default")
    assert (status, attempts) == ("paid", 1) and note.endswith(first.result["owner"])
    assert row(Invoice, invoice.pk, "replica") is None  # nothing ever wrote the replica
    assert [kw["current"] for kw in named(events, "transition_conflict")] == ["paid"]
    assert len(named(events, "transition_applied")) == 1
    assert leases(redis_client) == []


def test_a_stale_replica_never_runs_a_finished_step(redis_client, events):
    invoice = Invoice.objects.create(status="paid", attempts=1, note="committed")
    Invoice.objects.using("replica").create(pk=invoice.pk)  # the replica: still pending
    assert Invoice.objects.get(pk=invoice.pk).status == "pending"
    assert DjangoStepStore(Invoice).status(invoice.pk) == "paid"
    result = pay_invoice.apply(args=(invoice.pk,))
    assert (result.state, result.result["found"]) == ("SUCCESS", "paid")
    assert row(Invoice, invoice.pk, "default") == ("paid", 1, "committed")  # no body ran
    assert row(Invoice, invoice.pk, "replica") == ("pending", 0, "")
    assert [kw["current"] for kw in named(events, "transition_conflict")] == ["paid"]
    assert named(events, "lock_lost") == []


def test_the_conflict_read_sees_the_write_database_not_the_replica(redis_client, events):
    """Without the precheck the body runs and the CAS finds nothing to update: the
    follow-up read must say "paid" (a conflict) and not the replica's "pending" (which would
    be taken for a newer fencing token: LockLost, retried without end)."""
    invoice = Invoice.objects.create(status="paid", attempts=7, note="committed")
    Invoice.objects.using("replica").create(pk=invoice.pk)
    result = blind_pay.apply(args=(invoice.pk,))
    assert isinstance(result.result, TransitionConflict)
    assert result.result.current == "paid" and result.result.stale_fence is False
    assert row(Invoice, invoice.pk, "default") == ("paid", 7, "committed")  # rolled back
    direct = DjangoStepStore(Invoice).transition(
        invoice.pk, "pending", "paid", fence=1, raise_on_conflict=False
    )
    assert (direct.applied, direct.current) == (False, "paid")
    assert named(events, "lock_lost") == [] and leases(redis_client) == []


# -- (b) a write database that is not default -------------------------------------------------


def test_a_step_model_that_lives_on_another_database_commits_once_there(redis_client, events):
    assert "routing_parcel" not in connections["default"].introspection.table_names()
    parcel = Parcel.objects.create()
    first = ship_parcel.apply(args=(parcel.pk,), task_id="same-id")
    duplicate = ship_parcel.apply(args=(parcel.pk,), task_id="same-id")
    other_id = ship_parcel.apply(args=(parcel.pk,))
    assert first.successful() and first.result["database"] == "other"
    assert duplicate.state == "IGNORED"  # the winner's own task id
    assert (other_id.state, other_id.result["steplock"]) == ("SUCCESS", "duplicate")
    status, attempts, note = row(Parcel, parcel.pk, "other")
    assert (status, attempts) == ("shipped", 1) and note.endswith(first.result["owner"])
    applied = named(events, "transition_applied")
    assert [(kw["step_id"], kw["to"]) for kw in applied] == [(parcel.pk, "shipped")]
    assert leases(redis_client) == []


def test_concurrent_duplicates_on_another_database_commit_once(redis_client):
    parcel = Parcel.objects.create()
    results = []

    def run():
        try:
            results.append(ship_parcel.apply(args=(parcel.pk,), kwargs={"delay": 0.3}))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 4
    # One body's value; every other delivery is the duplicate outcome (it got the lease after
    # the commit) or LockContended (its eager retries ran out first): which, the timing says.
    bodies = [r for r in results if r.successful() and r.result.get("database") == "other"]
    others = [r for r in results if r not in bodies]
    assert len(bodies) == 1
    assert all(
        (r.successful() and r.result.get("steplock") == "duplicate")
        or isinstance(r.result, LockContended)
        for r in others
    ), [r.result for r in others]
    assert row(Parcel, parcel.pk, "other")[:2] == ("shipped", 1)
    assert leases(redis_client) == []


def test_the_outer_transaction_check_looks_at_the_steps_database(redis_client, events):
    parcel = Parcel.objects.create()
    with pytest.raises(OuterTransactionError):
        with transaction.atomic(using="other"):
            ship_parcel(parcel.pk)
    assert leases(redis_client) == [] and row(Parcel, parcel.pk, "other") == ("pending", 0, "")
    # A transaction on another database does not hold the step's commit back: allowed, and
    # the step is committed on its own database before the block ends.
    with transaction.atomic(using="default"):
        value = ship_parcel(parcel.pk)
        assert row(Parcel, parcel.pk, "other")[:2] == ("shipped", 1)
    assert value["database"] == "other"


def test_transition_applied_is_sent_after_the_commit_of_the_steps_database(redis_client):
    parcel = Parcel.objects.create()
    seen = []

    def receiver(sender=None, **kw):
        seen.append((connections["other"].in_atomic_block, row(Parcel, parcel.pk, "other")))

    signals.transition_applied.connect(receiver, weak=False)
    try:
        assert ship_parcel.apply(args=(parcel.pk,)).successful()
    finally:
        signals.transition_applied.disconnect(receiver)
    status_seen = seen[0][1][0]
    assert len(seen) == 1 and seen[0][0] is False and status_seen == "shipped"


def test_delay_on_commit_waits_for_the_steps_database(redis_client):
    with transaction.atomic(using="other"):
        parcel = Parcel.objects.create()
        ship_later.delay_on_commit(parcel.pk)
        assert redis_client.llen("celery") == 0  # Celery's own would publish now
    assert redis_client.llen("celery") == 1
    assert ship_later.steplock_commit_database() == "other"


@pytest.mark.postgresql
def test_the_postgresql_deadline_is_set_on_the_steps_database(redis_client):
    parcel = Parcel.objects.create()
    Inspecting.seen.clear()
    assert inspect_parcel.apply(args=(parcel.pk,), kwargs={}).successful()
    assert Inspecting.seen["default"] == "0"  # untouched
    assert Inspecting.seen["other"] != "0" and Inspecting.seen["other"].endswith("s")


# -- (c) step models on two databases in one process -----------------------------------------


def test_step_models_on_two_databases_commit_each_on_its_own(redis_client):
    invoices = [Invoice.objects.create() for _ in range(3)]
    parcels = [Parcel.objects.create() for _ in range(3)]
    results = []

    def run(task, pk):
        try:
            results.append(task.apply(args=(pk,), kwargs={"delay": 0.1}))
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=run, args=(task, obj.pk))
        for _ in range(2)
        for task, objs in ((pay_invoice, invoices), (ship_parcel, parcels))
        for obj in objs
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    done = [
        r.result
        for r in results
        if r.successful() and isinstance(r.result, dict) and not is_outcome(r.result)
    ]  # the duplicates return their outcome
    assert sorted(r["database"] for r in done) == ["default"] * 3 + ["other"] * 3
    assert {row(Invoice, i.pk, "default")[:2] for i in invoices} == {("paid", 1)}
    assert {row(Parcel, p.pk, "other")[:2] for p in parcels} == {("shipped", 1)}
    assert all(row(Invoice, i.pk, "replica") is None for i in invoices)
    assert leases(redis_client) == []


# -- (d) a holder that lost its lease ------------------------------------------------------------


def test_a_holder_that_lost_its_lease_rolls_back_on_the_write_database(redis_client, events):
    parcel = Parcel.objects.create()
    result = ship_and_lose.apply(args=(parcel.pk,))
    assert isinstance(result.result, LockLost)
    assert row(Parcel, parcel.pk, "other") == ("pending", 0, "")  # the body's write too
    assert named(events, "transition_applied") == []


def test_a_newer_fence_in_the_row_refuses_the_stale_holder_on_the_write_database(
    redis_client, events
):
    parcel = Parcel.objects.create(lock_fence=2**62)  # a newer holder wrote it
    result = ship_and_lose.apply(args=(parcel.pk,), kwargs={"steal": False})
    assert isinstance(result.result, LockLost) and "newer fencing token" in str(result.result)
    assert row(Parcel, parcel.pk, "other") == ("pending", 0, "")
    assert Parcel.objects.get(pk=parcel.pk).lock_fence == 2**62


# -- the database named by an option or a setting ----------------------------------------------


def test_step_database_option_commits_there_and_leaves_the_routers_database_alone(redis_client):
    ledger = Ledger.objects.create()  # the router's: default
    Ledger.objects.using("other").create(pk=ledger.pk)  # the option's
    result = post_ledger.apply(args=(ledger.pk,))
    assert result.successful() and result.result["database"] == "other"
    assert row(Ledger, ledger.pk, "other")[:2] == ("posted", 1)
    assert row(Ledger, ledger.pk, "default") == ("pending", 0, "")
    assert post_ledger.steplock_plan.steps.using == "other"


def test_the_setting_names_the_database_of_tasks_without_the_option(app, redis_client):
    ledger = Ledger.objects.create()
    Ledger.objects.using("other").create(pk=ledger.pk)
    assert post_routed_ledger.apply(args=(ledger.pk,)).result == "default"
    Ledger.objects.filter(pk=ledger.pk).update(status="pending")
    set_settings(app, steplock_step_database="other")
    assert post_routed_ledger.apply(args=(ledger.pk,)).result == "other"
    assert row(Ledger, ledger.pk, "other")[0] == "posted"
    assert row(Ledger, ledger.pk, "default")[0] == "pending"


def test_one_database_per_execution_with_a_router_that_reads_the_context(redis_client):
    ledger = Ledger.objects.create()
    Ledger.objects.using("other").create(pk=ledger.pk)
    token = TENANT.set("default")
    try:
        with override_settings(DATABASE_ROUTERS=[TenantRouter()]):
            assert switch_tenant.apply(args=(ledger.pk,)).result == "switched"
    finally:
        TENANT.reset(token)
    assert row(Ledger, ledger.pk, "default")[0] == "posted"
    assert row(Ledger, ledger.pk, "other")[0] == "pending"


def test_the_router_is_asked_once_per_execution(redis_client):
    calls = []

    class Counting(TenantRouter):
        def db_for_write(self, model, **hints):
            if model is Ledger:
                calls.append(TENANT.get())
            return super().db_for_write(model, **hints)

    ledgers = [Ledger.objects.create() for _ in range(2)]
    with override_settings(DATABASE_ROUTERS=[Counting()]):
        for ledger in ledgers:
            token = TENANT.set("default")
            try:
                assert switch_tenant.apply(args=(ledger.pk,)).result == "switched"
            finally:
                TENANT.reset(token)
    assert calls == ["default", "default"]
    assert {row(Ledger, x.pk, "default")[0] for x in ledgers} == {"posted"}


def test_the_factory_gets_the_database_and_its_listing_refuses_unknown_ones():
    from celery_steplock.steps import load_step_store

    calls = []

    def factory(model, **fields):
        calls.append(fields.get("using", "<not given>"))
        return model

    factory.databases = lambda: ("main", "archive")
    fields = dict(status_field="s", owner_field="o", fence_field="f")
    assert load_step_store(factory, "m", **fields) == "m"
    assert load_step_store(factory, "m", using="archive", **fields) == "m"
    with pytest.raises(ImproperlyConfigured) as info:
        load_step_store(
            factory, "m", using="nope", using_setting="steplock_step_database", **fields
        )
    assert info.value.setting == "steplock_step_database"
    assert "'nope' is not a configured database (known: 'main', 'archive')" in str(info.value)
    assert calls == ["<not given>", "archive"]
    with pytest.raises(ImproperlyConfigured) as info:
        DjangoStepStore(Parcel, using="nope")
    assert "'default', 'replica', 'other'" in str(info.value)


def test_an_unknown_database_is_a_configuration_error_naming_the_option(app, redis_client):
    ledger = Ledger.objects.create()
    post_routed_ledger.step_database = "nowhere"
    try:
        with pytest.raises(ImproperlyConfigured) as info:
            build_plan(post_routed_ledger)
        assert info.value.setting == "step_database" and "'nowhere'" in str(info.value)
        assert "'default', 'replica', 'other'" in str(info.value)
        found = [
            (exc.setting, str(exc))
            for exc in option_problems(post_routed_ledger, models_ready=False)
        ]
        assert [setting for setting, _ in found] == ["step_database"]
        assert found[0][1].startswith("tests.routing.post_default_ledger: ")
        result = post_routed_ledger.apply(args=(ledger.pk,))
        assert isinstance(result.result, ImproperlyConfigured)
        assert leases(redis_client) == [] and row(Ledger, ledger.pk, "default")[0] == "pending"
        problems = [
            p for p in validate.problems(app) if p.obj == "tests.routing.post_default_ledger"
        ]
        assert [p.id for p in problems] == ["celery_steplock.E004"]
        assert "step_database" in problems[0].message
        post_routed_ledger.step_database = ""
        with pytest.raises(ImproperlyConfigured, match="database alias"):
            build_plan(post_routed_ledger)
    finally:
        del post_routed_ledger.step_database


def test_an_unknown_database_is_a_configuration_error_naming_the_setting(app, redis_client):
    from celery_steplock.contrib.django import checks

    set_settings(app, steplock_step_database="nowhere")
    with pytest.raises(ImproperlyConfigured) as info:
        build_plan(post_routed_ledger)
    assert info.value.setting == "steplock_step_database"
    problems = [p for p in validate.problems(app) if p.obj == "steplock_step_database"]
    assert [p.id for p in problems] == ["celery_steplock.E003"]
    assert "'nowhere' is not a configured database" in problems[0].message
    rendered = [m for m in checks.check_settings(app) if m.obj == "steplock_step_database"]
    assert [m.id for m in rendered] == ["celery_steplock.E003"]
    # Tasks with their own option are not concerned by the setting.
    assert build_plan(post_ledger).steps.using == "other"
    set_settings(app, steplock_step_database=5)
    problems = [p for p in validate.problems(app) if p.obj == "steplock_step_database"]
    assert [p.id for p in problems] == ["celery_steplock.E003"]
    assert "must be None or a database alias" in problems[0].message


# -- (e) the reaper's recovery -----------------------------------------------------------------


def stale(store, redis_client, name):
    """A lease of a silent worker, last renewed two minutes ago: the reaper reaps it."""
    lease = store.acquire(
        name,
        ttl=60.0,
        metadata={
            "worker": GHOST,
            "hostname": "elsewhere.invalid",
            "pid": 1,
            "task_name": "t.claim",
        },
    )
    now_s, now_us = redis_client.time()
    redis_client.hset(store.key(name), "renewed_ms", now_s * 1000 + now_us // 1000 - 120_000)
    return lease


def test_the_reaper_recovers_steps_on_their_write_databases(app, redis_client):
    store = get_lease_store(app)
    dead = stale(store, redis_client, "routing:dead")
    parcel = Parcel.objects.create(status="running", lock_owner=dead.owner)
    invoice = Invoice.objects.create(status="running", lock_owner=dead.owner)  # not on replica
    ledger_default = Ledger.objects.create(status="running", lock_owner=dead.owner)
    ledger_other = Ledger.objects.using("other").create(status="running", lock_owner=dead.owner)
    set_settings(
        app,
        steplock_reaper_recover={
            "routing.Parcel": {"running": "pending"},
            "routing.Invoice": {"running": "pending"},
            "routing.Ledger": {"running": "pending"},
        },
    )
    run = Reaper(
        app,
        ReapReport(),
        dry_run=True,
        batch_size=100,
        older_than=None,
        now=None,
        ping_timeout=PING,
        check_pids=True,
        lock=store,
    )
    watched = run.start_recovery()
    # Ledger's only task writes it on "other" (step_database); a task on it without the
    # option (the router's default) is registered by this module too.
    assert sorted((g.label, g.using) for g in watched.candidates) == [
        ("routing.Invoice", "default"),
        ("routing.Ledger", "default"),
        ("routing.Ledger", "other"),
        ("routing.Parcel", "other"),
    ]
    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    moved = sorted((s["model"], s["pk"]) for s in report.steps_recovered)
    assert moved == sorted(
        [
            ("routing.Invoice", invoice.pk),
            ("routing.Parcel", parcel.pk),
            ("routing.Ledger", ledger_default.pk),
            ("routing.Ledger", ledger_other.pk),
        ]
    )
    assert Parcel.objects.values_list("status", "lock_owner").get(pk=parcel.pk) == ("pending", "")
    assert Invoice.objects.using("default").get(pk=invoice.pk).status == "pending"
    assert not Invoice.objects.using("replica").exists()
    assert Ledger.objects.using("other").get(pk=ledger_other.pk).status == "pending"
    assert Ledger.objects.using("default").get(pk=ledger_default.pk).status == "pending"


def test_the_reaper_reads_in_flight_rows_on_the_setting_s_database(app, redis_client):
    store = get_lease_store(app)
    dead = stale(store, redis_client, "routing:dead")
    set_settings(
        app,
        steplock_step_database="other",
        steplock_reaper_recover={"routing.Ledger": {"running": "pending"}},
    )
    on_other = Ledger.objects.using("other").create(status="running", lock_owner=dead.owner)
    on_default = Ledger.objects.using("default").create(
        pk=on_other.pk + 100, status="running", lock_owner=dead.owner
    )
    report = reap(app, ping_timeout=PING)
    assert report.ok, report.errors
    assert [(s["model"], s["pk"]) for s in report.steps_recovered] == [
        ("routing.Ledger", on_other.pk)
    ]
    assert Ledger.objects.using("other").get(pk=on_other.pk).status == "pending"
    assert Ledger.objects.using("default").get(pk=on_default.pk).status == "running"


def test_the_reaper_names_the_router_when_it_routes_recovery_to_an_unknown_database(
    app, redis_client
):
    class Nowhere(ProjectRouter):
        def db_for_write(self, model, **hints):
            return "nowhere" if model is Parcel else super().db_for_write(model, **hints)

    store = get_lease_store(app)
    set_settings(app, steplock_reaper_recover={"routing.Parcel": {"running": "pending"}})
    with override_settings(DATABASE_ROUTERS=[Nowhere()]):
        run = Reaper(
            app,
            ReapReport(),
            dry_run=True,
            batch_size=100,
            older_than=None,
            now=None,
            ping_timeout=PING,
            check_pids=True,
            lock=store,
        )
        watched = run.start_recovery()
    assert [c for c in watched.candidates if c.label == "routing.Parcel"] == []
    errors = [e for e in run.report.errors if "routing.Parcel" in e]
    assert len(errors) == 1, run.report.errors
    assert "DATABASE_ROUTERS" in errors[0] and "'nowhere'" in errors[0]
    assert "not in DATABASES" in errors[0] and "step_database:" not in errors[0]


# -- real celery workers --------------------------------------------------------------------


@pytest.fixture
def routed_worker_env():
    """The test databases of ``replica`` and ``other`` for the worker processes (the
    ``worker_env`` fixture gives them ``default``'s)."""
    from tests.conftest import database_url

    return {
        f"STEPLOCK_{alias.upper()}_DATABASE_URL": database_url(connections[alias].settings_dict)
        for alias in ("replica", "other")
    }


@pytest.mark.workers
def test_real_workers_commit_each_step_once_on_its_write_database(
    start_worker, routed_worker_env, redis_client
):
    """Two prefork workers, each step sent twice (half of them as a duplicate delivery of
    one task id): Invoice on default (reads routed to the lagging replica), Parcel on other,
    Ledger on other by step_database."""
    from helpers import wait_until

    env = dict(routed_worker_env, STEPLOCK_RETRY_BACKOFF="0.2", STEPLOCK_RETRY_BACKOFF_MAX="1")
    start_worker("r1", concurrency=2, **env)
    start_worker("r2", concurrency=2, **env)
    invoices = [Invoice.objects.create() for _ in range(4)]
    parcels = [Parcel.objects.create() for _ in range(4)]
    ledgers = [Ledger.objects.create() for _ in range(4)]
    for ledger in ledgers:
        Ledger.objects.using("other").create(pk=ledger.pk)
    first = {}
    for task, objs in ((pay_invoice, invoices), (ship_parcel, parcels), (post_ledger, ledgers)):
        for i, obj in enumerate(objs):
            task_id = f"{task.name}-{obj.pk}" if i % 2 else None
            first[(task.name, obj.pk)] = task.apply_async(
                (obj.pk,), {"delay": 0.3}, task_id=task_id
            )
            task.apply_async((obj.pk,), {"delay": 0.3}, task_id=task_id)

    def finished():
        return (
            all(row(Invoice, i.pk, "default")[0] == "paid" for i in invoices)
            and all(row(Parcel, p.pk, "other")[0] == "shipped" for p in parcels)
            and all(row(Ledger, x.pk, "other")[0] == "posted" for x in ledgers)
            and redis_client.llen("celery") == 0
            and redis_client.hlen("unacked") == 0
            and leases(redis_client) == []
        )

    wait_until(
        finished,
        timeout=90,
        what="every step to commit and the queue to drain",
        describe=lambda: (
            f"queue {redis_client.llen('celery')}, unacked "
            f"{redis_client.hlen('unacked')}, leases "
            f"{leases(redis_client)}"
        ),
    )
    assert {row(Invoice, i.pk, "default")[1] for i in invoices} == {1}
    assert {row(Parcel, p.pk, "other")[1] for p in parcels} == {1}
    assert {row(Ledger, x.pk, "other")[1] for x in ledgers} == {1}
    assert {row(Ledger, x.pk, "default") for x in ledgers} == {("pending", 0, "")}
    assert not Invoice.objects.using("replica").exists()
    pids = {int(row(Parcel, p.pk, "other")[2].split(":")[0]) for p in parcels}
    assert pids and all(pid > 0 for pid in pids)
    # The task id that was delivered twice kept the winner's result.
    for (name, pk), result in first.items():
        if result.id.startswith(name):
            value = result.get(timeout=10)
            assert value["step_id"] == pk
            assert value["database"] == ("default" if name == pay_invoice.name else "other")
