"""One validator of a Celery app's steplock configuration: every problem, once.

:func:`problems` returns a list of :class:`Problem` (errors and warnings, each with a stable
id). Two renderers use it: worker start (:func:`refuse_to_start`: errors stop the worker,
warnings are logged) and Django's system checks (``manage.py check``,
:mod:`celery_steplock.contrib.django.checks`), so the two can never disagree.

==========================  ==============================================================
``celery_steplock.E002``    a StepLockedTask's ``step_model`` does not exist or has no field
                            named by ``steplock_status_field``.
``celery_steplock.E003``    a ``steplock_*`` setting is invalid (one error per setting).
``celery_steplock.E004``    a StepLockedTask option is invalid (one error per option, every
                            option judged): a value out of range or of the wrong type, a
                            ``lock_key`` placeholder or a ``step_id_arg`` that is no argument
                            of the task, a callable ``lock_key`` that cannot take the task's
                            arguments, a ``transition`` its ``step_transitions`` forbid,
                            an ``overlap`` contradicted by the task's ``on_contended`` or
                            ``lock_wait`` (named ``overlap``).
``celery_steplock.E005``    a model of ``steplock_reaper_recover`` the reaper cannot recover:
                            missing, without the status or owner column (or ``updated_at``
                            with ``steplock_reaper_older_than`` > 0), or a status that is not
                            one of its status field's choices.
``celery_steplock.W001``    a lease TTL is not below the broker's ``visibility_timeout``.
``celery_steplock.W002``    StepLockedTasks without ``acks_late`` + ``reject_on_worker_lost``.
``celery_steplock.W004``    ``soft_time_limit`` not below ``time_limit``, or a time limit or
                            the lease retries' backoff cap not below ``visibility_timeout``;
                            on an AMQP broker, a time limit, the backoff cap, a ``max_hold``
                            or a ``lock_wait`` not below its ``consumer_timeout``
                            (``steplock_broker_consumer_timeout``).
``celery_steplock.W005``    a setting or task option that does not exist, with the closest
                            real name: a misspelled ``CELERY_STEPLOCK_*`` / ``steplock_*``
                            key, a ``STEPLOCK_*`` Django setting the app never reads (no
                            ``CELERY_`` namespace, or a configuration not loaded from the
                            Django settings), an unknown ``@app.task`` keyword or task class
                            attribute (``lock_tll=5``); each is otherwise silently ignored.
``celery_steplock.W006``    a setting set under its former name (``steplock_bulkhead_*``,
                            now ``steplock_concurrency_limit_*``): still read for one
                            release while the new name is unset, ignored beside it.
``celery_steplock.W012``    StepLockedTasks with ``on_conflict="return_winner"`` while
                            Celery's ``result_extended`` is off: a duplicate never gets the
                            winner's result (a stored state that names no task could be
                            another task's).
``celery_steplock.W010``    no name secret: default lock names use a public HMAC key.
``celery_steplock.W011``    the name secret derives from an insecure Django ``SECRET_KEY``
                            while ``DEBUG`` is off.
==========================  ==============================================================

Worker start and ``manage.py check`` report every problem at once: each ``*_problems``
function collects, none stops at the first.

(E001, the lock store's PING, and W003, task modules that fail to import, are Django checks
only: the first needs the network, the second is what a worker start fails on anyway.)
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Any, Iterable

from celery.utils.imports import symbol_by_name

from . import _django
from .conf import Settings
from .events import log_event
from .exceptions import ImproperlyConfigured
from .plan import is_step_locked, option_problems
from .redact import redact, secrets_of
from .steps import DEFAULT_STEP_STORE, check_known_database, load_step_store, step_store_factory

__all__ = [
    "Problem",
    "problems",
    "refuse_to_start",
    "steplock_tasks",
    "settings_problems",
    "task_problems",
    "step_model_problems",
    "step_store_problems",
    "step_database_problems",
    "visibility_timeout_problems",
    "worker_lost_problems",
    "time_limit_problems",
    "unknown_name_problems",
    "deprecated_name_problems",
    "visibility_timeout",
    "consumer_timeout",
    "recovery_problems",
    "django_setting_problems",
    "name_secret_problems",
    "REDIS_VISIBILITY_TIMEOUT",
]

logger = logging.getLogger("celery_steplock")

#: kombu's Redis transport default ``visibility_timeout``, seconds.
REDIS_VISIBILITY_TIMEOUT = 3600

_REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://", "sentinel://")
_AMQP_SCHEMES = ("amqp://", "amqps://", "pyamqp://", "librabbitmq://")


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", redact(self.message))
        if self.hint is not None:
            object.__setattr__(self, "hint", redact(self.hint))

    @property
    def is_error(self) -> bool:
        return ".E" in self.id


def _django_name(name: str) -> str:
    """``"steplock_default_ttl"`` -> ``"CELERY_STEPLOCK_DEFAULT_TTL"``."""
    return f"CELERY_{name.upper()}"


def steplock_tasks(app: Any) -> list[Any]:
    """The StepLockedTask instances registered on the app, by name (finalizes the app,
    which registers the tasks of the modules imported so far; it imports none)."""
    try:
        tasks = app.tasks
    except RuntimeError:  # autofinalize=False and not finalized yet: nothing to inspect
        return []
    return [task for name, task in sorted(tasks.items()) if is_step_locked(task)]


def _masked(app: Any, found: list[Problem]) -> list[Problem]:
    """``found`` with every secret value of ``app``'s settings masked, wherever a message
    quotes it (beside the URL and key/value forms every Problem masks)."""
    secrets = secrets_of(app)
    if not secrets:
        return found
    return [
        dataclasses.replace(
            p,
            message=redact(p.message, secrets),
            hint=None if p.hint is None else redact(p.hint, secrets),
        )
        for p in found
    ]


def settings_problems(app: Any) -> list[Problem]:
    """E003: one per invalid ``steplock_*`` setting."""
    found = []
    for exc in Settings(app).problems():
        setting = exc.setting or "steplock_?"
        found.append(
            Problem(
                "celery_steplock.E003",
                f"Invalid celery-steplock setting {setting}: {exc}",
                hint=f"Fix {_django_name(setting)} in the Django settings (app.conf.{setting} "
                f"on the Celery app).",
                obj=setting,
            )
        )
    return _masked(app, found)


def task_problems(app: Any, tasks: Iterable[Any] | None = None) -> list[Problem]:
    """E004: one per invalid option of each StepLockedTask (step models aside: E002)."""
    found = []
    for task in steplock_tasks(app) if tasks is None else tasks:
        for exc in option_problems(task, models_ready=False):
            found.append(
                Problem(
                    "celery_steplock.E004",
                    str(exc),
                    hint=f"Fix the option {exc.setting} of the task "
                    f"(@app.task({exc.setting}=...)) or its setting.",
                    obj=task.name,
                )
            )
        found += _callable_lock_key_problems(task)
    return found


def step_model_problems(app: Any) -> list[Problem]:
    """E002: StepLockedTasks whose ``step_model`` the step store refuses (a missing model,
    no status field), judged by building each task's step store. Nothing is judged while the
    step store's models are not loaded yet (its factory's ``models_ready()`` says False)."""
    try:
        settings = Settings(app)
        spec = settings.step_store
        factory = symbol_by_name(spec) if isinstance(spec, str) else spec
        fields = dict(
            status_field=settings.status_field,
            owner_field=settings.owner_field,
            fence_field=settings.fence_field,
        )
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
            load_step_store(factory, task.step_model, transitions=task.step_transitions, **fields)
        except ImproperlyConfigured as exc:
            if exc.setting == "step_transitions":
                continue  # an option: task_problems reports it (E004)
            hint = (
                f"Add the status field to the model, or set "
                f"{_django_name('steplock_status_field')} to the name of its status field."
                if exc.setting == "steplock_status_field"
                else 'Name an installed model as "app_label.ModelName".'
            )
            found.append(
                Problem("celery_steplock.E002", f"{task.name}: {exc}", hint=hint, obj=task.name)
            )
        except Exception as exc:  # noqa: BLE001 - a store that fails otherwise is reported
            found.append(
                Problem(
                    "celery_steplock.E002",
                    f"{task.name}: the step store refused step_model {task.step_model!r}: "
                    f"{type(exc).__name__}: {exc}",
                    obj=task.name,
                )
            )
    return found


def step_store_problems(app: Any) -> list[Problem]:
    """E003: a ``steplock_step_store`` that cannot be imported (the default one only when a
    task has a step model: it needs Django)."""
    try:
        spec = Settings(app).step_store
    except ImproperlyConfigured:
        return []  # settings_problems reports it
    if spec == DEFAULT_STEP_STORE and not any(
        task.step_model is not None for task in steplock_tasks(app)
    ):
        return []  # the default needs Django only for tasks with a step model
    if not isinstance(spec, str):
        return []
    try:
        symbol_by_name(spec)
    except (ImportError, AttributeError, ValueError) as exc:
        return [
            Problem(
                "celery_steplock.E003",
                f"Invalid celery-steplock setting steplock_step_store: {spec!r} cannot "
                f"be imported: {exc}",
                hint='Name a step-store factory as "package.module:Name" '
                "(CELERY_STEPLOCK_STEP_STORE).",
                obj="steplock_step_store",
            )
        ]
    return []


def step_database_problems(app: Any) -> list[Problem]:
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
        return [
            Problem(
                "celery_steplock.E003",
                f"Invalid celery-steplock setting steplock_step_database: {exc}",
                hint="Name a key of DATABASES (CELERY_STEPLOCK_STEP_DATABASE), or "
                "None for the step model's write database (the router's).",
                obj="steplock_step_database",
            )
        ]
    return []


def _split_urls(value: Any) -> list[str]:
    """A broker URL setting (a string, ``;``-separated failover URLs, or a list) as URLs."""
    if isinstance(value, (list, tuple)):
        return [u.strip() for u in value if isinstance(u, str)]
    return [u.strip() for u in value.split(";")] if isinstance(value, str) else []


def _broker_urls(app: Any) -> list[str]:
    return _split_urls(app.conf.broker_url or "")


def _consumed_urls(app: Any) -> list[str]:
    """The URLs a worker consumes from: ``broker_read_url`` when set, else ``broker_url``;
    unset, Celery's default (``broker_transport``'s scheme, else ``amqp``)."""
    conf = app.conf
    if conf.broker_read_url:
        return _split_urls(conf.broker_read_url)
    urls = _broker_urls(app)
    if not any(urls):
        return [f"{conf.broker_transport or 'amqp'}://"]
    return urls


def visibility_timeout(app: Any) -> float | None:
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


def consumer_timeout(app: Any) -> float | None:
    """The AMQP broker's ``consumer_timeout`` in seconds, as ``steplock_broker_consumer_timeout``
    declares it (the server's value cannot be read by a client; default 1800, RabbitMQ's);
    None when the broker is not AMQP, the setting is 0 (no timeout) or invalid (E003)."""
    if not any(u.lower().startswith(_AMQP_SCHEMES) for u in _consumed_urls(app)):
        return None
    try:
        timeout = Settings(app).broker_consumer_timeout
    except ImproperlyConfigured:
        return None
    return timeout or None


def _seconds_option(task: Any, name: str) -> float | None:
    value = getattr(task, name, None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None  # unset, or E004 reports it


def consumer_timeout_offenders(app: Any, timeout: float) -> list[str]:
    """What keeps one AMQP delivery unacknowledged for ``timeout`` seconds or longer: the
    lease retries' countdown cap (a countdown message waits in the worker, unacknowledged,
    until its ETA), a ``max_hold`` or ``lock_wait`` (setting or task option) and a task's
    ``time_limit``; each as ``"name (setting value s)"``."""
    found = []
    try:
        settings = Settings(app)
        defaults = {
            "steplock_retry_backoff_max": settings.retry_backoff_max,
            "steplock_max_hold": settings.max_hold,
            "steplock_lock_wait": settings.lock_wait,
        }
    except ImproperlyConfigured:
        return []  # E003 reports it
    labels = {"steplock_retry_backoff_max": "lease retries"}
    for name, value in defaults.items():
        if value is not None and value >= timeout:
            found.append(f"{labels.get(name, 'task defaults')} ({name} {value:g} s)")
    conf = app.conf
    for task in steplock_tasks(app):
        for option in ("lock_max_hold", "lock_wait"):
            value = _seconds_option(task, option)
            if value is not None and value >= timeout:
                found.append(f"{task.name} ({option} {value:g} s)")
        hard = task.time_limit if task.time_limit is not None else conf.task_time_limit
        if isinstance(hard, (int, float)) and hard >= timeout:
            found.append(f"{task.name} (time_limit {hard:g} s)")
    if not steplock_tasks(app):
        hard = conf.task_time_limit
        if isinstance(hard, (int, float)) and hard >= timeout:
            found.append(f"task defaults (time_limit {hard:g} s)")
    return found


def visibility_timeout_problems(app: Any) -> list[Problem]:
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
    return [
        Problem(
            "celery_steplock.W001",
            f"Lease TTL not below the broker visibility_timeout ({timeout:g} s): "
            f"{', '.join(offenders)}. A killed worker's message is redelivered after "
            f"visibility_timeout, and its lease only expires after the TTL, so the redelivered "
            f"task is refused until then.",
            hint="Lower CELERY_STEPLOCK_DEFAULT_TTL / lock_ttl (the heartbeat renews a running "
            "task's lease every TTL/3, so long tasks do not need a long TTL), or raise "
            "CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above your longest task "
            "and countdown.",
            obj="steplock_default_ttl",
        )
    ]


def worker_lost_problems(app: Any) -> list[Problem]:
    """W002: StepLockedTasks whose message is acknowledged although their worker died.

    Without ``acks_late`` the message is acknowledged before the body runs; with
    ``acks_late`` but without ``reject_on_worker_lost`` (or Celery 5.6+'s
    ``retry_on_worker_lost``) Celery still acknowledges it when the worker process is
    killed. Either way the step is never retried: only the reaper can recover it.
    """
    tasks = steplock_tasks(app)
    conf = app.conf
    if tasks:
        subjects = [
            (
                task.name,
                bool(task.acks_late),
                bool(task.reject_on_worker_lost)
                or bool(getattr(task, "retry_on_worker_lost", None)),
            )
            for task in tasks
        ]
    else:
        subjects = [
            (
                "task defaults",
                bool(conf.task_acks_late),
                bool(conf.task_reject_on_worker_lost)
                or bool(conf.get("task_retry_on_worker_lost")),
            )
        ]
    not_late = [name for name, late, _ in subjects if not late]
    not_rejected = [name for name, late, rejects in subjects if late and not rejects]
    found = []
    if not_late:
        found.append(
            Problem(
                "celery_steplock.W002",
                f"StepLockedTasks acknowledged before they run (acks_late is off): "
                f"{', '.join(not_late)}. A worker killed mid-task loses the message: the lease "
                f"expires but the step is never retried.",
                hint="Set CELERY_TASK_ACKS_LATE = True and CELERY_TASK_REJECT_ON_WORKER_LOST = "
                "True (or acks_late=True, reject_on_worker_lost=True on the tasks); the "
                "lease and the compare-and-swap make the redelivery safe.",
                obj="task_acks_late",
            )
        )
    if not_rejected:
        found.append(
            Problem(
                "celery_steplock.W002",
                f"StepLockedTasks with acks_late but without reject_on_worker_lost: "
                f"{', '.join(not_rejected)}. Celery acknowledges the message when the worker "
                f"process is killed (WorkerLostError), so the step is never retried.",
                hint="Set CELERY_TASK_REJECT_ON_WORKER_LOST = True (or reject_on_worker_lost="
                "True on the tasks).",
                obj="task_reject_on_worker_lost",
            )
        )
    return found


def return_winner_problems(app: Any) -> list[Problem]:
    """W012: StepLockedTasks with ``on_conflict="return_winner"`` (the task option, or
    ``steplock_on_conflict``) while Celery's ``result_extended`` is off.

    A duplicate returns the winner's stored result only when the stored state names a task
    of its own name (:func:`celery_steplock.outcomes.winner_result`): another task that
    writes the same transition of the same step would otherwise hand over its result.
    Without ``result_extended`` the state names no task, so such a duplicate always returns
    its "duplicate" outcome dict, after up to ``STORE_WAIT`` seconds of reads.
    """
    if app.conf.get("result_extended"):
        return []
    try:
        default = Settings(app).on_conflict
    except ImproperlyConfigured:
        default = None  # E003 reports it
    names = [
        task.name
        for task in steplock_tasks(app)
        if (task.on_conflict if task.on_conflict is not None else default) == "return_winner"
    ]
    if not names:
        return []
    return [
        Problem(
            "celery_steplock.W012",
            f"StepLockedTasks with on_conflict='return_winner' while result_extended is off: "
            f"{', '.join(names)}. The stored results name no task, so a duplicate never "
            f"returns the winner's result (it could be another task's): it returns its "
            f"'duplicate' outcome dict.",
            hint="Set CELERY_RESULT_EXTENDED = True (Celery's result_extended), or use "
            "on_conflict='return'.",
            obj="result_extended",
        )
    ]


def time_limit_problems(app: Any) -> list[Problem]:
    """W004: time limits that do not pair with the lease.

    ``soft_time_limit`` must be below ``time_limit``: the soft limit raises
    SoftTimeLimitExceeded in the body, so its transaction rolls back and the lease is released
    at once; at the hard limit the pool kills the process and the lease waits for its TTL. A
    ``time_limit`` not below the broker's ``visibility_timeout`` lets the broker hand the
    message of a still-running task to another worker. On an AMQP broker the same goes for
    RabbitMQ's ``consumer_timeout`` (:func:`consumer_timeout_offenders`).
    """
    conf = app.conf
    tasks = steplock_tasks(app)
    subjects = [(t.name, t.soft_time_limit, t.time_limit) for t in tasks] or [
        ("task defaults", conf.task_soft_time_limit, conf.task_time_limit)
    ]
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
        found.append(
            Problem(
                "celery_steplock.W004",
                f"StepLockedTasks whose soft_time_limit is not below time_limit: "
                f"{', '.join(inverted)}. The pool kills them at the hard limit without the soft "
                f"limit's SoftTimeLimitExceeded, so their leases wait for the TTL to expire.",
                hint="Set CELERY_TASK_SOFT_TIME_LIMIT (or soft_time_limit=) a few seconds below "
                "CELERY_TASK_TIME_LIMIT (time_limit=).",
                obj="task_soft_time_limit",
            )
        )
    if too_long:
        found.append(
            Problem(
                "celery_steplock.W004",
                f"Time limits or countdowns not below the broker visibility_timeout "
                f"({visibility:g} s): {', '.join(too_long)}. The broker hands out the message of "
                f"a task still running or still waiting for its countdown again, and the "
                f"duplicate waits on the lease.",
                hint="Raise CELERY_BROKER_TRANSPORT_OPTIONS['visibility_timeout'] above your "
                "longest time_limit and countdown, or lower them "
                "(CELERY_STEPLOCK_RETRY_BACKOFF_MAX caps the lease retries' countdowns).",
                obj="task_time_limit",
            )
        )
    consumer = consumer_timeout(app)
    held = consumer_timeout_offenders(app, consumer) if consumer is not None else []
    if held:
        found.append(
            Problem(
                "celery_steplock.W004",
                f"Countdowns, holds or time limits not below the AMQP broker's "
                f"consumer_timeout ({consumer:g} s, steplock_broker_consumer_timeout): "
                f"{', '.join(held)}. RabbitMQ closes the channel of a delivery left "
                f"unacknowledged that long and requeues the message: another worker runs the "
                f"task while it still runs or waits for its countdown, the duplicate waits on "
                f"the lease, and the Celery worker whose channel was closed stops.",
                hint="Raise consumer_timeout in rabbitmq.conf (milliseconds; per queue with a "
                "consumer-timeout policy on RabbitMQ 3.12+) above your longest task "
                "and countdown, and set CELERY_STEPLOCK_BROKER_CONSUMER_TIMEOUT (seconds) to "
                "match; or lower them (CELERY_STEPLOCK_RETRY_BACKOFF_MAX caps the lease "
                "retries' countdowns).",
                obj="steplock_broker_consumer_timeout",
            )
        )
    return found


def _raw_keys(app: Any) -> list[str]:
    """The configuration keys ``app`` has, as each source spells them (``app.conf``'s own
    changes in lower case, a Django settings module in upper case, with its namespace)."""
    found = []
    for source in getattr(app.conf, "maps", None) or [app.conf]:
        try:
            found += [str(k) for k in source.keys()]  # noqa: SIM118 - Celery Settings, not a dict
        except Exception:  # noqa: BLE001 - a source that cannot list its keys
            continue
    return found


def _names(app: Any) -> list[str]:
    """The configuration keys ``app`` has, lower-cased."""
    return [key.lower() for key in _raw_keys(app)]


def _read_keys(app: Any, name: str) -> tuple[str, ...]:
    """The keys Celery looks ``name`` up under, the namespaced one first
    (``("CELERY_STEPLOCK_DEFAULT_TTL", "steplock_default_ttl")`` for ``namespace="CELERY"``)."""
    to_keys = getattr(app.conf, "_to_keys", None)
    try:
        return tuple(to_keys(name)) if to_keys is not None else (name,)
    except Exception:  # noqa: BLE001 - another configuration class: its plain name
        return (name,)


def _prefix(app: Any) -> str:
    prefix = getattr(app.conf, "prefix", None)
    return prefix if isinstance(prefix, str) else ""


def _spelled(app: Any, name: str) -> str:
    """How the user writes setting ``name``: the namespaced key when the app reads a
    namespace (Django's ``CELERY_STEPLOCK_...``), else both spellings."""
    if _prefix(app):
        return _read_keys(app, name)[0]
    return _django_name(name) if name.startswith("steplock_") else name


def _library_attributes(cls: type) -> set[str]:
    """The attributes the library's and Celery's task classes in ``cls``'s MRO define."""
    names: set[str] = set()
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if (
            klass is object
            or module == "celery"
            or module.startswith(("celery.", "celery_steplock."))
        ):
            names.update(vars(klass))
    return names


#: The task options ``@app.task(...)`` takes beside the plan's (``transition`` is kept as
#: ``step_transition``).
_OPTION_SPELLINGS = frozenset({"transition"})


def _unknown_option_names(task: Any) -> list[tuple[str, str | None]]:
    """``(attribute, closest option or None)`` of each attribute of the task's own classes
    (``@app.task`` keywords, a user base class) that looks like a steplock option but is
    none: a ``lock_*``/``step_*`` name, or one close to an option's name."""
    import difflib

    from .plan import option_names

    names = option_names()
    cls = type(task)
    known = names | _OPTION_SPELLINGS | {"lock_name"} | _library_attributes(cls)
    options = sorted(names | _OPTION_SPELLINGS)
    found, seen = [], set()
    for klass in cls.__mro__:
        module = getattr(klass, "__module__", "") or ""
        if (
            klass is object
            or module == "celery"
            or module.startswith(("celery.", "celery_steplock."))
        ):
            continue
        for attr, value in sorted(vars(klass).items()):
            if (
                attr in seen
                or attr in known
                or attr.startswith("_")
                or callable(value)
                or isinstance(value, (staticmethod, classmethod, property))
            ):
                continue
            seen.add(attr)
            close = difflib.get_close_matches(attr, options, n=1, cutoff=0.75)
            if close or attr.startswith(("lock_", "step_")):
                found.append((attr, close[0] if close else None))
    return found


#: Django settings the library reads itself (not through the Celery app): never "unknown".
DJANGO_SETTINGS_READ = frozenset({"STEPLOCK_IDEMPOTENCY_MIDDLEWARE"})


def _django_only_match(name: str, close: str | None) -> str | None:
    """The Django-only setting (:data:`DJANGO_SETTINGS_READ`, no ``CELERY_`` prefix) that
    ``name`` (lower case, without the app's namespace) is closer to than to ``close``, the
    closest ``steplock_*`` setting: ``STEPLOCK_IDEMPOTENCY_MIDDLEWAR`` and
    ``CELERY_STEPLOCK_IDEMPOTENCY_MIDDLEWARE`` mean ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE``."""
    import difflib

    if close == name:
        return None
    best = difflib.get_close_matches(name.upper(), sorted(DJANGO_SETTINGS_READ), n=1)
    if not best:
        return None
    ours = difflib.SequenceMatcher(None, name.upper(), best[0]).ratio()
    theirs = difflib.SequenceMatcher(None, name, close).ratio() if close else 0.0
    return best[0] if ours > theirs else None


def unknown_name_problems(app: Any) -> list[Problem]:
    """W005: settings and task options that do not exist, each with the closest real name.

    Settings: every configuration key with ``steplock`` in its name (any case) that no
    ``steplock_*`` setting is read from: a misspelled name (``CELERY_STEPLOCK_DEFUALT_TTL``),
    or a real one the app never reads because it lacks the app's namespace (a Django
    ``STEPLOCK_DEFAULT_TTL`` when Celery reads ``namespace="CELERY"``). Task options: the
    attributes :func:`_unknown_option_names` finds (``@app.task(lock_tll=5)``).
    """
    import difflib

    from ._checks import setting_name
    from .conf import DEFAULTS, RENAMED

    found = []
    known = sorted(setting_name(name) for name in DEFAULTS)
    # A former name is still read (W006 says it is deprecated): never unknown, and the
    # closest name to it is the one that replaced it.
    renamed = {setting_name(old): setting_name(new) for old, new in RENAMED.items()}
    read = {key for name in (*known, *renamed) for key in _read_keys(app, name)}
    prefix = _prefix(app)
    for raw in sorted(set(_raw_keys(app))):
        if "steplock" not in raw.lower() or raw in read or raw in DJANGO_SETTINGS_READ:
            continue
        name = raw[len(prefix) :] if prefix and raw.upper().startswith(prefix.upper()) else raw
        name = name.lower()
        if name in renamed:
            close = [renamed[name]]
        else:
            close = [name] if name in known else difflib.get_close_matches(name, known, n=1)
        django_close = _django_only_match(name, close[0] if close else None)
        if name not in known and name not in renamed and raw in _read_keys(app, name):
            # read as written: the name itself is wrong (a typo)
            message = (
                f"Unknown celery-steplock setting {raw}: it is ignored."
                if prefix
                else f"Unknown celery-steplock setting {name} ({_django_name(name)}):"
                f" it is ignored."
            )
        else:
            how = (
                f"with the {prefix} namespace (config_from_object(..., namespace="
                f"{prefix.rstrip('_')!r}))"
                if prefix
                else "without a namespace"
            )
            message = (
                f"Setting {raw} is never read: the Celery app reads its settings "
                f"{how}, so it is ignored."
            )
        found.append(
            Problem(
                "celery_steplock.W005",
                message,
                hint=(
                    f"Did you mean {django_close} (a Django setting, without CELERY_)?"
                    if django_close
                    else f"Did you mean {_spelled(app, close[0])}?"
                    if close
                    else None
                ),
                obj=raw,
            )
        )
    for task in steplock_tasks(app):
        for attr, close in _unknown_option_names(task):  # type: ignore[assignment]
            found.append(
                Problem(
                    "celery_steplock.W005",
                    f"{task.name}: unknown task option {attr}: it is ignored.",
                    hint=f"Did you mean {close}?" if close else None,
                    obj=task.name,
                )
            )
    return found


def deprecated_name_problems(app: Any) -> list[Problem]:
    """W006: settings set under a former name (:data:`celery_steplock.conf.RENAMED`).

    The former name is read, for one release, while the name that replaced it is unset;
    beside it, the former one is ignored.

    Args:
        app: The Celery app.

    Returns:
        One warning per former name that is set, in the order of ``RENAMED``.
    """
    from ._checks import setting_name
    from .conf import RENAMED

    prefix = _prefix(app)

    def key(name: str) -> str:
        return _spelled(app, name) if prefix else name

    def spelled(name: str) -> str:
        return key(name) if prefix else f"{name} ({_django_name(name)})"

    found: list[Problem] = []
    for old, new in RENAMED.items():
        old_name, new_name = setting_name(old), setting_name(new)
        if app.conf.get(old_name) is None:
            continue
        if app.conf.get(new_name) is None:
            message = (
                f"Setting {spelled(old_name)} is deprecated: it is read as {key(new_name)} "
                f"until the next release."
            )
            hint = f"Rename it to {spelled(new_name)}."
        else:
            message = (
                f"Setting {spelled(old_name)} is deprecated and ignored: {key(new_name)} is set."
            )
            hint = f"Remove it: {spelled(new_name)} is the one read."
        found.append(
            Problem(
                "celery_steplock.W006",
                message,
                hint=hint,
                obj=key(old_name),
            )
        )
    return found


def django_setting_problems(app: Any, django_settings: Any = None) -> list[Problem]:
    """W005: Django settings with ``STEPLOCK`` in their name that ``app`` never reads,
    because its configuration does not come from the Django settings (no
    ``app.config_from_object("django.conf:settings", namespace="CELERY")``). A Django
    settings source the app reads is :func:`unknown_name_problems`'s to judge. Not part of
    :func:`problems`: the Django checks run it on the project's app (a process may hold
    other Celery apps that rightly ignore the Django settings).

    ``django_settings``: the settings object (default ``django.conf.settings``; nothing is
    judged when Django is not configured)."""
    if django_settings is None:
        conf_module = sys.modules.get("django.conf")
        django_settings = getattr(conf_module, "settings", None)
        if django_settings is None or not django_settings.configured:
            return []
    names = [
        n
        for n in dir(django_settings)
        if n.isupper() and "STEPLOCK" in n and n not in DJANGO_SETTINGS_READ
    ]
    if not names:
        return []
    raw = set(_raw_keys(app))
    return [
        Problem(
            "celery_steplock.W005",
            f"Django setting {name} is never read: the Celery app {app.main!r} does not load "
            f"its configuration from the Django settings, so it is ignored.",
            hint="Load it in the Celery app module: app.config_from_object("
            '"django.conf:settings", namespace="CELERY").',
            obj=name,
        )
        for name in sorted(names)
        if name not in raw
    ]


def _callable_lock_key_problems(task: Any) -> list[Problem]:
    """E004: a callable ``lock_key`` that cannot take the task's arguments as keywords (it
    is called with every bound argument, ``lock_key(**arguments)``)."""
    from .keys import argument_names

    key = getattr(task, "lock_key", None)
    if key is None or not callable(key) or isinstance(key, str):
        return []
    if inspect.ismethod(key) and key.__self__ is task:
        key = key.__func__  # given as a class attribute: judged as written
    arguments = argument_names(task.run)
    try:
        signature = inspect.signature(key)
    except (TypeError, ValueError):
        return []
    if arguments is None:
        return []
    try:
        signature.bind(**{name: None for name in arguments[0]})
    except TypeError as exc:
        return [
            Problem(
                "celery_steplock.E004",
                f"{task.name}: lock_key {getattr(key, '__name__', key)!r} cannot be called "
                f"with the task's arguments as keywords ({exc}; arguments: "
                f"{', '.join(sorted(arguments[0])) or 'none'})",
                hint="Give the callable a parameter per task argument (or **kwargs): it is "
                "called as lock_key(**bound_arguments).",
                obj=task.name,
            )
        ]
    return []


def recovery_problems(app: Any) -> list[Problem]:
    """E005: a model of ``steplock_reaper_recover`` the reaper cannot recover: it does not
    exist, lacks the status or owner column (``steplock_status_field``,
    ``steplock_owner_field``), or the age column (``updated_at``) while
    ``steplock_reaper_older_than`` > 0, or a status there is not one its status field
    allows (its ``choices``). Judged once Django's models are loaded (as the reaper's
    recovery is Django's)."""
    try:
        settings = Settings(app)
        recover = settings.reaper_recover
        older_than = settings.reaper_older_than
        columns = (
            ("steplock_status_field", settings.status_field),
            ("steplock_owner_field", settings.owner_field),
        )
    except ImproperlyConfigured:
        return []  # E003 reports it
    if not recover or not _django.apps_ready():
        return []
    FieldDoesNotExist = _django.field_does_not_exist()
    AGE_FIELD = _django.contrib("recovery").AGE_FIELD
    resolve_model = _django.contrib("steps").resolve_model

    found = []

    def problem(label: str, message: str, hint: str | None) -> None:
        found.append(
            Problem(
                "celery_steplock.E005",
                f"steplock_reaper_recover: {label}: {message}",
                hint=hint,
                obj="steplock_reaper_recover",
            )
        )

    for label, moves in recover.items():
        try:
            model = resolve_model(label, "steplock_reaper_recover")
        except ImproperlyConfigured:
            problem(
                label,
                "no such model: the reaper cannot recover its steps.",
                'Name an installed step model as "app_label.ModelName" in '
                "CELERY_STEPLOCK_REAPER_RECOVER.",
            )
            continue
        status = None
        for setting, column in columns:
            try:
                field = model._meta.get_field(column)
            except FieldDoesNotExist:
                problem(
                    label,
                    f"the model has no field {column!r} ({setting}), which "
                    f"recovery needs: the reaper cannot recover its steps.",
                    f"Add the column to the model, or set {_django_name(setting)} to "
                    f"its name (LeaseFencedStep adds lock_owner and lock_fence).",
                )
                continue
            if setting == "steplock_status_field":
                status = field
        if older_than > 0:
            try:
                model._meta.get_field(AGE_FIELD)
            except FieldDoesNotExist:
                problem(
                    label,
                    f"steplock_reaper_older_than={older_than:g} needs an "
                    f"{AGE_FIELD!r} column (auto_now=True) on the model: the "
                    f"reaper refuses to recover its steps.",
                    f"Add {AGE_FIELD} = models.DateTimeField(auto_now=True), or set "
                    f"CELERY_STEPLOCK_REAPER_OLDER_THAN = 0.",
                )
        choices = getattr(status, "flatchoices", None) if status is not None else None
        if choices:
            allowed = {str(value) for value, _ in choices}
            listed = ", ".join(map(repr, sorted(allowed)))
            where = f"{model._meta.label}.{status.name}"  # type: ignore[union-attr]
            for kind, statuses, effect in (
                (
                    "in-flight",
                    set(moves),
                    "steps in flight under the real name are never recovered",
                ),
                (
                    "recovery",
                    set(moves.values()),
                    "the reaper would write a status the field does not allow",
                ),
            ):
                unknown = sorted(statuses - allowed)
                if unknown:
                    problem(
                        label,
                        f"{kind} status {', '.join(map(repr, unknown))} is not a "
                        f"choice of {where} ({listed}): {effect}.",
                        "Map in-flight statuses to recovery statuses among the status "
                        "field's choices.",
                    )
    return found


def name_secret_problems(app: Any) -> list[Problem]:
    """W010 when there is no name secret (``steplock_name_secret`` unset and no configured
    Django ``SECRET_KEY``): default lock names and idempotency keys are then made with a public
    key. W011 when it derives from a Django ``SECRET_KEY`` that Django itself calls insecure
    (the ``django-insecure-`` prefix of ``startproject``, under 50 characters or under 5
    distinct ones) and ``DEBUG`` is off. An invalid ``steplock_name_secret`` is an E003."""

    if Settings(app).raw("name_secret") is not None:
        return []
    secret_key = _django.secret_key()
    hint = (
        "set steplock_name_secret (CELERY_STEPLOCK_NAME_SECRET) to the same random "
        "string on every worker, e.g. secrets.token_urlsafe(32); see the README's "
        '"Lock names" for rotating it'
    )
    if secret_key is None:
        return [
            Problem(
                "celery_steplock.W010",
                "no name secret: steplock_name_secret is not set and there is no Django "
                "SECRET_KEY, so default lock names are HMACs with a public key (whoever sees a "
                "name in the admin, the CLI or the logs can recover guessable arguments by trying "
                "them) and lease.idempotency_key raises",
                hint=hint,
                obj="steplock_name_secret",
            )
        ]
    text = secret_key if isinstance(secret_key, str) else secret_key.decode("latin-1")
    weak = text.startswith("django-insecure-") or len(text) < 50 or len(set(text)) < 5
    if weak and not _django.debug():
        return [
            Problem(
                "celery_steplock.W011",
                "the name secret is derived from Django's SECRET_KEY, which is insecure (the "
                "django-insecure- prefix, under 50 characters or under 5 distinct ones) while "
                "DEBUG is off: whoever knows that key can recover guessable arguments from lock "
                "names and idempotency keys",
                hint=hint,
                obj="steplock_name_secret",
            )
        ]
    return []


def problems(app: Any) -> list[Problem]:
    """Every problem of ``app``'s steplock configuration: settings (E003), task options
    (E004), step models (E002, once the step store's models are loaded), then the warnings
    W001, W002, W004, W012, W005 and W006. Reads the tasks ``app`` has registered; imports no task
    module."""
    return (
        settings_problems(app)
        + step_store_problems(app)
        + step_database_problems(app)
        + task_problems(app)
        + step_model_problems(app)
        + recovery_problems(app)
        + visibility_timeout_problems(app)
        + worker_lost_problems(app)
        + time_limit_problems(app)
        + return_winner_problems(app)
        + unknown_name_problems(app)
        + deprecated_name_problems(app)
        + name_secret_problems(app)
    )


def refuse_to_start(app: Any) -> None:
    """Worker start: log each warning, and raise SystemExit listing the errors, if any (a
    worker that starts anyway would consume acks_late messages only to fail them)."""
    errors = []
    try:
        found = _masked(app, problems(app))
    except Exception as exc:  # noqa: BLE001 - never start unvalidated (fail closed)
        # Its text may quote a setting's value: masked, and not chained to the exit.
        error = redact(f"{type(exc).__name__}: {exc}", secrets_of(app))
        log_event(
            "improperly_configured", logging.CRITICAL, reason="validation failed", error=error
        )
        raise SystemExit(
            f"celery-steplock: the configuration could not be validated: {error}"
        ) from None
    for problem in found:
        if problem.is_error:
            log_event(
                "improperly_configured", logging.CRITICAL, id=problem.id, message=problem.message
            )
            errors.append(problem.message)
        else:
            log_event(
                "configuration_warning", logging.WARNING, id=problem.id, message=problem.message
            )
    if errors:
        raise SystemExit("celery-steplock: " + "; ".join(errors))
