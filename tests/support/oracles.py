"""Test oracles: reference models that judge a recorded history against a pattern's guarantee.

Used by the rate-limit tests (tests/patterns/test_ratelimit.py, the workers' evidence in
tests/patterns/test_ratelimit_workers.py) and the rate-limit benchmark (benchmarks/
ratelimit.py); the checkers' own negative controls are in
``test_history_checkers_flag_a_violation``. They lived at the bottom of
``celery_steplock.patterns.ratelimit`` until issue 23: nothing in the library uses them.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["max_in_window", "bucket_excess"]


def max_in_window(times: Sequence[float], window: float) -> tuple[int, float | None]:
    """The most of ``times`` inside any half-open window ``[t, t + window)``.

    A sliding window's guarantee is that this never exceeds its ``limit``.

    Args:
        times: grant or start times, in seconds (compared to the microsecond).
        window: the window's length, in seconds.

    Returns:
        ``(count, t)``: the largest count and a ``t`` where it is reached (None for no
        times).
    """
    # In whole microseconds (Redis TIME's resolution): two grants exactly one window apart
    # are in no common window, which float seconds near 1.8e9 cannot always tell.
    ordered = sorted(round(t * 1e6) for t in times)
    span = round(window * 1e6)
    best, where, start = 0, None, 0
    for end, moment in enumerate(ordered):
        while moment - ordered[start] >= span:
            start += 1
        if end - start + 1 > best:
            best, where = end - start + 1, ordered[start] / 1e6
    return best, where


def bucket_excess(times: Sequence[float], rate: float, capacity: int) -> float:
    """The largest ``count - (capacity + rate * (last - first))`` over every run of
    consecutive ``times``.

    A token bucket's guarantee is that this is never above 0: at most
    ``capacity + rate * t`` admissions in any interval of ``t`` seconds.

    Args:
        times: grant or start times, in seconds.
        rate: the bucket's refill rate, in tokens per second.
        capacity: the bucket's capacity, in tokens.

    Returns:
        The excess in tokens (0.0 for no times).
    """
    # Relative to the first time: rate * (seconds near 1.8e9) would lose the microseconds.
    ordered = [t - min(times) for t in sorted(times)] if times else []
    worst = -math.inf
    # Over runs ending at j, count - rate*(t_j - t_i) is largest for the i maximising
    # (j - i + 1) - rate*(t_j - t_i), i.e. maximising rate*t_i - i.
    best_start = -math.inf
    for j, moment in enumerate(ordered):
        best_start = max(best_start, rate * moment - j)
        worst = max(worst, (j + 1) - rate * moment + best_start - capacity)
    return worst if ordered else 0.0
