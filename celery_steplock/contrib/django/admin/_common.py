"""What the admin pages share: error text safe for staff, the lock store's read error on a
page, the audited-view wrapper, and two bases (pages read live from Redis, with their read
and response, and read-only database logs)."""

from __future__ import annotations

import logging
from typing import Any, Callable

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.db import router, transaction
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext as _

from ....events import log_event
from ....exceptions import StepLockError
from ....redact import redact, secrets_of
from ..leases import celery_app, steplock_task_names
from ..models import LeaseEvent

logger = logging.getLogger("celery_steplock")


def _error_text(exc: BaseException) -> str:
    """An error as the page (seen by view-only staff) and the log may show it: every secret
    of the Celery app's settings masked (URL passwords, transport options)."""
    try:
        secrets = secrets_of(celery_app())
    except Exception:  # noqa: BLE001 - no app to read: the URL and key/value forms still
        secrets = ()
    return redact(exc, secrets)


def store_read_failed(request: HttpRequest, exc: StepLockError) -> None:
    """Say on the page that the Redis lock store could not be read (Redis down or
    misconfigured: a message, never a 500), and log it: ``admin_lock_store_error``
    (WARNING), the error as :func:`_error_text` masks it."""
    log_event("admin_lock_store_error", logging.WARNING, error=_error_text(exc))
    messages.error(
        request,
        _("The Redis lock store could not be read: %(error)s") % {"error": _error_text(exc)},
    )


def audited_view(admin_site: admin.AdminSite, view: Callable[..., Any]) -> Callable[..., Any]:
    """An operator action's view, wrapped by ``admin_site.admin_view`` and kept out of the
    request's transaction (``ATOMIC_REQUESTS``) on the audit database.

    Args:
        admin_site: The site the page is registered on.
        view: The bound view method.

    Returns:
        The view to put in the page's URL patterns: its audit record commits before Redis is
        written, which a commit inside the request's transaction would not do.
    """
    return transaction.non_atomic_requests(using=router.db_for_write(LeaseEvent))(
        admin_site.admin_view(view)
    )


class LiveModelAdmin(admin.ModelAdmin):
    """A page over an unmanaged model whose rows live in Redis: no add, change or delete
    views and no bulk actions; its operator action needs a permission of its own."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        # Redis state changes only through the page's audited action, never by Django's
        # delete views or a bulk action.
        return False

    def get_actions(self, request: HttpRequest):
        return {}

    def page_url(
        self, route: str, view: Callable[..., Any], page: str, *, audited: bool = False
    ) -> URLPattern:
        """One URL pattern of the page, named ``<app_label>_<model_name>_<page>``.

        Args:
            route: The route below the model's admin URL (``""`` for the list).
            view: The bound view method.
            page: The last part of the URL's name (``"changelist"``, ``"release"``).
            audited: True for an operator action (:func:`audited_view`), else a plain
                ``admin_view``.

        Returns:
            The pattern for :meth:`get_urls`.
        """
        wrapped = (
            audited_view(self.admin_site, view) if audited else self.admin_site.admin_view(view)
        )
        return path(route, wrapped, name=f"{self.opts.app_label}_{self.opts.model_name}_{page}")

    def page_reverse(self, page: str) -> str:
        """The path of one of the page's URLs (:meth:`page_url`) on this admin site.

        Args:
            page: The last part of the URL's name.

        Returns:
            The reversed path.
        """
        return reverse(
            f"admin:{self.opts.app_label}_{self.opts.model_name}_{page}",
            current_app=self.admin_site.name,
        )

    def has_operator_permission(self, request: HttpRequest, action: str) -> bool:
        """The model's ``<action>`` permission and the view permission.

        Args:
            request: The admin request.
            action: The permission's action, e.g. ``"force_release"`` for
                ``celery_steplock.force_release_lease``.

        Returns:
            Whether the user holds both.
        """
        codename = get_permission_codename(action, self.opts)
        return request.user.has_perm(
            f"{self.opts.app_label}.{codename}"
        ) and self.has_view_permission(request)

    def read_live(self, request: HttpRequest, read: Callable[[Any, list], Any]) -> tuple[Any, Any]:
        """What a live page's list shows, read from Redis with the app's StepLockedTasks.

        Args:
            request: The admin request.
            read: ``read(app, tasks)``: the Celery app and its StepLockedTasks (their
                modules imported first: :func:`~celery_steplock.contrib.django.leases.steplock_task_names`).

        Returns:
            ``(read's value, None)``, or ``(None, error text)`` when a
            :class:`~celery_steplock.exceptions.StepLockError` is raised (the page shows the
            text: :func:`_error_text`).

        Raises:
            PermissionDenied: The user lacks the model's view permission.
        """
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            app = celery_app()
            return read(app, [app.tasks[name] for name in steplock_task_names(app)]), None
        except StepLockError as exc:
            return None, _error_text(exc)

    def live_response(
        self, request: HttpRequest, title: str, context: dict[str, Any], extra_context=None
    ) -> TemplateResponse:
        """The live page's list: :attr:`change_list_template` with the admin site's context,
        ``opts``, ``title``, the page's ``context``, then ``extra_context`` (which wins)."""
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            **context,
            **(extra_context or {}),
        }
        template = self.change_list_template
        assert template is not None  # each live page names its own
        request.current_app = self.admin_site.name
        return TemplateResponse(request, template, context)


class ReadOnlyModelAdmin(admin.ModelAdmin):
    """A database table shown read-only: every field read-only, no add or change."""

    list_per_page = 100
    # COUNT(*) on a large log is slow on PostgreSQL; the paginator shows "Show all" instead.
    show_full_result_count = False

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.opts.fields]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
