from django.apps import AppConfig


class StepLockConfig(AppConfig):
    """App config of ``celery_steplock.contrib.django`` (label ``celery_steplock``)."""

    name = "celery_steplock.contrib.django"
    label = "celery_steplock"
    verbose_name = "Step locks"
    default_auto_field = "django.db.models.BigAutoField"
