"""Settings read from app.conf (celery_steplock.conf)."""
import pytest
from celery import Celery

from celery_steplock.conf import DEFAULTS, Settings
from celery_steplock.exceptions import ImproperlyConfigured, StepLockError


def make_app(**conf):
    app = Celery("conf-tests", set_as_current=False)
    app.conf.update(conf)
    return app


def test_defaults():
    settings = Settings(make_app(broker_url="redis://127.0.0.1:1/3"))
    assert settings.default_ttl == 30.0
    assert settings.renewal_ratio == pytest.approx(1 / 3)
    assert settings.on_contended == "retry"
    assert settings.on_conflict == "return"
    assert settings.on_store_error == "fail_closed"
    assert settings.key_prefix == "steplock"
    assert settings.redis_url == "redis://127.0.0.1:1/3"
    assert settings.max_hold is None
    settings.validate()


def test_values_are_read_at_access_time():
    app = make_app(broker_url="redis://h/0")
    settings = Settings(app)
    assert settings.default_ttl == 30.0
    app.conf.steplock_default_ttl = 4
    assert settings.default_ttl == 4.0


def test_django_namespace_maps_celery_steplock_settings():
    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_STEPLOCK_DEFAULT_TTL = 12
        CELERY_STEPLOCK_ON_CONTENDED = "skip"

    app = Celery("ns", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    settings = Settings(app)
    assert settings.default_ttl == 12.0
    assert settings.on_contended == "skip"


def test_explicit_redis_url_wins_over_broker():
    settings = Settings(make_app(broker_url="amqp://x", steplock_redis_url="redis://r:1/2"))
    assert settings.redis_url == "redis://r:1/2"


@pytest.mark.parametrize("conf, setting", [
    ({"steplock_default_ttl": 0}, "steplock_default_ttl"),
    ({"steplock_default_ttl": -1}, "steplock_default_ttl"),
    ({"steplock_default_ttl": "30"}, "steplock_default_ttl"),
    ({"steplock_default_ttl": float("nan")}, "steplock_default_ttl"),
    ({"steplock_renewal_ratio": 1}, "steplock_renewal_ratio"),
    ({"steplock_renewal_ratio": 1.5}, "steplock_renewal_ratio"),
    ({"steplock_renewal_ratio": 0}, "steplock_renewal_ratio"),
    ({"steplock_on_contended": "wait"}, "steplock_on_contended"),
    ({"steplock_on_conflict": "overwrite"}, "steplock_on_conflict"),
    ({"steplock_on_store_error": "open"}, "steplock_on_store_error"),
    ({"steplock_lock_wait": -0.5}, "steplock_lock_wait"),
    ({"steplock_key_prefix": "a{b}"}, "steplock_key_prefix"),
    ({"steplock_key_prefix": "a[b"}, "steplock_key_prefix"),
    ({"steplock_key_prefix": "a\nb"}, "steplock_key_prefix"),
    ({"steplock_precheck": "false"}, "steplock_precheck"),
    ({"steplock_default_ttl": 1e20}, "steplock_default_ttl"),
    ({"steplock_default_ttl": 0.001}, "steplock_default_ttl"),
    ({"steplock_renewal_ratio": 0.995}, "steplock_renewal_ratio"),
    ({"steplock_status_field": "not a field"}, "steplock_status_field"),
    ({"steplock_redis_url": "http://x"}, "steplock_redis_url"),
    ({"steplock_retry_max": -1}, "steplock_retry_max"),
    ({"steplock_retry_max": 2.5}, "steplock_retry_max"),
    ({"steplock_reaper_recover": {"workflows.Step": "pending"}}, "steplock_reaper_recover"),
])
def test_invalid_values_name_the_setting(conf, setting):
    settings = Settings(make_app(broker_url="redis://h/0", **conf))
    with pytest.raises(ImproperlyConfigured) as info:
        settings.validate()
    assert info.value.setting == setting
    assert setting in str(info.value)
    assert f"CELERY_{setting.upper()}" in str(info.value)  # as a Django user writes it
    assert isinstance(info.value, StepLockError)


def test_missing_redis_url_with_a_non_redis_broker():
    with pytest.raises(ImproperlyConfigured, match="steplock_redis_url"):
        Settings(make_app(broker_url="amqp://guest@localhost//")).redis_url


def test_every_default_has_a_property():
    settings = Settings(make_app(broker_url="redis://h/0"))
    for name in DEFAULTS:
        getattr(settings, name)


@pytest.mark.parametrize("factory, why", [
    ("no.such:thing", "cannot import 'no.such:thing'"),
    (5, "must be callable"),
])
def test_a_bad_factory_is_reported_rather_than_the_missing_url(factory, why):
    # No URL and a broker that is not Redis: the factory was meant to replace the URL, so its
    # own error is the one reported, and the missing URL is not.
    app = Celery("t", set_as_current=False)
    app.conf.broker_url = "amqp://guest@localhost//"
    app.conf.steplock_redis_client_factory = factory
    settings = Settings(app)
    with pytest.raises(ImproperlyConfigured) as info:
        settings.validate()
    assert info.value.setting == "steplock_redis_client_factory"
    assert why in str(info.value)
    found = settings.problems()
    assert [exc.setting for exc in found] == ["steplock_redis_client_factory"]
    assert "steplock_redis_url is not set" not in str(found[0])
