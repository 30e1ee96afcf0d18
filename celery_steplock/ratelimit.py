"""Deprecated: the rate limits moved to :mod:`celery_steplock.patterns.ratelimit` (this path is kept one release)."""

from ._moved import alias

alias(__name__, "celery_steplock.patterns.ratelimit")
