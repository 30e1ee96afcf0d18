"""The idempotency suites' shared fixture (tests/patterns/test_idempotency.py and
tests/aio/test_idempotency_async.py): import it into a test module to use it."""

import pytest

from celery_steplock import signals

#: The idempotency policy's signals.
SIGNALS = (
    signals.idempotency_locked,
    signals.idempotency_replayed,
    signals.idempotency_completed,
    signals.idempotency_failed,
    signals.idempotency_conflict,
)


@pytest.fixture
def seen():
    """Every idempotency signal sent during the test, as (name, kwargs)."""
    found = []

    def receiver(sender=None, signal=None, **kw):
        found.append((signal.name, kw))

    for sig in SIGNALS:
        sig.connect(receiver, weak=False)
    yield found
    for sig in SIGNALS:
        sig.disconnect(receiver)
