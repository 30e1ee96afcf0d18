"""The idempotency records page: rows of the database store, read-only, with an "Invalidate"
action that drops a record and its Redis copy. Above the list, a summary: the database
rows counted by status (live and expired) with the oldest in progress, and the records Redis
holds (the Redis store's, or the database store's cached copies) counted the same way by a
bounded read (:func:`celery_steplock.live.idempotency_summary`). A recorded result (an HTTP response's body
and headers) is shown only to users with ``celery_steplock.change_idempotencyrecord``; the
view permission alone shows its size."""

from __future__ import annotations

import base64
import binascii
import json
import logging

from django.contrib import admin, messages
from django.db import DatabaseError
from django.db.models import Count, F
from django.db.models import Q as models_q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from .... import live
from ....events import log_event
from ....exceptions import StepLockError
from ....lock import get_lease_store
from ....patterns.idempotency import RedisRecords
from ..idempotency import DatabaseRecords
from ..leases import celery_app
from ..models import IdempotencyRecord
from ._common import ReadOnlyModelAdmin, _error_text

__all__ = ["IdempotencyRecordAdmin"]


def _idempotency_store():
    """The database store of the project's app, with its Redis cache (the lease store's
    client and prefix), so an invalidation drops both copies."""
    lease_store = get_lease_store(celery_app())
    return DatabaseRecords(cache=RedisRecords(lease_store.client, lease_store.prefix))


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyModelAdmin):
    """Idempotency records of the database store: read-only, filtered by status and
    namespace; the "Invalidate" action (permission ``delete``) deletes rows and their Redis
    copies so the next call runs again. The recorded result (for a view: the response's
    status, headers and body) is shown to users with the ``change`` permission; with
    ``view`` alone, its size."""

    # Fits beside the filter at 1400 px with the sidebar open (the browser test measures it);
    # the version, attempts, completion and expiry times and the whole error are on each record's
    # page.
    list_display = (
        "created_at",
        "namespace",
        "status",
        "short_key",
        "short_error",
    )
    list_filter = ("status", "namespace")
    search_fields = ("key", "namespace")
    date_hierarchy = "created_at"
    actions = ("invalidate",)
    change_list_template = "admin/celery_steplock/idempotencyrecord/change_list.html"

    def changelist_view(self, request, extra_context=None):
        """Django's list, with :meth:`summary` above it (on GET; an action's POST reads
        nothing more)."""
        if request.method in ("GET", "HEAD") and self.has_view_permission(request):
            extra_context = {**(extra_context or {}), "summary": self.summary()}
        return super().changelist_view(request, extra_context)

    def summary(self) -> dict:
        """What the page shows above the list: ``database`` (``counts``: ``{status: (live,
        expired)}``; ``oldest``: the oldest live locked row, or None; ``error``) and
        ``redis`` (:func:`celery_steplock.live.idempotency_summary`'s ``extra`` with
        ``complete``, or ``error``: the Redis error, its secrets masked). One grouped query
        and one bounded read; neither failing fails the page."""
        now = timezone.now()
        database: dict = {"counts": {}, "oldest": None, "error": None}
        try:
            rows = IdempotencyRecord.objects.values("status").annotate(
                live=Count("id", filter=models_q(expires_at__gt=now)), total=Count("id")
            )
            database["counts"] = {
                row["status"]: (row["live"], row["total"] - row["live"])
                for row in rows.order_by("status")
            }
            oldest = (
                IdempotencyRecord.objects.filter(status="locked", expires_at__gt=now)
                .order_by(F("locked_at").asc(nulls_last=True), "created_at")
                .first()
            )
            if oldest is not None:
                since = oldest.locked_at or oldest.created_at
                database["oldest"] = {
                    "record": oldest,
                    "age": max(0.0, (now - since).total_seconds()),
                }
        except DatabaseError as exc:
            database["error"] = _error_text(exc)
        redis: dict = {"error": None}
        try:
            lease_store = get_lease_store(celery_app())
            listing = live.idempotency_summary(lease_store.client, lease_store.prefix)
            redis.update(listing.extra, complete=listing.complete, max=live.MAX_RECORDS)
        except StepLockError as exc:
            redis["error"] = _error_text(exc)
        return {"database": database, "redis": redis}

    def shows_results(self, request) -> bool:
        """Whether ``request``'s user may read recorded results (bodies, headers): the
        change permission of the model (the page itself never changes a row)."""
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.change_{opts.model_name}")

    def get_readonly_fields(self, request, obj=None):
        names = list(super().get_readonly_fields(request, obj))
        if self.shows_results(request):
            return names
        return ["result_size" if name == "result" else name for name in names]

    def get_fields(self, request, obj=None):
        # Only the read-only fields, so no form field ever carries ``result``.
        return self.get_readonly_fields(request, obj)

    @admin.display(description="result")
    def result_size(self, obj: IdempotencyRecord) -> str:
        """The recorded result's size only (what the view permission may see)."""
        if not obj.result:
            return "–"
        hidden = _("hidden: reading it needs the change permission")
        try:
            snapshot = json.loads(obj.result)
            body = base64.b64decode(snapshot["body"], validate=True)
            shape = _("HTTP %(status)s, %(headers)d header(s), body %(size)d bytes") % {
                "status": int(snapshot["status"]),
                "headers": len(snapshot["headers"]),
                "size": len(body),
            }
        except (ValueError, TypeError, KeyError, binascii.Error):
            shape = _("%d characters") % len(obj.result)
        return f"{shape} ({hidden})"

    @admin.display(description="record key", ordering="key")
    def short_key(self, obj: IdempotencyRecord) -> str:
        return obj.key[:16]

    @admin.display(description="error", ordering="error")
    def short_error(self, obj: IdempotencyRecord) -> str:
        """The error's first 32 characters (the record's page has it whole)."""
        error = obj.error or ""
        return error if len(error) <= 32 else error[:31] + "…"

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # it would leave the Redis copies
        return actions

    @admin.action(
        description=gettext_lazy("Invalidate the selected records (the next call runs again)"),
        permissions=["delete"],
    )
    def invalidate(self, request, queryset):
        store = _idempotency_store()
        done = failed = 0
        for key in list(queryset.values_list("key", flat=True)):
            try:
                store.invalidate(key)
                done += 1
            except StepLockError as exc:
                failed += 1
                log_event("admin_lock_store_error", logging.ERROR, key=key, error=exc)
        if done:
            self.message_user(request, _("%d record(s) invalidated.") % done, messages.SUCCESS)
        if failed:
            self.message_user(
                request,
                _("%d record(s) could not be invalidated (Redis did not answer); try again.")
                % failed,
                messages.ERROR,
            )

    def delete_model(self, request, obj):
        _idempotency_store().invalidate(obj.key)
