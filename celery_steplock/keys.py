"""Lock names and Redis keys.

A lock name identifies the step a task execution mutates: by default a keyed hash of the
task's bound arguments, or a ``lock_key`` template or callable (:func:`lock_name` says how;
who sees names and what they reveal: docs/security.md, "Lock names and idempotency keys").
Redis keys wrap the name in braces, a Redis Cluster hash tag, so that the lease and its fencing
counter always live in the same slot: ``steplock:lease:{order:42}`` and
``steplock:fence:{order:42}``.
"""

from __future__ import annotations

import decimal
import functools
import hashlib
import hmac
import inspect
import json
import math
import re
import string
from typing import Any, Callable, Iterable, Mapping, Sequence

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
    "history_key",
    "name_from_key",
    "check_name",
    "glob_escape",
    "PROBE_NAME",
    "template_fields",
    "render_template",
    "KEY_ESCAPE",
    "idempotency_key",
    "MAX_NAME_LENGTH",
    "PUBLIC_NAME_KEY",
    "argument_names",
    "lease_keys",
    "released_channel",
    "breaker_key",
    "breaker_probes_key",
    "breaker_keys",
    "breaker_name_from_key",
    "SLOT_SUFFIX",
    "slot_name",
    "parse_slot_name",
    "slot_key",
    "concurrency_keys",
    "rate_limit_keys",
    "rate_ticket_binding",
    "idempotency_record_key",
    "idempotency_quota_key",
]

#: The HMAC key used when no name secret is configured: public, so such names can be
#: recomputed by anyone who can guess the arguments (``celery_steplock.W010`` says so).
PUBLIC_NAME_KEY = b"celery_steplock: no name secret configured"

MAX_NAME_LENGTH = 512

#: The lock name the lease store's permission probe runs on (``lock.PROBE_NAME``); reserved,
#: so that no lease can have it (:func:`check_name`).
PROBE_NAME = "steplock-acl-probe"

LockKey = str | Callable[..., str] | None


def bind_arguments(
    fun: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    """Bind a call's arguments to ``fun``'s signature, defaults applied.

    Names passed through ``**kwargs`` join the declared ones.

    Args:
        fun: The task's ``run``: for a ``bind=True`` task a bound method, so ``self`` is
            never part of the result.
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.

    Returns:
        Argument name -> value.

    Raises:
        LockNameError: The call does not match the signature.
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
    """The argument names a call of ``fun`` can bind.

    Args:
        fun: A callable.

    Returns:
        ``(names, takes_var_keyword)``: the names (``*args``/``**kwargs`` themselves
        excluded; ``self`` of a bound method too) and whether it takes ``**kwargs``; None
        when the signature cannot be read (some builtins).
    """
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
    """Encode arguments as canonical JSON.

    Args:
        arguments: Bound arguments.

    Returns:
        JSON with sorted keys, no spaces and kombu's type tags.

    Raises:
        LockNameError: Naming the first argument that cannot be encoded (a type JSON cannot
            encode, or nesting deeper than the interpreter's recursion limit allows).
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
    """Check a lock name.

    Args:
        name: A non-empty string of printable characters, without braces (they delimit
            the Redis Cluster hash tag), at most :data:`MAX_NAME_LENGTH` (512) long, other
            than :data:`PROBE_NAME`.

    Returns:
        ``name``.

    Raises:
        LockNameError: ``name`` cannot be a lock name (quoting at most ``conf.MAX_SHOWN``
            characters of it), or is the reserved :data:`PROBE_NAME`.
    """
    if (
        type(name) is str
        and 0 < len(name) <= MAX_NAME_LENGTH
        and name.isprintable()
        and "{" not in name
        and "}" not in name
        and name != PROBE_NAME
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
    if name == PROBE_NAME:
        raise LockNameError(
            f"the lock name {PROBE_NAME!r} is reserved: the lease store's permission probe "
            f"writes and deletes its keys"
        )
    return name


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob (``SCAN MATCH``, ``KEYS``).

    Redis's glob (``stringmatchlen`` in its ``util.c``) gives ``*``, ``?``, ``[``, ``]``
    and ``\\`` a meaning, and a backslash makes the next character literal; a prefix or name
    put into a pattern unescaped matches other keys (prefix ``app*`` matches
    ``appserver:sessions:42``).

    Args:
        text: A key prefix or name.

    Returns:
        ``text`` with a backslash before each of those five characters.
    """
    if not any(c in _GLOB_SPECIAL for c in text):
        return text
    return "".join(f"\\{c}" if c in _GLOB_SPECIAL else c for c in text)


_GLOB_SPECIAL = frozenset("*?[]\\")


@functools.lru_cache(maxsize=1024)
def template_fields(template: str) -> tuple[str, ...]:
    """The argument names a ``lock_key`` template formats.

    Args:
        template: A :meth:`str.format` template over argument names.

    Returns:
        The names in order, nested fields of format specs included.

    Raises:
        LockNameError: A template :meth:`str.format` cannot parse, a positional field
            (``{}``, ``{0}``) or attribute or index access (``{x.__class__}``, ``{x[0]}``):
            a name is made of the arguments' values only; a conversion (``{x!r}``); or an
            ambiguous template
            (:func:`render_template`: two fields with nothing between them, text between
            fields that starts with the escape ``\\``, a format spec other than a whole
            number's, or one that names an argument).
    """
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
        for _, field_name, format_spec, conversion in parsed:
            if field_name is None:
                continue
            if conversion is not None:
                raise LockNameError(
                    f"lock_key {shown(template)} uses {{{field_name}!{conversion}}}: a "
                    f"conversion is not allowed (!r writes 1 and '1' as two names of one "
                    f"value): name the argument plainly",
                    argument=field_name,
                )
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
    _template_parts(template)
    return tuple(found)


#: What escapes a character of a value in a templated name (:func:`render_template`).
KEY_ESCAPE = "\\"

# A format spec a templated name allows: a whole number's, without a fill character (a
# digit as fill would make 7 and 17 one text) or a precision (it cuts), at most 3 digits wide.
_SPEC = re.compile(r"[<>=^]?[-+ ]?#?0?(?:[1-9][0-9]{0,2})?[,_]?[bdoxX]?")

# Whole numbers longer than a name can be are refused before they are written out.
_MAX_BITS = MAX_NAME_LENGTH * 4


@functools.lru_cache(maxsize=1024)
def _template_parts(
    template: str,
) -> tuple[tuple[tuple[str, str | None, str | None, str], ...], frozenset[str]]:
    """``template`` as ``(literal, field, conversion, spec)`` parts and the characters its
    values escape; LockNameError for an ambiguous template (see :func:`render_template`)."""
    parts: list[tuple[str, str | None, str | None, str]] = []
    literal = ""
    for text, field_name, format_spec, conversion in string.Formatter().parse(template):
        literal += text
        if field_name is None:
            continue
        if format_spec and not _SPEC.fullmatch(format_spec):
            raise LockNameError(
                f"lock_key {shown(template)}: the format spec of {{{field_name}:"
                f"{shown(format_spec)[1:-1]}}} is not allowed: a templated name takes a whole "
                f"number's spec only ([align][sign][#][0][width][,_][b|d|o|x|X]), no fill "
                f"character, precision or argument in it (it could give two values one name)",
                argument=field_name,
            )
        parts.append((literal, field_name, conversion, format_spec or ""))
        literal = ""
    parts.append((literal, None, None, ""))
    fields = [part for part in parts if part[1] is not None]
    if len(fields) < 2:
        return tuple(parts), frozenset()
    separators = [part[0] for part in fields[1:]]
    for separator, part in zip(separators, fields[1:]):
        if not separator or separator.startswith(KEY_ESCAPE):
            raise LockNameError(
                f"lock_key {shown(template)} is ambiguous: the text before {{{part[1]}}} "
                + ("is empty" if not separator else f"starts with the escape {KEY_ESCAPE!r}")
                + " (two values could give one name): put a separator such as ':' between "
                "the fields",
                argument=part[1],
            )
    return tuple(parts), frozenset(KEY_ESCAPE + "".join(s[0] for s in separators))


def render_template(template: str, arguments: Mapping[str, Any], option: str = "lock_key") -> str:
    """``template`` (a :meth:`str.format` template over argument names) formatted with the
    bound ``arguments`` so that two different value tuples never give one name.

    The rules (docs/security.md, "Lock names and idempotency keys"):

    - Numbers are canonical: an int as its digits; a float or ``Decimal`` with a whole value
      as that int (``7``, ``7.0``, ``Decimal("7.00")``: ``"7"``). A number with a fraction,
      NaN or infinity, and a bool are refused: they have no canonical whole value.
    - A string is used as it is, so ``"7"`` and ``7`` give one name while ``"07"`` and
      ``7`` give two (normalise such values before the call); a string (or another value's
      text) with leading or trailing whitespace is refused. Other values (``UUID``,
      ``datetime``) give their :func:`format` text.
    - With two fields or more, each value's text escapes :data:`KEY_ESCAPE` and the first
      character of each text between two fields (``"{tenant}:{user}"``: ``:``) with a
      backslash, so ``("acme:bob", "x")`` gives ``acme\\:bob:x`` and ``("acme", "bob:x")``
      ``acme:bob\\:x``. A value without those characters is written as it is (the names
      of earlier releases); a template of one field never escapes.
    - A format spec applies to whole numbers only (``{n:04d}``), and a template whose
      fields touch or whose text between fields starts with the escape is refused.

    Args:
        template: The template (checked by :func:`template_fields`).
        arguments: The bound arguments.
        option: The option the template is given as, for messages.

    Returns:
        The name (checked by :func:`check_name`).

    Raises:
        LockNameError: Naming the argument (``argument``) whose value a name cannot hold
            (its ``__format__`` or ``__repr__`` raising included), a field that names no
            argument, or the template's problem (a conversion such as ``{x!r}`` included).
    """
    template_fields(template)
    parts, escapes = _template_parts(template)
    missing = [p[1] for p in parts if p[1] is not None and p[1] not in arguments]
    if missing:
        raise LockNameError(
            f"{option} {shown(template)} names {shown(missing[0])}, which is not an argument "
            f"of the call (arguments: {', '.join(arguments) or 'none'})",
            argument=missing[0],
        )
    out: list[str] = []
    for literal, field_name, conversion, spec in parts:
        out.append(literal)
        if field_name is not None:
            text = _field_text(
                template, option, field_name, arguments[field_name], conversion, spec
            )
            if escapes and any(c in escapes for c in text):
                text = "".join(KEY_ESCAPE + c if c in escapes else c for c in text)
            out.append(text)
    return check_name("".join(out))


def _field_text(
    template: str, option: str, name: str, value: Any, conversion: str | None, spec: str
) -> str:
    def refused(why: str) -> LockNameError:
        return LockNameError(f"{option} {shown(template)}: argument {name!r} {why}", argument=name)

    if isinstance(value, bool):
        raise refused(
            f"is a bool ({value}): a templated name takes whole numbers and strings "
            f"(pass 1/0 or a word)"
        )
    if isinstance(value, (float, decimal.Decimal)):
        if isinstance(value, float):
            whole = math.isfinite(value) and value.is_integer()
        else:
            whole = value.is_finite() and (value.is_zero() or value.adjusted() < MAX_NAME_LENGTH)
            whole = whole and value == value.to_integral_value()
        if not whole:
            raise refused(
                f"is {shown(value)}: a number in a templated name must have a whole value "
                f"(7.0 is written 7; round or format it before the call)"
            )
        value = int(value)
    elif isinstance(value, int):
        value = int(value)
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise refused(f"has {value.bit_length()} bits: longer than a name can be")
    if isinstance(value, str) and value != value.strip():
        raise refused(
            f"{shown(value)} has leading or trailing whitespace (it would name another "
            f"limit or lock than the value without it)"
        )
    if conversion is not None:  # template_fields refused it first; kept for direct callers
        raise refused(f"is written with the conversion !{conversion}: name it plainly")
    if spec and type(value) is not int:
        raise refused(
            f"is formatted with {{{name}:{spec}}}: a format spec applies to whole numbers "
            f"only (a padded string could name another value)"
        )
    # A value's own __format__ may raise anything: it is the caller's bad argument.
    try:
        text = format(value, spec)
    except RecursionError:
        raise refused("is nested too deep to be formatted") from None
    except Exception as exc:  # noqa: BLE001 - reported as the argument's error
        raise refused(f"cannot be formatted: {type(exc).__name__}: {shown(str(exc))}") from None
    if type(value) is not int and text != text.strip():
        raise refused("is written with leading or trailing whitespace")
    return text


def lock_name(
    task_name: str,
    fun: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    lock_key: LockKey = None,
    *,
    secret: bytes | str | None = None,
) -> str:
    """The lock name of one call ``fun(*args, **kwargs)`` of a task.

    By default the arguments are bound with :func:`inspect.signature` (defaults applied, so
    ``t(1)``, ``t(x=1)`` and ``t(1, y=<default>)`` name the same lock, and keyword order
    never matters; names passed through ``**kwargs`` join the declared ones), encoded as
    canonical JSON with kombu's encoder (the one Celery's JSON serializer uses, so ``UUID``,
    ``datetime``, ``date``, ``Decimal`` and ``bytes`` work; a ``Decimal`` keeps its written
    precision, so ``Decimal("1.1")`` and ``Decimal("1.10")`` name different locks), and
    hashed with HMAC-SHA256 keyed with the name secret (``steplock_name_secret``, see
    :attr:`celery_steplock.conf.Settings.name_secret`): whoever sees a name (the admin, the
    CLI, logs, ``LeaseEvent`` rows) cannot recover the arguments by trying candidates
    without that secret. Types are kept: ``1``, ``1.0``, ``True`` and ``"1"`` are four JSON
    values and give four default names; a template formats them with :func:`format`, so
    ``"1"`` and ``1`` give one name there, ``1.0`` and ``True`` others (``"1.0"``,
    ``"True"``).

    Args:
        task_name: The task's name.
        fun: The task's ``run``.
        args: The call's positional arguments.
        kwargs: The call's keyword arguments.
        lock_key: None: ``"<task_name>:<64 hex digits>"``, the HMAC-SHA256 keyed with
            ``secret`` of the task name and the canonical bound arguments. A str:
            ``lock_key.format(**bound_arguments)`` (``"order:{order_id}"``: plain names
            only, see :func:`template_fields`; the values appear in the name as they are).
            A callable: its return value, called with the bound arguments as keywords.
        secret: The name secret; None: :data:`PUBLIC_NAME_KEY`.

    Returns:
        The lock name (checked by :func:`check_name`).

    Raises:
        LockNameError: The call does not match the signature, an argument cannot be
            encoded, a placeholder names no argument, or the result is no lock name.
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
    """:func:`lock_name` for arguments already bound by :func:`bind_arguments`.

    Args:
        task_name: The task's name.
        arguments: The bound arguments.
        lock_key: As for :func:`lock_name`.
        secret: As for :func:`lock_name`.

    Returns:
        The lock name.

    Raises:
        LockNameError: As :func:`lock_name`.
    """
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
        return render_template(lock_key, arguments)
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
    """The idempotency key of a lease (:attr:`celery_steplock.lease.Lease.idempotency_key`).

    Args:
        secret: The name secret; None: :data:`PUBLIC_NAME_KEY`.
        task_name: The task's name.
        name: The lock name.

    Returns:
        64 hex digits, HMAC-SHA256 keyed with the name secret over the task and lock names,
        so a third party that receives it learns neither (a templated lock name carries raw
        argument values).
    """
    mac = _keyed(_key(secret), b"idempotency-key\0")
    mac.update(b"%s\0%s" % ((task_name or "").encode(), name.encode()))
    return str(mac.hexdigest())


def lease_key(prefix: str, name: str) -> str:
    """The Redis key of a lease hash.

    Args:
        prefix: The key prefix (``steplock_key_prefix``).
        name: The lock name.

    Returns:
        ``<prefix>:lease:{<name>}``.
    """
    return f"{prefix}:lease:{{{name}}}"


def fence_key(prefix: str, name: str) -> str:
    """The Redis key of a name's fencing counter (the lease's hash slot).

    Args:
        prefix: The key prefix.
        name: The lock name.

    Returns:
        ``<prefix>:fence:{<name>}``.
    """
    return f"{prefix}:fence:{{{name}}}"


def waiters_key(prefix: str, name: str) -> str:
    """The Redis key of the sorted set of owners waiting for a name (the lease's hash slot).

    Args:
        prefix: The key prefix.
        name: The lock name.

    Returns:
        ``<prefix>:waiters:{<name>}``.
    """
    return f"{prefix}:waiters:{{{name}}}"


def wake_key(prefix: str, name: str) -> str:
    """The Redis key of the list a release pushes one waiter's wake-up to.

    Args:
        prefix: The key prefix.
        name: The lock name.

    Returns:
        ``<prefix>:wake:{<name>}``.
    """
    return f"{prefix}:wake:{{{name}}}"


def history_key(prefix: str, name: str) -> str:
    """The Redis key of a name's history, a capped list (the lease's hash slot, so the
    lease scripts write it in the same call, Redis Cluster included;
    :mod:`celery_steplock.history`).

    Args:
        prefix: The key prefix (``steplock_key_prefix``).
        name: The lock name.

    Returns:
        ``<prefix>:history:{<name>}``.
    """
    return f"{prefix}:history:{{{name}}}"


def name_from_key(key: str | bytes) -> str:
    """Inverse of :func:`lease_key` and :func:`fence_key`.

    Args:
        key: A key of this module's layouts (str or bytes).

    Returns:
        The name between the braces.

    Raises:
        LockNameError: ``key`` has no braces: not a celery-steplock key.
    """
    if isinstance(key, bytes):
        key = key.decode()
    start, end = key.find("{"), key.rfind("}")
    if start < 0 or end < start:
        raise LockNameError(f"not a celery-steplock key: {key!r}")
    return key[start + 1 : end]


# -- every other Redis key layout, by owner -----------------------------------------------------
# The strings below are what running deployments hold: changing one orphans their state
# (tests/test_keys.py pins each). Every key of one name or limit carries one hash tag, so a
# script's keys share a Redis Cluster slot.


def lease_keys(prefix: str, names: Iterable[str]) -> list[str]:
    """The lease keys of many names at once (a renewal batch).

    Args:
        prefix: The key prefix (``steplock_key_prefix``).
        names: Lock names.

    Returns:
        ``[lease_key(prefix, name) for name in names]``, built without a call per name.
    """
    head = f"{prefix}:lease:{{"
    return [f"{head}{name}}}" for name in names]


def released_channel(prefix: str, name: str) -> str:
    """The pub/sub channel releases of ``name`` were announced on (nothing publishes on it
    any more; kept for :meth:`celery_steplock.lock.RedisLeaseStore.channel`).

    Args:
        prefix: The key prefix.
        name: The lock name.

    Returns:
        ``<prefix>:released:{<name>}``.
    """
    return f"{prefix}:released:{{{name}}}"


def breaker_key(prefix: str, name: str) -> str:
    """The hash of circuit breaker ``name``: ``state``, ``gen``, ``opened_ms``, ``ring``,
    ``successes``, ``forced`` (:mod:`celery_steplock._redis.scripts.breaker`). TTL: a week
    after its last write (``IDLE_TTL``); none while an operator forces it open.

    Args:
        prefix: The key prefix.
        name: The dependency's name.

    Returns:
        ``<prefix>:breaker:{<name>}``.
    """
    return f"{prefix}:breaker:{{{name}}}"


def breaker_probes_key(prefix: str, name: str) -> str:
    """The sorted set of breaker ``name``'s half-open probe permits (owner token -> expiry,
    Redis ms). TTL: the probe timeout, from the last permit given; deleted at every state
    change.

    Args:
        prefix: The key prefix.
        name: The dependency's name.

    Returns:
        ``<prefix>:breaker-probes:{<name>}`` (the hash tag of :func:`breaker_key`).
    """
    return f"{prefix}:breaker-probes:{{{name}}}"


def breaker_keys(prefix: str, name: str) -> list[str]:
    """The KEYS of every breaker script: ``[breaker_key, breaker_probes_key]``.

    Args:
        prefix: The key prefix.
        name: The dependency's name.

    Returns:
        The breaker's hash and its probe permits, one Cluster slot.
    """
    return [breaker_key(prefix, name), breaker_probes_key(prefix, name)]


def breaker_name_from_key(prefix: str, key: str) -> str | None:
    """Inverse of :func:`breaker_key` (for a SCAN of ``breaker_key(prefix, "*")``).

    Args:
        prefix: The key prefix.
        key: A Redis key.

    Returns:
        The breaker's name, or None when ``key`` is no breaker hash under ``prefix``.
    """
    head = f"{prefix}:breaker:{{"
    if key.startswith(head) and key.endswith("}"):
        return key[len(head) : -1]
    return None


#: What joins a concurrency limit's key and a slot's index in the slot's lease name.
SLOT_SUFFIX = "}#"


def slot_name(key: str, index: int) -> str:
    """The lease name of slot ``index`` (0-based) of the limit key ``key``: ``"key}#index"``."""
    return f"{key}{SLOT_SUFFIX}{index}"


def parse_slot_name(name: str) -> tuple[str, int] | None:
    """``(limit key, index)`` of a slot's lease name, or None when ``name`` is no slot."""
    if not isinstance(name, str) or SLOT_SUFFIX not in name:
        return None
    key, _, index = name.rpartition(SLOT_SUFFIX)
    if not key or not index.isdigit() or "{" in key or "}" in key:
        return None
    return key, int(index)


def slot_key(prefix: str, key: str, index: int) -> str:
    """The lease hash of slot ``index`` of concurrency limit ``key``: an ordinary lease (the
    fields of :mod:`celery_steplock._redis.scripts.lease`) with the slot's TTL, whose hash
    tag is the limit's key.

    Args:
        prefix: The key prefix.
        key: The limit key.
        index: The slot's index, 0-based.

    Returns:
        ``<prefix>:lease:{<key>}#<index>}``.
    """
    return lease_key(prefix, slot_name(key, index))


def concurrency_keys(prefix: str, key: str) -> tuple[str, str, str]:
    """The keys of concurrency limit ``key`` beside its slots (the hash tag of its slots).

    ``fence``: the slots' fencing counter (a string, Redis us); TTL two periods (the fencing
    counter period or the slot TTL, whichever is longer) from the last grant. ``queue``: the
    waiters (sorted set: ticket -> first-denied time, Redis ms) and ``alive``: their
    liveness (ticket -> expiry, Redis ms); TTL twice the waiter TTL from the last denial.

    Args:
        prefix: The key prefix.
        key: The limit key.

    Returns:
        ``(<prefix>:bulkhead:{<key>}:fence, ...:queue, ...:alive)``.
    """
    base = f"{prefix}:bulkhead:{{{key}}}"
    return f"{base}:fence", f"{base}:queue", f"{base}:alive"


def rate_limit_keys(prefix: str, kind: str, ident: str, name: str) -> tuple[str, str, str]:
    """The keys of rate limit ``name`` of one limiter (one hash tag: one Cluster slot).

    The state: a token bucket's hash (``tokens``, ``ts``; TTL until it is full again, plus
    1 s) or a sliding window's log (sorted set: grant id -> Redis ms; TTL the window plus
    1 s). The ticket queue (sorted set: ticket -> the Redis ms it was first given) and the
    tickets' deadlines (ticket -> Redis ms); TTL the longest wait given plus the ticket
    grace and 1 s.

    Args:
        prefix: The key prefix.
        kind: ``"tb"`` (token bucket) or ``"sw"`` (sliding window).
        ident: The limiter's parameters as text (``"<rate>:<capacity>"``,
            ``"<limit>:<window>"``), so two limits of one name never share state.
        name: The limit's name (the rendered limit key).

    Returns:
        ``(<prefix>:rate:<kind>:<ident>:{<name>}, ...:queue:{<name>}, ...:due:{<name>})``.
    """
    base = f"{prefix}:rate:{kind}:{ident}"
    return f"{base}:{{{name}}}", f"{base}:queue:{{{name}}}", f"{base}:due:{{{name}}}"


def rate_ticket_binding(
    secret: bytes | str | None,
    task_name: str,
    task_id: str | None,
    key: str,
    arguments: Mapping[str, Any],
) -> str:
    """What a rate-limit ticket a task's denial took is bound to: its queue member is
    ``"<ticket>.<binding>"``, so a ticket copied into another message (another task id,
    other arguments, another limit) names no member of the queue and is no ticket there.

    Args:
        secret: The name secret; None: :data:`PUBLIC_NAME_KEY`.
        task_name: The task's name.
        task_id: The message's task id (a re-queued task keeps its id).
        key: The limit's Redis key (:func:`rate_limit_keys`' first).
        arguments: The bound arguments; arguments canonical JSON cannot encode bind
            through the task id and the limit only.

    Returns:
        32 hex digits: HMAC-SHA256 keyed with the name secret (the queue, readable by Redis
        users, reveals nothing of the arguments), cut to 128 bits.
    """
    try:
        encoded = canonical_json(arguments)
    except LockNameError:
        encoded = ""
    mac = _keyed(_key(secret), b"rate-ticket\0")
    mac.update(
        b"\0".join(
            part.encode("utf-8", "surrogatepass")
            for part in (task_name or "", "" if task_id is None else str(task_id), key, encoded)
        )
    )
    return str(mac.hexdigest()[:32])


def idempotency_record_key(prefix: str, key: str) -> str:
    """The hash of idempotency record ``key`` (fields in
    :mod:`celery_steplock._redis.scripts.idempotency`; also the Redis cache copy of a
    database record). TTL: the lock TTL while locked, the record TTL once completed or failed.

    Args:
        prefix: The key prefix.
        key: The record key (:func:`celery_steplock.patterns.idempotency.record_key`).

    Returns:
        ``<prefix>:idem:{<key>}``.
    """
    return f"{prefix}:idem:{{{key}}}"


def idempotency_quota_key(prefix: str, principal: str) -> str:
    """The sorted set of the live idempotency records of one principal of the HTTP layer
    (members: record keys; scores: when each stops counting, Redis server time in ms). Its
    TTL ends with its last member.

    Args:
        prefix: The key prefix.
        principal: The keyed hash (hex) of the principal's host and scope, never the scope
            itself.

    Returns:
        ``<prefix>:idemq:{<principal>}``.
    """
    return f"{prefix}:idemq:{{{principal}}}"
