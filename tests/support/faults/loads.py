"""The extra workloads of the randomized fault run (``scripts/nemesis.py --loads``), run
inside :class:`~tests.support.faults.nemesis.NemesisLab` beside its client and nemesis, so one
run with faults judges every pattern:

- ``http``: the HTTP idempotency load (:mod:`~tests.support.faults.http_load`): a uvicorn
  server of the example project with the fault views, started with the workers' environment
  (the same lock store and database, through the same proxies: the store faults hit it too),
  and a :class:`~tests.support.faults.http_load.Driver` thread. The server's bodies write
  ``http_body_start`` / ``http_body_end`` to the run's history; the clients' responses go to
  the run directory's ``http.jsonl`` (one JSON object a line, the ``http_rules`` shape).
- ``writers``: the writer outside Celery (:mod:`~tests.support.faults.writers`), its own
  process with the workers' environment; its ``StepFeed`` picks the run's steps from the
  client's ``publish`` entries. Its counts are its ``writer_done`` history entry.
- ``periodic``: two senders of the periodic task (:mod:`~tests.support.faults.periodic_load`);
  their sends and the runs are history entries.

Each has a negative control (``http``: ``shared`` / ``unguarded``; ``writers``: ``plain``;
``periodic``: ``unguarded``). ``runcheck`` judges them all from the run directory.

Also here: :func:`stale_aba`, the controller side of the client action ``stale_aba`` (the
fence-decides shape; ``django_app/faults/tasks.py`` ``StaleTask``).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

LOADS = ("http", "writers", "periodic")
HTTP_MODES = ("guarded", "shared", "unguarded")
WRITER_MODES = ("guarded", "plain")
PERIODIC_MODES = ("guarded", "unguarded")
HTTP_THREADS = 4  # client threads of the HTTP driver (two cores carry the whole lab)
STOP_WAIT = 30.0  # seconds a load may take to end once the run stops


def parse(spec: str | None) -> tuple[str, ...]:
    """The loads of ``--loads``: a comma-separated subset of :data:`LOADS`, ``all``, or
    empty/None/``none`` (no load). Raises ValueError on an unknown name."""
    if not spec or spec.strip() in ("", "none"):
        return ()
    if spec.strip() == "all":
        return LOADS
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = sorted(set(names) - set(LOADS))
    if unknown:
        raise ValueError(f"unknown load(s) {unknown}; known: {', '.join(LOADS)}, all")
    return tuple(n for n in LOADS if n in names)


class Loads:
    """The loads ``names`` (of :data:`LOADS`) of one run on ``lab`` (a started
    :class:`NemesisLab`, its workers up): :meth:`start` at the start of the run,
    :meth:`stop` once ``lab.stopping`` is set (before the settle), :meth:`write` with the run
    directory. ``http``, ``writers``, ``periodic`` are their modes (the first of each mode
    tuple is the guarded one, the others negative controls)."""

    def __init__(
        self,
        lab,
        names=(),
        http: str = "guarded",
        writers: str = "guarded",
        periodic: str = "guarded",
        seed: int = 0,
    ):
        for value, modes in ((http, HTTP_MODES), (writers, WRITER_MODES)):
            if value not in modes:
                raise ValueError(f"mode must be one of {modes}, got {value!r}")
        if periodic not in PERIODIC_MODES:
            raise ValueError(f"periodic must be one of {PERIODIC_MODES}, got {periodic!r}")
        self.lab = lab
        self.names = tuple(names)
        self.modes = {"http": http, "writers": writers, "periodic": periodic}
        self.seed = seed
        self.server = None
        self.driver = None
        self.threads: list[threading.Thread] = []
        self.writer: subprocess.Popen | None = None
        self.errors: list[str] = []
        self.started = None

    @property
    def controls(self) -> list[str]:
        """The negative controls among the running loads (``"http:unguarded"``...)."""
        guarded = {"http": "guarded", "writers": "guarded", "periodic": "guarded"}
        return [f"{n}:{self.modes[n]}" for n in self.names if self.modes[n] != guarded[n]]

    def lock_ttl(self) -> float:
        """The HTTP views' idempotency lock TTL (seconds) the workers' environment sets."""
        env = self.lab.worker_env()
        return float(env.get("STEPLOCK_FAULTS_IDEMPOTENCY_LOCK_TTL") or 8.0)

    def start(self) -> Loads:
        from tests.support.faults import http_load, periodic_load, writers

        lab = self.lab
        self.started = time.time()
        seconds = lab.duration
        if "http" in self.names:
            env = lab.worker_env()
            self.server = http_load.HttpServer(
                env["STEPLOCK_REDIS_URL"],
                lab.control.url,
                lab.workdir / "http-server.log",
                env=env,
            ).start()
            self.driver = http_load.Driver(
                self.server.url,
                variant=self.modes["http"],
                threads=HTTP_THREADS,
                seed=self.seed,
            )
            thread = threading.Thread(
                target=self.driver.run, args=(seconds, lab.stopping), name="http-load", daemon=True
            )
            thread.start()
            self.threads.append(thread)
            lab.note(
                "load_start", load="http", mode=self.modes["http"], pid=self.server.process.pid
            )
        if "writers" in self.names:
            self.writer = writers.start_writer(
                lab, seconds, self.modes["writers"], self.seed, logfile=lab.workdir / "writer.log"
            )
            lab.note("load_start", load="writers", mode=self.modes["writers"], pid=self.writer.pid)
        if "periodic" in self.names:
            self.threads += periodic_load.start_senders(
                lab.publisher,
                lab.note,
                seconds,
                lab.stopping,
                guarded=self.modes["periodic"] == "guarded",
                errors=self.errors,
            )
            lab.note("load_start", load="periodic", mode=self.modes["periodic"])
        return self

    def stop(self) -> None:
        """End every load (the lab's ``stopping`` is set): the driver's and the senders'
        threads end on it; the writer ends at its own deadline (killed by its pid after
        :data:`STOP_WAIT` seconds); the HTTP server is stopped by its PID once its clients
        are done."""
        deadline = time.monotonic() + STOP_WAIT
        for thread in self.threads:
            thread.join(max(0.1, deadline - time.monotonic()))
            if thread.is_alive():
                self.errors.append(f"load thread {thread.name} still running at stop")
        if self.writer is not None:
            try:
                self.writer.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.errors.append("writer: killed at stop (still running)")
                self.writer.kill()
                self.writer.wait(10)
        if self.server is not None:
            self.server.stop()
            self.server = None

    def write(self, out: Path, history: list[dict]) -> dict:
        """Write ``http.jsonl`` (the HTTP responses) to the run directory ``out``; returns
        run.json's ``loads`` entry: ``names``, ``modes``, ``controls`` and per load its
        summary (``http``: ``requests``, ``lock_ttl``, ``pid``; ``writers``: the writer's
        counts, :func:`~tests.support.faults.writers.writer_result`; ``periodic``:
        ``sends``), ``errors``."""
        from tests.support.faults import writers

        out = Path(out)
        (out / "http.jsonl").unlink(missing_ok=True)
        summary: dict = {
            "names": list(self.names),
            "modes": {n: self.modes[n] for n in self.names},
            "controls": self.controls,
        }
        if self.driver is not None:
            responses = list(self.driver.responses)
            (out / "http.jsonl").write_text(
                "".join(json.dumps(r, default=str) + "\n" for r in responses)
            )
            starts = [
                e for e in history if e.get("ev") == "load_start" and e.get("load") == "http"
            ]
            summary["http"] = {
                "variant": self.modes["http"],
                "requests": len(responses),
                "timeouts": sum(1 for r in responses if r.get("status") is None),
                "bodies": sum(1 for e in history if e.get("ev") == "http_body_start"),
                "lock_ttl": self.lock_ttl(),
                "pid": starts[-1].get("pid") if starts else None,
            }
        if "writers" in self.names:
            summary["writers"] = {
                **writers.writer_result(history),
                "returncode": self.writer.returncode if self.writer is not None else None,
            }
        if "periodic" in self.names:
            summary["periodic"] = {
                "guarded": self.modes["periodic"] == "guarded",
                "sends": sum(1 for e in history if e.get("ev") == "periodic_send"),
                "runs": sum(1 for e in history if e.get("ev") == "periodic_start"),
                "skips": sum(1 for e in history if e.get("ev") == "periodic_skipped"),
            }
        summary["errors"] = self.errors[:20]
        return summary


# -- the fence-decides shape (client action ``stale_aba``) ---------------------------------------

#: Seconds the stale holder stalls at most, in TTLs (it goes on as soon as the step was
#: moved away and back); under the workers' visibility timeout (10 s at the default 2 s TTL), so
#: the stalled message is not redelivered meanwhile.
STALE_STALL_TTLS = 3.5


def stale_aba(lab, step: int, work: float = 0.0, wait: float = 15.0) -> threading.Thread:
    """Send the ``stale_aba`` shape for ``step`` (pending, fresh): a ``stale_forward`` whose
    holder stalls after its last check without renewing (``StaleTask``,
    django_app/faults/tasks.py), then, in a daemon thread, once its lease is gone from the
    store (it lapsed), a ``start`` (pending -> running) and, once the step is running, a
    ``reset`` (running -> pending): newer holders move the step away and back, so the stale
    ``pending -> done`` meets its status again and only the fence refuses it. Each wait lasts
    at most ``wait`` seconds (a fault may delay every part; then the shape is not completed
    and nothing is refused). Returns the thread."""
    stall = round(STALE_STALL_TTLS * lab.ttl, 3)
    lab.send("stale_forward", step, kwargs={"work": work, "stall": stall})

    from tests.support.faults.lab import KEY_PREFIX

    key = f"{KEY_PREFIX}:lease:{{step:{step}}}"

    clients: list = []

    def leased() -> bool:
        if not clients:
            clients.append(lab.store_client())
        return bool(clients[0].exists(key))

    def until(predicate, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not lab.stopping.is_set():
            try:
                if predicate():
                    return True
            except Exception:  # noqa: BLE001 - a faulted path: ask again
                pass
            time.sleep(0.05)
        return False

    def aba() -> None:
        from django.db import connection

        try:
            if not until(leased, wait):
                return
            if not until(lambda: not leased(), wait):
                return
            lab.send("start", step)
            if not until(lambda: lab.statuses([step]).get(step) == "running", wait):
                return
            lab.send("reset", step)
        except Exception as exc:  # noqa: BLE001 - the control Redis or the database path
            lab.errors.append(f"stale_aba {step}: {type(exc).__name__}: {exc}")
        finally:
            connection.close()
            for client in clients:
                client.close()

    thread = threading.Thread(target=aba, name=f"stale-aba-{step}", daemon=True)
    thread.start()
    return thread


# -- the checker's side (runcheck) ----------------------------------------------------------------

#: Fault kinds after which the lock store (and the HTTP views' idempotency records in it) may
#: have lost data: an instant, or a window up to the heal for a split brain.
STORE_LOSS = ("redis_restart", "redis_failover", "sentinel_failover", "cluster_failover")
#: Prefixes of the kinds on the lock-store path: a store not answering (or slowly) for a
#: while, its data kept; a window from the fault to its heal.
STORE_PATH = ("redis_", "sentinel_", "cluster_", "slot_")


def store_windows(history: list[dict], lock_ttl: float) -> tuple[list, list]:
    """``(store_lost_at, store_down)`` of :func:`tests.support.faults.http_rules.check` from
    the nemesis's ``fault`` / ``heal`` entries: losses (:data:`STORE_LOSS` at their instant,
    ``split_brain`` from the split to its heal) and outages (the other kinds on the store's
    path, :data:`STORE_PATH`, from the fault to its heal, or ``lock_ttl`` seconds for one that
    is not lasting). A fault never healed lasts to the end of the history."""
    end = max((e.get("t", 0.0) for e in history), default=0.0)
    healed = {}
    for e in history:
        if e.get("ev") == "heal" and e.get("fault_t") is not None:
            healed[(e.get("kind"), e["fault_t"])] = e["t"]
    lost, down = [], []
    for e in history:
        kind = e.get("kind")
        if e.get("ev") != "fault" or not kind or e.get("follow_up"):
            continue
        t = e["t"]
        start = e.get("extends") or t
        if kind in STORE_LOSS:
            lost.append(t)
            down.append((t, healed.get((kind, t), t + lock_ttl)))
        elif kind == "split_brain":
            lost.append((start, healed.get((kind, start), end)))
        elif kind.startswith(STORE_PATH):
            down.append((start, healed.get((kind, start), min(end, t + lock_ttl))))
    return lost, down


def judge_http(history: list[dict], responses: list[dict], lock_ttl: float = 8.0) -> dict:
    """The HTTP rules (``http_rules.check``) on a run: the executions from ``history``, the
    clients' ``responses`` (``http.jsonl``), the store's losses and outages from the faults
    (:func:`store_windows`). Returns ``{"violations": [messages], "counts": {...,
    "by_rule", "excused"}}``."""
    from tests.support.faults import http_rules

    lost, down = store_windows(history, lock_ttl)
    verdict = http_rules.check(
        http_rules.executions_from_history(history),
        responses,
        store_lost_at=lost,
        store_down=down,
        lock_ttl=lock_ttl,
    )
    excused: dict = {}
    for finding in verdict.excused:
        excused[finding["rule"]] = excused.get(finding["rule"], 0) + 1
    messages = []
    for finding in verdict.violations:
        response = finding.get("response") or {}
        facts = {
            k: finding.get(k)
            for k in ("view", "key", "principal", "bodies", "body", "differs", "served_to")
            if finding.get(k) is not None
        }
        if response:
            facts.update(
                view=response.get("view"),
                key=response.get("key"),
                principal=response.get("principal"),
                status=response.get("status"),
            )
        messages.append(f"http {finding['rule']}: {json.dumps(facts, default=str)}")
    return {
        "violations": messages,
        "counts": {
            **verdict.counts,
            "violations": len(messages),
            "by_rule": verdict.by_rule(),
            "excused": excused,
            "store_losses": len(lost),
            "store_outages": len(down),
        },
    }


def controls_caught(counts: dict, controls) -> dict:
    """Whether each negative control of ``controls`` (``"http-unguarded"``,
    ``"writers-plain"``, ``"periodic-unguarded"``...: ``<load>-<mode>``) was caught by its own
    rules in a verdict's ``counts``: HTTP violations (``counts["http"]["violations"]``), step
    violations on steps the writer changed (``writer_step_violations``), periodic overlaps
    (``counts["periodic"]["violations"]``). Returns ``{control: bool}``."""
    found = {
        "http": (counts.get("http") or {}).get("violations") or 0,
        "writers": counts.get("writer_step_violations") or 0,
        "periodic": (counts.get("periodic") or {}).get("violations") or 0,
    }
    return {c: bool(found.get(c.split("-", 1)[0])) for c in controls}


def task_history(history: list[dict]) -> list[dict]:
    """``history`` without the HTTP server's idempotency entries (``idem_completed``,
    ``idem_replayed``, ``idem_body`` of a pid a ``load_start`` entry names for ``http``): the
    HTTP rules judge its records (:func:`judge_http`), the tasks' idempotency check the
    tasks'. The same list when there is no HTTP load."""
    servers = {
        e.get("pid") for e in history if e.get("ev") == "load_start" and e.get("load") == "http"
    }
    if not servers:
        return history
    return [
        e
        for e in history
        if not (str(e.get("ev")).startswith("idem_") and e.get("pid") in servers)
    ]


def periodic_history(history: list[dict], ttl: float = 2.0) -> list[dict]:
    """``history`` for ``overlap_rules.check_periodic`` with the splits as windows: a run that
    starts during a split (from its ``split_brain`` fault to its heal) holds its lease on one
    side only, so a run on the other side, or after the heal discards its side, may overlap
    it: the documented data-loss limit, as for a split that begins during a run. Adds a
    ``split_brain`` fault entry (``synthetic``) at the start of each such run, good for runs
    that start until the heal plus ``ttl`` seconds (``until``): a run on the discarded side
    has found its lease gone by then, one on the kept side still holds it."""
    healed = {
        e.get("fault_t"): e["t"]
        for e in history
        if e.get("ev") == "heal" and e.get("kind") == "split_brain"
    }
    end = max((e.get("t", 0.0) for e in history), default=0.0)
    splits = [
        (e["t"], healed.get(e["t"], end))
        for e in history
        if e.get("ev") == "fault" and e.get("kind") == "split_brain"
    ]
    added = [
        {
            "ev": "fault",
            "kind": "split_brain",
            "t": e["rt"],
            "synthetic": True,
            "until": next(b for a, b in splits if a <= e["rt"] <= b) + ttl,
        }
        for e in history
        if e.get("ev") == "periodic_start"
        and e.get("rt") is not None
        and any(a <= e["rt"] <= b for a, b in splits)
    ]
    return history + added if added else history
