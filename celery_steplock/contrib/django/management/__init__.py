"""Management commands of celery_steplock.contrib.django."""
