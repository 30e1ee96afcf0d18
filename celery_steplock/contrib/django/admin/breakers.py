"""The circuit breakers page: each breaker's state, read live from Redis, and the audited
"force open" / "close" override.

Redis keeps no history of a breaker's transitions: its hash holds the state, the window of
the last calls (the failures in it), the generation (how many state changes), when it last
opened and whether an operator forced it. The page adds, for users who may read the event
log (``celery_steplock.view_leaseevent``), the last operator overrides with their reasons
(the ``circuit_override`` audit rows); automatic trips are the ``circuit_opened`` /
``circuit_closed`` signals (and the Prometheus ``steplock_circuit_transitions_total``)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.utils.translation import gettext as _

from .... import ops
from ....exceptions import StepLockError
from ....ops import AuditRecordFailed, override_breaker
from ....patterns.breaker import CircuitBreaker
from ..eventlog import LeaseEventBreakerAudit
from ..leases import celery_app, steplock_task_names
from ..models import CircuitBreakerState, LeaseEvent
from ._common import LiveModelAdmin, _error_text

__all__ = ["CircuitBreakerAdmin", "BreakerOverrideForm", "breaker_names"]


#: Breaker names the page reads at most (the tasks' breakers first, then SCAN's finds).
MAX_BREAKERS = ops.MAX_BREAKERS

#: Operator overrides shown per breaker at most, and audit rows read at most per page.
OVERRIDES_SHOWN = 3
MAX_OVERRIDE_ROWS = 1000


def last_overrides(names: list[str]) -> dict[str, list[LeaseEvent]]:
    """The last :data:`OVERRIDES_SHOWN` operator overrides of each breaker of ``names``,
    newest first: the ``circuit_override`` audit rows (one query, at most
    :data:`MAX_OVERRIDE_ROWS` rows)."""
    found: dict[str, list[LeaseEvent]] = {}
    if not names:
        return found
    rows = LeaseEvent.objects.filter(event="circuit_override", name__in=names).order_by(
        "-created_at", "-id"
    )[:MAX_OVERRIDE_ROWS]
    for row in rows:
        shown = found.setdefault(row.name, [])
        if len(shown) < OVERRIDES_SHOWN:
            shown.append(row)
    return found


def _task_breakers(app) -> dict[str, Any]:
    """``{name: CircuitBreaker}`` of the app's StepLockedTasks' ``circuit_breaker`` options."""
    return ops.task_breakers(app.tasks[name] for name in steplock_task_names(app))


def breaker_names(
    app, limit: int = MAX_BREAKERS, *, malformed: dict[str, str] | None = None
) -> dict[str, Any]:
    """:func:`celery_steplock.ops.find_breakers` with the tasks of the app's task modules
    (imported first: :func:`~celery_steplock.contrib.django.leases.steplock_task_names`)."""
    tasks = [app.tasks[name] for name in steplock_task_names(app)]
    return ops.find_breakers(app, limit, tasks=tasks, malformed=malformed)


class BreakerOverrideForm(forms.Form):
    name = forms.CharField(max_length=255, widget=forms.HiddenInput)
    action = forms.ChoiceField(
        choices=[("open", "open"), ("close", "close")], widget=forms.HiddenInput
    )
    reason = forms.CharField(max_length=500, required=False)


@admin.register(CircuitBreakerState)
class CircuitBreakerAdmin(LiveModelAdmin):
    """Circuit breakers, read live from Redis (celery_steplock.patterns.breaker): their state, and
    for users with ``celery_steplock.override_circuitbreakerstate`` a button to force one
    open or close it, audited by :func:`celery_steplock.ops.override_breaker` (a
    ``LeaseEvent`` row, event ``circuit_override``, committed before Redis is written)."""

    change_list_template = "admin/celery_steplock/circuitbreakerstate/change_list.html"

    def has_override_permission(self, request: HttpRequest) -> bool:
        return self.has_operator_permission(request, "override")

    def get_urls(self):
        return [
            self.page_url("", self.changelist_view, "changelist"),
            self.page_url("override/", self.override_view, "override", audited=True),
        ]

    def changelist_view(self, request: HttpRequest, extra_context=None) -> HttpResponse:
        rows, error = self.read_live(
            request, lambda app, tasks: ops.breaker_rows(app, tasks=tasks)
        )
        if rows is None:
            rows = []
        shows_overrides = request.user.has_perm(f"{self.opts.app_label}.view_leaseevent")
        if shows_overrides:
            try:
                overrides = last_overrides([row["name"] for row in rows if "state" in row])
            except DatabaseError as exc:
                overrides, error = {}, error or _error_text(exc)
            for row in rows:
                row["overrides"] = overrides.get(row["name"], [])
        context = {
            "shows_overrides": shows_overrides,
            "rows": rows,
            "error": error,
            "can_override": self.has_override_permission(request),
            "override_url": self.page_reverse("override"),
        }
        return self.live_response(request, _("Circuit breakers"), context, extra_context)

    def override_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_override_permission(request):
            raise PermissionDenied
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        back = self.page_reverse("changelist")
        form = BreakerOverrideForm(request.POST)
        if not form.is_valid():
            messages.error(
                request, _("Invalid request: %(errors)s") % {"errors": form.errors.as_text()}
            )
            return HttpResponseRedirect(back)
        name, action = form.cleaned_data["name"], form.cleaned_data["action"]
        user = request.user.get_username()
        try:
            record = override_breaker(
                CircuitBreaker(name, app=celery_app()),
                action,
                actor=user,
                actor_host=request.META.get("REMOTE_ADDR"),
                via="admin",
                reason=form.cleaned_data["reason"] or f"{action} by {user} in the Django admin",
                auditor=LeaseEventBreakerAudit(),
            )
        except AuditRecordFailed as failed:
            messages.error(
                request,
                _("The audit record could not be written: nothing changed (%(error)s)")
                % {"error": failed.__cause__},
            )
            return HttpResponseRedirect(back)
        except StepLockError as exc:
            messages.error(
                request,
                _("The Redis lock store could not be reached (%(error)s)")
                % {"error": _error_text(exc)},
            )
            return HttpResponseRedirect(back)
        messages.success(
            request,
            _("Circuit breaker “%(name)s”: %(previous)s → %(now)s.")
            % {
                "name": name,
                "previous": record.previous,
                "now": _("forced open") if action == "open" else _("closed"),
            },
        )
        return HttpResponseRedirect(back)
