"""Celery-side hooks: the ``steplock_*`` settings masked in Celery's own outputs, and the lock
store's PING at worker start.

**Masking.** ``celery inspect conf`` (the worker's ``conf`` remote control command) and
``celery report`` (``app.bugreport()``) both show ``app.conf.table()``, which Celery masks by
name only (``celery.app.utils.filter_hidden_settings``: keys matching ``HIDDEN_SETTINGS``,
the broker URL, result backends): ``steplock_redis_url`` is shown with its password. Celery
has no hook for other settings (celery/celery#5657, open), so :func:`mask_steplock_settings`
wraps that one function, once per process, when this module is imported (by
:mod:`celery_steplock.task`): Celery's own masking runs first and is kept as it is for every
key; then the value of every key naming a ``steplock_*`` setting (``steplock_redis_url``,
Django's ``CELERY_STEPLOCK_REDIS_URL``) goes through
:func:`celery_steplock.redact.redact_options`: URL credentials and password or secret
options masked, the server still named.

**Startup PING.** :func:`ping_lock_store` runs at ``worker_init``, after the configuration
check (:func:`celery_steplock.validate.refuse_to_start`; the receiver is in
:mod:`celery_steplock.task`): one PING, at most :data:`PING_TIMEOUT` seconds; when the store does not answer it
logs one WARNING (``event=lock_store_unreachable``) naming the setting and what tasks will
do. The worker still starts: the store may come up later.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping

from .clients import client_for_settings
from .conf import Settings
from .events import log_event
from .exceptions import ImproperlyConfigured
from .redact import redact, redact_options, secrets_of

__all__ = ["PING_TIMEOUT", "mask_steplock_settings", "masked_setting", "ping_lock_store"]

#: The startup PING's timeout, seconds (at most; lower when ``steplock_socket_timeout`` is).
PING_TIMEOUT = 2.0


def _is_steplock_key(key: Any) -> bool:
    # steplock_redis_url, or a namespaced form: CELERY_STEPLOCK_REDIS_URL.
    if not isinstance(key, str):
        return False
    lower = key.lower()
    return lower.startswith("steplock_") or "_steplock_" in lower


def masked_setting(value: Any) -> Any:
    """A ``steplock_*`` setting's value as Celery's outputs may show it.

    Args:
        value: The value (after Celery's own masking).

    Returns:
        Strings, dicts, lists and tuples through
        :func:`~celery_steplock.redact.redact_options` (URL credentials, password and secret
        keys masked); another object as its masked ``repr`` when that ``repr`` holds a
        secret (a client factory's ``functools.partial`` quoting a URL), else as it is.
    """
    try:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, (str, Mapping, list, tuple)):
            return redact_options(value)
        text = repr(value)
        shown = redact(text)
        return value if shown == text else shown
    except Exception:  # noqa: BLE001 - fail closed: a value we cannot judge is not shown
        return "********"


def mask_steplock_settings() -> bool:
    """Make Celery's settings table (``inspect conf``, ``celery report``) mask the
    ``steplock_*`` settings; idempotent.

    Wraps ``celery.app.utils.filter_hidden_settings`` (what ``Settings.table(censored=True)``
    calls) unless it is wrapped already; the original stays its ``__wrapped__``.

    Returns:
        True when the wrapper is in place (now or before), False when this Celery has no
        such function.
    """
    import celery.app.utils as utils

    original: Callable[[Any], dict[Any, Any]] | None = getattr(
        utils, "filter_hidden_settings", None
    )
    if original is None:
        return False
    if getattr(original, "__steplock_masks__", False):
        return True

    @functools.wraps(original)
    def filter_hidden_settings(conf: Any) -> dict[Any, Any]:
        filtered = original(conf)
        return {
            key: masked_setting(value) if _is_steplock_key(key) else value
            for key, value in filtered.items()
        }

    filter_hidden_settings.__steplock_masks__ = True  # type: ignore[attr-defined]
    utils.filter_hidden_settings = filter_hidden_settings
    return True


def ping_lock_store(app: Any) -> bool | None:
    """PING the lock store once; log a WARNING naming the setting when it does not answer.

    Args:
        app: The Celery app.

    Returns:
        True when it answered, False when it did not (the WARNING was logged), None when the
        settings are invalid (the configuration check reports them) or the client factory
        fails.
    """
    import redis

    try:
        settings = Settings(app)
        if settings.redis_client_factory:
            setting, where = "steplock_redis_client_factory", "the client factory's server"
        else:
            url = settings.redis_url
            explicit = settings.raw("redis_url") is not None
            setting = "steplock_redis_url" if explicit else "broker_url"
            where = url
        client = client_for_settings(
            settings, socket_timeout=min(settings.socket_timeout, PING_TIMEOUT)
        )
    except ImproperlyConfigured:
        return None
    except Exception:  # noqa: BLE001 - a failing factory is the task's error to raise
        return None
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        secrets = secrets_of(app)
        refused = isinstance(exc, (redis.AuthenticationError, redis.ResponseError))
        log_event(
            "lock_store_unreachable",
            logging.WARNING,
            setting=setting,
            url=redact(where, secrets),
            error=redact(f"{type(exc).__name__}: {exc}", secrets),
            reason=(
                "the lock store refused us: StepLockedTasks fail with LockStoreMisconfigured "
                f"until {setting} is fixed"
                if refused
                else "StepLockedTasks (on_store_error='fail_closed') are retried until it "
                "answers; 'fail_open' ones run without their lease"
            ),
        )
        return False
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a client that never connected
            pass
    return True


mask_steplock_settings()
