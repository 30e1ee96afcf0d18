"""The concurrency limits page: each limit's slots held (by which task, since when) and its
waiters, read live from Redis (:func:`celery_steplock.live.concurrency_rows`). Read-only: it
needs ``celery_steplock.view_concurrencylimitstate``; a slot is a lease, freed by the
audited force release of the "Held leases" page."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.urls import NoReverseMatch, reverse
from django.utils.translation import gettext as _

from .... import live
from ..models import ConcurrencyLimitState, Lease
from ._common import LiveModelAdmin

__all__ = ["ConcurrencyLimitAdmin"]


def _duration(seconds: float | None) -> str:
    """``12.34`` -> ``"12.3 s"``; ``3725`` -> ``"1h 02m"``; None -> ``"–"``."""
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, _secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {_secs:02d}s"


@admin.register(ConcurrencyLimitState)
class ConcurrencyLimitAdmin(LiveModelAdmin):
    """Concurrency limits (``concurrency_limit``,
    :class:`~celery_steplock.patterns.concurrency.ConcurrencyLimit`), read live from Redis:
    the tasks' limits first, then those whose slots or waiters a bounded SCAN finds; per
    limit the slots held (task, task id, worker, held for, TTL left), the limit, the waiters
    and the oldest wait. A slot or key that holds what the scripts never write is shown
    marked malformed."""

    change_list_template = "admin/celery_steplock/concurrencylimitstate/change_list.html"

    def get_urls(self):
        return [self.page_url("", self.changelist_view, "changelist")]

    def _leases_url(self, request: HttpRequest) -> str | None:
        """The Held leases page, when the user may view it (a slot's force release)."""
        if not self.admin_site.is_registered(Lease):
            return None
        if not request.user.has_perm(f"{Lease._meta.app_label}.view_lease"):
            return None
        try:
            return reverse(
                f"admin:{Lease._meta.app_label}_lease_changelist", current_app=self.admin_site.name
            )
        except NoReverseMatch:
            return None

    def changelist_view(self, request: HttpRequest, extra_context=None) -> HttpResponse:
        listing, error = self.read_live(
            request, lambda app, tasks: live.concurrency_rows(app, tasks=tasks)
        )
        rows = listing.rows if listing is not None else []
        for row in rows:
            row["oldest_wait_text"] = _duration(row["oldest_wait"])
            for slot in row["slots"]:
                for name in ("owner", "task_name", "task_id", "worker", "hostname"):
                    slot.setdefault(name, "")
                slot["age_text"] = _duration(slot.get("age"))
                slot["ttl_text"] = _duration(slot.get("ttl"))
        context = {
            "rows": rows,
            "listing": listing,
            "templated": sorted((listing.extra.get("templated") or {}).items())
            if listing is not None
            else [],
            "max_limits": live.MAX_LIMITS,
            "leases_url": self._leases_url(request),
            "error": error,
        }
        return self.live_response(request, _("Concurrency limits"), context, extra_context)
