"""Models of the example workflow app.

``Step`` is the row a StepLockedTask mutates by compare-and-swap on ``status``;
``lock_owner``/``lock_fence`` are the optional guard columns the library fills
(settings ``steplock_owner_field`` / ``steplock_fence_field``).

``TransitionRecord`` is written *inside* the task body, i.e. in the same DB
transaction as the CAS: a transition that rolls back leaves no record, so the
number of records of a step is the number of committed transitions.
"""

from django.db import models

from celery_steplock.contrib.django.mixins import LeaseFencedStep


class Step(LeaseFencedStep):
    class Status(models.TextChoices):
        PENDING = "pending", "pending"
        RUNNING = "running", "running"
        DONE = "done", "done"
        CANCELLED = "cancelled", "cancelled"
        FAILED = "failed", "failed"

    TERMINAL = (Status.DONE, Status.CANCELLED, Status.FAILED)

    name = models.CharField(max_length=200)
    status = models.CharField(
        max_length=32, choices=Status.choices, default=Status.PENDING, db_index=True
    )
    attempts = models.PositiveIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ("id",)

    def __str__(self):
        return f"Step #{self.pk} {self.name} [{self.status}]"


class TransitionRecord(models.Model):
    step = models.ForeignKey(Step, on_delete=models.CASCADE, related_name="transitions")
    from_status = models.CharField(max_length=32)
    to_status = models.CharField(max_length=32)
    task_name = models.CharField(max_length=200, blank=True, default="")
    task_id = models.CharField(max_length=255, blank=True, default="")
    owner = models.CharField(max_length=64, blank=True, default="")
    fence = models.BigIntegerField(null=True, blank=True)
    hostname = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ("id",)

    def __str__(self):
        return f"{self.step_id}: {self.from_status} -> {self.to_status} (fence {self.fence})"


class VisibleManager(models.Manager):
    """A default manager that hides archived rows (the soft-delete pattern)."""

    def get_queryset(self):
        return super().get_queryset().filter(archived=False)


class ChildStep(Step):
    """Multi-table inheritance: ``status`` and the guard columns live in ``Step``'s table."""

    note = models.CharField(max_length=50, blank=True, default="")


class ArchivableStep(LeaseFencedStep):
    """A step model whose default manager hides archived rows."""

    status = models.CharField(max_length=32, default="pending")
    archived = models.BooleanField(default=False)

    objects = VisibleManager()
    all_objects = models.Manager()
