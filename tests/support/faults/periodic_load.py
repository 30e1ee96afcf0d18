"""The periodic workload of the randomized fault run: ``senders`` threads, each
sending the periodic task of ``django_app/faults/periodic.py`` every ``interval`` seconds (two
beats, or two hosts each running one), its run lasting longer than the interval. The rule is
:func:`tests.support.faults.overlap_rules.check_periodic`.

Each send writes a ``periodic_send`` history entry (``name``, ``task_id``, ``sender``) through
the caller's ``note`` (``Lab.note``). ``guarded=False`` sends ``periodic_unguarded`` (the
negative control: no lease, the runs overlap).
"""

from __future__ import annotations

import threading
import time
import uuid

PERIODIC = "django_app.faults.periodic"
INTERVAL = 1.0  # seconds between two sends of one sender
RUN = 2.5  # seconds a run lasts: longer than the interval


def task_name(guarded: bool = True) -> str:
    return f"{PERIODIC}.{'periodic_skip' if guarded else 'periodic_unguarded'}"


def sender(
    publisher,
    note,
    index: int,
    seconds: float,
    stop: threading.Event,
    guarded: bool = True,
    interval: float = INTERVAL,
    run: float = RUN,
    phase: float = 0.0,
    errors: list | None = None,
) -> int:
    """Send the periodic task every ``interval`` seconds for ``seconds`` (or until ``stop``),
    the first after ``phase`` seconds; returns the number of sends. A send that fails (the
    broker is the control Redis, which the faults leave alone) is appended to ``errors``."""
    from django_app.faults.periodic import NAME

    name = task_name(guarded)
    began = time.monotonic()
    sends = 0
    k = 0
    while True:
        due = began + phase + k * interval
        if due > began + seconds:
            break
        if stop.wait(max(0.0, due - time.monotonic())):
            break
        k += 1
        task_id = str(uuid.uuid4())
        try:
            publisher.send_task(
                name,
                kwargs={"run": run, "name": NAME, "sent_by": index},
                task_id=task_id,
            )
        except Exception as exc:  # noqa: BLE001 - counted, the sender goes on
            if errors is not None:
                errors.append(f"periodic sender {index}: {type(exc).__name__}: {exc}")
            continue
        note("periodic_send", name=NAME, task_id=task_id, sender=index)
        sends += 1
    return sends


def start_senders(
    publisher,
    note,
    seconds: float,
    stop: threading.Event,
    guarded: bool = True,
    senders: int = 2,
    interval: float = INTERVAL,
    run: float = RUN,
    errors: list | None = None,
) -> list[threading.Thread]:
    """Start ``senders`` daemon threads of :func:`sender` (the second a tenth of an interval
    after the first: two beats' ticks are close, not equal); returns them, started."""
    threads = []
    for index in range(senders):
        thread = threading.Thread(
            target=sender,
            args=(publisher, note, index, seconds, stop),
            kwargs={
                "guarded": guarded,
                "interval": interval,
                "run": run,
                "phase": 0.1 * interval * index,
                "errors": errors,
            },
            name=f"periodic-sender-{index}",
            daemon=True,
        )
        thread.start()
        threads.append(thread)
    return threads
