"""One validator of a Celery app's steplock configuration: every problem, once.

:func:`problems` returns a list of :class:`Problem` (errors and warnings, each with a stable
id). Two renderers use it: worker start (:func:`refuse_to_start`: errors stop the worker,
warnings are logged) and Django's system checks (``manage.py check``,
:mod:`celery_steplock.contrib.django.checks`), so the two can never disagree.

==========================  ==============================================================
``celery_steplock.E002``    a StepLockedTask's ``step_model`` does not exist or has no field
                            named by ``steplock_status_field``.
``celery_steplock.E003``    a ``steplock_*`` setting is invalid (one error per setting).
``celery_steplock.E004``    a StepLockedTask option is invalid (one error per option).
``celery_steplock.W001``    a lease TTL is not below the broker's ``visibility_timeout``.
``celery_steplock.W002``    StepLockedTasks without ``acks_late`` + ``reject_on_worker_lost``.
``celery_steplock.W004``    ``soft_time_limit`` not below ``time_limit``, or a time limit or
                            the lease retries' backoff cap not below ``visibility_timeout``.
``celery_steplock.W005``    a ``steplock_*`` setting or a ``lock_*`` task option that does not
                            exist (a typo is otherwise silently ignored).
==========================  ==============================================================

(E001, the lock store's PING, and W003, task modules that fail to import, are Django checks
only: the first needs the network, the second is what a worker start fails on anyway.)
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Iterable

from celery.utils.imports import symbol_by_name

from .conf import Settings
from .exceptions import ImproperlyConfigured
from .plan import is_step_locked, option_problems
from .redact import redact, secrets_of
from .steps import DEFAULT_STEP_STORE, check_known_database, load_step_store, \
    step_store_factory

__all__ = ["Problem", "problems", "refuse_to_start", "steplock_tasks", "settings_problems",
           "task_problems", "step_model_problems", "step_store_problems", "step_database_problems",
           "visibility_timeout_problems",
           "worker_lost_problems", "time_limit_problems", "unknown_name_problems", "visibility_timeout",
           "REDIS_VISIBILITY_TIMEOUT"]

logger = logging.getLogger("celery_steplock")

#: kombu's Redis transport default ``visibility_timeout``, seconds.
REDIS_VISIBILITY_TIMEOUT = 3600

_REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://", "sentinel://")


@dataclass(frozen=True)
class Problem:
    """One problem: ``id`` (``"celery_steplock.E003"``), ``message``, ``hint`` (or None),
    ``obj`` (the setting name, task name or model the problem is about). The message and
    hint are masked (:func:`celery_steplock.redact.redact`): no URL password or secret
    option value is ever shown."""

    id: str
    message: str
    hint: str | None = None
    obj: Any = None

    def __post_init__(self):
        object.__setattr__(self, "message", redact(self.message))
        if self.hint is not None:
            object.__setattr__(self, "hint", redact(self.hint))

    @property
    def is_error(self) -> bool:
        return ".E" in self.id


def _django_name(name: str) -> str:
    """``"steplock_default_ttl"`` -> ``"CELERY_STEPLOCK_DEFAULT_TTL"``."""
    return f"CELERY_{name.upper()}"


def steplock_tasks(app) -> list:
    """The StepLockedTask instances registered on the app, by name (finalizes the app,
    which registers the tasks of the modules imported so far; it imports none)."""
    try:
        tasks = app.tasks
    except RuntimeError:  # autofinalize=False and not finalized yet: nothing to inspect
        return []
    return [task for name, task in sorted(tasks.items()) if is_step_locked(task)]


def _masked(app, found: list[Problem]) -> list[Problem]:
    """``found`` with every secret value of ``app``'s settings masked, wherever a message
    quotes it (beside the URL and key/value forms every Problem masks)."""
    secrets = secrets_of(app)
    if not secrets:
        return found
    return [dataclasses.replace(p, message=redact(p.message, secrets),
                                hint=None if p.hint is None else redact(p.hint, secrets))
            for p in found]


def settings_problems(app) -> list[Problem]:
    """E003: one per invalid ``steplock_*`` setting."""
    found = []
    for exc in Settings(app).problems():
        setting = exc.setting or "steplock_?"
        found.append(Problem(
            "celery_steplock.E003", f"Invalid celery-steplock setting {setting}: {exc}",
            hint=f"Fix {_django_name(setting)} in the Django settings (app.conf.{setting} "
                 f"on the Celery app).", obj=setting))
    return _masked(app, found)


def task_problems(app, tasks: Iterable | None = None) -> list[Problem]:
    """E004: one per invalid option of each StepLockedTask (step models aside: E002)."""
    found = []
    for task in steplock_tasks(app) if tasks is None else tasks:
        for exc in option_problems(task, models_ready=False):
            found.append(Problem("celery_steplock.E004", str(exc),
                                 hint=f"Fix the option {exc.setting} of the task "
                                      f"(@app.task({exc.setting}=...)) or its setting.",
                                 obj=task.name))
    return found


def step_model_problems(app) -> list[Problem]:
    """E002: StepLockedTasks whose ``step_model`` the step store refuses (a missing model,
    no status field), judged by building each task's step store. Nothing is judged while the
    step store's models are not loaded yet (its factory's ``models_ready()`` says False)."""
    try:
        settings = Settings(app)
        spec = settings.step_store
        factory = symbol_by_name(spec) if isinstance(spec, str) else spec
        fields = dict(status_field=settings.status_field, owner_field=settings.owner_field,
                      fence_field=settings.fence_field)
    except (ImproperlyConfigured, ImportError, AttributeError, ValueError):
        return []  # E003 reports it
    ready = getattr(factory, "models_ready", None)
    if ready is not None and not ready():
        return []
    found = []
    for task in steplock_tasks(app):
        if task.step_model is None:
            continue
        try:
            load_step_store(factory, task.step_model, transitions=task.step_transitions,
                            **fields)
        except ImproperlyConfigured as exc:
            if exc.setting == "step_transitions":
                continue  # an option: task_problems reports it (E004)
            hint = (f"Add the status field to the model, or set "
                    f"{_django_name('steplock_status_field')} to the name of its status field."
                    if exc.setting == "steplock_status_field"
                    else "Name an installed model as \"app_label.ModelName\".")
            found.append(Problem("celery_steplock.E002", f"{task.name}: {exc}", hint=hint,
                                 obj=task.name))
        except Exception as exc:  # noqa: BLE001 - a store that fails otherwise is reported
            found.append(Problem(
                "celery_steplock.E002",
                f"{task.name}: the step store refused step_model {task.step_model!r}: "
                f"{type(exc).__name__}: {exc}", obj=task.name))
    return found


def step_store_problems(app) -> list[Problem]:
    """E003: a ``steplock_step_store`` that cannot be imported (the default one only when a
    task has a step model: it needs Django)."""
    try:
        spec = Settings(app).step_store
    except ImproperlyConfigured:
        return []  # settings_problems reports it
    if spec == DEFAULT_STEP_STORE and not any(task.step_model is not None
                                              for task in steplock_tasks(app)):
        return []  # the default needs Django only for tasks with a step model
    if not isinstance(spec, str):
        return []
    try:
        symbol_by_name(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        return [Problem("celery_steplock.E003",
                        f"Invalid celery-steplock setting steplock_step_store: {spec!r} cannot "
                        f"be imported: {exc}",
                        hint="Name a step-store factory as \"package.module:Name\" "
                             "(CELERY_STEPLOCK_STEP_STORE).", obj="steplock_step_store")]
    return []


def step_database_problems(app) -> list[Problem]:
    """E003: a ``steplock_step_database`` the step store does not know (judged when a task
    has a step model, through the factory's ``databases()``)."""
    try:
        settings = Settings(app)
        using = settings.step_database
        factory = step_store_factory(settings.step_store)
    except ImproperlyConfigured:
        return []  # settings_problems / step_store_problems report it
    if using is None or not any(task.step_model is not None for task in steplock_tasks(app)):
        return []
    try:
        check_known_database(factory, using, "steplock_step_database")
    except ImproperlyConfigured as exc:
        return [Problem("celery_steplock.E003",
                        f"Invalid celery-steplock setting steplock_step_database: {exc}",
                        hint="Name a key of DATABASES (CELERY_STEPLOCK_STEP_DATABASE), or "
                             "None for the step model's write database (the router's).",
                        obj="steplock_step_database")]
    return []


def _broker_urls(app) -> list[str]:
    url = app.conf.broker_url or ""
    if isinstance(url, (list, tuple)):
        return [u for u in url if isinstance(u, str)]
    return [u.strip() for u in url.split(";")] if isinstance(url, str) else []


def visibility_timeout(app) -> float | None:
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


def visibility_timeout_problems(app) -> list[Problem]:
    """W001: lease TTLs that are not below the broker's ``visibility_timeout``.

    Only the TTL frees the lease of a killed worker, while the broker redelivers that
    worker's unacknowledged message after ``visibility_timeout``: with a TTL that is not
    shorter, the redelivered task still meets the dead owner's lease.
    """
    try:
        default_ttl = Settings(app).default_ttl
    except ImproperlyConfigured:
        return []  # E003 reports it
    timeout = visibility_timeout(app)
    if timeout is None:
        return []
    offenders = []
    if default_ttl >= timeout:
        offenders.append(f"steplock_default_ttl={default_ttl:g}")
    for task in steplock_tasks(app):
        ttl = getattr(task, "lock_ttl", None)
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl >= timeout:
            offenders.append(f"{task.name} lock_ttl={ttl:g}")
    if not offenders:
        return []
    return [Problem(
        "celery_steplock.W001",
        f"Lease TTL not below the broker visibility_timeout ({timeout:g} s): "
        f"{', '.join(offenders)}. A killed worker's message is redelivered after "
        f"visibility_timeout, and its lease only expires after the TTL, so the redelivered "
        f"task is refused until then.",
        hint="Lower CELERY_STEPLOCK_DEFAULT_TTL / lock_ttl (the heartbeat renews a running "
             "task's lease every TTL/3, so long tasks do not need a long TTL), or raise "
             "CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above your longest task "
             "and countdown.",
        obj="steplock_default_ttl")]


def worker_lost_problems(app) -> list[Problem]:
    """W002: StepLockedTasks whose message is acknowledged although their worker died.

    Without ``acks_late`` the message is acknowledged before the body runs; with
    ``acks_late`` but without ``reject_on_worker_lost`` (or Celery 5.6+'s
    ``retry_on_worker_lost``) Celery still acknowledges it when the worker process is
    killed. Either way the step is never retried: only the reaper can recover it.
    """
    tasks = steplock_tasks(app)
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
    found = []
    if not_late:
        found.append(Problem(
            "celery_steplock.W002",
            f"StepLockedTasks acknowledged before they run (acks_late is off): "
            f"{', '.join(not_late)}. A worker killed mid-task loses the message: the lease "
            f"expires but the step is never retried.",
            hint="Set CELERY_TASK_ACKS_LATE = True and CELERY_TASK_REJECT_ON_WORKER_LOST = "
                 "True (or acks_late=True, reject_on_worker_lost=True on the tasks); the "
                 "lease and the compare-and-swap make the redelivery safe.",
            obj="task_acks_late"))
    if not_rejected:
        found.append(Problem(
            "celery_steplock.W002",
            f"StepLockedTasks with acks_late but without reject_on_worker_lost: "
            f"{', '.join(not_rejected)}. Celery acknowledges the message when the worker "
            f"process is killed (WorkerLostError), so the step is never retried.",
            hint="Set CELERY_TASK_REJECT_ON_WORKER_LOST = True (or reject_on_worker_lost="
                 "True on the tasks).",
            obj="task_reject_on_worker_lost"))
    return found


def time_limit_problems(app) -> list[Problem]:
    """W004: time limits that do not pair with the lease.

    ``soft_time_limit`` must be below ``time_limit``: the soft limit raises
    SoftTimeLimitExceeded in the body, so its transaction rolls back and the lease is released
    at once; at the hard limit the pool kills the process and the lease waits for its TTL. A
    ``time_limit`` not below the broker's ``visibility_timeout`` lets the broker hand the
    message of a still-running task to another worker.
    """
    conf = app.conf
    tasks = steplock_tasks(app)
    subjects = [(t.name, t.soft_time_limit, t.time_limit) for t in tasks] or [
        ("task defaults", conf.task_soft_time_limit, conf.task_time_limit)]
    visibility = visibility_timeout(app)
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
    found = []
    if inverted:
        found.append(Problem(
            "celery_steplock.W004",
            f"StepLockedTasks whose soft_time_limit is not below time_limit: "
            f"{', '.join(inverted)}. The pool kills them at the hard limit without the soft "
            f"limit's SoftTimeLimitExceeded, so their leases wait for the TTL to expire.",
            hint="Set CELERY_TASK_SOFT_TIME_LIMIT (or soft_time_limit=) a few seconds below "
                 "CELERY_TASK_TIME_LIMIT (time_limit=).",
            obj="task_soft_time_limit"))
    if too_long:
        found.append(Problem(
            "celery_steplock.W004",
            f"Time limits or countdowns not below the broker visibility_timeout "
            f"({visibility:g} s): {', '.join(too_long)}. The broker hands out the message of "
            f"a task still running or still waiting for its countdown again, and the "
            f"duplicate waits on the lease.",
            hint="Raise CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above your "
                 "longest time_limit and countdown, or lower them "
                 "(CELERY_STEPLOCK_RETRY_BACKOFF_MAX caps the lease retries' countdowns).",
            obj="task_time_limit"))
    return found


def _names(app) -> list[str]:
    """The configuration keys ``app`` has, as Celery spells them (lower case)."""
    found = []
    for source in getattr(app.conf, "maps", None) or [app.conf]:
        try:
            found += [str(k).lower() for k in source.keys()]
        except Exception:  # noqa: BLE001 - a source that cannot list its keys
            continue
    return found


def unknown_name_problems(app) -> list[Problem]:
    """W005: ``steplock_*`` settings and ``lock_*`` task options that do not exist."""
    import difflib

    from .conf import DEFAULTS, setting_name
    from .plan import OPTION_NAMES

    found = []
    known = {setting_name(name) for name in DEFAULTS}
    for key in sorted(set(_names(app))):
        name = key[len("celery_"):] if key.startswith("celery_steplock_") else key
        if name.startswith("steplock_") and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            found.append(Problem(
                "celery_steplock.W005", f"Unknown celery-steplock setting {name} "
                f"({_django_name(name)}): it is ignored.",
                hint=f"Did you mean {_django_name(close[0])}?" if close else None, obj=name))
    options = OPTION_NAMES | {"lock_name"}
    for task in steplock_tasks(app):
        for attr in sorted(vars(type(task))):
            if attr.startswith("lock_") and attr not in options and not callable(
                    getattr(type(task), attr)):
                close = difflib.get_close_matches(attr, sorted(OPTION_NAMES), n=1)
                found.append(Problem(
                    "celery_steplock.W005", f"{task.name}: unknown task option {attr}: it is "
                    f"ignored.", hint=f"Did you mean {close[0]}?" if close else None,
                    obj=task.name))
    return found


def problems(app) -> list[Problem]:
    """Every problem of ``app``'s steplock configuration: settings (E003), task options
    (E004), step models (E002, once the step store's models are loaded), then the warnings
    W001, W002, W004 and W005. Reads the tasks ``app`` has registered; imports no task
    module."""
    return (settings_problems(app) + step_store_problems(app) + step_database_problems(app)
            + task_problems(app)
            + step_model_problems(app) + visibility_timeout_problems(app)
            + worker_lost_problems(app) + time_limit_problems(app)
            + unknown_name_problems(app))


def refuse_to_start(app) -> None:
    """Worker start: log each warning, and raise SystemExit listing the errors, if any (a
    worker that starts anyway would consume acks_late messages only to fail them)."""
    errors = []
    try:
        found = _masked(app, problems(app))
    except Exception as exc:  # noqa: BLE001 - never start unvalidated (fail closed)
        # Its text may quote a setting's value: masked, and not chained to the exit.
        error = redact(f"{type(exc).__name__}: {exc}", secrets_of(app))
        logger.critical("event=improperly_configured validation failed: %s", error)
        raise SystemExit(f"celery-steplock: the configuration could not be validated: "
                         f"{error}") from None
    for problem in found:
        if problem.is_error:
            logger.critical("event=improperly_configured id=%s %s", problem.id,
                            problem.message)
            errors.append(problem.message)
        else:
            logger.warning("event=configuration_warning id=%s %s", problem.id,
                           problem.message)
    if errors:
        raise SystemExit("celery-steplock: " + "; ".join(errors))

