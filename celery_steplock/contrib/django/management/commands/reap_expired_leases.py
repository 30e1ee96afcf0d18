"""``manage.py reap_expired_leases``: the reaper as a cron job, shaped like ``clearsessions``.

Removes the leases of owners that are gone, recovers the steps they left in flight, and runs
the effects outbox's relay once for the effects a dead process left behind (see
:mod:`celery_steplock.reaper`). Uses the project's Celery app (``celery.current_app``: the
app the project imports in its ``__init__.py``, as Celery's Django guide sets it up).

Options: ``--dry-run`` (report, change nothing), ``--batch-size N`` (SCAN COUNT hint and
database chunk size, default 500), ``--older-than SECONDS`` (how long a step must have been in
flight, default ``CELERY_STEPLOCK_REAPER_OLDER_THAN``), ``--ping-timeout SECONDS`` (default 1),
``--no-effects`` (skip the effects outbox's relay), ``--json`` (the report as one JSON object
on stdout). Human output (verbosity >= 1): what ``celery steplock reap`` prints,
:meth:`~celery_steplock.reaper.ReapReport.human_lines`: one line per reaped lease and recovered
step, then one line per count (leases scanned, reaped, steps recovered, the effects outbox's
line of :meth:`~celery_steplock.reaper.ReapReport.effects_line`, errors, duration). Exit status 1
(``CommandError``) when the run met any error (Redis or the broker unreachable, a database error, a bad setting);
with ``--json`` the report is printed first.
"""

from __future__ import annotations

import argparse
import json

from django.core.management.base import BaseCommand, CommandError

from celery_steplock.reaper import DEFAULT_BATCH_SIZE, DEFAULT_PING_TIMEOUT, reap
from celery_steplock.redact import printable, redact, secrets_of


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str, *, allow_zero: bool = True) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if (
        value != value
        or value in (float("inf"), float("-inf"))
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        raise argparse.ArgumentTypeError(
            f"must be {'>= 0' if allow_zero else '> 0'} seconds, got {text}"
        )
    return value


def _positive_seconds(text: str) -> float:
    return _seconds(text, allow_zero=False)


def celery_app():
    """The project's Celery app (``celery.current_app``)."""
    from celery import current_app

    return current_app._get_current_object()  # type: ignore[attr-defined]


class Command(BaseCommand):
    help = (
        "Remove the Redis leases of Celery workers that are gone (owner-checked: a live "
        "lease is never touched) and move the steps they left in flight back to their "
        "recovery status (CELERY_STEPLOCK_REAPER_RECOVER), then relay the effects they left "
        "in the outbox. Run it from cron or beat."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="report what would be reaped and recovered, change nothing",
        )
        parser.add_argument(
            "--batch-size",
            type=_positive_int,
            default=DEFAULT_BATCH_SIZE,
            metavar="N",
            help=f"SCAN COUNT hint and database chunk size (default {DEFAULT_BATCH_SIZE})",
        )
        parser.add_argument(
            "--older-than",
            type=_seconds,
            default=None,
            metavar="SECONDS",
            help="recover only steps in flight for longer than this (default "
            "CELERY_STEPLOCK_REAPER_OLDER_THAN)",
        )
        parser.add_argument(
            "--ping-timeout",
            type=_positive_seconds,
            default=DEFAULT_PING_TIMEOUT,
            metavar="SECONDS",
            help=f"seconds to wait for workers' ping replies (default {DEFAULT_PING_TIMEOUT:g})",
        )
        parser.add_argument(
            "--no-pid-check",
            action="store_true",
            help="judge leases by their worker's ping only, not by their pid "
            "(when this host shares its hostname with other PID "
            "namespaces, e.g. a pod's sidecar)",
        )
        parser.add_argument(
            "--no-effects",
            action="store_true",
            help="do not relay the effects outbox (nor report on it)",
        )
        parser.add_argument(
            "--json", action="store_true", help="print the report as one JSON object"
        )

    def handle(self, *args, **options):
        report = reap(
            celery_app(),
            dry_run=options["dry_run"],
            batch_size=options["batch_size"],
            older_than=options["older_than"],
            ping_timeout=options["ping_timeout"],
            check_pids=not options["no_pid_check"],
            effects=not options["no_effects"],
        )
        if options["json"]:
            self.stdout.write(json.dumps(report.as_dict(), sort_keys=True, default=str))
        elif options["verbosity"] >= 1:
            for line in report.human_lines():  # the format of `celery steplock reap`
                self.stdout.write(line)
        if report.errors:
            errors = [printable(redact(m, secrets_of(celery_app()))) for m in report.errors]
            for message in errors:
                self.stderr.write(f"error: {message}")
            raise CommandError(
                f"reap_expired_leases met {len(errors)} error(s); the first: {errors[0]}"
            )
