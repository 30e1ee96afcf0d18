"""System checks ``celery_steplock.E001``-``E003``, ``W001``-``W004``.

Each check function takes a Celery app; most tests build a throwaway app (Celery adds the
example project's shared tasks to every app it finalizes, so assertions name their own tasks).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery, signals
from django.core.checks.registry import registry
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.urls import get_script_prefix, set_script_prefix

from celery_steplock import StepLockedTask
from celery_steplock.contrib.django import checks, leases
from tests.helpers import closed_port_url

ROOT = Path(__file__).resolve().parents[2]
_names = itertools.count()


def make_app(**conf):
    app = Celery(f"checks{next(_names)}", set_as_current=False)
    app.conf.broker_url = "redis://127.0.0.1:6379/0"
    app.conf.update(conf)
    return app


def add_task(app, **options):
    """Register a StepLockedTask on ``app``; returns its name."""
    name = f"checks.task{next(_names)}"

    def body(self, step_id):
        return step_id

    app.task(bind=True, base=StepLockedTask, name=name, shared=False, **options)(body)
    return name


def ids(messages):
    return [m.id for m in messages]


def about(messages, text):
    return [m for m in messages if text in m.msg]


# -- E003 -------------------------------------------------------------------------------------


def test_valid_settings_pass():
    assert checks.check_settings(make_app()) == []


def test_every_invalid_setting_is_named():
    app = make_app(steplock_default_ttl=-1, steplock_on_contended="wait")
    errors = checks.check_settings(app)
    assert ids(errors) == ["celery_steplock.E003"] * 2
    assert {e.obj for e in errors} == {"steplock_default_ttl", "steplock_on_contended"}
    assert "CELERY_STEPLOCK_DEFAULT_TTL" in errors[0].hint + errors[1].hint
    assert all("Invalid celery-steplock setting steplock_" in e.msg for e in errors)


def test_missing_redis_url_with_a_non_redis_broker_is_e003():
    app = make_app(broker_url="amqp://guest@localhost//")
    [error] = checks.check_settings(app)
    assert error.id == "celery_steplock.E003" and error.obj == "steplock_redis_url"


# -- W001 -------------------------------------------------------------------------------------


def test_ttl_below_the_redis_default_visibility_timeout_passes():
    assert checks.check_visibility_timeout(make_app(steplock_default_ttl=30)) == []


def test_default_ttl_not_below_the_redis_default_warns():
    [warning] = checks.check_visibility_timeout(make_app(steplock_default_ttl=3600))
    assert warning.id == "celery_steplock.W001"
    assert "3600 s" in warning.msg and "steplock_default_ttl=3600" in warning.msg


def test_configured_visibility_timeout_and_task_lock_ttl():
    app = make_app(steplock_default_ttl=30, broker_transport_options={"visibility_timeout": 120})
    name = add_task(app, lock_ttl=300)
    [warning] = checks.check_visibility_timeout(app)
    assert f"{name} lock_ttl=300" in warning.msg and "steplock_default_ttl" not in warning.msg
    app = make_app(steplock_default_ttl=30, broker_transport_options={"visibility_timeout": 20})
    assert ids(checks.check_visibility_timeout(app)) == ["celery_steplock.W001"]


def test_non_redis_broker_without_a_visibility_timeout_is_not_judged():
    app = make_app(
        broker_url="amqp://guest@localhost//",
        steplock_default_ttl=7200,
        steplock_redis_url="redis://127.0.0.1:6379/0",
    )
    assert checks.check_visibility_timeout(app) == []


# -- W002 -------------------------------------------------------------------------------------


def test_acks_late_and_reject_on_worker_lost_pass():
    app = make_app(task_acks_late=True, task_reject_on_worker_lost=True)
    name = add_task(app)
    assert not any(name in m.msg for m in checks.check_worker_lost(app))


def test_early_ack_warns():
    app = make_app()  # Celery's defaults: acks_late off
    name = add_task(app)
    [warning] = about(checks.check_worker_lost(app), name)
    assert warning.id == "celery_steplock.W002" and "acks_late is off" in warning.msg
    assert "CELERY_TASK_REJECT_ON_WORKER_LOST" in warning.hint


def test_acks_late_without_reject_on_worker_lost_warns():
    app = make_app(task_acks_late=True)
    name = add_task(app)
    late_ok = add_task(app, reject_on_worker_lost=True)
    [warning] = about(checks.check_worker_lost(app), name)
    assert warning.id == "celery_steplock.W002" and "without reject_on_worker_lost" in warning.msg
    assert late_ok not in warning.msg


# -- W004 -------------------------------------------------------------------------------------


def test_soft_below_hard_below_visibility_timeout_passes():
    app = make_app(
        task_soft_time_limit=50,
        task_time_limit=60,
        broker_transport_options={"visibility_timeout": 120},
    )
    add_task(app)
    assert checks.check_time_limits(app) == []


def test_soft_time_limit_not_below_time_limit_warns():
    app = make_app(broker_transport_options={"visibility_timeout": 120})
    name = add_task(app, soft_time_limit=60, time_limit=60)
    fine = add_task(app, soft_time_limit=30, time_limit=60)
    [warning] = about(checks.check_time_limits(app), name)
    assert warning.id == "celery_steplock.W004"
    assert f"{name} (soft 60 s, hard 60 s)" in warning.msg and fine not in warning.msg


def test_retry_backoff_max_not_below_the_visibility_timeout_warns():
    app = make_app(
        steplock_retry_backoff_max=60, broker_transport_options={"visibility_timeout": 30}
    )
    [warning] = checks.check_time_limits(app)
    assert warning.id == "celery_steplock.W004"
    assert "lease retries (steplock_retry_backoff_max 60 s)" in warning.msg


def test_time_limit_not_below_the_visibility_timeout_warns():
    app = make_app(task_time_limit=3600)  # the Redis default visibility_timeout: 3600 s
    name = add_task(app)
    [warning] = about(checks.check_time_limits(app), name)
    assert warning.id == "celery_steplock.W004"
    assert f"{name} (time_limit 3600 s)" in warning.msg and "(3600 s)" in warning.msg


# -- E002 -------------------------------------------------------------------------------------


def test_step_model_with_its_status_field_passes():
    app = make_app()
    name = add_task(app, step_model="workflows.Step", step_id_arg="step_id")
    assert not any(name in m.msg for m in checks.check_step_models(app))


def test_missing_step_model_and_missing_status_field():
    app = make_app(steplock_status_field="state")
    missing = add_task(app, step_model="nosuchapp.Step")
    no_field = add_task(app, step_model="workflows.Step")
    errors = checks.check_step_models(app)
    assert set(ids(errors)) == {"celery_steplock.E002"}
    [error] = about(errors, missing)
    assert "does not exist" in error.msg
    [error] = about(errors, no_field)
    assert "has no field 'state'" in error.msg and "CELERY_STEPLOCK_STATUS_FIELD" in error.hint


# -- E001 -------------------------------------------------------------------------------------


def test_reachable_lock_store_passes(redis_server_url):
    assert checks.check_lock_store(make_app(steplock_redis_url=redis_server_url)) == []


def test_unreachable_lock_store_is_e001_without_the_password():
    url = closed_port_url().replace("redis://", "redis://:s3cret@")
    [error] = checks.check_lock_store(make_app(steplock_redis_url=url))
    assert error.id == "celery_steplock.E001" and "unreachable" in error.msg
    assert "s3cret" not in error.msg


# -- registration in the project ---------------------------------------------------------------


def test_only_the_network_check_is_a_deployment_check():
    assert checks.lock_store_check in registry.deployment_checks
    assert checks.lock_store_check not in registry.registered_checks
    for check in (
        checks.settings_check,
        checks.visibility_timeout_check,
        checks.worker_lost_check,
        checks.step_model_check,
        checks.task_modules_check,
    ):
        assert check in registry.registered_checks
        assert checks.TAG in check.tags


def test_ordinary_commands_do_not_touch_redis(app):
    app.conf.steplock_redis_url = closed_port_url()
    call_command("check")  # no E001: the network check needs --deploy
    with pytest.raises(SystemCheckError, match=r"celery_steplock\.E001"):
        call_command("check", "--deploy", "--tag", "celery_steplock")


def test_the_example_project_passes_its_deploy_checks(app):
    call_command("check", "--deploy", "--tag", "celery_steplock")


def test_an_invalid_setting_fails_every_command(app):
    app.conf.steplock_renewal_ratio = 2
    with pytest.raises(SystemCheckError, match=r"celery_steplock\.E003.*steplock_renewal_ratio"):
        call_command("check")


# -- the task modules (autodiscover_tasks() is lazy) ---------------------------------------------


def manage_py_check(tmp_path, **settings):
    """Run ``manage.py check`` in a fresh process with the example settings plus ``settings``
    (a settings module written to tmp_path): the process imports no tasks module but those
    the checks import."""
    lines = ["from django_app.settings import *  # noqa: F401,F403"]
    lines += [f"{name} = {value!r}" for name, value in settings.items()]
    module = f"steplock_check_settings_{next(_names)}"
    (tmp_path / f"{module}.py").write_text("\n".join(lines) + "\n")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": module,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "STEPLOCK_VAR_DIR": str(tmp_path / "var"),
    }
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_manage_py_check_sees_the_autodiscovered_tasks(tmp_path):
    """E002 in a real ``manage.py check``: the checks import the tasks modules themselves."""
    result = manage_py_check(tmp_path, CELERY_STEPLOCK_STATUS_FIELD="no_such_status")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "celery_steplock.E002" in result.stderr
    assert (
        "django_app.workflows.tasks.advance: step_model workflows.Step has no field "
        "'no_such_status'"
    ) in result.stderr
    # W002 judges the same tasks, not only the task defaults
    result = manage_py_check(tmp_path, CELERY_TASK_REJECT_ON_WORKER_LOST=False)
    assert result.returncode == 0, result.stderr
    assert "celery_steplock.W002" in result.stderr
    assert "django_app.workflows.tasks.advance" in result.stderr


def test_manage_py_check_of_the_example_project_is_clean(tmp_path):
    result = manage_py_check(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout, result.stdout + result.stderr


@pytest.fixture
def import_signals():
    """Counts Celery's import_modules signal per sender app."""
    sent = []

    def receiver(sender=None, **kwargs):
        sent.append(sender)

    signals.import_modules.connect(receiver, weak=False, dispatch_uid="test-checks-imports")
    yield sent
    signals.import_modules.disconnect(receiver, dispatch_uid="test-checks-imports")


def test_task_modules_are_imported_once_per_app(tmp_path, monkeypatch, import_signals):
    module = f"steplock_tasks_module_{next(_names)}"
    (tmp_path / f"{module}.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    app = make_app(imports=[module])
    assert leases.import_task_modules(app) is None
    assert module in sys.modules
    assert leases.import_task_modules(app) is None
    assert checks.check_task_modules(app) == []
    assert import_signals.count(app) == 1  # once, however often it is asked
    assert leases.task_import_error(app) is None


def test_task_modules_of_a_worker_are_not_imported_again(import_signals):
    app = make_app()
    app.loader.worker_initialized = True  # what init_worker() sets after importing them
    leases.import_task_modules(app)
    assert app not in import_signals


def test_a_nested_call_during_the_import_returns_at_once(import_signals):
    """Celery's Django fix-up runs the system checks while the modules are imported; the
    checks ask for the import again, which must not recurse."""
    app = make_app()
    nested = []

    def receiver(sender=None, **kwargs):
        nested.append(leases.import_task_modules(app))

    signals.import_modules.connect(receiver, sender=app, weak=False)
    try:
        leases.import_task_modules(app)
    finally:
        signals.import_modules.disconnect(receiver, sender=app)
    assert nested == [None] and import_signals.count(app) == 1


def test_the_url_script_prefix_survives_the_import():
    """The fix-up's django.setup() resets the script prefix: a request under SCRIPT_NAME
    must keep its own."""
    set_script_prefix("/sub/")
    try:
        leases.import_task_modules(make_app())
        assert get_script_prefix() == "/sub/"
    finally:
        set_script_prefix("/")


def test_unimportable_task_modules_are_w003_once(import_signals):
    app = make_app(imports=["no_such_module_for_w003"])
    [warning] = checks.check_task_modules(app)
    assert warning.id == "celery_steplock.W003"
    assert "ModuleNotFoundError" in warning.msg and "no_such_module_for_w003" in warning.msg
    assert isinstance(leases.task_import_error(app), ModuleNotFoundError)
    # reported again, not retried
    assert ids(checks.check_task_modules(app)) == ["celery_steplock.W003"]
    assert import_signals.count(app) == 1


# -- E005: the reaper's recovery models ----------------------------------------------------------


def recovery(**conf):
    return [(m.id, m.msg) for m in checks.check_recovery(make_app(**conf))]


def test_a_recovery_model_the_reaper_can_recover_passes():
    assert (
        recovery(
            steplock_reaper_recover={"workflows.Step": {"running": "pending"}},
            steplock_reaper_older_than=60,
        )
        == []
    )
    assert recovery() == []  # nothing to recover: nothing judged


def test_a_recovery_model_that_does_not_exist():
    assert recovery(steplock_reaper_recover={"workflows.Stepp": {"running": "pending"}}) == [
        (
            "celery_steplock.E005",
            "steplock_reaper_recover: workflows.Stepp: no such model: "
            "the reaper cannot recover its steps.",
        )
    ]


def test_a_recovery_model_without_the_columns_recovery_needs():
    found = recovery(
        steplock_reaper_recover={"workflows.TransitionRecord": {"a": "b"}},
        steplock_reaper_older_than=60,
    )
    prefix = "steplock_reaper_recover: workflows.TransitionRecord: "
    assert found == [
        (
            "celery_steplock.E005",
            prefix + "the model has no field 'status' "
            "(steplock_status_field), which recovery needs: the "
            "reaper cannot recover its steps.",
        ),
        (
            "celery_steplock.E005",
            prefix + "the model has no field 'lock_owner' "
            "(steplock_owner_field), which recovery needs: the "
            "reaper cannot recover its steps.",
        ),
        (
            "celery_steplock.E005",
            prefix + "steplock_reaper_older_than=60 needs an "
            "'updated_at' column (auto_now=True) on the model: "
            "the reaper refuses to recover its steps.",
        ),
    ]


def test_recovery_statuses_outside_the_status_choices():
    found = recovery(
        steplock_reaper_recover={"workflows.Step": {"runing": "pendng", "running": "pending"}}
    )
    choices = "('cancelled', 'done', 'failed', 'pending', 'running')"
    assert found == [
        (
            "celery_steplock.E005",
            f"steplock_reaper_recover: workflows.Step: in-flight status "
            f"'runing' is not a choice of workflows.Step.status "
            f"{choices}: steps in flight under the real name are never "
            f"recovered.",
        ),
        (
            "celery_steplock.E005",
            f"steplock_reaper_recover: workflows.Step: recovery status "
            f"'pendng' is not a choice of workflows.Step.status "
            f"{choices}: the reaper would write a status the field does "
            f"not allow.",
        ),
    ]


def test_a_model_without_choices_takes_any_status():
    assert recovery(steplock_reaper_recover={"routing.Invoice": {"anything": "else"}}) == []


def test_an_invalid_recovery_setting_is_e003_only():
    app = make_app(steplock_reaper_recover=["workflows.Step"])
    assert checks.check_recovery(app) == []
    assert ids(checks.check_settings(app)) == ["celery_steplock.E003"]


# -- W005: Django settings -------------------------------------------------------------------


def test_django_settings_without_the_namespace_are_named(app):
    from django.test import override_settings

    with override_settings(STEPLOCK_DEFAULT_TTL=3, CELERY_STEPLOCK_LOCK_WAITT=1):
        found = [(m.id, m.obj, m.msg, m.hint) for m in checks.check_unknown_names(app)]
    assert found == [
        (
            "celery_steplock.W005",
            "CELERY_STEPLOCK_LOCK_WAITT",
            "Unknown celery-steplock setting CELERY_STEPLOCK_LOCK_WAITT: it is ignored.",
            "Did you mean CELERY_STEPLOCK_LOCK_WAIT?",
        ),
        (
            "celery_steplock.W005",
            "STEPLOCK_DEFAULT_TTL",
            "Setting STEPLOCK_DEFAULT_TTL is never read: the Celery app reads its settings with "
            "the CELERY_ namespace (config_from_object(..., namespace='CELERY')), so it is "
            "ignored.",
            "Did you mean CELERY_STEPLOCK_DEFAULT_TTL?",
        ),
    ]
    assert checks.check_unknown_names(app) == []  # the example project's own settings


def test_django_settings_of_an_app_that_does_not_read_them():
    from django.conf import settings

    other = make_app()
    found = checks.check_unknown_names(other)
    expected = sorted(n for n in dir(settings) if n.isupper() and "STEPLOCK" in n)
    assert expected and [m.obj for m in found] == expected  # the example project's settings
    assert {m.id for m in found} == {"celery_steplock.W005"}
    assert found[0].msg == (
        f"Django setting {expected[0]} is never read: the Celery app "
        f"{other.main!r} does not load its configuration from the Django "
        f"settings, so it is ignored."
    )


# -- every problem at once: manage.py check and a worker's start -------------------------------

#: What tests/contrib/check_project (settings with several mistakes, a task with bad options)
#: must produce, in ``manage.py check`` and at a worker's start alike.
TASK = "tests.contrib.check_project.tasks.charge"
ERRORS = [
    (
        "celery_steplock.E005",
        "steplock_reaper_recover: workflows.Step: in-flight status "
        "'runing' is not a choice of workflows.Step.status ('cancelled', "
        "'done', 'failed', 'pending', 'running'): steps in flight under "
        "the real name are never recovered.",
    ),
    (
        "celery_steplock.E003",
        "Invalid celery-steplock setting steplock_renewal_ratio: "
        "steplock_renewal_ratio (CELERY_STEPLOCK_RENEWAL_RATIO in Django "
        "settings) must be a number between 0.05 and 0.75",
    ),
    (
        "celery_steplock.E004",
        f"{TASK}: lock_key 'order:{{order}}' names 'order', which is not "
        f"an argument of the task (arguments: order_id)",
    ),
    (
        "celery_steplock.E004",
        f"{TASK}: lock_ttl must be a number of seconds between 0.05 and 86400, got -1",
    ),
    (
        "celery_steplock.E004",
        f"{TASK}: on_conflict must be one of 'return', 'return_winner', 'ignore', 'raise', "
        "got 'clobber'",
    ),
    (
        "celery_steplock.E004",
        f"{TASK}: step_id_arg='id' is not an argument of the task (arguments: order_id)",
    ),
]
WARNINGS = [
    (
        "celery_steplock.W005",
        "Unknown celery-steplock setting CELERY_STEPLOCK_DEFUALT_TTL: it is ignored.",
    ),
    (
        "celery_steplock.W005",
        "Setting STEPLOCK_ON_CONFLICT is never read: the Celery app reads "
        "its settings with the CELERY_ namespace",
    ),
    ("celery_steplock.W005", f"{TASK}: unknown task option lock_tll: it is ignored."),
]


def run_in_check_project(tmp_path, *command):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.contrib.check_project.settings",
        "PYTHONPATH": str(ROOT),
        "STEPLOCK_VAR_DIR": str(tmp_path / "var"),
        "REDIS_URL": closed_port_url(),
    }
    return subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_manage_py_check_reports_every_mistake_at_once(tmp_path):
    result = run_in_check_project(tmp_path, "manage.py", "check")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    for check_id, message in ERRORS + WARNINGS:
        assert f"({check_id}) {message}" in output, (check_id, message, output)
    assert output.count("(celery_steplock.E") == len(ERRORS)
    assert output.count("(celery_steplock.W") == len(WARNINGS)
    assert "Did you mean CELERY_STEPLOCK_DEFAULT_TTL?" in output
    assert "Did you mean CELERY_STEPLOCK_ON_CONFLICT?" in output
    assert "Did you mean lock_ttl?" in output


def test_a_worker_start_reports_the_same_mistakes_at_once(tmp_path):
    result = run_in_check_project(
        tmp_path,
        "-m",
        "celery",
        "-A",
        "django_app",
        "worker",
        "-P",
        "solo",
        "--loglevel",
        "WARNING",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    for check_id, message in ERRORS:
        logged = "message=" + json.dumps(message)[:-1]  # logfmt: the message is quoted
        assert f"event=improperly_configured id={check_id} {logged}" in output, (
            check_id,
            message,
            output,
        )
    for check_id, message in WARNINGS:
        logged = "message=" + json.dumps(message)[:-1]
        assert f"event=configuration_warning id={check_id} {logged}" in output, (
            check_id,
            message,
            output,
        )
    assert output.count("event=improperly_configured") == len(ERRORS)
    [exit_line] = [line for line in output.splitlines() if line.startswith("celery-steplock: ")]
    for _, message in ERRORS:
        assert message in exit_line


# -- W005: the one Django-only setting --------------------------------------------------------


def test_a_misspelled_middleware_setting_suggests_the_django_only_name(app):
    from django.test import override_settings

    with override_settings(
        STEPLOCK_IDEMPOTENCY_MIDDLEWAR={}, CELERY_STEPLOCK_IDEMPOTENCY_MIDDLEWARE={}
    ):
        found = {m.obj: m.hint for m in checks.check_unknown_names(app)}
    hint = "Did you mean STEPLOCK_IDEMPOTENCY_MIDDLEWARE (a Django setting, without CELERY_)?"
    assert found == {
        "STEPLOCK_IDEMPOTENCY_MIDDLEWAR": hint,
        "CELERY_STEPLOCK_IDEMPOTENCY_MIDDLEWARE": hint,
    }


def test_e011_is_registered():
    from django.test import override_settings

    with override_settings(STEPLOCK_IDEMPOTENCY_MIDDLEWARE={"max_record": 5}):
        found = [m for m in registry.run_checks(tags=["celery_steplock"]) if m.id.endswith("E011")]
    assert len(found) == 1 and "max_records" in found[0].msg
