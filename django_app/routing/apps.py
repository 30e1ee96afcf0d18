from django.apps import AppConfig


class RoutingConfig(AppConfig):
    default_auto_field = "django.db.models.BigAutoField"
    name = "django_app.routing"
    label = "routing"
    verbose_name = "Routing (step models on several databases)"
