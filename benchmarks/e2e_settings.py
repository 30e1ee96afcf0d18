"""Django settings of the end-to-end benchmark: the example project's (``django_app.settings``,
so ``DATABASE_URL`` / ``STEPLOCK_*`` / ``REDIS_URL`` work as documented there) with three
changes that keep the measurement about locking:

* no result backend (``django-db`` would add an INSERT and an UPDATE of a TaskResult row to
  every task of every kind);
* the worker keeps its database connection between tasks (Celery's Django fix-up otherwise
  closes it before and after every task, and each task would pay a reconnect);
* ``celery_steplock`` logs at WARNING unless ``STEPLOCK_LOG_LEVEL`` says otherwise (INFO writes
  three event lines per task).
"""

import os

os.environ.setdefault("STEPLOCK_LOG_LEVEL", "WARNING")

from django_app.settings import *  # noqa: E402,F401,F403

CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
CELERY_DB_REUSE_MAX = 10**9
