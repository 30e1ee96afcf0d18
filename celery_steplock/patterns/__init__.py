"""The distributed patterns, and the registry of their admission gates.

:data:`GATE_REGISTRY` maps a gate's name to its module and the task options it reads, in
the order an execution enters the gates (:mod:`celery_steplock.patterns.gates` says what a
gate module provides). The options are declared here, so the execution plan knows them
without importing a gate module. The registry is open, the way Celery finds its result
backends by name: :func:`register_gate`, or an entry point of the group
``celery_steplock.gates`` in a distribution's metadata (read once, at the registry's first
use)::

    [project.entry-points."celery_steplock.gates"]
    quota = "myproject.quota_gate"     # a module with OPTIONS and gate(task, settings)

An entry point's module may set ``GATE_BEFORE`` to the name of the gate it enters before
(default: after every other).
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from collections.abc import Iterable
from importlib import metadata
from typing import Any

from ..exceptions import ImproperlyConfigured, InvalidArgument
from .gates import NOT_RUN, Admission, AdmissionContext, Entered, Gate, Replay

__all__ = [
    "GATE_REGISTRY",
    "GATES",
    "ENTRY_POINT_GROUP",
    "register_gate",
    "registry_version",
    "gate_options",
    "build_gates",
    "gate_problems",
    "Gate",
    "Admission",
    "AdmissionContext",
    "Replay",
    "NOT_RUN",
    "Entered",
]

#: The entry-point group of third-party gates: ``name = "package.module"``.
ENTRY_POINT_GROUP = "celery_steplock.gates"

#: Gate name -> (module path, task option names), in entry order: a replayed result costs no
#: breaker probe, a refused call no concurrency slot, and a task waiting for a slot no
#: rate-limit token. Change it with :func:`register_gate`.
GATE_REGISTRY: dict[str, tuple[str, frozenset[str]]] = {
    "idempotency": (
        "celery_steplock.patterns.idempotency",
        frozenset({"idempotency_key", "idempotency_version", "idempotency_ttl"}),
    ),
    "breaker": (
        "celery_steplock.patterns.breaker",
        frozenset({"circuit_breaker", "retry_policy"}),
    ),
    "concurrency": (
        "celery_steplock.patterns.concurrency",
        frozenset({"concurrency_limit", "concurrency_limit_key"}),
    ),
    "ratelimit": (
        "celery_steplock.patterns.ratelimit",
        frozenset({"cluster_rate_limit", "cluster_rate_limit_key"}),
    ),
}

_guard = threading.RLock()
_entry_points_read = False
#: Bumped by every registration: the plan's option names follow it (:func:`registry_version`).
_version = [0]


def register_gate(
    name: str, module: str, options: Iterable[str], before: str | None = None
) -> None:
    """Add a gate to the registry, or replace the gate of that name.

    The gate's options join the plan's option names (:func:`celery_steplock.plan.option_names`)
    at once, so a plan built before the registration is rebuilt at its task's next execution.

    Args:
        name: the gate's name (``"ratelimit"``).
        module: the dotted path of its module, which provides ``gate(task, settings)``
            (:mod:`celery_steplock.patterns.gates`); imported when a plan is built.
        options: the task options the gate reads.
        before: the name of the gate it enters before; None: after every other (a
            replaced gate keeps its place).

    Raises:
        InvalidArgument: a bad name, module, option or ``before``, or an option another
            gate reads already.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidArgument(
            f"register_gate(name=) must be an identifier, got {name!r}", argument="name"
        )
    if not isinstance(module, str) or not all(p.isidentifier() for p in module.split(".")):
        raise InvalidArgument(
            f"register_gate(module=) must be a dotted module path, got {module!r}",
            argument="module",
        )
    if isinstance(options, str):
        options = (options,)
    if not isinstance(options, Iterable):
        raise InvalidArgument(
            f"register_gate(options=) must be task option names, got {options!r}",
            argument="options",
        )
    found = frozenset(options)
    if not all(isinstance(o, str) and o.isidentifier() for o in found):
        raise InvalidArgument(
            f"register_gate(options=) must be task option names, got {sorted(map(repr, found))}",
            argument="options",
        )
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise InvalidArgument(
            f"register_gate(module=) names no importable module: {module!r}", argument="module"
        )
    with _guard:
        _read_entry_points()
        _register(name, module, found, before)


def _register(name: str, module: str, found: frozenset[str], before: str | None) -> None:
    with _guard:
        for other, (_module, taken) in GATE_REGISTRY.items():
            if other != name and found & taken:
                raise InvalidArgument(
                    f"register_gate({name!r}): the gate {other!r} reads "
                    f"{', '.join(sorted(found & taken))} already",
                    argument="options",
                )
        if before is not None and (before == name or before not in GATE_REGISTRY):
            raise InvalidArgument(
                f"register_gate(before=) must name another registered gate "
                f"({', '.join(GATE_REGISTRY)}), got {before!r}",
                argument="before",
            )
        entries = list(GATE_REGISTRY.items())
        if before is None and name in GATE_REGISTRY:
            entries = [(n, (module, found) if n == name else e) for n, e in entries]
        else:
            entries = [(n, e) for n, e in entries if n != name]
            at = len(entries) if before is None else [n for n, _ in entries].index(before)
            entries.insert(at, (name, (module, found)))
        GATE_REGISTRY.clear()
        GATE_REGISTRY.update(entries)
        _version[0] += 1


def _read_entry_points() -> None:
    """Register the gates of the entry-point group, once per process (a broken one raises
    at every use until it is fixed)."""
    global _entry_points_read
    with _guard:
        if _entry_points_read:
            return
        for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                module = importlib.import_module(point.module)
                options = frozenset(module.OPTIONS)
                _register(point.name, point.module, options, getattr(module, "GATE_BEFORE", None))
            except Exception as exc:
                raise ImproperlyConfigured(
                    f"the {ENTRY_POINT_GROUP} entry point {point.name} = {point.value!r} "
                    f"is not a gate module: {exc!r}",
                    setting=ENTRY_POINT_GROUP,
                ) from exc
        _entry_points_read = True


def _registered() -> list[tuple[str, tuple[str, frozenset[str]]]]:
    with _guard:
        _read_entry_points()
        return list(GATE_REGISTRY.items())


def __getattr__(name: str) -> Any:
    if name == "GATES":
        # The gate modules in entry order (the former closed tuple of gates.py).
        return tuple(module for _name, (module, _options) in _registered())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def registry_version() -> tuple[int, int]:
    """A value that changes with every registration (entry points read included) and with a
    registry replaced whole (tests do)."""
    with _guard:
        _read_entry_points()
        return _version[0], id(GATE_REGISTRY)


def gate_options() -> frozenset[str]:
    """The task options of every registered gate, without importing a gate module.

    Returns:
        The option names.
    """
    names: set[str] = set()
    for _name, (_module, options) in _registered():
        names |= options
    return frozenset(names)


def build_gates(task: Any, settings: Any) -> tuple[Gate, ...]:
    """The gates of a task, in entry order.

    Args:
        task: the task.
        settings: its app's :class:`~celery_steplock.conf.Settings`.

    Returns:
        Its gates (empty when no pattern is on).

    Raises:
        ImproperlyConfigured: the first invalid option (it names itself).
    """
    gates = []
    for _name, (module, _options) in _registered():
        gate = importlib.import_module(module).gate(task, settings)
        if gate is not None:
            gates.append(gate)
    return tuple(gates)


def gate_problems(task: Any, settings: Any) -> list[ImproperlyConfigured]:
    """Every gate's first invalid option of a task.

    Args:
        task: the task.
        settings: its app's :class:`~celery_steplock.conf.Settings`.

    Returns:
        One ImproperlyConfigured per gate with an invalid option; an option left to an
        invalid ``steplock_*`` setting is the setting's problem, not listed.
    """
    problems = []
    for _name, (module, _options) in _registered():
        try:
            importlib.import_module(module).gate(task, settings)
        except ImproperlyConfigured as exc:
            if not (exc.setting and exc.setting.startswith("steplock_")):
                problems.append(exc)
    return problems
