"""One structured log line per event (celery_steplock.events)."""
import logging

from celery_steplock import signals
from celery_steplock.events import emit


def test_log_line_is_logfmt_and_cannot_be_forged(caplog):
    with caplog.at_level(logging.INFO, logger="celery_steplock"):
        emit(signals.lock_acquired, None, key='steplock:lease:{a b\nevent=lock_lost}',
             owner="o1", fence=7, task_name="t", ttl=3.0, name="n")
    (record,) = caplog.records
    text = record.getMessage()
    assert "\n" not in text
    assert text.startswith("event=lock_acquired key=\"steplock:lease:{a b\\nevent=lock_lost}\"")
    assert " owner=o1 fence=7 task_name=t ttl=3.0" in text
    assert record.steplock["event"] == "lock_acquired" and record.steplock["fence"] == 7


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
