"""Columns that let the compare-and-swap refuse a stale lease holder.

Subclass :class:`LeaseFencedStep` in the step model (or declare the same two fields)::

    class Order(LeaseFencedStep):
        status = models.CharField(max_length=32, default="pending")

With them, :class:`~celery_steplock.contrib.django.steps.DjangoStepStore` adds
``lock_fence IS NULL OR lock_fence <= <token>`` to its ``UPDATE`` and writes the token and the owner, so a holder that
paused past its TTL cannot write after a newer holder has, even when the status would match
(fencing token, as in Kleppmann 2016). The names are the defaults of the settings
``steplock_owner_field`` and ``steplock_fence_field``.
"""

from django.db import models


class LeaseFencedStep(models.Model):
    """Abstract model: ``lock_owner`` (the owner token of the attempt that wrote the row last,
    max 64 characters, blank when none) and ``lock_fence`` (its fencing token, a 64-bit
    integer, NULL before the first fenced write)."""

    lock_owner = models.CharField(max_length=64, blank=True, default="")
    lock_fence = models.BigIntegerField(null=True, blank=True)

    class Meta:
        abstract = True
