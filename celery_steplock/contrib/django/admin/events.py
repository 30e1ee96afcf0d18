"""The lease event log page: the durable ``LeaseEvent`` rows, read-only."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html

from ..models import LeaseEvent
from ._common import ReadOnlyModelAdmin
from .history import history_url

__all__ = ["LeaseEventAdmin"]


@admin.register(LeaseEvent)
class LeaseEventAdmin(ReadOnlyModelAdmin):
    """The durable lease event log, read-only (rows are pruned by ``prune_lease_events``)."""

    list_display = (
        "created_at",
        "event",
        "name",
        "fence",
        "task_name",
        "task_id",
        "step",
        "hostname",
        "pid",
        "short_owner",
        "actor",
        "outcome",
        "reason",
        "history",
    )
    list_filter = ("event", "outcome", "task_name")
    search_fields = ("name", "task_id", "task_name", "step", "owner", "actor")
    date_hierarchy = "created_at"

    @admin.display(description="owner", ordering="owner")
    def short_owner(self, obj: LeaseEvent) -> str:
        return obj.owner[:12]

    @admin.display(description="history")
    def history(self, obj: LeaseEvent) -> str:
        """A link to the timeline of the row's lock name (admin/history.py); the page
        itself checks ``view_lease``."""
        url = history_url(self.admin_site.name, obj.name) if obj.name else None
        return format_html('<a href="{}">history</a>', url) if url else "–"

    def has_delete_permission(self, request, obj=None):
        return False
