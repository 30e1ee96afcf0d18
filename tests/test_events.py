"""One structured log line per event (celery_steplock.events)."""

import ast
import logging
from pathlib import Path

import pytest

from celery_steplock import signals
from celery_steplock.events import emit, log_event


def test_log_line_is_logfmt_and_cannot_be_forged(caplog):
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        emit(
            signals.lock_acquired,
            None,
            key="steplock:lease:{a b\nevent=lock_lost}",
            owner="o1",
            fence=7,
            task_name="t",
            ttl=3.0,
            name="n",
        )
    (record,) = caplog.records
    text = record.getMessage()
    assert "\n" not in text
    assert text.startswith('event=lock_acquired key="steplock:lease:{a b\\nevent=lock_lost}"')
    assert " owner=o1 fence=7 task_name=t ttl=3.0" in text
    assert record.steplock["event"] == "lock_acquired" and record.steplock["fence"] == 7


def test_durations_are_rounded_to_microseconds_in_the_line_and_the_record(caplog):
    """A ``*_seconds`` float is written with 6 decimals at most, in fixed notation; the
    signal's receivers get it as measured."""
    seen = []
    signals.lock_released.connect(lambda **kw: seen.append(kw["hold_seconds"]), weak=False)
    try:
        with caplog.at_level(logging.INFO, logger="celery_steplock"):
            emit(
                signals.lock_released,
                None,
                key="k",
                owner="o",
                fence=1,
                wait_seconds=0.00027734799999734605,
                hold_seconds=2.4e-06,
                cas_seconds=3.0,
            )
            log_event("execution_done", task_id="t", hold_seconds=5e-06, wait_seconds=1e-07)
    finally:
        signals.lock_released.receivers.clear()
    assert seen == [2.4e-06]
    first, second = caplog.records
    assert first.getMessage() == (
        "event=lock_released key=k owner=o fence=1 wait_seconds=0.000277 "
        "hold_seconds=0.000002 cas_seconds=3.0"
    )
    assert (first.steplock["wait_seconds"], first.steplock["hold_seconds"]) == (0.000277, 2e-06)
    assert second.getMessage() == (
        "event=execution_done task_id=t hold_seconds=0.000005 wait_seconds=0.0"
    )
    assert second.steplock == {
        "event": "execution_done",
        "task_id": "t",
        "hold_seconds": 5e-06,
        "wait_seconds": 0.0,
    }


def test_a_raising_receiver_never_breaks_the_caller(caplog):
    def boom(**kwargs):
        raise RuntimeError("receiver failed")

    seen = []
    signals.lock_released.connect(boom, weak=False)
    signals.lock_released.connect(lambda **kw: seen.append(kw["owner"]), weak=False)
    try:
        emit(signals.lock_released, None, key="k", owner="o", fence=1)
    finally:
        signals.lock_released.disconnect(boom)
        signals.lock_released.receivers.clear()
    assert seen == ["o"]


# -- every line the library writes ----------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "celery_steplock"
LEVELS = {"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"}


def direct_log_calls(tree):
    """``logger.<level>`` / ``logging.<level>`` / ``getLogger(...).<level>`` in ``tree``:
    called or passed on (``_report(logger.error, ...)``), both bypass events.py."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in LEVELS):
            continue
        target = node.value
        name = getattr(target, "id", getattr(target, "attr", ""))
        if isinstance(target, (ast.Name, ast.Attribute)) and (
            name in ("logging", "log") or "logger" in name.lower()
        ):
            yield node.lineno
        elif (
            isinstance(target, ast.Call)
            and getattr(target.func, "attr", getattr(target.func, "id", "")) == "getLogger"
        ):
            yield node.lineno


def test_no_log_line_of_the_package_bypasses_events_py():
    """Every log call goes through events.emit / events.log_event, which escape each value
    and attach ``record.steplock``; a direct logger call here would do neither."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "events.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        found += [f"{path.relative_to(PACKAGE)}:{line}" for line in direct_log_calls(tree)]
    assert found == []


def test_the_scan_finds_each_form_of_direct_call():
    source = (
        "logger.info('x')\nlogging.warning('x')\nself.logger.error('x')\n"
        "report(logger.error, 'x')\nlogging.getLogger('a').debug('x')\n"
        "log_event('x')\nlogger.isEnabledFor(10)\n"
    )
    assert sorted(direct_log_calls(ast.parse(source))) == [1, 2, 3, 4, 5]


def test_log_event_escapes_every_value_and_carries_the_fields(caplog):
    forged = "tid\nevent=lock_acquired key=steplock:lease:x"
    with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
        log_event(
            "commit_failed",
            logging.WARNING,
            task_id=forged,
            task_name="t",
            step_id='7 "x"=1',
            error=ValueError("bad\r\nline"),
            skipped=None,
            countdown=0.25,
        )
    (record,) = caplog.records
    text = record.getMessage()
    assert text == (
        'event=commit_failed task_id="tid\\nevent=lock_acquired '
        'key=steplock:lease:x" task_name=t step_id="7 \\"x\\"=1" '
        'error="ValueError: bad\\r\\nline" countdown=0.25'
    )
    assert record.levelno == logging.WARNING
    assert record.steplock == {
        "event": "commit_failed",
        "task_id": forged,
        "task_name": "t",
        "step_id": '7 "x"=1',
        "error": "ValueError: bad\r\nline",
        "skipped": None,
        "countdown": 0.25,
    }


def test_terminal_escapes_are_escaped_too(caplog):
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        log_event("retry_scheduled", task_id="\x1b[2J\x1b[31mred\u2028x")
    assert (
        caplog.records[0].getMessage()
        == 'event=retry_scheduled task_id="\\u001b[2J\\u001b[31mred\\u2028x"'
    )


def test_a_disabled_level_builds_nothing(caplog):
    class Loud:
        def __str__(self):
            raise AssertionError("formatted although the level is off")

    with caplog.at_level(logging.WARNING, logger="celery_steplock"):
        log_event("reaper_batch", logging.DEBUG, value=Loud())
    assert caplog.records == []


@pytest.mark.django_db
def test_retry_scheduled_with_a_forged_task_id_stays_one_line(app, caplog):
    """The line of issue 12's finding 4: a client-chosen task id with a newline."""
    from celery.exceptions import Retry

    from celery_steplock.exceptions import LockContended
    from celery_steplock.task import StepLockedTask

    @app.task(bind=True, base=StepLockedTask, name="tests.events.forged", lock_key="x")
    def forged(self):
        return None

    task_id = "abc\nevent=lock_released key=steplock:lease:victim forced=True"
    forged.push_request(
        id=task_id,
        args=(),
        kwargs={},
        retries=0,
        is_eager=True,
        called_directly=False,
        delivery_info={},
    )
    try:
        # retry_scheduled is DEBUG (an execution's INFO line is its execution_done)
        with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
            with pytest.raises(Retry):
                forged.steplock_retry(LockContended("busy", key="k"))
    finally:
        forged.pop_request()
    (record,) = [r for r in caplog.records if r.steplock["event"] == "retry_scheduled"]
    text = record.getMessage()
    assert "\n" not in text
    assert text.startswith('event=retry_scheduled task_id="abc\\nevent=lock_released key=')
    assert record.levelno == logging.DEBUG
    assert record.steplock["task_id"] == task_id
    assert record.steplock["task_name"] == "tests.events.forged"
    assert record.steplock["reason"] == "LockContended"
    assert 0.05 <= record.steplock["countdown"] <= forged.steplock_plan.retry_backoff_max


LOGS_PAGE = PACKAGE.parent / "docs" / "reference" / "logs.md"


def docs_json_logging():
    """The JSON logging block of the logs reference page, run as the page shows it."""
    text = LOGS_PAGE.read_text()
    block = text.split("<!-- json-logging", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(block, "docs/reference/logs.md:json-logging", "exec"), namespace)
    return namespace


def test_the_docs_json_logging_configuration_parses(tmp_path):
    import io
    import json
    import logging.config

    config = docs_json_logging()["LOGGING"]
    stream = io.StringIO()
    config["handlers"]["json"]["stream"] = stream
    logger = logging.getLogger("celery_steplock")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    try:
        logging.config.dictConfig(config)
        emit(
            signals.lock_acquired,
            None,
            key="steplock:lease:{a\nb}",
            name="a\nb",
            owner="o",
            fence=12,
            task_id="t\n1",
            task_name="tasks.x",
            ttl=3.0,
            wait_seconds=0.002,
        )
        log_event(
            "retry_scheduled",
            task_id="t\n1",
            task_name="tasks.x",
            countdown=0.5,
            reason="LockContended",
        )
        try:
            raise ValueError("boom")
        except ValueError:
            log_event("reaper_failed", logging.ERROR, exc_info=True, error="x")
        log_event("reaper_batch", logging.DEBUG, leases=1)  # below the configured INFO
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3
    first, second, third = (json.loads(line) for line in lines)
    assert first["level"] == "INFO" and first["logger"] == "celery_steplock"
    assert first["message"].startswith('event=lock_acquired key="steplock:lease:{a\\nb}"')
    steplock = first["steplock"]
    assert {
        k: steplock[k]
        for k in (
            "event",
            "key",
            "name",
            "owner",
            "fence",
            "task_id",
            "task_name",
            "ttl",
            "wait_seconds",
        )
    } == {
        "event": "lock_acquired",
        "key": "steplock:lease:{a\nb}",
        "name": "a\nb",
        "owner": "o",
        "fence": 12,
        "task_id": "t\n1",
        "task_name": "tasks.x",
        "ttl": 3.0,
        "wait_seconds": 0.002,
    }
    assert isinstance(steplock["monotonic"], float) and isinstance(steplock["timestamp"], float)
    assert second["steplock"] == {
        "event": "retry_scheduled",
        "task_id": "t\n1",
        "task_name": "tasks.x",
        "countdown": 0.5,
        "reason": "LockContended",
    }
    assert third["level"] == "ERROR" and third["steplock"] == {
        "event": "reaper_failed",
        "error": "x",
    }
    assert "ValueError: boom" in third["exc_info"]


def test_every_event_line_of_the_package_is_documented_in_the_logs_reference():
    """Each ``log_event("<name>", ...)`` of the package appears in the "Log lines" section of
    docs/reference/logs.md (the README points there)."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    names = set()
    for path in (root / "celery_steplock").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "log_event"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(node.args[0].value)
    page = (root / "docs" / "reference" / "logs.md").read_text()
    section = re.search(r"^## Log lines\n(.*?)^## ", page, re.S | re.M).group(1)
    assert len(names) > 20
    assert sorted(n for n in names if f"`{n}`" not in section) == []
