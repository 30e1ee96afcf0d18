"""Cluster-wide rate limits (celery_steplock.patterns.ratelimit) against a real Redis: parsing and
validation, the token bucket's and the sliding window's decisions, tickets (first come,
first served), the outage policy, the task option through a real execution, and the history
checkers with their negative controls."""

import time

import pytest

from celery_steplock import RateLimited, SlidingWindow, TokenBucket, signals
from celery_steplock.exceptions import ImproperlyConfigured, InvalidArgument, LockStoreUnavailable
from celery_steplock.patterns.ratelimit import TICKETS_HEADER, gate, parse_rate
from tests.support.oracles import bucket_excess, max_in_window


def _wait_until(moment: float, client) -> None:
    """Sleep until Redis TIME (seconds) passes ``moment``."""
    while True:
        seconds, micros = client.time()
        left = moment - (seconds + micros / 1e6)
        if left <= 0:
            return
        time.sleep(left + 0.002)


# -- parsing and validation --------------------------------------------------------------------


@pytest.mark.no_database
@pytest.mark.parametrize(
    "text,expected",
    [
        ("10/s", (10.0, 1.0)),
        ("100/m", (100.0, 60.0)),
        ("1000/h", (1000.0, 3600.0)),
        ("5/d", (5.0, 86400.0)),
        ("5/10s", (5.0, 10.0)),
        ("3 / 2 min", (3.0, 120.0)),
        ("2.5/s", (2.5, 1.0)),
        ("7/hours", (7.0, 3600.0)),
    ],
)
def test_rates_parse(text, expected):
    assert parse_rate(text) == expected


@pytest.mark.no_database
@pytest.mark.parametrize(
    "bad", ["10/x", "0/s", "-1/s", "ten/s", "10", "10/", "/s", "10/0s", "10/8d", 10, None, "1e3/s"]
)
def test_bad_rates_name_the_option(bad):
    with pytest.raises(ImproperlyConfigured) as info:
        parse_rate(bad, "cluster_rate_limit")
    assert info.value.setting == "cluster_rate_limit"
    assert "cluster_rate_limit" in str(info.value)


@pytest.mark.no_database
@pytest.mark.parametrize(
    "build,needle",
    [
        (lambda: TokenBucket(0), "rate"),
        (lambda: TokenBucket(-1), "rate"),
        (lambda: TokenBucket("10/x"), "not a rate"),
        (lambda: TokenBucket(1, capacity=0), "capacity"),
        (lambda: TokenBucket(1, capacity=1.5), "capacity"),
        (lambda: TokenBucket(1, capacity=True), "capacity"),
        (lambda: TokenBucket(float("nan")), "rate"),
        (lambda: SlidingWindow(0, 1), "limit"),
        (lambda: SlidingWindow(2.5, 1), "limit"),
        (lambda: SlidingWindow("2.5/s"), "limit"),
        (lambda: SlidingWindow(5, 0), "window"),
        (lambda: SlidingWindow(5, -1), "window"),
        (lambda: SlidingWindow(10**6, 1), "limit"),
        (lambda: SlidingWindow(5, 1, key="{x.y}"), "attribute"),
        (lambda: SlidingWindow(5, 1, key="{}"), "positional"),
        (lambda: SlidingWindow(5, 1, key=5), "template"),
        (lambda: SlidingWindow(5, 1, on_store_error="maybe"), "on_store_error"),
        (lambda: SlidingWindow(5, 1, max_wait=-1), "max_wait"),
    ],
)
def test_bad_limits_name_the_option(build, needle):
    with pytest.raises(ImproperlyConfigured) as info:
        build()
    assert info.value.setting == "cluster_rate_limit"
    assert needle in str(info.value)


@pytest.mark.no_database
def test_limits_describe_themselves():
    assert str(SlidingWindow("100/m")) == "100/60s window"
    assert (SlidingWindow("100/m").limit, SlidingWindow("100/m").window) == (100, 60.0)
    bucket = TokenBucket("600/m")
    assert (bucket.rate, bucket.capacity, str(bucket)) == (10.0, 10, "10/s bucket of 10")
    assert TokenBucket(0.5).capacity == 1


# -- token bucket ------------------------------------------------------------------------------


@pytest.mark.no_database
def test_bucket_bursts_to_capacity_then_refills_fractionally(redis_client):
    bucket = TokenBucket(4.0, capacity=3, client=redis_client)
    first = [bucket.try_acquire("tb") for _ in range(4)]
    assert [d.allowed for d in first] == [True, True, True, False]
    # Each took one token; the bucket refilled 4 per second (Redis time) meanwhile.
    assert [d.remaining for d in first[:3]] == pytest.approx(
        [2 - k + 4 * (d.now - first[0].now) for k, d in enumerate(first[:3])], abs=1e-4
    )
    # The next token is due a quarter second after the burst began (by Redis TIME).
    denied = first[3]
    assert denied.retry_after == pytest.approx(0.25 - (denied.now - first[0].now), abs=1e-4)
    assert denied.ticket is None  # not asked for one
    _wait_until(denied.now + denied.retry_after, redis_client)
    again = bucket.try_acquire("tb")
    assert again.allowed and again.remaining == pytest.approx(0, abs=0.05)
    assert not bucket.try_acquire("tb").allowed


@pytest.mark.no_database
def test_bucket_state_is_one_hash_that_expires_once_full(redis_client):
    bucket = TokenBucket(10.0, capacity=5, client=redis_client, prefix="p")
    bucket.try_acquire("idle")
    key = "p:rate:tb:10.0:5:{idle}"
    assert redis_client.type(key) == "hash"
    # one token short of full: refilled in 0.1 s, gone a second after that
    assert 900 < redis_client.pttl(key) <= 1100
    assert set(redis_client.hgetall(key)) == {"tokens", "ts"}


@pytest.mark.no_database
def test_bucket_never_exceeds_capacity_plus_rate_t(redis_client):
    bucket = TokenBucket(50.0, capacity=5, client=redis_client)
    grants = []
    end = time.monotonic() + 0.6
    while time.monotonic() < end:
        decision = bucket.try_acquire("tight")
        if decision.allowed:
            grants.append(decision.now)
    assert len(grants) >= 5 + 50 * 0.5  # it did admit at the rate
    # float seconds near 1.8e9 hold about 0.24 us: 1e-3 token is 20 us at this rate
    assert bucket_excess(grants, 50.0, 5) <= 1e-3


# -- sliding window -------------------------------------------------------------------------------


@pytest.mark.no_database
def test_window_admits_limit_per_any_window_and_denials_consume_nothing(redis_client):
    window = SlidingWindow(3, 0.5, client=redis_client)
    decisions = [window.try_acquire("sw") for _ in range(10)]
    assert [d.allowed for d in decisions] == [True] * 3 + [False] * 7
    key = decisions[0].key
    assert redis_client.zcard(key) == 3  # seven denials wrote nothing
    oldest = min(d.now for d in decisions[:3])
    denied = decisions[-1]
    assert denied.retry_after == pytest.approx(oldest + 0.5 - denied.now, abs=0.002)
    assert 0.4 < redis_client.pttl(key) / 1000 <= 1.5


@pytest.mark.no_database
def test_window_is_exact_over_any_window(redis_client):
    window = SlidingWindow(5, 0.2, client=redis_client)
    grants = []
    end = time.monotonic() + 0.7
    while time.monotonic() < end:
        decision = window.try_acquire("exact")
        if decision.allowed:
            grants.append(decision.now)
    assert len(grants) >= 15
    most, where = max_in_window(grants, 0.2)
    assert most == 5, [round((g - where) * 1000, 3) for g in sorted(grants) if g >= where][:8]


@pytest.mark.no_database
def test_keys_share_one_cluster_slot_and_differ_per_limit(redis_client):
    keys = SlidingWindow(3, 1).redis_key("steplock", "tenant:7")
    assert all(k.endswith(":{tenant:7}") for k in keys) and len(set(keys)) == 3
    assert SlidingWindow(3, 1).redis_key("s", "a") != SlidingWindow(4, 1).redis_key("s", "a")
    with pytest.raises(Exception, match="braces"):
        SlidingWindow(3, 1, client=redis_client).try_acquire("a{b}")


# -- what a decision costs Redis ---------------------------------------------------------------


def _commands(client, decide) -> dict[str, int]:
    """The Redis commands ``decide()`` ran, a script's inner ones included (INFO
    commandstats, lower case: ``{"zcard": 1, ...}``), INFO and CONFIG left out."""

    def calls() -> dict[str, int]:
        return {
            name.split("_", 1)[1]: stats["calls"]
            for name, stats in client.info("commandstats").items()
            if not name.startswith(("cmdstat_info", "cmdstat_config"))
        }

    before = calls()
    decide()
    after = calls()
    return {name: n - before.get(name, 0) for name, n in after.items() if n > before.get(name, 0)}


@pytest.mark.no_database
def test_without_tickets_the_queue_costs_one_zcard_and_denials_write_nothing(redis_client):
    """While no ticket waits, the queue is one ZCARD (no clamp, trim or rank); a bucket's
    denial writes nothing; a window's denial reads one log entry by rank, and only an
    admission to a full log trims it."""
    bucket = TokenBucket(1.0, capacity=1, client=redis_client)
    window = SlidingWindow(2, 60.0, client=redis_client)
    bucket.try_acquire("warm"), window.try_acquire("warm")  # scripts loaded
    base = {"evalsha": 1, "time": 1}
    assert _commands(redis_client, lambda: bucket.try_acquire("b")) == {
        **base,
        "zcard": 1,
        "hmget": 1,
        "hset": 1,
        "pexpire": 1,
    }
    key = bucket.redis_key("steplock", "b")[0]
    state = redis_client.hgetall(key)
    assert _commands(redis_client, lambda: bucket.try_acquire("b")) == {
        **base,
        "zcard": 1,
        "hmget": 1,
    }
    assert redis_client.hgetall(key) == state
    # an admission to a log shorter than the limit counts it, with no trim
    assert _commands(redis_client, lambda: window.try_acquire("w")) == {
        **base,
        "zcard": 1,
        "zrange": 2,
        "zcount": 1,
        "zadd": 1,
        "pexpire": 1,
    }
    assert window.try_acquire("w").allowed
    assert _commands(redis_client, lambda: window.try_acquire("w")) == {
        **base,
        "zcard": 1,
        "zrange": 1,
    }
    assert redis_client.zcard(window.redis_key("steplock", "w")[0]) == 2
    # a full log whose oldest grants left the window is trimmed by the admission
    short = SlidingWindow(2, 0.05, client=redis_client)
    first = [short.try_acquire("t") for _ in range(2)]
    _wait_until(max(d.now for d in first) + 0.05, redis_client)
    assert _commands(redis_client, lambda: short.try_acquire("t")) == {
        **base,
        "zcard": 2,
        "zrange": 2,
        "zremrangebyscore": 1,
        "zadd": 1,
        "pexpire": 1,
    }
    assert redis_client.zcard(short.redis_key("steplock", "t")[0]) == 1


@pytest.mark.no_database
def test_a_window_denial_waits_for_the_grant_that_frees_its_place(redis_client):
    """Behind ``p`` tickets the wait is the expiry of the log's ``(limit - p)``-th latest
    grant (read by rank), and past the limit's worth of tickets whole windows later (the
    full count): both against the grants' own Redis times."""
    window = SlidingWindow(3, 5.0, client=redis_client)
    grants = sorted(window.try_acquire("places").now for _ in range(3))
    places = [window.try_acquire("places", reserve=True) for _ in range(7)]
    assert [d.allowed for d in places] == [False] * 7
    assert [d.queued for d in places] == list(range(7))
    for place, denied in enumerate(places):
        due = grants[place % 3] + 5.0 * (place // 3 + 1)
        assert denied.retry_after == pytest.approx(due - denied.now, abs=2e-6), place


@pytest.mark.no_database
def test_a_window_whose_last_grant_is_a_little_ahead_counts_from_it(redis_client):
    """A clock that went back by less than the tolerance: the admission is recorded at the
    last grant's time, not before it, and reported with that time; no skew."""
    window = SlidingWindow(2, 10.0, client=redis_client)
    log = window.redis_key("steplock", "back")[0]
    seconds, micros = redis_client.time()
    ahead = seconds * 1000.0 + micros / 1000.0 + 500.0
    redis_client.zadd(log, {"earlier": ahead})
    decision = window.try_acquire("back")
    assert decision.allowed and decision.skew == 0.0 and decision.remaining == 0
    assert decision.now == ahead / 1000.0
    assert redis_client.zscore(log, decision.member) == ahead


# -- tickets: first come, first served -------------------------------------------------------------


@pytest.mark.no_database
@pytest.mark.parametrize(
    "limiter,pause",
    [(SlidingWindow(2, 0.8), 0.2), (TokenBucket(5.0, capacity=2), 0.0)],
    ids=["window", "bucket"],
)
def test_an_early_waiter_runs_before_later_newcomers(redis_client, limiter, pause):
    limiter.client = redis_client
    assert limiter.try_acquire("fair").allowed
    time.sleep(pause)  # the window's two grants expire 0.2 s apart
    assert limiter.try_acquire("fair").allowed
    waiter = limiter.try_acquire("fair", reserve=True)
    assert not waiter.allowed and waiter.ticket and waiter.queued == 0
    # Newcomers keep arriving; each is refused while the waiter's turn is pending, and
    # none of them jumps the queue when the quota frees.
    _wait_until(waiter.now + waiter.retry_after, redis_client)
    newcomer = limiter.try_acquire("fair")
    assert not newcomer.allowed and newcomer.queued == 1
    held = limiter.try_acquire("fair", ticket=waiter.ticket)
    assert held.allowed
    queue = limiter.redis_key("steplock", "fair")[1]
    assert redis_client.zcard(queue) == 0  # the ticket is used up


@pytest.mark.no_database
def test_tickets_are_served_in_order(redis_client):
    window = SlidingWindow(1, 0.3, client=redis_client)
    assert window.try_acquire("order").allowed
    first = window.try_acquire("order", reserve=True)
    second = window.try_acquire("order", reserve=True)
    assert (first.queued, second.queued) == (0, 1)
    assert second.retry_after > first.retry_after + 0.25  # a window later
    _wait_until(first.now + first.retry_after, redis_client)
    assert not window.try_acquire("order", ticket=second.ticket).allowed  # not its turn
    assert window.try_acquire("order", ticket=first.ticket).allowed
    again = window.try_acquire("order", ticket=second.ticket, reserve=True)
    assert not again.allowed and again.ticket == second.ticket and again.queued == 0


@pytest.mark.no_database
def test_an_unused_ticket_expires_and_frees_the_quota(redis_client):
    window = SlidingWindow(1, 0.2, ticket_grace=0.5, client=redis_client)
    assert window.try_acquire("gone").allowed
    ghost = window.try_acquire("gone", reserve=True)
    assert ghost.ticket
    _wait_until(ghost.now + ghost.retry_after, redis_client)
    assert not window.try_acquire("gone").allowed  # the quota waits for the ticket
    _wait_until(ghost.now + ghost.retry_after + 0.5, redis_client)
    assert window.try_acquire("gone").allowed  # its holder never came: dropped


@pytest.mark.no_database
def test_no_ticket_past_max_wait(redis_client):
    window = SlidingWindow(1, 1.0, max_wait=1.5, client=redis_client)
    assert window.try_acquire("flood").allowed
    tickets = [window.try_acquire("flood", reserve=True) for _ in range(4)]
    assert [bool(d.ticket) for d in tickets] == [True, False, False, False]
    assert tickets[1].retry_after > 1.5
    queue = window.redis_key("steplock", "flood")[1]
    assert redis_client.zcard(queue) == 1


# -- the plain API ---------------------------------------------------------------------------------


@pytest.mark.no_database
def test_context_manager_and_decorator(redis_client):
    window = SlidingWindow(2, 5, client=redis_client)
    ran = []
    with window.acquire("api") as decision:
        ran.append(decision.remaining)
    with window.acquire("api"):
        ran.append("second")
    with pytest.raises(RateLimited) as info:
        with window.acquire("api"):
            ran.append("never")
    assert ran == [1.0, "second"]
    assert 4 < info.value.retry_after <= 5 and info.value.key.endswith(":{api}")
    assert info.value.limit == "2/5s window"

    per_user = TokenBucket(1.0, capacity=1, client=redis_client)

    @per_user.using("user:{user}")
    def call(user, payload=None):
        return f"called {user}"

    assert call("ann") == "called ann" and call("bob") == "called bob"
    with pytest.raises(RateLimited):
        call("ann")
    assert redis_client.exists("steplock:rate:tb:1.0:1:{user:ann}")
    with pytest.raises(InvalidArgument):
        SlidingWindow(1, 1, key="t:{x}", client=redis_client).try_acquire()


@pytest.mark.no_database
def test_outage_fails_closed_by_default_and_open_when_asked():
    from celery_steplock.lock import make_client
    from tests.helpers import closed_port_url

    dead = make_client(closed_port_url())
    with pytest.raises(LockStoreUnavailable):
        SlidingWindow(1, 1, client=dead).try_acquire("down")
    opened = SlidingWindow(1, 1, client=dead, on_store_error="fail_open")
    assert [opened.try_acquire("down").allowed for _ in range(3)] == [True] * 3


def test_the_plain_api_sends_the_decision_signals(redis_client):
    """Outside a task too, every decision is a signal (sender None) and a log line."""
    seen = []

    def receiver(signal=None, sender=None, **fields):
        seen.append(
            (signal.name, sender, fields["key"], fields["limit"], fields.get("retry_after"))
        )

    for signal in (signals.rate_limit_allowed, signals.rate_limited):
        signal.connect(receiver, weak=False)
    try:
        limiter = SlidingWindow(1, 5, client=redis_client)
        limiter.try_acquire("plain-signals")
        with pytest.raises(RateLimited):
            with limiter.acquire("plain-signals"):
                pass
    finally:
        for signal in (signals.rate_limit_allowed, signals.rate_limited):
            signal.disconnect(receiver)
    key = "steplock:rate:sw:1:5.0:{plain-signals}"
    assert [(n, s, k, lim) for n, s, k, lim, _ in seen] == [
        ("rate_limit_allowed", None, key, "1/5s window"),
        ("rate_limited", None, key, "1/5s window"),
    ]
    assert 4 < seen[1][4] <= 5


# -- the task option -------------------------------------------------------------------------


class _Task:
    name = "tests.rl"

    def __init__(self, **options):
        self.__dict__.update(options)

    def run(self, tenant, amount=0):
        pass


class _Settings:
    rate_limit_on_store_error = "fail_closed"


@pytest.mark.no_database
def test_gate_reads_the_options_and_names_bad_ones():
    assert gate(_Task(), _Settings()) is None
    built = gate(
        _Task(
            cluster_rate_limit=["10/s", TokenBucket(2, 4)],
            cluster_rate_limit_key="tenant:{tenant}",
        ),
        _Settings(),
    )
    assert [str(x) for x in built.limiters] == ["10/1s window", "2/s bucket of 4"]
    for options, setting, needle in [
        ({"cluster_rate_limit": "10/x"}, "cluster_rate_limit", "not a rate"),
        ({"cluster_rate_limit": 10}, "cluster_rate_limit", "rate string"),
        ({"cluster_rate_limit": []}, "cluster_rate_limit", "empty"),
        (
            {"cluster_rate_limit": "1/s", "cluster_rate_limit_key": "t:{nope}"},
            "cluster_rate_limit_key",
            "'nope', which is not an argument",
        ),
        (
            {"cluster_rate_limit": SlidingWindow(1, 1, key="t:{nope}")},
            "cluster_rate_limit",
            "'nope'",
        ),
        (
            {"cluster_rate_limit": "1/s", "cluster_rate_limit_key": 3},
            "cluster_rate_limit_key",
            "template",
        ),
    ]:
        with pytest.raises(ImproperlyConfigured) as info:
            gate(_Task(**options), _Settings())
        assert info.value.setting == setting and needle in str(info.value), options


@pytest.mark.no_database
def test_history_checkers_flag_a_violation():
    # negative controls: the checkers fail on histories that break the limit
    assert max_in_window([0.0, 0.1, 0.2, 0.95], 1.0) == (4, 0.0)
    assert max_in_window([0.0, 0.1, 0.2, 1.0], 1.0)[0] == 3  # [t, t + window): 1.0 is out
    at = 1796149537.899604  # one window apart to the microsecond, near today's epoch
    assert max_in_window([at, at + 0.2], 0.2)[0] == 1
    assert max_in_window([at, at + 0.199999], 0.2)[0] == 2
    assert bucket_excess([0.0, 0.0, 0.0], 1.0, 2) == pytest.approx(1.0)
    assert bucket_excess([0.0, 0.0, 1.0], 1.0, 2) == pytest.approx(0.0)
    assert bucket_excess([], 1.0, 2) == 0.0


def test_the_option_gates_a_real_execution(app, redis_client, events):
    from celery_steplock.task import StepLockedTask

    @app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.rl.eager",
        lock_key="rl:{n}",
        cluster_rate_limit="2/5s",
        cluster_rate_limit_key="tenant:{tenant}",
        lock_retry_max=0,
        shared=False,
    )
    def limited(self, tenant, n):
        return f"ran {n}"

    assert limited.apply(args=("a", 1)).get() == "ran 1"
    assert limited.apply(args=("a", 2)).get() == "ran 2"
    assert limited.apply(args=("b", 3)).get() == "ran 3"  # another tenant, another limit
    denied = limited.apply(args=("a", 4))
    assert isinstance(denied.result, RateLimited)  # lock_retry_max=0: no re-queue left
    assert denied.result.option == "cluster_rate_limit"
    assert denied.result.key.endswith(":{tenant:a}") and 3 < denied.result.retry_after <= 5
    assert denied.result.context["headers"] == {
        TICKETS_HEADER: {denied.result.key: denied.result.context["ticket"]}
    }
    seen = [
        (name, kw.get("name"))
        for name, kw in events
        if name in ("rate_limit_allowed", "rate_limited")
    ]
    assert seen == [
        ("rate_limit_allowed", "tenant:a"),
        ("rate_limit_allowed", "tenant:a"),
        ("rate_limit_allowed", "tenant:b"),
        ("rate_limited", "tenant:a"),
    ]
    limited_kw = [kw for name, kw in events if name == "rate_limited"][0]
    assert limited_kw["limit"] == "2/5s window" and limited_kw["task_name"] == "tests.rl.eager"
    assert signals.rate_limited in signals.ALL_SIGNALS


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_an_outage_at_the_gate_follows_the_limit_policy(app, policy, events):
    from celery_steplock.exceptions import LockStoreUnavailable
    from celery_steplock.task import StepLockedTask
    from tests.helpers import closed_port_url, set_settings

    def body(self, n):
        return f"ran {n}"

    name = f"tests.rl.outage.{policy}"
    # The lease fails open too, so the execution reaches the gate with Redis down.
    limited = app.tasks.get(name) or app.task(
        bind=True,
        base=StepLockedTask,
        name=name,
        lock_key="rl-outage:{n}",
        on_store_error="fail_open",
        lock_retry_max=0,
        shared=False,
        cluster_rate_limit=SlidingWindow(1, 60, on_store_error=policy),
    )(body)
    set_settings(app, steplock_redis_url=closed_port_url())
    try:
        results = [limited.apply(args=(n,)) for n in (1, 2)]
    finally:
        set_settings(app, steplock_redis_url=app.conf.broker_url)
    if policy == "fail_open":
        assert [r.get() for r in results] == ["ran 1", "ran 2"]  # past a 1/60s limit
    else:
        assert all(isinstance(r.result, LockStoreUnavailable) for r in results)
    errors = [
        kw
        for name_, kw in events
        if name_ == "lock_store_error" and str(kw.get("reason", "")).startswith("rate limit")
    ]
    assert [kw["policy"] for kw in errors] == [policy, policy]


@pytest.mark.no_database
def test_bad_options_are_task_problems_for_the_checks(celery_app_configured):
    from celery_steplock import plan as plan_module
    from celery_steplock.task import StepLockedTask

    app = celery_app_configured

    # shared=False: a shared task would join every app made later (a worker's checks).
    @app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.rl.bad",
        lock_key="rl-bad:{n}",
        cluster_rate_limit="10/x",
        cluster_rate_limit_key="t:{nope}",
        shared=False,
    )
    def bad(self, n):
        return n

    try:
        problems = plan_module.option_problems(bad)
        # The key is judged first; once it is fixed, the rate is reported.
        assert [p.setting for p in problems] == ["cluster_rate_limit_key"]
        assert "tests.rl.bad: cluster_rate_limit_key 't:{nope}' names 'nope'" in str(problems[0])
        bad.cluster_rate_limit_key = "t:{n}"
        problems = plan_module.option_problems(bad)
        assert [p.setting for p in problems] == ["cluster_rate_limit"]
        assert "'10/x' is not a rate" in str(problems[0])
        assert {"cluster_rate_limit", "cluster_rate_limit_key"} <= plan_module.OPTION_NAMES
    finally:
        app.tasks.pop("tests.rl.bad", None)


def test_a_later_limit_refusing_gives_back_the_earlier_admissions(app, redis_client):
    from celery_steplock.task import StepLockedTask

    @app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.rl.list",
        lock_key="rl-list:{n}",
        cluster_rate_limit=[
            SlidingWindow(5, 60),
            TokenBucket(0.001, capacity=5),
            SlidingWindow(1, 60),
        ],
        lock_retry_max=0,
        shared=False,
    )
    def listed(self, n):
        return n

    try:
        assert listed.apply(args=(1,)).get() == 1
        denied = listed.apply(args=(2,))
        assert isinstance(denied.result, RateLimited)
        assert denied.result.limit == "1/60s window"
        prefix = listed.steplock_plan.store.prefix
        window = SlidingWindow(5, 60).redis_key(prefix, "tests.rl.list")[0]
        bucket = TokenBucket(0.001, capacity=5).redis_key(prefix, "tests.rl.list")[0]
        assert redis_client.zcard(window) == 1  # the second grant was given back
        assert float(redis_client.hget(bucket, "tokens")) == pytest.approx(4, abs=0.01)
    finally:
        app.tasks.pop("tests.rl.list", None)


@pytest.mark.no_database
def test_decisions_are_counted_by_the_prometheus_metrics():
    import prometheus_client  # requirements/test.txt: never skipped

    from celery_steplock.contrib.prometheus import Metrics

    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry=registry)
    for event in ("rate_limit_allowed", "rate_limit_allowed", "rate_limited"):
        metrics.receive(event=event, task_name="t", limit="5/1s window", key="k")

    def value(decision):
        return registry.get_sample_value(
            "steplock_rate_limit_decisions_total",
            {"task": "t", "limit": "5/1s window", "decision": decision},
        )

    assert (value("allowed"), value("limited")) == (2.0, 1.0)


# -- the ticket header: malformed, copied ------------------------------------------------------


def _refused(caplog) -> list[dict]:
    return [
        r.steplock
        for r in caplog.records
        if getattr(r, "steplock", {}).get("event") == "rate_limit_ticket_refused"
    ]


def _ticketed_task(app, name, **options):
    from celery_steplock.task import StepLockedTask

    def body(self, tenant, n):
        return f"ran {n}"

    return app.task(
        bind=True,
        base=StepLockedTask,
        name=name,
        lock_key=name + ":{n}",
        cluster_rate_limit_key="tenant:{tenant}",
        lock_retry_max=0,
        shared=False,
        **options,
    )(body)


@pytest.mark.parametrize(
    "header",
    [
        "forged",
        ["a", "b"],
        [("k", "v")],
        12345,
        {"KEY": 123},
        {"KEY": ["x"]},
        {"KEY": "f" * 100_000},
        {"KEY": "not a ticket"},
        {"KEY": "ABCDEF0123456789ABCDEF0123456789"},
    ],
    ids=["str", "list", "pairs", "int", "int-ticket", "list-ticket", "huge", "text", "upper"],
)
def test_a_malformed_ticket_header_is_no_ticket_and_is_logged(app, redis_client, caplog, header):
    name = "tests.rl.malformed"
    limited = _ticketed_task(app, name, cluster_rate_limit=SlidingWindow(5, 60))
    try:
        key = limited.steplock_plan.store.prefix
        redis_key = SlidingWindow(5, 60).redis_key(key, "tenant:a")[0]
        if isinstance(header, dict):
            header = {redis_key: header["KEY"]}
        caplog.set_level("INFO", logger="celery_steplock")
        result = limited.apply(args=("a", 1), headers={TICKETS_HEADER: header})
        assert result.get() == "ran 1"  # admitted against the limit, as a newcomer
        refused = _refused(caplog)
        assert len(refused) == 1, refused
        assert refused[0]["task_name"] == name and refused[0]["reason"]
        assert len(str(refused[0])) < 2000  # the value is never logged whole
        assert redis_client.zcard(SlidingWindow(5, 60).redis_key(key, "tenant:a")[1]) == 0
    finally:
        app.tasks.pop(name, None)


def test_a_denial_never_carries_a_malformed_header_forward(app, redis_client, caplog):
    name = "tests.rl.malformed.forward"
    limited = _ticketed_task(app, name, cluster_rate_limit=SlidingWindow(1, 60))
    try:
        assert limited.apply(args=("a", 1)).get() == "ran 1"
        forged = {"other-key": "f" * 100_000, "x": ["y"]}
        denied = limited.apply(args=("a", 2), headers={TICKETS_HEADER: forged})
        assert isinstance(denied.result, RateLimited)
        carried = denied.result.context["headers"][TICKETS_HEADER]
        assert carried == {denied.result.key: denied.result.context["ticket"]}
    finally:
        app.tasks.pop(name, None)


def _queued(events) -> int:
    return [kw for name, kw in events if name == "rate_limited"][-1]["queued"]


def test_a_copied_ticket_does_not_take_the_waiters_place(app, redis_client, events):
    name = "tests.rl.copied"
    limiter = SlidingWindow(1, 1.0, ticket_grace=60.0, max_wait=60.0)
    limited = _ticketed_task(app, name, cluster_rate_limit=limiter)
    try:
        assert limited.apply(args=("a", 1), task_id="holder").get() == "ran 1"
        waiter = limited.apply(args=("a", 2), task_id="waiter")
        assert isinstance(waiter.result, RateLimited)
        ticket = waiter.result.context["ticket"]
        header = waiter.result.context["headers"]
        assert ticket and _queued(events) == 0
        now = redis_client.time()
        _wait_until(now[0] + now[1] / 1e6 + waiter.result.retry_after, redis_client)
        # The waiter's header copied into messages of another task id, and of the waiter's
        # task id with other arguments (same limit key): newcomers behind the waiter.
        for task_id, args in (("thief", ("a", 2)), ("waiter", ("a", 99))):
            copy = limited.apply(args=args, task_id=task_id, headers=header)
            assert isinstance(copy.result, RateLimited), (task_id, args, copy.result)
            assert copy.result.context["ticket"] != ticket
            assert _queued(events) >= 1
        # A ticket of tenant a presented for tenant b's limit is no ticket there.
        assert limited.apply(args=("b", 7), task_id="b-holder").get() == "ran 7"
        other = {TICKETS_HEADER: {waiter.result.key.replace("{tenant:a}", "{tenant:b}"): ticket}}
        moved = limited.apply(args=("b", 2), task_id="waiter", headers=other)
        assert isinstance(moved.result, RateLimited) and moved.result.context["ticket"] != ticket
        # The waiter itself comes back with its ticket and is admitted at its turn.
        assert limited.apply(args=("a", 2), task_id="waiter", headers=header).get() == "ran 2"
    finally:
        app.tasks.pop(name, None)


@pytest.mark.no_database
@pytest.mark.parametrize("bad", [123, ["x"], "f" * 100_000, "not a ticket", b"f" * 32])
def test_the_plain_api_refuses_a_ticket_that_is_no_ticket(redis_client, bad):
    window = SlidingWindow(1, 60, client=redis_client)
    with pytest.raises(InvalidArgument) as info:
        window.try_acquire("plain", ticket=bad)
    assert info.value.argument == "ticket" and len(str(info.value)) < 500
    assert redis_client.keys("*") == []  # refused before any write


# -- corrupt state (issue 26 review) -----------------------------------------------------------


@pytest.mark.no_database
@pytest.mark.parametrize("tokens", ["-1e30", "nan", "inf"])
def test_a_corrupt_bucket_never_answers_retry_now_and_heals(redis_client, tokens):
    """A bucket hash whose ``tokens`` no decision could have written (below zero, NaN, infinite) is
    not trusted: a denial's ``retry_after`` is never 0 nor a wrapped-around integer, and
    the bucket admits again once its refill is due (a denial that writes nothing must not
    leave a corrupt state to deny forever)."""
    bucket = TokenBucket(10.0, capacity=2, client=redis_client)
    key = bucket.redis_key("steplock", "corrupt")[0]
    seconds, micros = redis_client.time()
    # a moment just ahead of now (inside the skew tolerance): no refill on the next decision
    redis_client.hset(
        key, mapping={"tokens": tokens, "ts": repr(seconds * 1000.0 + micros / 1000.0 + 300.0)}
    )
    decision = bucket.try_acquire("corrupt")
    assert decision.allowed or 0.0 < decision.retry_after <= 0.5, decision
    _wait_until(decision.now + decision.retry_after + 0.001, redis_client)
    assert bucket.try_acquire("corrupt").allowed
    assert float(redis_client.hget(key, "tokens")) >= 0.0


def test_a_rate_limited_task_logs_one_info_line_per_execution(app, redis_client, caplog):
    """The decisions are DEBUG lines (the metrics count them); each execution's INFO line is
    its execution_done, the denial's with its reason."""
    import logging

    from celery_steplock.task import StepLockedTask

    @app.task(
        bind=True,
        base=StepLockedTask,
        name="tests.rl.logged",
        lock_key="rl-log:{n}",
        cluster_rate_limit="1/5s",
        lock_retry_max=0,
        shared=False,
    )
    def limited(self, n):
        return n

    with caplog.at_level(logging.DEBUG, logger="celery_steplock"):
        assert limited.apply(args=(1,), task_id="rl-1").get() == 1
        assert isinstance(limited.apply(args=(2,), task_id="rl-2").result, RateLimited)
    ours = [r for r in caplog.records if hasattr(r, "steplock")]
    info = [
        (r.steplock["task_id"], r.steplock["event"], r.steplock.get("outcome"))
        for r in ours
        if r.levelno >= logging.INFO
    ]
    assert info[0] == ("rl-1", "execution_done", "done")
    assert [e for _, e, _ in info].count("execution_done") == 2
    assert all(e == "execution_done" for _, e, _ in info), info
    assert {r.steplock["event"]: r.levelname for r in ours}["rate_limited"] == "DEBUG"
    assert {r.steplock["event"]: r.levelname for r in ours}["rate_limit_allowed"] == "DEBUG"
