from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("celery_steplock", "0006_rate_and_concurrency_limits"),
    ]

    operations = [
        migrations.CreateModel(
            name="Activity",
            fields=[
                (
                    "key",
                    models.CharField(
                        max_length=512,
                        primary_key=True,
                        serialize=False,
                        verbose_name="subject",
                    ),
                ),
            ],
            options={
                "verbose_name": "activity",
                "verbose_name_plural": "activity",
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
    ]
