"""Step models of the routing tests: the same shape, three homes (see the package).

``attempts`` and ``note`` are written by the tasks' bodies through the router, inside the
step's transaction: a body whose transaction rolled back leaves them as they were, so
``attempts`` counts the committed bodies.
"""

from django.db import models

from celery_steplock.contrib.django.mixins import LeaseFencedStep


class RoutedStep(LeaseFencedStep):
    status = models.CharField(max_length=32, default="pending", db_index=True)
    attempts = models.PositiveIntegerField(default=0)
    note = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        abstract = True
        ordering = ("id",)

    def __str__(self):
        return f"{type(self).__name__} #{self.pk} [{self.status}]"


class Invoice(RoutedStep):
    """On ``default``; a router may send its reads to ``replica``."""


class Parcel(RoutedStep):
    """Only on ``other``."""


class Ledger(RoutedStep):
    """On ``default`` and ``other``; no router has an opinion on it."""
