"""The "Held leases" page (live from Redis) and the force release of one lease.

The pattern is django-rq's: the unmanaged :class:`~.models.Lease` model gives the admin a
menu entry and permissions, and :meth:`LeaseAdmin.get_urls` replaces the ORM-backed views
with two views wrapped by ``admin_site.admin_view`` (staff login, ``never_cache``, CSRF):

``admin:celery_steplock_lease_changelist``
    Held leases, read with ``SCAN`` (never ``KEYS``) one bounded page at a time: per
    request at most ``scan_key_budget`` lease hashes read, ``max_scan_steps`` SCAN round
    trips and ``list_per_page`` rows, whatever Redis holds (see
    :func:`~celery_steplock.contrib.django.leases.lease_page`); once the budget is spent
    the page ends with what it has and a "next page" link. The SCAN cursor travels in the
    querystring (``?cursor=``). Needs ``celery_steplock.view_lease``.
``admin:celery_steplock_lease_release``
    Force release of one lease: GET shows a confirmation page with the holder, POST (CSRF
    token) deletes the lease only if the owner shown on that page still holds it. Both need
    ``celery_steplock.force_release_lease`` *and* ``celery_steplock.view_lease`` (the page
    shows the holder's owner token, task, host and step). Done by
    :func:`celery_steplock.ops.force_release` (as ``celery steplock release``), audited by
    :class:`~.eventlog.LeaseEventAudit`: a ``LeaseEvent`` row (event ``force_release``, the
    user, the client's address, the lease, its owner and fence) and an admin ``LogEntry``
    (action DELETION) written and *committed* before the delete, then the outcome on that
    row (and a CHANGE ``LogEntry`` when nothing was released), then the ``lock_released``
    signal with ``forced=True``. The view never runs in ``ATOMIC_REQUESTS``' transaction
    (a commit inside it would not be one). There is deliberately no bulk action.
``admin:celery_steplock_lease_timeline``
    The timeline of one lock name (``?name=``), linked from each row: see
    :mod:`~celery_steplock.contrib.django.admin.history`.
``admin:celery_steplock_lease_change``
    No change page: a redirect to Held leases searching for the lease's name (the admin's
    templates link an object there, e.g. the confirmation page's breadcrumbs).

The pages extend Django's own ``admin/change_list.html`` and
``admin/delete_confirmation.html`` (through :class:`LeaseChangeList`, the ``cl`` those
templates read), so they take the markup and styles of the running Django version.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.apps import apps
from django.contrib import admin, messages
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError, router
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
    QueryDict,
)
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils.decorators import method_decorator
from django.utils.html import escape
from django.utils.safestring import mark_safe
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.cache import never_cache

from .... import signals
from ....events import emit
from ....exceptions import StepLockError
from ....keys import MAX_NAME_LENGTH
from ....ops import AuditRecordFailed, ForceReleaseRefused, LeaseHeldByAnother, force_release
from ..eventlog import LeaseEventAudit
from ..leases import (
    celery_app,
    import_task_modules,
    lease_lock,
    lease_page,
    matches,
    redis_time_ms,
    steplock_task_names,
)
from ..models import Lease, LeaseEvent
from ._common import LiveModelAdmin, _error_text, store_read_failed
from .history import HistoryPages

__all__ = ["LeaseAdmin", "ForceReleaseForm", "LeaseChangeList", "TaskNameFilter"]


#: Querystring parameters of the changelist that a force release carries back to it
#: (``scanned``: lease keys examined by the pages before this one, for display only).
LIST_PARAMS = ("q", "task_name", "cursor", "p", "scanned")


class ForceReleaseForm(forms.Form):
    """The POST of the force-release confirmation page: the lease and the owner it showed."""

    name = forms.CharField(max_length=MAX_NAME_LENGTH, strip=False, widget=forms.HiddenInput)
    owner = forms.CharField(max_length=64, strip=False, widget=forms.HiddenInput)
    changelist_filters = forms.CharField(required=False, widget=forms.HiddenInput)


class TaskNameFilter(admin.ListFilter):
    """The "By task name" filter of the Held leases page, rendered by Django's own
    ``admin_list_filter`` tag and ``admin/filter.html``.

    ``choices`` is a list of dicts (``display``: str or safe HTML, ``selected``: bool,
    ``query_string``: ``"?..."``) computed by :meth:`LeaseAdmin.changelist_view`; the
    filtering itself is :func:`~celery_steplock.contrib.django.leases.matches`, applied
    while Redis is scanned.
    """

    title = gettext_lazy("task name")
    parameter_name = "task_name"

    def __init__(self, request, params, model, model_admin, choices: list[dict]):
        super().__init__(request, params, model, model_admin)
        self._choices = choices
        value = params.get(self.parameter_name)
        if value:
            self.used_parameters[self.parameter_name] = value

    def has_output(self) -> bool:
        return True

    def choices(self, changelist) -> list[dict]:  # type: ignore[override]
        return self._choices

    def queryset(self, request, queryset):
        return queryset

    def expected_parameters(self) -> list[str]:  # type: ignore[override]
        return [self.parameter_name]


class LeaseChangeList:
    """The ``cl`` that Django's ``admin/change_list.html`` and its tags (``search_form``,
    ``admin_list_filter``, ``pagination``) read, for a list that is one SCAN page of leases
    rather than a queryset: the page extends Django's own template, so its breadcrumbs,
    filter sidebar, search bar and footer are the markup of the running Django version.

    There is no sorting, no actions, no formset and no numbered pages (the SCAN cursor
    pages; see ``admin/celery_steplock/lease/pagination.html``). ``result_count`` is the
    number of rows on this page.
    """

    formset = None
    date_hierarchy = None
    is_popup = False
    to_field = None
    show_admin_actions = False
    is_facets_optional = False
    add_facets = False
    # Read by the pagination tag: never Django's numbered pages or its "Show all" link.
    multi_page = False
    can_show_all = False
    show_all = False
    search_fields = ("name", "task_name", "task_id", "step")

    def __init__(
        self,
        request: HttpRequest,
        model_admin: LeaseAdmin,
        *,
        q: str,
        task_name: str,
        filter_choices: list[dict],
        rows: list[dict],
        clear_filters_url: str | None,
        **page: Any,
    ):
        self.model = model_admin.model
        self.opts = model_admin.opts
        self.model_admin = model_admin
        self.query = q
        # What the search form carries along as hidden inputs (the filter, not the cursor).
        self.params = {"task_name": task_name} if task_name else {}
        self.search_help_text = _(
            "A step id (digits only: exact), or part of a task name, lock name or step "
            "(app_label.model:pk), or the start of a task id."
        )
        self.filter_specs = [
            TaskNameFilter(request, self.params, self.model, model_admin, filter_choices)
        ]
        self.has_filters = True
        self.has_active_filters = bool(task_name)
        self.clear_all_filters_qs = clear_filters_url or "?"
        self.rows = rows
        self.result_count = self.full_result_count = len(rows)
        self.show_full_result_count = True
        for key, value in page.items():  # page, page_number, next_url, first_url, ...
            setattr(self, key, value)


def _duration(seconds: float | None) -> str:
    """``3725.4`` -> ``"1h 02m 05s"``; ``12.34`` -> ``"12.3 s"``; None -> ``""``."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    total = int(seconds)
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s"


def _breakable(text: str, after: str = "._:@/") -> str:
    """HTML of a name (``"proj.app.tasks.charge"``, ``"celery@host.example"``) that may wrap
    after each of the characters ``after``, so long names do not widen the table."""
    html = str(escape(text))
    for char in after:
        html = html.replace(char, char + "<wbr>")
    return mark_safe(html)


def _holder(lease: Lease) -> str:
    """``"w1@box"``, ``"w1@box (box.example)"`` when the host is not in the worker's name,
    the host alone without a worker name, or ``"–"``."""
    if lease.worker:
        if lease.hostname and lease.hostname not in lease.worker:
            return f"{lease.worker} ({lease.hostname})"
        return lease.worker
    return lease.hostname or "–"


def _list_query(params: QueryDict | dict, **changes: Any) -> str:
    """The changelist querystring (``"?..."``, or ``"?"`` for the defaults): ``params``
    restricted to :data:`LIST_PARAMS`, with ``changes`` applied (None or "" drops one)."""
    query = {k: params.get(k) for k in LIST_PARAMS if params.get(k)}
    for key, value in changes.items():
        if value is None or value == "":
            query.pop(key, None)
        else:
            query[key] = str(value)
    if query.get("cursor") == "0":
        del query["cursor"]
    if query.get("p") == "1":
        del query["p"]
    if query.get("scanned") == "0":
        del query["scanned"]
    return "?" + urlencode(query) if query else "?"


@admin.register(Lease)
class LeaseAdmin(HistoryPages, LiveModelAdmin):
    """Held leases, read live from Redis; see the module docstring."""

    #: Leases shown per page, at most (see
    #: :func:`~celery_steplock.contrib.django.leases.lease_page`).
    list_per_page = 100
    #: Lease hashes one request reads at most, whatever the number of leases and the sizes
    #: of SCAN's steps: a step whose keys do not fit in what is left ends the page before
    #: it, with a "next page" link (a rare filter may show a short or empty page).
    scan_key_budget = 5000
    #: Largest SCAN COUNT of one step while a search or filter is active: when few keys
    #: match, a step asks for up to this many keys (steps are sized so that their matches
    #: fit in the page).
    filtered_scan_count = 500
    #: SCAN round trips per request at most: enough for the budget to be the bound that
    #: ends a rare search (5000 / 500 and the re-reads), and a bound of its own when Redis
    #: holds many keys that are not leases (they cost round trips, not budget).
    max_scan_steps = 20

    change_list_template = "admin/celery_steplock/lease/change_list.html"
    release_confirmation_template = "admin/celery_steplock/lease/release_confirmation.html"

    # -- permissions ----------------------------------------------------------------------

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        """``celery_steplock.force_release_lease`` and the view permission: the confirmation
        page shows the holder (owner token, task, host/pid, step) of any lease named."""
        return self.has_operator_permission(request, "force_release")

    # -- URLs -----------------------------------------------------------------------------

    def get_urls(self):
        return [
            self.page_url("", self.changelist_view, "changelist"),
            # The audit record must commit before the delete: never inside the request's
            # transaction (ATOMIC_REQUESTS) of the audit database.
            self.page_url("release/", self.release_view, "release", audited=True),
            # A lock name's timeline (admin/history.py), linked from each row.
            self.timeline_pattern(),
            # Named like Django's change page, which admin templates link to (the
            # force-release confirmation's breadcrumbs): a lease's row on the list.
            self.page_url("<path:object_id>/change/", self.change_view, "change"),
        ]

    def changelist_url(self, params: QueryDict | dict | None = None) -> str:
        url = self.page_reverse("changelist")
        query = _list_query(params or {})
        return url if query == "?" else url + query

    def release_url(self, name: str, params: QueryDict | dict) -> str:
        url = self.page_reverse("release")
        query = {"name": name}
        filters = _list_query(params)[1:]
        if filters:
            query["_changelist_filters"] = filters
        return f"{url}?{urlencode(query)}"

    # -- links to other admin pages ----------------------------------------------------

    def _model_admin(self, request: HttpRequest, app_label: str, model_name: str):
        """The ModelAdmin of a registered model the user may view, else None."""
        try:
            model = apps.get_model(app_label, model_name)
        except (LookupError, ValueError):
            return None
        if not self.admin_site.is_registered(model):
            return None
        get_model_admin = getattr(self.admin_site, "get_model_admin", None)  # Django 5.0+
        model_admin = (
            get_model_admin(model) if get_model_admin else self.admin_site._registry[model]
        )
        if not model_admin.has_view_or_change_permission(request):
            return None
        return model_admin

    def step_url(self, request: HttpRequest, lease: Lease, cache: dict) -> str | None:
        """The admin change page of the lease's step, when its model is registered."""
        parts = lease.step_parts
        if parts is None:
            return None
        app_label, model_name, pk = parts
        if (app_label, model_name) not in cache:
            cache[app_label, model_name] = self._model_admin(request, app_label, model_name)
        model_admin = cache[app_label, model_name]
        if model_admin is None:
            return None
        opts = model_admin.opts
        try:
            return reverse(
                f"admin:{opts.app_label}_{opts.model_name}_change",
                args=(quote(pk),),
                current_app=self.admin_site.name,
            )
        except NoReverseMatch:
            return None

    def task_result_url(self, request: HttpRequest, task_id: str, cache: dict) -> str | None:
        """django-celery-results' TaskResult admin filtered on ``task_id``, when installed.

        A changelist filter rather than a change page: a running task usually has no
        result row yet, and this needs no database query per lease.
        """
        if not task_id or not apps.is_installed("django_celery_results"):
            return None
        if "taskresult" not in cache:
            cache["taskresult"] = self._model_admin(request, "django_celery_results", "taskresult")
        model_admin = cache["taskresult"]
        if model_admin is None:
            return None
        try:
            url = reverse(
                "admin:django_celery_results_taskresult_changelist",
                current_app=self.admin_site.name,
            )
        except NoReverseMatch:
            return None
        return f"{url}?{urlencode({'task_id': task_id})}"

    # -- views ------------------------------------------------------------------------------

    def _context(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "title": title,
            "has_view_permission": True,
            **extra,
        }

    @method_decorator(never_cache)
    def changelist_view(self, request: HttpRequest, extra_context=None) -> HttpResponse:
        """One page of held leases. Querystring: ``q`` (search), ``task_name`` (filter),
        ``cursor`` (SCAN cursor of the page, default 0), ``p`` (page number) and
        ``scanned`` (lease keys examined by the previous pages), both for display."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        params = request.GET
        q = params.get("q", "").strip()
        task_name = params.get("task_name", "").strip()
        try:
            cursor = max(0, int(params.get("cursor", 0)))
            page_number = max(1, int(params.get("p", 1)))
            scanned_before = max(0, int(params.get("scanned", 0))) if cursor else 0
        except ValueError:
            cursor, page_number, scanned_before = 0, 1, 0
        filtered = bool(q or task_name)

        page = None
        task_names: list[str] = []
        try:
            task_names = steplock_task_names(celery_app())
            page = lease_page(
                lease_lock(),
                cursor,
                self.list_per_page,
                predicate=(lambda info: matches(info, q, task_name)) if filtered else None,
                key_budget=self.scan_key_budget,
                max_count=self.filtered_scan_count,
                max_steps=self.max_scan_steps,
            )
        except StepLockError as exc:
            # Redis down or misconfigured: say so on the page, never a 500.
            store_read_failed(request, exc)

        can_release = self.has_force_release_permission(request)
        rows = []
        if page is not None:
            link_cache: dict = {}
            for info in page.leases:
                lease = Lease.from_redis(info, page.now_ms)
                rows.append(
                    {
                        "lease": lease,
                        "name_html": _breakable(lease.name),
                        "task_html": _breakable(lease.task_name) if lease.task_name else "",
                        "step_html": _breakable(lease.step) if lease.step else "",
                        "holder_html": _breakable(_holder(lease)),
                        "age": _duration(lease.age),
                        "ttl_left": _duration(lease.ttl_left),
                        "since_renewal": _duration(lease.since_renewal),
                        "step_url": self.step_url(request, lease, link_cache),
                        "task_url": self.task_result_url(request, lease.task_id, link_cache),
                        "release_url": (
                            self.release_url(lease.name, params) if can_release else None
                        ),
                        "history_url": self.timeline_link(lease.name),
                    }
                )

        if task_name and task_name not in task_names:
            task_names.append(task_name)  # a filter from a link for a task not loaded here
        restart = {"cursor": None, "p": None, "scanned": None}
        filter_choices = [
            {
                "display": _("All"),
                "selected": not task_name,
                "query_string": _list_query(params, task_name=None, **restart),
            }
        ]
        filter_choices += [
            {
                "display": _breakable(name),
                "selected": name == task_name,
                "query_string": _list_query(params, task_name=name, **restart),
            }
            for name in task_names
        ]
        next_url = first_url = None
        scanned = scanned_before + (page.examined if page is not None else 0)
        if page is not None and not page.complete:
            next_url = _list_query(
                params, cursor=page.next_cursor, p=page_number + 1, scanned=scanned
            )
        if cursor:
            first_url = _list_query(params, **restart)

        # As Django's changelist: "Clear all filters" drops the filter and keeps the search.
        clear_filters_url = _list_query(params, task_name=None, **restart) if task_name else None
        listing: dict[str, Any] = dict(
            rows=rows,
            page=page,
            page_number=page_number,
            filtered=filtered,
            next_url=next_url,
            first_url=first_url,
            can_release=can_release,
            store_error=page is None,
            per_page=self.list_per_page,
            scanned=scanned,
        )
        cl = LeaseChangeList(
            request,
            self,
            q=q,
            task_name=task_name,
            filter_choices=filter_choices,
            clear_filters_url=clear_filters_url,
            **listing,
        )
        context = self._context(
            request,
            _("Held leases"),
            cl=cl,
            q=q,
            task_name=task_name,
            filter_choices=filter_choices,
            clear_filters_url=clear_filters_url,
            has_add_permission=False,
            actions_on_top=False,
            actions_on_bottom=False,
            **listing,
            **(extra_context or {}),
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.change_list_template, context)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context=None
    ) -> HttpResponse:
        """A lease has no change page: redirect to Held leases searching for its name
        (``object_id`` is the lock name, quoted as the admin quotes primary keys)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return HttpResponseRedirect(self.changelist_url({"q": unquote(object_id)}))

    @method_decorator(never_cache)
    def release_view(self, request: HttpRequest) -> HttpResponse:
        """GET ``?name=``: confirmation page showing the holder. POST (name, owner):
        release if that owner still holds the lease, else say who holds it now. Both need
        :meth:`has_force_release_permission` (force release *and* view)."""
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            return self._release_post(request)
        if request.method not in ("GET", "HEAD"):
            return HttpResponseNotAllowed(["GET", "HEAD", "POST"])
        name = request.GET.get("name", "")
        filters = QueryDict(request.GET.get("_changelist_filters", ""))
        back = self.changelist_url(filters)
        if not name:
            messages.error(request, _("No lease named."))
            return HttpResponseRedirect(back)
        try:
            lock = lease_lock()
            info = lock.inspect(name)
            now_ms = redis_time_ms(lock) if info is not None else None
        except StepLockError as exc:
            messages.error(
                request,
                _("The Redis lock store could not be read: %(error)s")
                % {"error": _error_text(exc)},
            )
            return HttpResponseRedirect(back)
        if info is None:
            messages.warning(
                request, _("Lease “%(name)s” is already gone: nothing released.") % {"name": name}
            )
            return HttpResponseRedirect(back)
        lease = Lease.from_redis(info, now_ms)
        form = ForceReleaseForm(
            initial={"name": name, "owner": lease.owner, "changelist_filters": filters.urlencode()}
        )
        context = self._context(
            request,
            _("Force-release lease “%(name)s”?") % {"name": name},
            lease=lease,
            form=form,
            object=lease,
            changelist_url=back,
            age=_duration(lease.age),
            ttl_left=_duration(lease.ttl_left),
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.release_confirmation_template, context)

    def _release_post(self, request: HttpRequest) -> HttpResponse:
        form = ForceReleaseForm(request.POST)
        if not form.is_valid():
            messages.error(
                request,
                _("Invalid force-release request: %(errors)s") % {"errors": form.errors.as_text()},
            )
            return HttpResponseRedirect(self.changelist_url())
        name, owner = form.cleaned_data["name"], form.cleaned_data["owner"]
        back = self.changelist_url(QueryDict(form.cleaned_data["changelist_filters"]))
        user = request.user.get_username()
        # The audit store commits its LeaseEvent row and this LogEntry *before* the
        # owner-checked delete (no record, no release), then records the outcome; see
        # celery_steplock.ops.force_release, shared with `celery steplock release`.
        auditor = LeaseEventAudit(
            using=router.db_for_write(LeaseEvent),
            also=lambda record: self.log_force_release(request, Lease.from_redis(record.lease)),
            after=lambda record: self.log_force_release_outcome(request, record),
        )
        try:
            store = lease_lock()
            app = celery_app()
            import_task_modules(app)  # once per process: the sender is the holder's task
            released = force_release(
                store,
                name,
                owner,
                actor=user,
                actor_host=request.META.get("REMOTE_ADDR"),
                via="admin",
                app=app,
                reason=f"force-released by {user} in the Django admin",
                auditor=auditor,
            )
        except AuditRecordFailed as failed:
            messages.error(
                request,
                _("The audit record could not be written: nothing released (%(error)s)")
                % {"error": failed.__cause__},
            )
            return HttpResponseRedirect(back)
        except ForceReleaseRefused as refused:
            current = refused.current
            if isinstance(refused, LeaseHeldByAnother) and current is not None:
                messages.warning(
                    request,
                    _(
                        "Lease “%(name)s” is now held by another owner (%(owner)s, task "
                        "%(task)s, fence %(fence)s): nothing released."
                    )
                    % {
                        "name": name,
                        "owner": current.get("owner"),
                        "task": current.get("task_name") or "?",
                        "fence": current.get("fence"),
                    },
                )
            else:
                messages.warning(
                    request,
                    _("Lease “%(name)s” is already gone: nothing released.") % {"name": name},
                )
            return HttpResponseRedirect(back)
        except StepLockError as exc:
            record = getattr(exc, "forced_release", None)
            if record is not None and record.outcome == "unknown":
                messages.error(
                    request,
                    _(
                        "The Redis lock store stopped answering during the release of lease "
                        "“%(name)s”: it may or may not be released (recorded as outcome "
                        "“unknown”; %(error)s)"
                    )
                    % {"name": name, "error": _error_text(exc)},
                )
            else:
                messages.error(
                    request,
                    _("The Redis lock store could not be reached: nothing released (%(error)s)")
                    % {"error": _error_text(exc)},
                )
            return HttpResponseRedirect(back)
        except (DatabaseError, RuntimeError) as exc:  # pragma: no cover - wrapped by ops
            messages.error(
                request,
                _("The audit record could not be written: nothing released (%(error)s)")
                % {"error": _error_text(exc)},
            )
            return HttpResponseRedirect(back)
        text = _(
            "Force-released lease “%(name)s” (owner %(owner)s, task %(task)s, fence %(fence)s)."
        ) % {
            "name": name,
            "owner": owner,
            "task": released.task_name or "?",
            "fence": released.fence,
        }
        if released.outcome_recorded:
            messages.success(request, text)
        else:
            messages.warning(
                request,
                text
                + " "
                + _(
                    "Its outcome could not be recorded: the audit record (%(audit)s) still says "
                    "“requested” (%(error)s)."
                )
                % {"audit": released.audit or "?", "error": released.outcome_error},
            )
        return HttpResponseRedirect(back)

    # -- audit --------------------------------------------------------------------------------

    def log_force_release(self, request: HttpRequest, lease: Lease) -> LogEntry:
        """Write the admin ``LogEntry`` (action DELETION) of a force release, before the
        delete (in the audit record's transaction)."""
        message = (
            f"Force release of lease {lease.name} requested: owner {lease.owner}, task "
            f"{lease.task_name or '?'} [{lease.task_id or '?'}], fence {lease.fence}, "
            f"worker {lease.worker or lease.hostname or '?'} pid {lease.pid}"
        )
        return self._log_entry(request, lease, DELETION, message)

    def log_force_release_outcome(self, request: HttpRequest, record) -> LogEntry | None:
        """A second ``LogEntry`` (action CHANGE) when a requested force release did not
        release (the holder changed after the request, or Redis failed); None when it
        did."""
        if record.outcome == "released" or record.audit_id is None:
            return None
        lease = Lease.from_redis(record.lease)
        message = (
            f"Force release of lease {lease.name} (owner {lease.owner}, fence "
            f"{lease.fence}) did not release it: {record.outcome}"
            + (f" ({record.detail})" if record.detail else "")
        )
        return self._log_entry(request, lease, CHANGE, message)

    def _log_entry(self, request: HttpRequest, lease: Lease, flag: int, message: str) -> LogEntry:
        manager = LogEntry.objects
        if hasattr(manager, "log_actions"):  # Django 5.1+ (log_action is deprecated there)
            return manager.log_actions(
                request.user.pk, [lease], flag, change_message=message, single_object=True
            )
        from django.contrib.contenttypes.models import ContentType

        return manager.log_action(  # Django 4.2
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(lease).pk,
            object_id=lease.pk,
            object_repr=str(lease),
            action_flag=flag,
            change_message=message,
        )

    def send_released(self, request: HttpRequest, lease: Lease) -> None:
        """Deprecated: :func:`celery_steplock.ops.force_release` sends ``lock_released``
        (``forced=True``) itself; the admin no longer calls this."""
        warnings.warn(
            "LeaseAdmin.send_released is deprecated: celery_steplock.ops."
            "force_release sends lock_released",
            DeprecationWarning,
            stacklevel=2,
        )
        user = request.user.get_username()
        emit(
            signals.lock_released,
            lease.task_name or "celery_steplock.admin",
            logging.WARNING,
            key=lease.key,
            name=lease.name,
            owner=lease.owner,
            fence=lease.fence,
            task_id=lease.task_id or None,
            task_name=lease.task_name or None,
            ttl=lease.lease_ttl,
            forced=True,
            reason=f"force-released by {user} in the Django admin",
            user=user,
        )
