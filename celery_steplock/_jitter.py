"""The one jitter helper of every backoff in the package (the ground floor: it imports only
the standard library, so the exceptions, the task and the patterns all use it).

The rule is "full jitter" from the AWS Architecture Blog, "Exponential Backoff And Jitter"
(Marc Brooker, 2015): wait a time drawn uniformly between zero and the exponential ceiling,
so that callers refused together do not come back together.
"""

from __future__ import annotations

import random

__all__ = ["full_jitter", "backoff_ceiling"]


def full_jitter(span: float, *, after: float = 0.0) -> float:
    """A wait drawn uniformly from ``[after, after + span]`` seconds.

    Full jitter (AWS Architecture Blog, "Exponential Backoff And Jitter", 2015) spreads the
    wait over the whole span; ``after`` shifts it past the earliest moment worth trying
    (``after = span`` gives the blog's "equal jitter" over ``2 * span``).

    Args:
        span: seconds the wait is spread over (>= 0).
        after: seconds the wait is at least (>= 0).

    Returns:
        The wait in seconds.
    """
    return after + random.uniform(0.0, span)


def backoff_ceiling(base: float, attempt: int, cap: float, *, max_exponent: int = 62) -> float:
    """The exponential ceiling of a backoff: ``min(cap, base * 2**attempt)``.

    Args:
        base: seconds of the first wait's ceiling (``attempt`` 0).
        attempt: how many attempts failed before this one (0-based); the exponent is
            clamped to ``max_exponent``, which keeps ``2**attempt`` finite.
        cap: the longest ceiling, seconds.
        max_exponent: the largest exponent used.

    Returns:
        The ceiling in seconds, to draw the wait under with :func:`full_jitter`.
    """
    return min(cap, base * (2 ** min(attempt, max_exponent)))
