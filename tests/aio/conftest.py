"""Fixtures shared by the asyncio suites of tests/aio/."""

import pytest

from celery_steplock.patterns.breaker import forget_cached_states


@pytest.fixture
def no_cached_breaker_states():
    """The process's cached circuit-breaker states forgotten before and after the test
    (a state cached by one test never answers another's breaker)."""
    forget_cached_states()
    yield
    forget_cached_states()
