"""Settings of the sample shop: what a project's test settings typically are."""

SECRET_KEY = "sample-shop-tests-only"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "celery_steplock.contrib.django",
    "orders",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Production would publish to a broker; the tests run every task in the caller's process.
CELERY_BROKER_URL = "memory://"
CELERY_TASK_ALWAYS_EAGER = True
CELERY_TASK_EAGER_PROPAGATES = True
# The production lock store; the plugin's steplock_app fixture replaces it for each test.
CELERY_STEPLOCK_REDIS_URL = "redis://redis.invalid:6379/0"
