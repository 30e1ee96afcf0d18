"""Test support, not tests: throwaway servers (``servers``, ``sentinel``, ``cluster``, ``tls``,
``acl``), the lock-store topologies every pattern runs on, as session fixtures
(``topologies``), supervised processes and polling (``processes``), the test oracles that
judge a recorded history (``oracles``) and the fault harness (``faults``: TCP proxy, lab,
scenarios, invariant checker).

Used by the test suite, ``scripts/`` (demo, run_tests, soak, bootstrap's verify step) and
``benchmarks/``, all with the repository root on ``sys.path`` (``import tests.support``).
pytest does not collect this package (``collect_ignore`` in ``tests/conftest.py``).
"""

from pathlib import Path

#: The repository root.
ROOT = Path(__file__).resolve().parents[2]
