"""Effects that go out once: side effects declared by a step, written with its transition.

Inside the body of a step-locked task that has a ``step_model`` (or a ``guarded_step``
block), a side effect is *declared* instead of performed::

    from celery_steplock import effects

    @app.task(base=StepLockedTask, step_model="shop.Order", step_id_arg="order_id",
              transition=("paid", "shipped"))
    def ship(order_id):
        effects.publish("shop.notify", args=[order_id])            # a Celery task
        effects.http("https://carrier.example/labels", json={"order": order_id})
        effects.email(subject="Shipped", body="...", to=["a@example.com"])
        effects.call("shop.audit", order_id)                       # @effects.register("shop.audit")

Each call validates its arguments at once (:class:`~celery_steplock.exceptions.InvalidEffect`
naming the argument) and appends a :class:`Declared` to the *current outbox*, a context
variable that the task's execution sets around its body and its compare-and-swap (and a
guarded step around its block). Nothing is sent then. After the transaction's last
transition applied and before its ownership check and COMMIT, the declared effects are
written as rows of the outbox table (the step store's ``write_effects``; Django:
:mod:`celery_steplock.contrib.django.outbox`) in that same transaction: they exist if and
only if the fenced compare-and-swap commits. A refused compare-and-swap, a lost lease, an
exception or a rollback leaves no row. After COMMIT the store's ``dispatch_effects`` sends
them (and a periodic relay sends what a dead process left).

Each effect carries a deterministic key, :func:`effect_key`:
``"<step>:<fence>:<to>:<position>"`` (the step as the store spells it, the lease's fencing
token, the status the transaction's last transition wrote, the effect's 0-based position
in its outbox). Dispatch is at least once: the receiver dedupes on the key (the task id of
a published task, the ``Idempotency-Key`` header of an HTTP call or an email, the
``idempotency_key`` keyword of a registered callable).

Outside such a scope, declaring raises :class:`~celery_steplock.exceptions.EffectsUnavailable`.
This module imports no Django (the import-linter contract ``no-django-below-contrib``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar
from urllib.parse import urlsplit

from .exceptions import EffectsUnavailable, InvalidEffect
from .redact import redact

__all__ = [
    "Declared",
    "Outbox",
    "KINDS",
    "MAX_KEY_LENGTH",
    "MAX_TARGET_LENGTH",
    "publish",
    "http",
    "email",
    "call",
    "register",
    "registered",
    "effect_key",
    "current_outbox",
    "collecting",
    "write_declared",
]

#: The kinds of effect, as the outbox's ``kind`` column holds them.
KINDS = ("task", "http", "email", "call")
#: The longest key (characters): the outbox's ``key`` column.
MAX_KEY_LENGTH = 255
#: The longest target (characters): the outbox's ``target`` column.
MAX_TARGET_LENGTH = 1024
#: The HTTP methods :func:`http` accepts.
HTTP_METHODS = ("POST", "PUT", "PATCH", "DELETE", "GET")

_UNAVAILABLE = (
    "effects are declared inside a step-locked task body with a step_model, or a "
    "guarded_step block"
)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NAME = re.compile(r"\S+")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Declared:
    """One declared effect; ``kind``, ``target`` and ``payload`` are the outbox row's columns.

    Attributes:
        kind: ``"task"``, ``"http"``, ``"email"`` or ``"call"``.
        target: The task name, the URL, the recipients (``", "``-joined) or the registered
            callable's name.
        payload: The arguments, JSON-normalised (lists, string keys): ``task``:
            ``{"args", "kwargs", "options"}``; ``http``: ``{"method", "headers",
            "timeout"}`` plus ``"json"`` or ``"data"`` when given; ``email``: ``{"subject",
            "body", "to", "from_email", "headers"}``; ``call``: ``{"args", "kwargs"}``.
        position: Its index in its outbox (0-based): the key's last part.
    """

    kind: str
    target: str
    payload: dict[str, Any]
    position: int


@dataclass(eq=False)
class Outbox:
    """The effects declared in one step transaction, in declaration order.

    Attributes:
        declared: The :class:`Declared` effects (``position`` is the index here).
        sealed: Set once they were written: a later declaration raises
            EffectsUnavailable (it would never be written).
        unavailable: Why this scope cannot write effects (e.g. a step store without
            ``write_effects``), or None; a declaration then raises EffectsUnavailable
            with it.
        scope: The step store's ``effect_scope`` (optional), called at each declaration:
            it returns a callable telling, when the outbox is sealed, whether the work
            around the declaration still stands (False: it was made in an inner
            savepoint since rolled back), or None (it stands). Without it every
            declaration is written.
    """

    declared: list[Declared] = field(default_factory=list)
    sealed: bool = False
    unavailable: str | None = None
    scope: Callable[[], Callable[[], bool] | None] | None = None
    _standing: list[Callable[[], bool] | None] = field(default_factory=list, repr=False)
    _held: list[Callable[[], None]] | None = field(default=None, repr=False)

    def hold_dispatch(self) -> None:
        """Keep the on-commit sends until :meth:`release_dispatch`: the task (or guarded
        step) sends its effects after it released its lease, so a slow receiver never keeps
        the step's other deliveries waiting for a lease whose work is done."""
        self._held = []

    def dispatch_later(self, send: Callable[[], None]) -> None:
        """Run ``send`` (the on-commit send of the rows written) now, or keep it until
        :meth:`release_dispatch` while the dispatch is held."""
        if self._held is None:
            send()
        else:
            self._held.append(send)

    def release_dispatch(self) -> None:
        """Run the sends kept since :meth:`hold_dispatch` (the transaction committed and
        the lease was released), and stop holding: a send of a transaction that commits
        later (an eager call inside a caller's transaction) runs at its COMMIT."""
        held, self._held = self._held or [], None
        for send in held:
            send()

    def add(self, kind: str, target: str, payload: Mapping[str, Any]) -> Declared:
        """Append one effect (already validated by the declaring function).

        Args:
            kind: One of :data:`KINDS`.
            target: Its target, at most :data:`MAX_TARGET_LENGTH` characters.
            payload: Its JSON-serialisable arguments.

        Returns:
            The :class:`Declared`, its position the next index.

        Raises:
            EffectsUnavailable: The outbox is sealed or cannot write effects.
            InvalidEffect: An unknown kind, or a target that is empty or too long.
        """
        if self.unavailable is not None:
            raise EffectsUnavailable(f"{_UNAVAILABLE}: {self.unavailable}")
        if self.sealed:
            raise EffectsUnavailable(
                f"{_UNAVAILABLE}: this one's effects were already written (declare them in "
                f"the body, before its transaction commits)"
            )
        if kind not in KINDS:
            raise InvalidEffect(f"kind must be one of {', '.join(KINDS)}, not {kind!r}", "kind")
        if not isinstance(target, str) or not target or len(target) > MAX_TARGET_LENGTH:
            raise InvalidEffect(
                f"an effect's target is a non-empty string of at most {MAX_TARGET_LENGTH} "
                f"characters, not {_shown(target)}",
                "target",
            )
        declared = Declared(kind, target, dict(payload), len(self.declared))
        standing = self.scope() if self.scope is not None else None
        self.declared.append(declared)
        self._standing.append(standing)
        return declared

    def seal(self) -> list[Declared]:
        """The declared effects, the outbox closed to new ones (what the writer writes).

        A declaration made inside an inner savepoint (``transaction.atomic()`` within the
        step's transaction) that rolled back is left out, as the rest of that block's work:
        the others keep their order, their positions renumbered 0, 1, ... (the key's last
        part), so the keys do not depend on work that did not commit.
        """
        self.sealed = True
        kept = [
            declared
            for declared, standing in zip(self.declared, self._standing)
            if standing is None or standing()
        ]
        return [
            declared if declared.position == n else replace(declared, position=n)
            for n, declared in enumerate(kept)
        ]


_current: contextvars.ContextVar[Outbox | None] = contextvars.ContextVar(
    "steplock_outbox", default=None
)


def current_outbox() -> Outbox | None:
    """The outbox of the step transaction running in this context, or None."""
    return _current.get()


@contextlib.contextmanager
def collecting(outbox: Outbox | None) -> Iterator[Outbox | None]:
    """Make ``outbox`` the current outbox for the ``with`` block (None: no outbox, hiding
    an outer one, as a body without a step store does); the previous one comes back at
    its end."""
    token = _current.set(outbox)
    try:
        yield outbox
    finally:
        _current.reset(token)


def effect_key(step: str, fence_or_tag: int | str, to: str, position: int) -> str:
    """The deterministic key of one effect: ``"<step>:<fence>:<to>:<position>"``.

    Args:
        step: The step as the store's rows spell it (``"<label>:<pk>"``).
        fence_or_tag: The lease's fencing token; without a lease (a fail-open execution)
            ``"t<task id>"``.
        to: The status written by the transaction's last applied transition.
        position: The effect's index in its outbox (0-based).

    Returns:
        The key, at most :data:`MAX_KEY_LENGTH` characters.

    Raises:
        InvalidEffect: The key would be longer than :data:`MAX_KEY_LENGTH` (a very long
            step key or status), naming ``step``.
    """
    key = f"{step}:{fence_or_tag}:{to}:{position}"
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidEffect(
            f"the effect key {key[:80]!r}... is {len(key)} characters, more than "
            f"{MAX_KEY_LENGTH} (the step's key and status make it)",
            "step",
        )
    return key


def write_declared(
    outbox: Outbox,
    steps: Any,
    *,
    step_id: Any,
    to: str | None,
    fence: int | None,
    tag: str,
    owner: str,
    task_id: str | None,
    task_name: str,
    on_commit: Callable[[Callable[[], None]], None] | None = None,
) -> list[int]:
    """Write ``outbox``'s effects in the step's transaction (after its last transition,
    before the ownership check and COMMIT), and have the store dispatch them once it
    commits. The outbox is sealed. Nothing declared: nothing written, no statement.

    Args:
        outbox: The transaction's outbox.
        steps: The step store (its ``write_effects``, ``dispatch_effects``, ``on_commit``,
            ``step_ref``).
        step_id: The step of the last transition applied in the transaction.
        to: The status it wrote (None: no transition applied).
        fence: The lease's fencing token (None: no lease, a fail-open execution).
        tag: The key's fence part without a lease (``"t<task id>"``).
        owner: The owner token of the execution.
        task_id: The declaring task's id (None outside a task).
        task_name: The declaring task's name (or the guarded step's actor).
        on_commit: Registers the send to run once the transaction commits (default: the
            store's ``on_commit``; the task and the guarded step pass
            :func:`celery_steplock.tracing.after_commit`, which runs it before any callback
            the body registered, so a body's raising callback cannot skip it).

    Returns:
        The ids of the rows written (empty when nothing was declared).

    Raises:
        EffectsUnavailable: Effects were declared but no transition applied in the
            transaction, or the store has no ``write_effects``; the caller's transaction
            then rolls back.
        InvalidEffect: The key would be too long (:func:`effect_key`).
    """
    declared = outbox.seal()
    if not declared:
        return []
    if to is None:
        raise EffectsUnavailable(
            f"{len(declared)} effect(s) were declared but no transition applied in this "
            f"transaction: an effect belongs to a committed transition (its key names it); "
            f"set transition=(from_, to) on the task, or call self.transition(...) (a "
            f"guarded_step: step.transition(...)) before the body ends"
        )
    writer = getattr(steps, "write_effects", None)
    if writer is None:
        raise EffectsUnavailable(
            f"{_UNAVAILABLE}: the step store {type(steps).__name__} cannot write them (it has "
            f"no write_effects)"
        )
    step = steps.step_ref(step_id)
    fence_part: int | str = fence if fence is not None else tag
    effect_key(step, fence_part, to, len(declared) - 1)  # the longest one fits
    ids: list[int] = writer(
        declared,
        step=step,
        fence=fence,
        key_base=f"{step}:{fence_part}:{to}",
        owner=owner,
        task_id=task_id or "",
        task_name=task_name,
    )
    dispatch = getattr(steps, "dispatch_effects", None)
    if dispatch is not None and ids:
        (on_commit or steps.on_commit)(lambda: outbox.dispatch_later(lambda: dispatch(list(ids))))
    return ids


# -- declaring -------------------------------------------------------------------------------


def _outbox() -> Outbox:
    outbox = _current.get()
    if outbox is None:
        raise EffectsUnavailable(_UNAVAILABLE)
    return outbox


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _json(value: Any, argument: str) -> Any:
    """``value`` as it reads back from JSON (tuples become lists); InvalidEffect naming
    ``argument`` when it is not JSON (NaN and infinities included: PostgreSQL's jsonb
    refuses them)."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise InvalidEffect(
            f"{argument} must be JSON-serialisable (it is stored in the outbox): {exc}",
            argument,
        ) from exc


def _args(value: Any, argument: str = "args") -> list[Any]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidEffect(f"{argument} must be a list or tuple, not {_shown(value)}", argument)
    result: list[Any] = _json(list(value), argument)
    return result


def _kwargs(value: Any, argument: str = "kwargs") -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InvalidEffect(
            f"{argument} must be a dict with string keys, not {_shown(value)}", argument
        )
    result: dict[str, Any] = _json(dict(value), argument)
    return result


def _headers(value: Any, *, reserved: tuple[str, ...] = ()) -> dict[str, str]:
    headers = _kwargs(value, "headers")
    for name, text in headers.items():
        if not _HEADER_NAME.fullmatch(name) or not isinstance(text, str) or "\n" in text:
            raise InvalidEffect(
                f"headers: {name!r}: {_shown(text)} is not a header (a token name, a string "
                f"value on one line)",
                "headers",
            )
        if name.lower() in reserved:
            raise InvalidEffect(
                f"headers: {name!r} is set by the relay (the effect's key)", "headers"
            )
    return headers


def _name(value: Any, argument: str) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidEffect(
            f"{argument} must be a non-empty name without spaces, not {_shown(value)}", argument
        )
    return value


def _task_name(task: Any) -> tuple[str, list[Any], dict[str, Any], dict[str, Any]]:
    """The name of a task, a signature (with its own args, kwargs, options) or a name."""
    if isinstance(task, str):
        return _name(task, "task"), [], {}, {}
    if isinstance(task, dict) and "task" in task and "args" in task:  # a Celery Signature
        return (
            _name(task.get("task"), "task"),
            list(task.get("args") or ()),
            dict(task.get("kwargs") or {}),
            dict(task.get("options") or {}),
        )
    name = getattr(task, "name", None)
    if name is None:
        raise InvalidEffect(
            f"task must be a task, a signature or a task name, not {_shown(task)}", "task"
        )
    return _name(name, "task"), [], {}, {}


def publish(
    task: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, **options: Any
) -> Declared:
    """Declare the publication of a Celery task, sent after COMMIT with
    ``app.send_task(name, args, kwargs, task_id=<key>, **options)``: a duplicate dispatch
    publishes the same task id, which a step-locked task (and the result backend) dedupes.

    Args:
        task: A task, a signature (its own args, kwargs and options come first; those
            given here are added) or a task name.
        args: Positional arguments (JSON).
        kwargs: Keyword arguments (JSON, string keys).
        **options: ``apply_async`` options (JSON: ``countdown``, ``queue``, ``priority``,
            ...; not ``task_id``, which is the key, and not a datetime ``eta``).

    Returns:
        The :class:`Declared` effect.

    Raises:
        EffectsUnavailable: No step transaction is running in this context.
        InvalidEffect: An argument is not JSON, or ``task_id`` is given (naming it).
    """
    outbox = _outbox()
    name, sig_args, sig_kwargs, sig_options = _task_name(task)
    merged_options = {**sig_options, **options}
    if "task_id" in merged_options:
        raise InvalidEffect(
            "task_id is the effect's key (deterministic, so a duplicate dispatch is deduped): "
            "do not pass one",
            "task_id",
        )
    payload = {
        "args": _args([*sig_args, *_args(args)]),
        "kwargs": _kwargs({**sig_kwargs, **_kwargs(kwargs)}),
        "options": _kwargs(merged_options, "options"),
    }
    return outbox.add("task", name, payload)


def http(
    url: str,
    *,
    method: str = "POST",
    json: Any = None,
    data: str | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> Declared:
    """Declare an HTTP request, sent after COMMIT with the header ``Idempotency-Key: <key>``
    (a 2xx answer dispatches it; a timeout, a connection error, 408/409/425/429 and 5xx are
    retried; another 4xx is permanent).

    Args:
        url: An ``http://`` or ``https://`` URL.
        method: One of :data:`HTTP_METHODS` (any case; default ``"POST"``).
        json: A JSON body (sent as ``application/json``).
        data: A text body, instead of ``json``.
        headers: Extra headers (string values; not ``Idempotency-Key``).
        timeout: Seconds to wait for the answer (None: ``steplock_effect_http_timeout``).

    Returns:
        The :class:`Declared` effect.

    Raises:
        EffectsUnavailable: No step transaction is running in this context.
        InvalidEffect: A bad URL (also one with ``user:password@``: credentials go in
            ``headers``), method, body, header or timeout (naming it).
    """
    outbox = _outbox()
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidEffect(f"url must be an http(s) URL, not {redact(_shown(url))}", "url")
    if "@" in parts.netloc:
        # The target is stored, logged (masked) and listed on the admin page; urllib would
        # not send these credentials anyway (it connects to "user:pw@host" as a host name).
        raise InvalidEffect(
            f"url must not carry credentials (user:password@host), not {redact(_shown(url))}: "
            f"send them in a header (headers={{'Authorization': ...}}), whose values the "
            f"admin page masks",
            "url",
        )
    verb = method.upper() if isinstance(method, str) else method
    if verb not in HTTP_METHODS:
        raise InvalidEffect(
            f"method must be one of {', '.join(HTTP_METHODS)}, not {_shown(method)}", "method"
        )
    if json is not None and data is not None:
        raise InvalidEffect("give json or data, not both", "data")
    if data is not None and not isinstance(data, str):
        raise InvalidEffect(f"data must be a string, not {_shown(data)}", "data")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise InvalidEffect(f"timeout must be positive seconds, not {_shown(timeout)}", "timeout")
    payload: dict[str, Any] = {
        "method": verb,
        "headers": _headers(headers, reserved=("idempotency-key",)),
        "timeout": float(timeout) if timeout is not None else None,
    }
    if json is not None:
        payload["json"] = _json(json, "json")
    if data is not None:
        payload["data"] = data
    return outbox.add("http", url, payload)


def email(
    *,
    subject: str,
    body: str,
    to: Sequence[str],
    from_email: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Declared:
    """Declare an email, sent after COMMIT (Django: ``EmailMessage``) with the headers
    ``Idempotency-Key: <key>`` and a ``Message-ID`` made from the key (a receiver that
    dedupes on either sees one message).

    Args:
        subject: The subject (one line).
        body: The text body.
        to: The recipients (a list of addresses; one string is refused).
        from_email: The sender (None: the framework's default).
        headers: Extra headers (not ``Idempotency-Key`` or ``Message-ID``).

    Returns:
        The :class:`Declared` effect.

    Raises:
        EffectsUnavailable: No step transaction is running in this context.
        InvalidEffect: A bad subject, body, recipient list, sender or header (naming it).
    """
    outbox = _outbox()
    if not isinstance(subject, str) or "\n" in subject or "\r" in subject:
        raise InvalidEffect(f"subject must be one line of text, not {_shown(subject)}", "subject")
    if not isinstance(body, str):
        raise InvalidEffect(f"body must be a string, not {_shown(body)}", "body")
    if (
        isinstance(to, str)
        or not isinstance(to, Sequence)
        or not to
        or not all(isinstance(a, str) and "@" in a for a in to)
    ):
        raise InvalidEffect(
            f"to must be a non-empty list of addresses, not {_shown(to)}",
            "to",
        )
    if from_email is not None and not isinstance(from_email, str):
        raise InvalidEffect(f"from_email must be a string, not {_shown(from_email)}", "from_email")
    payload = {
        "subject": subject,
        "body": body,
        "to": list(to),
        "from_email": from_email,
        "headers": _headers(headers, reserved=("idempotency-key", "message-id")),
    }
    return outbox.add("email", ", ".join(to), payload)


# -- registered callables --------------------------------------------------------------------

_registry: dict[str, Callable[..., Any]] = {}


def register(name: str) -> Callable[[F], F]:
    """Register a callable under ``name`` for :func:`call`; a decorator. The relay calls it
    as ``func(*args, idempotency_key=<key>, **kwargs)``: it dedupes on the key. Register it
    at import time of a module every process that declares or relays it imports.

    Raises:
        InvalidEffect: ``name`` is empty, or already registered to another callable.
    """
    _name(name, "name")

    def decorate(func: F) -> F:
        known = _registry.get(name)
        if known is not None and known is not func:
            raise InvalidEffect(f"an effect callable is already registered as {name!r}", "name")
        _registry[name] = func
        return func

    return decorate


def registered(name: str) -> Callable[..., Any]:
    """The callable registered as ``name``. Raises InvalidEffect (naming ``name``) when
    none is."""
    func = _registry.get(name)
    if func is None:
        raise InvalidEffect(
            f"no effect callable is registered as {name!r} (@effects.register({name!r}) in a "
            f"module this process imports)",
            "name",
        )
    return func


def call(name: str, *args: Any, **kwargs: Any) -> Declared:
    """Declare a call of the callable registered as ``name`` (:func:`register`), made after
    COMMIT as ``func(*args, idempotency_key=<key>, **kwargs)``.

    Args:
        name: The registered name (checked now).
        *args: Positional arguments (JSON).
        **kwargs: Keyword arguments (JSON; not ``idempotency_key``).

    Returns:
        The :class:`Declared` effect.

    Raises:
        EffectsUnavailable: No step transaction is running in this context.
        InvalidEffect: ``name`` is not registered, an argument is not JSON, or
            ``idempotency_key`` is given.
    """
    outbox = _outbox()
    registered(_name(name, "name"))
    if "idempotency_key" in kwargs:
        raise InvalidEffect("idempotency_key is the effect's key: do not pass one", "kwargs")
    return outbox.add("call", name, {"args": _args(args), "kwargs": _kwargs(kwargs)})
