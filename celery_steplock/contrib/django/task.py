"""The Django flavour of the task base: :class:`DjangoStepLockedTask`."""

from __future__ import annotations

import functools

from django.db import DEFAULT_DB_ALIAS, router, transaction

from ..._checks import check_database
from ...conf import Settings
from ...task import StepLockedTask
from .steps import resolve_model

try:
    from celery.contrib.django.task import DjangoTask
except ImportError:  # pragma: no cover - Celery < 5.4
    from celery import Task as DjangoTask  # type: ignore[assignment]

__all__ = ["DjangoStepLockedTask", "commit_database", "delay_on_commit", "apply_async_on_commit"]


def commit_database(task) -> str:
    """The database whose commit ``delay_on_commit`` waits for: the step store's ``using``
    (``step_database``, else ``steplock_step_database``, else the router's write database
    for ``step_model``; the default database for a task without a step model), found
    without building the execution plan (a publisher needs no lease store). Raises
    ImproperlyConfigured for an invalid ``step_model``, ``step_database`` or
    ``steplock_step_database``."""
    if task.step_model is None:
        return DEFAULT_DB_ALIAS
    using = task.step_database
    if using is None:
        using = Settings(task.app).step_database
    else:
        check_database(using, "step_database")
    return using or router.db_for_write(resolve_model(task.step_model)) or DEFAULT_DB_ALIAS


def delay_on_commit(task, *args, **kwargs) -> None:
    """Call ``task.delay(*args, **kwargs)`` once the step database's current transaction
    commits (at once outside one; never after a rollback)."""
    transaction.on_commit(
        functools.partial(task.delay, *args, **kwargs), using=commit_database(task)
    )


def apply_async_on_commit(task, *args, **kwargs) -> None:
    """Call ``task.apply_async(*args, **kwargs)`` once the step database's current
    transaction commits (at once outside one; never after a rollback)."""
    transaction.on_commit(
        functools.partial(task.apply_async, *args, **kwargs), using=commit_database(task)
    )


class DjangoStepLockedTask(StepLockedTask, DjangoTask):
    """:class:`~celery_steplock.task.StepLockedTask` that keeps Celery's ``DjangoTask`` API
    (``delay_on_commit`` / ``apply_async_on_commit``) whatever the app's task class.

    Both publish once the transaction of the step's own database commits (the step store's
    ``using``: ``step_database``, else the router's write database for ``step_model``; the
    default database for a task without a step model), not the default database's: a step
    row created on another database must be committed before a worker can read it. A plain
    ``StepLockedTask`` has the same two methods when the app's task class is ``DjangoTask``
    (a Django project on Celery 5.4+).
    """

    def steplock_commit_database(self) -> str:
        """The database whose commit ``delay_on_commit`` waits for (:func:`commit_database`).
        Raises ImproperlyConfigured for an invalid ``step_model``, ``step_database`` or
        ``steplock_step_database``."""
        return commit_database(self)

    def delay_on_commit(self, *args, **kwargs) -> None:  # type: ignore[override]
        """Call :meth:`~celery.app.task.Task.delay` once the step database's current
        transaction commits (at once outside one)."""
        delay_on_commit(self, *args, **kwargs)

    def apply_async_on_commit(self, *args, **kwargs) -> None:  # type: ignore[override]
        """Call :meth:`~celery.app.task.Task.apply_async` once the step database's current
        transaction commits (at once outside one)."""
        apply_async_on_commit(self, *args, **kwargs)
