"""The example project's settings with mistakes of several kinds (one each)."""

from django_app.settings import *  # noqa: F401,F403

# 1. a misspelled setting name: ignored, W005 with the closest name
CELERY_STEPLOCK_DEFUALT_TTL = 10
# 2. a real setting without the Celery namespace: never read, W005
STEPLOCK_ON_CONFLICT = "raise"
# 3. an invalid setting value: E003
CELERY_STEPLOCK_RENEWAL_RATIO = 2
# 4. a recovery status the step model's status field does not allow: E005
CELERY_STEPLOCK_REAPER_RECOVER = {"workflows.Step": {"runing": "pending"}}
# 5. a task module with bad options (unknown option, values, placeholders): E004, W005
CELERY_IMPORTS = ["tests.contrib.check_project.tasks"]
