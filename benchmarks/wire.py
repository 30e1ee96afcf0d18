"""Group ``wire``: our hand-packed EVALSHA against redis-py's own ``Script`` and pipelines.

Issue 23: "measure redis-py's ``Script``/``ClusterPipeline`` against the hand-packed wire for
every call except the renewal batch, and keep our own only where the benchmark says so".

Every library call that runs a script goes through :func:`celery_steplock._redis.route.evalsha`
(one call) or :func:`~celery_steplock._redis.route.evalsha_many` (a batch): on a single node
:mod:`celery_steplock._redis.wire` packs the command in RESP by hand and runs it on a pooled
connection of the client; on a Redis Cluster :mod:`celery_steplock._redis.cluster` routes it
by slot. The redis-py way is ``client.register_script(source)`` called with ``keys``/``args``
(``EVALSHA``, loading the script on ``NOSCRIPT``), and a ``Pipeline``/``ClusterPipeline`` for
a batch. Both run the same scripts (``celery_steplock/_redis/scripts/``) with the arguments
the library sends, on the same client (``celery_steplock.clients.make_client``:
``decode_responses=True``, one retry), so the difference is the client side only.

Calls (single node, and on a 3-primary Cluster when ``redis-server`` can run one):

* ``lease``: the lease ACQUIRE + RELEASE pair of a task (holder metadata as
  ``StepLockedTask`` writes it), two round trips;
* ``owned``: the lease OWNED check (a default task's third script);
* ``bucket``: a token bucket decision (admitted), ``ratelimit``'s TOKEN_BUCKET;
* ``breaker``: a circuit breaker's ADMIT (closed breaker);
* ``idempotency``: an idempotency record's BEGIN (locks the record);
* ``slot``: a concurrency slot's ACQUIRE_SLOT (limit 10) + the slot's lease RELEASE;
* ``reap<N>``: a batch of N REAP calls (the reaper's, each on its own lease; the holders
  "renewed" since, so nothing is deleted and the batch repeats) through ``evalsha_many``.
  Single node, against a redis-py ``Pipeline`` with the ``Script`` objects run on it (which
  makes redis-py send ``SCRIPT EXISTS`` before every batch), and a bare ``EVALSHA``
  pipeline (no ``NOSCRIPT`` handling). Cluster, against ``ClusterPipeline``: its
  ``evalsha()`` is refused (``PIPELINE_BLOCKED_COMMANDS``: a ``Script`` cannot run on it)
  and ``eval()`` is not implemented, so it is given ``EVALSHA`` through ``execute_command``
  (no ``NOSCRIPT`` handling), and ``EVAL`` the same way (the source with every call); also
  the ``Script`` called N times on the ``RedisCluster`` (N round trips), and per-node
  redis-py ``Pipeline`` objects grouped as ``cluster.py`` groups.

The renewal batch (EXTEND_MANY) is not measured: the issue keeps it ours.

Method: each variant runs in blocks of 50 calls (5 batches), the variants interleaved block
by block in a rotating order, ``reps`` repetitions after a warm-up; per call the wall time
(``perf_counter_ns``: p50 and p99 of the repetition) and the client's CPU (this thread's
``thread_time_ns`` over each block, divided by its calls). Figures are medians over the
repetitions; ratios (ours / redis-py) are taken within each repetition, then their median.
Noise: an A/A control runs a second, independent instance of our variant in the same
rotation; its ratio to the first (per repetition) spans the noise band. Verdict per call
and metric: "ours faster" when every repetition's ratio lies below both 1 and the A/A band,
"redis-py faster" when every one lies above both, else "within noise"; per call "keep ours"
when a metric says ours faster and none says redis-py faster, else "switch to redis-py"
(within noise or faster), reported, not acted on.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from .common import group_main, median, MonitorCapture, percentile, Recorder, servers

#: Calls measured, key -> label.
CALLS = {
    "lease": "lease ACQUIRE + RELEASE (with holder metadata)",
    "owned": "lease OWNED check",
    "bucket": "rate limit: token bucket decision (admitted)",
    "breaker": "circuit breaker: ADMIT (closed)",
    "idempotency": "idempotency: BEGIN (locks the record)",
    "slot": "concurrency: ACQUIRE_SLOT (limit 10) + RELEASE",
}
#: Variants of one call, key -> label; ``ours_aa`` is the A/A control.
VARIANTS = {
    "ours": "ours: route.evalsha (hand-packed RESP)",
    "redis_py": "redis-py Script (register_script)",
    "ours_aa": "ours again (A/A control)",
}
BATCH_VARIANTS = {
    "ours": "ours: route.evalsha_many",
    "redis_py": "redis-py pipeline + Script",
    "redis_py_bare": "redis-py pipeline, bare EVALSHA (no NOSCRIPT handling)",
    "ours_aa": "ours again (A/A control)",
}
CLUSTER_BATCH_VARIANTS = {
    "ours": "ours: route.evalsha_many (one pipeline per node, all in flight)",
    "redis_py": "redis-py ClusterPipeline, EVALSHA by execute_command (no NOSCRIPT handling)",
    "redis_py_eval": "redis-py ClusterPipeline, EVAL (the source with every call)",
    "redis_py_serial": "redis-py RedisCluster Script, one call after another",
    "redis_py_pernode": "redis-py Pipeline + Script per node (our grouping)",
    "ours_aa": "ours again (A/A control)",
}
PREFIX = "benchwire"
#: Each variant's keys apart, with names of one length (the same bytes on the wire).
TAG = {
    "ours": "v1",
    "redis_py": "v2",
    "ours_aa": "v3",
    "redis_py_bare": "v4",
    "redis_py_serial": "v5",
    "redis_py_pernode": "v6",
    "redis_py_eval": "v7",
}
TTL_MS = 30_000
BLOCK = 50  # calls of one variant in a row (batches: BLOCK // 10)


# -- what the library sends ----------------------------------------------------------------


def steps_of(call: str, tag: str) -> list[tuple[str, list[str], list[str]]]:
    """The script calls ``(source, keys, args)`` of one ``call``, with the keys and arguments
    the library builds for them (``tag`` keeps the variants' keys apart)."""
    from celery_steplock._redis.scripts import breaker, concurrency, idempotency, lease, ratelimit
    from celery_steplock.keys import (
        breaker_keys,
        concurrency_keys,
        fence_key,
        idempotency_record_key,
        lease_key,
        rate_limit_keys,
        slot_key,
        slot_name,
        waiters_key,
        wake_key,
    )
    from celery_steplock.lease import holder_metadata
    from celery_steplock.lock import pack_metadata

    owner = f"6f1c2a47-3b7e-4d1a-9a55-0c9d8e7f6a5b:{tag}:0123456789abcdef"
    meta = pack_metadata(
        holder_metadata(
            "6f1c2a47-3b7e-4d1a-9a55-0c9d8e7f6a5b",
            "bench.tasks.charge",
            0,
            worker="celery@bench",
            step="workflows.step:42",
            renew_ms=TTL_MS // 3,
        )
    )
    if call in ("lease", "owned"):
        name = f"orders:{tag}:42"
        grant = [owner, str(TTL_MS), str(max(TTL_MS, 2 * 86_400_000)), "0", meta]
        acquire = (lease.ACQUIRE, [lease_key(PREFIX, name), fence_key(PREFIX, name)], grant)
        wake = [lease_key(PREFIX, name), waiters_key(PREFIX, name), wake_key(PREFIX, name)]
        if call == "owned":
            return [(lease.OWNED, [lease_key(PREFIX, name)], [owner])]
        return [acquire, (lease.RELEASE, wake, [owner])]
    if call == "bucket":
        rate, capacity = 1_000_000.0, 1_000_000  # admits every call
        keys = list(rate_limit_keys(PREFIX, "tb", f"{rate!r}:{capacity}", f"api:{tag}"))
        args = [
            repr(rate / 1000.0),
            str(capacity),
            "",
            "0f5e9c1d2b3a47e8a6c4d2b1e0f9a8c7",
            "0",
            repr(4.0 * 1000.0),
            repr(2.0 * 1000.0),
            repr(1.0 * 1000.0),  # the clock skew tolerance
        ]
        return [(ratelimit.TOKEN_BUCKET, keys, args)]
    if call == "breaker":
        keys = breaker_keys(PREFIX, f"payments:{tag}")
        return [(breaker.ADMIT, keys, [owner, "30000", "1", "30000", str(86_400_000), "1000"])]
    if call == "idempotency":
        keys = [idempotency_record_key(PREFIX, f"charge:v1:{tag}:order-42")]
        fingerprint = "3f" * 32  # an HMAC-SHA256, hex
        return [(idempotency.BEGIN, keys, [owner, fingerprint, str(TTL_MS), "billing", "v1"])]
    if call == "slot":
        key, limit = f"exports:{tag}", 10
        slots = [slot_key(PREFIX, key, i) for i in range(limit)]
        keys = slots + list(concurrency_keys(PREFIX, key))
        args = [owner, str(TTL_MS), str(max(TTL_MS, 2 * 86_400_000)), "", "60000", meta, "1000"]
        name = slot_name(key, 0)
        wake = [slots[0], waiters_key(PREFIX, name), wake_key(PREFIX, name)]
        return [(concurrency.ACQUIRE_SLOT, keys, args), (lease.RELEASE, wake, [owner])]
    raise ValueError(call)


def build_call(client: Any, call: str, variant: str) -> Callable[[], Any]:
    """One ``call`` of ``variant`` on ``client`` (a ``redis.Redis`` or a ``RedisCluster``):
    a function running its script calls in order, returning the last reply."""
    from celery_steplock._redis import route, wire

    steps = steps_of(call, TAG[variant])
    if variant in ("ours", "ours_aa"):
        bound = [(wire.Script(src), keys, args) for src, keys, args in steps]
        evalsha = route.evalsha
        if len(bound) == 1:
            [(script, keys, args)] = bound

            def one() -> Any:
                return evalsha(client, script, keys, args)

            return one
        [(s1, k1, a1), (s2, k2, a2)] = bound

        def pair() -> Any:
            evalsha(client, s1, k1, a1)
            return evalsha(client, s2, k2, a2)

        return pair
    if variant == "redis_py":
        scripts = [(client.register_script(src), keys, args) for src, keys, args in steps]
        if len(scripts) == 1:
            [(script, keys, args)] = scripts

            def one_py() -> Any:
                return script(keys=keys, args=args)

            return one_py
        [(s1, k1, a1), (s2, k2, a2)] = scripts

        def pair_py() -> Any:
            s1(keys=k1, args=a1)
            return s2(keys=k2, args=a2)

        return pair_py
    raise ValueError(variant)


def reap_batch(client: Any, variant: str, n: int) -> Callable[[], Any]:
    """A batch of ``n`` REAP calls, each on its own lease (created here, held by ``owner``;
    the batch names a stale ``renewed_ms``, so nothing is deleted and it can repeat)."""
    from celery_steplock._redis import route, wire
    from celery_steplock._redis.scripts import lease
    from celery_steplock.keys import fence_key, lease_key, waiters_key, wake_key

    owner = f"6f1c2a47-3b7e-4d1a-9a55-0c9d8e7f6a5b:{TAG[variant]}:0123456789abcdef"
    calls = []
    acquire = wire.Script(lease.ACQUIRE)
    for i in range(n):
        name = f"reap:{TAG[variant]}:{n}:{i}"
        route.evalsha(
            client,
            acquire,
            [lease_key(PREFIX, name), fence_key(PREFIX, name)],
            [owner, str(600_000), str(600_000), "0", ""],
        )
        wake = [lease_key(PREFIX, name), waiters_key(PREFIX, name), wake_key(PREFIX, name)]
        calls.append((wake, [owner, "1700000000000"]))
    if variant in ("ours", "ours_aa"):
        script = wire.Script(lease.REAP)
        many = route.evalsha_many

        def ours() -> Any:
            return many(client, script, calls)

        return ours
    script = client.register_script(lease.REAP)
    client.script_load(lease.REAP)  # every node of a cluster
    cluster = not hasattr(client, "connection_pool")
    if variant == "redis_py" and not cluster:

        def py() -> Any:
            pipe = client.pipeline(transaction=False)
            for keys, args in calls:
                script(keys=keys, args=args, client=pipe)
            return pipe.execute(raise_on_error=False)

        return py
    if variant == "redis_py_bare":
        sha = script.sha

        def bare() -> Any:
            pipe = client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            return pipe.execute(raise_on_error=False)

        return bare
    if variant in ("redis_py", "redis_py_eval") and cluster:
        # redis-py's ClusterPipeline refuses its evalsha() method (PIPELINE_BLOCKED_COMMANDS)
        # and leaves eval() unimplemented; execute_command routes either by its keys. A
        # NOSCRIPT comes back as an error reply (not handled); EVAL sends the source.
        command, first = ("EVALSHA", script.sha) if variant == "redis_py" else ("EVAL", lease.REAP)

        def cluster_pipeline() -> Any:
            pipe = client.pipeline()
            for keys, args in calls:
                pipe.execute_command(command, first, len(keys), *keys, *args)
            return pipe.execute(raise_on_error=False)

        return cluster_pipeline
    if variant == "redis_py_serial":

        def serial() -> Any:
            return [script(keys=keys, args=args) for keys, args in calls]

        return serial
    if variant == "redis_py_pernode":
        # Our routing (one pipeline per node, all written before any is read) on redis-py's
        # Pipeline and Script: what a switch keeping cluster.py's grouping would run.

        def pernode() -> Any:
            groups: dict[str, tuple[Any, list[int]]] = {}
            for i, (keys, _args) in enumerate(calls):
                node = client.get_node_from_key(keys[0])
                group = groups.get(node.name)
                if group is None:
                    pipe = client.get_redis_connection(node).pipeline(transaction=False)
                    group = groups[node.name] = (pipe, [])
                script(keys=keys, args=calls[i][1], client=group[0])
                group[1].append(i)
            replies: list[Any] = [None] * len(calls)
            for pipe, members in groups.values():
                for i, reply in zip(members, pipe.execute(raise_on_error=False)):
                    replies[i] = reply
            return replies

        return pernode
    raise ValueError(variant)


def redis_version() -> str:
    import redis

    return redis.__version__


def _same(a: Any, b: Any) -> bool:
    """Replies of two variants alike: same shape and types (fencing tokens and times differ)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


# -- measuring -------------------------------------------------------------------------------


def interleaved(
    fns: dict[str, Callable[[], Any]], per_rep: int, reps: int, warmup: int, block: int
) -> dict[str, list[dict[str, float]]]:
    """Run every function of ``fns`` ``per_rep`` times per repetition in blocks of ``block``,
    interleaved in a rotating order. Returns, per variant and repetition, the p50 and p99
    wall time (us) and the client CPU per call (us)."""
    variants = list(fns)
    for v in variants:
        for _ in range(warmup):
            fns[v]()
    out: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    for rep in range(reps):
        samples: dict[str, list[int]] = {v: [] for v in variants}
        cpu_ns = dict.fromkeys(variants, 0)
        gc.collect()
        gc.disable()  # a collection would land on whichever variant runs then
        try:
            for b in range(max(1, per_rep // block)):
                k = (rep + b) % len(variants)
                for v in variants[k:] + variants[:k]:
                    fn, times = fns[v], samples[v]
                    c0 = cpu()
                    for _ in range(block):
                        t0 = clock()
                        fn()
                        times.append(clock() - t0)
                    cpu_ns[v] += cpu() - c0
        finally:
            gc.enable()
        for v in variants:
            out[v].append(
                {
                    "p50": percentile(samples[v], 50) / 1000.0,
                    "p99": percentile(samples[v], 99) / 1000.0,
                    "cpu": cpu_ns[v] / len(samples[v]) / 1000.0,
                }
            )
    return out


def _verdict(ratios: list[float], aa: list[float]) -> str:
    low, high = min(aa + [1.0]), max(aa + [1.0])
    if all(r < low for r in ratios):
        return "ours faster"
    if all(r > high for r in ratios):
        return "redis-py faster"
    return "within noise"


def record(
    rec: Recorder,
    topo: str,
    call: str,
    label: str,
    rows: dict[str, list[dict[str, float]]],
    variant_labels: dict[str, str],
    per_call: int = 1,
) -> dict[str, Any]:
    """Add the figures of one call (``per_call``: script calls in one timed unit, for the
    CPU per script call of a batch) and return its summary."""
    base = f"wire.{topo}.{call}"
    summary: dict[str, Any] = {"call": call, "label": label, "topology": topo}
    for v, reps in rows.items():
        for metric in ("p50", "p99", "cpu"):
            value = median(r[metric] for r in reps)
            summary[f"{v}.{metric}"] = value
            rec.add(
                f"{base}.{v}.{metric}",
                round(value, 1),
                "us" if metric != "cpu" else "us CPU",
                topology=topo,
                call=call,
                variant=v,
                label=variant_labels[v],
                reps=[round(r[metric], 1) for r in reps],
            )
        if per_call > 1:
            rec.add(
                f"{base}.{v}.cpu_per_script",
                round(summary[f"{v}.cpu"] / per_call, 2),
                "us CPU",
                topology=topo,
                call=call,
                variant=v,
            )
    verdicts = {}
    summary["others"] = [v for v in rows if v.startswith("redis_py_")]
    for other in [v for v in rows if v.startswith("redis_py")]:
        tag = "" if other == "redis_py" else f".vs_{other}"
        for metric in ("p50", "cpu"):
            ratios = [a[metric] / b[metric] for a, b in zip(rows["ours"], rows[other])]
            aa = [a[metric] / b[metric] for a, b in zip(rows["ours_aa"], rows["ours"])]
            verdict = _verdict(ratios, aa)
            if other == "redis_py":
                verdicts[metric] = verdict
            summary[f"ratio{tag}.{metric}"] = median(ratios)
            summary[f"ratio{tag}.{metric}.reps"] = ratios
            summary[f"aa.{metric}.reps"] = aa
            summary[f"verdict{tag}.{metric}"] = verdict
            rec.add(
                f"{base}.ratio{tag}.{metric}",
                round(median(ratios), 3),
                "x",
                topology=topo,
                call=call,
                reps=[round(r, 3) for r in ratios],
                aa_reps=[round(r, 3) for r in aa],
                verdict=verdict,
            )
    ours_faster = "ours faster" in verdicts.values()
    keep = ours_faster and "redis-py faster" not in verdicts.values()
    conclusion = (
        "keep ours"
        if keep
        else (
            "switch to redis-py (redis-py faster)"
            if "redis-py faster" in verdicts.values()
            else "switch to redis-py (within noise)"
        )
    )
    summary["conclusion"] = conclusion
    rec.add(f"{base}.conclusion", conclusion, "", topology=topo, call=call, label=label)
    return summary


def commands_per_call(rec: Recorder, url: str, fns: dict[str, Callable[[], Any]]) -> None:
    """Commands each variant sends per call, counted once with ``MONITOR`` (equal round trips
    make the comparison one of client cost)."""
    n = 20
    with MonitorCapture(url) as mon:
        for key, fn in fns.items():
            mon.phase(key)
            for _ in range(n):
                fn()
    for key in fns:
        sent = mon.count(key)
        call, variant = key.split("/", 1)
        rec.add(
            f"wire.single.{call}.{variant}.commands",
            round(sum(sent.values()) / n, 2),
            "commands/call",
            topology="single",
            call=call,
            variant=variant,
            detail={k: round(c / n, 2) for k, c in sorted(sent.items())},
        )


def measure_topology(
    rec: Recorder,
    topo: str,
    client: Any,
    url: str | None,
    per_rep: int,
    reps: int,
    warmup: int,
    batch_sizes: tuple[int, ...],
) -> list[dict[str, Any]]:
    summaries = []
    fns: dict[str, Callable[[], Any]] = {}
    for call in CALLS:
        variants = {v: build_call(client, call, v) for v in VARIANTS}
        first = {v: fn() for v, fn in variants.items()}
        if not _same(first["ours"], first["redis_py"]):
            rec.note(f"{topo} {call}: replies differ: {first['ours']!r} / {first['redis_py']!r}")
        rows = interleaved(variants, per_rep, reps, warmup, BLOCK)
        summaries.append(record(rec, topo, call, CALLS[call], rows, VARIANTS))
        s = summaries[-1]
        rec.say(
            f"{topo} {call}: p50 ours {s['ours.p50']:.1f} / redis-py {s['redis_py.p50']:.1f} us "
            f"({s['ratio.p50']:.3f}x), CPU {s['ours.cpu']:.1f} / {s['redis_py.cpu']:.1f} us "
            f"({s['ratio.cpu']:.3f}x): {s['conclusion']}"
        )
        fns.update({f"{call}/{v}": fn for v, fn in variants.items() if v != "ours_aa"})
    batch_labels = dict(BATCH_VARIANTS if topo == "single" else CLUSTER_BATCH_VARIANTS)
    if topo == "cluster":
        try:
            client.register_script("return 1")(keys=["k"], args=[], client=client.pipeline())
            refused = "none"
        except Exception as exc:  # noqa: BLE001 - what redis-py says is the finding
            refused = f"{type(exc).__name__}: {exc}"
        rec.note(f"redis-py {redis_version()}: a Script on a ClusterPipeline raises {refused}")
    for n in batch_sizes:
        call = f"reap{n}"
        variants = {v: reap_batch(client, v, n) for v in batch_labels}
        first = {v: fn() for v, fn in variants.items()}
        if not _same(first["ours"], first["redis_py"]):
            rec.note(f"{topo} {call}: replies differ")
        per_batch = max(BLOCK // 10, 1)
        rows = interleaved(variants, max(per_rep // n, 4 * per_batch), reps, 2, per_batch)
        summaries.append(
            record(rec, topo, call, f"batch of {n} REAP", rows, batch_labels, per_call=n)
        )
        s = summaries[-1]
        rec.say(
            f"{topo} {call}: p50 ours {s['ours.p50']:.0f} / redis-py {s['redis_py.p50']:.0f} us "
            f"({s['ratio.p50']:.3f}x), CPU {s['ours.cpu']:.0f} / {s['redis_py.cpu']:.0f} us "
            f"({s['ratio.cpu']:.3f}x): {s['conclusion']}"
        )
        if topo == "single" and n <= 100:
            fns.update({f"{call}/{v}": fn for v, fn in variants.items() if v != "ours_aa"})
    if url is not None:
        commands_per_call(rec, url, fns)
    return summaries


def table(summaries: list[dict[str, Any]]) -> str:
    lines = [
        "| topology | call | p50 ours / redis-py (us) | ratio | CPU us ours / redis-py | "
        "ratio | A/A CPU band | conclusion |",
        "|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for s in summaries:
        aa = s["aa.cpu.reps"]
        lines.append(
            f"| {s['topology']} | {s['label']} | {s['ours.p50']:.1f} / {s['redis_py.p50']:.1f} "
            f"| {s['ratio.p50']:.3f} ({s['verdict.p50']}) | {s['ours.cpu']:.1f} / "
            f"{s['redis_py.cpu']:.1f} | {s['ratio.cpu']:.3f} ({s['verdict.cpu']}) | "
            f"{min(aa):.3f}..{max(aa):.3f} | {s['conclusion']} |"
        )
        for other in s.get("others", []):
            tag = f"vs_{other}"
            lines.append(
                f"| | vs {other} | {s['ours.p50']:.1f} / {s[other + '.p50']:.1f} | "
                f"{s[f'ratio.{tag}.p50']:.3f} ({s[f'verdict.{tag}.p50']}) | "
                f"{s['ours.cpu']:.1f} / {s[other + '.cpu']:.1f} | "
                f"{s[f'ratio.{tag}.cpu']:.3f} ({s[f'verdict.{tag}.cpu']}) | | |"
            )
    return "\n".join(lines)


def run(quick: bool = False) -> dict[str, Any]:
    from celery_steplock.clients import make_client

    rec = Recorder("wire")
    per_rep, reps, warmup = (500, 3, 50) if quick else (2000, 7, 200)
    batch_sizes = (10, 100) if quick else (10, 100, 1000)
    summaries: list[dict[str, Any]] = []
    with servers.RedisServer() as server:
        rec.say(f"redis-server {server.url} (pid {server.pid})")
        client = make_client(server.url)
        summaries += measure_topology(
            rec, "single", client, server.url, per_rep, reps, warmup, batch_sizes
        )
        client.close()
    try:
        from tests.support.cluster import RedisCluster
    except ImportError as exc:  # an older tree: no cluster support
        rec.note(f"Redis Cluster skipped: {exc}")
    else:
        cluster = RedisCluster(primaries=3, replicas_per_primary=0)
        try:
            cluster.start()
        except Exception as exc:  # noqa: BLE001 - reported, the single node still counts
            rec.note(f"Redis Cluster skipped: could not start one ({exc})")
        else:
            try:
                rc = make_client(cluster.url, cluster=True)
                rec.say(f"Redis Cluster of 3 primaries at {cluster.url}")
                summaries += measure_topology(
                    rec, "cluster", rc, None, per_rep, reps, warmup, batch_sizes
                )
                rc.close()
            finally:
                cluster.stop()
    text = table(summaries)
    print(text, flush=True)
    rec.note(
        f"{per_rep} calls per variant and repetition ({reps} repetitions, blocks of "
        f"{BLOCK} interleaved in a rotating order); batches of N REAP: {per_rep} script calls "
        f"per repetition at least 4 blocks of 5 batches; client CPU from thread_time_ns per "
        f"block; verdicts against the A/A control's band (see benchmarks/wire.py)."
    )
    return rec.result(table=text, summaries=summaries)


if __name__ == "__main__":
    raise SystemExit(group_main("wire", run))
