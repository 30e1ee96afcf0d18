"""The fence decides: split-brain scenarios where only the fencing token can refuse the stale
writer (``tests/support/faults/scenarios.py``, :data:`FENCE_SCENARIOS`).

On the guarded lab the stale holder's CAS finds the status it expects, its own Redis still
renews its lease, and the fence condition alone refuses it; the step still ends with exactly
one terminal commit. On a lab whose CAS drops the fence condition (status CAS, pre-check and
ownership check kept) the stale write commits and the checker must report it.
"""

import pytest

from tests.support.faults import scenarios
from tests.support.faults.checker import TERMINAL
from tests.support.faults.scenarios import FENCE_SCENARIOS

pytestmark = [pytest.mark.faults, pytest.mark.workers, pytest.mark.django_db(transaction=True)]

STALE = {"forward": "done", "compensate": "cancelled"}


@pytest.fixture(scope="module")
def fence_lab(make_lab):
    return make_lab(worker_stores=True)


@pytest.fixture(scope="module")
def nofence_lab(make_lab):
    return make_lab(worker_stores=True, guard="nofence")


def _trial(lab, name):
    outcome = scenarios.run(lab, FENCE_SCENARIOS[name])
    print(f"{name} ({lab.guard}): {outcome.verdict} in {outcome.seconds:.1f}s")
    history = lab.history()
    step = next(e["step"] for e in history if e["ev"] == "trial")
    from django_app.workflows.models import TransitionRecord

    records = list(TransitionRecord.objects.filter(step_id=step).order_by("id"))
    stale_task = "compensate" if "compensate" in name else "forward"
    # The stale holder: the first attempt of the step, the one stopped at its barrier.
    first = next(
        e for e in history if e["ev"] == "acquired" and e["step"] == step and e.get("owner")
    )
    assert first["task"].endswith(f".{stale_task}")
    return outcome, history, step, records, first


def _mine(history, step, owner, ev, **match):
    return [
        e
        for e in history
        if e["ev"] == ev
        and e.get("step") == step
        and e.get("owner") == owner
        and all(e.get(k) == v for k, v in match.items())
    ]


@pytest.mark.parametrize("name", list(FENCE_SCENARIOS))
def test_only_the_fence_refuses_the_stale_holder(fence_lab, name):
    outcome, history, step, records, stale = _trial(fence_lab, name)
    verdict = outcome.verdict
    assert verdict.violations == []
    assert verdict.leftover_leases == 0 and verdict.keys_without_ttl == 0
    assert verdict.overlaps == 1  # the split brain: two holders at once
    assert verdict.stale_rejected == 1
    assert verdict.resumes == 0

    to = STALE["compensate" if "compensate" in name else "forward"]
    back_by = "reaper" if "reaper" in name else "django_app.faults.tasks.reset"
    chain = [(r.from_status, r.to_status) for r in records]
    assert chain == [("pending", "running"), ("running", "pending"), ("pending", to)]
    assert records[1].task_name == back_by
    assert [r.to_status in TERMINAL for r in records].count(True) == 1
    assert all(r.owner != stale["owner"] for r in records)  # the stale holder wrote nothing

    # When it went on, its own side of the split still said it owned the lease (the ownership
    # check would pass); the other side had no lease at all (the newer holders had released).
    (view,) = [e for e in history if e["ev"] == "split_view" and e["step"] == step]
    assert view["minority"]["owner"] == stale["owner"]
    assert view["minority"]["fence"] == stale["fence"]
    assert view["minority"]["pttl_ms"] > 0
    assert view["majority"] == {"owner": None, "fence": None, "pttl_ms": None}
    # Its CAS found the status it expected; the row carried a newer fence: the fence refused.
    (refused,) = _mine(history, step, stale["owner"], "fence_refused")
    assert refused["current"] == "pending" and refused["from_"] == "pending"
    assert refused["row_fence"] > stale["fence"]
    if back_by == "reaper":  # it leaves the fence column as the running holder wrote it
        assert records[1].fence is None and refused["row_fence"] == records[0].fence
    else:
        assert refused["row_fence"] == records[1].fence > records[0].fence
    (conflict,) = _mine(history, step, stale["owner"], "conflict")
    assert conflict["current"] == "pending"
    assert conflict["reason"] == "stale fence: the status matched, the fence refused"
    # Nothing else stopped it first: no lost lease before the CAS, no store error, and the
    # pre-commit ownership check (after the CAS) never ran.
    assert not [e for e in _mine(history, step, stale["owner"], "lost") if e["t"] < refused["t"]]
    assert _mine(history, step, stale["owner"], "store_error") == []
    assert _mine(history, step, stale["owner"], "point", point="before_commit") == []
    # The newer holders' grants were newer; the one terminal commit carries the newest fence.
    start_fence = records[0].fence
    assert start_fence > stale["fence"]
    assert records[2].fence > refused["row_fence"]
    assert outcome.seconds < 30


@pytest.mark.parametrize("name", list(FENCE_SCENARIOS))
def test_a_guard_without_the_fence_commits_the_stale_write(nofence_lab, name):
    outcome, history, step, records, stale = _trial(nofence_lab, name)
    verdict = outcome.verdict
    to = STALE["compensate" if "compensate" in name else "forward"]
    chain = [(r.from_status, r.to_status) for r in records]
    assert chain == [("pending", "running"), ("running", "pending"), ("pending", to)]
    assert records[2].owner == stale["owner"] and records[2].fence == stale["fence"]
    assert records[0].fence > stale["fence"]
    (view,) = [e for e in history if e["ev"] == "split_view" and e["step"] == step]
    assert view["minority"]["owner"] == stale["owner"] and view["minority"]["pttl_ms"] > 0
    # The status CAS and the ownership check both passed: nothing but the fence could refuse.
    assert _mine(history, step, stale["owner"], "point", point="before_commit") != []
    assert _mine(history, step, stale["owner"], "fence_refused") == []
    fences = [r.fence for r in records if r.fence is not None]
    assert len(verdict.violations) == 2, verdict.violations
    assert verdict.violations[0] == (
        f"step {step}: a stale holder wrote after a newer one (fences {fences})"
    )
    assert verdict.violations[1].startswith(
        f"step {step}: holder {stale['owner'][:8]} (fence {stale['fence']}) committed after "
    )
    assert verdict.leftover_leases == 0


def _get(proxy, key):
    import redis

    client = redis.Redis(
        host="127.0.0.1", port=proxy.port, decode_responses=True, socket_timeout=5
    )
    try:
        return client.get(key)
    finally:
        client.close()


def _open(proxy):
    import socket

    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(b"PING\r\n")
    assert sock.recv(64) == b"+PONG\r\n"
    return sock


def _reset(sock) -> bool:
    """Whether the proxy chain ended this connection (EOF or RST on the next round trip)."""
    try:
        sock.sendall(b"PING\r\n")
        return sock.recv(64) == b""
    except OSError:
        return True
    finally:
        sock.close()


def test_split_store_moves_only_the_majority_and_heal_split_rejoins_the_winner(fence_lab):
    lab = fence_lab
    lab.new_trial()
    lab.start_replica()
    lab.store_client().set("faults-split", "old primary")  # the stalled replica never sees it
    w1, w2 = lab.worker_store_proxy("w1"), lab.worker_store_proxy("w2")
    assert _get(w1, "faults-split") == _get(w2, "faults-split") == "old primary"
    held = {name: _open(proxy) for name, proxy in (("w1", w1), ("w2", w2))}

    entry = lab.split_store(minority=("w1",))
    assert (entry["kind"], entry["minority"], entry["majority"]) == ("split_store", ["w1"], ["w2"])
    assert entry["to_port"] == lab.replica.port
    assert _get(w1, "faults-split") == "old primary"
    assert _get(w2, "faults-split") is None  # the promoted replica
    assert lab.store_client().get("faults-split") == "old primary"
    assert _reset(held["w2"]) is True  # the majority's connections were reset
    held["w2"] = _open(w2)
    with pytest.raises(RuntimeError, match="split already"):
        lab.split_store(minority=("w1",))

    entry = lab.heal_split()
    assert (entry["kind"], entry["minority"], entry["majority"]) == ("heal_split", ["w1"], ["w2"])
    assert _get(w1, "faults-split") is None and _get(w2, "faults-split") is None  # the winner
    assert lab.store_client().get("faults-split") is None
    assert lab.store_proxy.target == ("127.0.0.1", lab.replica.port)
    assert _reset(held["w1"]) is True and _reset(held["w2"]) is True
    with pytest.raises(RuntimeError, match="not split"):
        lab.heal_split()

    lab.new_trial()  # back to the lab's own store for the next trial
    assert lab.replica is None and lab.split is None
    assert lab.store_proxy.target == ("127.0.0.1", lab.store.port)
    lab.store_client().set("faults-split", "store")
    assert _get(w1, "faults-split") == _get(w2, "faults-split") == "store"
    lab.store_client().delete("faults-split")
