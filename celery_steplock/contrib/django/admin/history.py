"""The timeline of one lock name (its history, :mod:`celery_steplock.history`), read live
from Redis: a page of the "Held leases" admin.

``admin:celery_steplock_lease_timeline`` (``?name=<lock name>``, ``&offset=<n>`` for the
next page): the name's entries newest first, one call to Redis (``TIME``, ``TYPE``,
``LRANGE`` of one page) whatever Redis holds, so the page costs the same with one name or a
million. Needs ``celery_steplock.view_lease``, as the Held leases page (it shows owner
tokens and task ids). An entry that cannot be read is a row "malformed" saying why, a key
that is no list one such row, a bad name or offset and Redis down a message on the page:
never an error 500.

Linked from the Held leases rows (:class:`~.leases.LeaseAdmin` mixes :class:`HistoryPages`
in) and from the event log's rows (:class:`~.events.LeaseEventAdmin`, by the URL's name).
"""

from __future__ import annotations

import datetime
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse
from django.utils.decorators import method_decorator
from django.utils.translation import gettext as _
from django.utils.translation import ngettext
from django.views.decorators.cache import never_cache

from ....exceptions import InvalidArgument, LockNameError, StepLockError
from ....history import HistoryEntry
from ..leases import lease_lock
from ._common import store_read_failed

__all__ = ["HistoryPages", "history_url", "history_rows", "HISTORY_PAGE"]

#: The last part of the page's URL name (``admin:<app>_lease_timeline``; not Django's
#: ``_history``, an object's change history).
HISTORY_PAGE = "timeline"


def history_url(admin_site_name: str, name: str) -> str | None:
    """The timeline page of ``name`` on the admin site named ``admin_site_name``, or None
    when the site has no such page (the Held leases page not registered)."""
    try:
        url = reverse(f"admin:celery_steplock_lease_{HISTORY_PAGE}", current_app=admin_site_name)
    except NoReverseMatch:
        return None
    return f"{url}?{urlencode({'name': name})}"


def history_rows(entries: list[HistoryEntry]) -> list[dict[str, Any]]:
    """The page's rows: each entry with its time as an aware UTC datetime and a detail
    text (refusals counted, holder, operator, reason)."""
    rows = []
    for entry in entries:
        detail = []
        if entry.contended:
            detail.append(
                ngettext(
                    "%(count)s refused acquire", "%(count)s refused acquires", entry.contended
                )
                % {"count": entry.contended}
            )
        if entry.holder:
            detail.append(_("held by %(owner)s") % {"owner": entry.holder})
        if entry.by:
            detail.append(_("by %(who)s") % {"who": entry.by})
        if entry.reason:
            detail.append(entry.reason)
        if entry.extra:
            detail.append(", ".join(f"{k}={v}" for k, v in sorted(entry.extra.items())))
        try:
            at = (
                datetime.datetime.fromtimestamp(entry.at, tz=datetime.timezone.utc)
                if entry.at
                else None
            )
        except (OverflowError, ValueError, OSError):  # never a 500 for a stored time
            at = None
        rows.append(
            {
                "entry": entry,
                "at": at,
                "malformed": entry.event == "malformed",
                "detail": "; ".join(detail),
            }
        )
    return rows


class HistoryPages:
    """The timeline page, for a :class:`~._common.LiveModelAdmin` of leases: add
    ``self.timeline_pattern()`` to its ``get_urls`` and link rows with
    :meth:`timeline_link`."""

    #: Entries per page.
    timeline_per_page = 100
    timeline_template = "admin/celery_steplock/lease/history.html"

    def timeline_pattern(self) -> Any:
        """The page's URL pattern (``timeline/``)."""
        return self.page_url(  # type: ignore[attr-defined]
            "timeline/", self.timeline_view, HISTORY_PAGE
        )

    def timeline_link(self, name: str) -> str:
        """The path of ``name``'s timeline on this admin site."""
        url = self.page_reverse(HISTORY_PAGE)  # type: ignore[attr-defined]
        return f"{url}?{urlencode({'name': name})}"

    @method_decorator(never_cache)
    def timeline_view(self, request: HttpRequest) -> HttpResponse:
        """GET ``?name=`` (``&offset=``: stored entries to skip, the older pages): the
        name's timeline, newest first. Needs the view permission of the leases page."""
        if not self.has_view_permission(request):  # type: ignore[attr-defined]
            raise PermissionDenied
        name = request.GET.get("name", "")
        raw_offset = request.GET.get("offset", "0")
        offset = int(raw_offset) if raw_offset.isascii() and raw_offset.isdigit() else -1
        entries: list[HistoryEntry] | None = None
        try:
            entries = lease_lock().history(name, self.timeline_per_page, offset=offset)
        except (InvalidArgument, LockNameError) as exc:
            messages.error(request, _("Not a lock name or page: %(error)s") % {"error": exc})
        except StepLockError as exc:
            store_read_failed(request, exc)
        rows = history_rows(entries or [])
        stored = [r for r in rows if not r["entry"].inferred and r["entry"].id != "?"]
        next_url = None
        if entries is not None and len(stored) >= self.timeline_per_page:
            next_url = "?" + urlencode({"name": name, "offset": offset + self.timeline_per_page})
        opts = self.opts  # type: ignore[attr-defined]
        context = {
            **self.admin_site.each_context(request),  # type: ignore[attr-defined]
            "opts": opts,
            "app_label": opts.app_label,
            "title": _("History of %(name)s") % {"name": name},
            "has_view_permission": True,
            "name": name,
            "rows": rows,
            "store_error": entries is None,
            "next_url": next_url,
            "first_url": "?" + urlencode({"name": name}) if offset > 0 else None,
            "changelist_url": self.page_reverse("changelist"),  # type: ignore[attr-defined]
        }
        request.current_app = self.admin_site.name  # type: ignore[attr-defined]
        return TemplateResponse(request, self.timeline_template, context)
