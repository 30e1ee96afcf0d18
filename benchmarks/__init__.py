"""celery-steplock benchmark suite: ``python benchmarks/run.py [--quick] [--only GROUP ...]``.

One module per group (``lock_primitive``, ``e2e``, ``heartbeat``, ``blocking_wait``,
``operators``); ``run.py`` runs each in its own subprocess, collects their figures and writes
``docs/performance.md`` and ``docs/performance.json``. See ``benchmarks/README.md``.
"""
