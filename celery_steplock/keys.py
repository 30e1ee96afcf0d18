"""Lock names and Redis keys.

A lock name identifies the step a task execution mutates. By default it is derived from the
task's signature: the call's arguments are bound with :func:`inspect.signature` (defaults
applied, so ``t(1)``, ``t(x=1)`` and ``t(1, y=<default>)`` name the same lock, and keyword order
never matters), encoded as canonical JSON with kombu's encoder (the one Celery's JSON serializer
uses, so ``UUID``, ``datetime``, ``date``, ``Decimal`` and ``bytes`` work; a ``Decimal``
keeps its written precision, so ``Decimal("1.1")`` and ``Decimal("1.10")`` name different
locks), and hashed with HMAC-SHA256 keyed with the name secret (``steplock_name_secret``, see
:attr:`celery_steplock.conf.Settings.name_secret`): whoever sees a name (the admin, the CLI,
logs, ``LeaseEvent`` rows) cannot recover the arguments by trying candidates without that
secret. Names passed through ``**kwargs`` join the declared ones. A ``lock_key`` task option
replaces that with a :meth:`str.format` template over the argument names
(``"order:{order_id}"``: plain names only, no attribute or index access; the values appear
in the name as they are) or a callable receiving the bound arguments as keywords.

Types are kept: ``1``, ``1.0``, ``True`` and ``"1"`` are four JSON values and give four
default names; a template formats them with :func:`format`, so ``"1"`` and ``1`` give one
name there, ``1.0`` and ``True`` others (``"1.0"``, ``"True"``).

Redis keys wrap the name in braces, a Redis Cluster hash tag, so that the lease and its fencing
counter always live in the same slot: ``steplock:lease:{order:42}`` and
``steplock:fence:{order:42}``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import inspect
import json
import string
from typing import Any, Callable, Mapping, Sequence

from kombu.utils.json import JSONEncoder

from ._checks import shown
from .exceptions import LockNameError

__all__ = [
    "bind_arguments",
    "canonical_json",
    "lock_name",
    "name_from_arguments",
    "lease_key",
    "fence_key",
    "waiters_key",
    "wake_key",
    "name_from_key",
    "check_name",
    "template_fields",
    "idempotency_key",
    "MAX_NAME_LENGTH",
    "PUBLIC_NAME_KEY",
    "argument_names",
]

#: The HMAC key used when no name secret is configured: public, so such names can be
#: recomputed by anyone who can guess the arguments (``celery_steplock.W010`` says so).
PUBLIC_NAME_KEY = b"celery_steplock: no name secret configured"

MAX_NAME_LENGTH = 512

LockKey = str | Callable[..., str] | None


def bind_arguments(
    fun: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind ``args``/``kwargs`` to ``fun``'s signature with defaults applied.

    ``fun`` is the task's ``run``: for a ``bind=True`` task that is a bound method, so
    ``self`` is never part of the result. Raises :class:`LockNameError` when the call does
    not match the signature.
    """
    try:
        signature = _signature(fun)
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        # ``from None``: the TypeError quotes the caller's keyword names, however long.
        raise LockNameError(f"cannot bind the task's arguments to its signature: {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            # ``**kwargs`` names join the declared ones, so templates and step_id_arg reach
            # them (they cannot collide: Python refuses a keyword that names a parameter).
            arguments.update(arguments.pop(parameter.name, {}))
    return arguments


def argument_names(fun: Callable[..., Any]) -> tuple[frozenset[str], bool] | None:
    """``(names, takes_var_keyword)`` of ``fun``'s signature: the names a call can bind
    (``*args``/``**kwargs`` themselves excluded; ``self`` of a bound method too) and whether
    it takes ``**kwargs``. None when the signature cannot be read (some builtins)."""
    try:
        signature = _signature(fun)
    except (TypeError, ValueError):
        return None
    parameters = signature.parameters.values()
    names = frozenset(
        p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


_signatures: dict[tuple[Any, bool], inspect.Signature] = {}


def _signature(fun: Callable[..., Any]) -> inspect.Signature:
    """``inspect.signature(fun)``, computed once per function (a task's ``run`` is a new
    bound method at every access, so the cache is keyed on the function)."""
    func = getattr(fun, "__func__", None)
    key = (
        (func, True)
        if func is not None and getattr(fun, "__self__", None) is not None
        else (fun, False)
    )
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

    Raises :class:`LockNameError` naming the first argument that cannot be encoded (a type
    JSON cannot encode, or nesting deeper than the interpreter's recursion limit allows).
    """
    try:
        return json.dumps(arguments, cls=JSONEncoder, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        for name in sorted(arguments):
            try:
                json.dumps(arguments[name], cls=JSONEncoder, sort_keys=True)
            except RecursionError:
                raise LockNameError(
                    f"argument {shown(name)} is nested too deep to be part of a lock name "
                    f"(use lock_key to name the lock explicitly)",
                    argument=name,
                ) from None
            except (TypeError, ValueError) as inner:
                raise LockNameError(
                    f"argument {shown(name)} cannot be part of a lock name: {inner} "
                    f"(use lock_key to name the lock explicitly)",
                    argument=name,
                ) from None
        raise LockNameError(f"arguments cannot be part of a lock name: {exc}") from None


def check_name(name: Any) -> str:
    """Return ``name`` if it can be used as a lock name, else raise :class:`LockNameError`:
    a non-empty string of printable characters, without braces, at most 512 long. The
    error quotes at most ``conf.MAX_SHOWN`` characters of ``name``."""
    if (
        type(name) is str
        and 0 < len(name) <= MAX_NAME_LENGTH
        and name.isprintable()
        and "{" not in name
        and "}" not in name
    ):
        return name
    if not isinstance(name, str) or not name:
        raise LockNameError(f"a lock name must be a non-empty string, got {shown(name)}")
    if len(name) > MAX_NAME_LENGTH:
        raise LockNameError(
            f"a lock name is at most {MAX_NAME_LENGTH} characters, got {len(name)}: {shown(name)}"
        )
    if not name.isprintable():
        raise LockNameError(
            f"a lock name must be printable (no newlines or control characters): {shown(name)}"
        )
    if "{" in name or "}" in name:
        raise LockNameError(
            f"a lock name cannot contain braces (they delimit the Redis Cluster hash tag): "
            f"{shown(name)}"
        )
    return name


@functools.lru_cache(maxsize=1024)
def template_fields(template: str) -> tuple[str, ...]:
    """The argument names a ``lock_key`` template formats, in order (nested fields of format
    specs included). Raises :class:`LockNameError` for a template :meth:`str.format` cannot
    parse, a positional field (``{}``, ``{0}``) and attribute or index access
    (``{x.__class__}``, ``{x[0]}``): a name is made of the arguments' values only."""
    found: list[str] = []
    pending = [template]
    while pending:
        text = pending.pop()
        try:
            parsed = list(string.Formatter().parse(text))
        except ValueError as exc:
            raise LockNameError(
                f"lock_key {shown(template)} is not a valid format template: {exc}"
            ) from None
        for _, field_name, format_spec, _ in parsed:
            if field_name is None:
                continue
            if not field_name or field_name.isdigit():
                raise LockNameError(
                    f"lock_key {shown(template)} has a positional field "
                    f"({{{field_name}}}): name an argument"
                )
            if not field_name.isidentifier():
                raise LockNameError(
                    f"lock_key {shown(template)} uses {shown(field_name)}: only plain argument "
                    f"names are allowed, no attribute or index access (a lock name is made of "
                    f"the arguments' values)",
                    argument=field_name,
                )
            found.append(field_name)
            if format_spec and "{" in format_spec:
                pending.append(format_spec)
    return tuple(found)


def lock_name(
    task_name: str,
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    lock_key: LockKey = None,
    *,
    secret: bytes | str | None = None,
) -> str:
    """Return the lock name of one call ``fun(*args, **kwargs)`` of task ``task_name``.

    ``lock_key`` None: ``"<task_name>:<64 hex digits>"``, the HMAC-SHA256 keyed with
    ``secret`` (the name secret; None: :data:`PUBLIC_NAME_KEY`) of the task name and the
    canonical bound arguments. ``lock_key`` str: ``lock_key.format(**bound_arguments)`` (see
    :func:`template_fields`); a placeholder that names no argument raises
    :class:`LockNameError`. ``lock_key`` callable: its return value, called with the bound
    arguments as keywords.
    """
    return name_from_arguments(
        task_name, bind_arguments(fun, args, kwargs), lock_key, secret=secret
    )


def _key(secret: bytes | str | None) -> bytes:
    if secret is None:
        return PUBLIC_NAME_KEY
    return secret.encode() if isinstance(secret, str) else secret


_prepared: dict[tuple[bytes, bytes], Any] = {}


def _keyed(key: bytes, domain: bytes) -> Any:
    """A fresh HMAC-SHA256 of ``key`` that has read ``domain``: a copy of one prepared per
    key (copying skips the key schedule: about half the cost of ``hmac.new``)."""
    prepared = _prepared.get((key, domain))
    if prepared is None:
        prepared = hmac.new(key, domain, hashlib.sha256)
        if len(_prepared) < 64:
            _prepared[(key, domain)] = prepared
    return prepared.copy()


def name_from_arguments(
    task_name: str,
    arguments: Mapping[str, Any],
    lock_key: LockKey = None,
    *,
    secret: bytes | str | None = None,
) -> str:
    """:func:`lock_name` for arguments already bound by :func:`bind_arguments`."""
    if lock_key is None:
        mac = _keyed(_key(secret), b"lock-name\0")
        mac.update(b"%s\0%s" % (task_name.encode(), canonical_json(arguments).encode()))
        return check_name(f"{task_name}:{mac.hexdigest()}")
    if callable(lock_key):
        return check_name(lock_key(**arguments))
    if not isinstance(lock_key, str):
        raise LockNameError(
            f"lock_key must be a str.format template or a callable, got {shown(lock_key)}"
        )
    template_fields(lock_key)
    try:
        return check_name(lock_key.format(**arguments))
    except ValueError as exc:
        raise LockNameError(
            f"lock_key {shown(lock_key)} cannot format these arguments: {exc}"
        ) from None
    except RecursionError:
        raise LockNameError(
            f"lock_key {shown(lock_key)}: an argument is nested too deep to be formatted"
        ) from None
    except (KeyError, IndexError, AttributeError) as exc:
        missing = exc.args[0] if isinstance(exc, KeyError) and exc.args else None
        raise LockNameError(
            f"lock_key {shown(lock_key)} names {shown(missing)} which is not an argument of "
            f"{task_name} (arguments: {shown(', '.join(arguments) or 'none')})",
            argument=missing,
        ) from None


def idempotency_key(secret: bytes | str | None, task_name: str | None, name: str) -> str:
    """The idempotency key of lease ``name`` of task ``task_name`` (see
    :attr:`celery_steplock.lease.Lease.idempotency_key`): 64 hex digits, HMAC-SHA256 keyed with
    the name secret over the task and lock names, so a third party that receives it learns
    neither (a templated lock name carries raw argument values)."""
    mac = _keyed(_key(secret), b"idempotency-key\0")
    mac.update(b"%s\0%s" % ((task_name or "").encode(), name.encode()))
    return str(mac.hexdigest())


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
    return key[start + 1 : end]
