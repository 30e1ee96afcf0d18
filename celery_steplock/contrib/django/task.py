"""The Django flavour of the task base: :class:`DjangoStepLockedTask`."""
from __future__ import annotations

from ...task import StepLockedTask

try:
    from celery.contrib.django.task import DjangoTask
except ImportError:  # pragma: no cover - Celery < 5.4
    from celery import Task as DjangoTask

__all__ = ["DjangoStepLockedTask"]


class DjangoStepLockedTask(StepLockedTask, DjangoTask):
    """:class:`~celery_steplock.task.StepLockedTask` that keeps Celery's ``DjangoTask`` API
    (``delay_on_commit`` / ``apply_async_on_commit``)."""
