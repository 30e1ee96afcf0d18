"""``reap_expired_leases``: see :mod:`celery_steplock.reaper`."""
