"""Periodic runs that never overlap, with real processes: TWO ``celery beat`` processes send
``overlap.periodic`` every second (tests/support/overlap_app.py), a task whose run lasts 3.5 s
(longer than its interval and its 2 s lease TTL: the heartbeat keeps the lease), to one
``celery worker`` of concurrency 4. Every run and every send is recorded in Redis time.

- skip: never two runs at once, and no run started while one was in progress;
- coalesce: never two runs at once; every run after the first starts after the previous one
  ended; of the sends made during a run, at most one runs (the follower); the runs are back
  to back (no gap longer than the follower's longest countdown, one lease TTL, while sends
  keep arriving); once the beats stop, at most one run starts after the one in progress.

The default run gives each policy ``OVERLAP_BEAT_SECONDS`` (15) seconds of beat;
``make overlap`` sets 60 and ``OVERLAP_REPORT=1``, which prints the figures.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from helpers import wait_until

from tests.support import ROOT
from tests.support.processes import ProcessGroup, celery_worker

pytestmark = [pytest.mark.workers, pytest.mark.no_database]

SECONDS = float(os.environ.get("OVERLAP_BEAT_SECONDS", "15"))
REPORT = bool(os.environ.get("OVERLAP_REPORT"))
RUN = 3.5
TTL = 2.0  # steplock_default_ttl of the app: the follower's longest countdown
SLACK = 0.75  # a loaded two-core machine: worker pickup, beat's tick


def _records(client, name):
    return [json.loads(item) for item in client.lrange(f"ovl:{name}", 0, -1)]


def _beat(env, tmp_path, index):
    beat = ProcessGroup(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.overlap_app",
            "beat",
            "-l",
            "INFO",
            "-s",
            str(tmp_path / f"beat{index}-schedule"),
            "--pidfile",
            str(tmp_path / f"beat{index}.pid"),
        ],
        env=env,
        cwd=ROOT,
        logfile=tmp_path / f"beat{index}.log",
    )
    return beat.start()


def _run_policy(policy, redis_client, redis_server_url, tmp_path):
    """Run the worker and two beats for SECONDS, stop the beats, let the runs drain, and
    return (runs sorted by start, sends, skipped, coalesced, max_running, beats stopped at)."""
    env = {
        "REDIS_URL": redis_server_url,
        "OVERLAP_POLICY": policy,
        "OVERLAP_RUN": str(RUN),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)
    worker = celery_worker(
        app="tests.support.overlap_app",
        name=f"ovl-{policy}",
        concurrency=4,
        env=env,
        logfile=tmp_path / f"worker-{policy}.log",
        cwd=ROOT,
    )
    beats = []
    try:
        beats = [_beat(env, tmp_path, 1), _beat(env, tmp_path, 2)]
        for beat in beats:
            beat.wait_for_log(r"beat: Starting", timeout=60)
        wait_until(
            lambda: redis_client.llen("ovl:sends") >= 2 * SECONDS,
            timeout=SECONDS * 3 + 30,
            what=f"{2 * SECONDS:g} sends",
        )
        for beat in beats:
            beat.terminate()
        seconds, micros = redis_client.time()
        stopped = seconds + micros / 1e6

        # Drained: nothing queued or running, no retry pending (unacked), twice 0.5 s apart
        # (a message between the queue and the unacked table shows in neither).
        def idle():
            return (
                redis_client.llen("celery") == 0
                and redis_client.hlen("unacked") == 0
                and int(redis_client.get("ovl:running") or 0) == 0
            )

        wait_until(lambda: idle() and not time.sleep(0.5) and idle(), timeout=60, what="drain")
    finally:
        for beat in beats:
            beat.kill()
        worker.kill()
    runs = sorted(_records(redis_client, "runs"), key=lambda r: r["start"])
    sends = _records(redis_client, "sends")
    skipped = int(redis_client.get("ovl:skipped") or 0)
    coalesced = int(redis_client.get("ovl:coalesced") or 0)
    max_running = int(redis_client.get("ovl:max_running") or 0)
    return runs, sends, skipped, coalesced, max_running, stopped


def worker_log(tmp_path):
    return "\n".join(
        (tmp_path / name).read_text(errors="replace")
        for name in ("worker-skip.log", "worker-coalesce.log")
        if (tmp_path / name).exists()
    )


def _unaccounted(runs, sends, log):
    """The sends that neither ran nor were skipped, with their worker log lines."""
    ran = {r["id"] for r in runs}
    skipped = "\n".join(line for line in log.splitlines() if "event=overlap_skipped" in line)
    missing = [s["id"] for s in sends if s["id"] not in ran and s["id"] not in skipped]
    lines = [line for line in log.splitlines() if any(m in line for m in missing)]
    return {"missing": missing, "log": lines[-20:]}


def _overlaps(runs):
    return [(a["id"], b["id"]) for a, b in zip(runs, runs[1:]) if b["start"] < a["end"]]


def _report(policy, runs, sends, skipped, coalesced, max_running, gaps, stopped):
    if REPORT:
        sent_at = {s["id"]: s["t"] for s in sends}
        followers = [
            r for r in runs if any(o["start"] <= sent_at[r["id"]] <= o["end"] for o in runs)
        ]
        print(
            f"\noverlap={policy}: {SECONDS:g} s of two beats: sends {len(sends)}, runs "
            f"{len(runs)} (sent during another run: {len(followers)}; started after the "
            f"beats stopped: {len([r for r in runs if r['start'] > stopped])}), skipped "
            f"{skipped}, coalesced {coalesced}, max concurrent {max_running}, longest gap "
            f"between runs {max(gaps, default=0):.3f} s"
        )


def test_skip_never_runs_two_at_once(redis_client, redis_server_url, tmp_path):
    runs, sends, skipped, coalesced, max_running, stopped = _run_policy(
        "skip", redis_client, redis_server_url, tmp_path
    )
    gaps = [b["start"] - a["end"] for a, b in zip(runs, runs[1:])]
    _report("skip", runs, sends, skipped, coalesced, max_running, gaps, stopped)
    assert len(sends) >= 2 * SECONDS
    assert max_running == 1
    assert _overlaps(runs) == []  # no run started while one was in progress
    assert len({r["id"] for r in runs}) == len(runs)
    # Every send ran or was skipped: nothing waited its turn.
    assert len(runs) + skipped == len(sends), _unaccounted(runs, sends, worker_log(tmp_path))
    assert coalesced == 0
    assert 2 <= len(runs) <= SECONDS / RUN + 2


def test_coalesce_runs_back_to_back_at_most_one_follower(redis_client, redis_server_url, tmp_path):
    runs, sends, skipped, coalesced, max_running, stopped = _run_policy(
        "coalesce", redis_client, redis_server_url, tmp_path
    )
    gaps = [b["start"] - a["end"] for a, b in zip(runs, runs[1:])]
    _report("coalesce", runs, sends, skipped, coalesced, max_running, gaps, stopped)
    sent_at = {s["id"]: s["t"] for s in sends}
    assert len(sends) >= 2 * SECONDS
    assert max_running == 1
    assert _overlaps(runs) == []  # each run starts after the previous one ended
    assert len({r["id"] for r in runs}) == len(runs)
    for run in runs:
        during = [r for r in runs if run["start"] <= sent_at[r["id"]] <= run["end"]]
        assert len(during) <= 1, (run, during)  # at most one run follows each run
    # Back to back while sends keep arriving (until the beats stopped).
    busy = [g for a, g in zip(runs[1:], gaps) if a["start"] <= stopped]
    assert max(busy, default=0) <= TTL + SLACK, gaps
    # After the beats stopped: at most the run in progress's one follower.
    assert len([r for r in runs if r["start"] > stopped]) <= 1
    assert len(runs) >= SECONDS / (RUN + TTL + SLACK)
    # Every other send coalesced into the follower or was skipped.
    assert len(runs) + skipped == len(sends), _unaccounted(runs, sends, worker_log(tmp_path))
    assert coalesced >= 1 and skipped >= 1
