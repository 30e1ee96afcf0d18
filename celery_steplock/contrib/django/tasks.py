"""The reaper and the effects relay as Celery tasks, for celery beat.

``celery_steplock.relay_effects`` sends the outbox's due effects (:func:`relay_effects`).

``celery_steplock.reap_expired_leases`` runs :func:`celery_steplock.reaper.reap` and returns its
report as a dict (``ReapReport.as_dict()``). Celery's ``autodiscover_tasks()`` finds this
module once ``"celery_steplock.contrib.django"`` is in ``INSTALLED_APPS``. A beat schedule::

    CELERY_BEAT_SCHEDULE = {
        "steplock-reaper": {
            "task": "celery_steplock.reap_expired_leases",
            "schedule": 60.0,                 # seconds
            "kwargs": {"older_than": 120},    # optional; default the setting
            "options": {"expires": 55},       # a late run is dropped, not queued up
        },
    }

Two runs at once (a second beat, a manual ``manage.py reap_expired_leases``) are harmless:
every change the reaper makes is a compare-and-delete or a compare-and-swap on what it
observed. The task runs in a worker, whose own main process answers the pings, so its own
live leases stay untouched.
"""

from __future__ import annotations

import logging

from celery import shared_task

from celery_steplock.events import log_event
from celery_steplock.reaper import DEFAULT_BATCH_SIZE, DEFAULT_PING_TIMEOUT, reap

logger = logging.getLogger("celery_steplock")


@shared_task(bind=True, name="celery_steplock.reap_expired_leases", ignore_result=False)
def reap_expired_leases(
    self,
    dry_run: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    older_than: float | None = None,
    ping_timeout: float = DEFAULT_PING_TIMEOUT,
    check_pids: bool = True,
    effects: bool = True,
) -> dict:
    """Reap dead owners' leases, recover their steps and relay the effects they left behind;
    returns the report dict.

    Arguments as :func:`celery_steplock.reaper.reap` (seconds for ``older_than`` and
    ``ping_timeout``; ``effects=False`` leaves the outbox to ``celery_steplock.relay_effects``). Errors are in the returned dict (``errors``, ``ok``) and logged at
    ERROR; the task itself succeeds so that beat's next run simply tries again.
    """
    report = reap(
        self.app,
        dry_run=dry_run,
        batch_size=batch_size,
        older_than=older_than,
        ping_timeout=ping_timeout,
        check_pids=check_pids,
        effects=effects,
    )
    for message in report.errors:
        log_event("reaper_error", logging.ERROR, task_id=self.request.id, error=message)
    return report.as_dict()


@shared_task(bind=True, name="celery_steplock.relay_effects", ignore_result=False)
def relay_effects(self, using: str | None = None, limit: int = 500) -> dict:
    """Send the effects of the outbox that are due; returns the report dict.

    :func:`celery_steplock.contrib.django.outbox.relay` (``using``: one database alias, None:
    every database with the ``Effect`` table; ``limit``: rows claimed per database and run),
    its :class:`~celery_steplock.contrib.django.outbox.RelayReport` as a dict. A beat
    schedule::

        "steplock-relay-effects": {
            "task": "celery_steplock.relay_effects",
            "schedule": 10.0,                 # seconds; at most steplock_effect_relay_delay
            "options": {"expires": 9},
        },

    Two runs at once are harmless: each row is claimed by one relay (a compare-and-swap).
    """
    from .outbox import relay

    return relay(using=using, limit=limit, app=self.app).as_dict()
