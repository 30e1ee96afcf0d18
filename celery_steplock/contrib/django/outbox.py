"""The effects outbox, Django side: rows written with the step's transition, sent after COMMIT.

:mod:`celery_steplock.effects` declares effects; this module keeps them as
:class:`~celery_steplock.contrib.django.models.Effect` rows and sends them:

* :func:`write` inserts the declared effects in the step's transaction (status ``pending``,
  ``next_attempt_at`` = now + ``steplock_effect_relay_delay``), so they exist if and only if
  the transition commits;
* :func:`dispatch`, the on-commit path: the committing process claims its own fresh rows by
  id (``attempts == 0``) and sends them at once;
* :func:`relay`, the periodic path (the ``celery_steplock.relay_effects`` task, the
  reaper): claims due rows (``pending``, ``next_attempt_at <= now``) one at a time with a
  compare-and-swap ``UPDATE``, sends each outside any transaction, and marks it.

Claims. A claim is one ``UPDATE ... WHERE id = %s AND status = 'pending' AND attempts = %s
AND next_attempt_at <= now`` that adds one to ``attempts``, writes the claimer's token to
``claimed_by`` and moves ``next_attempt_at`` to now + ``steplock_effect_claim_timeout``: of
two relays reading the same row, one updates it, the other finds it changed (0 rows) and
leaves it. The attempt is counted when claimed, so a process that dies while sending has
used one. The mark after the send is an ``UPDATE ... WHERE claimed_by = <token>``: a relay
whose claim timed out (another took the row over) or whose row an operator discarded
meanwhile writes nothing (``event=effect_mark_lost``). A relay slower than the claim timeout
may therefore send an effect twice, and so may a process that dies between the send and the
mark: delivery is at least once, and the receiver dedupes on the key.

Sends, by kind (the row's ``payload`` is :class:`celery_steplock.effects.Declared`'s):

* ``task``: ``app.send_task(target, args, kwargs, task_id=key, **options)``; outcome: the
  task id (the key);
* ``http``: :mod:`urllib.request`, header ``Idempotency-Key: <key>``, a JSON or text body,
  ``timeout`` (or ``steplock_effect_http_timeout``) seconds; a 2xx answer dispatches it
  (outcome ``"HTTP 200"``); 408, 409, 425, 429, 5xx, a timeout or a connection error is
  retried; another status is a permanent refusal;
* ``email``: :class:`django.core.mail.EmailMessage` with the headers ``Idempotency-Key`` and
  ``Message-ID: <effect.<sha256 of the key>@<sender's domain>>`` (the same for every send);
* ``call``: the callable registered with ``@effects.register(target)``, called as
  ``func(*args, idempotency_key=key, **kwargs)``; a name this process has not registered is
  retried (a relay started before the module that registers it was deployed).

Failures are judged by :mod:`celery_steplock.patterns.retry` (its classifier, its backoff
with full jitter, ``Retry-After`` honoured up to :data:`MAX_RETRY_AFTER`): a retryable or
unknown error waits ``RetryPolicy.countdown(attempts)`` seconds (base :data:`BACKOFF`, cap
:data:`BACKOFF_MAX`), a permanent one (``NonRetryable``, an HTTP 4xx but 408/409/425/429,
a ``ValueError``...) makes the effect ``dead`` at once, and so does the last of
``max_attempts``. Each outcome is one signal and one log line: ``effect_dispatched``
(INFO), ``effect_retry`` (WARNING), ``effect_dead`` (ERROR).

Operators: :func:`retry_effects` and :func:`discard_effects`, audited as a force release is
(:class:`~celery_steplock.contrib.django.eventlog.LeaseEventAudit`: a ``LeaseEvent`` row,
event ``effect_retried`` / ``effect_discarded``, committed before the change, its outcome
written after). :func:`pending_stats` gives the outbox's depth and age.

Databases: :func:`relay` and :func:`pending_stats` without ``using`` visit every database
where the router lets the ``Effect`` table be (``router.allow_migrate_model``); one where the
table does not exist (not migrated) is skipped with a WARNING line
(``event=effect_relay_skipped``), not an error.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import smtplib
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from django.apps import apps
from django.db import DatabaseError, connections, router, transaction
from django.db.models import F
from django.utils import timezone

from ... import signals
from ..._checks import MAX_RETRIES
from ...conf import Settings
from ...events import emit, log_event
from ...exceptions import AuditRecordFailed, EffectsUnavailable, InvalidEffect
from ...ops import ForcedRelease
from ...patterns.retry import RetryPolicy, http_status_of
from ...redact import redact

__all__ = [
    "RelayReport",
    "EffectAction",
    "write",
    "dispatch",
    "relay",
    "pending_stats",
    "retry_effects",
    "discard_effects",
    "databases",
    "OUTBOX_SENDER",
    "BACKOFF",
    "BACKOFF_MAX",
    "MAX_RETRY_AFTER",
]

logger = logging.getLogger("celery_steplock")

#: The signals' sender.
OUTBOX_SENDER = "celery_steplock.outbox"
#: Seconds: the base of the backoff between attempts (attempt n waits up to
#: ``min(BACKOFF_MAX, BACKOFF * 2**(n-1))``, full jitter).
BACKOFF = 1.0
#: Seconds: the longest wait between two attempts drawn by the backoff.
BACKOFF_MAX = 300.0
#: Seconds: the longest ``Retry-After`` of a receiver that is honoured.
MAX_RETRY_AFTER = 3600.0
#: Characters of an error kept in ``last_error`` and in the signals.
MAX_ERROR = 2000

#: The share of ``steplock_effect_claim_timeout`` an HTTP send may wait for its receiver
#: (a longer payload or setting timeout is cut to it): the claim must outlive the send, or a
#: second relay takes the row over and sends it again while the first still waits.
CLAIM_SHARE = 0.5
#: HTTP statuses retried besides 5xx: 408 Request Timeout, 409 Conflict (the receiver is
#: still processing the same key), 425 Too Early, 429 Too Many Requests.
RETRIED_STATUSES = (408, 409, 425, 429)


@dataclass
class RelayReport:
    """What one :func:`relay` or :func:`dispatch` did.

    Attributes:
        dispatched: Effects the receiver accepted, marked ``dispatched``.
        retried: Effects that failed and wait for their next attempt.
        dead: Effects marked ``dead`` (a permanent refusal, or their last attempt).
        pending: Effects still ``pending`` afterwards in the databases visited
            (:func:`dispatch`: those of its ids it neither sent nor marked dead).
        oldest_pending_seconds: Age (seconds since written) of the oldest of them; None when
            none (and from :func:`dispatch`, which does not look).
        skipped: Aliases of the databases skipped (no ``Effect`` table, or an error).
    """

    dispatched: int = 0
    retried: int = 0
    dead: int = 0
    pending: int = 0
    oldest_pending_seconds: float | None = None
    skipped: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-able dict (the Celery task's result)."""
        data = asdict(self)
        data["skipped"] = list(self.skipped)
        return data


def _settings(app: Any) -> Settings:
    if app is None:
        from .leases import celery_app

        app = celery_app()
    return Settings(app)


def _app(app: Any) -> Any:
    if app is not None:
        return app
    from .leases import celery_app

    return celery_app()


def _model():
    """The Effect model; EffectsUnavailable naming the fix when the library's Django app
    (where it lives) is not installed."""
    if not apps.is_installed("celery_steplock.contrib.django"):
        raise EffectsUnavailable(
            "the effects outbox is the Effect model of the app 'celery_steplock.contrib.django': "
            "add it to INSTALLED_APPS and run `python manage.py migrate`"
        )
    from .models import Effect

    return Effect


def _token() -> str:
    """A claim token: ``<host>:<pid>:<random>``, at most 64 characters."""
    return f"{socket.gethostname()[:36]}:{os.getpid()}:{uuid.uuid4().hex[:16]}"[:64]


def _error_text(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}")[:MAX_ERROR]


# -- databases ---------------------------------------------------------------------------------


def databases(using: str | None = None) -> list[str]:
    """The aliases :func:`relay` visits: ``[using]``, or every database the router lets the
    ``Effect`` table be in (``router.allow_migrate_model``), in ``DATABASES`` order."""
    if using is not None:
        return [using]
    Effect = _model()
    return [alias for alias in connections if router.allow_migrate_model(alias, Effect)]


def _has_table(alias: str) -> bool:
    Effect = _model()
    connection = connections[alias]
    with connection.cursor() as cursor:
        return Effect._meta.db_table in connection.introspection.table_names(cursor)


def _usable(aliases: list[str], explicit: bool) -> tuple[list[str], list[str]]:
    """``(aliases with the table, aliases skipped)``; each skip is logged."""
    found, skipped = [], []
    for alias in aliases:
        try:
            present = _has_table(alias)
        except DatabaseError as exc:
            log_event(
                "effect_relay_skipped",
                logging.ERROR,
                using=alias,
                reason="database unreachable",
                error=_error_text(exc),
            )
            skipped.append(alias)
            continue
        if not present:
            log_event(
                "effect_relay_skipped",
                logging.WARNING,
                using=alias,
                reason=f"no {_model()._meta.db_table} table (run migrate on this database)",
                explicit=explicit,
            )
            skipped.append(alias)
            continue
        found.append(alias)
    return found, skipped


def _outside_transaction(using: str, what: str) -> None:
    if transaction.get_connection(using).in_atomic_block:
        from ...exceptions import OuterTransactionError

        raise OuterTransactionError(
            f"{what} sends effects and must run outside any transaction (database {using!r} "
            f"is in one): a claim inside it would be invisible to other relays and a send "
            f"could not be undone by its rollback"
        )


# -- write ----------------------------------------------------------------------------------


def write(
    using: str,
    declared: Sequence[Any],
    *,
    step: str,
    fence: int | None,
    key_base: str,
    owner: str,
    task_id: str,
    task_name: str,
    max_attempts: int | None = None,
    relay_delay: float | None = None,
    app: Any = None,
) -> list[int]:
    """Insert the declared effects as ``pending`` rows on ``using`` (one ``INSERT``).

    Called inside the step's transaction, after its fenced compare-and-swap applied: the
    rows commit with it or not at all.

    Args:
        using: The step's database alias.
        declared: :class:`celery_steplock.effects.Declared` effects, in position order.
        step: The step (``"<label>:<pk>"``).
        fence: The lease's fencing token (None without a lease).
        key_base: ``"<step>:<fence>:<to>"``; each row's key is ``"<key_base>:<position>"``.
        owner: The lease's owner token ("" without a lease).
        task_id: The declaring task's id ("" outside a task).
        task_name: The declaring task's name.
        max_attempts: Attempts before ``dead`` (None: ``steplock_effect_max_attempts``).
        relay_delay: Seconds before the periodic relay may take a row over from the
            committing process (None: ``steplock_effect_relay_delay``).
        app: The Celery app whose settings are read (default: the current app).

    Returns:
        The rows' ids, in position order.

    Raises:
        InvalidEffect: A key longer than 255 characters (naming ``step``).
        EffectsUnavailable: The router does not allow the ``Effect`` table on ``using``
            (``router.allow_migrate_model``): nothing written.
        django.db.DatabaseError: From the insert (the step's transaction then rolls back).
    """
    if not declared:
        return []
    Effect = _model()
    if not router.allow_migrate_model(using, Effect):
        # No table there (migrate skips it), and relay() never visits it: a row written
        # there (a table made by hand) would be sent on commit or never.
        raise EffectsUnavailable(
            f"effects cannot be written on the step's database {using!r}: the database "
            f"router does not allow the outbox table ({Effect._meta.db_table}) there "
            f"(allow_migrate), so it has none and the relay would never visit it. Allow "
            f"celery_steplock's Effect on {using!r} and run `manage.py migrate --database "
            f"{using}`; the effects are written in the step's own transaction"
        )
    if max_attempts is None or relay_delay is None:
        settings = _settings(app)
        max_attempts = settings.effect_max_attempts if max_attempts is None else max_attempts
        relay_delay = settings.effect_relay_delay if relay_delay is None else relay_delay
    now = timezone.now()
    due = now + dt.timedelta(seconds=relay_delay)
    rows = []
    for effect in declared:
        key = f"{key_base}:{effect.position}"
        if len(key) > 255:
            raise InvalidEffect(
                f"the effect key {key[:80]!r}... is {len(key)} characters, more than 255",
                "step",
            )
        rows.append(
            {
                "key": key,
                "step": step[:255],
                "fence": fence,
                "position": effect.position,
                "kind": effect.kind,
                "target": effect.target,
                "payload": effect.payload,
                "status": "pending",
                "attempts": 0,
                "max_attempts": max_attempts,
                "next_attempt_at": due,
                "claimed_by": "",
                "task_id": (task_id or "")[:255],
                "task_name": (task_name or "")[:255],
                "owner": (owner or "")[:64],
                "outcome": "",
                "last_error": "",
                "created_at": now,
            }
        )
    return _insert(Effect, using, rows)


def _insert(Effect: Any, using: str, rows: list[dict[str, Any]]) -> list[int]:
    """Multi-row ``INSERT``s of ``rows`` (column values by field name), each value adapted
    by its Django field (``get_db_prep_save``), in batches the database's parameter limit
    allows (Django's ``bulk_batch_size``: SQLite's 999 or 32,766 variables, PostgreSQL's
    65,535 with server-side binding); the ids in ``rows``' order (``RETURNING`` where the
    database has it, else read back by key). The step's transaction runs it on its hot path:
    the ORM's ``bulk_create`` builds the same statements at twice the cost (model instances,
    the compiler, per row)."""
    connection = connections[using]
    fields = [Effect._meta.get_field(name) for name in rows[0]]
    quote = connection.ops.quote_name
    table = quote(Effect._meta.db_table)
    columns = ", ".join(quote(f.column) for f in fields)
    row = "(" + ", ".join(["%s"] * len(fields)) + ")"
    returning = connection.features.can_return_rows_from_bulk_insert
    batch = max(1, connection.ops.bulk_batch_size(fields, rows))
    found: list[tuple[int, str]] = []
    with connection.cursor() as cursor:
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            sql = f"INSERT INTO {table} ({columns}) VALUES " + ", ".join([row] * len(chunk))
            if returning:
                sql += f" RETURNING {quote('id')}, {quote('key')}"
            cursor.execute(
                sql,
                [
                    field.get_db_prep_save(values[field.name], connection)
                    for values in chunk
                    for field in fields
                ],
            )
            if returning:
                found.extend(cursor.fetchall())
    keys = [values["key"] for values in rows]
    if len(found) != len(rows):
        found = list(Effect.objects.using(using).filter(key__in=keys).values_list("pk", "key"))
    by_key = {key: pk for pk, key in found}
    return [by_key[key] for key in keys]


# -- sending --------------------------------------------------------------------------------


class _HTTPStatus(Exception):
    """A receiver's non-2xx answer, shaped for the retry classifier (``status_code``,
    ``response.headers`` for ``Retry-After``)."""

    def __init__(self, status: int, headers: Any, url: str) -> None:
        super().__init__(f"HTTP {status} from {url}")
        self.status_code = status
        self.response = type("Response", (), {"status_code": status, "headers": headers})()
        if 300 <= status < 400:  # a redirect is not followed: the URL is wrong, permanently
            self.retryable = False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects are answers, not followed: a POST would be replayed as a GET elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class _NotRegistered(Exception):
    """A ``call`` effect names a callable this process has not registered: retried (the
    module registering it may not be deployed on this relay yet)."""

    retryable = True


def _classifier(exc: BaseException) -> bool | None:
    """The outbox's additions to the retry classifier: HTTP 409 and 425 are retried (the
    classifier's 408, 429 and 5xx too); an SMTP 4xx reply is transient, a 5xx permanent."""
    status = http_status_of(exc)
    if status in RETRIED_STATUSES:
        return True
    if isinstance(exc, smtplib.SMTPResponseException):
        code = exc.smtp_code
        if 400 <= code < 500:
            return True
        if 500 <= code < 600:
            return False
    return None


def _policy(max_attempts: int) -> RetryPolicy:
    return RetryPolicy(
        max_attempts=min(max(1, max_attempts), MAX_RETRIES),
        backoff=BACKOFF,
        backoff_max=BACKOFF_MAX,
        classifier=_classifier,
        retry_unknown=True,
    )


def _send_task(effect: Any, app: Any) -> str:
    payload = effect.payload or {}
    options = dict(payload.get("options") or {})
    options.pop("task_id", None)
    result = _app(app).send_task(
        effect.target,
        args=list(payload.get("args") or ()),
        kwargs=dict(payload.get("kwargs") or {}),
        task_id=effect.key,
        **options,
    )
    return str(getattr(result, "id", effect.key))


def _send_http(effect: Any, timeout: float, claim_timeout: float) -> str:
    payload = effect.payload or {}
    headers = {str(k): str(v) for k, v in (payload.get("headers") or {}).items()}
    body: bytes | None = None
    if payload.get("json") is not None:
        body = json.dumps(payload["json"]).encode("utf-8")
        headers.setdefault("Content-Type", "application/json")
    elif payload.get("data") is not None:
        body = str(payload["data"]).encode("utf-8")
        headers.setdefault("Content-Type", "text/plain; charset=utf-8")
    headers["Idempotency-Key"] = header_key(effect.key)
    request = urllib.request.Request(
        effect.target, data=body, headers=headers, method=payload.get("method") or "POST"
    )
    seconds = min(payload.get("timeout") or timeout, claim_timeout * CLAIM_SHARE)
    try:
        with _OPENER.open(request, timeout=seconds) as response:
            response.read(65536)
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
        headers_in = exc.headers
        exc.close()
        raise _HTTPStatus(status, headers_in, effect.target) from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, BaseException):
            raise reason from exc  # ConnectionRefusedError, TimeoutError: the classifier's
        raise
    if not 200 <= status < 300:  # a 1xx/3xx urllib did not follow
        raise _HTTPStatus(status, {}, effect.target)
    return f"HTTP {status}"


#: The characters an ``Idempotency-Key`` header carries as they are (besides letters and
#: digits); any other character of a key is percent-encoded (UTF-8) by :func:`header_key`.
HEADER_SAFE = ":/@.-_~"


def header_key(key: str) -> str:
    """The ``Idempotency-Key`` header value of an effect ``key``: the key itself when it is
    ASCII letters, digits and ``:/@.-_~`` (every key of an integer or UUID primary key and
    an ASCII status), else its percent-encoding (``urllib.parse.quote``, UTF-8), so a
    status or primary key with non-ASCII letters, spaces or CR/LF is still one deterministic,
    valid header value (RFC 9110 5.5) rather than an effect that can never be sent."""
    return urllib.parse.quote(key, safe=HEADER_SAFE)


def _message_id(key: str, sender: str) -> str:
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:40]
    domain = sender.rsplit("@", 1)[-1].strip(" >") if "@" in sender else ""
    if not domain or any(c in domain for c in " <>\r\n"):
        domain = "steplock.invalid"
    return f"<effect.{digest}@{domain}>"


def _send_email(effect: Any) -> str:
    from django.conf import settings as django_settings
    from django.core.mail import EmailMessage

    payload = effect.payload or {}
    sender = payload.get("from_email") or django_settings.DEFAULT_FROM_EMAIL
    to = list(payload.get("to") or [a.strip() for a in effect.target.split(",") if a.strip()])
    headers = dict(payload.get("headers") or {})
    headers["Idempotency-Key"] = effect.key
    headers["Message-ID"] = _message_id(effect.key, str(sender))
    message = EmailMessage(
        subject=payload.get("subject", ""),
        body=payload.get("body", ""),
        from_email=sender,
        to=to,
        headers=headers,
    )
    sent = message.send(fail_silently=False)
    return f"sent to {len(to)} ({sent} message)"


def _send_call(effect: Any) -> str:
    from ... import effects

    try:
        func = effects.registered(effect.target)
    except InvalidEffect as exc:
        raise _NotRegistered(str(exc)) from None
    payload = effect.payload or {}
    result = func(
        *list(payload.get("args") or ()),
        idempotency_key=effect.key,
        **dict(payload.get("kwargs") or {}),
    )
    return "" if result is None else redact(str(result))[:MAX_ERROR]


class _Corrupt(Exception):
    """A row whose stored shape no declaration writes (edited by hand, or by a bug): dead
    at once, its error saying what is wrong (``corrupt effect row: ...``)."""

    retryable = False

    def __init__(self, what: str) -> None:
        super().__init__(f"corrupt effect row: {what}")


def _type(value: Any) -> str:
    return type(value).__name__


#: The payload's parts each kind reads, and the JSON type they must have (None allowed).
_SHAPES: dict[str, dict[str, tuple[type, ...]]] = {
    "task": {"args": (list,), "kwargs": (dict,), "options": (dict,)},
    "http": {"method": (str,), "headers": (dict,), "timeout": (int, float)},
    "email": {"subject": (str,), "body": (str,), "to": (list,), "headers": (dict,)},
    "call": {"args": (list,), "kwargs": (dict,)},
}


def _check_row(effect: Any) -> None:
    """Raise :class:`_Corrupt` unless the row has the shape its kind's sender reads."""
    kind, target, payload = effect.kind, effect.target, effect.payload
    if kind not in _SHAPES:
        raise _Corrupt(f"unknown kind {kind!r} (one of {', '.join(_SHAPES)})")
    if not isinstance(target, str) or not target.strip():
        raise _Corrupt("target is empty")
    if kind == "http" and "@" in urllib.parse.urlsplit(target).netloc:
        raise _Corrupt("target carries credentials (user:password@host): never sent")
    if payload is None:
        return
    if not isinstance(payload, dict):
        raise _Corrupt(f"payload is a {_type(payload)}, not a dict")
    for name, types in _SHAPES[kind].items():
        value = payload.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            wanted = " or ".join(t.__name__ for t in types)
            raise _Corrupt(f"payload's {name} is a {_type(value)}, not a {wanted}")
    if kind == "call" and not all(isinstance(k, str) for k in payload.get("kwargs") or {}):
        raise _Corrupt("payload's kwargs has a key that is not a string")
    if kind == "email" and not all(isinstance(a, str) for a in payload.get("to") or ()):
        raise _Corrupt("payload's to holds an address that is not a string")
    if kind == "http":
        timeout = payload.get("timeout")
        if timeout is not None and not 0 < timeout < float("inf"):
            raise _Corrupt(f"payload's timeout is {timeout!r}, not a number of seconds > 0")


def _perform(effect: Any, app: Any, http_timeout: float, claim_timeout: float) -> str:
    """Send one effect; its outcome text, or the send's exception (:class:`_Corrupt` for a
    row no declaration writes: dead at once)."""
    _check_row(effect)
    if effect.kind == "task":
        return _send_task(effect, app)
    if effect.kind == "http":
        return _send_http(effect, http_timeout, claim_timeout)
    if effect.kind == "email":
        return _send_email(effect)
    if effect.kind == "call":
        return _send_call(effect)
    raise InvalidEffect(f"unknown effect kind {effect.kind!r}", "kind")


# -- claim, send, mark -----------------------------------------------------------------------


@dataclass
class _Run:
    using: str
    app: Any
    token: str
    http_timeout: float
    claim_timeout: float
    report: RelayReport = field(default_factory=RelayReport)
    claimed_at: float = 0.0  # time.monotonic() of the last batch claim


def _fields(effect: Any, using: str) -> dict[str, Any]:
    return {
        "key": effect.key,
        "kind": effect.kind,
        "target": redact(effect.target),
        "step": effect.step,
        "attempts": effect.attempts,
        "effect_id": effect.pk,
        "using": using,
        "owner": effect.owner or None,
        "fence": effect.fence,
        "task_id": effect.task_id or None,
        "task_name": effect.task_name or None,
    }


def _mark(run: _Run, effect: Any, **values: Any) -> bool:
    """Write ``values`` to the row if this run's claim still holds it."""
    Effect = _model()
    updated = (
        Effect.objects.using(run.using)
        .filter(pk=effect.pk, status="pending", claimed_by=run.token)
        .update(claimed_by="", **values)
    )
    if updated:
        return True
    log_event(
        "effect_mark_lost",
        logging.WARNING,
        key=effect.key,
        effect_id=effect.pk,
        using=run.using,
        status=values.get("status", "pending"),
        reason="the claim was taken over (claim timeout) or an operator changed the row",
    )
    return False


def _send_one(run: _Run, effect: Any) -> None:
    """Send a claimed effect (``attempts`` already counts this attempt) and mark it."""
    try:
        outcome = _perform(effect, run.app, run.http_timeout, run.claim_timeout)
    except Exception as exc:  # noqa: BLE001 - every send error is judged, none escapes
        _failed(run, effect, exc)
        return
    now = timezone.now()
    if _mark(run, effect, status="dispatched", outcome=outcome, dispatched_at=now, last_error=""):
        run.report.dispatched += 1
        emit(
            signals.effect_dispatched,
            OUTBOX_SENDER,
            logging.INFO,
            outcome=outcome,
            error=None,
            **_fields(effect, run.using),
        )


def _failed(run: _Run, effect: Any, exc: BaseException) -> None:
    error = _error_text(exc)
    decision = _policy(effect.max_attempts).decide(exc, effect.attempts, 0.0)
    if decision.decision == "retry":
        countdown = min(decision.countdown or 0.0, MAX_RETRY_AFTER)
        due = timezone.now() + dt.timedelta(seconds=countdown)
        if _mark(run, effect, next_attempt_at=due, last_error=error):
            run.report.retried += 1
            emit(
                signals.effect_retry,
                OUTBOX_SENDER,
                logging.WARNING,
                error=error,
                countdown=countdown,
                next_attempt_at=due.isoformat(),
                reason=decision.kind,
                **_fields(effect, run.using),
            )
        return
    reason = "max_attempts" if decision.decision == "give_up" else "permanent"
    if _mark(run, effect, status="dead", last_error=error):
        run.report.dead += 1
        emit(
            signals.effect_dead,
            OUTBOX_SENDER,
            logging.ERROR,
            error=error,
            reason=reason,
            **_fields(effect, run.using),
        )


def _run(using: str, app: Any) -> _Run:
    settings = _settings(app)
    return _Run(
        using=using,
        app=app,
        token=_token(),
        http_timeout=settings.effect_http_timeout,
        claim_timeout=settings.effect_claim_timeout,
    )


def dispatch(using: str, ids: Iterable[int], app: Any = None) -> RelayReport:
    """The on-commit path: claim the fresh rows ``ids`` (``attempts == 0``) and send them.

    One ``UPDATE`` claims every row of ``ids`` still ``pending`` with ``attempts == 0`` and
    no claim (a row the periodic relay already took is left to it); each claimed row is then
    sent, in id order, and marked. Called (through the step store's ``dispatch_effects``)
    from a ``transaction.on_commit`` callback; called inside a transaction on ``using``, it
    defers itself to that transaction's commit and returns an empty report.

    Args:
        using: The database alias the rows were written on.
        ids: The rows' ids (:func:`write`'s).
        app: The Celery app (default: the current app): its settings, and ``send_task``.

    Returns:
        A :class:`RelayReport` (``pending``: of ``ids``, those left pending;
        ``oldest_pending_seconds`` None). Never raises: a database error is logged
        (``event=effect_dispatch_failed``) and leaves the rows to the relay.
    """
    ids = list(ids)
    report = RelayReport()
    if not ids:
        return report
    try:
        if transaction.get_connection(using).in_atomic_block:
            transaction.on_commit(lambda: dispatch(using, ids, app), using=using, robust=True)
            report.pending = len(ids)
            return report
        run = _run(using, app)
        for effect in _claim_batch(run, ids, fresh=True):
            # The batch claim was taken before the first send: renew this row's claim (so
            # it covers this send) and skip it if it timed out meanwhile and a relay took it.
            if _renew(run, effect):
                _send_one(run, effect)
        report = run.report
        report.pending = len(ids) - report.dispatched - report.dead
    except Exception as exc:  # noqa: BLE001 - on commit: never raises, the relay takes over
        log_event(
            "effect_dispatch_failed",
            logging.ERROR,
            exc_info=True,
            using=using,
            effects=len(ids),
            error=_error_text(exc),
        )
        report.pending = len(ids) - report.dispatched - report.dead
    return report


def _renew(run: _Run, effect: Any) -> bool:
    """Extend this run's claim of ``effect`` by ``claim_timeout`` from now; False (nothing
    sent; the WARNING line ``effect_mark_lost`` says so) when the claim is no longer this
    run's."""
    if time.monotonic() - run.claimed_at < run.claim_timeout / 4:
        return True  # claimed moments ago: it holds for three quarters of its timeout more
    Effect = _model()
    renewed = (
        Effect.objects.using(run.using)
        .filter(pk=effect.pk, status="pending", claimed_by=run.token)
        .update(next_attempt_at=timezone.now() + dt.timedelta(seconds=run.claim_timeout))
    )
    if renewed:
        return True
    log_event(
        "effect_mark_lost",
        logging.WARNING,
        key=effect.key,
        effect_id=effect.pk,
        using=run.using,
        status="pending",
        reason="the claim timed out before its turn and a relay took the row over; not sent",
    )
    return False


def _claim_batch(run: _Run, pks: Sequence[int], *, fresh: bool) -> list[Any]:
    """Claim the rows ``pks`` that are still free in one compare-and-swap ``UPDATE`` and
    read them back, in id order (fresh: the committing process's own rows, never attempted
    nor claimed; else: due rows, ``next_attempt_at <= now``, a claim of a dead relay among
    them). A row another relay claimed first has its ``next_attempt_at`` in the future (or
    its ``attempts`` above 0): the statement, re-evaluated on the row's latest version by
    the database, leaves it."""
    Effect = _model()
    now = timezone.now()
    rows = Effect.objects.using(run.using).filter(pk__in=list(pks), status="pending")
    if fresh:
        rows = rows.filter(attempts=0, claimed_by="")
    else:
        rows = rows.filter(next_attempt_at__lte=now)
    run.claimed_at = time.monotonic()
    rows.update(
        attempts=F("attempts") + 1,
        claimed_by=run.token,
        next_attempt_at=now + dt.timedelta(seconds=run.claim_timeout),
    )
    return list(
        Effect.objects.using(run.using)
        .filter(pk__in=list(pks), claimed_by=run.token)
        .order_by("pk")
    )


#: Rows claimed at once by the relay: sent one by one within the claim's timeout.
RELAY_BATCH = 50


def relay(using: str | None = None, limit: int = 500, app: Any = None) -> RelayReport:
    """The periodic path: send the due effects of one database or of all.

    For each database (``using``, or every one where the ``Effect`` table can be, those
    without it skipped with a WARNING line), reads up to ``limit`` due rows (``pending``,
    ``next_attempt_at <= now``: fresh rows after ``steplock_effect_relay_delay``, failed
    ones after their backoff, claims of dead relays after ``steplock_effect_claim_timeout``),
    oldest due first; claims them :data:`RELAY_BATCH` at a time (one compare-and-swap
    ``UPDATE``; a row another relay claimed first is left), sends each outside any
    transaction (in id order within a batch) and marks it. Then counts what is left
    pending. Two relays at once are safe (each row is claimed by one).

    Args:
        using: A database alias; None: every database with the table.
        limit: The most rows claimed per database and run (int >= 1; default 500).
        app: The Celery app (default: the current app): settings, ``send_task``.

    Returns:
        A :class:`RelayReport` summed over the databases.

    Raises:
        OuterTransactionError: Called inside a transaction on a database it visits.
        ValueError: ``limit`` < 1.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be an int >= 1, got {limit!r}")
    Effect = _model()
    aliases, skipped = _usable(databases(using), explicit=using is not None)
    total = RelayReport(skipped=tuple(skipped))
    for alias in aliases:
        _outside_transaction(alias, "relay()")
    for alias in aliases:
        run = _run(alias, app)
        try:
            now = timezone.now()
            due = list(
                Effect.objects.using(alias)
                .filter(status="pending", next_attempt_at__lte=now)
                .order_by("next_attempt_at", "pk")
                .values_list("pk", "attempts")[:limit]
            )
            for start in range(0, len(due), RELAY_BATCH):
                batch = [pk for pk, _attempts in due[start : start + RELAY_BATCH]]
                for effect in _claim_batch(run, batch, fresh=False):
                    if _renew(run, effect):
                        _send_one(run, effect)
        except DatabaseError as exc:
            log_event(
                "effect_relay_failed",
                logging.ERROR,
                exc_info=True,
                using=alias,
                error=_error_text(exc),
            )
            total.skipped += (alias,)
        total.dispatched += run.report.dispatched
        total.retried += run.report.retried
        total.dead += run.report.dead
    count, oldest = _stats(aliases)
    total.pending, total.oldest_pending_seconds = count, oldest
    if total.dispatched or total.retried or total.dead:
        log_event(
            "effect_relay_done",
            logging.INFO,
            dispatched=total.dispatched,
            retried=total.retried,
            dead=total.dead,
            pending=total.pending,
            oldest_pending_seconds=oldest,
        )
    return total


def _stats(aliases: list[str]) -> tuple[int, float | None]:
    from django.db.models import Count, Min

    Effect = _model()
    count, oldest = 0, None
    now = timezone.now()
    for alias in aliases:
        try:
            row = (
                Effect.objects.using(alias)
                .filter(status="pending")
                .aggregate(n=Count("pk"), oldest=Min("created_at"))
            )
        except DatabaseError as exc:
            log_event("effect_relay_failed", logging.ERROR, using=alias, error=_error_text(exc))
            continue
        count += row["n"] or 0
        if row["oldest"] is not None:
            age = max(0.0, (now - row["oldest"]).total_seconds())
            oldest = age if oldest is None else max(oldest, age)
    return count, oldest


def pending_stats(using: str | None = None) -> tuple[int, float | None]:
    """The outbox's depth and age, for metrics and the reaper.

    Args:
        using: A database alias; None: every database with the ``Effect`` table (those
            without it skipped, as :func:`relay` does).

    Returns:
        ``(pending effects, seconds since the oldest of them was written)``; the age is None
        when none is pending.
    """
    aliases, _skipped = _usable(databases(using), explicit=using is not None)
    return _stats(aliases)


# -- operators' actions --------------------------------------------------------------------


@dataclass
class EffectAction(ForcedRelease):
    """The audit record of one operator's :func:`retry_effects` / :func:`discard_effects`
    on one effect: a :class:`~celery_steplock.ops.ForcedRelease` (``name``: the effect's
    target, ``key``: its key, ``owner``, ``fence``, ``task_id``, ``task_name``, ``step``:
    the declaring execution's) plus ``action`` (``"retry"``, ``"discard"``), ``effect_id``,
    ``using`` and ``previous`` (its status before). ``outcome``: ``requested``, then
    ``done``, ``refused`` (a dispatched effect, or one being sent now: ``detail`` says
    which) or ``changed`` (the row changed between the read and the write: nothing done).
    """

    action: str = ""
    effect_id: Any = None
    using: str = ""
    previous: str = ""


_ACTIONS = {
    # action: (LeaseEvent event and log line, the statuses it applies to)
    "retry": ("effect_retried", ("dead", "discarded", "pending")),
    "discard": ("effect_discarded", ("dead", "pending")),
}
_LOGGED = (
    "outcome",
    "action",
    "actor",
    "actor_host",
    "via",
    "key",
    "effect_id",
    "using",
    "previous",
    "audit",
    "detail",
)


def _rows(effects: Any, using: str | None) -> tuple[str, list[Any]]:
    Effect = _model()
    db = getattr(effects, "db", None) if hasattr(effects, "model") else None
    alias = using or db or router.db_for_write(Effect)
    if hasattr(effects, "model"):
        rows = list(effects.using(alias).order_by("pk"))
    else:
        ids = [getattr(e, "pk", e) for e in effects]
        rows = list(Effect.objects.using(alias).filter(pk__in=ids).order_by("pk"))
    return alias, rows


def _act(
    action: str,
    effects: Any,
    actor: str | None,
    actor_host: str | None,
    via: str,
    reason: str,
    using: str | None,
    audit_using: str | None,
    also: Any = None,
    after: Any = None,
) -> list[EffectAction]:
    from .eventlog import LeaseEventAudit

    event, allowed = _ACTIONS[action]
    Effect = _model()
    auditor = LeaseEventAudit(using=audit_using, event=event, also=also, after=after)
    alias, rows = _rows(effects, using)
    records = []
    for effect in rows:
        record = EffectAction(
            name=effect.target,
            key=effect.key,
            owner=effect.owner,
            fence=effect.fence,
            task_id=effect.task_id or None,
            task_name=effect.task_name or None,
            step=effect.step,
            actor=actor,
            actor_host=actor_host,
            via=via,
            reason=(
                f"{action} of effect {effect.pk} ({effect.kind}, {effect.status}, "
                f"{effect.attempts} attempts) by {actor or 'an operator'}"
                + (f": {reason}" if reason else "")
            ),
            action=action,
            effect_id=effect.pk,
            using=alias,
            previous=effect.status,
        )
        now = timezone.now()
        busy = bool(effect.claimed_by) and effect.next_attempt_at > now
        if effect.status not in allowed or busy:
            record.outcome = "refused"
            record.detail = (
                f"being sent now (claimed by {effect.claimed_by})"
                if effect.status in allowed
                else f"status {effect.status}: nothing to {action}"
            )
            _finish(auditor, record, event)  # a refusal found at the read: a row of its own
            records.append(record)
            continue
        _line(record, event)
        try:
            auditor.requested(record)
        except Exception as exc:
            log_event(
                "effect_action_aborted",
                logging.ERROR,
                action=action,
                key=effect.key,
                error=_error_text(exc),
            )
            raise AuditRecordFailed(
                f"effect {effect.key!r}: the audit record of the {action} could not be "
                f"written ({_error_text(exc)}): nothing changed",
                name=effect.target,
                key=effect.key,
                owner=effect.owner,
                current=None,
            ) from exc
        values: dict[str, Any]
        if action == "retry":
            values = {
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": now,
                "claimed_by": "",
            }
        else:
            values = {"status": "discarded", "claimed_by": ""}
        changed = (
            Effect.objects.using(alias)
            .filter(
                pk=effect.pk,
                status=effect.status,
                attempts=effect.attempts,
                claimed_by=effect.claimed_by,
            )
            .update(**values)
        )
        record.outcome = "done" if changed else "changed"
        if not changed:
            record.detail = "the effect changed meanwhile (sent or claimed): nothing done"
        _finish(auditor, record, event)
        records.append(record)
    return records


def _line(record: EffectAction, event: str) -> None:
    """The audit line: WARNING ``event=effect_retried`` / ``effect_discarded``, the fields
    of :data:`_LOGGED` that have a value (the ``LeaseEvent`` row is the durable record)."""
    data = record.fields()
    log_event(
        event, logging.WARNING, **{k: data[k] for k in _LOGGED if data.get(k) not in (None, "")}
    )


def _finish(auditor: Any, record: EffectAction, event: str) -> None:
    """Log the outcome and write it to the audit row (a failure is logged and noted on the
    record: the outcome stands)."""
    _line(record, event)
    try:
        auditor.finished(record)
    except Exception as exc:  # noqa: BLE001 - the outcome stands; its record failed
        record.outcome_recorded = False
        record.outcome_error = _error_text(exc)
        log_event(
            "effect_action_outcome_unrecorded",
            logging.ERROR,
            action=record.action,
            key=record.key,
            outcome=record.outcome,
            audit=record.audit,
            error=record.outcome_error,
        )


def retry_effects(
    effects: Any,
    actor: str | None = None,
    actor_host: str | None = None,
    via: str = "api",
    *,
    reason: str = "",
    using: str | None = None,
    audit_using: str | None = None,
    also: Any = None,
    after: Any = None,
) -> list[EffectAction]:
    """Send effects again: each ``dead``, ``discarded`` or ``pending`` one becomes
    ``pending`` with ``attempts`` 0, due now (the next relay sends it), audited.

    Per effect, as a force release: a WARNING line ``event=effect_retried`` and a
    ``LeaseEvent`` row (event ``effect_retried``, ``actor``, ``actor_host``, ``via``,
    outcome ``requested``) committed before the change, then the change (a compare-and-swap
    on the status, attempts and claim read), then the outcome on that row. A dispatched
    effect, or one a relay is sending now, is refused (outcome ``refused``, a row too).

    Args:
        effects: A queryset of ``Effect``, or ids (or rows).
        actor: Who asks (the Django user name, the OS user).
        actor_host: From where.
        via: Through what: ``"admin"``, ``"cli"``, ``"api"`` (default).
        reason: Why, for the record.
        using: The effects' database (default: the queryset's, else the router's).
        audit_using: The ``LeaseEvent`` rows' database (default: the router's).
        also: Called with the record inside the durable transaction that writes its audit
            row (the admin writes its ``LogEntry`` there), as
            :class:`~celery_steplock.contrib.django.eventlog.LeaseEventAudit`'s ``also``.
        after: Called with the record once its outcome is written (``after`` there).

    Returns:
        One :class:`EffectAction` per effect found, in id order.

    Raises:
        ~celery_steplock.exceptions.AuditRecordFailed: An audit row could not be
            written: that effect (and the ones after it) unchanged.
    """
    return _act("retry", effects, actor, actor_host, via, reason, using, audit_using, also, after)


def discard_effects(
    effects: Any,
    actor: str | None = None,
    actor_host: str | None = None,
    via: str = "api",
    *,
    reason: str = "",
    using: str | None = None,
    audit_using: str | None = None,
    also: Any = None,
    after: Any = None,
) -> list[EffectAction]:
    """Give effects up: each ``dead`` or ``pending`` one becomes ``discarded`` (never
    sent by the relay; :func:`retry_effects` can bring it back), audited as
    :func:`retry_effects` is (event ``effect_discarded``). Arguments, return value and
    errors as :func:`retry_effects`'s."""
    return _act(
        "discard", effects, actor, actor_host, via, reason, using, audit_using, also, after
    )
