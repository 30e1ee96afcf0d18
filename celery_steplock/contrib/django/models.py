"""Models of ``celery_steplock.contrib.django``.

``Lease``
    An *unmanaged* model with no table (django-rq's pattern for its queues): it gives the
    admin its "Held leases" menu entry and the permissions ``celery_steplock.view_lease``
    (see the page) and ``celery_steplock.force_release_lease`` (free a held lease). Instances
    are never saved; :meth:`Lease.from_redis` builds one from a lease hash read from Redis so
    that the admin templates and the admin ``LogEntry`` of a force release have an object.

``IdempotencyRecord``
    One idempotency record of the database store (``steplock_idempotency_store =
    "database"``; :mod:`celery_steplock.contrib.django.idempotency`): the truth, with Redis
    as a cache of its completed rows.

``Effect``
    One side effect declared by a step's body (or a guarded step) in the transaction of its
    fenced compare-and-swap: the effects outbox (:mod:`celery_steplock.effects`,
    :mod:`celery_steplock.contrib.django.outbox`). The row exists if and only if the
    transition committed; the relay dispatches it after COMMIT with its deterministic key.

``CircuitBreakerState``, ``RateLimitState``, ``ConcurrencyLimitState``
    Unmanaged models with no table, as ``Lease``: the admin pages that read the circuit
    breakers, the rate limits and the concurrency limits live from Redis, and their
    permissions.

``Activity``
    Unmanaged, no table: the admin's "Activity" page (per-minute charts drawn from
    :mod:`celery_steplock.activity`) and its permission.

``LeaseEvent``
    One row per lease or transition event, written only when the setting
    ``steplock_event_log`` (Django: ``CELERY_STEPLOCK_EVENT_LOG = True``) is on; see
    :mod:`celery_steplock.contrib.django.eventlog`. The audit record of every force release
    (``event="force_release"``) is written whatever that setting says. Rows older than
    ``steplock_event_retention`` seconds are deleted by ``manage.py prune_lease_events``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Mapping

from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from ...keys import MAX_NAME_LENGTH
from ...redact import redact

__all__ = [
    "Lease",
    "LeaseEvent",
    "IdempotencyRecord",
    "CircuitBreakerState",
    "RateLimitState",
    "ConcurrencyLimitState",
    "Activity",
    "Effect",
]


def _ms_to_datetime(value: Any) -> dt.datetime | None:
    """Redis server milliseconds since the epoch (str or int) -> aware UTC datetime."""
    try:
        return dt.datetime.fromtimestamp(int(value) / 1000.0, tz=dt.timezone.utc)
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _split_step(step: str) -> tuple[str, str, str] | None:
    """``"workflows.step:42"`` -> ``("workflows", "step", "42")``; None when malformed."""
    label, sep, pk = (step or "").partition(":")
    app_label, dot, model_name = label.partition(".")
    if not (sep and dot and app_label and model_name and pk):
        return None
    return app_label, model_name, pk


class Lease(models.Model):
    """A lease held in Redis right now (never stored in the database: no table).

    Fields mirror the lease hash of :mod:`celery_steplock.lock`; times are aware UTC
    datetimes converted from the Redis server's milliseconds. :meth:`from_redis` also sets
    ``ttl_left`` (seconds or None), ``age`` (seconds since acquisition, or None) and
    ``malformed`` (what is wrong with the stored hash, ``""`` when nothing).
    """

    name = models.CharField(_("lock name"), max_length=MAX_NAME_LENGTH, primary_key=True)
    key = models.CharField(_("Redis key"), max_length=MAX_NAME_LENGTH + 64, blank=True)
    owner = models.CharField(_("owner token"), max_length=64, blank=True)
    fence = models.BigIntegerField(_("fencing token"), null=True, blank=True)
    task_id = models.CharField(_("task id"), max_length=255, blank=True)
    task_name = models.CharField(_("task name"), max_length=255, blank=True)
    worker = models.CharField(_("worker"), max_length=255, blank=True)
    hostname = models.CharField(_("host"), max_length=255, blank=True)
    pid = models.IntegerField(_("pid"), null=True, blank=True)
    retries = models.IntegerField(_("retries"), null=True, blank=True)
    step = models.CharField(_("step"), max_length=255, blank=True)
    acquired_at = models.DateTimeField(_("acquired at"), null=True, blank=True)
    renewed_at = models.DateTimeField(_("last renewal"), null=True, blank=True)
    lease_ttl = models.FloatField(_("lease TTL (s)"), null=True, blank=True)

    # Set by from_redis (not columns): what the admin shows beside the hash's fields.
    malformed: str
    ttl_left: float | None
    age: float | None
    since_renewal: float | None

    class Meta:
        managed = False
        # Only "view": there is nothing to add or change, and deleting is the separate,
        # owner-checked force release below (no bulk delete).
        default_permissions = ("view",)
        permissions = [("force_release_lease", "Can force-release a held lease")]
        verbose_name = _("held lease")
        verbose_name_plural = _("held leases")

    def __str__(self) -> str:
        return self.name

    @classmethod
    def from_redis(cls, info: Mapping[str, Any], now_ms: int | None = None) -> Lease:
        """An unsaved Lease from a dict of :meth:`RedisLeaseStore.inspect`/``scan``.

        ``now_ms`` is the Redis server time in milliseconds used to compute ``age``
        (seconds); None leaves ``age`` None. ``ttl_left`` is the key's remaining TTL in
        seconds (None when Redis reported none).
        """
        ttl_ms = _int_or_none(info.get("ttl_ms"))
        lease = cls(
            name=info.get("name") or "",
            key=info.get("key") or "",
            owner=info.get("owner") or "",
            fence=_int_or_none(info.get("fence")),
            task_id=info.get("task_id") or "",
            task_name=info.get("task_name") or "",
            worker=info.get("worker") or "",
            hostname=info.get("hostname") or "",
            pid=_int_or_none(info.get("pid")),
            retries=_int_or_none(info.get("retries")),
            step=info.get("step") or "",
            acquired_at=_ms_to_datetime(info.get("acquired_ms")),
            renewed_at=_ms_to_datetime(info.get("renewed_ms")),
            lease_ttl=ttl_ms / 1000.0 if ttl_ms is not None else None,
        )
        # What parse_lease found wrong with the stored hash ("" when nothing): shown, so
        # that one corrupt lease is visible on the page rather than breaking it.
        lease.malformed = str(info.get("malformed") or "")
        lease.ttl_left = info.get("ttl")
        acquired_ms = _int_or_none(info.get("acquired_ms"))
        renewed_ms = _int_or_none(info.get("renewed_ms"))
        lease.age = (
            max(0, now_ms - acquired_ms) / 1000.0
            if now_ms is not None and acquired_ms is not None
            else None
        )
        lease.since_renewal = (
            max(0, now_ms - renewed_ms) / 1000.0
            if now_ms is not None and renewed_ms is not None
            else None
        )
        return lease

    @property
    def step_parts(self) -> tuple[str, str, str] | None:
        """``(app_label, model_name, pk)`` of ``step`` (``"app_label.model:pk"``), or None."""
        return _split_step(self.step)


class LeaseEvent(models.Model):
    """A durable record of one lease or transition event (the optional event log).

    ``event`` is the signal name (``lock_acquired``, ...); ``created_at`` is when the event
    happened (the signal's wall-clock ``timestamp``), not when the row was written (rows are
    written after the surrounding transaction ends).

    ``event="force_release"`` rows are the audit records of operators' force releases
    (:class:`~celery_steplock.contrib.django.eventlog.LeaseEventAudit`), written and
    committed before the delete: ``actor`` (the Django user name, or the OS user of
    ``celery steplock release``), ``actor_host`` (the admin client's address, the CLI's
    host), ``via`` (``admin``/``cli``/``api``), ``outcome`` (``requested`` until the delete
    answered, then one of :data:`celery_steplock.ops.OUTCOMES`). ``hostname``/``pid`` are
    the lease holder's.
    """

    EVENTS = (
        "lock_acquired",
        "lock_contended",
        "lock_released",
        "lock_expired",
        "lock_lost",
        "transition_applied",
        "transition_conflict",
        "force_release",
        "effect_retried",
        "effect_discarded",
    )

    event = models.CharField(_("event"), max_length=32, choices=[(e, e) for e in EVENTS])
    key = models.CharField(_("Redis key"), max_length=MAX_NAME_LENGTH + 64, blank=True)
    name = models.CharField(_("lock name"), max_length=MAX_NAME_LENGTH, blank=True)
    owner = models.CharField(_("owner token"), max_length=64, blank=True)
    fence = models.BigIntegerField(_("fencing token"), null=True, blank=True)
    task_id = models.CharField(_("task id"), max_length=255, blank=True)
    task_name = models.CharField(_("task name"), max_length=255, blank=True)
    step = models.CharField(_("step"), max_length=255, blank=True)
    hostname = models.CharField(_("host"), max_length=255, blank=True)
    pid = models.IntegerField(_("pid"), null=True, blank=True)
    reason = models.TextField(_("reason"), blank=True)
    created_at = models.DateTimeField(_("time"), default=timezone.now, db_index=True)
    # An operator's force release (event "force_release", written whatever
    # steplock_event_log says): who asked, from where, through what, and what came of it.
    actor = models.CharField(_("operator"), max_length=255, blank=True)
    actor_host = models.CharField(_("operator host"), max_length=255, blank=True)
    via = models.CharField(_("via"), max_length=16, blank=True)
    outcome = models.CharField(_("outcome"), max_length=32, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name = _("lease event")
        verbose_name_plural = _("lease events")

    def __str__(self) -> str:
        return f"{self.event} {self.name} (fence {self.fence})"


class IdempotencyRecord(models.Model):
    """One idempotency record (:mod:`celery_steplock.patterns.idempotency`) of the database store.

    ``key`` the record key (64 hex digits, the HMAC of namespace, resource key and version);
    ``status`` locked / completed / failed; ``fingerprint`` the HMAC of the call's arguments
    (never the arguments); ``owner`` the token of the execution holding a locked record;
    ``result`` the serialized result of a completed one (as the serializer returned it:
    ``serializer``, ``content_type``, ``content_encoding``; ``result_b64`` when ``result`` is
    the base64 of a binary payload); ``error`` the error type of a failed one. A row past
    ``expires_at`` counts as absent (``manage.py`` users may delete such rows at will).
    """

    STATUSES = ("locked", "completed", "failed")

    key = models.CharField(_("record key"), max_length=64, unique=True)
    namespace = models.CharField(_("namespace"), max_length=512, db_index=True)
    version = models.CharField(_("version"), max_length=64)
    status = models.CharField(
        _("status"), max_length=16, choices=[(s, s) for s in STATUSES], db_index=True
    )
    fingerprint = models.CharField(_("arguments' fingerprint"), max_length=64)
    owner = models.CharField(_("owner token"), max_length=64, blank=True)
    serializer = models.CharField(_("serializer"), max_length=64, blank=True)
    content_type = models.CharField(_("content type"), max_length=128, blank=True)
    content_encoding = models.CharField(_("content encoding"), max_length=64, blank=True)
    result = models.TextField(_("result"), blank=True)
    result_b64 = models.BooleanField(_("result is base64"), default=False)
    error = models.CharField(_("error"), max_length=255, blank=True)
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    locked_at = models.DateTimeField(_("locked"), null=True, blank=True)
    completed_at = models.DateTimeField(_("completed"), null=True, blank=True)
    failed_at = models.DateTimeField(_("failed"), null=True, blank=True)
    expires_at = models.DateTimeField(_("expires"), db_index=True)

    class Meta:
        ordering = ("-created_at", "-id")
        verbose_name = _("idempotency record")
        verbose_name_plural = _("idempotency records")

    def __str__(self) -> str:
        return f"{self.namespace} {self.key[:12]} ({self.status})"


class CircuitBreakerState(models.Model):
    """A circuit breaker as Redis holds it now (never stored in the database: no table).

    Unmanaged, like :class:`Lease`: it gives the admin its "Circuit breakers" page and the
    permissions ``celery_steplock.view_circuitbreakerstate`` (see the page) and
    ``celery_steplock.override_circuitbreakerstate`` (force a breaker open, or close it),
    both audited through :func:`celery_steplock.ops.override_breaker`.
    """

    name = models.CharField(_("dependency"), max_length=255, primary_key=True)

    class Meta:
        managed = False
        default_permissions = ("view",)
        permissions = [
            ("override_circuitbreakerstate", "Can force a circuit breaker open or close it")
        ]
        verbose_name = _("circuit breaker")
        verbose_name_plural = _("circuit breakers")

    def __str__(self) -> str:
        return self.name


class RateLimitState(models.Model):
    """A rate limit as Redis holds it now (never stored in the database: no table).

    Unmanaged, like :class:`CircuitBreakerState`: it gives the admin its "Rate limits" page
    (:func:`celery_steplock.live.rate_limit_rows`) and its one permission,
    ``celery_steplock.view_ratelimitstate``. The page has no operator action.
    """

    key = models.CharField(_("Redis key"), max_length=MAX_NAME_LENGTH + 128, primary_key=True)

    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = _("rate limit")
        verbose_name_plural = _("rate limits")

    def __str__(self) -> str:
        return self.key


class ConcurrencyLimitState(models.Model):
    """A concurrency limit as Redis holds it now (never stored in the database: no table).

    Unmanaged: it gives the admin its "Concurrency limits" page
    (:func:`celery_steplock.live.concurrency_rows`) and its one permission,
    ``celery_steplock.view_concurrencylimitstate``. A slot is a lease: freeing one is the
    audited force release of the "Held leases" page.
    """

    key = models.CharField(_("limit key"), max_length=MAX_NAME_LENGTH, primary_key=True)

    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = _("concurrency limit")
        verbose_name_plural = _("concurrency limits")

    def __str__(self) -> str:
        return self.key


class Activity(models.Model):
    """The last hour of activity per minute (never stored in the database: no table).

    Unmanaged: it gives the admin its "Activity" page, the charts of what every process's
    aggregator wrote (:func:`celery_steplock.activity.read`), and its one permission,
    ``celery_steplock.view_activity``. The page has no operator action.
    """

    key = models.CharField(_("subject"), max_length=MAX_NAME_LENGTH, primary_key=True)

    class Meta:
        managed = False
        default_permissions = ("view",)
        verbose_name = _("activity")
        verbose_name_plural = _("activity")

    def __str__(self) -> str:
        return self.key


class Effect(models.Model):
    """One declared side effect of a committed step transition (the effects outbox).

    Written in the step's database, in the transaction of the fenced compare-and-swap that
    declared it, so it exists if and only if that transition committed (a refused CAS, a lost
    lease, a duplicate delivery or a rollback leaves none). The relay
    (:mod:`celery_steplock.contrib.django.outbox`) dispatches it after COMMIT.

    ``key`` the deterministic key given to the receiver (step, fencing token, position:
    ``<step>:<fence>:<to>:<position>``, ``to`` the status
    the transition wrote); ``kind`` ``task`` / ``http`` / ``email`` / ``call``;
    ``target`` the task name, URL, recipients or registered callable name; ``payload`` the
    JSON of its arguments; ``status`` ``pending`` (waiting for dispatch, or for its next
    attempt at ``next_attempt_at``), ``dispatched`` (the receiver accepted it; ``outcome``
    says what it answered), ``dead`` (retries exhausted or a permanent refusal; an operator
    may retry or discard it) or ``discarded`` (an operator's decision, audited);
    ``attempts`` dispatch attempts made; ``claimed_by`` the relay holding the attempt now.
    """

    KINDS = ("task", "http", "email", "call")
    STATUSES = ("pending", "dispatched", "dead", "discarded")

    key = models.CharField(_("effect key"), max_length=255, unique=True)
    step = models.CharField(_("step"), max_length=255)
    fence = models.BigIntegerField(_("fencing token"), null=True, blank=True)
    position = models.PositiveIntegerField(_("position"))
    kind = models.CharField(_("kind"), max_length=16, choices=[(k, k) for k in KINDS])
    target = models.CharField(_("target"), max_length=1024)
    payload = models.JSONField(_("payload"), default=dict, blank=True)
    status = models.CharField(
        _("status"),
        max_length=16,
        choices=[(s, s) for s in STATUSES],
        default="pending",
    )
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    max_attempts = models.PositiveIntegerField(_("max attempts"), default=10)
    next_attempt_at = models.DateTimeField(_("next attempt"), default=timezone.now)
    claimed_by = models.CharField(_("claimed by"), max_length=64, blank=True)
    task_id = models.CharField(_("declared by task"), max_length=255, blank=True)
    task_name = models.CharField(_("declared by"), max_length=255, blank=True)
    owner = models.CharField(_("owner token"), max_length=64, blank=True)
    outcome = models.TextField(_("outcome"), blank=True)
    last_error = models.TextField(_("last error"), blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    dispatched_at = models.DateTimeField(_("dispatched"), null=True, blank=True)

    class Meta:
        ordering = ("-created_at", "-id")
        indexes = [
            models.Index(fields=["status", "next_attempt_at"], name="steplock_effect_due"),
        ]
        permissions = [("replay_effect", "Can retry or discard an effect of the outbox")]
        verbose_name = _("effect")
        verbose_name_plural = _("effects outbox")

    def __str__(self) -> str:
        return f"{self.kind} {redact(self.target)} ({self.status})"
