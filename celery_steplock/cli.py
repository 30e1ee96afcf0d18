"""``celery steplock``: look at, release and reap leases from the command line.

Installed through Celery's ``celery.commands`` entry point (``setup.cfg``), so it runs with the
app of ``celery -A proj`` and its ``steplock_*`` settings::

    celery -A proj steplock ls [--match GLOB] [--limit N] [--json]
    celery -A proj steplock show NAME [--json]
    celery -A proj steplock history NAME [--json] [--count N]
    celery -A proj steplock release NAME --owner TOKEN
    celery -A proj steplock reap [--dry-run] [--json] [--batch-size N] [--older-than SECONDS]
                                 [--no-effects]
    celery -A proj steplock breaker ls [--limit N] [--json]
    celery -A proj steplock breaker show|open|close NAME [--json] [--reason TEXT]

``celery steplock --help`` lists every command with its one-line summary.

``ls`` reads with SCAN (never KEYS) and stops once ``--limit`` leases were found, so it stays
quick on a Redis holding many. ``release`` is :func:`celery_steplock.ops.force_release` (as
the Django admin's force release): owner-checked (compare-and-delete), it deletes the lease
only while ``TOKEN`` still holds it, and sends ``lock_released`` with ``forced=True``.
This module imports the lease store, never the task module. ``reap`` runs :func:`celery_steplock.reaper.reap`; with a Django project
(``DJANGO_SETTINGS_MODULE`` set, as in Celery's Django layout) it also recovers steps and
relays the effects outbox once (``--no-effects``: not), otherwise only leases.

Every value read from Redis or given on the command line is printed through
:func:`celery_steplock.redact.printable` (control characters, ANSI escape sequences and
newlines escaped: a lease cannot forge a line or drive the terminal; ``--json`` escapes them
as JSON does), and every error through :func:`celery_steplock.redact.redact` (no password
of a URL or of the transport options is shown).

Every ``--json`` prints typed values: the integer fields of a lease (``fence``, ``pid``,
``acquired_ms``, ``renewed_ms``, ``ttl_ms``, ``renew_ms``, ``retries``, a slot's ``limit``) as
JSON numbers, ``ttl``, ``age`` and ``renewed_ago`` as numbers of seconds (null when unknown),
a breaker's counts as numbers and ``forced`` as a boolean; a lease's other metadata entries
are strings, as stored. ``reap`` prints the same report as ``manage.py reap_expired_leases``
(:meth:`celery_steplock.reaper.ReapReport.human_lines`).

Corrupt data never ends a command with a traceback: a malformed lease is listed by ``ls``
(named below the table) and printed by ``show`` with its ``malformed`` field, exit 0; a
corrupt breaker (fields that are not what they claim, or a key of the wrong type) is printed
by ``breaker show`` with its ``malformed`` field, exit 0
(:meth:`celery_steplock.patterns.breaker.CircuitBreaker.state`), and ``breaker open|close``
refused by a key of the wrong type exits 1, changing nothing.

Exit status: 0 on success; 1 when ``show`` finds no lease, ``release`` released nothing,
``reap`` met errors, or Redis refused a breaker override (``WRONGTYPE``); 69
(``EX_UNAVAILABLE``, as ``celery inspect``) when Redis is unreachable or refuses our
credentials.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from typing import Any

import click
from celery.bin.base import CeleryCommand, handle_preload_options
from celery.exceptions import CeleryCommandException
from celery.platforms import EX_FAILURE, EX_UNAVAILABLE

from .exceptions import (
    InvalidArgument,
    LockNameError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
    StepLockError,
)
from .lease import INTEGER_FIELDS
from .lock import get_lease_store
from .ops import (
    MAX_BREAKERS,
    AuditRecordFailed,
    ForceReleaseRefused,
    LeaseHeldByAnother,
    breaker_rows,
    default_audit,
    force_release,
)
from .reaper import DEFAULT_BATCH_SIZE, DEFAULT_PING_TIMEOUT, reap
from .redact import printable, redact, secrets_of

__all__ = ["steplock"]

#: Columns of ``ls``: (header, lease field or computed name).
COLUMNS = (
    ("NAME", "name"),
    ("OWNER", "owner"),
    ("FENCE", "fence"),
    ("TASK", "task_name"),
    ("TASK ID", "task_id"),
    ("WORKER", "worker"),
    ("PID", "pid"),
    ("STEP", "step"),
    ("AGE", "age"),
    ("TTL", "ttl"),
)


def _shown(text: Any) -> str:
    """``text`` (an error, a message) as it may be printed: the secrets of the current app's
    settings masked, on one line."""
    ctx = click.get_current_context(silent=True)
    app = getattr(getattr(ctx, "obj", None), "app", None)
    return printable(redact(text, secrets_of(app)))


def _lock(ctx):
    try:
        return get_lease_store(ctx.obj.app)
    except StepLockError as exc:
        raise CeleryCommandException(message=f"steplock: {_shown(exc)}", exit_code=EX_FAILURE)


def _unavailable(exc: Exception) -> CeleryCommandException:
    return CeleryCommandException(message=f"steplock: {_shown(exc)}", exit_code=EX_UNAVAILABLE)


def _redis_now_ms(lock) -> int | None:
    try:
        seconds, micros = lock.client.time()
    except Exception:  # noqa: BLE001 - ages are a nicety; the listing still works without
        return None
    return int(seconds) * 1000 + int(micros) // 1000


def _with_age(lease: dict[str, Any], now_ms: int | None) -> dict[str, Any]:
    """``lease`` plus ``age`` (seconds since acquired, Redis clock) and ``renewed_ago``."""
    out = dict(lease)
    for field_name, target in (("acquired_ms", "age"), ("renewed_ms", "renewed_ago")):
        try:
            out[target] = round((now_ms - int(lease[field_name])) / 1000.0, 3)  # type: ignore[operator]
        except (TypeError, ValueError, KeyError):
            out[target] = None
    return out


#: Metadata entries the library writes as integers besides :data:`INTEGER_FIELDS` (a
#: concurrency limit's slot: ``limit``).
_INTEGER_METADATA = ("limit",)


def _typed(lease: dict[str, Any]) -> dict[str, Any]:
    """``lease`` for ``--json``: its integer fields as ints (``parse_lease`` left them as
    checked decimal strings; one that is not one is left as it is)."""
    out = dict(lease)
    for key in (*INTEGER_FIELDS, *_INTEGER_METADATA):
        value = out.get(key)
        if isinstance(value, str):
            text = value.strip()
            digits = text[1:] if text[:1] == "-" else text
            if digits.isascii() and digits.isdigit() and len(digits) <= 19:
                out[key] = int(text)
    return out


def _cell(value: Any, column: str) -> str:
    if value is None or value == "":
        return "-"
    if column in ("age", "ttl"):
        return f"{float(value):.1f}s"
    if column == "owner":
        return str(value)[:12] + ".."
    if column == "task_id":
        return str(value)[:8]
    if column == "task_name":
        return str(value).rsplit(".", 1)[-1]
    return str(value)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [[h for h, _ in COLUMNS]] + [
        [printable(_cell(r.get(c), c)) for _, c in COLUMNS] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in cells]


@click.group(short_help="Leases and circuit breakers: ls, show, history, release, reap, breaker.")
@click.pass_context
@handle_preload_options
def steplock(ctx):
    """celery-steplock: look at, release and reap leases; look at, open and close circuit
    breakers (breaker ls|show|open|close)."""


@steplock.command("ls", cls=CeleryCommand, short_help="List held leases (SCAN, never KEYS).")
@click.option(
    "--match",
    default="*",
    show_default=True,
    metavar="GLOB",
    help="only lease names matching this glob (Redis MATCH syntax)",
)
@click.option(
    "--limit",
    default=100,
    show_default=True,
    type=click.IntRange(min=0),
    help="stop after this many leases (0: all of them)",
)
@click.option("--json", "as_json", is_flag=True, help="print a JSON list instead of a table")
@click.pass_context
def ls(ctx, match, limit, as_json):
    """List held leases (SCAN with a cursor, never KEYS)."""
    lock = _lock(ctx)
    found: dict[str, dict[str, Any]] = {}
    more = False
    cursor = 0
    try:
        while True:
            cursor, leases = lock.scan(cursor, count=DEFAULT_BATCH_SIZE, match=match)
            for lease in leases:
                found.setdefault(lease["key"], lease)  # SCAN may return a key twice
            if limit and len(found) >= limit:
                more = cursor != 0 or len(found) > limit
                break
            if cursor == 0:
                break
    except StepLockError as exc:
        raise _unavailable(exc)
    now_ms = _redis_now_ms(lock)
    rows = sorted((_with_age(lease, now_ms) for lease in found.values()), key=lambda r: r["name"])
    if limit:
        rows = rows[:limit]
    if as_json:
        click.echo(json.dumps([_typed(row) for row in rows], sort_keys=True, default=str))
        return
    if not rows:
        click.echo(f"no lease held (match {match!r})")
        return
    # A concurrency limit's slot (celery_steplock.patterns.concurrency) says so where a step would be.
    shown_rows = [
        dict(row, step=f"slot of {row.get('limit_key')} (limit {row.get('limit')})")
        if row.get("kind") == "slot" and not row.get("step")
        else row
        for row in rows
    ]
    for line in _table(shown_rows):
        click.echo(line)
    click.echo(f"{len(rows)} lease(s)" + (f"; more not shown (--limit {limit})" if more else ""))
    malformed = [row["name"] for row in rows if row.get("malformed")]
    if malformed:
        click.echo(
            f"{len(malformed)} malformed lease(s), fields left out (see show NAME): "
            + ", ".join(json.dumps(name) for name in malformed[:10])
            + (" ..." if len(malformed) > 10 else "")
        )


@steplock.command("show", cls=CeleryCommand, short_help="Show every field of the lease NAME.")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object")
@click.pass_context
def show(ctx, name, as_json):
    """Show every field of the lease NAME (exit 1 when it is not held)."""
    lock = _lock(ctx)
    try:
        lease = lock.inspect(name)
    except StepLockError as exc:
        raise _unavailable(exc)
    if lease is None:
        raise CeleryCommandException(
            message=f"no lease named {name!r} is held", exit_code=EX_FAILURE
        )
    lease = _with_age(lease, _redis_now_ms(lock))
    if as_json:
        click.echo(json.dumps(_typed(lease), sort_keys=True, default=str))
        return
    shown = {printable(k): "-" if v in (None, "") else printable(v) for k, v in lease.items()}
    width = max(len(k) for k in shown)
    for key in sorted(shown):
        click.echo(f"{key.ljust(width)}  {shown[key]}")


_HISTORY_COLUMNS = (
    ("TIME (UTC)", "at"),
    ("EVENT", "event"),
    ("FENCE", "fence"),
    ("OWNER", "owner"),
    ("TASK ID", "task_id"),
    ("OUTCOME", "outcome"),
    ("DETAIL", "detail"),
)


def _history_row(entry: Any) -> dict[str, str]:
    """One history entry as the table's cells (all text, printable)."""
    at = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.at))
        + f".{int(entry.at * 1000) % 1000:03d}"
    )
    detail = []
    fence = entry.fence
    if entry.contended:
        detail.append(f"{entry.contended} refused acquire{'' if entry.contended == 1 else 's'}")
    if entry.holder:
        # A contended entry's owner is the refused one; the fence is its holder's grant.
        detail.append(f"held by {entry.holder}" + (f" (fence {fence})" if fence else ""))
        fence = None
    if entry.by:
        detail.append(f"by {entry.by}")
    if entry.reason:
        detail.append(entry.reason)
    row = {
        "at": at,
        "event": entry.event,
        "fence": "-" if fence is None else str(fence),
        "owner": entry.owner or "-",
        "task_id": entry.task_id or "-",
        "outcome": entry.outcome or "-",
        "detail": "; ".join(detail) or "-",
    }
    return {k: printable(v) for k, v in row.items()}


@steplock.command(
    "history", cls=CeleryCommand, short_help="Show the history of the lock name NAME."
)
@click.argument("name")
@click.option(
    "--count",
    type=click.IntRange(1, 10_000),
    default=50,
    show_default=True,
    help="entries at most, newest first",
)
@click.option("--json", "as_json", is_flag=True, help="print a JSON list, newest first")
@click.pass_context
def history(ctx, name, count, as_json):
    """Show the history of the lock name NAME, newest first: its lease events (acquired,
    contended, released with the execution's outcome, forced, reaped, lost; expired
    inferred) from its capped Redis list (celery_steplock.history). An entry that cannot
    be read is shown as "malformed"; no history says so (exit 0)."""
    lock = _lock(ctx)
    try:
        entries = lock.history(name, count)
    except (InvalidArgument, LockNameError) as exc:
        raise CeleryCommandException(message=f"steplock: {_shown(exc)}", exit_code=EX_FAILURE)
    except StepLockError as exc:
        raise _unavailable(exc)
    if as_json:
        click.echo(json.dumps([e.as_dict() for e in entries], sort_keys=True, default=str))
        return
    if not entries:
        click.echo(f"no history for {printable(name)}")
        return
    cells = [[h for h, _ in _HISTORY_COLUMNS]] + [
        [row[c] for _, c in _HISTORY_COLUMNS] for row in map(_history_row, entries)
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_HISTORY_COLUMNS))]
    for row in cells:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


@steplock.command(
    "release", cls=CeleryCommand, short_help="Release the lease NAME if TOKEN still holds it."
)
@click.argument("name")
@click.option(
    "--owner",
    required=True,
    metavar="TOKEN",
    help="the owner token you saw holding it (ls / show); nothing is deleted if "
    "another owner holds the lease now",
)
@click.pass_context
def release(ctx, name, owner):
    """Release the lease NAME if TOKEN still holds it (exit 1 otherwise).

    Audited as the admin's force release (celery_steplock.ops.force_release): the record
    names the OS user and this host. With a Django project (DJANGO_SETTINGS_MODULE set and
    celery_steplock.contrib.django installed) a LeaseEvent row is committed before the
    delete; otherwise the record is the WARNING log line event=force_release_audit (on
    stderr unless logging is configured) and the force_release_audit signal.
    """
    lock = _lock(ctx)
    app = ctx.obj.app
    _load_django(app)
    actor, host = _actor(), _host()
    try:
        released = force_release(
            lock,
            name,
            owner,
            actor=actor,
            actor_host=host,
            via="cli",
            app=app,
            auditor=default_audit(app),
            reason=f"force-released by {actor}@{host} from the command line",
        )
    except AuditRecordFailed as failed:
        raise CeleryCommandException(
            message=f"not released: {name!r}: the audit record could not be written "
            f"({_shown(failed.__cause__)})",
            exit_code=EX_FAILURE,
        )
    except ForceReleaseRefused as refused:
        why = (
            f"it is held by another owner ({printable(refused.holder)})"
            if isinstance(refused, LeaseHeldByAnother)
            else "it is not held"
        )
        raise CeleryCommandException(
            message=f"not released: {name!r}: {why}", exit_code=EX_FAILURE
        )
    except StepLockError as exc:
        record = getattr(exc, "forced_release", None)
        if record is not None and record.outcome == "unknown":
            raise CeleryCommandException(
                message=f"steplock: Redis stopped answering during the release of {name!r}: "
                f"it may or may not be released (recorded as outcome unknown): {exc}",
                exit_code=EX_UNAVAILABLE,
            )
        raise _unavailable(exc)
    click.echo(
        f"released {name!r} (owner {printable(owner)}, fence {released.fence}; audit: "
        f"{released.audit or 'log line event=force_release_audit'})"
    )
    if not released.outcome_recorded:
        click.echo(
            f"warning: the outcome could not be recorded ({printable(released.outcome_error)}); "
            f"the audit record ({released.audit}) still says 'requested'",
            err=True,
        )


def _load_django(app) -> None:
    """With a Django project (``DJANGO_SETTINGS_MODULE``), load the app's modules as
    ``celery report`` does: Celery's Django fix-up runs ``django.setup()``, after which the
    audit record goes to the database. A failure refuses the release (exit 1)."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return
    try:
        app.loader.import_default_modules()
    except Exception as exc:  # noqa: BLE001 - no database record, so no release
        raise CeleryCommandException(
            message=f"not released: could not load the app's modules, so the audit record "
            f"cannot be written to the database ({_shown(f'{type(exc).__name__}: {exc}')})",
            exit_code=EX_FAILURE,
        )


def _actor() -> str:
    """The operator, for the record: the OS account running the command (its passwd name,
    which the environment cannot change), else the login name, else the user id; followed
    by ``$USER``, ``$LOGNAME`` and ``$SUDO_USER`` where they name someone else, as claims
    (``"root (USER=ceo, SUDO_USER=alice)"``)."""
    try:
        import pwd

        account = pwd.getpwuid(os.getuid()).pw_name
    except Exception:  # noqa: BLE001 - no pwd module or passwd entry (a container)
        try:
            account = getpass.getuser()
        except Exception:  # noqa: BLE001 - nothing names the user: the uid will do
            return f"uid {os.getuid()}"
    claims = [
        f"{var}={printable(os.environ[var])}"
        for var in ("USER", "LOGNAME", "SUDO_USER")
        if os.environ.get(var) and os.environ[var] != account
    ]
    return f"{account} ({', '.join(claims)})" if claims else account


def _host() -> str:
    """Where the operator runs the command: this host's name."""
    try:
        return socket.gethostname()
    except OSError:
        return "?"


@steplock.command(
    "reap", cls=CeleryCommand, short_help="Reap dead owners' leases, recover steps, relay effects."
)
@click.option("--dry-run", is_flag=True, help="report what would be done, change nothing")
@click.option("--json", "as_json", is_flag=True, help="print the report as one JSON object")
@click.option(
    "--batch-size",
    default=DEFAULT_BATCH_SIZE,
    show_default=True,
    type=click.IntRange(min=1),
    help="SCAN COUNT hint and database chunk size",
)
@click.option(
    "--older-than",
    default=None,
    type=click.FloatRange(min=0),
    metavar="SECONDS",
    help="recover only steps in flight for longer (default: the setting)",
)
@click.option(
    "--ping-timeout",
    default=DEFAULT_PING_TIMEOUT,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="seconds to wait for workers' ping replies",
)
@click.option(
    "--no-pid-check",
    is_flag=True,
    help="judge leases by their worker's ping only, not by their pid",
)
@click.option(
    "--no-effects",
    is_flag=True,
    help="do not relay the effects outbox (nor report on it)",
)
@click.pass_context
def reap_(ctx, dry_run, as_json, batch_size, older_than, ping_timeout, no_pid_check, no_effects):
    """Reap the leases of dead owners, recover the steps they left in flight and relay the
    effects they left in the outbox."""
    app = ctx.obj.app
    # Load the app's modules as `celery report` does: with Celery's Django fixup this runs
    # django.setup(), without which no step model can be read (pass 1 still runs).
    try:
        app.loader.import_default_modules()
    except Exception as exc:  # noqa: BLE001 - a broken import must not stop lease reaping
        click.echo(
            f"warning: could not load the app's modules ({_shown(exc)}); steps may "
            f"not be recovered",
            err=True,
        )
    started = time.monotonic()
    report = reap(
        app,
        dry_run=dry_run,
        batch_size=batch_size,
        older_than=older_than,
        ping_timeout=ping_timeout,
        check_pids=not no_pid_check,
        effects=not no_effects,
    )
    if as_json:
        click.echo(json.dumps(report.as_dict(), sort_keys=True, default=str))
    else:
        for line in report.human_lines():
            click.echo(line)
    for message in report.errors:
        click.echo(f"error: {_shown(message)}", err=True)
    if report.errors:
        raise CeleryCommandException(
            message=f"reap met {len(report.errors)} error(s) in {time.monotonic() - started:.1f}s",
            exit_code=EX_FAILURE,
        )


# -- circuit breakers ------------------------------------------------------------------------


@steplock.group("breaker", short_help="Circuit breakers: ls, show, open, close.")
def breaker_group():
    """Circuit breakers (celery_steplock.patterns.breaker): ls, show, open, close."""


def _breaker(ctx, name):
    from .patterns.breaker import CircuitBreaker

    try:
        return CircuitBreaker(name, app=ctx.obj.app)
    except StepLockError as exc:
        raise CeleryCommandException(message=f"steplock: {_shown(exc)}", exit_code=EX_FAILURE)


#: Columns of ``breaker ls``: (header, state field).
BREAKER_COLUMNS = (
    ("NAME", "name"),
    ("STATE", "state"),
    ("FORCED", "forced"),
    ("FAILURES", "failures"),
    ("CALLS", "calls"),
    ("PROBES", "probes"),
    ("OPENED AGO", "opened_ago"),
)


def _breaker_cell(value: Any, column: str) -> str:
    if value is None or value == "":
        return "-"
    if column == "opened_ago":
        return f"{float(value):.1f}s"
    if column == "forced":
        return "yes" if value else "no"
    return str(value)


@breaker_group.command("ls", cls=CeleryCommand, short_help="List the circuit breakers.")
@click.option(
    "--limit",
    default=MAX_BREAKERS,
    show_default=True,
    type=click.IntRange(min=1),
    help="breakers at most",
)
@click.option("--json", "as_json", is_flag=True, help="print a JSON list instead of a table")
@click.pass_context
def breaker_ls(ctx, limit, as_json):
    """List the circuit breakers: those the app's tasks name, then those Redis holds (SCAN,
    never KEYS), each with its state; the listing of the Django admin's breaker page
    (celery_steplock.ops.breaker_rows). A corrupt one is listed with what is wrong below.
    """
    app = ctx.obj.app
    try:  # the tasks' circuit_breaker options: load the app's modules as `reap` does
        app.loader.import_default_modules()
    except Exception as exc:  # noqa: BLE001 - Redis still lists the breakers it holds
        click.echo(
            f"warning: could not load the app's modules ({_shown(exc)}); only the "
            f"breakers Redis holds are listed",
            err=True,
        )
    try:
        rows = breaker_rows(app, limit)
    except StepLockError as exc:
        raise _unavailable(exc)
    for row in rows:  # as `show`: these depend on options the tasks configure
        row.pop("retry_after", None)
        row.pop("limits", None)
    if as_json:
        click.echo(json.dumps(rows, sort_keys=True, default=str))
        return
    if not rows:
        click.echo("no circuit breaker")
        return
    cells = [[h for h, _ in BREAKER_COLUMNS]] + [
        [printable(_breaker_cell(r.get(c), c)) for _, c in BREAKER_COLUMNS] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(BREAKER_COLUMNS))]
    for cell_row in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(cell_row, widths)).rstrip())
    click.echo(f"{len(rows)} circuit breaker(s)")
    malformed = [row for row in rows if row.get("malformed")]
    for row in malformed:
        click.echo(f"malformed {printable(row['name'])}: {printable(row['malformed'])}")


@breaker_group.command(
    "show", cls=CeleryCommand, short_help="Show the state of the circuit breaker NAME."
)
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object")
@click.pass_context
def breaker_show(ctx, name, as_json):
    """Show the state of the circuit breaker NAME (a dependency name) as Redis holds it.

    A corrupt breaker is shown too (exit 0): its ``malformed`` line says what is wrong.
    """
    breaker = _breaker(ctx, name)
    try:
        state = breaker.state().as_dict()
    except StepLockError as exc:
        raise _unavailable(exc)
    state.pop("retry_after", None)  # depends on the recovery timeout, which tasks configure
    if as_json:
        click.echo(json.dumps(state, sort_keys=True, default=str))
        return
    width = max(len(k) for k in state)
    for key in sorted(state):
        value = state[key]
        click.echo(f"{key.ljust(width)}  {'-' if value in (None, '') else printable(value)}")


def _override(ctx, name, action, reason):
    from .ops import override_breaker

    breaker = _breaker(ctx, name)
    app = ctx.obj.app
    _load_django(app)
    actor, host = _actor(), _host()
    try:
        record = override_breaker(
            breaker,
            action,
            actor=actor,
            actor_host=host,
            via="cli",
            reason=reason or f"{action} by {actor}@{host} from the command line",
            app=app,
        )
    except AuditRecordFailed as failed:
        raise CeleryCommandException(
            message=f"not changed: circuit breaker {name!r}: the audit record could not be "
            f"written ({_shown(failed.__cause__)})",
            exit_code=EX_FAILURE,
        )
    except (LockStoreUnavailable, LockStoreMisconfigured) as exc:
        raise _unavailable(exc)
    except StepLockError as exc:  # Redis answered and refused: a key of the wrong type
        raise CeleryCommandException(
            message=f"not changed: circuit breaker {name!r}: {_shown(exc)} (see show {name})",
            exit_code=EX_FAILURE,
        )
    click.echo(
        f"circuit breaker {printable(name)!r}: {record.previous} -> "
        f"{'open (forced, until closed)' if action == 'open' else 'closed'} (audit: "
        f"{record.audit or 'log line event=circuit_override_audit'})"
    )


@breaker_group.command(
    "open", cls=CeleryCommand, short_help="Force the circuit breaker NAME open (audited)."
)
@click.argument("name")
@click.option("--reason", default="", help="why, for the audit record")
@click.pass_context
def breaker_open(ctx, name, reason):
    """Force the circuit breaker NAME open: no call passes until it is closed. Audited."""
    _override(ctx, name, "open", reason)


@breaker_group.command(
    "close", cls=CeleryCommand, short_help="Close the circuit breaker NAME (audited)."
)
@click.argument("name")
@click.option("--reason", default="", help="why, for the audit record")
@click.pass_context
def breaker_close(ctx, name, reason):
    """Close the circuit breaker NAME (its window emptied, a forced open lifted). Audited."""
    _override(ctx, name, "close", reason)
