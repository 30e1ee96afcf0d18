"""StepTransitionGuard: a step's status transition as a Django ORM compare-and-swap.

``transition(step_id, from_, to)`` runs one statement::

    Step.objects.filter(pk=step_id, status=from_, <fence guard>).update(status=to, ...)

One row updated means the transition is applied; none means a conflict (the step left
``from_``, or a newer holder already wrote it), and the caller's transaction must roll back.
This is the fence that makes a duplicate *commit* impossible whatever the Redis lease did
(etcd's ``Mutex.IsOwner()`` inside the write transaction; django-fsm-2's
``ConcurrentTransitionMixin`` for the expected-state CAS and the ``exists()`` follow-up that
tells a missing row from a conflict).

Fence guard: when the model has the fence column (``steplock_fence_field``, default
``lock_fence``) and a fencing token is given, the CAS also requires ``fence IS NULL OR
fence <= token`` and writes the token, so a holder that paused past its TTL cannot write after
a newer holder has, even if the status would match. The owner column (``lock_owner``) records
which execution attempt wrote the row last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist
from django.db.models import Model, Q
from django.utils import timezone

from .exceptions import ImproperlyConfigured, InvalidTransition, StepNotFound, \
    TransitionConflict

__all__ = ["StepTransitionGuard", "TransitionResult", "resolve_model"]


@dataclass(frozen=True)
class TransitionResult:
    """The outcome of one compare-and-swap. Truthy when applied.

    ``current`` is the status read after a conflict (None when applied); ``fence`` the
    fencing token written with the transition, if any.
    """

    applied: bool
    step_id: Any
    from_: str
    to: str
    current: str | None = None
    fence: int | None = None

    def __bool__(self) -> bool:
        return self.applied


def resolve_model(model: type[Model] | str, setting: str = "step_model") -> type[Model]:
    """A model class from a class or an ``"app_label.ModelName"`` string.

    Raises ImproperlyConfigured naming ``setting`` when it cannot be found.
    """
    if isinstance(model, str):
        try:
            return apps.get_model(model)
        except (LookupError, ValueError) as exc:
            raise ImproperlyConfigured(f"{setting}={model!r} is not an installed model "
                                       f"(\"app_label.ModelName\"): {exc}",
                                       setting=setting) from exc
    if isinstance(model, type) and issubclass(model, Model):
        return model
    raise ImproperlyConfigured(f"{setting} must be a Django model or \"app_label.ModelName\", "
                               f"got {model!r}", setting=setting)


def _has_field(model: type[Model], name: str) -> bool:
    try:
        model._meta.get_field(name)
    except FieldDoesNotExist:
        return False
    return True


class StepTransitionGuard:
    """Compare-and-swap transitions of one step model's status field.

    ``model``: model class or ``"app_label.ModelName"``. ``transitions``: optional table
    ``{from_: [to, ...]}`` of allowed transitions (None allows any). ``using``: database alias.
    Raises ImproperlyConfigured when the model or the status field does not exist.
    """

    def __init__(self, model: type[Model] | str, *, status_field: str = "status",
                 transitions: Mapping[str, Iterable[str]] | None = None,
                 owner_field: str = "lock_owner", fence_field: str = "lock_fence",
                 using: str | None = None):
        self.model = resolve_model(model)
        if not _has_field(self.model, status_field):
            raise ImproperlyConfigured(
                f"steplock_status_field={status_field!r} is not a field of "
                f"{self.model._meta.label}", setting="steplock_status_field")
        self.status_field = status_field
        self.owner_field = owner_field if _has_field(self.model, owner_field) else None
        self.fence_field = fence_field if _has_field(self.model, fence_field) else None
        self.auto_now_fields = [f.name for f in self.model._meta.concrete_fields
                                if getattr(f, "auto_now", False)]
        self.transitions = ({k: frozenset(v) for k, v in transitions.items()}
                            if transitions is not None else None)
        self.using = using

    @property
    def manager(self):
        manager = self.model._default_manager
        return manager.using(self.using) if self.using else manager

    def check_allowed(self, from_: str, to: str) -> None:
        """Raise InvalidTransition when ``from_ -> to`` is not in the table."""
        if self.transitions is not None and to not in self.transitions.get(from_, ()):
            raise InvalidTransition(f"{self.model._meta.label}: {from_!r} -> {to!r} is not an "
                                    f"allowed transition", from_=from_, to=to)

    def status(self, step_id: Any) -> str:
        """The step's current status; raises StepNotFound."""
        found = list(self.manager.filter(pk=step_id).values_list(self.status_field,
                                                                 flat=True)[:1])
        current = found[0] if found else None
        if current is None:
            raise StepNotFound(f"{self.model._meta.label} pk={step_id!r} does not exist",
                               step_id=step_id)
        return current

    def set_deadline(self, seconds: float) -> bool:
        """PostgreSQL only: within the current transaction, wait at most ``seconds`` for a row
        lock (``lock_timeout``) and let the server end the session when it sits idle inside
        the transaction for longer (``idle_in_transaction_session_timeout``), both ``SET
        LOCAL``. Called with the lease's remaining validity just before the CAS, it means a
        holder paused after its CAS can no longer COMMIT once its lease may have passed to a
        newer holder, and a stopped holder's row lock does not block the step for longer
        than that. Returns False (and does nothing) on other databases."""
        from django.db import connections

        connection = connections[self.using or self.manager.db]
        if connection.vendor != "postgresql":
            return False
        ms = str(max(1, int(seconds * 1000)))
        with connection.cursor() as cursor:
            cursor.execute("SELECT set_config('lock_timeout', %s, true), "
                           "set_config('idle_in_transaction_session_timeout', %s, true)",
                           [ms, ms])
        return True

    def transition(self, step_id: Any, from_: str, to: str, *, owner: str | None = None,
                   fence: int | None = None, updates: Mapping[str, Any] | None = None,
                   raise_on_conflict: bool = True) -> TransitionResult:
        """Move step ``step_id`` from ``from_`` to ``to`` by compare-and-swap.

        ``owner``/``fence`` are written to (and ``fence`` guards on) the model's owner/fence
        columns when it has them. ``updates`` are extra column values set by the same UPDATE;
        ``auto_now`` columns (``updated_at``) are set to now, as ``save()`` would.
        Returns the TransitionResult. Raises InvalidTransition, StepNotFound, and
        TransitionConflict when nothing matched (unless ``raise_on_conflict`` is False).
        """
        self.check_allowed(from_, to)
        condition = Q(pk=step_id, **{self.status_field: from_})
        values: dict[str, Any] = dict(updates or {})
        values[self.status_field] = to
        if self.fence_field and fence is not None:
            condition &= (Q(**{f"{self.fence_field}__isnull": True})
                          | Q(**{f"{self.fence_field}__lte": fence}))
            values[self.fence_field] = fence
        if self.owner_field and owner is not None:
            values[self.owner_field] = owner
        for column in self.auto_now_fields:
            # QuerySet.update() skips auto_now, which save() would set: keep it meaningful.
            values.setdefault(column, timezone.now())
        if self.manager.filter(condition).update(**values) == 1:
            return TransitionResult(True, step_id, from_, to, fence=fence)
        current = self.status(step_id)
        result = TransitionResult(False, step_id, from_, to, current=current, fence=fence)
        if raise_on_conflict:
            why = (f"its status is {current!r}" if current != from_
                   else "a newer fencing token already wrote it")
            raise TransitionConflict(
                f"{self.model._meta.label} pk={step_id!r}: {from_!r} -> {to!r} refused: {why}",
                step_id=step_id, from_=from_, to=to, current=current)
        return result
