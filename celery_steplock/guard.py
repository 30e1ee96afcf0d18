"""Deprecated: the Django compare-and-swap moved to :mod:`celery_steplock.contrib.django.steps`
(:class:`~celery_steplock.contrib.django.steps.DjangoStepStore`); ``TransitionResult`` lives in
:mod:`celery_steplock.steps`. These names stay for one release.
"""

from __future__ import annotations

import warnings
from typing import Any

from . import _django
from .steps import TransitionResult

_steps = _django.contrib("steps")
DjangoStepStore = _steps.DjangoStepStore
resolve_model = _steps.resolve_model

__all__ = ["StepTransitionGuard", "TransitionResult", "resolve_model"]


class StepTransitionGuard(DjangoStepStore):
    """Deprecated alias of :class:`~celery_steplock.contrib.django.steps.DjangoStepStore`."""

    def __init__(self, model: Any, **kwargs: Any):
        warnings.warn(
            "celery_steplock.guard.StepTransitionGuard is deprecated; use "
            "celery_steplock.contrib.django.steps.DjangoStepStore",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(model, **kwargs)
