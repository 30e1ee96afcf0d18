"""Step recovery for the reaper: the Django ORM side of its pass 2.

The core reaper (:mod:`celery_steplock.reaper`) knows no ORM: it loads its step recovery
through a qualified name, by default :data:`celery_steplock.reaper.DEFAULT_STEP_RECOVERY`
(``"celery_steplock.contrib.django.recovery:recover_steps"``), and only when
``steplock_reaper_recover`` names models. :func:`recover_steps` is that default.

For every model of ``steplock_reaper_recover`` (``{"app_label.Model": {"running":
"pending"}}``), rows in an in-flight status whose owner column (``steplock_owner_field``,
default ``lock_owner``) is not the owner of a live lease, that no live lease names as its
``step``, and that have been in flight for more than ``older_than`` seconds (measured on
``updated_at`` when the model has it), are moved to their recovery status by
compare-and-swap (the age is measured from the row's last ``save()``: ``QuerySet.update``,
which the library's CAS uses, leaves ``auto_now`` columns alone, so it can exceed the time
actually spent in flight; the live-owner check, not the age, is what protects a working
holder)::

    UPDATE ... SET status=<recovery>, lock_owner='' WHERE pk=? AND status=<in flight>
                                                       AND lock_owner=<observed owner>

The fence column is left as it is, so a stale holder that wakes up still cannot write (its
token is not above the one recorded). The rows are read *before* the reaper's scan: a holder
writes its owner into a row only while it holds the lease, so an owner that is live when the
row is read is still seen by the scan that follows (or has released, which makes it not
live). Each recovery sends ``lock_expired`` with ``step_id``/``from_``/``to`` once its update
commits. Rows with an empty owner (written by code outside the library) are left alone.

Database: the rows are read and moved on the step model's write database, never on a
replica a router sends reads to (a lagging replica would hide in-flight rows, or show rows
that moved on long ago): the ``step_database`` of each registered task of that model, else
``steplock_step_database``, else the router's ``db_for_write``. A model that tasks write on
several databases is recovered on each of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from datetime import timezone as dt_timezone
from functools import partial
from typing import Any

from django.apps import apps as django_apps
from django.conf import settings as django_settings
from django.core.exceptions import FieldDoesNotExist
from django.db import DEFAULT_DB_ALIAS, DatabaseError, router, transaction
from django.utils import timezone

from ... import signals
from ...events import emit, log_event
from ...exceptions import ImproperlyConfigured, StepLockError
from .steps import resolve_model

__all__ = ["recover_steps", "StepRecovery", "AGE_FIELD"]

logger = logging.getLogger("celery_steplock")

#: The column whose age ``older_than`` is measured on, when the step model has it.
AGE_FIELD = "updated_at"


@dataclass
class _Candidates:
    """Rows of one model in an in-flight status, read before the scan."""

    label: str
    model: Any
    status_field: str
    owner_field: str
    moves: dict[str, str]
    rows: list[tuple[Any, str, str]]
    auto_now_field: str | None
    using: str = DEFAULT_DB_ALIAS


class StepRecovery:
    """The in-flight rows of one reaper run, read before its scan.

    ``owners`` and ``steps`` (``"app_label.model:pk"``) are what the scan must report on;
    :meth:`recover` moves the orphaned rows once it has.
    """

    def __init__(self, run, candidates: list[_Candidates]) -> None:
        self.run = run
        self.candidates = candidates
        self.owners: set[str] = set()
        self.steps: set[str] = set()
        for group in candidates:
            label_lower = group.model._meta.concrete_model._meta.label_lower
            for pk, _status, owner in group.rows:
                self.owners.add(owner)
                self.steps.add(f"{label_lower}:{pk}")

    def recover(
        self, live_owners: set[str], live_steps: set[str], dead: dict[str, dict[str, Any]]
    ) -> None:
        """Move orphaned in-flight rows to their recovery status by compare-and-swap.

        ``live_owners``: owners of live leases; ``live_steps``: steps a live lease names (a
        new attempt holding it protects the row even if the row still shows a dead owner:
        that attempt will move it on); ``dead``: the reaped leases by owner (as
        ``ReapReport.leases_reaped`` lists them).
        """
        run = self.run
        for group in self.candidates:
            label_lower = group.model._meta.concrete_model._meta.label_lower
            using = group.using
            manager = group.model._base_manager.db_manager(using)
            for pk, status, owner in group.rows:
                if owner in live_owners or f"{label_lower}:{pk}" in live_steps:
                    continue
                to = group.moves[status]
                lease = dead.get(owner)
                reason = (
                    f"its owner's lease {lease['name']} was reaped ({lease['reason']})"
                    if lease
                    else "no live lease is held by its owner"
                )
                info = {
                    "model": group.label,
                    "pk": pk,
                    "from_": status,
                    "to": to,
                    "owner": owner,
                    "lease": lease["name"] if lease else None,
                    "reason": reason,
                }
                if not run.dry_run:
                    updates = {group.status_field: to, group.owner_field: ""}
                    if group.auto_now_field:
                        updates[group.auto_now_field] = timezone.now()  # type: ignore[assignment]
                    try:
                        # CAS on what was observed: a row moved on or re-claimed since (new
                        # status or owner) is not touched. The fence column stays as it is,
                        # so the dead holder, should it wake up, still cannot write.
                        changed = manager.filter(
                            **{"pk": pk, group.status_field: status, group.owner_field: owner}
                        ).update(**updates)
                    except DatabaseError as exc:
                        run.error(f"could not recover {group.label} pk={pk}: {exc}")
                        continue
                    if changed != 1:
                        continue
                    transaction.on_commit(
                        partial(
                            emit,
                            signals.lock_expired,
                            run.sender((lease or {}).get("task_name")),
                            logging.WARNING,
                            key=lease["key"] if lease else None,
                            name=lease["name"] if lease else None,
                            owner=owner,
                            fence=lease["fence"] if lease else None,
                            task_id=lease["task_id"] if lease else None,
                            task_name=lease["task_name"] if lease else None,
                            ttl=None,
                            step_id=pk,
                            step=f"{label_lower}:{pk}",
                            model=group.label,
                            from_=status,
                            to=to,
                            reason=f"step recovered: {reason}",
                        ),
                        using=using,
                    )
                run.report.add_recovered(info)


def recover_steps(run) -> StepRecovery | None:
    """Read the in-flight rows of every ``steplock_reaper_recover`` model for one reaper
    ``run`` (a :class:`celery_steplock.reaper.Reaper`); returns the :class:`StepRecovery`,
    or None when Django is not set up (logged: no step is recovered).

    Reads ``run.recover`` (the validated setting), ``run.settings`` (status and owner
    columns, ``reaper_older_than``), ``run.older_than``, ``run.now``, ``run.batch_size``;
    reports problems (a model without the owner column, a database error) with
    ``run.error`` and goes on with the other models.
    """
    if not django_apps.ready:
        log_event(
            "reaper_no_django",
            logging.WARNING,
            reason="steplock_reaper_recover is set but Django is not set up: no step is recovered",
        )
        return None
    settings = run.settings
    older_than = run.older_than if run.older_than is not None else settings.reaper_older_than
    now = run.now or timezone.now()
    if timezone.is_naive(now):
        now = now.replace(tzinfo=dt_timezone.utc)
    found = []
    for label, moves in run.recover.items():
        try:
            model = resolve_model(label, "steplock_reaper_recover")
            status_field = settings.status_field
            owner_field = settings.owner_field
            for name in (status_field, owner_field):
                model._meta.get_field(name)
        except FieldDoesNotExist as exc:
            run.error(
                f"steplock_reaper_recover: {label} cannot be recovered: {exc} (the "
                f"owner column tells an orphaned row from a live one)"
            )
            continue
        except StepLockError as exc:
            run.error(str(exc))
            continue
        age = _age_field(model)
        if age is None and older_than > 0:
            # Recovering at once would move steps a live multi-phase flow is between phases
            # of: refuse, rather than ignore the grace the operator asked for.
            run.error(
                f"steplock_reaper_older_than={older_than:g} needs an {AGE_FIELD!r} "
                f"column (auto_now=True) on {label}: its steps are not recovered"
            )
            continue
        try:
            aliases = _databases(run, model)
        except StepLockError as exc:
            run.error(f"steplock_reaper_recover: {label}: {exc}")
            continue
        query = {f"{status_field}__in": sorted(moves)}
        if age is not None and older_than > 0:
            cutoff = now - timedelta(seconds=older_than)
            if not getattr(django_settings, "USE_TZ", True):
                cutoff = timezone.make_naive(cutoff, dt_timezone.utc)
            query[f"{age.name}__lte"] = cutoff  # type: ignore[assignment]
        auto_now = age.name if age is not None and getattr(age, "auto_now", False) else None
        for using in aliases:
            try:
                rows = list(
                    model._base_manager.db_manager(using)
                    .filter(**query)
                    .exclude(**{owner_field: ""})
                    .exclude(**{f"{owner_field}__isnull": True})
                    .order_by("pk")
                    .values_list("pk", status_field, owner_field)
                    .iterator(chunk_size=run.batch_size)
                )
            except DatabaseError as exc:
                where = "" if aliases == [DEFAULT_DB_ALIAS] else f" on database {using!r}"
                run.error(f"could not read in-flight {label} rows{where}: {exc}")
                continue
            found.append(
                _Candidates(
                    label, model, status_field, owner_field, dict(moves), rows, auto_now, using
                )
            )
    return StepRecovery(run, found)


def _databases(run, model) -> list[str]:
    """The write databases of ``model``'s steps, sorted: each registered StepLockedTask's
    ``step_database`` for that model, else ``steplock_step_database``, else the router's
    ``db_for_write``. Raises ImproperlyConfigured for a database not in ``DATABASES``."""
    from ...plan import is_step_locked
    from ...steps import check_known_database
    from .steps import DjangoStepStore

    setting = run.settings.step_database
    fallback = setting or router.db_for_write(model) or DEFAULT_DB_ALIAS
    # Which setting chose each alias, for the error naming the one to fix.
    fallback_from = "steplock_step_database" if setting else "DATABASE_ROUTERS"
    concrete = model._meta.concrete_model
    found: dict[str, str] = {}
    try:
        tasks = list(run.app.tasks.values())
    except RuntimeError:  # an app not finalized: no task to read options from
        tasks = []
    for task in tasks:
        spec = getattr(task, "step_model", None) if is_step_locked(task) else None
        if spec is None:
            continue
        try:
            if resolve_model(spec)._meta.concrete_model is not concrete:
                continue
        except StepLockError:
            continue  # the validator reports it (E002)
        explicit = getattr(task, "step_database", None)
        if isinstance(explicit, str) and explicit:
            found.setdefault(explicit, "step_database")
        else:
            found[fallback] = fallback_from
    found = found or {fallback: fallback_from}
    for using in sorted(found):
        if found[using] == "DATABASE_ROUTERS":
            try:
                check_known_database(DjangoStepStore, using, "DATABASE_ROUTERS")
            except ImproperlyConfigured:
                raise ImproperlyConfigured(
                    f"DATABASE_ROUTERS: the database router sends writes of "
                    f"{model._meta.label} to {using!r}, which is not in DATABASES (set the "
                    f"task's step_database or steplock_step_database, or fix the router)",
                    setting="DATABASE_ROUTERS",
                ) from None
        else:
            check_known_database(DjangoStepStore, using, found[using])
    return sorted(found)


def _age_field(model):
    try:
        return model._meta.get_field(AGE_FIELD)
    except FieldDoesNotExist:
        return None
