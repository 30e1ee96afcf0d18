"""The rate limits page: each cluster-wide rate limit's use now, read live from Redis
(:func:`celery_steplock.live.rate_limit_rows`). Read-only: it needs
``celery_steplock.view_ratelimitstate`` and has no operator action."""

from __future__ import annotations

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _

from .... import live
from ....exceptions import StepLockError
from ..leases import celery_app, steplock_task_names
from ..models import RateLimitState
from ._common import LiveModelAdmin, _error_text

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
        if not self.has_view_permission(request):
            raise PermissionDenied
        listing, error = None, None
        try:
            app = celery_app()
            tasks = [app.tasks[name] for name in steplock_task_names(app)]
            listing = live.rate_limit_rows(app, tasks=tasks)
        except StepLockError as exc:
            error = _error_text(exc)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Rate limits"),
            "rows": listing.rows if listing is not None else [],
            "listing": listing,
            "max_limits": live.MAX_LIMITS,
            "error": error,
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.change_list_template, context)
