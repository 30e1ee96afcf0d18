"""Cluster-wide rate limits: a token bucket and a sliding window shared by every worker.

Each decision is one atomic Lua script on the lock store's Redis, with the time read from
Redis ``TIME`` (never a worker's clock), so every worker of every host sees one limit.

:class:`TokenBucket`
    ``capacity`` tokens, refilled continuously (fractionally) at ``rate`` tokens per second;
    an admission takes one. Over any interval of ``t`` seconds at most
    ``capacity + rate * t`` admissions are granted.
:class:`SlidingWindow`
    at most ``limit`` admissions in any window of ``window`` seconds: an exact log of the
    grants' times (a sorted set), so the bound holds for *every* window, not only for
    windows aligned to a clock. A denied request records nothing in the log.

Fairness: a denied request may take a *ticket*, a place in a first-come queue kept next to
the limit. While tickets are queued, quota that frees goes to the ticket holders in queue
order: a newcomer is admitted only when more quota is free than there are tickets ahead of
it. A task re-queued by a denial carries its ticket in a message header
(``steplock_rate_tickets``) and comes back when its turn is due (``retry_after``), so an
early waiter runs before later newcomers. Tickets are not quota (a denied request never
consumes any): the admission is still decided, at the holder's real arrival, against the
limit itself, so a late holder can never push the count over it. A ticket whose holder does
not come back by its deadline (its expected turn plus ``ticket_grace``) is dropped; no
ticket is given when the turn would be more than ``max_wait`` seconds away (a flood cannot
queue forever), and that request is denied without a place in the queue.

Task options (see :mod:`celery_steplock.patterns.gates`): ``cluster_rate_limit`` (``"10/s"``,
``"100/m"``, ``"1000/h"``, ``"5/10s"``: a sliding window of that limit per period; or a
:class:`TokenBucket` / :class:`SlidingWindow`; or a list of them, all of which must admit)
and ``cluster_rate_limit_key`` (a template over the task's arguments, like ``lock_key``, or
a callable of them; default: the task's name, one limit per task).

Async: the same limiter objects serve asyncio code on the same Redis state (a sync Celery
task and an async view share one limit): ``await limiter.atry_acquire(key)``, ``async with
limiter.acquire(key)`` (or ``await limiter.acquire(key)``) and ``@limiter.using(...)`` on an
``async def``. Each Redis operation is written once as :mod:`celery_steplock.calls` steps,
driven by a redis-py client (sync) or its ``redis.asyncio`` twin
(:func:`celery_steplock.clients.async_client_for`).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

from .. import calls, signals
from .._checks import CLOCK_SKEW_TOLERANCE, shown
from .._redis import wire
from .._redis.scripts.ratelimit import (
    BUCKET_REFUND,
    SLIDING_WINDOW,
    TOKEN_BUCKET,
    WINDOW_REFUND,
)
from ..clients import async_client_for
from ..events import emit, log_event
from ..exceptions import (
    ImproperlyConfigured,
    InvalidArgument,
    LockError,
    LockNameError,
    LockStoreUnavailable,
    RateLimited,
)
from ..keys import (
    argument_names,
    bind_arguments,
    check_name,
    rate_limit_keys,
    rate_ticket_binding,
    template_fields,
)
from ._base import (
    Target,
    check_on_store_error,
    clock_skew,
    outage,
    resolve_policy,
    target,
)

__all__ = [
    "TokenBucket",
    "SlidingWindow",
    "RateDecision",
    "Admission",
    "Decision",
    "parse_rate",
    "OPTIONS",
    "gate",
    "RateLimitGate",
    "TICKETS_HEADER",
    "TICKET",
    "MAX_LIMIT",
    "MAX_WINDOW",
]

#: The task options this gate reads.
OPTIONS = frozenset({"cluster_rate_limit", "cluster_rate_limit_key"})

#: The message header a re-queued task carries its tickets in: ``{redis key: ticket}``.
#: A value that is not such a dict, or a ticket that is not :data:`TICKET`, is no ticket
#: (logged ``event=rate_limit_ticket_refused``), never an error of the task.
TICKETS_HEADER = "steplock_rate_tickets"

#: A ticket as given: 32 lowercase hex digits (its queue member adds the binding,
#: :func:`celery_steplock.keys.rate_ticket_binding`).
TICKET = re.compile(r"[0-9a-f]{32}")

#: Largest sliding-window limit (its log holds one entry per grant in the window).
MAX_LIMIT = 100_000
#: Largest window or ``max_wait``, seconds: one week.
MAX_WINDOW = 7 * 24 * 3600.0
#: Largest token-bucket capacity and rate (tokens, tokens per second).
MAX_CAPACITY = 1_000_000_000
MAX_RATE = 1_000_000.0
#: Smallest rate, tokens per second (one a week).
MIN_RATE = 1 / MAX_WINDOW

_PERIODS = {
    "s": 1.0,
    "sec": 1.0,
    "second": 1.0,
    "m": 60.0,
    "min": 60.0,
    "minute": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
}
_RATE = re.compile(
    r"\s*(?P<count>[0-9]+(?:\.[0-9]+)?)\s*/\s*(?P<every>[0-9]+(?:\.[0-9]+)?)?"
    r"\s*(?P<unit>[a-z]+?)s?\s*",
    re.IGNORECASE,
)

# -- values --------------------------------------------------------------------------------------


def parse_rate(value: Any, option: str = "cluster_rate_limit") -> tuple[float, float]:
    """``"N/period"`` -> ``(N, period seconds)``. A period is ``s``, ``m``, ``h`` or ``d``
    (also ``sec``, ``min``, ``hour``, ``day``, plural or not) with an optional multiple
    before it: ``"10/s"``, ``"100/m"``, ``"1000/h"``, ``"5/10s"`` (5 per 10 seconds).
    ``N`` and the multiple are > 0 (``N`` may be fractional for a token bucket's rate).
    Raises :class:`ImproperlyConfigured` naming ``option`` for anything else (``"10/x"``,
    ``"0/s"``, ``"-1/s"``, ``"ten/s"``, a number without a period)."""
    if not isinstance(value, str):
        raise ImproperlyConfigured(
            f'{option} must be a rate string "N/s|m|h|d" (e.g. '
            f'"10/s", "5/10s"), got {shown(value)}',
            setting=option,
        )
    match = _RATE.fullmatch(value)
    unit = match and match.group("unit").lower()
    if match is None or unit not in _PERIODS:
        raise ImproperlyConfigured(
            f'{option}={shown(value)} is not a rate: use "N/period" with a period of '
            f's, m, h or d, optionally with a multiple ("10/s", "100/m", "5/10s")',
            setting=option,
        )
    count = float(match.group("count"))
    every = float(match.group("every") or 1)
    if count <= 0 or every <= 0:
        raise ImproperlyConfigured(
            f"{option}={shown(value)}: the count and the period must be greater than zero",
            setting=option,
        )
    period = every * _PERIODS[unit]
    if period > MAX_WINDOW:
        raise ImproperlyConfigured(
            f"{option}={shown(value)}: the period is at most {MAX_WINDOW:.0f} s (a week)",
            setting=option,
        )
    return count, period


def _number(
    value: Any, option: str, what: str, low: float, high: float, integer: bool = False
) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (integer and value != int(value))
    ):
        kind = "an integer" if integer else "a number"
        raise ImproperlyConfigured(
            f"{option}: {what} must be {kind}, got {shown(value)}", setting=option
        )
    if not low <= value <= high:
        raise ImproperlyConfigured(
            f"{option}: {what} must be within [{low:g}, {high:g}], got {shown(value)}",
            setting=option,
        )
    return int(value) if integer else float(value)


def check_ticket(ticket: Any) -> str | None:
    """``ticket`` if it is None or a ticket (:data:`TICKET`), else :class:`InvalidArgument`
    naming ``ticket``."""
    if ticket is None or (type(ticket) is str and TICKET.fullmatch(ticket)):
        return ticket
    raise InvalidArgument(
        f"ticket must be None or the 32 hex digits of an earlier RateDecision.ticket, "
        f"got {shown(ticket)}",
        argument="ticket",
    )


def held_tickets(raw: Any, keys: Sequence[str], **task: Any) -> dict[str, str]:
    """The tickets of the header value ``raw`` (:data:`TICKETS_HEADER`) for the limits of
    Redis ``keys``: a dict of ``{key: ticket}``. Anything else (another type, a ticket that
    is not :data:`TICKET`) is no ticket and logged as ``event=rate_limit_ticket_refused``
    with ``task`` (its ``task_id``, ``task_name``), the type and the size, never the value;
    entries for other keys are dropped (a denial carries on only this task's tickets)."""
    if not raw:
        return {}
    if not isinstance(raw, dict):
        _refused(None, f"the header is a {type(raw).__name__}, not a dict", raw, **task)
        return {}
    held: dict[str, str] = {}
    for key in keys:
        value = raw.get(key)
        if value is None:
            continue
        if type(value) is str and TICKET.fullmatch(value):
            held[key] = value
        else:
            _refused(
                key, f"the ticket is a {type(value).__name__}, not 32 hex digits", value, **task
            )
    return held


def _refused(key: str | None, reason: str, value: Any, **task: Any) -> None:
    try:
        size = len(value)
    except TypeError:
        size = None
    log_event(
        "rate_limit_ticket_refused",
        logging.WARNING,
        key=key,
        **task,
        reason=f"{TICKETS_HEADER}: {reason}" + (f" (length {size})" if size is not None else ""),
    )


def _key_template(value: Any, option: str) -> Any:
    if value is None or callable(value):
        return value
    if not isinstance(value, str):
        raise ImproperlyConfigured(
            f"{option}: the key must be a str.format template or a callable, got {shown(value)}",
            setting=option,
        )
    try:
        template_fields(value)
    except LockNameError as exc:
        raise ImproperlyConfigured(f"{option}: {exc}", setting=option) from None
    return value


@dataclass(frozen=True)
class RateDecision:
    """One rate-limit decision. ``allowed`` (bool); ``retry_after`` (seconds, 0.0 when
    allowed): the time until this request's quota is due (the bucket's next token, the
    window's next free moment, behind the queued tickets); ``key`` the Redis key decided
    on; ``limit`` the limit's description (``"10/1s window"``); ``ticket`` the place in the
    queue this denial holds (None: none given); ``remaining`` tokens or grants left after an
    admission; ``now`` the Redis time of the decision (seconds since the epoch); ``queued``
    the number of tickets ahead of this request when it was denied; ``skew`` the seconds a
    stored time of the limit (``skew_field``: ``ts``, ``log``, ``tickets``) was ahead of Redis
    ``TIME`` and clamped to now by this decision (0.0: none; see ``clock_skew``)."""

    allowed: bool
    retry_after: float
    key: str
    limit: str
    ticket: str | None = None
    remaining: float | None = None
    now: float = 0.0
    queued: int = 0
    member: str | None = None
    skew: float = 0.0
    skew_field: str = ""

    def __bool__(self) -> bool:
        return self.allowed


#: The former name of :class:`RateDecision`, kept for one release.
Decision = RateDecision


class _Limiter:
    kind = ""
    _script: wire.Script
    _refund: wire.Script

    def __init__(
        self,
        key: Any,
        on_store_error: str | None,
        max_wait: float | None,
        ticket_grace: float,
        app: Any,
        client: Any,
        prefix: str | None,
        option: str,
    ):
        self.key = _key_template(key, option)
        self.on_store_error = check_on_store_error(
            on_store_error, f"{option} on_store_error", setting=option
        )
        self.ticket_grace = _number(ticket_grace, option, "ticket_grace", 0.0, MAX_WINDOW)
        self.max_wait = (
            None if max_wait is None else _number(max_wait, option, "max_wait", 0.0, MAX_WINDOW)
        )
        self.app = app
        self.client = client
        self.prefix = prefix
        self.option = option

    # -- what subclasses give ---------------------------------------------------------------
    def _args(self) -> list[str]:
        raise NotImplementedError

    def _default_max_wait(self) -> float:
        raise NotImplementedError

    def _refund_args(self, decision: RateDecision) -> list[str]:
        raise NotImplementedError

    def redis_key(self, prefix: str, name: str) -> tuple[str, str, str]:
        """The Redis keys of limit ``name`` under ``prefix``: the state, the ticket queue and
        the tickets' deadlines (one hash tag: one Cluster slot)."""
        return rate_limit_keys(prefix, self.kind, self._ident(), name)

    def _ident(self) -> str:
        raise NotImplementedError

    # -- deciding ---------------------------------------------------------------------------
    def _target(self, app: Any = None, client: Any = None, prefix: str | None = None) -> Target:
        return target(
            app if app is not None else self.app,
            client=client if client is not None else self.client,
            prefix=prefix if prefix is not None else self.prefix,
        )

    def decide(
        self,
        name: str,
        *,
        client: Any,
        prefix: str,
        ticket: str | None = None,
        reserve: bool = False,
        binding: str | None = None,
    ) -> RateDecision:
        """One atomic decision for limit ``name`` (a lock-name-like string) on ``client``
        under ``prefix``. ``ticket`` the place in the queue held from an earlier denial
        (:data:`TICKET` 32 hex digits, else :class:`InvalidArgument`); ``reserve`` True to
        take one when denied; ``binding`` what the ticket is bound to
        (:func:`celery_steplock.keys.rate_ticket_binding`; None: unbound, the plain API):
        the queue member is ``"<ticket>.<binding>"``, so the script finds a ticket only
        when presented with the binding it was given with. Raises
        :class:`LockStoreUnavailable` (or LockStoreMisconfigured) when Redis does not answer
        or refuses. The async form is :meth:`adecide` (the same steps)."""
        return calls.run(self._decide_steps(name, prefix, ticket, reserve, binding), client)

    async def adecide(
        self,
        name: str,
        *,
        client: Any,
        prefix: str,
        ticket: str | None = None,
        reserve: bool = False,
        binding: str | None = None,
    ) -> RateDecision:
        """:meth:`decide` on a ``redis.asyncio`` client (a synchronous one is replaced by
        its asyncio twin, :func:`celery_steplock.clients.async_client_for`)."""
        return await calls.arun(
            self._decide_steps(name, prefix, ticket, reserve, binding),
            async_client_for(client),
        )

    def _decide_steps(
        self,
        name: str,
        prefix: str,
        ticket: str | None,
        reserve: bool,
        binding: str | None,
    ) -> calls.Steps[RateDecision]:
        """The decision, written once (:mod:`celery_steplock.calls`): one script call."""
        name = check_name(name)
        ticket = check_ticket(ticket)
        keys = list(self.redis_key(prefix, name))
        bound = f".{binding}" if binding else ""
        member = uuid.uuid4().hex + bound
        max_wait = self.max_wait if self.max_wait is not None else self._default_max_wait()
        args = [
            *self._args(),
            ticket + bound if ticket else "",
            member,
            "1" if reserve else "0",
            repr(max_wait * 1000.0),
            repr(self.ticket_grace * 1000.0),
            repr(CLOCK_SKEW_TOLERANCE * 1000.0),
        ]
        reply = yield calls.Eval(self._script, keys, args, "rate limit", name=name)
        return self._decision(reply, keys[0], member)

    def _decision(self, reply: Sequence[Any], key: str, member: str) -> RateDecision:
        """The :class:`RateDecision` of a decision script's ``reply`` (the contract of
        :data:`~celery_steplock._redis.scripts.ratelimit.TOKEN_BUCKET`): ``{admitted, figure,
        now, now_us[, place, ticket given[, skew ms, field]]}``."""
        admitted, figure, now, now_us, *rest = (wire.text(part) for part in reply)
        # an admission stops at now_us, a denial at the ticket given, unless a skew follows
        place, given, skew_ms, skew_field = (*rest, 0, "", 0, "")[:4]
        # now: Redis TIME's seconds and microseconds, or ms when the script moved it past TIME
        now_ms = float(now) if now_us == "" else int(now) * 1000 + int(now_us) / 1000
        skew = float(skew_ms) / 1000.0
        if int(admitted) == 1:
            return RateDecision(
                True,
                0.0,
                key,
                str(self),
                remaining=float(figure),
                now=now_ms / 1000.0,
                member=member,
                skew=skew,
                skew_field=skew_field,
            )
        return RateDecision(
            False,
            max(0, int(figure)) / 1e6,
            key,
            str(self),
            ticket=given.partition(".")[0] or None,
            now=now_ms / 1000.0,
            queued=int(place),
            skew=skew,
            skew_field=skew_field,
        )

    def refund(self, decision: RateDecision, *, client: Any) -> None:
        """Give back an admission that was not used (best effort: errors are ignored)."""
        calls.run(self._refund_steps(decision), client)

    async def arefund(self, decision: RateDecision, *, client: Any) -> None:
        """:meth:`refund` on a ``redis.asyncio`` client (or a synchronous one's twin)."""
        await calls.arun(self._refund_steps(decision), async_client_for(client))

    def _refund_steps(self, decision: RateDecision) -> calls.Steps[None]:
        try:
            yield calls.Eval(self._refund, [decision.key], self._refund_args(decision), "refund")
        except LockError:
            pass

    # -- the plain API ------------------------------------------------------------------------
    def try_acquire(
        self,
        key: str | None = None,
        *,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        ticket: str | None = None,
        reserve: bool = False,
    ) -> RateDecision:
        """Decide once for limit ``key`` (a name: printable, no braces, at most 512
        characters; default the limiter's own ``key`` when it is a plain name). The Redis
        is ``client`` (with ``prefix``, default ``"steplock"``), else ``app``'s lock store
        (:func:`celery_steplock.lock.get_lease_store`), else the current Celery app's.
        ``ticket``: an earlier denial's :attr:`RateDecision.ticket` (else
        :class:`InvalidArgument` naming ``ticket``, before anything is written); ``reserve``
        True to take a place in the queue when denied.
        Returns a :class:`RateDecision`; raises LockStoreUnavailable when Redis does not answer
        and the policy is fail_closed (fail_open: an allowed RateDecision with ``now`` 0.0).
        The coroutine form is :meth:`atry_acquire`."""
        where, steps = self._try_steps(key, app, client, prefix, ticket, reserve)
        return calls.run(steps, where.client)

    async def atry_acquire(
        self,
        key: str | None = None,
        *,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        ticket: str | None = None,
        reserve: bool = False,
    ) -> RateDecision:
        """:meth:`try_acquire` as a coroutine: the same arguments, decision, Redis state,
        outage policy and signals, on the ``redis.asyncio`` twin of the client
        (:func:`celery_steplock.clients.async_client_for`; ``client`` may be a
        ``redis.asyncio`` client itself). Never blocks the event loop. A sync caller and an
        async caller of equal limiters on one Redis share one limit.

        Returns:
            The :class:`RateDecision` (truthy when admitted).

        Raises:
            LockStoreUnavailable: Redis does not answer and the policy is fail_closed.
            InvalidArgument: ``key`` or ``ticket`` is no name/ticket.
        """
        where, steps = self._try_steps(key, app, client, prefix, ticket, reserve)
        return await calls.arun(steps, async_client_for(where.client))

    def _try_steps(
        self,
        key: str | None,
        app: Any,
        client: Any,
        prefix: str | None,
        ticket: str | None,
        reserve: bool,
    ) -> tuple[Target, calls.Steps[RateDecision]]:
        name = self._plain_name(key)
        ticket = check_ticket(ticket)
        where = self._target(app, client, prefix)
        return where, self._plain_steps(name, where, ticket, reserve)

    def _plain_steps(
        self, name: str, where: Target, ticket: str | None, reserve: bool
    ) -> calls.Steps[RateDecision]:
        """The plain API's decision, written once: the outage policy around the script
        call, then the decision's signals."""
        try:
            decision = yield from self._decide_steps(name, where.prefix, ticket, reserve, None)
        except LockStoreUnavailable as exc:
            policy = resolve_policy(
                self.on_store_error, where.settings, "rate_limit_on_store_error"
            )
            redis_key = self.redis_key(where.prefix, name)[0]
            admitted = RateDecision(True, 0.0, redis_key, str(self))
            return outage(exc, policy, admitted, pattern="rate limit", key=redis_key, name=name)
        _announce(decision, None, name, ticket)
        return decision

    def acquire(
        self,
        key: str | None = None,
        *,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
    ) -> Admission:
        """Admit a block once, or raise :class:`RateLimited` (``retry_after`` seconds)
        without running it; arguments as :meth:`try_acquire`. The decision is taken when
        the block is entered: ``with limiter.acquire(key) as decision:`` (sync) or ``async
        with limiter.acquire(key) as decision:`` (asyncio, :meth:`atry_acquire`);
        ``await limiter.acquire(key)`` decides without a block. An admission is not given
        back at exit (a rate limit counts starts, not holders).

        Returns:
            An :class:`Admission` (a sync and async context manager, and awaitable).
        """
        return Admission(self, key, app, client, prefix)

    def using(
        self, key: Any = None, *, app: Any = None, client: Any = None, prefix: str | None = None
    ) -> Callable:
        """Decorator: each call is admitted once or raises :class:`RateLimited` without
        running. ``key`` a name, a template over the function's arguments or a callable of
        them (default the limiter's ``key``, else the function's qualified name). An
        ``async def`` gets a coroutine function deciding with :meth:`atry_acquire`."""
        template = _key_template(key if key is not None else self.key, self.option)

        def decorate(fun: Callable) -> Callable:
            default = f"{fun.__module__}.{fun.__qualname__}"

            if inspect.iscoroutinefunction(fun):

                @functools.wraps(fun)
                async def awrapper(*args, **kwargs):
                    name = limit_name(template, default, bind_arguments(fun, args, kwargs))
                    async with self.acquire(name, app=app, client=client, prefix=prefix):
                        return await fun(*args, **kwargs)

                return awrapper

            @functools.wraps(fun)
            def wrapper(*args, **kwargs):
                name = limit_name(template, default, bind_arguments(fun, args, kwargs))
                with self.acquire(name, app=app, client=client, prefix=prefix):
                    return fun(*args, **kwargs)

            return wrapper

        return decorate

    def _plain_name(self, key: str | None) -> str:
        if key is None:
            if isinstance(self.key, str) and not template_fields(self.key):
                return self.key
            raise InvalidArgument(
                f"{type(self).__name__}.try_acquire needs a key (the "
                f"limiter's own key {shown(self.key)} is no plain name)",
                argument="key",
            )
        if not isinstance(key, str):
            raise InvalidArgument(f"key must be a str, got {shown(key)}", argument="key")
        return key

    def _denied(self, decision: RateDecision, option: str | None = None) -> RateLimited:
        return RateLimited(
            f"rate limit {decision.limit} of {decision.key!r}: no quota for "
            f"{decision.retry_after:.3f} s",
            retry_after=decision.retry_after,
            option=option or self.option,
            key=decision.key,
            limit=decision.limit,
            ticket=decision.ticket,
        )


class Admission:
    """What :meth:`TokenBucket.acquire` / :meth:`SlidingWindow.acquire` return: one
    decision, taken on entering the block (``with``: :meth:`~_Limiter.try_acquire`;
    ``async with`` or ``await``: :meth:`~_Limiter.atry_acquire`). Entering yields the
    allowed :class:`RateDecision`; a denial raises :class:`RateLimited` and the block does
    not run. Exiting gives nothing back and lets every exception through. Each entry is a
    new decision."""

    __slots__ = ("limiter", "key", "app", "client", "prefix")

    def __init__(self, limiter: _Limiter, key: str | None, app: Any, client: Any, prefix: Any):
        self.limiter = limiter
        self.key = key
        self.app = app
        self.client = client
        self.prefix = prefix

    def _admitted(self, decision: RateDecision) -> RateDecision:
        if not decision.allowed:
            raise self.limiter._denied(decision)
        return decision

    def __enter__(self) -> RateDecision:
        decision = self.limiter.try_acquire(
            self.key, app=self.app, client=self.client, prefix=self.prefix
        )
        return self._admitted(decision)

    def __exit__(self, *exc_info: Any) -> None:
        return None

    async def __aenter__(self) -> RateDecision:
        decision = await self.limiter.atry_acquire(
            self.key, app=self.app, client=self.client, prefix=self.prefix
        )
        return self._admitted(decision)

    async def __aexit__(self, *exc_info: Any) -> None:
        return None

    def __await__(self) -> Generator[Any, None, RateDecision]:
        return self.__aenter__().__await__()


class TokenBucket(_Limiter):
    """A token bucket shared by every worker: ``capacity`` tokens (int >= 1, default: the
    rate per second rounded up, at least 1), refilled fractionally at ``rate`` tokens per
    second: a float (``2.5``) or a string ``"N/period"`` (:func:`parse_rate`: ``"10/s"``,
    ``"600/m"``). Each admission takes one token; a full bucket admits a burst of
    ``capacity``. Over any interval of ``t`` seconds at most ``capacity + rate * t`` are
    admitted. State: one Redis hash per key, expiring once it would be full again.

    ``key``: a name, a template over the task's (or decorated function's) arguments, or a
    callable of them (default: ``cluster_rate_limit_key``, else the task's name).
    ``on_store_error``: ``"fail_closed"`` (default: ``steplock_rate_limit_on_store_error``)
    refuses and retries when Redis does not answer, ``"fail_open"`` admits. ``max_wait``
    (seconds, default :func:`default_max_wait` of ``capacity / rate``: four times that, 30
    to 600 s): the farthest turn a ticket is given for;
    ``ticket_grace`` (seconds, default 2.0): how long past its turn a ticket waits for its
    holder. ``app``/``client``/``prefix``: the Redis of the plain API (see
    :meth:`try_acquire`). Bad values raise :class:`ImproperlyConfigured` naming
    ``cluster_rate_limit``."""

    kind = "tb"
    _script = wire.Script(TOKEN_BUCKET)
    _refund = wire.Script(BUCKET_REFUND)

    def __init__(
        self,
        rate: Any,
        capacity: int | None = None,
        *,
        key: Any = None,
        on_store_error: str | None = None,
        max_wait: float | None = None,
        ticket_grace: float = 2.0,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        option: str = "cluster_rate_limit",
    ):
        if isinstance(rate, str):
            count, period = parse_rate(rate, option)
            rate = count / period
        self.rate = _number(rate, option, "rate (tokens per second)", MIN_RATE, MAX_RATE)
        if capacity is None:
            capacity = max(1, math.ceil(self.rate))
        self.capacity = _number(capacity, option, "capacity", 1, MAX_CAPACITY, integer=True)
        super().__init__(key, on_store_error, max_wait, ticket_grace, app, client, prefix, option)

    def _args(self) -> list[str]:
        return [repr(self.rate / 1000.0), str(self.capacity)]

    def _refund_args(self, decision: RateDecision) -> list[str]:
        return [str(self.capacity)]

    def _default_max_wait(self) -> float:
        return default_max_wait(self.capacity / self.rate)

    def _ident(self) -> str:
        return f"{self.rate!r}:{self.capacity}"

    def __str__(self) -> str:
        return f"{self.rate:g}/s bucket of {self.capacity}"

    def __repr__(self) -> str:
        return f"TokenBucket(rate={self.rate!r}, capacity={self.capacity})"


class SlidingWindow(_Limiter):
    """At most ``limit`` admissions (int, 1 to :data:`MAX_LIMIT`) in any window of
    ``window`` seconds (0.001 to a week), shared by every worker: an exact log of the
    grants' Redis times in one sorted set per key (it expires a window after the last
    grant). A denied request records nothing. ``SlidingWindow("10/s")`` parses a rate
    string (:func:`parse_rate`; the count must then be a whole number).

    ``key``, ``on_store_error``, ``ticket_grace``, ``app``/``client``/``prefix`` as for
    :class:`TokenBucket`; ``max_wait`` (seconds, default four windows, 30 to 600 s)."""

    kind = "sw"
    _script = wire.Script(SLIDING_WINDOW)
    _refund = wire.Script(WINDOW_REFUND)

    def __init__(
        self,
        limit: Any = None,
        window: float | None = None,
        *,
        key: Any = None,
        on_store_error: str | None = None,
        max_wait: float | None = None,
        ticket_grace: float = 2.0,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
        option: str = "cluster_rate_limit",
    ):
        if isinstance(limit, str) and window is None:
            limit, window = parse_rate(limit, option)
        self.limit = _number(limit, option, "limit", 1, MAX_LIMIT, integer=True)
        self.window = _number(window, option, "window (seconds)", 0.001, MAX_WINDOW)
        super().__init__(key, on_store_error, max_wait, ticket_grace, app, client, prefix, option)

    def _args(self) -> list[str]:
        return [str(self.limit), repr(self.window * 1000.0)]

    def _refund_args(self, decision: RateDecision) -> list[str]:
        return [decision.member or ""]

    def _default_max_wait(self) -> float:
        return default_max_wait(self.window)

    def _ident(self) -> str:
        return f"{self.limit}:{self.window!r}"

    def __str__(self) -> str:
        return f"{self.limit}/{self.window:g}s window"

    def __repr__(self) -> str:
        return f"SlidingWindow(limit={self.limit}, window={self.window!r})"


def default_max_wait(window: float) -> float:
    """The default ``max_wait`` of a limit whose window (a bucket: the time to refill it
    full) is ``window`` seconds: four windows, at least 30 s and at most 600 s (a longer
    countdown would meet the broker's visibility timeout sooner)."""
    return min(600.0, max(30.0, 4.0 * window))


# -- the gate ----------------------------------------------------------------------------------


def limit_name(template: Any, default: str, arguments: dict[str, Any]) -> str:
    """The limit's name for bound ``arguments``: ``default`` when ``template`` is None, the
    callable's return value, or the template formatted. Raises LockNameError."""
    from ..keys import name_from_arguments

    if template is None:
        return check_name(default)
    return name_from_arguments(default, arguments, template)


def _limiters(value: Any, option: str) -> tuple[_Limiter, ...]:
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ImproperlyConfigured(
            f"{option}: an empty list limits nothing (use None)", setting=option
        )
    found: list[_Limiter] = []
    for item in items:
        if isinstance(item, str):
            found.append(SlidingWindow(item, option=option))
        elif isinstance(item, _Limiter):
            found.append(item)
        else:
            raise ImproperlyConfigured(
                f'{option} must be a rate string ("10/s"), a TokenBucket or SlidingWindow, '
                f"or a list of them, got {shown(item)}",
                setting=option,
            )
    return tuple(found)


def _check_fields(task, template: Any, option: str) -> None:
    if not isinstance(template, str):
        return
    known = argument_names(task.run)
    if known is None or known[1]:
        return
    for field_name in template_fields(template):
        if field_name not in known[0]:
            raise ImproperlyConfigured(
                f"{option} {shown(template)} names {field_name!r}, which is not an argument "
                f"of the task (arguments: {', '.join(sorted(known[0])) or 'none'})",
                setting=option,
            )


def _announce(
    decision: RateDecision, sender: Any, name: str, held: str | None, **task: Any
) -> None:
    """Send ``rate_limit_allowed`` or ``rate_limited`` for ``decision`` on limit ``name``:
    ``held`` the ticket the request came with, ``task`` its ``task_id`` and ``task_name``
    (none on the plain API); first ``clock_skew`` when the decision clamped a stored time."""
    if decision.skew:
        clock_skew(
            decision.skew,
            decision.skew_field,
            pattern="rate limit",
            sender=sender,
            key=decision.key,
            name=name,
            **task,
            limit=decision.limit,
        )
    if decision.allowed:
        emit(
            signals.rate_limit_allowed,
            sender,
            logging.DEBUG,  # a decision, not an outcome: a task's INFO line is execution_done
            key=decision.key,
            name=name,
            **task,
            limit=decision.limit,
            remaining=decision.remaining,
            granted_at=decision.now,
            ticket=held,
        )
    else:
        emit(
            signals.rate_limited,
            sender,
            logging.DEBUG,  # counted by the metrics; a task's retry is its execution_done line
            key=decision.key,
            name=name,
            **task,
            limit=decision.limit,
            retry_after=decision.retry_after,
            ticket=decision.ticket,
            queued=decision.queued,
        )


def _refund(granted: Sequence[tuple[_Limiter, RateDecision]], client: Any) -> None:
    for limiter, decision in granted:
        limiter.refund(decision, client=client)


class RateLimitGate:
    """The ``cluster_rate_limit`` gate of one task: every limiter must admit. A denial
    gives back the admissions of the limiters before it and raises :class:`RateLimited`
    with the ticket (``context["ticket"]``) and the message headers
    (``context["headers"]``) its retry carries: this task's valid tickets only.

    A ticket is bound to the message it was given to (the task's name and id, its
    arguments, the limit: :func:`celery_steplock.keys.rate_ticket_binding`): the same
    header in another message is no ticket there. The header is read with
    :func:`held_tickets`: a malformed one is no ticket, logged, never the task's error."""

    option = "cluster_rate_limit"

    def __init__(self, task, limiters: Sequence[_Limiter], key: Any, policy: str):
        self.task = task
        self.limiters = tuple(limiters)
        self.key = key
        self.policy = policy

    def enter(self, context):
        task = context.task
        request = task.request
        store = getattr(context.plan, "store", None) or target(task.app).store
        client, prefix = store.client, store.prefix
        limits = []
        for limiter in self.limiters:
            template = limiter.key if limiter.key is not None else self.key
            name = limit_name(template, task.name, context.arguments)
            limits.append((limiter, name, limiter.redis_key(prefix, name)[0]))
        raw = getattr(request, TICKETS_HEADER, None) or (request.headers or {}).get(TICKETS_HEADER)
        tickets = held_tickets(
            raw, [key for _, _, key in limits], task_id=request.id, task_name=task.name
        )
        secret = getattr(store, "name_secret", None)
        granted: list[tuple[_Limiter, RateDecision]] = []
        for limiter, name, redis_key in limits:
            held = tickets.get(redis_key)
            binding = rate_ticket_binding(
                secret, task.name, request.id, redis_key, context.arguments
            )
            try:
                decision = limiter.decide(
                    name,
                    client=client,
                    prefix=prefix,
                    ticket=held,
                    reserve=True,
                    binding=binding,
                )
            except LockStoreUnavailable as exc:
                outage(
                    exc,
                    limiter.on_store_error or self.policy,
                    pattern="rate limit",
                    sender=task,
                    key=redis_key,
                    name=name,
                    cleanup=functools.partial(_refund, granted, client),
                )
                continue
            if decision.allowed:
                granted.append((limiter, decision))
                _announce(decision, task, name, held, task_id=request.id, task_name=task.name)
                continue
            _refund(granted, client)
            _announce(decision, task, name, held, task_id=request.id, task_name=task.name)
            # Always set: the retry's headers start from this message's, whatever they held.
            carried = {key: ticket for key, ticket in tickets.items() if key != decision.key}
            if decision.ticket:
                carried[decision.key] = decision.ticket
            denied = limiter._denied(decision, self.option)
            denied.context["headers"] = {TICKETS_HEADER: carried}
            raise denied
        return None


def gate(task, settings) -> RateLimitGate | None:
    """The task's rate-limit gate (None without ``cluster_rate_limit``). Raises
    ImproperlyConfigured naming ``cluster_rate_limit`` or ``cluster_rate_limit_key``."""
    value = getattr(task, "cluster_rate_limit", None)
    key = getattr(task, "cluster_rate_limit_key", None)
    if inspect.ismethod(key) and key.__self__ is task:
        key = key.__func__  # a function given as a class attribute or keyword
    key = _key_template(key, "cluster_rate_limit_key")
    _check_fields(task, key, "cluster_rate_limit_key")
    if value is None:
        return None
    limiters = _limiters(value, "cluster_rate_limit")
    for limiter in limiters:
        _check_fields(task, limiter.key, "cluster_rate_limit")
    return RateLimitGate(task, limiters, key, settings.rate_limit_on_store_error)
