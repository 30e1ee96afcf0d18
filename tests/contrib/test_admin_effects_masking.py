"""An effect's target with credentials in it (a row written before
effects.http refused them, or edited by hand) is masked on every admin page that shows it:
the list, the detail page (its title and breadcrumbs too) and the actions' confirmation."""

from __future__ import annotations

import pytest
from django.urls import reverse

from tests.contrib.test_admin_effects import CHANGELIST, action, make, replayer, viewer

pytestmark = pytest.mark.django_db

__all__ = ["replayer", "viewer"]  # fixtures

URL = "https://alice:s3cretpw@hooks.example.com/x?password=zz9top"


def test_a_target_with_credentials_is_masked_on_every_admin_page(viewer, replayer):
    effect = make(1, kind="http", target=URL, payload={"method": "POST", "json": {}})
    pages = [
        viewer.get(reverse(CHANGELIST)),
        viewer.get(reverse("admin:celery_steplock_effect_change", args=[effect.pk])),
        replayer.get(reverse("admin:celery_steplock_effect_change", args=[effect.pk])),
        action(replayer, "retry_now", [effect]),
    ]
    for page in pages:
        assert page.status_code == 200
        text = page.content.decode()
        assert "s3cretpw" not in text and "zz9top" not in text
        assert "https://alice:***@hooks.example.com/x?password=***" in text
