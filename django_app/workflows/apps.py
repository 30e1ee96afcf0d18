from django.apps import AppConfig


class WorkflowsConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "django_app.workflows"
    label = "workflows"
    verbose_name = "Workflows (celery-steplock example)"

    def ready(self):
        # Demo statistics: counts library signals in Redis, shared by all
        # worker processes. Connects nothing unless STEPLOCK_DEMO_STATS=1.
        from . import receivers

        receivers.connect()
