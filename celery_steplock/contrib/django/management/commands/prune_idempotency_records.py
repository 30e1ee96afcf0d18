"""``manage.py prune_idempotency_records [--older-than SECONDS] [--batch-size N] [--dry-run]``:
delete the database store's expired idempotency records.

An :class:`~celery_steplock.contrib.django.models.IdempotencyRecord` row past its
``expires_at`` already counts as absent, but nothing deletes it: run this from cron (like
``clearsessions``) with ``steplock_idempotency_store = "database"``. Rows are deleted in
batches of ``--batch-size`` (default 1000), each one short transaction
(:func:`celery_steplock.contrib.django.idempotency.prune_expired_records`). ``--dry-run``
only counts them. Prints one summary line (verbosity >= 1).
"""

from __future__ import annotations

import argparse
import math

from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from celery_steplock.contrib.django.idempotency import prune_expired_records
from celery_steplock.exceptions import ImproperlyConfigured


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _batch(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 100_000:
        raise argparse.ArgumentTypeError(f"must be from 1 to 100000, got {text}")
    return value


class Command(BaseCommand):
    help = (
        "Delete expired idempotency records (IdempotencyRecord rows past expires_at) of the "
        "database store, in batches."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than",
            type=_seconds,
            default=0.0,
            metavar="SECONDS",
            help="delete rows expired for more than SECONDS (default 0: every expired row)",
        )
        parser.add_argument(
            "--batch-size",
            type=_batch,
            default=1000,
            metavar="N",
            help="rows per DELETE, each in its own transaction (1 to 100000; default 1000)",
        )
        parser.add_argument(
            "--database",
            default=None,
            help="database alias (default: the router's for IdempotencyRecord)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="count the rows that would be deleted, delete nothing",
        )

    def handle(self, *args, **options):
        using = options["database"]
        if using is not None and using not in connections:
            raise CommandError(
                f"--database {using!r} is not a database alias; DATABASES has: "
                f"{', '.join(sorted(connections.settings))}"
            )
        try:
            rows, batches = prune_expired_records(
                older_than=options["older_than"],
                batch_size=options["batch_size"],
                dry_run=options["dry_run"],
                using=options["database"],
            )
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        if options["verbosity"] >= 1:
            if options["dry_run"]:
                self.stdout.write(f"Would delete {rows} expired idempotency record(s).")
            else:
                self.stdout.write(
                    f"Deleted {rows} expired idempotency record(s) in {batches} batch(es)."
                )
