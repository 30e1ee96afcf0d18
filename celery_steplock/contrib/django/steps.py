"""The Django step store: a step's status transition as a compare-and-swap ``UPDATE``.

``DjangoStepStore(model).transition(step_id, from_, to, owner=, fence=)`` runs one statement::

    UPDATE <step table> SET status = to, lock_fence = fence, lock_owner = owner[, auto_now]
     WHERE pk = step_id AND status = from_ AND (lock_fence IS NULL OR lock_fence <= fence)

One row updated means the transition is applied; none means a conflict (the step left
``from_``, or a newer holder already wrote it), and the caller's transaction must roll back.
This is the fence that makes a duplicate *commit* impossible whatever the Redis lease did
(etcd's ``Mutex.IsOwner()`` inside the write transaction; django-fsm-2's
``ConcurrentTransitionMixin`` for the expected-state CAS and the follow-up read that tells a
missing row from a conflict).

Fence guard: when the model has the fence column (``steplock_fence_field``, default
``lock_fence``) and a fencing token is given, the CAS also requires ``fence IS NULL OR
fence <= token`` and writes the token, so a holder that paused past its TTL cannot write after
a newer holder has, even if the status would match (Kleppmann 2016). The owner column
(``lock_owner``) records which execution attempt wrote the row last.

The statements are built once per database and shape from the model's metadata and sent
through a plain cursor: the ORM would compile the same ``UPDATE`` on every call, which cost
more than the statement itself. Extra column values (``updates``) take the ORM path.

Deadline (PostgreSQL): ``transition(..., deadline=s)`` puts ``set_config('lock_timeout', ..)``
and ``set_config('idle_in_transaction_session_timeout', ..)`` (both transaction-local) into
the ``UPDATE``'s own condition. Volatile conditions are evaluated for the row before the
row lock is requested, so the wait for a row held by another transaction is bounded by ``s``
(SQLSTATE 55P03), and a holder that stops after its CAS cannot COMMIT once its lease may have
passed to a newer holder: the server ends the idle session. No statement of its own.

Every call goes to one database, the model's *write* database (``router.db_for_write``) or
the ``using`` it was given (the task option ``step_database`` / the setting
``steplock_step_database``), the precheck and the follow-up read included: a replica's stale
status must never skip or decide a step. A task calls :meth:`DjangoStepStore.bind` once per
execution, so the outer-transaction check, the precheck, the transaction, the
compare-and-swap, its follow-up read, the deadline and ``on_commit`` all go to the alias the
router named at the start of the execution, even for a router whose answer depends on the
context (a tenant, a request).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Iterable, Mapping

from django.apps import apps
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db import (
    DEFAULT_DB_ALIAS,
    InterfaceError,
    InternalError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.db.models import Model, Q
from django.utils import timezone

from ...exceptions import (
    ImproperlyConfigured,
    InvalidStepId,
    InvalidTransition,
    OuterTransactionError,
    StepNotFound,
    TransitionConflict,
)
from ...steps import TransitionResult, check_transitions

__all__ = ["DjangoStepStore", "TransitionResult", "resolve_model"]


def resolve_model(model: type[Model] | str, setting: str = "step_model") -> type[Model]:
    """A model class from a class or an ``"app_label.ModelName"`` string.

    Raises ImproperlyConfigured naming ``setting`` when it cannot be found.
    """
    if isinstance(model, str):
        try:
            return apps.get_model(model)
        except (LookupError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{setting} {model!r} does not exist ({exc}); name an "
                f'installed model as "app_label.ModelName"',
                setting=setting,
            ) from exc
    if isinstance(model, type) and issubclass(model, Model):
        return model
    raise ImproperlyConfigured(
        f'{setting} must be a Django model or "app_label.ModelName", got {model!r}',
        setting=setting,
    )


def _field(model: type[Model], name: str):
    try:
        return model._meta.get_field(name)
    except FieldDoesNotExist:
        return None


class DjangoStepStore:
    """Compare-and-swap transitions of one step model's status field (a
    :class:`~celery_steplock.steps.StepStore`).

    ``model``: model class or ``"app_label.ModelName"``. ``transitions``: optional table
    ``{from_: [to, ...]}`` of allowed transitions (None allows any). ``using``: a database
    alias (a key of ``DATABASES``), default the model's write database per
    ``DATABASE_ROUTERS``, asked again on every call until :meth:`bind` fixes it.
    Raises ImproperlyConfigured when the model or the status field does not exist, or
    ``using`` is not a configured database.
    """

    def __init__(
        self,
        model: type[Model] | str,
        *,
        status_field: str = "status",
        owner_field: str = "lock_owner",
        fence_field: str = "lock_fence",
        transitions: Mapping[str, Iterable[str]] | None = None,
        using: str | None = None,
    ):
        self.model = resolve_model(model)
        meta = self.model._meta
        if _field(self.model, status_field) is None:
            raise ImproperlyConfigured(
                f"step_model {meta.label} has no field {status_field!r} (steplock_status_field)",
                setting="steplock_status_field",
            )
        self.status_field = status_field
        self.owner_field = owner_field if _field(self.model, owner_field) else None
        self.fence_field = fence_field if _field(self.model, fence_field) else None
        self.auto_now_fields = [
            f.name for f in meta.concrete_fields if getattr(f, "auto_now", False)
        ]
        if transitions is not None:
            transitions = check_transitions(transitions)
        self.transitions = (
            {k: frozenset(v) for k, v in transitions.items()} if transitions is not None else None
        )
        if using is not None and using not in connections.settings:
            raise ImproperlyConfigured(
                f"using={using!r} is not a configured database (DATABASES has "
                f"{', '.join(map(repr, connections.settings))})",
                setting="step_database",
            )
        self._using = using
        self._bound: dict[str, DjangoStepStore] = {}
        self._status = meta.get_field(status_field)
        self._fence = meta.get_field(self.fence_field) if self.fence_field else None
        self._owner = meta.get_field(self.owner_field) if self.owner_field else None
        self._auto_now = [meta.get_field(name) for name in self.auto_now_fields]
        # The table the statements write: the one model that holds every column the CAS
        # touches (a multi-table-inheritance parent, when the status lives there; its key
        # has the child's key value). Columns spread over several tables: the ORM's path.
        concrete = meta.concrete_model
        owners = {
            f.model._meta.concrete_model
            for f in (self._status, self._fence, self._owner, *self._auto_now)
            if f
        }
        self._table_model = owners.pop() if len(owners) == 1 else None
        self._pk = (self._table_model or concrete)._meta.pk  # type: ignore[union-attr]
        self.label = concrete._meta.label_lower  # type: ignore[union-attr]
        self._sql: dict[tuple, str] = {}

    @staticmethod
    def models_ready() -> bool:
        """Whether Django's model registry is loaded (the validator judges step models only
        then)."""
        return apps.ready

    # -- where -------------------------------------------------------------------------

    @staticmethod
    def databases() -> tuple[str, ...] | None:
        """The aliases of ``DATABASES`` (None while Django's settings are not configured):
        what a ``using`` may name."""
        from django.conf import settings

        if not settings.configured:
            return None
        return tuple(connections.settings)

    @property
    def using(self) -> str:
        """The database alias every call goes to: the ``using`` given (or fixed by
        :meth:`bind`), else the router's ``db_for_write`` for the model, as it answers
        now."""
        return self._using or router.db_for_write(self.model) or DEFAULT_DB_ALIAS

    def bind(self) -> DjangoStepStore:
        """This store with its database fixed to the alias :attr:`using` names now (itself
        when it was given one): every call of the returned store goes there, whatever the
        router answers later. One store per alias is kept and shares the built statements.
        Raises ImproperlyConfigured when the router names a database that is not in
        ``DATABASES``."""
        if self._using is not None:
            return self
        alias = router.db_for_write(self.model) or DEFAULT_DB_ALIAS
        bound = self._bound.get(alias)
        if bound is None:
            if alias not in connections.settings:
                raise ImproperlyConfigured(
                    f"the database router sends writes of {self.model._meta.label} to "
                    f"{alias!r}, which is not in DATABASES",
                    setting="DATABASE_ROUTERS",
                )
            bound = copy.copy(self)
            bound._using = alias
            bound._bound = {}
            self._bound[alias] = bound
        return bound

    @property
    def manager(self):
        """The model's base manager on :attr:`using`: every row, as the statements see them
        (a default manager that hides rows, e.g. soft-deleted ones, must not make the ORM's
        path and the statements disagree)."""
        return self.model._base_manager.db_manager(self.using)

    def step_ref(self, step_id: Any) -> str:
        """``"<app_label>.<model>:<pk>"`` of the step, the primary key as the database holds
        it (``str(UUID)``, ``5`` for ``"5"``), the concrete model's label: what the reaper
        compares with the rows it reads. Raises InvalidStepId."""
        return f"{self.label}:{self._pk_value(step_id)}"

    def _pk_value(self, step_id: Any) -> Any:
        try:
            return self.model._meta.pk.to_python(step_id)
        except (ValidationError, ValueError, TypeError) as exc:
            message = exc.messages[0] if isinstance(exc, ValidationError) else str(exc)
            raise InvalidStepId(
                f"step id {step_id!r} is not a primary key of {self.model._meta.label}: {message}",
                step_id=step_id,
            ) from exc

    # -- the statements ----------------------------------------------------------------

    def _statement(self, connection, kind: str, fenced: bool, owned: bool, deadline: bool) -> str:
        key = (connection.alias, connection.vendor, kind, fenced, owned, deadline)
        sql = self._sql.get(key)
        if sql is None:
            qn = connection.ops.quote_name
            table = qn(self._table_model._meta.db_table)  # type: ignore[union-attr]
            pk, status = qn(self._pk.column), qn(self._status.column)  # type: ignore[union-attr]
            if kind == "status":
                sql = f"SELECT {status} FROM {table} WHERE {pk} = %s"
            else:
                sets = [f"{status} = %s"]
                where = [f"{pk} = %s", f"{status} = %s"]
                if fenced:
                    fence = qn(self._fence.column)  # type: ignore[union-attr]
                    sets.append(f"{fence} = %s")
                    where.append(f"({fence} IS NULL OR {fence} <= %s)")
                if owned:
                    sets.append(f"{qn(self._owner.column)} = %s")  # type: ignore[union-attr]
                sets += [f"{qn(f.column)} = %s" for f in self._auto_now]  # type: ignore[union-attr]
                if deadline:
                    where.append("set_config('lock_timeout', %s, true) IS NOT NULL")
                    where.append(
                        "set_config('idle_in_transaction_session_timeout', %s, true) IS NOT NULL"
                    )
                sql = f"UPDATE {table} SET {', '.join(sets)} WHERE {' AND '.join(where)}"
            self._sql[key] = sql
        return sql

    @staticmethod
    def _db(field, value: Any, connection) -> Any:
        return field.get_db_prep_value(field.get_prep_value(value), connection, prepared=True)

    def _pk_param(self, step_id: Any, connection) -> Any:
        try:
            return self._db(self._pk, step_id, connection)
        except (ValidationError, ValueError, TypeError):
            self._pk_value(step_id)  # raises InvalidStepId naming the model
            raise

    def status(self, step_id: Any) -> str:
        """The step's current status, read on the write database; raises StepNotFound,
        InvalidStepId."""
        if self._table_model is None:
            found = list(
                self.manager.filter(pk=self._pk_value(step_id)).values_list(
                    self.status_field, flat=True
                )[:1]
            )
            row = (found[0],) if found else None
        else:
            connection = connections[self.using]
            with connection.cursor() as cursor:
                cursor.execute(
                    self._statement(connection, "status", False, False, False),
                    [self._pk_param(step_id, connection)],
                )
                row = cursor.fetchone()
        if row is None or row[0] is None:
            raise StepNotFound(
                f"{self.model._meta.label} pk={step_id!r} does not exist", step_id=step_id
            )
        return row[0]

    def writer(self, step_id: Any, *, event_log: bool = False) -> dict[str, Any]:
        """Who wrote the step row last: ``{"owner": <owner token>, "fence": <fencing
        token>, "task_id": <task id>}`` from the owner and fence columns (each None when
        the model lacks it or the row holds none) and, with ``event_log``, the task id of
        the ``transition_applied`` event of that owner (None when not logged). One
        ``SELECT`` of the row, one of the event log; {} when the model has neither column
        or the row is gone."""
        columns = [c for c in (self.owner_field, self.fence_field) if c]
        if not columns:
            return {}
        row = list(self.manager.filter(pk=self._pk_value(step_id)).values_list(*columns)[:1])
        if not row:
            return {}
        values = dict(zip(columns, row[0]))
        owner = values.get(self.owner_field) if self.owner_field else None
        task_id = None
        if event_log and owner and apps.is_installed("celery_steplock.contrib.django"):
            from .models import LeaseEvent

            task_id = (
                LeaseEvent.objects.using(router.db_for_read(LeaseEvent))
                .filter(event="transition_applied", owner=owner)
                .values_list("task_id", flat=True)
                .first()
            ) or None
        return {
            "owner": owner or None,
            "fence": values.get(self.fence_field) if self.fence_field else None,
            "task_id": task_id,
        }

    def check_allowed(self, from_: str, to: str) -> None:
        """Raise InvalidTransition when ``from_ -> to`` is not in the table."""
        if self.transitions is not None and to not in self.transitions.get(from_, ()):
            raise InvalidTransition(
                f"{self.model._meta.label}: {from_!r} -> {to!r} is not an allowed transition",
                from_=from_,
                to=to,
            )

    def transition(
        self,
        step_id: Any,
        from_: str,
        to: str,
        *,
        owner: str | None = None,
        fence: int | None = None,
        updates: Mapping[str, Any] | None = None,
        deadline: float | None = None,
        raise_on_conflict: bool = True,
    ) -> TransitionResult:
        """Move step ``step_id`` from ``from_`` to ``to`` by compare-and-swap.

        ``owner``/``fence`` are written to (and ``fence`` guards on) the model's owner/fence
        columns when it has them. ``updates`` are extra column values set by the same UPDATE
        (through the ORM); ``auto_now`` columns (``updated_at``) are set to now, as
        ``save()`` would. ``deadline`` (seconds): see the module docstring; ignored on
        databases other than PostgreSQL. Returns the TransitionResult. Raises
        InvalidTransition, StepNotFound, and TransitionConflict when nothing matched
        (unless ``raise_on_conflict`` is False).
        """
        self.check_allowed(from_, to)
        connection = connections[self.using]
        fenced = self._fence is not None and fence is not None
        owned = self._owner is not None and owner is not None
        with_deadline = deadline is not None and connection.vendor == "postgresql"
        if updates or self._table_model is None:
            if with_deadline:
                self.set_deadline(deadline)  # type: ignore[arg-type]
            applied = self._orm_update(
                self._pk_value(step_id),
                from_,
                to,
                owner if owned else None,
                fence if fenced else None,
                updates or {},
            )
        else:
            params = [self._db(self._status, to, connection)]
            if fenced:
                params.append(fence)
            if owned:
                params.append(self._db(self._owner, owner, connection))
            if self._auto_now:
                now = timezone.now()
                params += [self._db(f, now, connection) for f in self._auto_now]
            params += [
                self._pk_param(step_id, connection),
                self._db(self._status, from_, connection),
            ]
            if fenced:
                params.append(fence)
            if with_deadline:
                ms = str(max(1, int(deadline * 1000)))  # type: ignore[operator]
                params += [ms, ms]
            with connection.cursor() as cursor:
                cursor.execute(
                    self._statement(connection, "cas", fenced, owned, with_deadline), params
                )
                applied = cursor.rowcount == 1
        if applied:
            return TransitionResult(True, step_id, from_, to, fence=fence)
        current = self.status(step_id)
        result = TransitionResult(False, step_id, from_, to, current=current, fence=fence)
        if raise_on_conflict:
            stale_fence = fenced and current == from_
            why = (
                f"its status is {current!r}"
                if current != from_
                else "a newer fencing token already wrote it"
                if stale_fence
                else "it changed meanwhile"
            )
            raise TransitionConflict(
                f"{self.model._meta.label} pk={step_id!r}: {from_!r} -> {to!r} refused: {why}",
                step_id=step_id,
                from_=from_,
                to=to,
                current=current,
                stale_fence=stale_fence,
            )
        return result

    def _orm_update(self, step_id, from_, to, owner, fence, updates) -> bool:
        condition = Q(pk=step_id, **{self.status_field: from_})
        values: dict[str, Any] = dict(updates)
        values[self.status_field] = to
        if fence is not None:
            condition &= Q(**{f"{self.fence_field}__isnull": True}) | Q(
                **{f"{self.fence_field}__lte": fence}
            )
            values[self.fence_field] = fence  # type: ignore[index]
        if owner is not None:
            values[self.owner_field] = owner  # type: ignore[index]
        for column in self.auto_now_fields:
            # QuerySet.update() skips auto_now, which save() would set: keep it meaningful.
            values.setdefault(column, timezone.now())
        return self.manager.filter(condition).update(**values) == 1

    def set_deadline(self, seconds: float) -> bool:
        """PostgreSQL only, as its own statement: within the current transaction, wait at most
        ``seconds`` for a row lock and let the server end the session when it sits idle inside
        the transaction for longer (both ``SET LOCAL``). ``transition(deadline=)`` does the
        same inside its ``UPDATE``. Returns False (and does nothing) on other databases."""
        connection = connections[self.using]
        if connection.vendor != "postgresql":
            return False
        ms = str(max(1, int(seconds * 1000)))
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('lock_timeout', %s, true), "
                "set_config('idle_in_transaction_session_timeout', %s, true)",
                [ms, ms],
            )
        return True

    # -- the transaction ---------------------------------------------------------------

    def atomic(self):
        """``transaction.atomic(durable=True)`` on :attr:`using`: the commit really happens
        when the block exits, before the lease is released."""
        return transaction.atomic(using=self.using, durable=True)

    def on_commit(self, func: Callable[[], None]) -> None:
        transaction.on_commit(func, using=self.using)

    def savepoint(self):
        """``transaction.atomic()`` on :attr:`using`, nested in the caller's transaction (a
        savepoint): what an eager execution inside the caller's block runs in."""
        return transaction.atomic(using=self.using)

    def in_outer_transaction(self) -> bool:
        """Whether :attr:`using` is inside a caller's ``transaction.atomic()`` (Django's
        TestCase blocks do not count, as ``atomic(durable=True)`` does not count them)."""
        connection = transaction.get_connection(self.using)
        return bool(
            connection.in_atomic_block
            and connection.atomic_blocks
            and not getattr(connection.atomic_blocks[-1], "_from_testcase", False)
        )

    def check_not_nested(self, task_name: str) -> None:
        """Refuse to run inside an outer ``transaction.atomic()`` (ATOMIC_REQUESTS, a caller's
        own block): its commit would come after our release. Django's TestCase blocks are
        allowed, as ``atomic(durable=True)`` allows them."""
        if self.in_outer_transaction():
            raise OuterTransactionError(
                f"{task_name} was called inside transaction.atomic(): its transition would "
                f"commit after the lease is released. Call it outside the block, or with "
                f"delay_on_commit()/apply_async() (DjangoStepLockedTask)."
            )

    # -- errors ------------------------------------------------------------------------

    @staticmethod
    def is_lock_timeout(exc: BaseException) -> bool:
        """PostgreSQL's lock_not_available (SQLSTATE 55P03), as raised through Django."""
        cause = exc.__cause__
        return (
            getattr(cause, "sqlstate", None) == "55P03"
            or getattr(cause, "pgcode", None) == "55P03"
        )

    @staticmethod
    def is_lost_connection(exc: BaseException) -> bool:
        """A database error that means the connection broke (Django's OperationalError or
        InterfaceError, or PostgreSQL's idle-in-transaction timeout, SQLSTATE 25P03, which
        Django raises as InternalError), as opposed to a refused statement."""
        if isinstance(exc, InternalError):
            return (
                getattr(exc.__cause__, "sqlstate", None) == "25P03"
                or getattr(exc.__cause__, "pgcode", None) == "25P03"
            )
        return isinstance(exc, (OperationalError, InterfaceError))


class StepTransitionGuard(DjangoStepStore):
    """Deprecated alias of :class:`DjangoStepStore` (``celery_steplock.guard``, one release)."""

    def __init__(self, model: Any, **kwargs: Any):
        warnings.warn(
            "celery_steplock.guard.StepTransitionGuard is deprecated; use "
            "celery_steplock.contrib.django.steps.DjangoStepStore",
            DeprecationWarning,
            stacklevel=2,
        )
        super().__init__(model, **kwargs)
