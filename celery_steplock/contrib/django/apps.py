"""Django integration: the "Held leases" admin page, the reaper command, system checks and
the optional durable lease event log. Add ``"celery_steplock.contrib.django"`` to
``INSTALLED_APPS``."""

from django.apps import AppConfig


class StepLockConfig(AppConfig):
    """App config of ``celery_steplock.contrib.django`` (label ``celery_steplock``)."""

    name = "celery_steplock.contrib.django"
    label = "celery_steplock"
    verbose_name = "Step locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        from ... import activity, ops
        from . import checks, eventlog

        # celery_steplock.E001-E004, W001-W005 (E001, which connects to Redis, only with
        # `manage.py check --deploy`).
        checks.register_checks()
        # The receivers read steplock_event_log at every event, so connecting them always
        # costs nothing while the log is off and lets the setting change at run time.
        eventlog.connect()
        # The operators' tools (force release, breaker overrides) audit into LeaseEvent.
        ops.register_audits(eventlog.LeaseEventAudit, eventlog.LeaseEventBreakerAudit)
        # The per-minute counts the admin's Activity page draws, in the web process and in
        # every worker that sets Django up (off by default: steplock_activity, which the
        # flusher reads every interval; off, an event costs one attribute read).
        activity.install()
