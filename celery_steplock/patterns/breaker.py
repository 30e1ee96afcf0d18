"""A circuit breaker per dependency name, held in Redis and shared by every worker.

States: CLOSED (calls pass; their outcomes fill a rolling window of the last ``window``
calls), OPEN (no call passes until ``recovery_timeout`` seconds after it opened), HALF_OPEN
(at most ``half_open_probes`` calls cluster-wide pass as probes; ``success_threshold``
successful probes close it, one failed probe opens it again). Every decision Redis makes
(admission, recording a success or a failure, an operator's override) is one Lua script,
atomic on the breaker's keys, with the time from Redis ``TIME``: workers' clocks never decide.

The state cache (``state_cache``, default the setting ``steplock_breaker_state_cache``,
1.0 s; 0 turns it off): each process keeps a copy of each breaker's state (per client, key
prefix and name) for at most that long, counted from the request that read it. While the
copy holds, a CLOSED breaker admits and an OPEN one refuses (``retry_after`` from the cached
open time, in Redis time through the offset measured at the read) without a round trip;
successes of calls admitted CLOSED are counted in the process (at most ``window``) and
written with the next request, failures are written at once together with the successes
counted before them, so the shared window holds every worker's calls. The first admission
after the copy expires runs the admission script, which writes the counted successes
first (with a rate threshold they may trip the breaker: that call is then refused). A
HALF_OPEN breaker, and an OPEN one past its recovery time, always ask Redis: the probe
permits stay cluster-wide. So a trip, a probe's outcome or an operator's override made
elsewhere reaches a process within the staleness; a trip or an override made by the
process itself at once. :meth:`CircuitBreaker.state` writes the process's counted successes
before it reads. A forked child starts with no copy (``os.register_at_fork``); the
successes a process counted in its last staleness are lost if it exits before writing them
(at most ``window`` calls each).

Half-open probe permits are owner-keyed and expire (``probe_timeout``): a prober that dies
frees its permit when it expires, so a dead prober never wedges the breaker. A probe whose
outcome arrives after its permit expired is ignored. Each state change starts a new
*generation*: the outcome of a call admitted in an earlier generation (a call admitted while
CLOSED that ends after the breaker opened) is ignored, so neither a late success closes an
open breaker nor a late failure re-opens a closed one. Outcomes while OPEN never count
(retries refused by an open breaker are not failures).

Keys (one hash slot: ``{name}``): ``<prefix>:breaker:{<name>}`` (hash: ``state``, ``gen``,
``opened_ms``, ``ring`` (the window, one character per call, ``1`` a failure),
``successes``, ``forced``) and ``<prefix>:breaker-probes:{<name>}`` (sorted set of probe
owner tokens by expiry, ms).

Use it as the ``circuit_breaker`` task option (a dependency name, or a
:class:`CircuitBreaker`), or directly::

    payments = CircuitBreaker("payments", failure_threshold=5, window=10, app=app)
    payments.call(charge, order)          # raises CircuitOpen while open
    @payments
    def charge(order): ...
    with payments:
        charge(order)

The same object serves asyncio code, on the same keys, scripts and process cache (a sync
Celery task and an async view share one breaker): ``await payments.acall(acharge, order)``,
``@payments`` on an ``async def`` (the wrapper is a coroutine function), ``async with
payments:``, ``call = await payments.aadmit()`` then ``await call.asuccess()`` /
``afailure(exc)`` / ``arelease()``, ``await payments.astate()``. Each operation that talks to
Redis is written once as :mod:`celery_steplock.calls` steps, run by ``calls.run`` on the
breaker's client or by ``calls.arun`` on its ``redis.asyncio`` twin for the running loop
(:func:`celery_steplock.clients.async_client_for`): the event loop is never blocked, and a
cancellation records no outcome (a half-open probe's permit is given back). Over a
:class:`~celery_steplock.patterns.retry.RetryPolicy` decorator (``@payments`` above
``@policy``) every attempt is admitted by the breaker, and its refusal is never retried.

Which exceptions count as failures (:func:`default_classifier`): every exception except the
library's and Celery's control exceptions and the errors the retry classifier calls
non-retryable (:func:`celery_steplock.patterns.retry.classify`: validation, permission, business
rejection, HTTP 4xx other than 408/429): those show the dependency answered. Unknown errors
count as failures. Pass ``classifier=exc -> bool`` (True: a failure) to decide otherwise.

Redis outage (``on_store_error``, default ``steplock_breaker_on_store_error``,
"fail_closed"): fail closed raises LockStoreUnavailable (a task is retried as for any lock
store outage; nothing is called); fail open calls the dependency unguarded (nothing
recorded). The policy applies to the admissions that ask Redis: while a cached copy holds,
calls are decided by it (a failure that cannot be written is logged and its counted
successes kept for the next write). A Redis that restarts without persistence forgets the breaker's state: it is
CLOSED again.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, NoReturn

from .. import calls, signals
from .._checks import (
    CLOCK_SKEW_TOLERANCE,
    MAX_IDENTIFIER_LENGTH,
    MAX_SECONDS,
    check_count,
    check_seconds,
    check_text,
    shown,
)
from .._loops import background
from .._redis import wire
from .._redis.scripts.breaker import ADMIT, OVERRIDE, READ, RECORD
from ..clients import async_client_for
from ..conf import DEFAULTS
from ..events import emit, log_event
from ..exceptions import (
    CircuitOpen,
    ImproperlyConfigured,
    InvalidArgument,
    LockError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
)
from ..keys import breaker_key, breaker_keys
from ..lease import MALFORMED_EXCERPT
from ._base import (
    Target,
    check_on_store_error,
    clock_skew,
    outage,
    resolve_policy,
    target,
)
from .retry import check_policy, classify, is_async_callable, is_control

__all__ = [
    "CircuitBreaker",
    "BreakerState",
    "AdmittedCall",
    "Ticket",
    "default_classifier",
    "forget_cached_states",
    "OPTIONS",
    "gate",
    "CLOSED",
    "OPEN",
    "HALF_OPEN",
    "ADMIT",
    "RECORD",
    "OVERRIDE",
    "READ",
]

OPTIONS = frozenset({"circuit_breaker", "retry_policy"})

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

#: A breaker's keys live this long after their last write (a forced-open breaker: forever).
IDLE_TTL = 7 * 24 * 3600.0
#: Largest ``window`` (calls kept in the rolling window).
MAX_WINDOW = 10_000
#: Largest ``half_open_probes``.
MAX_PROBES = 10_000
#: Largest ``state_cache`` (seconds), as for the setting ``steplock_breaker_state_cache``.
MAX_STATE_CACHE = 60.0

_ADMIT, _RECORD, _OVERRIDE, _READ = (
    wire.Script(ADMIT),
    wire.Script(RECORD),
    wire.Script(OVERRIDE),
    wire.Script(READ),
)


def default_classifier(exc: BaseException) -> bool:
    """True when ``exc`` counts as a failure of the dependency: anything but the control
    exceptions and what :func:`celery_steplock.patterns.retry.classify` calls non-retryable."""
    return classify(exc) not in ("control", "never")


@dataclass(frozen=True)
class BreakerState:
    """A breaker as read from Redis: ``state`` (closed/open/half_open), ``forced`` (True:
    opened by an operator), ``failures`` and ``calls`` in the window, ``successes`` (probes
    that succeeded while HALF_OPEN; with a count threshold, successes admitted while the
    window held no failure are not written, so ``calls`` counts from the first failure),
    ``probes`` (live probe permits), ``retry_after``
    (seconds until an OPEN breaker lets a probe through, by this object's
    ``recovery_timeout``; 0 otherwise), ``generation``, ``opened_ago`` (seconds since it last
    opened, Redis clock; None when it never did or was closed since), ``malformed`` (what is
    wrong with the stored keys, ``"field: why; ..."`` with its parts sorted, as a lease's
    :func:`~celery_steplock.lease.parse_lease` says it; ``""`` when nothing): a field that
    cannot be what it claims is read as the scripts read it (see :meth:`CircuitBreaker.state`).
    """

    name: str
    key: str
    state: str
    forced: bool
    failures: int
    calls: int
    successes: int
    probes: int
    retry_after: float
    generation: int
    opened_ago: float | None = None
    malformed: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class AdmittedCall:
    """One admitted call: record its outcome once with :meth:`record` (or ``success()`` /
    ``failure()`` / ``release()``). ``probe`` is True for a half-open probe; ``guarded`` False
    when admitted unguarded (fail open during an outage: nothing is recorded); ``clean``
    True when admitted CLOSED with no failure in the window: with a count threshold its
    success is not written (it would change nothing the threshold sees). ``owner`` is ""
    for a call admitted from the cache (never a probe). ``cache``: the
    process's cached state of the breaker when it has one (``state_cache`` > 0): a success
    of a call admitted CLOSED is then counted there and written at the next refresh, a
    failure written at once with the successes counted before it."""

    breaker: CircuitBreaker
    generation: int
    owner: str
    probe: bool
    guarded: bool = True
    done: bool = False
    sender: Any = None
    clean: bool = False
    cache: _CachedState | None = None

    def record(self, exc: BaseException | None) -> None:
        """Record the call's outcome from its exception (None: success) with the breaker's
        classifier; control exceptions and a cancellation (``asyncio.CancelledError``: the
        outcome is unknown) record nothing (a probe's permit is given back). Never raises."""
        if exc is None:
            self._send("0")
            return
        outcome = self._outcome_of(exc)
        self._send(outcome, exc if outcome != "n" else None)

    async def arecord(self, exc: BaseException | None) -> None:
        """:meth:`record`, writing on the breaker's ``redis.asyncio`` client (the twin of its
        client for the running loop, :func:`celery_steplock.clients.async_client_for`).
        Never raises (a cancellation while it writes propagates)."""
        outcome = self._outcome_of(exc)
        await self._asend(outcome, exc if outcome != "n" else None)

    def success(self) -> None:
        self._send("0")

    def failure(self, exc: BaseException | None = None) -> None:
        self._send("1", exc)

    def release(self) -> None:
        """The call never reached the dependency: give the probe permit back."""
        self._send("n")

    async def asuccess(self) -> None:
        """:meth:`success` on the asyncio client."""
        await self._asend("0")

    async def afailure(self, exc: BaseException | None = None) -> None:
        """:meth:`failure` on the asyncio client."""
        await self._asend("1", exc)

    async def arelease(self) -> None:
        """:meth:`release` on the asyncio client."""
        await self._asend("n")

    def _outcome_of(self, exc: BaseException | None) -> str:
        """``"0"`` (a success), ``"1"`` (a failure) or ``"n"`` (nothing) for ``exc``."""
        if exc is None:
            return "0"
        if is_control(exc) or isinstance(exc, asyncio.CancelledError):
            return "n"
        try:
            failed = self.breaker.classifier(exc)
        except Exception as error:  # noqa: BLE001 - a broken classifier: count it
            log_event(
                "circuit_classifier_failed", logging.ERROR, key=self.breaker.key, error=error
            )
            failed = True
        return "1" if failed else "0"

    def _send(self, outcome: str, exc: BaseException | None = None) -> None:
        steps = self._outcome_steps(outcome, exc)
        if steps is None:
            return
        try:
            calls.run(steps, self.breaker._target().client)
        except Exception as error:  # noqa: BLE001 - recording never breaks the call
            steps.close()  # gives the counted successes back
            self._record_failed(outcome, error)

    async def _asend(self, outcome: str, exc: BaseException | None = None) -> None:
        steps = self._outcome_steps(outcome, exc)
        if steps is None:
            return
        try:
            await calls.arun(steps, async_client_for(self.breaker._target().client))
        except Exception as error:  # noqa: BLE001 - recording never breaks the call
            steps.close()
            self._record_failed(outcome, error)

    def _record_failed(self, outcome: str, error: BaseException) -> None:
        log_event(
            "circuit_record_failed",
            logging.ERROR,
            key=self.breaker.key,
            name=self.breaker.name,
            outcome=outcome,
            error=error,
        )

    def _outcome_steps(self, outcome: str, exc: BaseException | None) -> calls.Steps[None] | None:
        """What recording ``outcome`` takes: None when nothing goes to Redis (recorded once;
        unguarded; a released non-probe; a success counted in the process's cache or not
        written), else the steps of the write (:meth:`_record_steps`)."""
        if self.done:
            return None
        self.done = True
        if not self.guarded or (outcome == "n" and not self.probe):
            return None
        cache = self.cache
        if cache is not None and not self.probe:
            if outcome == "0":
                cache.count_success(self.generation, self.breaker.window)
                return None
        elif outcome == "0" and self.clean and self.breaker.mode == "count":
            return None
        return self._record_steps(outcome, exc)

    def _record_steps(self, outcome: str, exc: BaseException | None) -> calls.Steps[None]:
        """The :data:`RECORD` write of ``outcome`` (with the successes the cache counted
        before it), then the cache's update and the signals of a state change. A write that
        fails is logged (``circuit_record_failed``) and its successes counted again."""
        breaker = self.breaker
        cache = self.cache
        before = cache.take(self.generation) if cache is not None and not self.probe else 0
        asked = time.monotonic()
        try:
            where = breaker._target()
            reply = yield breaker._step(
                where,
                _RECORD,
                [
                    outcome,
                    str(self.generation),
                    self.owner if self.probe else "",
                    str(breaker.window),
                    repr(breaker.failure_threshold),
                    breaker.mode,
                    str(breaker.minimum_calls),
                    str(breaker.success_threshold),
                    str(int(IDLE_TTL * 1000)),
                    str(before),
                ],
                "record",
            )
        except GeneratorExit:  # cancelled, or the driver failed: the successes stay counted
            if cache is not None:
                cache.give_back(before, self.generation, breaker.window)
            raise
        except Exception as error:  # noqa: BLE001 - recording never breaks the call
            if cache is not None:
                cache.give_back(before, self.generation, breaker.window)
            self._record_failed(outcome, error)
            return
        state, changed = wire.text(reply[0]), int(reply[1])
        if cache is not None:
            cache.recorded(asked, state, bool(changed), int(reply[4]), int(reply[5]))
        if not changed:
            return
        if cache is None:
            # A probe's outcome, or a breaker object without a cache: the copy another
            # object of the process holds for this name asks Redis at its next admission.
            held = _held_state(where.client, where.prefix, breaker.name)
            if held is not None:
                held.invalidate()
        fields = {
            "key": breaker.key,
            "name": breaker.name,
            "state": state,
            "failures": int(reply[2]),
            "calls": int(reply[3]),
            "task_id": getattr(getattr(self.sender, "request", None), "id", None),
            "task_name": getattr(self.sender, "name", None),
            "error": type(exc).__name__ if exc is not None else None,
        }
        if state == OPEN:
            why = (
                "a half-open probe failed"
                if self.probe
                else f"{fields['failures']} failures in the last {fields['calls']} calls"
            )
            emit(
                signals.circuit_opened,
                self.sender,
                logging.WARNING,
                reason=why,
                manual=False,
                **fields,
            )
        elif state == CLOSED:
            emit(
                signals.circuit_closed,
                self.sender,
                reason=f"{fields['failures']} successful probes",
                manual=False,
                **fields,
            )


#: The former name of :class:`AdmittedCall`, kept for one release.
Ticket = AdmittedCall


class _CachedState:
    """One process's copy of a breaker's state, shared by every :class:`CircuitBreaker` of
    the process with the same client, prefix and name (:func:`_cached_state`).

    ``state`` (None: nothing read yet), ``forced``, ``generation``, ``opened_ms`` (Redis
    time it opened, ms) and ``offset_ms`` (Redis time minus this process's monotonic
    clock, ms, at the reply) as the last reply said; ``expires`` (monotonic seconds: the
    request's send time plus the staleness) and ``asked`` (the send time of the request
    whose reply is held: an older reply arriving later is not applied); ``pending``
    (successes of generation ``pending_generation`` counted here and not yet written, at
    most the window); ``ttl`` (the staleness, seconds, of the last reply). Every field is read and written under ``lock``.
    """

    __slots__ = (
        "lock",
        "state",
        "forced",
        "generation",
        "opened_ms",
        "offset_ms",
        "expires",
        "asked",
        "pending",
        "pending_generation",
        "ttl",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state: str | None = None
        self.forced = False
        self.generation = 0
        self.opened_ms = 0
        self.offset_ms = 0.0
        self.expires = 0.0
        self.asked = float("-inf")
        self.pending = 0
        self.pending_generation = 0
        self.ttl = 0.0

    def count_success(self, generation: int, window: int) -> None:
        """A success of a call admitted CLOSED in ``generation``: counted when that is still
        the state held (else dropped: Redis would ignore it too)."""
        with self.lock:
            if self.state != CLOSED or generation != self.generation:
                return
            if self.pending_generation != generation:
                self.pending, self.pending_generation = 0, generation
            if self.pending < window:
                self.pending += 1

    def take(self, generation: int) -> int:
        """The successes counted in ``generation``, handed to a write (and forgotten here)."""
        with self.lock:
            if self.pending_generation != generation:
                return 0
            taken, self.pending = self.pending, 0
            return taken

    def take_all(self) -> tuple[int, int]:
        """``(successes, their generation)`` counted, handed to a write."""
        with self.lock:
            taken, self.pending = self.pending, 0
            return taken, self.pending_generation

    def give_back(self, count: int, generation: int, window: int) -> None:
        """Successes taken for a write that failed: counted again (same generation only)."""
        if not count:
            return
        with self.lock:
            if self.pending and self.pending_generation != generation:
                return
            self.pending = min(window, self.pending + count)
            self.pending_generation = generation

    def apply(
        self,
        asked: float,
        ttl: float,
        state: str,
        generation: int,
        *,
        forced: bool = False,
        opened_ms: int = 0,
        now_ms: int = 0,
        newer_generation_wins: bool = False,
    ) -> None:
        """What a reply to a request sent at ``asked`` (monotonic seconds) said; held until
        ``asked + ttl``. A reply to a request sent before the one held is dropped, unless
        ``newer_generation_wins`` and its ``generation`` is past the one held (Redis ran it
        later, whatever the send times: another thread's request on another connection)."""
        received = time.monotonic()
        with self.lock:
            if asked < self.asked and not (newer_generation_wins and generation > self.generation):
                return
            self.asked = max(asked, self.asked)
            self.state, self.generation, self.forced = state, generation, forced
            self.opened_ms = opened_ms
            if now_ms:
                self.offset_ms = now_ms - received * 1000.0
            self.expires = asked + ttl
            self.ttl = ttl

    def recorded(
        self, asked: float, state: str, changed: bool, generation: int, now_ms: int
    ) -> None:
        """After a RECORD: a trip is held as OPEN (this process refuses at once, even when
        another thread's admission, sent after the RECORD but run by Redis before it, was
        applied first); any other change, or a reply that is not the CLOSED generation held,
        makes the next admission ask Redis."""
        if changed and state == OPEN:
            self.apply(
                asked,
                self.ttl,
                OPEN,
                generation,
                opened_ms=now_ms,
                now_ms=now_ms,
                newer_generation_wins=True,
            )
            return
        with self.lock:
            if changed or state != CLOSED or generation != self.generation:
                self.expires = 0.0

    def invalidate(self) -> None:
        """The next admission asks Redis."""
        with self.lock:
            self.expires = 0.0


# Per process: the cached states by client (weakly: a client's states go with it), then by
# (prefix, name); clients that take no weak reference by id, kept alive with their states.
_caches: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], _CachedState]] = (
    weakref.WeakKeyDictionary()
)
_caches_by_id: dict[int, tuple[Any, dict[tuple[str, str], _CachedState]]] = {}
_caches_guard = threading.Lock()
#: Advanced in a forked child: a breaker's memo of its cached state from before is stale.
_fork_epoch = 0


def _cached_state(client: Any, prefix: str, name: str) -> _CachedState:
    """This process's cached state of breaker ``name`` under ``prefix`` on ``client``."""
    with _caches_guard:
        try:
            table = _caches.get(client)
            if table is None:
                table = _caches[client] = {}
        except TypeError:  # no weak reference to it
            held = _caches_by_id.get(id(client))
            if held is None or held[0] is not client:
                held = _caches_by_id[id(client)] = (client, {})
            table = held[1]
        found = table.get((prefix, name))
        if found is None:
            found = table[(prefix, name)] = _CachedState()
        return found


def _held_state(client: Any, prefix: str, name: str) -> _CachedState | None:
    """This process's cached state of breaker ``name`` when one exists (never made here)."""
    with _caches_guard:
        try:
            table = _caches.get(client)
        except TypeError:  # no weak reference to it
            held = _caches_by_id.get(id(client))
            table = held[1] if held is not None and held[0] is client else None
        return None if table is None else table.get((prefix, name))


def forget_cached_states() -> None:
    """Drop every breaker state this process cached (and the successes it counted and has
    not written): the next admission of each breaker asks Redis. For tests, and after
    Redis lost its data (FLUSHDB, a restart without persistence) when the staleness
    (``steplock_breaker_state_cache``) is long."""
    global _fork_epoch
    with _caches_guard:
        _caches.clear()
        _caches_by_id.clear()
    _fork_epoch += 1  # breakers' memos of the dropped states are stale too


def _after_fork_in_child() -> None:
    # A child starts with no cached state: the parent's could be stale by the time the child
    # runs, its counted successes are the parent's to write, and a lock held by another
    # thread of the parent at the fork would never be released here.
    global _caches, _caches_by_id, _caches_guard, _fork_epoch
    _caches = weakref.WeakKeyDictionary()
    _caches_by_id = {}
    _caches_guard = threading.Lock()
    _fork_epoch += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


_active: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "steplock_breaker_tickets", default=()
)


class CircuitBreaker:
    """A circuit breaker shared through Redis; see the module docstring.

    ``name`` (str: the dependency), ``failure_threshold`` (int >= 1: failures among the last
    ``window`` calls that open it; or a float in (0, 1): the failure rate over them, once
    ``minimum_calls`` calls (default ``window``) are in the window; default 5), ``window``
    (calls, default 10), ``recovery_timeout`` (seconds OPEN before a probe may pass,
    default 30.0), ``half_open_probes`` (probes at once cluster-wide, default 1),
    ``success_threshold`` (successful probes that close it, default 2), ``probe_timeout``
    (seconds a probe permit lives: a prober that dies frees it then; default 30.0),
    ``classifier`` (``exc -> bool``, True: a failure; default :func:`default_classifier`),
    ``on_store_error`` ("fail_closed" or "fail_open"; None: the setting
    ``steplock_breaker_on_store_error``), ``state_cache`` (seconds, 0 to 60, this process
    trusts its cached copy of the state: see "The state cache" in the module docstring; 0:
    every call asks Redis; None: the setting ``steplock_breaker_state_cache``, default
    1.0), ``app`` (a Celery app: its lease store's client and key prefix; None: Celery's
    current app) or ``client`` (a redis client) with ``prefix`` (default "steplock").
    Raises ImproperlyConfigured for a bad value.
    """

    def __init__(
        self,
        name: str,
        failure_threshold: int | float = 5,
        window: int = 10,
        recovery_timeout: float = 30.0,
        half_open_probes: int = 1,
        success_threshold: int = 2,
        *,
        probe_timeout: float = 30.0,
        minimum_calls: int | None = None,
        classifier: Callable[[BaseException], bool] | None = None,
        on_store_error: str | None = None,
        state_cache: float | None = None,
        app: Any = None,
        client: Any = None,
        prefix: str | None = None,
    ):
        self.name = check_text(name, "CircuitBreaker(name=)", maximum=MAX_IDENTIFIER_LENGTH)
        if not self.name.isprintable() or "{" in self.name or "}" in self.name:
            # It becomes the keys' hash tag and appears in logs and the CLI, as a lock name.
            raise InvalidArgument(
                f"CircuitBreaker(name=) must be printable and without braces, as a lock name "
                f"is: {shown(self.name)}",
                argument="CircuitBreaker(name=)",
            )
        self.window = check_count(window, "CircuitBreaker(window=)", minimum=1, maximum=MAX_WINDOW)
        if isinstance(failure_threshold, float) and 0 < failure_threshold < 1:
            self.mode = "rate"
            self.failure_threshold = failure_threshold
        else:
            self.mode = "count"
            self.failure_threshold = check_count(
                failure_threshold,
                "CircuitBreaker(failure_threshold=) (a count; a rate is a float in (0, 1))",
                minimum=1,
                maximum=self.window,
            )
        self.minimum_calls = check_count(
            self.window if minimum_calls is None else minimum_calls,
            "CircuitBreaker(minimum_calls=)",
            minimum=1,
            maximum=self.window,
        )
        self.recovery_timeout = check_seconds(
            recovery_timeout, "CircuitBreaker(recovery_timeout=)", maximum=MAX_SECONDS / 10
        )
        self.half_open_probes = check_count(
            half_open_probes, "CircuitBreaker(half_open_probes=)", minimum=1, maximum=MAX_PROBES
        )
        self.success_threshold = check_count(
            success_threshold, "CircuitBreaker(success_threshold=)", minimum=1, maximum=MAX_PROBES
        )
        self.probe_timeout = check_seconds(
            probe_timeout, "CircuitBreaker(probe_timeout=)", maximum=MAX_SECONDS / 10
        )
        if classifier is not None and not callable(classifier):
            raise ImproperlyConfigured(
                f"CircuitBreaker(classifier=) must be callable, got {shown(classifier)}",
                setting="circuit_breaker",
            )
        self.classifier = classifier or default_classifier
        self.on_store_error = check_on_store_error(
            on_store_error, "CircuitBreaker(on_store_error=)"
        )
        self.state_cache = check_seconds(
            state_cache,
            "CircuitBreaker(state_cache=)",
            allow_zero=True,
            allow_none=True,
            maximum=MAX_STATE_CACHE,
        )
        self._cache_memo: tuple[Any, ...] | None = None
        self._target_memo: Target | None = None
        self.app = app
        self._client = client
        self._prefix = prefix
        if prefix is not None:
            check_text(prefix, "CircuitBreaker(prefix=)", maximum=64)

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.name!r}, {self.describe()})"

    def describe(self) -> str:
        """The configured limits in a few words."""
        threshold = (
            f"{self.failure_threshold:.0%} failures of {self.window} calls"
            if self.mode == "rate"
            else f"{self.failure_threshold} failures in {self.window} calls"
        )
        return (
            f"{threshold}, {self.recovery_timeout:g} s recovery, "
            f"{self.half_open_probes} probe(s), {self.success_threshold} to close"
        )

    def bind(self, app: Any) -> CircuitBreaker:
        """This breaker, bound to ``app`` when it has neither an app nor a client yet."""
        if self.app is None and self._client is None:
            self.app = app
        return self

    # -- Redis ------------------------------------------------------------------------------

    def _target(self) -> Target:
        memo = self._target_memo
        if memo is not None and self.app is None:
            return memo
        where = target(self.app, client=self._client, prefix=self._prefix)
        if self._client is not None and self.app is None:
            self._target_memo = where  # a bare client and prefix: it never changes
        return where

    def _policy(self, choice: str | None = None) -> str:
        choice = choice or self.on_store_error
        return resolve_policy(choice, self._target().settings, "breaker_on_store_error")

    def _cache(self, where: Target) -> tuple[_CachedState | None, float]:
        """``(cached state, staleness in seconds)`` of this process for ``where``; ``(None,
        0.0)`` when the staleness is 0 (every call asks Redis)."""
        memo = self._cache_memo
        if (
            memo is not None
            and memo[0] is where.client
            and memo[1] == where.prefix
            and memo[2] == _fork_epoch
            and (memo[3] is where or where.settings is None)
        ):
            return memo[4], memo[5]
        ttl = self.state_cache
        if ttl is None:
            settings = where.settings
            ttl = (
                settings.breaker_state_cache
                if settings is not None
                else float(DEFAULTS["breaker_state_cache"])
            )
        cache = _cached_state(where.client, where.prefix, self.name) if ttl > 0 else None
        self._cache_memo = (where.client, where.prefix, _fork_epoch, where, cache, ttl)
        return cache, ttl

    @property
    def key(self) -> str:
        """The Redis key of the breaker's hash."""
        return breaker_key(self._target().prefix, self.name)

    def _keys(self, prefix: str) -> list[str]:
        return breaker_keys(prefix, self.name)

    def _step(self, where: Target, script: wire.Script, args: list[str], what: str) -> calls.Eval:
        """The step running ``script`` on the breaker's keys under ``where``'s prefix."""
        return calls.Eval(
            script, self._keys(where.prefix), args, f"circuit breaker {what}", name=self.name
        )

    def _eval(self, script: wire.Script, args: list[str], what: str) -> Any:
        """Run ``script`` on the breaker's keys with the sync client (errors translated)."""
        where = self._target()
        return calls.run(_one(self._step(where, script, args, what)), where.client)

    # -- admission --------------------------------------------------------------------------

    def admit(
        self, owner: str | None = None, *, sender: Any = None, on_store_error: str | None = None
    ) -> AdmittedCall:
        """Ask to call the dependency. Returns a :class:`AdmittedCall` (record its outcome), or
        raises CircuitOpen (``retry_after``: seconds until a call may pass) or, failing
        closed while Redis cannot be reached, LockStoreUnavailable. ``owner``: the probe
        permit's owner token (default: a new one). An ``opened_ms`` or probe permit stored
        ahead of Redis ``TIME`` by more than ``CLOCK_SKEW_TOLERANCE`` (a clock that went
        back) counts from now, so the wait is at most ``recovery_timeout`` or
        ``probe_timeout``; that admission sends ``clock_skew`` first.

        With a state cache (``state_cache`` > 0) held and not older than the staleness: a
        CLOSED breaker admits and an OPEN one (recovery time not passed, or forced) refuses
        without a round trip, ``retry_after`` from the cached ``opened_ms`` in Redis time.
        Otherwise (nothing cached, expired, HALF_OPEN, or OPEN past its recovery time) the
        admission script runs, writing the successes counted since the last refresh first.
        The cache is the process's: sync and async callers (:meth:`aadmit`) share it."""
        where, cache, ttl, held = self._cached_admission(owner, sender)
        if held is not None:
            return held
        return calls.run(
            self._admit_steps(where, cache, ttl, owner, sender, on_store_error), where.client
        )

    async def aadmit(
        self, owner: str | None = None, *, sender: Any = None, on_store_error: str | None = None
    ) -> AdmittedCall:
        """:meth:`admit` for asyncio code: the same cache, script, permits, signals and outage
        policy, the round trip (when the cache does not decide) on the ``redis.asyncio`` twin
        of the breaker's client for the running loop
        (:func:`celery_steplock.clients.async_client_for`). Record the outcome with
        ``await call.asuccess()`` / ``afailure(exc)`` / ``arelease()`` / ``arecord(exc)``.

        A cancelled call (``asyncio.CancelledError``) never keeps a probe permit: the
        admission script may have granted one with its reply unread, so a task of the loop
        (one its caller's cancellation cannot stop) then removes the permit of this
        call's owner token from the probe set (one ``ZREM``: never another owner's permit;
        nothing when none was granted), as the lease store releases a cancelled acquire's
        grant, so the other callers may probe at once rather than after ``probe_timeout``.
        A removal that fails is logged (``circuit_record_failed``, ``outcome=n``): the
        permit expires with ``probe_timeout``. (The permit is the owner token's: a caller
        passing the ``owner`` of a permit it already holds gives that permit back by
        cancelling.)

        Returns:
            The :class:`AdmittedCall`.

        Raises:
            CircuitOpen: The breaker refuses the call.
            LockStoreUnavailable: Redis could not be reached and the policy is fail closed.
            RuntimeError: No event loop is running.
            asyncio.CancelledError: Cancelled.
        """
        where, cache, ttl, held = self._cached_admission(owner, sender)
        if held is not None:
            return held
        from ..lock import new_owner_token

        owner = owner or new_owner_token(None)
        client = async_client_for(where.client)
        try:
            return await calls.arun(
                self._admit_steps(where, cache, ttl, owner, sender, on_store_error), client
            )
        except asyncio.CancelledError:
            background(self._give_back(client, self._keys(where.prefix)[1], owner))
            raise

    async def _give_back(self, client: Any, probes: str, owner: str) -> None:
        """After a cancelled :meth:`aadmit`: remove ``owner``'s probe permit from the probe
        set ``probes`` (the RECORD script's ``n`` outcome without its generation check: a
        permit of another generation was dropped when the generation moved); logged
        (``circuit_record_failed``) when Redis refuses or does not answer."""
        step = calls.Command(
            ("ZREM", probes, owner),
            "circuit breaker probe give-back",
            key=probes,
            name=self.name,
            owner=owner,
        )
        try:
            await calls.arun(_one(step), client)
        except Exception as error:  # noqa: BLE001 - a background task: logged, left to expire
            log_event(
                "circuit_record_failed",
                logging.ERROR,
                key=self.key,
                name=self.name,
                outcome="n",
                error=error,
            )

    def _cached_admission(
        self, owner: str | None, sender: Any
    ) -> tuple[Target, _CachedState | None, float, AdmittedCall | None]:
        """What :meth:`admit` and :meth:`aadmit` decide without Redis: the target, its
        state cache (None: no cache) and staleness (seconds), and the admission the cache
        decided (None: the admission script decides; raises CircuitOpen when the cache
        refuses)."""
        where = self._target()
        cache, ttl = self._cache(where)
        held = self._from_cache(cache, ttl, owner, sender) if cache is not None else None
        return where, cache, ttl, held

    def _from_cache(
        self, cache: _CachedState, ttl: float, owner: str | None, sender: Any
    ) -> AdmittedCall | None:
        """The admission the process's cached state decides without a round trip: an
        :class:`AdmittedCall` (CLOSED), CircuitOpen raised (OPEN, recovery not passed, or
        forced), or None (ask Redis)."""
        asked = time.monotonic()
        refused: tuple[int, float] | None = None
        with cache.lock:
            # Within this breaker's own staleness too: the copy may have been read by
            # another breaker of the name with a longer one.
            if asked < cache.expires and asked < cache.asked + ttl:
                if cache.state == CLOSED:
                    return AdmittedCall(
                        self, cache.generation, owner or "", False, sender=sender, cache=cache
                    )
                if cache.state == OPEN:
                    if cache.forced:
                        refused = (-2, self.recovery_timeout)
                    else:
                        left = (
                            cache.opened_ms
                            + self.recovery_timeout * 1000.0
                            - (asked * 1000.0 + cache.offset_ms)
                        ) / 1000.0
                        if left > 0:
                            refused = (0, left)
        if refused is not None:
            self._refuse(refused[0], refused[1], sender)
        return None

    def _admit_steps(
        self,
        where: Target,
        cache: _CachedState | None,
        ttl: float,
        owner: str | None,
        sender: Any,
        on_store_error: str | None,
    ) -> calls.Steps[AdmittedCall]:
        """The admission script's round trip (the successes the cache counted written
        first), the cache updated from its reply, its signals, and the outage policy."""
        asked = 0.0
        flush = (0, 0)
        if cache is not None:
            asked = time.monotonic()
            flush = cache.take_all()
        from ..lock import new_owner_token

        owner = owner or new_owner_token(None)
        args = [
            owner,
            str(int(self.recovery_timeout * 1000)),
            str(self.half_open_probes),
            str(int(self.probe_timeout * 1000)),
            str(int(IDLE_TTL * 1000)),
            str(int(CLOCK_SKEW_TOLERANCE * 1000)),
        ]
        if flush[0]:
            args += [
                str(flush[0]),
                str(flush[1]),
                str(self.window),
                repr(self.failure_threshold),
                self.mode,
                str(self.minimum_calls),
            ]
        try:
            reply = yield self._step(where, _ADMIT, args, "admission")
        except GeneratorExit:  # cancelled while asking: the counted successes stay counted
            if cache is not None:
                cache.give_back(flush[0], flush[1], self.window)
            raise
        except Exception as exc:
            if cache is not None:
                cache.give_back(flush[0], flush[1], self.window)
            if not isinstance(exc, LockStoreUnavailable):
                raise
            policy = self._policy(on_store_error)
            unguarded = AdmittedCall(self, 0, owner, False, guarded=False, sender=sender)
            return outage(
                exc,
                policy,
                unguarded,
                pattern="circuit breaker",
                sender=sender,
                key=self.key,
                name=self.name,
            )
        verdict, generation, wait_ms, moved, clean = (
            int(reply[0]),
            int(reply[1]),
            int(reply[2]),
            int(reply[3]),
            int(reply[4]),
        )
        task_fields: dict[str, Any] = {
            "task_id": getattr(getattr(sender, "request", None), "id", None),
            "task_name": getattr(sender, "name", None),
        }
        extra = len(reply) > 11
        if cache is not None:
            cache.apply(
                asked,
                ttl,
                {1: CLOSED, 2: HALF_OPEN, -1: HALF_OPEN}.get(verdict, OPEN),
                generation,
                forced=verdict == -2,
                opened_ms=int(reply[8]) if extra else 0,
                now_ms=int(reply[7]) if extra else 0,
            )
        if extra and int(reply[9]):
            self._opened_by_flush(sender, int(reply[10]), int(reply[11]), task_fields)
        if len(reply) > 6 and int(reply[5]) > 0:
            clock_skew(
                int(reply[5]) / 1000.0,
                wire.text(reply[6]),
                pattern="circuit breaker",
                sender=sender,
                key=self.key,
                name=self.name,
                **task_fields,
            )
        if moved:
            emit(
                signals.circuit_half_opened,
                sender,
                key=self.key,
                name=self.name,
                state=HALF_OPEN,
                reason="recovery timeout passed",
                **task_fields,
            )
        if verdict > 0:
            return AdmittedCall(
                self,
                generation,
                owner,
                verdict == 2,
                sender=sender,
                clean=bool(clean),
                cache=cache if verdict == 1 else None,
            )
        self._refuse(verdict, wait_ms / 1000.0, sender)

    def _refuse(self, verdict: int, retry_after: float, sender: Any) -> NoReturn:
        """Send ``circuit_rejected`` and raise CircuitOpen for a refusal (``verdict`` as
        :data:`ADMIT` returns it: 0, -1 or -2)."""
        state = {0: OPEN, -1: HALF_OPEN, -2: OPEN}[verdict]
        why = {0: "open", -1: "half-open, its probes are taken", -2: "forced open"}[verdict]
        emit(
            signals.circuit_rejected,
            sender,
            logging.DEBUG,
            key=self.key,
            name=self.name,
            state=state,
            reason=why,
            retry_after=retry_after,
            task_id=getattr(getattr(sender, "request", None), "id", None),
            task_name=getattr(sender, "name", None),
        )
        raise CircuitOpen(
            f"circuit breaker {self.name!r} is {why}: retry after {retry_after:.3f} s",
            retry_after=retry_after,
            option="circuit_breaker",
            key=self.key,
            limit=self.describe(),
            name=self.name,
            state=state,
            forced=verdict == -2,
        )

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` through the breaker: raises CircuitOpen (``fn`` not
        called) while open; records the outcome; returns ``fn``'s result or raises its
        exception. A coroutine function ``fn`` gets :meth:`acall`'s coroutine (await it)."""
        if is_async_callable(fn):
            return self.acall(fn, *args, **kwargs)
        ticket = self.admit()
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            ticket.record(exc)
            raise
        ticket.record(None)
        return result

    async def acall(self, fn: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """``await fn(*args, **kwargs)`` through the breaker (:meth:`aadmit`, then the
        outcome recorded on the asyncio client); a cancellation while ``fn`` runs records
        nothing (a probe's permit is given back at once); one during the admission's round
        trip leaves a permit it was granted to expire (``probe_timeout``).

        Returns:
            What ``fn`` returned.

        Raises:
            CircuitOpen: The breaker is open (``fn`` not called).
            LockStoreUnavailable: Redis could not be reached and the policy is fail closed.
            Exception: What ``fn`` raised.
        """
        ticket = await self.aadmit()
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            await ticket.arecord(exc)
            raise
        await ticket.arecord(None)
        return result

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Decorator form of :meth:`call` (of :meth:`acall` for an ``async def``: the
        wrapper is a coroutine function). Over a :class:`~celery_steplock.patterns.retry.RetryPolicy`
        decorator (``@breaker`` above ``@policy``) every attempt passes the breaker: the
        retries run inside it, and its refusal (CircuitOpen) is never retried."""
        composed = getattr(fn, "__steplock_retry__", None)
        if composed is not None and composed.wrapper is fn:
            return composed.through(self)
        if is_async_callable(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                return await self.acall(fn, *args, **kwargs)

            return awrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return self.call(fn, *args, **kwargs)

        return wrapper

    def __enter__(self) -> AdmittedCall:
        ticket = self.admit()
        _active.set((*_active.get(), ticket))
        return ticket

    def __exit__(self, exc_type, exc, tb) -> None:
        stack = _active.get()
        ticket = stack[-1]
        _active.set(stack[:-1])
        ticket.record(exc)

    async def __aenter__(self) -> AdmittedCall:
        """``async with breaker:`` as ``with breaker:``, admitted with :meth:`aadmit` (each
        asyncio task holds its own stack of admitted calls)."""
        ticket = await self.aadmit()
        _active.set((*_active.get(), ticket))
        return ticket

    async def __aexit__(self, exc_type, exc, tb) -> None:
        stack = _active.get()
        ticket = stack[-1]
        _active.set(stack[:-1])
        await ticket.arecord(exc)

    # -- reading and overriding -------------------------------------------------------------

    def state(self) -> BreakerState:
        """The breaker as Redis holds it now; never raises for what the keys hold. The
        successes this process's state cache counted and has not written yet are written
        first (one round trip still): another process's are not, so ``calls`` may be behind
        by what other workers counted within their staleness.

        Corrupt keys (written by anything but this library's scripts) come back described in
        ``malformed``, each field read as the scripts read it: an integer field (``gen``,
        ``opened_ms``, ``successes``) that is not a decimal integer in [0, 2**63 - 1] as 0
        (``opened_ms``: as absent), a ``state`` other than closed/open/half_open as half_open
        (the admission script lets probes through then), a ``forced`` other than ``open``
        as forced; a ``ring`` with other characters than ``0``/``1`` or longer than
        :data:`MAX_WINDOW`, and text that was not UTF-8, are noted; a key of the wrong type
        (a string or a list where the hash or the probes' sorted set belongs) gives the
        hash's fields when it is the probes' key, else a closed state with zero counts.

        Returns:
            The :class:`BreakerState`.

        Raises:
            LockStoreUnavailable: Redis could not be reached.
            LockStoreMisconfigured: Redis refused our credentials or a permission.
            LockError: Redis refused the read for another reason than a key's type.
        """
        where = self._target()
        return calls.run(self._state_steps(where), where.client)

    async def astate(self) -> BreakerState:
        """:meth:`state` on the ``redis.asyncio`` twin of the breaker's client (the same read,
        the same flush of this process's counted successes).

        Returns:
            The :class:`BreakerState`.

        Raises:
            LockStoreUnavailable, LockStoreMisconfigured, LockError: As :meth:`state`.
        """
        where = self._target()
        return await calls.arun(self._state_steps(where), async_client_for(where.client))

    def _state_steps(self, where: Target) -> calls.Steps[BreakerState]:
        """The :data:`READ` round trip of :meth:`state` (the cache's counted successes written
        first), a plain read when a key has the wrong type."""
        cache = self._cache(where)[0]
        flush = cache.take_all() if cache is not None else (0, 0)
        args = []
        if flush[0]:
            args = [
                str(flush[0]),
                str(flush[1]),
                str(self.window),
                repr(self.failure_threshold),
                self.mode,
                str(self.minimum_calls),
                str(int(IDLE_TTL * 1000)),
            ]
        try:
            reply = yield self._step(where, _READ, args, "read")
        except (LockStoreUnavailable, LockStoreMisconfigured, GeneratorExit):
            if cache is not None:
                cache.give_back(flush[0], flush[1], self.window)
            raise
        except LockError:
            # WRONGTYPE inside the script: find which key, and read what still can be.
            hash_type, probes_type = yield from self._key_types_steps(where)
            problems = []
            if hash_type not in ("hash", "none"):
                problems.append(f"key: a {hash_type}, not a hash")
            if probes_type not in ("zset", "none"):
                problems.append(f"probes key: a {probes_type}, not a sorted set")
            if not problems:
                raise
            reply = yield from self._read_plain_steps(where, hash_ok=hash_type == "hash")
            return self._parse(reply, problems)
        if len(reply) > 10 and int(reply[8]):
            if cache is not None:
                cache.invalidate()
            self._opened_by_flush(
                None, int(reply[9]), int(reply[10]), {"task_id": None, "task_name": None}
            )
        return self._parse(reply, [])

    def _opened_by_flush(
        self, sender: Any, failures: int, calls: int, task_fields: dict[str, Any]
    ) -> None:
        """``circuit_opened`` for a trip made by writing a process's counted successes (with
        a rate threshold they can trip it), in an admission or a :meth:`state` read."""
        emit(
            signals.circuit_opened,
            sender,
            logging.WARNING,
            key=self.key,
            name=self.name,
            state=OPEN,
            failures=failures,
            calls=calls,
            error=None,
            reason=f"{failures} failures in the last {calls} calls",
            manual=False,
            **task_fields,
        )

    def _key_types_steps(self, where: Target) -> calls.Steps[tuple[str, str]]:
        """The Redis types of the breaker's hash and probes' key (``"none"``: absent)."""
        hash_key, probes_key = self._keys(where.prefix)
        what = "circuit breaker read"
        hash_type = yield calls.Command(
            ("TYPE", hash_key), what, key=hash_key, name=self.name, options={"keys": [hash_key]}
        )
        probes_type = yield calls.Command(
            ("TYPE", probes_key),
            what,
            key=hash_key,
            name=self.name,
            options={"keys": [probes_key]},
        )
        return _decoded(hash_type), _decoded(probes_type)

    def _read_plain_steps(self, where: Target, *, hash_ok: bool) -> calls.Steps[list[Any]]:
        """What :data:`READ` returns, read with plain commands when a key has the wrong
        type: the hash's fields when it is one, no live probe."""
        key = self._keys(where.prefix)[0]
        what = "circuit breaker read"
        if hash_ok:
            fields = yield calls.Command(
                ("HMGET", key, *_READ_FIELDS),
                what,
                key=key,
                name=self.name,
                options={"keys": [key]},
            )
        else:
            fields = [None] * len(_READ_FIELDS)
        seconds, micros = yield calls.Command(("TIME",), what, key=key, name=self.name)
        now = int(seconds) * 1000 + int(micros) // 1000
        return [
            default if value is None else value for value, default in zip(fields, _READ_DEFAULTS)
        ] + [str(now), 0]

    def _parse(self, reply: list[Any], problems: list[str]) -> BreakerState:
        """A :class:`BreakerState` from a :data:`READ` reply, whatever the hash holds."""
        raw = [_decoded(v) for v in reply]
        for field_name, value in zip(_READ_FIELDS, raw):
            if "\ufffd" in value:
                problems.append(f"{field_name}: not UTF-8")
        state, forced, ring = raw[0], raw[5], raw[3]
        if state not in (CLOSED, OPEN, HALF_OPEN):
            problems.append(
                f"state: not closed, open or half_open ({_excerpt(state)}), read as half_open"
            )
            state = HALF_OPEN
        if forced and forced != "open":
            problems.append(f"forced: not 'open' ({_excerpt(forced)}), read as forced")
        if ring.strip("01"):
            problems.append(f"ring: not 0s and 1s ({_excerpt(ring)})")
        if len(ring) > MAX_WINDOW:
            problems.append(f"ring: longer than the largest window ({len(ring)} > {MAX_WINDOW})")
        generation = _integer(raw[1], "gen", problems) or 0
        successes = _integer(raw[4], "successes", problems) or 0
        # Unreadable: as absent, as the admission script reads it (tonumber(...) or 0).
        opened_ms = _integer(raw[2], "opened_ms", problems) if raw[2] else None
        if not raw[2] and state == OPEN:
            problems.append("opened_ms: missing (the breaker is open)")
        now = _integer(raw[6], "now", problems) or 0
        probes = _integer(raw[7], "probes", problems) or 0
        retry_after = 0.0
        if state == OPEN and opened_ms is not None and not forced:
            retry_after = max(0.0, (opened_ms + self.recovery_timeout * 1000 - now) / 1000)
        opened_ago = (
            max(0.0, (now - opened_ms) / 1000)
            if opened_ms is not None and state != CLOSED
            else None
        )
        return BreakerState(
            self.name,
            self.key,
            state,
            bool(forced),
            ring.count("1"),
            len(ring),
            successes,
            probes,
            retry_after,
            generation,
            opened_ago,
            "; ".join(sorted(problems)),
        )

    def override(self, action: str) -> tuple[str, bool]:
        """Force the breaker "open" (until closed by hand) or "close" it (window emptied),
        unaudited: operators use :func:`celery_steplock.ops.override_breaker`. Returns the
        state before and whether it was forced open. Raises LockStoreUnavailable. Seen by
        this process's next admission, by other processes' within their state cache's
        staleness (``state_cache``, default 1 s)."""
        where = self._target()
        return calls.run(self._override_steps(where, action), where.client)

    async def aoverride(self, action: str) -> tuple[str, bool]:
        """:meth:`override` on the ``redis.asyncio`` twin of the breaker's client."""
        where = self._target()
        return await calls.arun(
            self._override_steps(where, action), async_client_for(where.client)
        )

    def _override_steps(self, where: Target, action: str) -> calls.Steps[tuple[str, bool]]:
        """The :data:`OVERRIDE` round trip; this process's cached state asks Redis next."""
        if action not in ("open", "close"):
            raise ImproperlyConfigured(
                f"action must be 'open' or 'close', got {shown(action)}", setting="action"
            )
        reply = yield self._step(where, _OVERRIDE, [action, str(int(IDLE_TTL * 1000))], "override")
        cache = self._cache(where)[0] or _held_state(where.client, where.prefix, self.name)
        if cache is not None:
            cache.invalidate()  # this process sees it at once; others within the staleness
        return wire.text(reply[0]), bool(wire.text(reply[1]))


def _one(step: calls.Step) -> calls.Steps[Any]:
    """The steps of one call: its reply is the result."""
    return (yield step)


#: The hash fields :data:`READ` returns, in its order, and what it returns for an absent one.
_READ_FIELDS = ("state", "gen", "opened_ms", "ring", "successes", "forced")
_READ_DEFAULTS = (CLOSED, "0", "", "", "0", "")
#: Largest value of a stored integer field (a signed 64-bit integer, as Redis keeps them).
_MAX_INTEGER = 2**63 - 1


def _decoded(value: Any) -> str:
    # A client that does not decode hands bytes over; a byte that is not UTF-8 becomes
    # U+FFFD, as the library's own clients decode (encoding_errors="replace").
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _excerpt(value: str) -> str:
    return repr(value if len(value) <= MALFORMED_EXCERPT else value[:MALFORMED_EXCERPT] + "...")


def _integer(text: str, field_name: str, problems: list[str]) -> int | None:
    """``text`` as a stored integer field; None (and a problem noted) when it is none."""
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()):
        problems.append(f"{field_name}: not an integer ({_excerpt(text)})")
        return None
    if len(digits) > 19 or int(digits) > _MAX_INTEGER:
        problems.append(f"{field_name}: out of range ({_excerpt(text)})")
        return None
    return int(digits)


# -- the gate ------------------------------------------------------------------------------


class _Admitted:
    __slots__ = ("ticket",)

    def __init__(self, ticket: AdmittedCall):
        self.ticket = ticket

    def exit(self, exc: BaseException | None, result: Any) -> None:
        from .gates import NOT_RUN

        if result is NOT_RUN:
            self.ticket.release()
        else:
            self.ticket.record(exc)


class BreakerGate:
    """The ``circuit_breaker`` gate of one task (:mod:`celery_steplock.patterns.gates`)."""

    option = "circuit_breaker"

    def __init__(self, breaker: CircuitBreaker, on_store_error: str):
        self.breaker = breaker
        self.on_store_error = on_store_error

    def enter(self, context) -> _Admitted | None:
        lease = context.lease
        ticket = self.breaker.admit(
            getattr(lease, "owner", None), sender=context.task, on_store_error=self.on_store_error
        )
        return _Admitted(ticket) if ticket.guarded else None


def gate(task, settings) -> BreakerGate | None:
    """The task's breaker gate from ``circuit_breaker`` (a dependency name or a
    :class:`CircuitBreaker`); None when unset. Also checks ``retry_policy`` (the retry
    policy is applied by the task around the whole execution, not by a gate)."""
    check_policy(getattr(task, "retry_policy", None))
    value = getattr(task, "circuit_breaker", None)
    if value is None:
        return None
    if isinstance(value, str):
        try:
            breaker = CircuitBreaker(value, app=task.app)
        except ImproperlyConfigured as exc:
            raise ImproperlyConfigured(
                f"circuit_breaker={shown(value)}: {exc}", setting="circuit_breaker"
            ) from exc
    elif isinstance(value, CircuitBreaker):
        breaker = value.bind(task.app)
    else:
        raise ImproperlyConfigured(
            f"circuit_breaker={shown(value)} must be a dependency name "
            f"or a CircuitBreaker(...) object",
            setting="circuit_breaker",
        )
    policy = breaker.on_store_error or settings.breaker_on_store_error
    return BreakerGate(breaker, policy)
