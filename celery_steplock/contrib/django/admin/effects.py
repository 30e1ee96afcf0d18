"""The effects outbox page: ``Effect`` rows (pending, dispatched, dead, discarded), read-only,
with two audited operator actions.

``Retry now``
    Puts the selected effects (dead, discarded or pending) back to ``pending`` with their
    attempts at 0 and their next attempt now, so the next
    relay (the committing process is gone: the periodic ``celery_steplock.relay_effects``
    task or ``manage.py reap_expired_leases``) dispatches them again, with the same key.
``Discard``
    Marks them (dead or pending) ``discarded``: no relay dispatches them again.

A dispatched effect, or one a relay is sending at that moment, is left as it is (and said so
on the page).
Both need ``celery_steplock.replay_effect`` and the view permission, show a confirmation
page first (the effects, their statuses), and are done by
:func:`celery_steplock.contrib.django.outbox.retry_effects` /
:func:`~celery_steplock.contrib.django.outbox.discard_effects` (as the force release of a
lease, the rules live there): each writes its audit record, a ``LeaseEvent`` row (event
``effect_retried`` / ``effect_discarded``, the user, the client's address, ``via="admin"``).
There are no add, change or delete views: a row changes only through those actions and the
relay.

A payload (the effect's arguments: an HTTP call's headers and body, an email's text) is shown
to users with ``celery_steplock.replay_effect`` only, the values of credential-looking headers
masked; the view permission alone shows its size. A payload of an unexpected shape (not an
object, ``headers`` not an object, a value that does not serialize) is shown as it is and
never breaks the page; the list never loads payloads.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.auth import get_permission_codename
from django.db import DatabaseError, router, transaction
from django.db.models import Count
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from ....ops import AuditRecordFailed
from ....redact import redact
from ..models import Effect, LeaseEvent
from ._common import ReadOnlyModelAdmin, _error_text

__all__ = ["EffectAdmin", "payload_text"]

#: Header names (lower case) whose values the page never shows, and parts of a name that
#: mark one as a credential.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "set-cookie"})
SECRET_HEADER_PARTS = ("token", "secret", "password", "api-key", "apikey", "signature")
MASK = "********"
#: Effects listed by name on the confirmation page at most (the counts are complete).
CONFIRM_LISTED = 20
#: Characters of ``last_error`` shown in the list.
SHORT_ERROR = 80


def _secret_header(name: Any) -> bool:
    lowered = str(name).lower()
    return lowered in SECRET_HEADERS or any(part in lowered for part in SECRET_HEADER_PARTS)


def _masked(payload: Any) -> Any:
    """``payload`` with the values of credential-looking headers (``headers``, an object)
    replaced by :data:`MASK`; anything else as it is."""
    if not isinstance(payload, dict):
        return payload
    headers = payload.get("headers")
    if not isinstance(headers, dict):
        return payload
    return {
        **payload,
        "headers": {k: MASK if _secret_header(k) else v for k, v in headers.items()},
    }


def payload_text(payload: Any, *, reveal: bool) -> str:
    """An effect's payload as the page shows it; never raises.

    Args:
        payload: The ``Effect.payload`` value as loaded (any JSON value; a corrupt row may
            hold any shape).
        reveal: Whether the user may read it (``celery_steplock.replay_effect``).

    Returns:
        With ``reveal``: indented JSON with keys sorted, credential-looking header values
        masked (the ``repr`` when it does not serialize). Without: its shape and size only.
    """
    try:
        text = json.dumps(_masked(payload), indent=2, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(payload)
    if reveal:
        return text
    shape = _("%d key(s)") % len(payload) if isinstance(payload, dict) else type(payload).__name__
    return _(
        "%(shape)s, %(size)d characters (hidden: reading it needs the permission "
        "celery_steplock.replay_effect)"
    ) % {"shape": shape, "size": len(text)}


@admin.register(Effect)
class EffectAdmin(ReadOnlyModelAdmin):
    """The effects outbox, read-only, with the audited "Retry now" and "Discard" actions
    (``celery_steplock.replay_effect``); see the module docstring."""

    list_display = (
        "status",
        "kind",
        "target_shown",
        "step",
        "key",
        "attempts",
        "next_attempt_at",
        "short_error",
        "created_at",
        "dispatched_at",
    )
    list_filter = ("status", "kind")
    search_fields = ("key", "target", "step")
    date_hierarchy = "created_at"
    actions = ("retry_now", "discard")
    action_confirmation_template = "admin/celery_steplock/effect/action_confirmation.html"

    # -- permissions ----------------------------------------------------------------------

    def has_replay_permission(self, request: HttpRequest) -> bool:
        """``celery_steplock.replay_effect`` and the view permission (the actions'
        ``permissions=["replay"]``; also what reveals payloads)."""
        codename = get_permission_codename("replay", self.opts)
        return request.user.has_perm(
            f"{self.opts.app_label}.{codename}"
        ) and self.has_view_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        # A row changes only through the audited actions and the relay.
        return False

    def get_urls(self):
        urls = super().get_urls()
        changelist = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        for pattern in urls:
            if getattr(pattern, "name", None) == changelist:
                # The actions' audit records commit before the change (durable
                # transactions): never inside the request's (ATOMIC_REQUESTS) on the audit
                # database, as the force release of a lease.
                transaction.non_atomic_requests(using=router.db_for_write(LeaseEvent))(
                    pattern.callback
                )
        return urls

    # -- list and detail ----------------------------------------------------------------

    def get_queryset(self, request: HttpRequest):
        # The list never loads payloads (they can be large, and are shown on the detail page
        # only, through payload_shown).
        return super().get_queryset(request).defer("payload")

    def get_readonly_fields(self, request: HttpRequest, obj=None):
        shown = "payload_shown" if self.has_replay_permission(request) else "payload_size"
        replaced = {"payload": shown, "target": "target_shown"}
        return [replaced.get(name, name) for name in super().get_readonly_fields(request, obj)]

    def get_object(self, request: HttpRequest, object_id: str, from_field=None):
        # The detail page is read-only (never saved): its title and breadcrumbs show
        # str(effect), which names the target, so the target is masked on the object itself.
        obj = super().get_object(request, object_id, from_field)
        if obj is not None:
            obj.target = redact(obj.target or "")
        return obj

    @admin.display(description=gettext_lazy("target"), ordering="target")
    def target_shown(self, obj: Effect) -> str:
        """The target with its secrets masked (:func:`celery_steplock.redact.redact`: a URL's
        ``user:password@``, ``?password=``...): the view permission alone shows it."""
        return redact(obj.target or "")

    def get_fields(self, request: HttpRequest, obj=None):
        # Only the read-only fields, so no form field ever carries ``payload``.
        return self.get_readonly_fields(request, obj)

    @admin.display(description=gettext_lazy("payload"))
    def payload_shown(self, obj: Effect) -> str:
        """The payload, for users with the replay permission (:func:`payload_text`)."""
        return self._payload(obj, reveal=True)

    @admin.display(description=gettext_lazy("payload"))
    def payload_size(self, obj: Effect) -> str:
        """The payload's shape and size only (what the view permission may see)."""
        return self._payload(obj, reveal=False)

    @staticmethod
    def _payload(obj: Effect, *, reveal: bool) -> str:
        try:
            payload = obj.payload
        except Exception as exc:  # noqa: BLE001 - a corrupt value never breaks the page
            return _("unreadable: %(error)s") % {"error": _error_text(exc)}
        return payload_text(payload, reveal=reveal)

    @admin.display(description=gettext_lazy("last error"), ordering="last_error")
    def short_error(self, obj: Effect) -> str:
        text = obj.last_error or ""
        return text if len(text) <= SHORT_ERROR else text[: SHORT_ERROR - 1] + "…"

    # -- actions --------------------------------------------------------------------------

    @admin.action(
        description=gettext_lazy("Retry now the selected effects"), permissions=["replay"]
    )
    def retry_now(self, request: HttpRequest, queryset):
        return self._replay(request, queryset, "retry_now")

    @admin.action(description=gettext_lazy("Discard the selected effects"), permissions=["replay"])
    def discard(self, request: HttpRequest, queryset):
        return self._replay(request, queryset, "discard")

    def _replay(self, request: HttpRequest, queryset, action: str):
        """The confirmation page (first POST), then the action (``post=yes``)."""
        if request.POST.get("post") != "yes":
            return self._confirmation(request, queryset, action)
        from .. import outbox  # the relay's module

        perform = outbox.retry_effects if action == "retry_now" else outbox.discard_effects
        try:
            records = perform(
                queryset,
                actor=request.user.get_username(),
                actor_host=request.META.get("REMOTE_ADDR"),
                via="admin",
            )
        except AuditRecordFailed as failed:
            # The effects before the failing one were changed (and audited); it and the
            # ones after it were not.
            self.message_user(
                request,
                _(
                    "The audit record could not be written: that effect and the ones after it "
                    "are unchanged (%(error)s)"
                )
                % {"error": _error_text(failed.__cause__ or failed)},
                messages.ERROR,
            )
            return None
        except DatabaseError as exc:
            # The outbox logged what it did before the error (one line per effect).
            self.message_user(
                request,
                _("The database refused the action (%(error)s)") % {"error": _error_text(exc)},
                messages.ERROR,
            )
            return None
        self._report(request, action, records)
        return None

    def _report(self, request: HttpRequest, action: str, records: list[Any]) -> None:
        """The messages of an action: done, refused (dispatched, or being sent now) and
        changed meanwhile (by the relay), each counted."""
        outcomes = Counter(record.outcome for record in records)
        done = outcomes.pop("done", 0)
        if action == "retry_now":
            text = ngettext(
                "%d effect will be dispatched again by the next relay.",
                "%d effects will be dispatched again by the next relay.",
                done,
            )
        else:
            text = ngettext("%d effect discarded.", "%d effects discarded.", done)
        self.message_user(request, text % done, messages.SUCCESS if done else messages.WARNING)
        details = Counter(
            (record.detail or record.outcome).split(" (", 1)[0].split(":", 1)[0]
            for record in records
            if record.outcome != "done"
        )
        for detail, count in sorted(details.items()):
            self.message_user(
                request,
                _("%(count)d effect(s) left as they were: %(why)s.")
                % {"count": count, "why": detail},
                messages.WARNING,
            )

    def _confirmation(self, request: HttpRequest, queryset, action: str) -> TemplateResponse:
        statuses = {
            row["status"]: row["n"]
            for row in queryset.order_by().values("status").annotate(n=Count("pk"))
        }
        total = sum(statuses.values())
        listed = list(queryset.defer("payload").order_by("-created_at", "-id")[:CONFIRM_LISTED])
        for effect in listed:  # shown only, never saved
            effect.target = redact(effect.target or "")
        title = (
            _("Retry these effects now?") if action == "retry_now" else _("Discard these effects?")
        )
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "action": action,
            "action_label": _("Retry now") if action == "retry_now" else _("Discard"),
            "effects": listed,
            "total": total,
            "unlisted": max(0, total - len(listed)),
            "statuses": sorted(statuses.items()),
            "select_across": request.POST.get("select_across") == "1",
            "selected": request.POST.getlist(helpers.ACTION_CHECKBOX_NAME),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "objects_name": self.opts.verbose_name_plural,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.action_confirmation_template, context)
