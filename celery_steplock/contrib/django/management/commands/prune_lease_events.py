"""``manage.py prune_lease_events [--days N] [--dry-run]``: retention of the lease event log.

Deletes :class:`~celery_steplock.contrib.django.models.LeaseEvent` rows older than ``--days``
(default: ``CELERY_STEPLOCK_EVENT_RETENTION`` seconds, 7 days) in one ``DELETE``; run it from
cron like ``clearsessions``. ``--dry-run`` only counts them. Prints one summary line
(verbosity >= 1).
"""

from __future__ import annotations

import argparse
import math

from django.core.management.base import BaseCommand, CommandError

from celery_steplock.contrib.django.eventlog import prune_lease_events
from celery_steplock.exceptions import ImproperlyConfigured


def _days(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 days, got {text}")
    return value


class Command(BaseCommand):
    help = (
        "Delete lease event log rows (LeaseEvent) older than the retention "
        "(CELERY_STEPLOCK_EVENT_RETENTION, default 7 days)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--days",
            type=_days,
            default=None,
            metavar="N",
            help="delete events older than N days (fractions allowed; default "
            "CELERY_STEPLOCK_EVENT_RETENTION)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="count the events that would be deleted, delete nothing",
        )

    def handle(self, *args, **options):
        seconds = None if options["days"] is None else options["days"] * 86400.0
        try:
            count = prune_lease_events(seconds, dry_run=options["dry_run"])
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if options["verbosity"] >= 1:
            verb = "Would delete" if options["dry_run"] else "Deleted"
            self.stdout.write(f"{verb} {count} lease event(s).")
