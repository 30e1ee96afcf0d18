"""Example Django project for celery-steplock.

The Celery app is imported here so that it is loaded when Django starts and
``@shared_task`` binds to it (the layout the Celery "First steps with Django"
guide recommends).
"""

from .celery import app as celery_app

__all__ = ("celery_app",)
