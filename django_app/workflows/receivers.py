"""Demo statistics: count celery-steplock signals in Redis.

Worker processes share no memory, so ``scripts/demo.py`` asks every worker to
``INCR <prefix>:<event>`` in Redis for each library signal it sends. Enabled
only when the environment variable ``STEPLOCK_DEMO_STATS=1``; the key prefix is
``STEPLOCK_DEMO_STATS_PREFIX`` (default ``demo:stats``) and the Redis URL is
``STEPLOCK_DEMO_STATS_URL``, else ``REDIS_URL``, else the Celery broker URL.
A failing receiver never affects the task (errors are swallowed and logged).
"""

import logging
import os

logger = logging.getLogger(__name__)

EVENTS = (
    "lock_acquired",
    "lock_contended",
    "lock_extended",
    "lock_released",
    "lock_expired",
    "lock_lost",
    "transition_applied",
    "transition_conflict",
    "lock_store_error",
)
STATS_TTL = 24 * 3600

_client = None
_client_pid = None


def enabled():
    return os.environ.get("STEPLOCK_DEMO_STATS") == "1"


def stats_prefix():
    return os.environ.get("STEPLOCK_DEMO_STATS_PREFIX", "demo:stats")


def stats_url():
    url = os.environ.get("STEPLOCK_DEMO_STATS_URL") or os.environ.get("REDIS_URL")
    if not url:
        from django.conf import settings

        url = settings.CELERY_BROKER_URL
    return url


def _redis():
    """One client per process (re-created after a fork)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        import redis

        _client = redis.Redis.from_url(stats_url(), socket_timeout=2, socket_connect_timeout=2)
        _client_pid = os.getpid()
    return _client


def _make_receiver(event):
    def receiver(sender=None, **kwargs):
        _count(event)

    receiver.__name__ = f"count_{event}"
    return receiver


_receivers = {event: _make_receiver(event) for event in EVENTS}


def _count(event):
    try:
        key = f"{stats_prefix()}:{event}"
        pipe = _redis().pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, STATS_TTL)
        pipe.execute()
    except Exception:  # never break a task for statistics
        logger.warning("demo stats: could not count %s", event, exc_info=True)


def count_redelivered(sender=None, task=None, **kwargs):
    """``task_prerun``: count messages kombu handed out again (``redelivered`` flag).

    kombu's Redis transport sets it when it restores an unacknowledged message
    after ``visibility_timeout`` (e.g. the message of a SIGKILLed worker).
    """
    request = getattr(task, "request", None)
    if request is None:
        return
    delivery_info = getattr(request, "delivery_info", None) or {}
    if delivery_info.get("redelivered") or getattr(request, "redelivered", False):
        _count("redelivered")


def connect():
    """Connect a counting receiver to every library signal (idempotent)."""
    if not enabled():
        return False
    from celery.signals import task_prerun
    from celery_steplock import signals

    task_prerun.connect(count_redelivered, weak=False, dispatch_uid="steplock-demo-redelivered")

    for event, receiver in _receivers.items():
        signal = getattr(signals, event, None)
        if signal is None:
            logger.warning("demo stats: celery_steplock.signals has no %s", event)
            continue
        signal.connect(receiver, weak=False, dispatch_uid=f"steplock-demo-stats-{event}")
    return True
