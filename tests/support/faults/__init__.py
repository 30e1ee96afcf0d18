"""The fault-injection harness: a TCP proxy for network faults (proxy), the invariant checker
(checker), the controller that runs real workers against real servers (lab) and the fault
scenarios (scenarios). Used by ``tests/faults`` (each scenario once), ``scripts/soak.py``
(N trials per scenario, ``docs/reliability.md``)."""
