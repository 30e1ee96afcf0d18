"""Deprecated: the admission gates moved to :mod:`celery_steplock.patterns` (the registry:
``GATES``, ``gate_options``, ``build_gates``, ``gate_problems``) and
:mod:`celery_steplock.patterns.gates` (the protocols, re-exported by the package); this path
is kept one release."""

from ._moved import alias

alias(__name__, "celery_steplock.patterns")
