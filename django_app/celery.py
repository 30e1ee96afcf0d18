"""Celery application of the example project.

Every ``CELERY_*`` Django setting becomes a lowercase Celery setting, so
``CELERY_STEPLOCK_DEFAULT_TTL`` is read by the library as
``app.conf.steplock_default_ttl``.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_app.settings")

# STEPLOCK_RESULT_BACKEND (a result backend URL) overrides CELERY_RESULT_BACKEND: the suite
# runs its group/chord/chain test on Redis's backend too.
app = Celery("django_app", backend=os.environ.get("STEPLOCK_RESULT_BACKEND") or None)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
