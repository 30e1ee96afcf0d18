"""The circuit breakers page: each breaker's state, read live from Redis, and the audited
"force open" / "close" override."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _

from ....exceptions import LockStoreMisconfigured, LockStoreUnavailable, StepLockError
from ....keys import breaker_key, breaker_name_from_key, glob_escape
from ....ops import AuditRecordFailed, override_breaker
from ....patterns._base import translated
from ....patterns.breaker import CircuitBreaker
from ....redact import printable
from ..eventlog import LeaseEventBreakerAudit
from ..leases import celery_app, lease_lock, steplock_task_names
from ..models import CircuitBreakerState
from ._common import LiveModelAdmin, _error_text

__all__ = ["CircuitBreakerAdmin", "BreakerOverrideForm", "breaker_names"]


#: Breaker names the page reads at most (the tasks' breakers first, then SCAN's finds).
MAX_BREAKERS = 500


def _task_breakers(app) -> dict[str, Any]:
    """``{name: CircuitBreaker}`` of the app's StepLockedTasks' ``circuit_breaker`` options."""
    found: dict[str, Any] = {}
    for task_name in steplock_task_names(app):
        value = getattr(app.tasks[task_name], "circuit_breaker", None)
        if isinstance(value, CircuitBreaker):
            found.setdefault(value.name, value.bind(app))
        elif isinstance(value, str) and value:
            found.setdefault(value, None)
    return found


def breaker_names(
    app, limit: int = MAX_BREAKERS, *, malformed: dict[str, str] | None = None
) -> dict[str, Any]:
    """The breakers to show: those the app's tasks name, then those Redis holds (SCAN of
    ``<prefix>:breaker:{*}``, never KEYS), at most ``limit``.

    Args:
        app: The Celery app.
        limit: Breakers at most (the malformed keys count too).
        malformed: When given, each key that names no possible breaker (its name was not
            UTF-8, or holds a brace or a control character) is put there, its name escaped
            (:func:`~celery_steplock.redact.printable`) -> what is wrong; otherwise it is
            left out.

    Returns:
        ``{name: CircuitBreaker}``.

    Raises:
        LockStoreUnavailable: Redis could not be reached.
        LockStoreMisconfigured: Redis refused our credentials or the SCAN.
    """
    found = _task_breakers(app)
    store = lease_lock(app)
    with translated("circuit breaker scan", key=breaker_key(store.prefix, "*")):
        for key in store.client.scan_iter(
            match=breaker_key(glob_escape(store.prefix), "*"), count=1000
        ):
            if len(found) >= limit:
                break
            # A client that does not decode gives bytes; a name that was not UTF-8 then
            # reads with U+FFFD, as the library's own clients decode it.
            key = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
            name = breaker_name_from_key(store.prefix, key)
            if name is not None:
                found.setdefault(name, None)
    shown: dict[str, Any] = {}
    for name, breaker in sorted(found.items())[:limit]:
        problem = None
        if breaker is not None:
            shown[name] = breaker
        elif "\ufffd" in name:
            problem = "key: not UTF-8 (cannot be read back)"
        else:
            try:
                shown[name] = CircuitBreaker(name, app=app)
            except StepLockError as exc:
                problem = f"name: {exc}"
        if problem is not None and malformed is not None:
            malformed[printable(name)] = printable(problem)
    return shown


def _row(name: str, breaker: CircuitBreaker) -> dict[str, Any]:
    """One row of the page: the breaker's state (``malformed`` says what is wrong with its
    keys, see :meth:`CircuitBreaker.state`); when Redis refuses this breaker's read alone,
    a row with its ``key`` and the error as ``malformed``."""
    try:
        return breaker.state().as_dict() | {"limits": breaker.describe()}
    except (LockStoreUnavailable, LockStoreMisconfigured):
        raise
    except StepLockError as exc:  # Redis refused this breaker's read alone
        return {"name": name, "key": breaker.key, "malformed": _error_text(exc)}


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
        if not self.has_view_permission(request):
            raise PermissionDenied
        rows, error = [], None
        try:
            app = celery_app()
            unnamed: dict[str, str] = {}
            for name, breaker in breaker_names(app, malformed=unnamed).items():
                rows.append(_row(name, breaker))
            prefix = lease_lock(app).prefix
            rows.extend(
                {"name": name, "key": printable(breaker_key(prefix, name)), "malformed": why}
                for name, why in unnamed.items()
            )
            rows.sort(key=lambda row: row["name"])
        except StepLockError as exc:
            error = _error_text(exc)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Circuit breakers"),
            "rows": rows,
            "error": error,
            "can_override": self.has_override_permission(request),
            "override_url": self.page_reverse("override"),
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.change_list_template, context)

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
