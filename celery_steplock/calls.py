"""Redis calls written once, run synchronously or under asyncio.

A pattern's operation that talks to Redis is written as a generator of *steps*: it yields
what it needs (:class:`Eval` a script, :class:`EvalMany` a pipelined batch, :class:`Command`
a plain command, :class:`Sleep` a pause) and receives each reply; its ``return`` value is
the operation's result. :func:`run` drives it with a redis-py client, :func:`arun` with a
``redis.asyncio`` one. So the sync and async forms of an operation share every argument,
key, script, bound, parse and policy decision; only the driver differs (the sans-I/O style
of h11 and hyper-h2). Errors are translated once, by the driver, with
:func:`celery_steplock.lock.store_error`, and thrown into the generator where the step was
yielded, so an outage policy written around a ``yield`` applies to both forms.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Generator, Iterable, TypeVar

from ._redis import aio, route, wire
from .lock import STORE_ERRORS, store_error

__all__ = ["Eval", "EvalMany", "Command", "Sleep", "Step", "Steps", "Flight", "run", "arun"]

T = TypeVar("T")


@dataclass(slots=True)
class Eval:
    """Run ``script`` once (``EVALSHA``, loading it on ``NOSCRIPT``); the reply is sent back.

    Attributes:
        script: The script.
        keys: Its KEYS; the first names the call in an error.
        args: Its ARGV.
        what: The call in an error's message (``"rate limit"``).
        name: The lock name, limit or dependency the call is about (in an error).
        owner: The owner token the call is about (in an error).
    """

    script: wire.Script
    keys: list[str]
    args: list[str]
    what: str
    name: str | None = None
    owner: str | None = None


@dataclass(slots=True)
class EvalMany:
    """Run ``script`` once per ``(keys, args)`` of ``calls`` in one pipelined round trip;
    the list of replies is sent back, a refused call's as its ``ResponseError`` (not
    raised). A failed round trip is thrown as the translated error."""

    script: wire.Script
    calls: list[wire.Call]
    what: str
    name: str | None = None


@dataclass(slots=True)
class Command:
    """One plain command (``args`` as redis-py's ``execute_command`` takes them, e.g.
    ``("BLPOP", key, 0.5)``); its reply is sent back."""

    args: tuple[Any, ...]
    what: str
    key: str | None = None
    name: str | None = None
    owner: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Sleep:
    """Pause ``seconds`` (``time.sleep`` in :func:`run`, ``asyncio.sleep`` in
    :func:`arun`: the event loop is never blocked); None is sent back."""

    seconds: float


Step = Eval | EvalMany | Command | Sleep
#: An operation written once: a generator of steps returning ``T``.
Steps = Generator[Step, Any, T]


class Flight:
    """The :class:`Eval` step :func:`arun` has in flight, for a cancelled caller's cleanup.

    Given to :func:`arun` (``flight=``), it makes each :class:`Eval` step's call a task of
    its own, shielded from the caller's cancellation: a script, once sent, runs to its end
    and its reply is kept. ``step`` and ``call`` (that task) are set from when the call is
    sent until its reply (or error) has been handed to the generator, None otherwise; so
    after a cancellation they name the script whose reply the caller never read, if any, and
    the caller's cleanup must await ``call`` (its reply, or the untranslated redis-py error
    it raises) to learn what the script did.
    """

    __slots__ = ("step", "call")

    def __init__(self) -> None:
        self.step: Eval | None = None
        self.call: asyncio.Future[Any] | None = None


def _error(step: Step, exc: BaseException) -> BaseException:
    if isinstance(step, Eval):
        return store_error(
            exc,
            step.what,
            key=step.keys[0] if step.keys else None,
            name=step.name,
            owner=step.owner,
        )
    if isinstance(step, Command):
        return store_error(exc, step.what, key=step.key, name=step.name, owner=step.owner)
    if isinstance(step, EvalMany):
        return store_error(exc, step.what, name=step.name)
    raise TypeError(f"not a step: {step!r}")  # pragma: no cover - a programming error


def run(steps: Steps[T], client: Any) -> T:
    """Drive ``steps`` with a synchronous redis-py client (``Redis`` or ``RedisCluster``).

    Returns:
        The value the generator returns.

    Raises:
        LockStoreUnavailable, LockStoreMisconfigured, LockError: A step's Redis call failed
            and the generator did not handle the error thrown into it.
    """
    send: Any = None
    error: BaseException | None = None
    while True:
        try:
            step = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        error = None
        send = None
        try:
            if isinstance(step, Eval):
                send = route.evalsha(client, step.script, step.keys, step.args)
            elif isinstance(step, Sleep):
                time.sleep(max(0.0, step.seconds))
            elif isinstance(step, EvalMany):
                send = route.evalsha_many(client, step.script, step.calls)
            else:
                send = client.execute_command(*step.args, **step.options)
        except STORE_ERRORS as exc:
            error = _error(step, exc)
            error.__cause__ = exc


async def arun(steps: Steps[T], client: Any, *, flight: Flight | None = None) -> T:
    """Drive ``steps`` with a ``redis.asyncio`` client; as :func:`run`, never blocking the
    event loop. On a cancellation (``asyncio.CancelledError``) the generator is closed, so
    its ``finally`` blocks run (they must not yield: a cleanup that needs Redis is the
    caller's, e.g. a shielded release), and the cancellation propagates; also when the
    step's Redis call completed before the cancellation was seen.

    Args:
        steps: The operation.
        client: A ``redis.asyncio`` ``Redis`` or ``RedisCluster``.
        flight: When given, each :class:`Eval` step runs shielded and is recorded there
            while its reply is unread (see :class:`Flight`): a cleanup after a cancellation
            learns what the script in flight did. Default None: a cancellation aborts the
            call (redis-py drops the connection; whether the script ran is unknown).

    Returns:
        The value the generator returns.

    Raises:
        LockStoreUnavailable, LockStoreMisconfigured, LockError: As :func:`run`.
    """
    send: Any = None
    error: BaseException | None = None
    # redis-py can swallow a cancellation (Python 3.11's asyncio.timeout converts a cancel
    # that lands while a zero timeout expires, in the connection check at a command's
    # start): the command then runs to its end. The task's pending cancel requests
    # (Task.cancelling, 3.11+) are checked after each step, so it is never lost.
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    pending = cancelling() if cancelling is not None else 0
    while True:
        try:
            step = steps.send(send) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        error = None
        send = None
        try:
            if isinstance(step, Eval):
                if flight is None:
                    send = await aio.evalsha(client, step.script, step.keys, step.args)
                else:
                    call = asyncio.ensure_future(
                        aio.evalsha(client, step.script, step.keys, step.args)
                    )
                    flight.step, flight.call = step, call
                    send = await asyncio.shield(call)
            elif isinstance(step, Sleep):
                await asyncio.sleep(max(0.0, step.seconds))
            elif isinstance(step, EvalMany):
                send = await aio.evalsha_many(client, step.script, step.calls)
            else:
                send = await client.execute_command(*step.args, **step.options)
            if cancelling is not None and cancelling() > pending:
                raise asyncio.CancelledError("cancelled during a Redis call that completed")
            if flight is not None:
                flight.step = flight.call = None  # the reply goes to the generator
        except STORE_ERRORS as exc:
            if cancelling is not None and cancelling() > pending:
                steps.close()
                raise asyncio.CancelledError("cancelled during a Redis call that failed") from exc
            if flight is not None:
                flight.step = flight.call = None
            error = _error(step, exc)
            error.__cause__ = exc
        except asyncio.CancelledError as exc:
            # the generator's finally (a release, a ZREM) runs without awaiting: it is closed
            steps.close()
            raise exc


def evals(script: wire.Script, calls: Iterable[wire.Call], what: str) -> EvalMany:
    """An :class:`EvalMany` of ``calls`` (materialised: a batch may be sent twice)."""
    return EvalMany(script, list(calls), what)
