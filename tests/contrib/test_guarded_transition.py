"""Writers outside Celery: the guarded transition, its admin mixin, the W008 check, the example
project's admin and command (issue 24, "Writers outside Celery").

Real Redis (the session's server), the real test database (transactions committed:
``transactional_db``), Django's test client on the example project's admin.
"""

from __future__ import annotations

import asyncio
from html.parser import HTMLParser

import pytest
from asgiref.sync import async_to_sync
from django.contrib import admin as django_admin
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.urls import reverse

from celery_steplock.contrib.django.checks import check_step_admins
from celery_steplock.contrib.django.mixins import GuardedStepAdminMixin
from celery_steplock.contrib.django.steps import (
    DEFAULT_ACTOR,
    AsyncGuardedStep,
    aguarded_step,
    aguarded_transition,
    guarded_step,
    guarded_transition,
    step_lock_name,
)
from celery_steplock.exceptions import (
    ImproperlyConfigured,
    InvalidArgument,
    InvalidTransition,
    LockContended,
    LockLost,
    LockStoreUnavailable,
    OuterTransactionError,
    StepNotFound,
    TransitionConflict,
)
from celery_steplock.lock import get_lease_store
from django_app.workflows.admin import StepAdmin
from django_app.workflows.models import ArchivableStep, Step, TransitionRecord
from django_app.workflows.tasks import advance
from tests.helpers import closed_port_url, set_settings
from tests.support.loop import LagProbe

pytestmark = pytest.mark.django_db(transaction=True)


class _FormValues(HTMLParser):
    """The values a browser would submit from the page's main form (inputs, selects,
    textareas; buttons and unchecked boxes left out)."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, str] = {}
        self._select: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        name = a.get("name")
        if tag == "input" and name and a.get("type") not in ("submit", "button", "file"):
            if a.get("type") in ("checkbox", "radio") and "checked" not in a:
                return
            self.values[name] = a.get("value") or ""
        elif tag == "select" and name:
            self._select = name
            self.values.setdefault(name, "")
        elif tag == "option" and self._select and "selected" in a:
            self.values[self._select] = a.get("value") or ""
        elif tag == "textarea" and name:
            self._textarea = name
            self.values[name] = ""

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data):
        if self._textarea:
            self.values[self._textarea] += data


def form_values(response) -> dict[str, str]:
    parser = _FormValues()
    parser.feed(response.content.decode())
    values = parser.values
    values.pop("csrfmiddlewaretoken", None)
    return values


@pytest.fixture
def steps_app(app, redis_client):
    """The example project's Celery app on a flushed Redis; tasks run in this process."""
    app.conf.steplock_retry_backoff = 0.01
    return app


def test_a_stale_admin_save_cannot_undo_a_committed_transition(steps_app, admin_client):
    """Before: the change form, opened before the task committed and saved after it, wrote
    back ``pending`` and a NULL fence, and a redelivery of the same message committed
    ``pending -> done`` a second time (two TransitionRecords). Now the status and the guard
    columns are read-only, the save goes through the guarded transition, and the redelivery
    is a duplicate."""
    step = Step.objects.create(name="ship")
    url = reverse("admin:workflows_step_change", args=(step.pk,))
    page = admin_client.get(url)
    assert page.status_code == 200
    stale = form_values(page)

    first = advance.apply(args=(step.pk,), task_id="message-1")
    assert first.successful(), first.traceback
    step.refresh_from_db()
    committed = (step.status, step.lock_owner, step.lock_fence)
    assert committed[0] == "done" and committed[2] is not None

    stale["name"] = "ship (renamed)"
    saved = admin_client.post(url, stale)
    assert saved.status_code == 302, saved.content.decode()[:2000]
    step.refresh_from_db()
    assert step.name == "ship (renamed)"
    assert (step.status, step.lock_owner, step.lock_fence) == committed

    # The redelivery of the winner's own task id ends in Ignore (the same-id rule); its
    # body must not have run again.
    advance.apply(args=(step.pk,), task_id="message-1")
    assert TransitionRecord.objects.filter(step=step).count() == 1
    step.refresh_from_db()
    assert step.status == "done" and step.lock_fence == committed[2]


# -- the guarded transition ------------------------------------------------------------------


def names(events):
    return [name for name, _ in events]


def _from_asyncio(*args, **kwargs):
    """``aguarded_transition`` from a fresh event loop: its database part runs on a thread
    (and a connection) of its own."""
    return asyncio.run(aguarded_transition(*args, **kwargs))


@pytest.fixture(params=["sync", "async"])
def guarded(request):
    """The guarded transition in both forms (issue 27): ``guarded_transition``, and
    ``aguarded_transition`` run by ``asyncio.run``; the same arguments, answers, errors
    and signals."""
    return guarded_transition if request.param == "sync" else _from_asyncio


def test_an_applied_transition_holds_the_tasks_lease_and_commits_before_release(
    guarded, steps_app, events
):
    step = Step.objects.create(name="s")
    result = guarded(Step, str(step.pk), "pending", "cancelled", task=advance)
    assert result.applied and result.step_id == step.pk and result.to == "cancelled"
    step.refresh_from_db()
    assert step.status == "cancelled" and step.lock_fence == result.fence
    assert len(step.lock_owner) == 32
    assert names(events) == ["lock_acquired", "transition_applied", "lock_released"]
    applied = dict(events)["transition_applied"]
    assert applied["name"] == f"step:{step.pk}" and applied["task_name"] == DEFAULT_ACTOR
    assert applied["task_id"] is None and applied["fence"] == result.fence
    assert (applied["from_"], applied["to"], applied["step_id"]) == (
        "pending",
        "cancelled",
        step.pk,
    )
    assert get_lease_store(steps_app).inspect(f"step:{step.pk}") is None


def test_a_task_after_the_guarded_transition_is_a_duplicate(guarded, steps_app):
    step = Step.objects.create(name="s")
    guarded(Step, step.pk, "pending", "cancelled", task=advance)
    result = advance.apply(args=(step.pk,))
    assert result.successful() and result.result["steplock"] == "duplicate"
    assert TransitionRecord.objects.filter(step=step).count() == 0


def test_a_conflict_raises_or_returns_and_writes_nothing(guarded, steps_app, events):
    step = Step.objects.create(name="s", status="done")
    with pytest.raises(TransitionConflict) as info:
        guarded(Step, step.pk, "pending", "cancelled", task=advance)
    assert info.value.current == "done" and not info.value.stale_fence
    assert names(events) == ["lock_acquired", "transition_conflict", "lock_released"]
    events.clear()
    result = guarded(Step, step.pk, "pending", "cancelled", task=advance, on_conflict="return")
    assert not result.applied and result.current == "done"
    assert names(events) == ["lock_acquired", "transition_conflict", "lock_released"]
    step.refresh_from_db()
    assert (step.status, step.lock_owner, step.lock_fence) == ("done", "", None)
    with pytest.raises(ImproperlyConfigured) as bad:
        guarded(Step, step.pk, "pending", "x", task=advance, on_conflict="skip")
    assert bad.value.setting == "on_conflict"


def test_a_busy_lease_is_contended_and_nothing_runs(guarded, steps_app, events):
    step = Step.objects.create(name="s")
    store = get_lease_store(steps_app)
    assert store.acquire(f"step:{step.pk}", "a-worker", 30.0) is not None
    with pytest.raises(LockContended) as info:
        guarded(Step, step.pk, "pending", "cancelled", task=advance, wait=0.2)
    assert info.value.holder == "a-worker" and info.value.name == f"step:{step.pk}"
    assert names(events) == ["lock_contended"]
    assert dict(events)["lock_contended"]["holder"] == "a-worker"
    step.refresh_from_db()
    assert step.status == "pending" and step.lock_fence is None


def test_a_lease_lost_before_commit_rolls_the_whole_block_back(steps_app, events):
    step = Step.objects.create(name="s")
    with pytest.raises(LockLost):
        with guarded_step(Step, step.pk, task=advance) as guarded:
            assert guarded.status() == "pending"
            Step.objects.filter(pk=step.pk).update(name="renamed in the block")
            assert guarded.transition("pending", "running")
            # Another owner takes the key (an expiry and a new holder, or a force release).
            guarded.store.client.hset(guarded.lease.key, mapping={"owner": "thief"})
    step.refresh_from_db()
    assert (step.name, step.status, step.lock_fence) == ("s", "pending", None)
    assert "transition_applied" not in names(events)
    assert names(events)[-1] == "lock_lost"


def test_an_async_block_is_one_transaction_its_own_async_orm_calls_included(steps_app, events):
    """``async with aguarded_step(...)``: the block's own async ORM calls (thread-sensitive
    hops) run on the block's thread, inside its transaction: a lease lost before COMMIT
    rolls them back with the transition, as the sync block does; a block that ends well
    commits both, then releases the lease."""
    step = Step.objects.create(name="s")

    async def lost():
        async with aguarded_step(Step, step.pk, task=advance) as held:
            assert isinstance(held, AsyncGuardedStep)
            assert await held.astatus() == "pending"
            await Step.objects.filter(pk=step.pk).aupdate(name="renamed in the block")
            assert (await held.atransition("pending", "running")).applied
            await held._astore.client.hset(held.lease.key, mapping={"owner": "thief"})

    with pytest.raises(LockLost):
        asyncio.run(lost())
    step.refresh_from_db()
    assert (step.name, step.status, step.lock_fence) == ("s", "pending", None)
    assert "transition_applied" not in names(events) and names(events)[-1] == "lock_lost"

    step = Step.objects.create(name="s")  # the other's lease is the thief's now

    async def kept():
        async with aguarded_step(Step, step.pk, task=advance) as held:
            await Step.objects.filter(pk=step.pk).aupdate(name="renamed")
            result = await held.atransition("pending", "running")
        return result

    events.clear()
    result = asyncio.run(kept())
    step.refresh_from_db()
    assert (step.name, step.status, step.lock_fence) == ("renamed", "running", result.fence)
    assert names(events) == ["lock_acquired", "transition_applied", "lock_released"]
    assert get_lease_store(steps_app).inspect(f"step:{step.pk}") is None


def test_an_async_wait_for_a_busy_step_never_blocks_the_loop(steps_app):
    """A task's lease holds the step; ``aguarded_transition`` waits for it on the loop (the
    async store's wait) while a probe task of the loop sleeping 5 ms at a time keeps
    running: its largest overshoot stays under 50 ms, and the transition applies once the
    holder releases (its fencing token after the holder's)."""
    step = Step.objects.create(name="s")
    store = get_lease_store(steps_app)
    holder = store.acquire(f"step:{step.pk}", "a-worker", 30.0)

    async def scenario():
        async def holder_releases():
            await asyncio.sleep(0.5)
            await asyncio.to_thread(store.release, holder.name, holder.owner)

        async with LagProbe() as probe:
            releasing = asyncio.ensure_future(holder_releases())
            result = await aguarded_transition(
                Step, step.pk, "pending", "cancelled", task=advance, wait=5
            )
        await releasing
        return result, probe.max_lag, probe.ticks

    result, lag, ticks = asyncio.run(scenario())
    assert result.applied and result.fence > holder.fence
    assert ticks >= 40 and lag < 0.05, (lag, ticks)


def test_a_cancelled_async_writer_leaves_no_lease_and_no_write(steps_app, events):
    """Cancelled while it waits for the task's lease: nothing of it stays (the task still
    holds its lease). Cancelled inside its block: the block's writes roll back and its
    lease is released (not left to its TTL)."""
    step = Step.objects.create(name="s")
    store = get_lease_store(steps_app)
    holder = store.acquire(f"step:{step.pk}", "a-worker", 30.0)

    async def waits():
        task = asyncio.ensure_future(
            aguarded_transition(Step, step.pk, "pending", "cancelled", task=advance, wait=5)
        )
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(waits())
    assert store.inspect(f"step:{step.pk}")["owner"] == "a-worker"
    assert store.release(holder.name, holder.owner)

    async def holds():
        entered = asyncio.Event()

        async def block():
            async with aguarded_step(Step, step.pk, task=advance) as held:
                await held.atransition("pending", "running")
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.ensure_future(block())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    events.clear()
    asyncio.run(holds())
    step.refresh_from_db()
    assert (step.status, step.lock_fence) == ("pending", None)
    assert store.inspect(f"step:{step.pk}") is None
    assert names(events) == ["lock_acquired", "lock_released"]


def test_a_row_with_a_newer_fence_loses_the_lease(guarded, steps_app):
    step = Step.objects.create(name="s", lock_fence=2**62)
    with pytest.raises(LockLost):
        guarded(Step, step.pk, "pending", "cancelled", task=advance)
    step.refresh_from_db()
    assert step.status == "pending" and step.lock_fence == 2**62


def test_an_unreachable_lock_store_fails_closed(guarded, steps_app, events):
    step = Step.objects.create(name="s")
    set_settings(steps_app, steplock_redis_url=closed_port_url(), steplock_socket_timeout=0.5)
    with pytest.raises(LockStoreUnavailable):
        guarded(Step, step.pk, "pending", "cancelled", lock_name=f"step:{step.pk}")
    assert names(events) == ["lock_store_error"]
    assert dict(events)["lock_store_error"]["policy"] == "fail_closed"
    step.refresh_from_db()
    assert step.status == "pending"


def test_refusals_before_any_lease(steps_app, redis_client):
    step = Step.objects.create(name="s")
    with pytest.raises(OuterTransactionError, match="non_atomic_requests"):
        with transaction.atomic():
            guarded_transition(Step, step.pk, "pending", "cancelled", task=advance)
    with pytest.raises(InvalidTransition):
        guarded_transition(
            Step, step.pk, "pending", "done", task=advance, transitions={"pending": ["running"]}
        )
    with pytest.raises(StepNotFound):
        guarded_transition(Step, step.pk + 1000, "pending", "cancelled", task=advance)
    # The async form called from sync code inside a block (async_to_sync: its hops go to
    # this thread, whose atomic() it sees), and entered without `async with`.
    with pytest.raises(OuterTransactionError, match="non_atomic_requests"):
        with transaction.atomic():
            async_to_sync(aguarded_transition)(Step, step.pk, "pending", "cancelled", task=advance)
    with pytest.raises(InvalidTransition):
        asyncio.run(
            aguarded_transition(
                Step,
                step.pk,
                "pending",
                "done",
                task=advance,
                transitions={"pending": ["running"]},
            )
        )
    with pytest.raises(StepNotFound):
        asyncio.run(
            aguarded_transition(Step, step.pk + 1000, "pending", "cancelled", task=advance)
        )
    with pytest.raises(InvalidArgument, match="async with"):
        with aguarded_step(Step, step.pk, task=advance):
            pass
    assert list(redis_client.scan_iter("steplock:lease:*")) == []


def test_the_lock_name_is_the_tasks(steps_app):
    assert step_lock_name(Step, "7", task=advance) == "step:7"
    assert step_lock_name(Step, 7, task=advance.name) == "step:7"
    # Derived from the app's tasks when their lock_key names only the step.
    assert step_lock_name("routing.Invoice", 5) == "invoice:5"
    # No task guards this model: the caller must name the lease.
    with pytest.raises(ImproperlyConfigured) as info:
        step_lock_name(ArchivableStep, 1)
    assert info.value.setting == "lock_name"
    with pytest.raises(ImproperlyConfigured) as other:
        step_lock_name(ArchivableStep, 1, task=advance)
    assert other.value.setting == "task"


# -- the admin ---------------------------------------------------------------------------------


def test_the_admin_changes_the_status_through_the_guarded_transition(
    steps_app, admin_client, events
):
    step = Step.objects.create(name="s")
    url = reverse("admin:workflows_step_change", args=(step.pk,))
    values = form_values(admin_client.get(url))
    assert "status" not in values and "lock_fence" not in values and "lock_owner" not in values
    assert values["steplock_seen_status"] == "pending"
    values["steplock_transition"] = "cancelled"
    response = admin_client.post(url, values)
    assert response.status_code == 302
    step.refresh_from_db()
    assert step.status == "cancelled" and step.lock_fence is not None
    applied = dict(events)["transition_applied"]
    assert applied["task_name"] == "admin:admin" and applied["fence"] == step.lock_fence


def test_the_change_page_links_the_steps_lease_history_for_lease_viewers(
    steps_app, admin_client, django_user_model
):
    step = Step.objects.create(name="s")
    url = reverse("admin:workflows_step_change", args=(step.pk,))
    page = admin_client.get(url).content.decode()
    timeline = reverse("admin:celery_steplock_lease_timeline")
    assert "Lease history" in page
    assert f'<a href="{timeline}?name=step%3A{step.pk}">step:{step.pk}</a>' in page
    # Lock names are for users who may view leases: a step editor without it sees none.
    from django.contrib.auth.models import Permission

    editor = django_user_model.objects.create_user("editor", password="pw", is_staff=True)
    editor.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_step", "change_step"])
    )
    admin_client.force_login(editor)
    page = admin_client.get(url)
    assert page.status_code == 200
    assert "Lease history" not in page.content.decode() and timeline not in page.content.decode()
    values = form_values(page)
    assert values["steplock_seen_status"] == "pending"  # the form is unchanged


def test_a_stale_status_change_in_the_admin_is_refused_whole(steps_app, admin_client):
    step = Step.objects.create(name="s")
    url = reverse("admin:workflows_step_change", args=(step.pk,))
    values = form_values(admin_client.get(url))
    assert advance.apply(args=(step.pk,)).successful()
    values.update(name="renamed", steplock_transition="cancelled")
    response = admin_client.post(url, values, follow=True)
    assert "Nothing was saved: its status is now &#x27;done&#x27;" in response.content.decode()
    step.refresh_from_db()
    assert (step.name, step.status) == ("s", "done")


def test_the_admin_waits_for_no_task_holding_the_step(steps_app, admin_client):
    step = Step.objects.create(name="s")
    url = reverse("admin:workflows_step_change", args=(step.pk,))
    values = form_values(admin_client.get(url))
    get_lease_store(steps_app).acquire(f"step:{step.pk}", "a-worker", 30.0)
    values["name"] = "renamed"
    response = admin_client.post(url, values, follow=True)
    assert "the step is being changed right now" in response.content.decode()
    step.refresh_from_db()
    assert step.name == "s"


def test_a_view_only_user_sees_the_step_without_the_status_change(
    steps_app, client, django_user_model
):
    from django.contrib.auth.models import Permission

    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_step"))
    client.force_login(user)
    step = Step.objects.create(name="s")
    page = client.get(reverse("admin:workflows_step_change", args=(step.pk,)))
    assert page.status_code == 200
    assert "steplock_transition" not in form_values(page)


# -- the check and the example command ---------------------------------------------------------


def test_w008_names_a_step_model_saved_by_a_plain_model_admin(steps_app):
    site = django_admin.AdminSite(name="plain")
    site.register(Step, django_admin.ModelAdmin)
    warnings = check_step_admins(steps_app, sites=[site])
    assert [w.id for w in warnings] == ["celery_steplock.W008"]
    assert warnings[0].obj is Step and "GuardedStepAdminMixin" in warnings[0].hint
    assert "workflows.Step" in warnings[0].msg and "lock_fence" in warnings[0].msg

    guarded = django_admin.AdminSite(name="guarded")
    guarded.register(Step, StepAdmin)
    assert check_step_admins(steps_app, sites=[guarded]) == []
    assert issubclass(StepAdmin, GuardedStepAdminMixin)
    # The example project's own admin site passes.
    assert check_step_admins(steps_app, sites=[django_admin.site]) == []


def test_the_example_command_cancels_under_the_lease(steps_app, capsys):
    step = Step.objects.create(name="s")
    call_command("cancel_step", str(step.pk))
    step.refresh_from_db()
    assert step.status == "cancelled" and step.lock_fence is not None
    with pytest.raises(CommandError, match="is cancelled, not pending"):
        call_command("cancel_step", str(step.pk))
    other = Step.objects.create(name="t")
    get_lease_store(steps_app).acquire(f"step:{other.pk}", "a-worker", 30.0)
    with pytest.raises(CommandError, match="being worked on"):
        call_command("cancel_step", str(other.pk))
