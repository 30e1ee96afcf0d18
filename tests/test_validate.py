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
    found = [p for p in problems(app) if p.obj in (bad, "steplock_default_ttl",
                                                   "steplock_on_conflict")]
    assert [(p.id, p.obj) for p in found] == [
        ("celery_steplock.E003", "steplock_default_ttl"),
        ("celery_steplock.E003", "steplock_on_conflict"),
        ("celery_steplock.E004", bad), ("celery_steplock.E004", bad)]
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
    assert [(m.id, m.msg, m.obj) for m in rendered] == [(p.id, p.message, p.obj)
                                                        for p in errors if p.obj == bad]
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
        (name, "Did you mean lock_ttl?")]


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
    name = add_task(app, step_model="workflows.Step", step_id_arg="step_id",
                    step_transitions=["pending"])
    found = [p for p in problems(app) if p.obj == name]
    assert [(p.id, "step_transitions" in p.message) for p in found] == [
        ("celery_steplock.E004", True)]


def test_an_unimportable_step_store_is_reported_without_any_task():
    app = make_app(steplock_step_store="no_such_pkg.steps:Store")
    assert [p.obj for p in problems(app) if p.id == "celery_steplock.E003"] == [
        "steplock_step_store"]
