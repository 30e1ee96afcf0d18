"""Django integration: the "Held leases" admin page, the reaper command, system checks and
the optional durable lease event log. Add ``"celery_steplock.contrib.django"`` to
``INSTALLED_APPS``."""
