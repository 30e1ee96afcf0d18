"""Django system checks of celery-steplock, with stable ids (``manage.py check``).

==========================  ==============================================================
``celery_steplock.E001``    the Redis lock store does not answer PING. A *deployment*
                            check (``manage.py check --deploy``; ``--deploy --tag
                            celery_steplock`` runs this app's checks only), so ordinary
                            commands never touch the network.
``celery_steplock.E002``    a registered StepLockedTask's ``step_model`` does not exist or
                            has no field named by ``steplock_status_field``.
``celery_steplock.E003``    a ``steplock_*`` setting is invalid (one error per setting).
``celery_steplock.W001``    a lease TTL (``steplock_default_ttl`` or a task's ``lock_ttl``)
                            is not below the broker's ``visibility_timeout`` (Redis
                            transport default: 3600 s).
``celery_steplock.W002``    StepLockedTasks without ``acks_late`` + ``reject_on_worker_lost``:
                            a killed worker's message is acknowledged and never redelivered.
``celery_steplock.W003``    the Celery app's task modules could not be imported, so E002,
                            W001, W002 and W004 only judged the tasks registered anyway.
``celery_steplock.W004``    a StepLockedTask's ``soft_time_limit`` is not below its
                            ``time_limit``, or its ``time_limit`` (or the lease retries'
                            ``steplock_retry_backoff_max``) is not below the broker's
                            ``visibility_timeout``.
==========================  ==============================================================

The checks read the project's Celery app (``celery.current_app``), after importing its task
modules once per process (:func:`~.leases.import_task_modules`): ``app.autodiscover_tasks()``
is lazy, and a ``manage.py`` process would otherwise see no task of a ``tasks.py`` module.
Every check function is also usable on its own: ``check_lock_store(app)`` etc. take a Celery
app and return a list of :class:`django.core.checks.CheckMessage`; they inspect the tasks
``app`` has registered, without importing anything (``check_task_modules(app)`` imports).
"""
from __future__ import annotations

from typing import Any

from django.apps import apps
from django.core import checks
from django.core.exceptions import FieldDoesNotExist

from ...conf import DEFAULTS, Settings, setting_name
from ...exceptions import ImproperlyConfigured

__all__ = ["TAG", "REDIS_VISIBILITY_TIMEOUT", "register_checks", "check_lock_store",
           "check_step_models", "check_settings", "check_visibility_timeout",
           "check_worker_lost", "check_time_limits", "check_task_modules"]

TAG = "celery_steplock"
#: kombu's Redis transport default ``visibility_timeout``, seconds.
REDIS_VISIBILITY_TIMEOUT = 3600
#: PING timeout of E001, seconds (at most; lower when ``steplock_socket_timeout`` is).
PING_TIMEOUT = 2.0

_REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://", "sentinel://")


def _app():
    from .leases import celery_app

    return celery_app()


def _app_with_tasks():
    """The project's Celery app, its task modules imported (once per process; an import
    error is W003's to report)."""
    from .leases import import_task_modules

    app = _app()
    import_task_modules(app)
    return app


def _django_name(name: str) -> str:
    """``"steplock_default_ttl"`` -> ``"CELERY_STEPLOCK_DEFAULT_TTL"``."""
    return f"CELERY_{name.upper()}"


def _steplock_tasks(app) -> list:
    """The StepLockedTask instances registered on the app (finalizes the app, which
    registers the tasks of the modules imported so far; it imports none)."""
    from ...task import StepLockedTask

    try:
        tasks = app.tasks
    except RuntimeError:  # autofinalize=False and not finalized yet: nothing to inspect
        return []
    return [task for name, task in sorted(tasks.items()) if isinstance(task, StepLockedTask)]


def _broker_urls(app) -> list[str]:
    url = app.conf.broker_url or ""
    if isinstance(url, (list, tuple)):
        return [u for u in url if isinstance(u, str)]
    return [u.strip() for u in url.split(";")] if isinstance(url, str) else []


# -- checks on a Celery app ----------------------------------------------------------------

def check_settings(app) -> list[checks.CheckMessage]:
    """E003: one Error per invalid ``steplock_*`` setting (as ``Settings.validate`` would
    raise, but naming every invalid setting, not only the first)."""
    settings = Settings(app)
    errors = []
    for name in DEFAULTS:
        try:
            getattr(settings, name)
        except ImproperlyConfigured as exc:
            setting = exc.setting or setting_name(name)
            errors.append(checks.Error(
                f"Invalid celery-steplock setting {setting}: {exc}",
                hint=f"Fix {_django_name(setting)} in the Django settings (app.conf."
                     f"{setting} on the Celery app).",
                obj=setting, id="celery_steplock.E003"))
    return errors


def _visibility_timeout(app) -> float | None:
    """The broker's ``visibility_timeout`` in seconds (kombu's Redis default when unset on a
    Redis broker); None when the transport has none we know or the value is not a number."""
    options = app.conf.broker_transport_options or {}
    timeout = options.get("visibility_timeout")
    if timeout is None:
        if not any(u.startswith(_REDIS_SCHEMES) for u in _broker_urls(app)):
            return None
        timeout = REDIS_VISIBILITY_TIMEOUT
    try:
        return float(timeout)
    except (TypeError, ValueError):
        return None


def check_visibility_timeout(app) -> list[checks.CheckMessage]:
    """W001: lease TTLs that are not below the broker's ``visibility_timeout``.

    Only the TTL frees the lease of a killed worker, while the broker redelivers that
    worker's unacknowledged message after ``visibility_timeout``: with a TTL that is not
    shorter, the redelivered task still meets the dead owner's lease.
    """
    try:
        default_ttl = Settings(app).default_ttl
    except ImproperlyConfigured:
        return []  # E003 reports it
    timeout = _visibility_timeout(app)
    if timeout is None:
        return []
    offenders = []
    if default_ttl >= timeout:
        offenders.append(f"steplock_default_ttl={default_ttl:g}")
    for task in _steplock_tasks(app):
        ttl = getattr(task, "lock_ttl", None)
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl >= timeout:
            offenders.append(f"{task.name} lock_ttl={ttl:g}")
    if not offenders:
        return []
    return [checks.Warning(
        f"Lease TTL not below the broker visibility_timeout ({timeout:g} s): "
        f"{', '.join(offenders)}. A killed worker's message is redelivered after "
        f"visibility_timeout, and its lease only expires after the TTL, so the redelivered "
        f"task is refused until then.",
        hint="Lower CELERY_STEPLOCK_DEFAULT_TTL / lock_ttl (the heartbeat renews a running "
             "task's lease every TTL/3, so long tasks do not need a long TTL), or raise "
             "CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above your longest task "
             "and countdown.",
        obj="steplock_default_ttl", id="celery_steplock.W001")]


def check_worker_lost(app) -> list[checks.CheckMessage]:
    """W002: StepLockedTasks whose message is acknowledged although their worker died.

    Without ``acks_late`` the message is acknowledged before the body runs; with
    ``acks_late`` but without ``reject_on_worker_lost`` (or Celery 5.6+'s
    ``retry_on_worker_lost``) Celery still acknowledges it when the worker process is
    killed. Either way the step is never retried: only the reaper can recover it.
    """
    tasks = _steplock_tasks(app)
    conf = app.conf
    if tasks:
        subjects = [(task.name, bool(task.acks_late),
                     bool(task.reject_on_worker_lost)
                     or bool(getattr(task, "retry_on_worker_lost", None))) for task in tasks]
    else:
        subjects = [("task defaults", bool(conf.task_acks_late),
                     bool(conf.task_reject_on_worker_lost)
                     or bool(conf.get("task_retry_on_worker_lost")))]
    not_late = [name for name, late, _ in subjects if not late]
    not_rejected = [name for name, late, rejects in subjects if late and not rejects]
    warnings = []
    if not_late:
        warnings.append(checks.Warning(
            f"StepLockedTasks acknowledged before they run (acks_late is off): "
            f"{', '.join(not_late)}. A worker killed mid-task loses the message: the lease "
            f"expires but the step is never retried.",
            hint="Set CELERY_TASK_ACKS_LATE = True and CELERY_TASK_REJECT_ON_WORKER_LOST = "
                 "True (or acks_late=True, reject_on_worker_lost=True on the tasks); the "
                 "lease and the compare-and-swap make the redelivery safe.",
            obj="task_acks_late", id="celery_steplock.W002"))
    if not_rejected:
        warnings.append(checks.Warning(
            f"StepLockedTasks with acks_late but without reject_on_worker_lost: "
            f"{', '.join(not_rejected)}. Celery acknowledges the message when the worker "
            f"process is killed (WorkerLostError), so the step is never retried.",
            hint="Set CELERY_TASK_REJECT_ON_WORKER_LOST = True (or reject_on_worker_lost="
                 "True on the tasks).",
            obj="task_reject_on_worker_lost", id="celery_steplock.W002"))
    return warnings


def check_step_models(app, app_configs=None) -> list[checks.CheckMessage]:
    """E002: StepLockedTasks whose ``step_model`` is missing or lacks the status field.

    With ``app_configs`` (``manage.py check <app_label>``), only models of those apps are
    checked, and missing models are not reported.
    """
    try:
        status_field = Settings(app).status_field
    except ImproperlyConfigured:
        return []  # E003 reports it
    errors = []
    for task in _steplock_tasks(app):
        spec: Any = task.step_model
        if spec is None:
            continue
        model = spec
        if isinstance(spec, str):
            try:
                model = apps.get_model(spec)
            except (LookupError, ValueError) as exc:
                if app_configs is None:
                    errors.append(checks.Error(
                        f"{task.name}: step_model {spec!r} does not exist ({exc}).",
                        hint="Name an installed model as \"app_label.ModelName\".",
                        obj=task.name, id="celery_steplock.E002"))
                continue
        meta = getattr(model, "_meta", None)
        if meta is None:
            errors.append(checks.Error(
                f"{task.name}: step_model {spec!r} is not a Django model.",
                obj=task.name, id="celery_steplock.E002"))
            continue
        if app_configs is not None and meta.app_config not in app_configs:
            continue
        try:
            meta.get_field(status_field)
        except FieldDoesNotExist:
            errors.append(checks.Error(
                f"{task.name}: step_model {meta.label} has no field {status_field!r} "
                f"(steplock_status_field).",
                hint=f"Add the status field to {meta.label}, or set "
                     f"CELERY_STEPLOCK_STATUS_FIELD to the name of its status field.",
                obj=model, id="celery_steplock.E002"))
    return errors


def check_task_modules(app) -> list[checks.CheckMessage]:
    """W003: import the app's task modules (once per process, as the other checks need
    them) and warn when that failed."""
    from .leases import import_task_modules

    error = import_task_modules(app)
    if error is None:
        return []
    return [checks.Warning(
        f"The task modules of the Celery app {app.main!r} could not be imported: "
        f"{type(error).__name__}: {error}. The StepLockedTask checks (E002, W001, W002) "
        f"only judged the tasks registered anyway, and a worker of this project would fail "
        f"to start.",
        hint="Fix the import error (its traceback is logged by the celery_steplock "
             "logger).",
        obj=app.main, id="celery_steplock.W003")]


def check_lock_store(app) -> list[checks.CheckMessage]:
    """E001: PING the Redis lock store (one connection, at most ``PING_TIMEOUT`` seconds)."""
    import redis
    from kombu.utils.url import maybe_sanitize_url

    try:
        settings = Settings(app)
        url = settings.redis_url
        timeout = min(settings.socket_timeout, PING_TIMEOUT)
    except ImproperlyConfigured:
        return []  # E003 reports it
    client = redis.Redis.from_url(url, socket_timeout=timeout,
                                  socket_connect_timeout=timeout)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return [checks.Error(
            f"The Redis lock store {maybe_sanitize_url(url)} is unreachable: {exc}",
            hint="Start Redis or fix CELERY_STEPLOCK_REDIS_URL (default: the broker URL). "
                 "StepLockedTasks fail closed while it is down: their bodies do not run.",
            obj="steplock_redis_url", id="celery_steplock.E001")]
    finally:
        client.close()
    return []


def check_time_limits(app) -> list[checks.CheckMessage]:
    """W004: time limits that do not pair with the lease.

    ``soft_time_limit`` must be below ``time_limit``: the soft limit raises
    SoftTimeLimitExceeded in the body, so its transaction rolls back and the lease is released
    at once; at the hard limit the pool kills the process and the lease waits for its TTL. A
    ``time_limit`` not below the broker's ``visibility_timeout`` lets the broker hand the
    message of a still-running task to another worker (tests/faults: countdown-past-visibility).
    """
    conf = app.conf
    tasks = _steplock_tasks(app)
    subjects = [(t.name, t.soft_time_limit, t.time_limit) for t in tasks] or [
        ("task defaults", conf.task_soft_time_limit, conf.task_time_limit)]
    visibility = _visibility_timeout(app)
    inverted, too_long = [], []
    try:
        backoff_max = Settings(app).retry_backoff_max
    except ImproperlyConfigured:
        backoff_max = None  # E003 reports it
    if backoff_max is not None and visibility is not None and backoff_max >= visibility:
        too_long.append(f"lease retries (steplock_retry_backoff_max {backoff_max:g} s)")
    for name, soft, hard in subjects:
        soft = conf.task_soft_time_limit if soft is None else soft
        hard = conf.task_time_limit if hard is None else hard
        if soft is not None and hard is not None and soft >= hard:
            inverted.append(f"{name} (soft {soft:g} s, hard {hard:g} s)")
        if hard is not None and visibility is not None and hard >= visibility:
            too_long.append(f"{name} (time_limit {hard:g} s)")
    warnings = []
    if inverted:
        warnings.append(checks.Warning(
            f"StepLockedTasks whose soft_time_limit is not below time_limit: "
            f"{', '.join(inverted)}. The pool kills them at the hard limit without the soft "
            f"limit's SoftTimeLimitExceeded, so their leases wait for the TTL to expire.",
            hint="Set CELERY_TASK_SOFT_TIME_LIMIT (or soft_time_limit=) a few seconds below "
                 "CELERY_TASK_TIME_LIMIT (time_limit=).",
            obj="task_soft_time_limit", id="celery_steplock.W004"))
    if too_long:
        warnings.append(checks.Warning(
            f"Time limits or countdowns not below the broker visibility_timeout "
            f"({visibility:g} s): {', '.join(too_long)}. The broker hands out the message of "
            f"a task still running or still waiting for its countdown again, and the "
            f"duplicate waits on the lease.",
            hint="Raise CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above your "
                 "longest time_limit and countdown, or lower them "
                 "(CELERY_STEPLOCK_RETRY_BACKOFF_MAX caps the lease retries' countdowns).",
            obj="task_time_limit", id="celery_steplock.W004"))
    return warnings


# -- registered check functions (Django calls them with app_configs and databases) --------

def settings_check(app_configs=None, **kwargs):
    return check_settings(_app())


def task_modules_check(app_configs=None, **kwargs):
    return check_task_modules(_app())


def visibility_timeout_check(app_configs=None, **kwargs):
    return check_visibility_timeout(_app_with_tasks())


def worker_lost_check(app_configs=None, **kwargs):
    return check_worker_lost(_app_with_tasks())


def time_limits_check(app_configs=None, **kwargs):
    return check_time_limits(_app_with_tasks())


def step_model_check(app_configs=None, **kwargs):
    return check_step_models(_app_with_tasks(), app_configs)


def lock_store_check(app_configs=None, **kwargs):
    return check_lock_store(_app())


def register_checks() -> None:
    """Register the checks (idempotent: Django's registry is a set of functions)."""
    checks.register(settings_check, TAG)
    checks.register(task_modules_check, TAG)
    checks.register(visibility_timeout_check, TAG)
    checks.register(worker_lost_check, TAG)
    checks.register(time_limits_check, TAG)
    checks.register(step_model_check, TAG)
    # The network check only with --deploy: `manage.py migrate` must not wait on Redis.
    checks.register(lock_store_check, TAG, deploy=True)
