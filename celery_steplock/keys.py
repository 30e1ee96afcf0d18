"""Lock names and Redis keys.

A lock name identifies the step a task execution mutates. By default it is derived from the
task's signature: the call's arguments are bound with :func:`inspect.signature` (defaults
applied, so ``t(1)``, ``t(x=1)`` and ``t(1, y=<default>)`` name the same lock, and keyword order
never matters), encoded as canonical JSON with kombu's encoder (the one Celery's JSON serializer
uses, so ``UUID``, ``datetime``, ``date``, ``Decimal`` and ``bytes`` work; a ``Decimal``
keeps its written precision, so ``Decimal("1.1")`` and ``Decimal("1.10")`` name different
locks), and hashed with SHA-256. Names passed through ``**kwargs`` join the declared ones. A ``lock_key`` task option replaces that with a :meth:`str.format` template over the
argument names (``"order:{order_id}"``) or a callable receiving the bound arguments as keywords.

Redis keys wrap the name in braces, a Redis Cluster hash tag, so that the lease and its fencing
counter always live in the same slot: ``steplock:lease:{order:42}`` and
``steplock:fence:{order:42}``.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any, Callable, Mapping, Sequence

from kombu.utils.json import JSONEncoder

from .exceptions import LockNameError

__all__ = ["bind_arguments", "canonical_json", "lock_name", "name_from_arguments", "lease_key",
           "fence_key", "waiters_key", "wake_key", "name_from_key", "check_name",
           "MAX_NAME_LENGTH", "argument_names"]

MAX_NAME_LENGTH = 512

LockKey = str | Callable[..., str] | None


def bind_arguments(fun: Callable, args: Sequence, kwargs: Mapping) -> dict[str, Any]:
    """Bind ``args``/``kwargs`` to ``fun``'s signature with defaults applied.

    ``fun`` is the task's ``run``: for a ``bind=True`` task that is a bound method, so
    ``self`` is never part of the result. Raises :class:`LockNameError` when the call does
    not match the signature.
    """
    try:
        signature = _signature(fun)
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise LockNameError(f"cannot bind the task's arguments to its signature: {exc}") from exc
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            # ``**kwargs`` names join the declared ones, so templates and step_id_arg reach
            # them (they cannot collide: Python refuses a keyword that names a parameter).
            arguments.update(arguments.pop(parameter.name, {}))
    return arguments


def argument_names(fun: Callable) -> tuple[frozenset[str], bool] | None:
    """``(names, takes_var_keyword)`` of ``fun``'s signature: the names a call can bind
    (``*args``/``**kwargs`` themselves excluded; ``self`` of a bound method too) and whether
    it takes ``**kwargs``. None when the signature cannot be read (some builtins)."""
    try:
        signature = _signature(fun)
    except (TypeError, ValueError):
        return None
    parameters = signature.parameters.values()
    names = frozenset(p.name for p in parameters
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


_signatures: dict[tuple[Any, bool], inspect.Signature] = {}


def _signature(fun: Callable) -> inspect.Signature:
    """``inspect.signature(fun)``, computed once per function (a task's ``run`` is a new
    bound method at every access, so the cache is keyed on the function)."""
    func = getattr(fun, "__func__", None)
    key = (func, True) if func is not None and getattr(fun, "__self__", None) is not None \
        else (fun, False)
    try:
        signature = _signatures.get(key)
    except TypeError:  # an unhashable callable
        return inspect.signature(fun)
    if signature is None:
        signature = inspect.signature(fun)
        if len(_signatures) < 10000:
            _signatures[key] = signature
    return signature


def canonical_json(arguments: Mapping[str, Any]) -> str:
    """Encode ``arguments`` as canonical JSON (sorted keys, no spaces, kombu's type tags).

    Raises :class:`LockNameError` naming the first argument that cannot be encoded.
    """
    try:
        return json.dumps(arguments, cls=JSONEncoder, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        for name in sorted(arguments):
            try:
                json.dumps(arguments[name], cls=JSONEncoder, sort_keys=True)
            except (TypeError, ValueError) as inner:
                raise LockNameError(
                    f"argument {name!r} cannot be part of a lock name: {inner} "
                    f"(use lock_key to name the lock explicitly)",
                    argument=name) from exc
        raise LockNameError(f"arguments cannot be part of a lock name: {exc}") from exc


def check_name(name: Any) -> str:
    """Return ``name`` if it can be used as a lock name, else raise :class:`LockNameError`:
    a non-empty string of printable characters, without braces, at most 512 long."""
    if not isinstance(name, str) or not name:
        raise LockNameError(f"a lock name must be a non-empty string, got {name!r}")
    if not name.isprintable():
        raise LockNameError(f"a lock name must be printable (no newlines or control "
                            f"characters): {name!r}")
    if "{" in name or "}" in name:
        raise LockNameError(
            f"a lock name cannot contain braces (they delimit the Redis Cluster hash tag): "
            f"{name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise LockNameError(f"a lock name is at most {MAX_NAME_LENGTH} characters, "
                            f"got {len(name)}")
    return name


def lock_name(task_name: str, fun: Callable, args: Sequence, kwargs: Mapping,
              lock_key: LockKey = None) -> str:
    """Return the lock name of one call ``fun(*args, **kwargs)`` of task ``task_name``.

    ``lock_key`` None: ``"<task_name>:<sha256 hex of the canonical bound arguments>"``.
    ``lock_key`` str: ``lock_key.format(**bound_arguments)``; a placeholder that names no
    argument raises :class:`LockNameError`. ``lock_key`` callable: its return value, called
    with the bound arguments as keywords.
    """
    return name_from_arguments(task_name, bind_arguments(fun, args, kwargs), lock_key)


def name_from_arguments(task_name: str, arguments: Mapping[str, Any],
                        lock_key: LockKey = None) -> str:
    """:func:`lock_name` for arguments already bound by :func:`bind_arguments`."""
    if lock_key is None:
        digest = hashlib.sha256(canonical_json(arguments).encode()).hexdigest()
        return check_name(f"{task_name}:{digest}")
    if callable(lock_key):
        return check_name(lock_key(**arguments))
    try:
        return check_name(lock_key.format(**arguments))
    except ValueError as exc:
        raise LockNameError(f"lock_key {lock_key!r} is not a valid format template: "
                            f"{exc}") from exc
    except (KeyError, IndexError, AttributeError) as exc:
        missing = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
        raise LockNameError(
            f"lock_key {lock_key!r} names {exc} which is not an argument of {task_name} "
            f"(arguments: {', '.join(arguments) or 'none'})", argument=missing) from exc


def lease_key(prefix: str, name: str) -> str:
    """Redis key of the lease hash of ``name``."""
    return f"{prefix}:lease:{{{name}}}"


def fence_key(prefix: str, name: str) -> str:
    """Redis key of the fencing counter of ``name`` (same hash slot as the lease)."""
    return f"{prefix}:fence:{{{name}}}"


def waiters_key(prefix: str, name: str) -> str:
    """Redis key of the sorted set of owners waiting for ``name`` (same hash slot)."""
    return f"{prefix}:waiters:{{{name}}}"


def wake_key(prefix: str, name: str) -> str:
    """Redis key of the list a release of ``name`` pushes one waiter's wake-up to."""
    return f"{prefix}:wake:{{{name}}}"


def name_from_key(key: str | bytes) -> str:
    """Inverse of :func:`lease_key`/:func:`fence_key`: the name between the braces."""
    if isinstance(key, bytes):
        key = key.decode()
    start, end = key.find("{"), key.rfind("}")
    if start < 0 or end < start:
        raise LockNameError(f"not a celery-steplock key: {key!r}")
    return key[start + 1:end]
