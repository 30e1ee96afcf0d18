"""The one validator (celery_steplock.validate): every problem, rendered alike by worker
start and by Django's checks."""

from __future__ import annotations

import itertools
import logging

import pytest
from celery import Celery

from celery_steplock import StepLockedTask
from celery_steplock.contrib.django import checks
from celery_steplock.validate import Problem, problems, refuse_to_start

pytestmark = pytest.mark.no_database  # runs once, in the SQLite pass

_names = itertools.count()


def make_app(**conf):
    app = Celery(f"validate{next(_names)}", set_as_current=False)
    app.conf.broker_url = "redis://127.0.0.1:6379/0"
    app.conf.task_acks_late = True
    app.conf.task_reject_on_worker_lost = True
    app.conf.update(conf)
    return app


def add_task(app, **options):
    name = f"validate.task{next(_names)}"

    def body(self, step_id):
        return step_id

    app.task(bind=True, base=StepLockedTask, name=name, shared=False, **options)(body)
    return name


def test_every_problem_at_once_with_stable_ids():
    app = make_app(steplock_default_ttl=-1, steplock_on_conflict="clobber")
    bad = add_task(app, lock_ttl=0, on_contended="wait")
    found = [
        p for p in problems(app) if p.obj in (bad, "steplock_default_ttl", "steplock_on_conflict")
    ]
    assert [(p.id, p.obj) for p in found] == [
        ("celery_steplock.E003", "steplock_default_ttl"),
        ("celery_steplock.E003", "steplock_on_conflict"),
        ("celery_steplock.E004", bad),
        ("celery_steplock.E004", bad),
    ]
    assert "lock_ttl" in found[2].message and "on_contended" in found[3].message
    assert all(p.is_error for p in found)


def test_a_clean_app_has_no_errors():
    app = make_app()
    name = add_task(app, lock_ttl=5)
    assert [p for p in problems(app) if p.is_error and p.obj == name] == []


def test_worker_start_and_checks_render_the_same_problems():
    app = make_app()
    bad = add_task(app, lock_ttl=0)
    errors = [p for p in problems(app) if p.is_error]
    rendered = checks.check_task_options(app)
    assert [(m.id, m.msg, m.obj) for m in rendered] == [
        (p.id, p.message, p.obj) for p in errors if p.obj == bad
    ]
    with pytest.raises(SystemExit) as info:
        refuse_to_start(app)
    assert f"{bad}: lock_ttl must be" in str(info.value)


def test_worker_start_logs_warnings_and_starts(caplog):
    app = make_app(task_acks_late=False)
    add_task(app, lock_ttl=5)
    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        refuse_to_start(app)  # warnings only: no SystemExit
    assert any("id=celery_steplock.W002" in r.getMessage() for r in caplog.records)


def test_problem_levels():
    assert Problem("celery_steplock.E003", "x").is_error
    assert not Problem("celery_steplock.W001", "x").is_error


def test_typos_in_settings_and_options_are_named_with_a_suggestion():
    app = make_app(steplock_default_tll=10)
    name = add_task(app, lock_tll=5)
    found = [p for p in problems(app) if p.id == "celery_steplock.W005"]
    assert [(p.obj, p.hint) for p in found] == [
        ("steplock_default_tll", "Did you mean CELERY_STEPLOCK_DEFAULT_TTL?"),
        (name, "Did you mean lock_ttl?"),
    ]


def test_worker_start_fails_closed_when_validation_itself_breaks(monkeypatch):
    from celery_steplock import validate

    app = make_app()
    add_task(app, lock_ttl=5)

    def broken(app):
        raise AttributeError("a store factory that breaks")

    monkeypatch.setattr(validate, "problems", broken)
    with pytest.raises(SystemExit) as info:
        refuse_to_start(app)
    assert "could not be validated" in str(info.value) and "AttributeError" in str(info.value)


def test_a_malformed_transition_table_is_an_option_error_not_a_crash():
    app = make_app()
    name = add_task(
        app, step_model="workflows.Step", step_id_arg="step_id", step_transitions=["pending"]
    )
    found = [p for p in problems(app) if p.obj == name]
    assert [(p.id, "step_transitions" in p.message) for p in found] == [
        ("celery_steplock.E004", True)
    ]


def test_an_unimportable_step_store_is_reported_without_any_task():
    app = make_app(steplock_step_store="no_such_pkg.steps:Store")
    assert [p.obj for p in problems(app) if p.id == "celery_steplock.E003"] == [
        "steplock_step_store"
    ]


# -- every option value, each once ---------------------------------------------------------


def test_every_invalid_option_value_is_one_error_and_worker_start_names_them_all():
    app = make_app()
    name = add_task(
        app,
        lock_ttl=-1,
        lock_wait="soon",
        lock_max_hold=0,
        on_contended="wait",
        on_conflict="clobber",
        on_store_error="open",
        lock_precheck="no",
        lock_retry_max=-1,
        lock_key="order:{order_id}",
        step_id_arg="order_id",
    )
    found = [p for p in problems(app) if p.obj == name]
    assert [p.id for p in found] == ["celery_steplock.E004"] * 10
    messages = sorted(p.message.split(":", 1)[1].split()[0] for p in found)
    assert messages == [
        "lock_key",
        "lock_max_hold",
        "lock_precheck",
        "lock_retry_max",
        "lock_ttl",
        "lock_wait",
        "on_conflict",
        "on_contended",
        "on_store_error",
        "step_id_arg='order_id'",
    ]
    assert f"{name}: lock_ttl must be a number of seconds between 0.05 and 86400, got -1" in [
        p.message for p in found
    ]
    assert (
        f"{name}: lock_key 'order:{{order_id}}' names 'order_id', which is not an "
        f"argument of the task (arguments: step_id)"
    ) in [p.message for p in found]
    with pytest.raises(SystemExit) as info:
        refuse_to_start(app)
    for problem in found:
        assert problem.message in str(info.value)


def test_a_callable_lock_key_is_checked_against_the_task_signature():
    app = make_app()
    bad = add_task(app, lock_key=lambda order_id: f"order:{order_id}")
    good = add_task(app, lock_key=lambda step_id: f"step:{step_id}")
    catch_all = add_task(app, lock_key=lambda **arguments: "one")
    found = [p for p in problems(app) if p.obj in (bad, good, catch_all) and p.is_error]
    assert [(p.id, p.obj) for p in found] == [("celery_steplock.E004", bad)]
    assert found[0].message == (
        f"{bad}: lock_key '<lambda>' cannot be called with the task's arguments as keywords "
        f"(missing a required argument: 'order_id'; arguments: step_id)"
    )


# -- unknown names (W005) --------------------------------------------------------------------


def unknown(app):
    return [(p.obj, p.message, p.hint) for p in problems(app) if p.id == "celery_steplock.W005"]


def test_unknown_task_options_anywhere_in_the_task_classes_with_a_suggestion():
    class Base(StepLockedTask):
        lock_timeout = 3  # a lock_* attribute of the user's own base class

    app = make_app()
    name = f"validate.task{next(_names)}"

    def body(self, step_id):
        return step_id

    app.task(
        bind=True,
        base=Base,
        name=name,
        shared=False,
        lock_tll=5,
        step_id_ar="step_id",
        on_conflit="raise",
        transtion=("a", "b"),
        max_retries=3,
        autoretry_for=(KeyError,),
        retry_backoff=True,
        lock_ttl=5,
    )(body)
    assert [(obj, hint) for obj, _, hint in unknown(app)] == [
        (name, "Did you mean lock_ttl?"),
        (name, "Did you mean on_conflict?"),
        (name, "Did you mean step_id_arg?"),
        (name, "Did you mean transition?"),
        (name, None),
    ]
    messages = [message for _, message, _ in unknown(app)]
    assert messages == [
        f"{name}: unknown task option {attr}: it is ignored."
        for attr in ("lock_tll", "on_conflit", "step_id_ar", "transtion", "lock_timeout")
    ]


def test_the_options_of_the_library_and_celery_are_not_unknown():
    app = make_app()
    add_task(
        app,
        lock_ttl=5,
        lock_wait=1,
        lock_max_hold=60,
        on_contended="skip",
        on_conflict="raise",
        on_store_error="fail_open",
        lock_precheck=False,
        lock_retry_max=2,
        step_id_arg="step_id",
        lock_key="s:{step_id}",
        max_retries=3,
        autoretry_for=(KeyError,),
        retry_backoff=True,
        retry_jitter=False,
        rate_limit="10/s",
        typing=True,
        expires=60,
    )
    assert unknown(app) == []


def test_a_misspelled_setting_of_a_namespaced_configuration():
    class Config:
        CELERY_BROKER_URL = "redis://127.0.0.1:6379/0"
        CELERY_STEPLOCK_DEFUALT_TTL = 10
        CELERY_STEPLOCK_LOCK_WAIT = 1.0  # real: read
        STEPLOCK_ON_CONFLICT = "raise"  # real name, but without the namespace: never read

    app = Celery(f"validate{next(_names)}", set_as_current=False)
    app.config_from_object(Config, namespace="CELERY")
    assert app.conf.get("steplock_lock_wait") == 1.0  # what "read" means here
    assert app.conf.get("steplock_on_conflict") is None
    assert unknown(app) == [
        (
            "CELERY_STEPLOCK_DEFUALT_TTL",
            "Unknown celery-steplock setting CELERY_STEPLOCK_DEFUALT_TTL: it is ignored.",
            "Did you mean CELERY_STEPLOCK_DEFAULT_TTL?",
        ),
        (
            "STEPLOCK_ON_CONFLICT",
            "Setting STEPLOCK_ON_CONFLICT is never read: the Celery app reads its settings with "
            "the CELERY_ namespace (config_from_object(..., namespace='CELERY')), so it is "
            "ignored.",
            "Did you mean CELERY_STEPLOCK_ON_CONFLICT?",
        ),
    ]


def test_a_setting_name_that_is_not_a_steplock_one_gets_the_closest():
    app = make_app(steplocks_ttl=3, steplock_lockwait=2)
    assert [(obj, hint) for obj, _, hint in unknown(app)] == [
        ("steplock_lockwait", "Did you mean CELERY_STEPLOCK_LOCK_WAIT?"),
        ("steplocks_ttl", "Did you mean CELERY_STEPLOCK_FENCE_TTL?"),
    ]


def test_steplock_django_settings_an_app_never_reads():
    from celery_steplock.validate import django_setting_problems

    class DjangoSettings:
        DEBUG = False
        STEPLOCK_DEFAULT_TTL = 3
        CELERY_STEPLOCK_LOCK_WAIT = 1.0

    elsewhere = make_app()  # configured from a dict, not from the Django settings
    found = django_setting_problems(elsewhere, DjangoSettings)
    assert [(p.id, p.obj) for p in found] == [
        ("celery_steplock.W005", "CELERY_STEPLOCK_LOCK_WAIT"),
        ("celery_steplock.W005", "STEPLOCK_DEFAULT_TTL"),
    ]
    assert found[0].message == (
        f"Django setting CELERY_STEPLOCK_LOCK_WAIT is never read: the Celery app "
        f"{elsewhere.main!r} does not load its configuration from the Django settings, so it "
        f"is ignored."
    )
    reading = Celery(f"validate{next(_names)}", set_as_current=False)
    reading.config_from_object(DjangoSettings, namespace="CELERY")
    assert django_setting_problems(reading, DjangoSettings) == []  # unknown_name_problems'


# -- W004 on an AMQP broker: RabbitMQ's consumer_timeout ----------------------------------------

AMQP = dict(broker_url="amqp://guest@127.0.0.1:5672//", steplock_redis_url="redis://127.0.0.1/0")


def consumer_timeout_warnings(app):
    return [p for p in problems(app) if p.obj == "steplock_broker_consumer_timeout"]


def test_rabbitmq_defaults_pass_and_redis_ignores_the_consumer_timeout():
    app = make_app(**AMQP)  # backoff cap 60 s, no max_hold, no lock_wait: below 1800 s
    add_task(app, lock_ttl=30)
    assert consumer_timeout_warnings(app) == []
    # A Redis broker has no consumer_timeout: a small one there is never judged.
    redis_app = make_app(steplock_broker_consumer_timeout=5)
    assert consumer_timeout_warnings(redis_app) == []


@pytest.mark.parametrize(
    "broker",
    [
        {"broker_url": None},  # Celery's default broker is AMQP
        {"broker_url": None, "broker_transport": "pyamqp"},
        {"broker_url": "AMQP://guest@127.0.0.1:5672//"},
        # The worker consumes from the read URL.
        {"broker_url": "redis://127.0.0.1/0", "broker_read_url": "amqp://guest@127.0.0.1//"},
    ],
    ids=["default", "transport", "upper-case", "read-url"],
)
def test_the_amqp_broker_a_worker_consumes_from_is_judged_however_it_is_named(broker):
    app = make_app(
        **{**AMQP, **broker}, steplock_broker_consumer_timeout=600, task_time_limit=4000
    )
    add_task(app)
    [warning] = consumer_timeout_warnings(app)
    assert "(600 s, steplock_broker_consumer_timeout)" in warning.message
    assert "(time_limit 4000 s)" in warning.message, warning.message


@pytest.mark.parametrize("scheme", ["amqp", "amqps", "pyamqp", "librabbitmq"])
def test_countdown_max_hold_lock_wait_and_time_limit_past_consumer_timeout_warn(scheme):
    app = make_app(
        **{**AMQP, "broker_url": f"{scheme}://guest@127.0.0.1:5672//"},
        steplock_broker_consumer_timeout=120,
        steplock_retry_backoff_max=300,
        steplock_max_hold=120,
    )
    held = add_task(app, lock_wait=600, time_limit=3600)
    fine = add_task(app, lock_wait=5, lock_max_hold=60, time_limit=100)
    [warning] = consumer_timeout_warnings(app)
    assert warning.id == "celery_steplock.W004" and not warning.is_error
    head = (
        "Countdowns, holds or time limits not below the AMQP broker's consumer_timeout "
        "(120 s, steplock_broker_consumer_timeout): "
    )
    tail = (
        ". RabbitMQ closes the channel of a delivery left unacknowledged that long and requeues "
        "the message: another worker runs the task while it still runs or waits for its "
        "countdown, the duplicate waits on the lease, and the Celery worker whose channel was "
        "closed stops."
    )
    assert warning.message.startswith(head) and warning.message.endswith(tail)
    # The settings first, then each task's (other test modules' shared tasks may be listed).
    items = warning.message[len(head) : -len(tail)].split(", ")
    assert items[:2] == [
        "lease retries (steplock_retry_backoff_max 300 s)",
        "task defaults (steplock_max_hold 120 s)",
    ]
    assert [i for i in items if i.startswith(f"{held} (")] == [
        f"{held} (lock_wait 600 s)",
        f"{held} (time_limit 3600 s)",
    ]
    assert fine not in warning.message
    assert warning.hint == (
        "Raise consumer_timeout in rabbitmq.conf (milliseconds; per queue with a "
        "consumer-timeout policy on RabbitMQ 3.12+) above your longest task and "
        "countdown, and set CELERY_STEPLOCK_BROKER_CONSUMER_TIMEOUT (seconds) to match; or "
        "lower them (CELERY_STEPLOCK_RETRY_BACKOFF_MAX caps the lease retries' countdowns)."
    )
    # Django's check renders the same warning.
    rendered = [m for m in checks.check_time_limits(app) if m.obj == warning.obj]
    assert [(m.id, m.msg, m.hint) for m in rendered] == [
        (warning.id, warning.message, warning.hint)
    ]


def test_rabbitmq_default_consumer_timeout_and_a_disabled_one():
    app = make_app(**AMQP, task_time_limit=1800)  # RabbitMQ's default: 1800 s
    [warning] = consumer_timeout_warnings(app)
    assert "consumer_timeout (1800 s," in warning.message
    assert "(time_limit 1800 s)" in warning.message
    app = make_app(**AMQP, task_time_limit=1800, steplock_broker_consumer_timeout=3600)
    assert consumer_timeout_warnings(app) == []
    # 0: the server's consumer_timeout is off (consumer_timeout = undefined).
    app = make_app(**AMQP, steplock_retry_backoff_max=7200, steplock_broker_consumer_timeout=0)
    assert consumer_timeout_warnings(app) == []


def test_an_invalid_consumer_timeout_is_e003_not_a_crash():
    app = make_app(**AMQP, steplock_broker_consumer_timeout="30 minutes")
    found = [p for p in problems(app) if "steplock_broker_consumer_timeout" in p.message]
    assert [(p.id, p.obj) for p in found] == [
        ("celery_steplock.E003", "steplock_broker_consumer_timeout")
    ]


# -- W012: return_winner without result_extended ------------------------------------------------


def return_winner_warnings(app):
    return [p for p in problems(app) if p.id == "celery_steplock.W012"]


def test_return_winner_without_result_extended_warns_naming_the_tasks():
    app = make_app()  # Celery's default: result_extended off
    winner = add_task(app, on_conflict="return_winner")
    add_task(app)  # on_conflict="return": nothing to say
    [warning] = return_winner_warnings(app)
    assert not warning.is_error and warning.obj == "result_extended"
    assert "while result_extended is off: " in warning.message and winner in warning.message
    assert "CELERY_RESULT_EXTENDED = True" in warning.hint
    # The setting names every task that does not set the option.
    by_setting = make_app(steplock_on_conflict="return_winner")
    plain = add_task(by_setting)
    returns = add_task(by_setting, on_conflict="return")
    [warning] = return_winner_warnings(by_setting)
    assert plain in warning.message and returns not in warning.message
    # result_extended on: no warning; the Django check renders the same problem.
    extended = make_app(result_extended=True)
    add_task(extended, on_conflict="return_winner")
    assert return_winner_warnings(extended) == []
    assert [m.id for m in checks.check_return_winner(app)] == ["celery_steplock.W012"]
