"""Settings read from app.conf (celery_steplock.conf)."""

import pytest
from celery import Celery

from celery_steplock.conf import DEFAULTS, Settings
from celery_steplock.exceptions import ImproperlyConfigured, StepLockError

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass


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


@pytest.mark.parametrize(
    "conf, setting",
    [
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
    ],
)
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


@pytest.mark.parametrize(
    "factory, why",
    [
        ("no.such:thing", "cannot import 'no.such:thing'"),
        (5, "must be callable"),
    ],
)
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


# -- issue 12, finding 6: every setting bounded below and above ----------------------------------

OUT_OF_BOUNDS = [
    ("steplock_fence_ttl", 1e20),
    ("steplock_fence_ttl", 0.5),
    ("steplock_socket_timeout", 1e300),
    ("steplock_socket_timeout", 601),
    ("steplock_lock_wait", 1e9),
    ("steplock_lock_wait", 86400.5),
    ("steplock_max_hold", 1e12),
    ("steplock_retry_backoff", 1e9),
    ("steplock_retry_backoff_max", 1e9),
    ("steplock_retry_max", 10**12),
    ("steplock_max_waiters", 10**9),
    ("steplock_max_waiters", 0),
    ("steplock_event_retention", 1e20),
    ("steplock_reaper_older_than", 1e20),
    ("steplock_default_ttl", 86401),
    ("steplock_key_prefix", "p" * 65),
    ("steplock_status_field", "f" * 256),
    ("steplock_step_database", "d" * 256),
    ("steplock_step_store", "m" * 256 + ":F"),
    ("steplock_name_secret", "short"),
    ("steplock_name_secret", "x" * 4097),
    ("steplock_name_secret", 12345),
    ("steplock_socket_timeout", "5"),
    ("steplock_fence_ttl", True),
]


@pytest.mark.parametrize(
    "setting, value", OUT_OF_BOUNDS, ids=[f"{s}={str(v)[:12]}" for s, v in OUT_OF_BOUNDS]
)
def test_out_of_bounds_settings_are_refused_by_name(setting, value):
    settings = Settings(make_app(broker_url="redis://h/0", **{setting: value}))
    with pytest.raises(ImproperlyConfigured) as info:
        getattr(settings, setting[len("steplock_") :])
    assert info.value.setting == setting
    assert f"CELERY_{setting.upper()}" in str(info.value)
    assert len(str(info.value)) < 400
    assert [p.setting for p in settings.problems()] == [setting]


@pytest.mark.parametrize(
    "setting, value, expected",
    [
        ("steplock_fence_ttl", 366 * 24 * 3600, 366 * 24 * 3600.0),
        ("steplock_fence_ttl", 1, 1.0),
        ("steplock_socket_timeout", 600, 600.0),
        ("steplock_lock_wait", 86400, 86400.0),
        ("steplock_max_hold", 30 * 24 * 3600, 30 * 24 * 3600.0),
        ("steplock_retry_max", 1_000_000, 1_000_000),
        ("steplock_max_waiters", 100_000, 100_000),
        ("steplock_key_prefix", "p" * 64, "p" * 64),
    ],
)
def test_values_at_the_bounds_are_accepted(setting, value, expected):
    settings = Settings(make_app(broker_url="redis://h/0", **{setting: value}))
    assert getattr(settings, setting[len("steplock_") :]) == expected


def test_an_invalid_setting_quotes_at_most_a_line_of_a_huge_value():
    huge = "{" * (10 * 1024 * 1024)
    with pytest.raises(ImproperlyConfigured) as info:
        Settings(make_app(steplock_key_prefix=huge)).key_prefix
    assert len(str(info.value)) < 400
    with pytest.raises(ImproperlyConfigured) as info:
        Settings(make_app(steplock_default_ttl=10**10000)).default_ttl  # repr() would fail
    assert "<int>" in str(info.value)


def test_an_invalid_name_secret_is_never_quoted():
    with pytest.raises(ImproperlyConfigured) as info:
        Settings(make_app(steplock_name_secret="hunter2-hunter2")).name_secret
    assert "hunter2" not in str(info.value) and "15 characters" in str(info.value)


OPTION_BOUNDS = [
    ("lock_wait", 1e9),
    ("lock_ttl", 1e20),
    ("lock_max_hold", 1e12),
    ("lock_retry_max", 10**12),
    ("lock_wait", "2"),
    ("lock_ttl", True),
    ("lock_key", "n:{order_id.__class__}"),
    ("lock_key", "n:{order_id[0]}"),
]


@pytest.mark.parametrize(
    "index, option, value",
    [(i, o, v) for i, (o, v) in enumerate(OPTION_BOUNDS)],
    ids=[f"{o}={str(v)[:12]}" for o, v in OPTION_BOUNDS],
)
def test_out_of_bounds_task_options_are_refused_at_check_time(index, option, value):
    from celery_steplock.plan import option_problems
    from celery_steplock.task import StepLockedTask

    app = make_app(broker_url="redis://127.0.0.1:1/0")

    @app.task(
        base=StepLockedTask, name=f"bounds.{option}.{index}", shared=False, **{option: value}
    )
    def t(order_id):
        return order_id

    found = option_problems(t)
    assert [p.setting for p in found] == [option]
    assert len(str(found[0])) < 400


# -- issue 12, finding 1: the name secret -----------------------------------------------------


def test_the_name_secret_is_the_setting_or_derived_from_django_secret_key():
    import hashlib
    import hmac

    from django.conf import settings as django_settings

    derived = hmac.new(
        django_settings.SECRET_KEY.encode(), b"celery_steplock lock names v1", hashlib.sha256
    ).digest()
    assert Settings(make_app()).name_secret == derived
    assert Settings(make_app(steplock_name_secret="k" * 32)).name_secret == b"k" * 32
    assert Settings(make_app(steplock_name_secret=b"\x00" * 40)).name_secret == b"\x00" * 40


def test_w011_when_the_derived_secret_comes_from_an_insecure_secret_key():
    from django.test import override_settings

    from celery_steplock.validate import name_secret_problems, problems

    app = make_app(broker_url="redis://127.0.0.1:1/0")
    strong = "Vq3" + "".join(chr(65 + (i * 7) % 26) for i in range(60))
    with override_settings(SECRET_KEY="django-insecure-" + "x1y2z3" * 10, DEBUG=False):
        found = name_secret_problems(app)
        assert [p.id for p in found] == ["celery_steplock.W011"]
        assert "celery_steplock.W011" in [p.id for p in problems(app)]
    with override_settings(SECRET_KEY="django-insecure-" + "x1y2z3" * 10, DEBUG=True):
        assert name_secret_problems(app) == []
    with override_settings(SECRET_KEY=strong, DEBUG=False):
        assert name_secret_problems(app) == []
    with override_settings(SECRET_KEY="short", DEBUG=False):
        assert [p.id for p in name_secret_problems(app)] == ["celery_steplock.W011"]
    app.conf.steplock_name_secret = "k" * 32
    with override_settings(SECRET_KEY="short", DEBUG=False):
        assert name_secret_problems(app) == []


def test_w010_without_django_and_without_a_name_secret(tmp_path):
    import subprocess
    import sys

    script = (
        "from celery import Celery\n"
        "from celery_steplock.conf import Settings\n"
        "from celery_steplock.validate import name_secret_problems\n"
        "app = Celery('plain', set_as_current=False)\n"
        "print(Settings(app).name_secret, [p.id for p in name_secret_problems(app)])\n"
        "app.conf.steplock_name_secret = 'k' * 32\n"
        "print([p.id for p in name_secret_problems(app)])\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    assert out == ["None ['celery_steplock.W010']", "[]"]


def test_manage_py_check_deploy_reports_the_insecure_name_secret():
    from django.core import checks
    from django.test import override_settings

    with override_settings(SECRET_KEY="django-insecure-" + "x1y2z3" * 10, DEBUG=False):
        found = checks.run_checks(include_deployment_checks=True, tags=["celery_steplock"])
    assert "celery_steplock.W011" in [m.id for m in found]
    assert "celery_steplock.W011" not in [
        m.id for m in checks.run_checks(include_deployment_checks=False, tags=["celery_steplock"])
    ]


@pytest.mark.parametrize(
    "options",
    [
        {"health_check_interval": 1e300},
        {"health_check_interval": float("nan")},
        {"sentinel_kwargs": {"socket_timeout": 1e9}},
    ],
)
def test_transport_option_durations_are_bounded(options):
    settings = Settings(
        make_app(
            steplock_redis_url="sentinel://127.0.0.1:1",
            steplock_redis_transport_options={"master_name": "m", **options},
        )
    )
    with pytest.raises(ImproperlyConfigured) as info:
        settings.redis_transport_options
    assert info.value.setting == "steplock_redis_transport_options"
    assert "at most 600" in str(info.value) and len(str(info.value)) < 400


# -- hostile review, finding 4: a renewal ratio that makes a busy loop --------------------------


@pytest.mark.parametrize("ratio", [1e-300, 0.049, 5e-324, -0.1])
def test_a_renewal_ratio_below_its_floor_is_refused(ratio):
    from celery_steplock.conf import MIN_RENEWAL_RATIO

    settings = Settings(make_app(steplock_renewal_ratio=ratio))
    with pytest.raises(ImproperlyConfigured) as info:
        settings.renewal_ratio
    assert info.value.setting == "steplock_renewal_ratio" and MIN_RENEWAL_RATIO == 0.05
    assert "between 0.05 and 0.75" in str(info.value)
    assert Settings(make_app(steplock_renewal_ratio=0.05)).renewal_ratio == 0.05


# -- issue 23: one settings table ---------------------------------------------------------------


def test_the_table_is_the_only_source():
    from celery_steplock.conf import DESCRIPTIONS, RENAMED, SETTINGS

    names = [s.name for s in SETTINGS]
    # 45, then steplock_overlap and the four steplock_effect_* settings (issue 28), then
    # steplock_history, steplock_history_max_entries, steplock_history_max_age (issue 30),
    # steplock_activity, steplock_activity_flush_interval (issue 30)
    assert len(names) == len(set(names)) == 55
    assert DEFAULTS == {s.name: s.default for s in SETTINGS} and list(DEFAULTS) == names
    assert DESCRIPTIONS == {s.name: s.description for s in SETTINGS}
    assert list(DESCRIPTIONS) == names
    for setting in SETTINGS:
        assert setting.description.strip().endswith("."), setting.name
        assert callable(setting.check), setting.name
        assert setting.unit in (None, "seconds", "count", "bytes", "ratio"), setting.name
        assert setting.qualified == f"steplock_{setting.name}"
    assert RENAMED == {
        "bulkhead_on_store_error": "concurrency_limit_on_store_error",
        "bulkhead_retry_after": "concurrency_limit_retry_after",
    }
    assert not set(RENAMED) & set(DEFAULTS)


def test_every_setting_attribute_resolves_through_the_table():
    import inspect

    from celery_steplock.conf import SETTINGS

    settings = Settings(make_app(broker_url="redis://h/0"))
    # Typed attributes are settings, and only settings.
    assert set(inspect.get_annotations(Settings)) <= set(DEFAULTS)
    for setting in SETTINGS:
        attribute = inspect.getattr_static(Settings, setting.name)
        value = getattr(settings, setting.name)
        if not isinstance(attribute, property):  # generated: the table's check of the default
            assert value == setting.check(setting.default, setting.qualified), setting.name
    # The former property names are aliases of the new ones.
    assert settings.bulkhead_on_store_error == settings.concurrency_limit_on_store_error
    assert settings.bulkhead_retry_after == settings.concurrency_limit_retry_after == 0.5
    with pytest.raises(AttributeError):
        settings.default_ttl = 5


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_every_setting_is_checked_by_name(name):
    settings = Settings(make_app(broker_url="redis://h/0", **{f"steplock_{name}": object()}))
    found = settings.problems()
    assert [exc.setting for exc in found] == [f"steplock_{name}"]
    assert f"CELERY_STEPLOCK_{name.upper()}" in str(found[0])


def test_a_former_setting_name_is_read_and_warned_about():
    from celery_steplock.validate import problems

    app = make_app(
        broker_url="redis://h/0",
        steplock_bulkhead_retry_after=2,
        steplock_bulkhead_on_store_error="fail_open",
    )
    settings = Settings(app)
    assert settings.concurrency_limit_retry_after == settings.bulkhead_retry_after == 2.0
    assert settings.concurrency_limit_on_store_error == "fail_open"
    assert settings.raw("bulkhead_retry_after") == 2
    found = [
        (p.id, p.obj, p.message, p.hint)
        for p in problems(app)
        if p.id in ("celery_steplock.W005", "celery_steplock.W006")
    ]
    assert found == [
        (
            "celery_steplock.W006",
            "steplock_bulkhead_on_store_error",
            "Setting steplock_bulkhead_on_store_error (CELERY_STEPLOCK_BULKHEAD_ON_STORE_ERROR) "
            "is deprecated: it is read as steplock_concurrency_limit_on_store_error until the "
            "next release.",
            "Rename it to steplock_concurrency_limit_on_store_error "
            "(CELERY_STEPLOCK_CONCURRENCY_LIMIT_ON_STORE_ERROR).",
        ),
        (
            "celery_steplock.W006",
            "steplock_bulkhead_retry_after",
            "Setting steplock_bulkhead_retry_after (CELERY_STEPLOCK_BULKHEAD_RETRY_AFTER) is "
            "deprecated: it is read as steplock_concurrency_limit_retry_after until the next "
            "release.",
            "Rename it to steplock_concurrency_limit_retry_after "
            "(CELERY_STEPLOCK_CONCURRENCY_LIMIT_RETRY_AFTER).",
        ),
    ]  # and no W005: a former name is not unknown
    assert "celery_steplock.E003" not in [p.id for p in problems(app)]

    # Beside the new name, the former one is ignored (and said to be).
    app.conf.steplock_concurrency_limit_retry_after = 3
    assert Settings(app).concurrency_limit_retry_after == 3.0
    assert Settings(app).bulkhead_retry_after == 3.0
    ignored = [p for p in problems(app) if p.obj == "steplock_bulkhead_retry_after"]
    assert [p.message for p in ignored] == [
        "Setting steplock_bulkhead_retry_after (CELERY_STEPLOCK_BULKHEAD_RETRY_AFTER) is "
        "deprecated and ignored: steplock_concurrency_limit_retry_after is set."
    ]

    # An invalid value under the former name is refused naming the name it was set under.
    bad = Settings(make_app(broker_url="redis://h/0", steplock_bulkhead_retry_after=0))
    assert [exc.setting for exc in bad.problems()] == ["steplock_bulkhead_retry_after"]


def test_a_former_setting_name_in_django_settings():
    from celery_steplock.contrib.django import checks

    class DjangoSettings:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_STEPLOCK_BULKHEAD_RETRY_AFTER = 1.5
        STEPLOCK_BULKHEAD_ON_STORE_ERROR = "fail_open"  # no namespace: never read

    app = Celery("renamed", set_as_current=False)
    app.config_from_object(DjangoSettings, namespace="CELERY")
    assert Settings(app).concurrency_limit_retry_after == 1.5
    assert Settings(app).concurrency_limit_on_store_error == "fail_closed"
    found = [(m.id, m.obj, m.hint) for m in checks.check_unknown_names(app, DjangoSettings)]
    assert found == [
        (
            "celery_steplock.W005",
            "STEPLOCK_BULKHEAD_ON_STORE_ERROR",
            "Did you mean CELERY_STEPLOCK_CONCURRENCY_LIMIT_ON_STORE_ERROR?",
        ),
        (
            "celery_steplock.W006",
            "CELERY_STEPLOCK_BULKHEAD_RETRY_AFTER",
            "Rename it to CELERY_STEPLOCK_CONCURRENCY_LIMIT_RETRY_AFTER.",
        ),
    ]


def _reference():
    """docs/_ext/steplock_reference.py, which generates the settings reference (it imports no
    Sphinx until Sphinx calls its setup)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "_ext" / "steplock_reference.py"
    spec = importlib.util.spec_from_file_location("steplock_reference_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_lists_every_setting_with_an_anchor():
    from celery_steplock.conf import RENAMED, SETTINGS

    reference = _reference()
    lines = reference.settings_lines()
    targets = [line.split()[1] for line in lines if line.startswith("```{setting} ")]
    assert targets == [s.qualified for s in SETTINGS]
    for setting in SETTINGS:
        term = lines[lines.index(f"```{{setting}} {setting.qualified}") + 3]
        assert term.startswith(f"{{setting}}`{setting.qualified}` ")
        assert f"``CELERY_{setting.qualified.upper()}``" in term
        assert f"default ``{setting.default!r}``" in term
        assert (setting.unit or "") in term
        definition = lines[lines.index(term) + 1]
        assert definition == ": " + " ".join(setting.description.split())
    renamed = reference.renamed_settings_lines()
    assert [line.split()[1] for line in renamed if line.startswith("```{setting} ")] == [
        f"steplock_{old}" for old in RENAMED
    ]
    assert reference.setting_anchor("steplock_default_ttl") == "setting-steplock_default_ttl"


def test_the_readme_points_to_the_reference_instead_of_a_table_of_its_own():
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    assert "/blob/main/docs/reference/settings.md)" in readme
    assert "| `steplock_" not in readme
    assert "| `lock_ttl` |" not in readme  # the task options live in the reference too
