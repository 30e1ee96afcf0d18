"""The example project's Celery app with celery_steplock.contrib.prometheus installed:
``celery -A tests.support.prometheus_app worker`` serves ``/metrics`` on
``STEPLOCK_METRICS_PORT`` from the worker's main process."""

import os

from celery_steplock.contrib import prometheus
from django_app.celery import app

__all__ = ["app"]

prometheus.install(app, port=int(os.environ["STEPLOCK_METRICS_PORT"]))
