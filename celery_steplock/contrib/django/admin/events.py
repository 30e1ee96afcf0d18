"""The lease event log page: the durable ``LeaseEvent`` rows, read-only."""

from __future__ import annotations

from django.contrib import admin

from ..models import LeaseEvent
from ._common import ReadOnlyModelAdmin

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
    )
    list_filter = ("event", "outcome", "task_name")
    search_fields = ("name", "task_id", "task_name", "step", "owner", "actor")
    date_hierarchy = "created_at"

    @admin.display(description="owner", ordering="owner")
    def short_owner(self, obj: LeaseEvent) -> str:
        return obj.owner[:12]

    def has_delete_permission(self, request, obj=None):
        return False
