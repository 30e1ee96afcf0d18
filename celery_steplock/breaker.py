"""Deprecated: the circuit breaker moved to :mod:`celery_steplock.patterns.breaker` (this path is kept one release)."""

from ._moved import alias

alias(__name__, "celery_steplock.patterns.breaker")
