"""The execution plan: everything a StepLockedTask's execution needs that does not change
between executions, resolved once per (task, configuration version).

Celery resolves a task's options once, when the task is bound to its app; this does the same
for the steplock options: each option is validated and defaulted from its ``steplock_*``
setting, and the lease store and the step store are built, the first time the task runs and
again only after ``app.conf`` changed (:func:`celery_steplock.conf.configuration_version`) or
one of the task's options changed (assigned on the task or its class, deleted, restored). An execution then reads plain
attributes.

:func:`option_problems` collects every invalid option of a task (for the validator,
:mod:`celery_steplock.validate`); :func:`build_plan` raises the first one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from . import patterns
from ._checks import (
    MAX_HOLD,
    MAX_RETRIES,
    MAX_WAIT,
    MIN_RENEWAL_INTERVAL,
    check_bool,
    check_choice,
    check_count,
    check_database,
    check_seconds,
    check_ttl,
    shown,
)
from .conf import (
    ON_CONFLICT,
    ON_CONTENDED,
    ON_STORE_ERROR,
    OVERLAP,
    Settings,
    configuration_version,
)
from .exceptions import ImproperlyConfigured, LockNameError
from .keys import argument_names, template_fields
from .lock import RedisLeaseStore, get_lease_store
from .steps import (
    StepStore,
    check_known_database,
    check_transitions,
    load_step_store,
    step_store_factory,
)

__all__ = [
    "ExecutionPlan",
    "build_plan",
    "option_problems",
    "option_values",
    "is_step_locked",
    "option_names",
]

#: The task attributes of the lease and the step a plan is built from.
_CORE_OPTIONS = frozenset(
    {
        "lock_key",
        "lock_ttl",
        "lock_wait",
        "lock_max_hold",
        "on_contended",
        "overlap",
        "on_conflict",
        "on_store_error",
        "step_model",
        "step_id_arg",
        "step_transition",
        "step_transitions",
        "lock_precheck",
        "lock_retry_max",
        "step_database",
    }
)


_names: tuple[tuple[int, int], frozenset[str], tuple[str, ...]] | None = None


def option_names() -> frozenset[str]:
    """The task attributes a plan is built from: the lease's and the step's options and every
    registered gate's (:func:`celery_steplock.patterns.register_gate`). Assigning one on a
    task drops its plan."""
    return _option_names()[1]


def _option_names() -> tuple[tuple[int, int], frozenset[str], tuple[str, ...]]:
    global _names
    version = patterns.registry_version()
    names = _names
    if names is None or names[0] != version:
        found = _CORE_OPTIONS | patterns.gate_options()
        names = _names = (version, found, tuple(sorted(found)))
    return names


def __getattr__(name: str) -> Any:
    # OPTION_NAMES follows the gate registry (read on use, never at import).
    if name == "OPTION_NAMES":
        return option_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ExecutionPlan:
    """A task's resolved options, in the API's units (seconds), and its stores.

    ``ttl``, ``wait``, ``max_hold`` (None: no cap), ``retry_backoff``, ``retry_backoff_max``:
    seconds. ``renew_ms``: the renewal interval stored beside the lease for the reaper.
    ``transition``: ``(from_, to)`` or None. ``steps``: the step store of ``step_model``
    (None without one). ``version``: the configuration version the plan was built for;
    ``options``: the task's option values it was built from (:func:`option_values`).
    ``gates``: the admission gates its executions pass (:mod:`celery_steplock.patterns.gates`).
    ``overlap``: the overlap guard (None, "skip", "coalesce" or "queue", :func:`_overlap`);
    with one, ``on_contended`` and ``wait`` are the guard's.
    """

    task_name: str
    lock_key: str | Callable[..., str] | None
    ttl: float
    wait: float
    max_hold: float | None
    ratio: float
    on_contended: str
    on_conflict: str
    on_store_error: str
    transition: tuple[str, str] | None
    step_id_arg: str | None
    precheck: bool
    retry_max: int | None
    retry_backoff: float
    retry_backoff_max: float
    db_deadline: bool
    store: RedisLeaseStore
    steps: StepStore | None
    settings: Settings
    version: Any
    options: tuple[Any, ...] = ()
    gates: tuple[Any, ...] = ()
    overlap: str | None = None

    @property
    def renew_ms(self) -> int:
        return int(max(self.ttl * self.ratio, MIN_RENEWAL_INTERVAL) * 1000)

    @property
    def key_prefix(self) -> str:
        return self.store.prefix


def option_values(task: Any) -> tuple[Any, ...]:
    """The task's current option values, in :data:`OPTION_NAMES` order: a plan built from
    other values is stale (an option assigned on the task or its class, deleted, or
    restored by ``mock.patch``). Cheap: attribute reads, compared by identity first."""
    return tuple(getattr(task, name, None) for name in _option_names()[2])


def is_step_locked(task: Any) -> bool:
    """Whether ``task`` is a StepLockedTask (it has an execution plan), without importing
    the task module. ``__class__``, as ``isinstance`` reads it: a task still behind the
    app's proxy (before the app finalizes) answers for the task."""
    return isinstance(getattr(task.__class__, "steplock_plan", None), property)


def _transition(task: Any) -> tuple[str, str] | None:
    transition = task.step_transition
    if transition is None:
        return None
    if (
        not isinstance(transition, tuple)
        or len(transition) != 2
        or not all(isinstance(s, str) for s in transition)
    ):
        raise ImproperlyConfigured(
            f"transition must be a (from_, to) pair of status strings, got {shown(transition)}",
            setting="transition",
        )
    if task.step_model is None or not task.step_id_arg:
        raise ImproperlyConfigured(
            "transition needs step_model and step_id_arg",
            setting="step_model" if task.step_model is None else "step_id_arg",
        )
    return transition


def _arguments(task: Any) -> tuple[frozenset[str], bool] | None:
    """The names the task's ``run`` takes and whether it takes ``**kwargs``; None when its
    signature cannot be read."""
    return argument_names(task.run)


def _step_id_arg(task: Any) -> str | None:
    name = task.step_id_arg
    if name is None:
        return None
    if not isinstance(name, str) or not name.isidentifier():
        raise ImproperlyConfigured(
            f"step_id_arg must be an argument name, got {shown(name)}", setting="step_id_arg"
        )
    known = _arguments(task)
    if known is not None and not known[1] and name not in known[0]:
        raise ImproperlyConfigured(
            f"step_id_arg={name!r} is not an argument of the task (arguments: "
            f"{', '.join(sorted(known[0])) or 'none'})",
            setting="step_id_arg",
        )
    return name


def _lock_key(task: Any) -> Any:
    template = task.lock_key
    if inspect.ismethod(template) and template.__self__ is task:
        # A function given as a class attribute or an ``@app.task(lock_key=...)`` keyword
        # (which Celery makes a class attribute) is bound on access: call the function.
        template = template.__func__
    if template is None or callable(template):
        return template
    if not isinstance(template, str):
        raise ImproperlyConfigured(
            f"lock_key must be a str.format template or a callable, got {shown(template)}",
            setting="lock_key",
        )
    try:
        fields = template_fields(template)
    except LockNameError as exc:
        raise ImproperlyConfigured(str(exc), setting="lock_key") from None
    known = _arguments(task)
    if known is not None and not known[1]:
        for field_name in fields:
            if field_name not in known[0]:
                raise ImproperlyConfigured(
                    f"lock_key {shown(template)} names {field_name!r}, which is not an "
                    f"argument of the task (arguments: {', '.join(sorted(known[0])) or 'none'})",
                    setting="lock_key",
                )
    return template


def _transitions(task: Any) -> Any:
    table = task.step_transitions
    if table is None:
        return None
    check_transitions(table)
    transition = task.step_transition
    if (
        isinstance(transition, tuple)
        and len(transition) == 2
        and transition[1] not in table.get(transition[0], ())
    ):
        raise ImproperlyConfigured(
            f"transition {transition[0]!r} -> {transition[1]!r} is not allowed by "
            f"step_transitions {table!r}: every execution would fail after its body",
            setting="step_transitions",
        )
    return table


def _retry_max(task: Any, settings: Settings) -> int | None:
    value = task.lock_retry_max
    if value is None:
        return settings.retry_max
    return check_count(value, "lock_retry_max", maximum=MAX_RETRIES)


def _step_database(task: Any, settings: Settings) -> tuple[str | None, str]:
    """The database the task's step store is told to use (None: the store's choice, the
    router's for Django) and the option or setting it comes from."""
    value = getattr(task, "step_database", None)
    if value is None:
        return settings.step_database, "steplock_step_database"
    return check_database(value, "step_database"), "step_database"


def _checked_step_database(task: Any, settings: Settings) -> tuple[str | None, str]:
    """:func:`_step_database`, refused by name when the step store's factory does not know
    the database (judged only for a task with a step model)."""
    using, source = _step_database(task, settings)
    if using is not None and task.step_model is not None:
        check_known_database(step_store_factory(settings.step_store), using, source)
    return using, source


def _steps(
    task: Any, settings: Settings, database: Callable[[], tuple[str | None, str]]
) -> StepStore | None:
    if task.step_model is None:
        return None
    using, source = database()
    return load_step_store(
        settings.step_store,
        task.step_model,
        status_field=settings.status_field,
        owner_field=settings.owner_field,
        fence_field=settings.fence_field,
        transitions=task.step_transitions,
        using=using,
        using_setting=source,
    )


#: The ``on_contended`` each overlap policy runs with (and the one a task may also set).
_OVERLAP_CONTENDED = {"skip": "skip", "coalesce": "retry", "queue": "retry"}


def _overlap(task: Any, settings: Settings) -> str | None:
    """The task's overlap guard: its ``overlap`` option, else ``steplock_overlap``.

    A policy decides what a busy lease does, so it conflicts with an ``on_contended`` other
    than its own ("skip" for skip, "retry" for coalesce and queue) and, for skip and
    coalesce (which never wait), with a ``lock_wait`` above 0. Set on the task, a conflict
    raises ImproperlyConfigured naming ``overlap``; from the setting, the task's own options
    win (the guard is off for that task), as every task option wins over its setting.
    """
    value = getattr(task, "overlap", None)
    if value is None:
        policy = settings.overlap
        if policy is None or _overlap_conflict(task, policy) is None:
            return policy
        return None
    policy = check_choice(value, "overlap", OVERLAP)
    conflict = _overlap_conflict(task, policy)
    if conflict is not None:
        raise ImproperlyConfigured(f"overlap={policy!r} {conflict}", setting="overlap")
    return policy


def _overlap_conflict(task: Any, policy: str) -> str | None:
    """Why the task's own ``on_contended`` or ``lock_wait`` contradicts ``policy`` (None:
    they do not)."""
    own = _OVERLAP_CONTENDED[policy]
    if task.on_contended is not None and task.on_contended != own:
        return (
            f"decides what a busy lease does (on_contended={own!r}); on_contended="
            f"{shown(task.on_contended)} contradicts it: leave on_contended unset"
        )
    wait = task.lock_wait
    if (
        policy != "queue"
        and wait is not None
        and not isinstance(wait, bool)
        and isinstance(wait, (int, float))
        and wait > 0
    ):
        return (
            f"never waits for a busy lease; lock_wait={shown(wait)} contradicts it: leave "
            f"lock_wait unset or 0 (or use overlap='queue')"
        )
    return None


def _option(value: Any, check: Callable[[], Any], default: Callable[[], Any]) -> Any:
    return default() if value is None else check()


def _resolvers(task: Any, settings: Settings) -> dict[str, Callable[[], Any]]:
    """One zero-argument resolver per plan field, each raising ImproperlyConfigured."""
    database: list[tuple[str | None, str]] = []
    guard: list[str | None] = []

    def step_database() -> tuple[str | None, str]:
        if not database:  # read once: the step store's resolver needs it too
            database.append(_checked_step_database(task, settings))
        return database[0]

    def overlap() -> str | None:
        if not guard:  # read once: on_contended and wait follow it
            guard.append(_overlap(task, settings))
        return guard[0]

    def policy() -> str | None:
        # For on_contended and wait: an invalid overlap is the "overlap" resolver's to report.
        try:
            return overlap()
        except ImproperlyConfigured:
            return None

    def wait() -> Any:
        seconds = _option(
            task.lock_wait,
            lambda: check_seconds(task.lock_wait, "lock_wait", allow_zero=True, maximum=MAX_WAIT),
            lambda: settings.lock_wait,
        )
        return seconds if policy() in (None, "queue") else 0.0  # skip, coalesce never wait

    def on_contended() -> Any:
        chosen = policy()
        if chosen is not None:
            return _OVERLAP_CONTENDED[chosen]
        return _option(
            task.on_contended,
            lambda: check_choice(task.on_contended, "on_contended", ON_CONTENDED),
            lambda: settings.on_contended,
        )

    return {
        "lock_key": lambda: _lock_key(task),
        "ttl": lambda: _option(
            task.lock_ttl,
            lambda: check_ttl(task.lock_ttl, "lock_ttl"),
            lambda: settings.default_ttl,
        ),
        "wait": wait,
        "max_hold": lambda: _option(
            task.lock_max_hold,
            lambda: check_seconds(task.lock_max_hold, "lock_max_hold", maximum=MAX_HOLD),
            lambda: settings.max_hold,
        ),
        "ratio": lambda: settings.renewal_ratio,
        "on_contended": on_contended,
        "overlap": overlap,
        "on_conflict": lambda: _option(
            task.on_conflict,
            lambda: check_choice(task.on_conflict, "on_conflict", ON_CONFLICT),
            lambda: settings.on_conflict,
        ),
        "on_store_error": lambda: _option(
            task.on_store_error,
            lambda: check_choice(task.on_store_error, "on_store_error", ON_STORE_ERROR),
            lambda: settings.on_store_error,
        ),
        "transition": lambda: _transition(task),
        "step_id_arg": lambda: _step_id_arg(task),
        "step_transitions": lambda: _transitions(task),
        "precheck": lambda: _option(
            task.lock_precheck,
            lambda: check_bool(task.lock_precheck, "lock_precheck"),
            lambda: settings.precheck,
        ),
        "retry_max": lambda: _retry_max(task, settings),
        "retry_backoff": lambda: settings.retry_backoff,
        "retry_backoff_max": lambda: settings.retry_backoff_max,
        "db_deadline": lambda: settings.db_deadline,
        "store": lambda: get_lease_store(task.app, settings),
        "step_database": step_database,
        "steps": lambda: _steps(task, settings, step_database),
        "gates": lambda: patterns.build_gates(task, settings),
    }


def _named(task: Any, exc: ImproperlyConfigured) -> ImproperlyConfigured:
    """``exc`` with the task's name in front of its message (once)."""
    message = str(exc)
    if message.startswith(f"{task.name}:"):
        return exc
    return ImproperlyConfigured(f"{task.name}: {message}", setting=exc.setting)


def option_problems(task: Any, *, models_ready: bool = True) -> list[ImproperlyConfigured]:
    """Every invalid option of ``task`` (one error each, the task's name in front); an
    option left to an invalid setting is the setting's problem, not listed here. Step models are resolved only when ``models_ready`` (the
    framework's model registry is loaded)."""
    settings = Settings(task.app)
    problems: list[ImproperlyConfigured] = []
    seen: set[tuple[str | None, str]] = set()
    for field_name, resolve in _resolvers(task, settings).items():
        if field_name == "steps" and not models_ready:
            continue
        if field_name in ("store", "ratio", "retry_backoff", "retry_backoff_max", "db_deadline"):
            continue  # settings only: the settings' own validation reports them
        if field_name == "gates":
            problems.extend(_named(task, exc) for exc in patterns.gate_problems(task, settings))
            continue
        try:
            resolve()
        except ImproperlyConfigured as exc:
            if exc.setting and exc.setting.startswith("steplock_"):
                continue  # an option left to its setting: the setting is what is invalid
            if (exc.setting, str(exc)) in seen:
                continue  # step_database: judged on its own and again by the step store
            seen.add((exc.setting, str(exc)))
            problems.append(_named(task, exc))
    return problems


def build_plan(task: Any) -> ExecutionPlan:
    """Resolve ``task``'s plan against its app's current configuration.

    Raises ImproperlyConfigured naming the task and the first invalid option or setting.
    """
    version = configuration_version(task.app)
    settings = Settings(task.app)
    values: dict[str, Any] = {}
    options = option_values(task)
    for field_name, resolve in _resolvers(task, settings).items():
        try:
            values[field_name] = resolve()
        except ImproperlyConfigured as exc:
            named = _named(task, exc)
            if named is exc:
                raise
            raise named from exc
    values.pop("step_transitions")
    values.pop("step_database")
    return ExecutionPlan(
        task_name=task.name,
        settings=Settings(task.app, snapshot=True),
        version=version,
        options=options,
        **values,
    )
