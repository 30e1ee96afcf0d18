"""The rate limits page: each cluster-wide rate limit's use now, read live from Redis
(:func:`celery_steplock.live.rate_limit_rows`). Read-only: it needs
``celery_steplock.view_ratelimitstate`` and has no operator action."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.utils.translation import gettext as _

from .... import live
from ..models import RateLimitState
from ._common import LiveModelAdmin

__all__ = ["RateLimitAdmin"]


@admin.register(RateLimitState)
class RateLimitAdmin(LiveModelAdmin):
    """Rate limits (``cluster_rate_limit``, :class:`~celery_steplock.patterns.ratelimit.TokenBucket`,
    :class:`~celery_steplock.patterns.ratelimit.SlidingWindow`), read live from Redis: the
    tasks' limits first, then those a bounded SCAN finds; per limit its use against the
    limit (a bucket's tokens left, a window's grants in the last window) and the tickets
    waiting in its queue. A key that names no limit, or holds what no limiter writes, is a
    row marked malformed."""

    change_list_template = "admin/celery_steplock/ratelimitstate/change_list.html"

    def get_urls(self):
        return [self.page_url("", self.changelist_view, "changelist")]

    def changelist_view(self, request: HttpRequest, extra_context=None) -> HttpResponse:
        listing, error = self.read_live(
            request, lambda app, tasks: live.rate_limit_rows(app, tasks=tasks)
        )
        context = {
            "rows": listing.rows if listing is not None else [],
            "listing": listing,
            "max_limits": live.MAX_LIMITS,
            "error": error,
        }
        return self.live_response(request, _("Rate limits"), context, extra_context)
