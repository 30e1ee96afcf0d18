"""What effects.http refuses (no database)."""

from __future__ import annotations

import pytest

from celery_steplock import effects
from celery_steplock.exceptions import InvalidEffect

pytestmark = pytest.mark.no_database


@pytest.mark.parametrize(
    "url",
    ["https://alice:s3cretpw@hooks.example.com/x", "http://token@hooks.example.com/x"],
)
def test_http_refuses_credentials_in_the_url_without_showing_them(url):
    with effects.collecting(effects.Outbox()) as outbox:
        with pytest.raises(InvalidEffect) as raised:
            effects.http(url, json={})
        assert outbox.declared == []
    assert raised.value.argument == "url"
    assert "credentials" in str(raised.value) and "s3cretpw" not in str(raised.value)
    assert "Authorization" in str(raised.value)


def test_a_bad_scheme_url_is_refused_with_its_password_masked():
    with effects.collecting(effects.Outbox()):
        with pytest.raises(InvalidEffect) as raised:
            effects.http("ftp://bob:hunter22pw@files.example.com/", json={})
    assert "hunter22pw" not in str(raised.value)
