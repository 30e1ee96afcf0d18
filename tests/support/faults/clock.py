"""The ``clock_ahead`` fault: the state a failover leaves in the lock store when the old
primary's clock ran ahead of the new one's (docs/howto/deployment.md, "After a failover to a
primary whose clock is behind"; docs/security.md rows 11, 15, 16).

The library reads time only from Redis ``TIME``, so what a clock that ran ahead leaves behind
is *stored* times and fencing tokens ahead of the new primary's ``TIME``. This module writes
that state into the live lock store (and the step rows) at once, each value exactly in the
format the library's scripts write it (celery_steplock/_redis/scripts/*), ``skew`` ahead of
what it is:

- fencing counters ``<prefix>:fence:{<name>}`` and ``<prefix>:bulkhead:{<key>}:fence``
  (decimal Redis microseconds, ``fragments.FENCE``);
- lease hashes ``<prefix>:lease:{<name>}``: ``acquired_ms``, ``renewed_ms`` (decimal ms; the
  ``fence`` of a held lease is left alone: its live holder carries the token it was given);
- step rows: ``lock_fence`` of some of the run's non-terminal steps no one holds set to
  ``max(lock_fence, now + skew)`` (Redis us), as a guarded writer of the old primary would
  have left it; for about half of those the fencing counter missed that grant (the
  failover's replication lag lost it), which is what makes ``FenceAhead`` (row 11);
- the rate limits ``<prefix>:rate:<kind>:<ident>:{<name>}`` (a token bucket's ``ts``, a
  sliding window's grants) and their ``:queue:`` / ``:due:`` tickets (ms, ``%.17g``; row 15);
- the breakers ``<prefix>:breaker:{<name>}`` ``opened_ms`` and the probe permits
  ``<prefix>:breaker-probes:{<name>}`` (integer ms; row 16);
- the concurrency waiters ``<prefix>:bulkhead:{<key>}:queue`` / ``:alive`` (integer ms;
  row 16);
- the idempotency records ``<prefix>:idem:{<key>}``: ``created_ms``, ``locked_ms``,
  ``completed_ms``, ``failed_ms``, ``expires_ms`` (for operators only, the docs say: their
  expiry is the key's TTL).

An event's time (a token, a grant, an opening) moves ``skew`` ahead but never past Redis now
+ ``skew`` nor back: one fault leaves the state of a clock ``skew`` ahead, and two faults do
not add up to a clock twice as far ahead (an expiry moves ``skew`` ahead: its key's TTL and
the library's clamp bound it). Each key is rewritten by one Lua script (atomic against the
workers' scripts), only if it still exists, keeping its TTL (HSET, ``ZADD XX``, ``SET
KEEPTTL``): the fault adds no key and no key without a TTL. Redis's own clock is not
touched.
"""

from __future__ import annotations

import random
import re
from collections import Counter

import redis

#: The skew a ``clock_ahead`` fault of the randomized run draws (seconds, from its ``lag``,
#: uniform in [0, 1)). Above ``CLOCK_SKEW_TOLERANCE`` (1 s, celery_steplock._checks): a stored
#: time further ahead is clamped by the patterns' next decision (within the tolerance it is
#: kept, as jitter), and the patterns recover within their configured refill, window,
#: recovery or lifetime whatever the skew (docs/howto/deployment.md). Below the lab's
#: ``steplock_retry_backoff_max`` (2 s, ``Lab.worker_env``): the bound of the library's own
#: recovery of a step row ahead (FenceAhead retried after the skew, at most twice; further
#: ahead it fails at once and waits for an operator, docs/howto/deployment.md, security.md
#: row 11). Tokens and rows never get further ahead than the skew (the shift is capped at
#: Redis now + skew), so every FenceAhead of the run is one the library retries itself.
SKEW_MIN, SKEW_MAX = 1.2, 1.8
#: Keys rewritten per pipeline (one round trip).
BATCH = 500

#: Hash fields that hold Redis ms, per key family.
LEASE_TIMES = ("acquired_ms", "renewed_ms")
IDEM_TIMES = ("created_ms", "locked_ms", "completed_ms", "failed_ms", "expires_ms")

# The shift of one stored value v: v + ARGV[1] (the skew, in the value's unit), but an
# event's time (ARGV[2] the cap, '' none: an expiry is not capped) never past the cap, Redis
# now + skew, nor moved back: a value a previous clock_ahead left ahead stays as it is (two
# faults do not add up to a clock twice as far ahead).
_SHIFTED = """
local function shifted(v)
  local new = v + tonumber(ARGV[1])
  if ARGV[2] ~= '' and new > tonumber(ARGV[2]) then new = math.max(v, tonumber(ARGV[2])) end
  return new
end
"""

# KEYS[1] a string holding an integer. Returns 1 if rewritten.
_SHIFT_STRING = (
    _SHIFTED
    + """
local v = tonumber(redis.call('GET', KEYS[1]) or '')
if not v then return 0 end
local new = shifted(v)
if new == v then return 0 end
redis.call('SET', KEYS[1], string.format('%d', new), 'KEEPTTL')
return 1
"""
)

# KEYS[1] a string fencing counter; ARGV[1] a token: the counter becomes at least it.
_RAISE_STRING = """
local v = tonumber(redis.call('GET', KEYS[1]) or '')
if not v or v >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'KEEPTTL')
return 1
"""

# KEYS[1] a hash; ARGV[3] 'int' or 'float' (the format its script writes: a decimal integer,
# or Lua %.17g), ARGV[4..] the fields. A field absent or '' is left alone. Returns the
# number of fields rewritten.
_SHIFT_HASH = (
    _SHIFTED
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local n = 0
for i = 4, #ARGV do
  local v = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '')
  if v then
    local new = shifted(v)
    if new ~= v then
      if ARGV[3] == 'int' then new = string.format('%d', new) else new = string.format('%.17g', new) end
      redis.call('HSET', KEYS[1], ARGV[i], new)
      n = n + 1
    end
  end
end
return n
"""
)

# KEYS[1] a sorted set; ARGV[3] 'int' or 'float'. Returns the number of members rewritten.
_SHIFT_ZSET = (
    _SHIFTED
    + """
local all = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local n = 0
for i = 1, #all, 2 do
  local v = tonumber(all[i + 1])
  local new = shifted(v)
  if new ~= v then
    if ARGV[3] == 'int' then new = string.format('%d', new) else new = string.format('%.17g', new) end
    redis.call('ZADD', KEYS[1], 'XX', new, all[i])
    n = n + 1
  end
end
return n
"""
)


def _family(prefix: str, key: str) -> str | None:
    """What a lock-store key under ``prefix`` is (celery_steplock/keys.py), or None."""
    rest = key[len(prefix) + 1 :] if key.startswith(prefix + ":") else None
    if rest is None:
        return None
    head = rest.split(":", 1)[0]
    if head == "bulkhead":
        return "slot_" + rest.rsplit(":", 1)[1]  # slot_fence / slot_queue / slot_alive
    if head == "rate":
        kind = rest.split(":")[1]  # tb | sw
        if ":queue:{" in rest:
            return "rate_queue"
        if ":due:{" in rest:
            return "rate_due"
        return "rate_tb" if kind == "tb" else "rate_sw"
    return {
        "fence": "fence",
        "lease": "lease",
        "breaker": "breaker",
        "breaker-probes": "breaker_probes",
        "idem": "idem",
    }.get(head)


def redis_now_us(client) -> int:
    """Redis ``TIME`` in microseconds (a cluster client's per-node answer: the first node's;
    the nodes share this machine's clock)."""
    reply = client.time()
    if isinstance(reply, dict):
        reply = next(iter(reply.values()))
    seconds, micros = reply
    return int(seconds) * 1_000_000 + int(micros)


def leave_clock_ahead(
    store,
    skew_s: float,
    steps=(),
    prefix: str = "steplock",
    step_key: str = "step:{}",
    rng: random.Random | None = None,
    rows: float = 0.5,
    lost: float = 0.5,
    terminal=("done", "cancelled", "failed"),
    row_ahead_s: float | None = None,
    skip_held: bool = True,
) -> dict:
    """Rewrite the lock store ``store`` (a ``redis.Redis`` on the current primary, decoded
    responses) and the rows of ``steps`` (step ids of the Django model
    ``workflows.Step``) into the state a primary whose clock ran ``skew_s`` seconds ahead
    leaves after a failover (the module docstring lists the keys and fields).

    Of the steps not in ``terminal`` and (``skip_held``, the default) not leased now (a live
    holder's token came from the same clock as the row's would have), a fraction ``rows``
    (drawn with ``rng``; default 0.5) get ``lock_fence = max(lock_fence, Redis now +
    row_ahead_s)`` (default ``skew_s``; a row written earlier is less ahead); of those, a
    fraction ``lost`` keep their fencing counter behind (``<prefix>:fence:{<step_key>}``:
    the failover lost that grant: FenceAhead), the others get their counter raised to the
    row's token. Every other counter is moved ``skew`` ahead (capped at Redis now + skew).
    ``step_key`` renders a step id as its lock name (the
    fault tasks' ``lock_key="step:{step_id}"``).

    Returns ``{"skew_s", "now_us", "changed": {field: count}, "rows": [step ids ahead],
    "counters_lost": [step ids]}``: ``changed`` counts keys or members rewritten per field
    (``fence``, ``lease_times``, ``row_fence``, ``rate_ts``, ``rate_log``, ``rate_tickets``,
    ``breaker_opened_ms``, ``breaker_probes``, ``slot_fence``, ``slot_queue``,
    ``slot_alive``, ``idem_times``); fields with nothing changed are left out."""
    rng = rng or random.Random(0)
    skew_us = int(round(skew_s * 1_000_000))
    changed: Counter = Counter()
    now_us = redis_now_us(store)

    # the step rows first (the state a guarded writer of the old primary left), so that
    # the counters the failover kept can be raised to them
    ahead: dict[int, int] = {}
    lost_steps: list = []
    if steps:
        row_us = skew_us if row_ahead_s is None else int(round(row_ahead_s * 1_000_000))
        # a step leased now has a live holder: its token came from the same clock as the
        # row's would have (not behind it); only the rows of steps no one holds are ahead
        steps = list(steps)
        idle = steps
        if skip_held:
            pipe = store.pipeline(transaction=False)
            for step in steps:
                pipe.exists(f"{prefix}:lease:{{{step_key.format(step)}}}")
            idle = [step for step, held in zip(steps, pipe.execute()) if not held]
        ahead, lost_steps = _rows_ahead(idle, now_us, row_us, rng, rows, lost, terminal)
        changed["row_fence"] = len(ahead)
    skip = {f"{prefix}:fence:{{{step_key.format(s)}}}" for s in lost_steps}
    raised = {f"{prefix}:fence:{{{step_key.format(s)}}}": fence for s, fence in ahead.items()}
    error = None
    try:
        _shift_store(store, prefix, changed, skip, raised, now_us, skew_us)
    except redis.RedisError as exc:  # a store fault under way: what was rewritten stays
        error = f"{type(exc).__name__}: {exc}"
    result = {
        "skew_s": skew_s,
        "now_us": now_us,
        "changed": {k: int(v) for k, v in sorted(changed.items()) if v},
        "rows": sorted(ahead),
        "counters_lost": sorted(lost_steps),
    }
    if error:
        result["error"] = error
    return result


def _shift_store(store, prefix, changed, skip, raised, now_us, skew_us) -> None:
    """Rewrite every time-bearing key under ``prefix`` (the module docstring), counting into
    ``changed``; ``skip``: fencing counters the failover lost, ``raised``: counter -> the
    token it is raised to (its row's), every other counter moved ahead. An event's time
    (a grant, a token, an opening) moves ``skew`` ahead but never past Redis now + skew; an
    expiry (a waiter's liveness, a probe permit, a ticket's deadline, a record's
    ``expires_ms``) moves ``skew`` ahead."""
    us = [str(skew_us), str(now_us + skew_us)]
    ms_int = [str(skew_us // 1000), str((now_us + skew_us) // 1000)]
    ms = [repr(skew_us / 1000.0), repr((now_us + skew_us) / 1000.0)]
    expiry_int, expiry = [ms_int[0], ""], [ms[0], ""]
    scripts = {
        name: store.register_script(text)
        for name, text in (
            ("string", _SHIFT_STRING),
            ("raise", _RAISE_STRING),
            ("hash", _SHIFT_HASH),
            ("zset", _SHIFT_ZSET),
        )
    }
    # a cluster's pipeline does not load scripts: loaded beforehand, on every primary
    if isinstance(store, redis.RedisCluster):
        for script in scripts.values():
            store.script_load(script.script)

    # family -> its (field, script, args) rewrites; the fencing counters are per key
    rewrites = {
        "slot_fence": [("slot_fence", "string", us)],
        "lease": [("lease_times", "hash", [*ms_int, "int", *LEASE_TIMES])],
        "rate_tb": [("rate_ts", "hash", [*ms, "float", "ts"])],
        "rate_sw": [("rate_log", "zset", [*ms, "float"])],
        "rate_queue": [("rate_tickets", "zset", [*ms, "float"])],
        "rate_due": [("rate_tickets", "zset", [*expiry, "float"])],
        "breaker": [("breaker_opened_ms", "hash", [*ms_int, "int", "opened_ms"])],
        "breaker_probes": [("breaker_probes", "zset", [*expiry_int, "int"])],
        "slot_queue": [("slot_queue", "zset", [*ms_int, "int"])],
        "slot_alive": [("slot_alive", "zset", [*expiry_int, "int"])],
        "idem": [
            ("idem_times", "hash", [*ms_int, "int", *IDEM_TIMES[:-1]]),
            ("idem_times", "hash", [*expiry_int, "int", IDEM_TIMES[-1]]),
        ],
    }

    def calls(key):
        """The (field, script, args) rewrites of ``key``."""
        family = _family(prefix, key)
        if family != "fence":
            return rewrites.get(family, [])
        if key in skip:
            return []
        if key in raised:
            return [("fence", "raise", [str(raised[key])])]
        return [("fence", "string", us)]

    # Pipelined by BATCH keys: a run leaves tens of thousands of idempotency records, and
    # one round trip each kept the controller (and the heals of the faults it runs) busy for
    # a minute or more. Each key is still rewritten by one atomic script.
    keys = sorted(set(store.scan_iter(match=f"{prefix}:*", count=1000)))  # SCAN repeats
    for begin in range(0, len(keys), BATCH):
        pipe = store.pipeline(transaction=False)
        fields = []
        for key in keys[begin : begin + BATCH]:
            for field, script, args in calls(key):
                scripts[script](keys=[key], args=args, client=pipe)
                fields.append(field)
        for field, count in zip(fields, pipe.execute()):
            changed[field] += count


def _rows_ahead(steps, now_us, skew_us, rng, rows, lost, terminal):
    """Move the ``lock_fence`` of a fraction ``rows`` of the non-terminal ``steps`` to
    ``max(lock_fence, now_us + skew_us)`` (one UPDATE each, only while still non-terminal);
    returns ``({step: its new fence}, [steps whose counter the failover lost])``."""
    from django.db import DatabaseError, connection

    from django_app.workflows.models import Step

    live = sorted(
        Step.objects.filter(pk__in=list(steps))
        .exclude(status__in=terminal)
        .values_list("pk", flat=True)
    )
    chosen = [s for s in live if rng.random() < rows]
    ahead: dict = {}
    lost_steps = []
    for step in chosen:
        try:
            n, fence = _row_ahead(step, now_us, skew_us, terminal)
        except DatabaseError:  # a database fault under way: this row stays as it was
            connection.close()
            continue
        if not n:
            continue
        ahead[step] = fence
        if rng.random() < lost:
            lost_steps.append(step)
    return ahead, lost_steps


def _row_ahead(step, now_us, skew_us, terminal):
    from django.db import transaction
    from django.db.models import F, Value
    from django.db.models.functions import Coalesce, Greatest

    from django_app.workflows.models import Step

    with transaction.atomic():
        n = (
            Step.objects.filter(pk=step)
            .exclude(status__in=terminal)
            .update(
                lock_fence=Greatest(Coalesce(F("lock_fence"), Value(0)), Value(now_us + skew_us))
            )
        )
        if not n:
            return 0, None
        return n, Step.objects.filter(pk=step).values_list("lock_fence", flat=True)[0]


def inject_clock_ahead(lab, fault: dict) -> dict | None:
    """The ``clock_ahead`` fault of :class:`~tests.support.faults.nemesis.NemesisLab`:
    :func:`leave_clock_ahead` on its lock store and steps with the skew ``SKEW_MIN +
    (SKEW_MAX - SKEW_MIN) * fault["lag"]`` seconds (rows and lost counters drawn from
    ``fault["target2"]``); returns its history entry (``skew``, ``changed``, ``rows``,
    ``counters_lost``, ``now_us``, ``error`` when the store failed midway), or None when the
    store did not answer (nothing changed: tried again, then skipped). Instantaneous: no
    heal."""
    from tests.support.faults.lab import KEY_PREFIX

    skew = round(SKEW_MIN + (SKEW_MAX - SKEW_MIN) * float(fault["lag"]), 3)
    try:
        done = leave_clock_ahead(
            lab.store_client(),
            skew,
            steps=list(lab.steps),
            prefix=KEY_PREFIX,
            rng=random.Random(fault["target2"]),
        )
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError, AttributeError):
        # AttributeError: redis-py's cluster client mid-failover (a node gone from its table)
        return None
    from django_app.faults import patterns

    extra = {"error": done["error"]} if "error" in done else {}
    # what the checker's bound needs (check_breakers_after): not in run.json's limits
    extra["breakers"] = {
        patterns.BREAKER_NAME: {"recovery_timeout": patterns.breaker.recovery_timeout}
    }
    return lab.note(
        "fault",
        kind="clock_ahead",
        skew=skew,
        changed=done["changed"],
        rows=done["rows"],
        counters_lost=done["counters_lost"],
        now_us=done["now_us"],
        **extra,
    )


# -- the checker's rule (tests/support/faults/runcheck.py) ---------------------------------------

#: ``CLOCK_SKEW_TOLERANCE`` (celery_steplock._checks): a stored time at most this far ahead is
#: kept, not clamped (seconds).
TOLERANCE = 1.0
#: The default ``steplock_breaker_state_cache`` (seconds): a process may refuse from its copy
#: of the breaker's state for this long after the request that read it.
STATE_CACHE = 1.0
#: Seconds between a refusal in a worker and its history entry (a loaded two-core machine).
SLACK = 1.0


def check_breakers_after(history: list[dict], stops: dict | None = None) -> tuple[list, dict]:
    """The liveness of the circuit breakers after each ``clock_ahead`` fault (docs/patterns/
    breaker.md, ``clock_skew``: an ``opened_ms`` ahead is clamped to now by the next
    admission, "so the breaker half-opens ``recovery_timeout`` from now, never after the
    skew"). For a ``clock_ahead`` entry at ``t_f`` naming the breakers' ``recovery_timeout``
    (``breakers``), each refusal as *open* (a ``breaker`` entry ``what="rejected"``,
    ``reason="open"``) of such a breaker after it and before the next ``clock_ahead`` is
    late when it comes more than ``recovery_timeout + state_cache + TOLERANCE + SLACK``
    seconds after ``base``: the later of the breaker's first admission entry (a refusal or
    a ``dep_call``) at or after ``t_f + state_cache`` (so decided by the admission script,
    which clamps, or by a copy it read after the fault) and its last ``opened`` entry
    before the refusal (a genuine re-open starts a new recovery). A refusal by a process
    stopped (SIGSTOP/SIGKILL in ``stops``, pid -> times) between ``base`` and its entry is
    not judged: its entry may be late. Returns ``(violations, {"clock_ahead_faults",
    "refusals_judged", "late_refusals", "changed": the faults' ``changed`` summed})``."""
    stops = stops or {}
    faults = [e for e in history if e.get("ev") == "fault" and e.get("kind") == "clock_ahead"]
    faults.sort(key=lambda e: e["t"])
    by_name: dict = {}
    for e in history:
        if e.get("ev") in ("breaker", "dep_call") and e.get("name") is not None:
            by_name.setdefault(e["name"], []).append(e)
    for entries in by_name.values():
        entries.sort(key=lambda e: e["t"])
    problems: list[str] = []
    counts: dict = {"clock_ahead_faults": len(faults), "refusals_judged": 0, "late_refusals": 0}
    changed: Counter = Counter()
    for fault in faults:
        changed.update(fault.get("changed") or {})
    counts["changed"] = dict(sorted(changed.items()))
    for n, fault in enumerate(faults):
        t_f = fault["t"]
        until = faults[n + 1]["t"] if n + 1 < len(faults) else float("inf")
        for name, conf in (fault.get("breakers") or {}).items():
            entries = by_name.get(name, [])
            caches = [float(e["state_cache"]) for e in entries if e.get("state_cache")]
            cache = max(caches, default=STATE_CACHE)
            admissions = [
                e
                for e in entries
                if e["t"] >= t_f + cache
                and (e.get("ev") == "dep_call" or e.get("what") == "rejected")
            ]
            if not admissions:
                continue
            anchor = admissions[0]["t"]
            bound = float(conf["recovery_timeout"]) + cache + TOLERANCE + SLACK
            opened = [e["t"] for e in entries if e.get("what") == "opened"]
            for e in entries:
                if not (anchor <= e["t"] < until) or e.get("what") != "rejected":
                    continue
                if e.get("reason") != "open":
                    continue
                counts["refusals_judged"] += 1
                base = max([anchor] + [t for t in opened if t <= e["t"]])
                if e["t"] <= base + bound:
                    continue
                if any(base <= s <= e["t"] for s in stops.get(e.get("pid"), [])):
                    continue
                counts["late_refusals"] += 1
                problems.append(
                    f"breaker {name}: refused as open at {e['t']:.3f} (pid {e.get('pid')}), "
                    f"{e['t'] - base:.3f} s after {base:.3f} (its first admission after the "
                    f"clock_ahead of {fault.get('skew')} s at {t_f:.3f}, or its last open): "
                    f"held open past recovery_timeout {conf['recovery_timeout']} s "
                    f"+ {bound - float(conf['recovery_timeout']):g} s"
                )
    return problems, counts


_REISSUE = re.compile(r"^step (\S+): one fencing token (\d+) written by \d+ owners")


#: Seconds between the stall of a replica's feed and the ``lag`` it was told (the
#: nemesis stalls the proxy, then sleeps ``lag`` and promotes).
LAG_SLACK = 0.5


def reissued_tokens(problems: list[str], history: list[dict]) -> list[str]:
    """The problems among ``problems`` (runcheck's step messages) that are a fencing token
    given twice because a counter ahead of the clock lost a grant: "one fencing token F
    written by N owners" where F is ahead of the Redis time of its first grant (so it was
    ``counter + 1`` of a counter a ``clock_ahead`` fault before that grant left ahead of the
    clock, not the clock's time) and a Redis data-loss fault came between each two of its
    grants that could have lost the first (a restart; a failover or split brain whose
    replica's feed stalled before that grant): the failover lost the grant, and
    the counter it kept gave the same ``counter + 1`` again. docs/design.md: the token
    "strictly increases ... as long as the Redis clock moves forward"; here the stored
    counter is ahead of the clock. Returned with ``; after clock_ahead at <t> and <kind> at
    <t>`` appended (runcheck reports them apart, as the patterns' limits after a data
    loss)."""
    clock_faults = [
        e["t"] for e in history if e.get("ev") == "fault" and e.get("kind") == "clock_ahead"
    ]
    if not clock_faults:
        return []
    losses = [
        (e["t"], e["kind"], float(e.get("lag") or 0.0))
        for e in history
        if e.get("ev") == "fault"
        and e.get("kind") in ("redis_restart", "redis_failover", "split_brain")
    ]

    def lost_between(first: float, second: float):
        # the loss came between the two grants, and (a failover or split of a replica whose
        # feed was stalled ``lag`` seconds before it) the first grant fell in what the
        # replica missed; a restart without persistence forgets everything before it
        for t, kind, lag in losses:
            if first < t < second and (kind == "redis_restart" or first >= t - lag - LAG_SLACK):
                return t, kind
        return None

    excused = []
    for problem in problems:
        match = _REISSUE.match(problem)
        if not match:
            continue
        fence = int(match[2])
        grants = sorted(
            e["t"]
            for e in history
            if e.get("ev") == "acquired"
            and str(e.get("step")) == match[1]
            and e.get("fence") == fence
        )
        if not grants or fence / 1_000_000 <= grants[0]:
            continue  # a token of the clock's own time: no excuse
        before = [t for t in clock_faults if t <= grants[0]]
        lost = [lost_between(a, b) for a, b in zip(grants, grants[1:])]
        if before and lost and all(lost):
            excused.append(
                f"{problem}; after clock_ahead at {before[-1]:.3f} and {lost[0][1]} at "
                f"{lost[0][0]:.3f} (a counter ahead of the clock lost a grant)"
            )
    return excused


__all__ = [
    "check_breakers_after",
    "reissued_tokens",
    "inject_clock_ahead",
    "leave_clock_ahead",
    "redis_now_us",
    "LEASE_TIMES",
    "IDEM_TIMES",
]
