from django.apps import AppConfig


class FaultsConfig(AppConfig):
    name = "django_app.faults"
    label = "faults"
    verbose_name = "Fault-injection probe (tests/faults)"

    def ready(self):
        # Connects nothing unless STEPLOCK_FAULTS=1 (set by the fault harness for its workers).
        from . import effects, patterns, periodic, probe  # noqa: F401 - they register their tasks

        probe.connect()
        probe.connect_patterns()
        periodic.connect()
