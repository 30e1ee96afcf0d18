"""Columns that let the compare-and-swap refuse a stale lease holder.

Subclass :class:`LeaseFencedStep` in the step model (or declare the same two fields)::

    class Order(LeaseFencedStep):
        status = models.CharField(max_length=32, default="pending")

With them, :class:`~celery_steplock.contrib.django.steps.DjangoStepStore` adds
``lock_fence IS NULL OR lock_fence <= <token>`` to its ``UPDATE`` and writes the token and the owner, so a holder that
paused past its TTL cannot write after a newer holder has, even when the status would match
(fencing token, as in Kleppmann 2016). The names are the defaults of the settings
``steplock_owner_field`` and ``steplock_fence_field``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import FieldDoesNotExist
from django.db import models

__all__ = ["LeaseFencedStep", "GuardedStepAdminMixin"]


class LeaseFencedStep(models.Model):
    """Abstract model: ``lock_owner`` (the owner token of the attempt that wrote the row last,
    max 64 characters, blank when none) and ``lock_fence`` (its fencing token, a 64-bit
    integer, NULL before the first fenced write)."""

    lock_owner = models.CharField(max_length=64, blank=True, default="")
    lock_fence = models.BigIntegerField(null=True, blank=True)

    class Meta:
        abstract = True


#: The change form's extra fields: the status to move to, and the status the form showed.
TRANSITION_FIELD = "steplock_transition"
SEEN_STATUS_FIELD = "steplock_seen_status"
#: The change form's read-only line linking to the step's lease history (users with
#: ``celery_steplock.view_lease`` only: lock names are theirs to see).
HISTORY_FIELD = "steplock_lease_history"
#: The admin URL name of a lock name's timeline (``admin/history.py``).
TIMELINE_URL = "admin:celery_steplock_lease_timeline"


class GuardedStepAdminMixin:
    """ModelAdmin mixin for a step model: the admin takes part in the guard.

    Use it before ``ModelAdmin`` in the bases::

        @admin.register(Order)
        class OrderAdmin(GuardedStepAdminMixin, admin.ModelAdmin):
            steplock_task = "orders.tasks.charge"

    What changes (a plain ``ModelAdmin.save_model()`` calls ``obj.save()``, which writes
    every column as the form loaded it: a form saved after a task committed writes back the
    old status and a NULL fencing token, and a redelivery then commits the same transition a
    second time):

    - The owner and fence columns are read-only, and so is the status on the change form;
      a save writes only the form's other columns (``save(update_fields=...)``), never
      the guard columns.
    - A status change is the form's "Change status to" field, applied by the fenced
      compare-and-swap from the status the form *showed*: a form opened before a task
      moved the step is refused ("Nothing was saved"), never written back.
    - A change form's POST holds the step's lease, as a task does
      (:func:`~celery_steplock.contrib.django.steps.guarded_step`), in one durable
      transaction committed before the lease is released: the save, the transition, the
      inlines and the admin log commit together or not at all. A busy lease, a conflict, a
      lost lease or a Redis outage leaves the step as it was, with an error message. The
      change view is exempt from ``ATOMIC_REQUESTS`` (its transaction must be the
      outermost).
    - ``list_editable`` loses the guard columns.

    Attributes:
        steplock_task: A StepLockedTask of this model (or its name) whose lock name, TTL,
            wait and transition table the admin uses; None: the lock name is derived
            (:func:`~celery_steplock.contrib.django.steps.step_lock_name`).
        steplock_wait: Seconds a save waits for a busy lease (None: the task's, else
            ``steplock_lock_wait``).
        steplock_app: The Celery app (None: ``celery.current_app``).
    """

    steplock_task: Any = None
    steplock_wait: float | None = None
    steplock_app: Any = None

    # -- what is guarded ---------------------------------------------------------------

    def steplock_settings(self) -> Any:
        from ...conf import Settings
        from .steps import _celery_app

        return Settings(_celery_app(self.steplock_app))

    def steplock_guard_fields(self) -> tuple[str | None, str | None, str | None]:
        """``(status, owner, fence)`` field names of the model (None for one it lacks), per
        ``steplock_status_field``/``steplock_owner_field``/``steplock_fence_field``."""
        settings = self.steplock_settings()
        names = []
        for name in (settings.status_field, settings.owner_field, settings.fence_field):
            try:
                self.model._meta.get_field(name)  # type: ignore[attr-defined]
            except FieldDoesNotExist:
                name = None
            names.append(name)
        return names[0], names[1], names[2]

    def get_steplock_lock_name(self, request: Any, obj_pk: Any) -> str | None:
        """The lock name a change of step ``obj_pk`` holds; None (default): derived from
        :attr:`steplock_task`, or from the app's tasks of this model."""
        return None

    def guarded_step(self, request: Any, obj_pk: Any) -> Any:
        """The :class:`~celery_steplock.contrib.django.steps.GuardedStep` a change of step
        ``obj_pk`` holds (not entered)."""
        from .steps import guarded_step

        user = getattr(request, "user", None)
        name = user.get_username() if user is not None and user.is_authenticated else "-"
        return guarded_step(
            self.model,  # type: ignore[attr-defined]
            obj_pk,
            lock_name=self.get_steplock_lock_name(request, obj_pk),
            task=self.steplock_task,
            wait=self.steplock_wait,
            app=self.steplock_app,
            actor=f"admin:{name}",
        )

    # -- the form ----------------------------------------------------------------------

    def get_readonly_fields(self, request: Any, obj: Any = None) -> Any:
        status, owner, fence = self.steplock_guard_fields()
        guarded = [owner, fence] if obj is None else [status, owner, fence]
        if obj is not None and _sees_leases(request):
            guarded.append(HISTORY_FIELD)
        fields = list(super().get_readonly_fields(request, obj))  # type: ignore[misc]
        return fields + [f for f in guarded if f and f not in fields]

    @admin.display(description="Lease history")
    def steplock_lease_history(self, obj: Any) -> str:
        """A link to the timeline of the step's lock name (acquired, contended, released with
        each execution's outcome, forced, reaped, lost), when the name is derivable from the
        step (:meth:`get_steplock_lock_name` with no request, :attr:`steplock_task`, or the
        app's tasks whose ``lock_key`` names only the step); else why it is not."""
        from django.urls import NoReverseMatch, reverse
        from django.utils.html import format_html

        from ...exceptions import StepLockError
        from .steps import step_lock_name

        try:
            name = self.get_steplock_lock_name(None, obj.pk) or step_lock_name(
                self.model,  # type: ignore[attr-defined]
                obj.pk,
                task=self.steplock_task,
                app=self.steplock_app,
            )
            url = reverse(TIMELINE_URL, current_app=self.admin_site.name)  # type: ignore[attr-defined]
        except StepLockError as exc:
            return f"not derivable from the step: {exc}"
        except NoReverseMatch:
            return "the Held leases page is not in this admin site"
        return format_html('<a href="{}?{}">{}</a>', url, urlencode({"name": name}), name)

    def _status_choices(self, obj: Any, status_field: str) -> list[tuple[str, str]]:
        current = getattr(obj, status_field)
        task = self.steplock_task
        table = None
        if task is not None:
            from .steps import _celery_app, _step_locked_task

            table = _step_locked_task(task, _celery_app(self.steplock_app)).step_transitions
        field = self.model._meta.get_field(status_field)  # type: ignore[attr-defined]
        labels = {str(k): str(v) for k, v in (field.flatchoices or ())}
        if table is not None:
            targets = [str(t) for t in table.get(current, ())]
        else:
            targets = [k for k in labels if k != str(current)]
        return [(t, labels.get(t, t)) for t in targets]

    def get_form(self, request: Any, obj: Any = None, change: bool = False, **kwargs: Any) -> Any:
        status = self.steplock_guard_fields()[0]
        # A view-only user's form shows every field read-only, looked up on the model: the
        # extra fields exist for those who may change the step.
        if obj is not None and status and self.has_change_permission(request, obj):  # type: ignore[attr-defined]
            from django import forms

            current = getattr(obj, status)
            choices = self._status_choices(obj, status)
            help_text = (
                f"Applied under the step's lease, from the status shown here ({current}); "
                f"refused if it changed meanwhile."
            )
            if choices:
                target: forms.Field = forms.ChoiceField(
                    label=f"Change {status} to",
                    choices=[("", f"(keep {current})"), *choices],
                    required=False,
                    help_text=help_text,
                )
            else:
                target = forms.CharField(
                    label=f"Change {status} to", required=False, help_text=help_text
                )
            base: Any = kwargs.get("form", self.form)  # type: ignore[attr-defined]
            kwargs["form"] = type(
                base.__name__,
                (base,),
                {
                    TRANSITION_FIELD: target,
                    SEEN_STATUS_FIELD: forms.CharField(
                        widget=forms.HiddenInput, required=False, initial=current
                    ),
                },
            )
        return super().get_form(request, obj, change=change, **kwargs)  # type: ignore[misc]

    def get_fieldsets(self, request: Any, obj: Any = None) -> Any:
        fieldsets = list(super().get_fieldsets(request, obj))  # type: ignore[misc]
        if (
            obj is None
            or not self.steplock_guard_fields()[0]
            or not self.has_change_permission(request, obj)  # type: ignore[attr-defined]
        ):
            return fieldsets
        from django.contrib.admin.utils import flatten_fieldsets

        shown_fields = set(flatten_fieldsets(fieldsets))
        wanted: tuple[str, ...] = (TRANSITION_FIELD, SEEN_STATUS_FIELD)
        if _sees_leases(request):
            wanted += (HISTORY_FIELD,)
        extra = [f for f in wanted if f not in shown_fields]
        if extra:
            fieldsets.append(("Status", {"fields": extra}))
        return fieldsets

    def get_changelist_instance(self, request: Any) -> Any:
        # list_editable would save the guard columns through a plain formset.
        guarded = set(filter(None, self.steplock_guard_fields()))
        editable = getattr(self, "list_editable", ())
        self.list_editable = tuple(f for f in editable if f not in guarded)
        return super().get_changelist_instance(request)  # type: ignore[misc]

    # -- the save ----------------------------------------------------------------------

    def save_model(self, request: Any, obj: Any, form: Any, change: bool) -> None:
        if not change:
            super().save_model(request, obj, form, change)  # type: ignore[misc]
            return
        status, owner, fence = self.steplock_guard_fields()
        guarded = {status, owner, fence}
        meta = obj._meta
        columns = [
            f.name
            for f in meta.concrete_fields
            if not f.primary_key
            and f.name not in guarded
            and (f.name in form.fields or getattr(f, "auto_now", False))
        ]
        if columns:
            obj.save(update_fields=columns)
        target = form.cleaned_data.get(TRANSITION_FIELD)
        if not target or not status:
            return
        step = getattr(request, "steplock_step", None)
        if step is None:
            from ...exceptions import OuterTransactionError

            raise OuterTransactionError(
                "a status change from the admin runs inside its change view's guarded step"
            )
        seen = form.cleaned_data.get(SEEN_STATUS_FIELD) or getattr(obj, status)
        result = step.transition(seen, target)
        setattr(obj, status, target)
        if fence and result.fence is not None:
            setattr(obj, fence, result.fence)

    def changeform_view(
        self, request: Any, object_id: Any = None, form_url: str = "", extra_context: Any = None
    ) -> Any:
        parent = super().changeform_view  # type: ignore[misc]
        if request.method != "POST" or object_id is None or "_saveasnew" in request.POST:
            return parent(request, object_id, form_url, extra_context)
        from django.contrib import messages
        from django.contrib.admin.utils import unquote
        from django.http import HttpResponseRedirect

        from ...exceptions import (
            InvalidStepId,
            InvalidTransition,
            LockContended,
            LockLost,
            LockStoreUnavailable,
            TransitionConflict,
        )

        try:
            step = self.guarded_step(request, unquote(object_id))
        except InvalidStepId:
            return parent(request, object_id, form_url, extra_context)  # Django's 404
        try:
            with step:
                request.steplock_step = step
                return parent(request, object_id, form_url, extra_context)
        except (
            LockContended,
            TransitionConflict,
            LockLost,
            LockStoreUnavailable,
            InvalidTransition,
        ) as exc:
            self.message_user(  # type: ignore[attr-defined]
                request, _refusal(exc), level=messages.ERROR
            )
            return HttpResponseRedirect(request.get_full_path())
        finally:
            request.__dict__.pop("steplock_step", None)

    def get_urls(self) -> Any:
        from django.db import connections

        urls = super().get_urls()  # type: ignore[misc]
        opts = self.model._meta  # type: ignore[attr-defined]
        change = f"{opts.app_label}_{opts.model_name}_change"
        for pattern in urls:
            if getattr(pattern, "name", None) == change:
                # ATOMIC_REQUESTS would wrap the view in a transaction that commits after
                # the guarded step's lease is released (Django reads this attribute).
                pattern.callback._non_atomic_requests = set(connections)
        return urls


def _sees_leases(request: Any) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.has_perm("celery_steplock.view_lease"))


def _refusal(exc: Exception) -> str:
    """The admin's message for a refused change of a step (nothing was saved)."""
    from ...exceptions import LockContended, LockLost, LockStoreUnavailable, TransitionConflict

    if isinstance(exc, TransitionConflict):
        if exc.current is not None and exc.current != exc.from_:
            why = f"its status is now {exc.current!r}, not {exc.from_!r} as the form showed"
        else:
            why = "it changed meanwhile"
        return f"Nothing was saved: {why}. Review the step and save again."
    if isinstance(exc, LockContended):
        return (
            f"Nothing was saved: the step is being changed right now (its lease "
            f"{exc.name!r} is held by {exc.holder or 'another owner'}). Try again shortly."
        )
    if isinstance(exc, LockLost):
        return "Nothing was saved: the step's lease was lost before the commit. Try again."
    if isinstance(exc, LockStoreUnavailable):
        return "Nothing was saved: the lock store (Redis) did not answer. Try again later."
    return f"Nothing was saved: {exc}"
