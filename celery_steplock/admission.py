"""Deprecated: the admission gates moved to :mod:`celery_steplock.patterns.gates` (this path is kept one release)."""

from ._moved import alias

alias(__name__, "celery_steplock.patterns.gates")
