"""Deprecated: the Django compare-and-swap moved to :mod:`celery_steplock.contrib.django.steps`
(:class:`~celery_steplock.contrib.django.steps.DjangoStepStore`; ``StepTransitionGuard`` is its
deprecated alias there); ``TransitionResult`` lives in :mod:`celery_steplock.steps`. This path
is kept one release."""

from ._moved import alias

alias(__name__, "celery_steplock.contrib.django.steps")
