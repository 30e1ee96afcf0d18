"""Deprecated: the retry policy moved to :mod:`celery_steplock.patterns.retry` (this path is kept one release)."""

from ._moved import alias

alias(__name__, "celery_steplock.patterns.retry")
