"""Deprecation shims for modules that moved: the old import path stays valid for one release
and is the new module itself (``celery_steplock.breaker is celery_steplock.patterns.breaker``),
so attributes patched through either name are the same."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module being imported as ``old`` the module ``new`` (imported here), with a
    DeprecationWarning naming both."""
    warnings.warn(
        f"{old} moved to {new}; the old path is kept for one release",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
