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

Writers outside Celery (views, the admin, management commands, serializers):
:func:`guarded_transition` (one transition) and :func:`guarded_step` (a ``with`` block) run a
task's flow without the task: the lease of the step's lock name (:func:`step_lock_name`: the
one its tasks take), the fenced compare-and-swap in a durable transaction, the ownership check
before COMMIT, the release after it, and a task's signals and outcomes. A plain ``save()``
writes the status and the fence back as it loaded them (docs/howto/external-writers.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import logging
import math
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.apps import apps
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    InternalError,
    OperationalError,
    connections,
    router,
    transaction,
)
from django.db.models import Model, Q
from django.utils import timezone

from ... import effects, signals, tracing
from ..._checks import (
    MAX_WAIT,
    MIN_RENEWAL_INTERVAL,
    check_choice,
    check_seconds,
    check_ttl,
    shown,
)
from ...conf import Settings
from ...events import emit, lease_fields
from ...exceptions import (
    ImproperlyConfigured,
    InvalidArgument,
    InvalidStepId,
    InvalidTransition,
    LockContended,
    LockStoreUnavailable,
    OuterTransactionError,
    StepNotFound,
    TransitionConflict,
)
from ...execution import fenced_cas
from ...heartbeat import announce_lost, get_heartbeat
from ...keys import bind_arguments, check_name, name_from_arguments, template_fields
from ...lock import _released as released_after_commit
from ...lock import get_lease_store, holder_metadata, new_owner_token, release_after_commit
from ...plan import is_step_locked
from ...steps import TransitionResult, check_transitions

__all__ = [
    "DjangoStepStore",
    "TransitionResult",
    "resolve_model",
    "GuardedStep",
    "guarded_step",
    "guarded_transition",
    "AsyncGuardedStep",
    "aguarded_step",
    "aguarded_transition",
    "step_lock_name",
    "DEFAULT_ACTOR",
]


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
        #: The owner column's max_length (None: none): a column sized for the 32-character
        #: tokens of earlier versions gets tokens of that form (no committed_by from the row).
        self.owner_max_length = getattr(self._owner, "max_length", None)
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
            elif kind == "latest":
                sql = f"SELECT {status} FROM {table} WHERE {pk} = %s FOR UPDATE"
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
        return self._read_status(step_id, latest=False)

    @staticmethod
    def _snapshot_reads(connection) -> bool:
        """Whether a plain read in the current transaction may see a snapshot older than the
        latest committed row: inside a transaction on MySQL/MariaDB, whose REPEATABLE READ
        (InnoDB's default) reads the snapshot of its first read. PostgreSQL's does not
        matter here: at READ COMMITTED a plain read sees the latest row, and at REPEATABLE
        READ an ``UPDATE`` of a row changed after the snapshot fails to serialize (40001)
        before any read; a locking read there would only wait on others' row locks."""
        return bool(connection.in_atomic_block and connection.vendor == "mysql")

    def _read_status(self, step_id: Any, *, latest: bool) -> str:
        connection = connections[self.using]
        # A locking read (SELECT ... FOR UPDATE) reads the latest committed row and waits for
        # a transaction that holds it.
        latest = (
            latest and connection.in_atomic_block and connection.features.has_select_for_update
        )
        if self._table_model is None:
            rows = self.manager.filter(pk=self._pk_value(step_id))
            if latest:
                rows = rows.select_for_update()
            found = list(rows.values_list(self.status_field, flat=True)[:1])
            row = (found[0],) if found else None
        else:
            with connection.cursor() as cursor:
                cursor.execute(
                    self._statement(
                        connection, "latest" if latest else "status", False, False, False
                    ),
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
        rows = self.manager.filter(pk=self._pk_value(step_id))
        if self._snapshot_reads(connections[self.using]):
            rows = rows.select_for_update()  # the latest row, not a snapshot's
        row = list(rows.values_list(*columns)[:1])
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
        # The UPDATE read the latest committed row; a plain SELECT of a REPEATABLE READ
        # transaction (MySQL's default) would read its snapshot, where the status a rival
        # just committed is still ``from_``: a plain conflict would look like a newer
        # fencing token. PostgreSQL at REPEATABLE READ raises a serialization failure here.
        current = self._read_status(step_id, latest=self._snapshot_reads(connection))
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

    def settled_status(self, step_id: Any, wait: float) -> str:
        """After the step's transaction rolled back: the step's status once a transaction
        that holds its row (the one that won a deadlock) has ended, in a short transaction
        of its own. A locking read waits for that holder at most ``wait`` seconds (the row
        lock wait bound of PostgreSQL and MySQL); when it cannot say (the wait ran out, a
        serialization failure of REPEATABLE READ), a plain read outside any transaction.

        Args:
            step_id: The step.
            wait: Seconds the read may wait for a row lock (at least 1 on MySQL).

        Returns:
            The step's status as last committed.

        Raises:
            StepNotFound: No such step.
            InvalidStepId: ``step_id`` is no key of the model.
        """
        connection = connections[self.using]
        if connection.features.has_select_for_update and not connection.in_atomic_block:
            try:
                with (
                    transaction.atomic(using=self.using),
                    self._row_lock_wait(connection, wait),
                ):
                    return self._read_status(step_id, latest=True)
            except DatabaseError as exc:  # the plain read below decides
                if not (self.is_transient_conflict(exc) or self.is_lock_timeout(exc)):
                    raise
        return self.status(step_id)

    @contextlib.contextmanager
    def _row_lock_wait(self, connection, seconds: float) -> Iterator[None]:
        """Bound the row lock waits of the current transaction: PostgreSQL's
        transaction-local ``lock_timeout``; MySQL's session ``innodb_lock_wait_timeout``
        (whole seconds), put back afterwards."""
        if connection.vendor == "postgresql":
            self.set_deadline(seconds)
            yield
            return
        if connection.vendor != "mysql":
            yield
            return
        with connection.cursor() as cursor:
            cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
            saved = cursor.fetchone()[0]
            cursor.execute(
                "SET SESSION innodb_lock_wait_timeout = %s", [max(1, math.ceil(seconds))]
            )
        try:
            yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute("SET SESSION innodb_lock_wait_timeout = %s", [saved])

    # -- the transaction ---------------------------------------------------------------

    def atomic(self) -> StepTransaction:
        """``transaction.atomic(durable=True)`` on :attr:`using`: the commit really happens
        when the block exits, before the lease is released. A deadlock or serialization
        failure inside it ends it, even when the code inside caught the error
        (:class:`StepTransaction`)."""
        return StepTransaction(self)

    def on_commit(self, func: Callable[[], None]) -> None:
        transaction.on_commit(func, using=self.using)

    # -- the effects outbox ------------------------------------------------------------

    def write_effects(
        self,
        declared: list[Any],
        *,
        step: str,
        fence: int | None,
        key_base: str,
        owner: str,
        task_id: str,
        task_name: str,
    ) -> list[int]:
        """Write declared effects (:class:`celery_steplock.effects.Declared`) as rows of the
        outbox on :attr:`using`, inside the step's transaction (one ``bulk_create``; the
        key of each is ``f"{key_base}:{position}"``). Returns their ids.
        :func:`celery_steplock.contrib.django.outbox.write` does it."""
        from . import outbox

        ids: list[int] = outbox.write(
            self.using,
            declared,
            step=step,
            fence=fence,
            key_base=key_base,
            owner=owner,
            task_id=task_id,
            task_name=task_name,
            max_attempts=None,
        )
        return ids

    def effect_scope(self) -> Callable[[], bool] | None:
        """Called at each effect declaration (:class:`celery_steplock.effects.Outbox`):
        a callable telling, when the effects are written, whether the savepoints open at
        the declaration still stand; None outside a transaction on :attr:`using` (an async
        block's own thread among them: nothing to roll back there).

        It rides Django's own bookkeeping: a no-op ``on_commit`` marker registered now is
        dropped by Django when a savepoint around it rolls back (as the block's other
        on-commit callbacks are), so "the marker is still queued" is "the work around the
        declaration still stands"."""
        connection = transaction.get_connection(self.using)
        if not connection.in_atomic_block:
            return None

        def marker() -> None:  # runs (doing nothing) at COMMIT
            return None

        connection.on_commit(marker)
        return lambda: any(entry[1] is marker for entry in connection.run_on_commit)

    def dispatch_effects(self, ids: list[int]) -> None:
        """Send the effects of rows ``ids`` at once (called on commit of the transaction
        that wrote them); never raises: what is not sent stays pending for the relay
        (:func:`celery_steplock.contrib.django.outbox.dispatch`)."""
        try:
            from . import outbox

            outbox.dispatch(self.using, ids)
        except Exception:  # noqa: BLE001 - the rows stay pending: the relay sends them
            pass

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
    def error_code(exc: BaseException) -> str | None:
        """The database's own code of an error raised through Django: PostgreSQL's SQLSTATE
        (``"40001"``), MySQL's error number as text (``"1213"``); None for anything else."""
        if not isinstance(exc, DatabaseError):
            return None
        cause = exc.__cause__
        code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        if code:
            return str(code)
        args = getattr(cause, "args", None)
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return str(args[0])  # MySQLdb / PyMySQL: (errno, message)
        return None

    @classmethod
    def is_lock_timeout(cls, exc: BaseException) -> bool:
        """The wait for a row lock ran out: PostgreSQL's lock_not_available (SQLSTATE 55P03,
        the deadline's ``lock_timeout``) or MySQL's lock wait timeout (1205,
        ``innodb_lock_wait_timeout``), as raised through Django."""
        return cls.error_code(exc) in LOCK_TIMEOUT_CODES

    @classmethod
    def is_transient_conflict(cls, exc: BaseException) -> bool:
        """The database gave up the transaction for another one's sake, and a new attempt
        may succeed: a deadlock (PostgreSQL SQLSTATE 40P01, MySQL 1213) or a serialization
        failure (PostgreSQL 40001; MariaDB's 1020, "Record has changed since last read",
        with ``innodb_snapshot_isolation``), as raised through Django."""
        return cls.error_code(exc) in TRANSIENT_CONFLICT_CODES

    @classmethod
    def is_lost_connection(cls, exc: BaseException) -> bool:
        """A database error that means the connection broke (Django's OperationalError or
        InterfaceError, or PostgreSQL's idle-in-transaction timeout, SQLSTATE 25P03, which
        Django raises as InternalError), as opposed to a refused statement: a deadlock, a
        serialization failure or a lock wait timeout (OperationalError too) is not one."""
        code = cls.error_code(exc)
        if isinstance(exc, InternalError):
            return code == "25P03"
        if code in TRANSIENT_CONFLICT_CODES or code in LOCK_TIMEOUT_CODES:
            return False
        return isinstance(exc, (OperationalError, InterfaceError))

    def connection_unusable(self) -> bool:
        """Whether :attr:`using`'s connection is closed or no longer answers (Django's
        ``is_usable``: a round trip); never raises (an error asking is an answer)."""
        try:
            connection = connections[self.using]
            return connection.connection is None or not connection.is_usable()
        except Exception:  # noqa: BLE001 - it could not even be asked
            return True

    def close_if_unusable(self) -> None:
        """Close :attr:`using`'s connection when it broke (outside a transaction only: a
        caller's is the caller's), so that what runs next in this thread (an eager retry,
        the next task of a thread pool) opens a fresh one; Django otherwise does it at the
        end of a request or task. Never raises."""
        try:
            connection = connections[self.using]
            if not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()
        except Exception:  # noqa: BLE001 - a broken connection may refuse even its close
            pass


#: Codes of :meth:`DjangoStepStore.is_lock_timeout`: PostgreSQL's SQLSTATE, MySQL's errno.
LOCK_TIMEOUT_CODES = frozenset({"55P03", "1205"})
#: Codes of :meth:`DjangoStepStore.is_transient_conflict`: deadlocks and serialization
#: failures (PostgreSQL 40001, 40P01; MySQL/MariaDB 1213, 1020).
TRANSIENT_CONFLICT_CODES = frozenset({"40001", "40P01", "1213", "1020"})
#: The databases whose errors can carry one of those codes.
_TRANSIENT_CONFLICT_VENDORS = frozenset({"postgresql", "mysql"})


class StepTransaction:
    """The step's transaction: ``transaction.atomic(durable=True)`` on the store's database
    that remembers a deadlock or serialization failure (:meth:`DjangoStepStore.is_transient_conflict`)
    raised by any statement inside it, caught or not.

    The database already rolled the transaction back (MySQL/MariaDB: all of it) or aborted it
    (PostgreSQL), but Django's ``atomic`` learns of it only from an error that leaves the
    block. Code that catches the error and goes on would, on MySQL, run the rest (the
    compare-and-swap included) in a new transaction and commit it without the writes before
    the error. So once one was raised, every later statement raises it again, and the block
    rolls back and raises it at its end instead of committing.
    """

    __slots__ = ("store", "error", "_atomic", "_watching")

    def __init__(self, store: DjangoStepStore):
        self.store = store
        self.error: BaseException | None = None
        self._atomic = transaction.atomic(using=store.using, durable=True)
        self._watching: Any = None

    def __enter__(self) -> StepTransaction:
        self._atomic.__enter__()
        connection = connections[self.store.using]
        if connection.vendor not in _TRANSIENT_CONFLICT_VENDORS:
            return self  # no such error there (SQLite): no wrapper on every statement
        try:
            self._watching = connection.execute_wrapper(self._watch)
            self._watching.__enter__()
        except BaseException as exc:
            self._atomic.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _watch(self, execute, sql, params, many, context):
        if self.error is not None:
            raise self.error
        try:
            return execute(sql, params, many, context)
        except DatabaseError as exc:
            if self.store.is_transient_conflict(exc):
                self.error = exc
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._watching is not None:
            self._watching.__exit__(None, None, None)
        if exc_type is None and self.error is not None:
            error = self.error
            self._atomic.__exit__(type(error), error, error.__traceback__)
            raise error
        self._atomic.__exit__(exc_type, exc, tb)


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


# -- writers outside Celery ------------------------------------------------------------------

#: Who writes, when a guarded transition's caller names no ``actor``: stored as the lease's
#: ``task_name`` (the admin's "Held leases" page, a contended task's message) and sent as the
#: signals' ``task_name``.
DEFAULT_ACTOR = "guarded_transition"

#: What :func:`guarded_transition` accepts as ``on_conflict``.
ON_CONFLICT = ("raise", "return")


def _celery_app(app: Any) -> Any:
    if app is not None:
        return app
    from .leases import celery_app

    return celery_app()


def _step_locked_task(task: Any, app: Any) -> Any:
    """``task`` (a StepLockedTask, or the name of one of ``app``'s tasks) as a task."""
    if isinstance(task, str):
        from .leases import import_task_modules

        import_task_modules(app)
        try:
            task = app.tasks[task]
        except KeyError:
            raise ImproperlyConfigured(
                f"task={task!r} is not a task of the Celery app {app.main!r}", setting="task"
            ) from None
    if not is_step_locked(task):
        raise ImproperlyConfigured(
            f"task={shown(task)} is not a StepLockedTask: only a StepLockedTask names the "
            f"lease of a step",
            setting="task",
        )
    return task


def _same_model(spec: Any, model: type[Model]) -> bool:
    try:
        other = resolve_model(spec)
    except ImproperlyConfigured:
        return False
    return other._meta.label_lower == model._meta.label_lower


def _pk_of(model: type[Model], pk: Any) -> Any:
    try:
        return model._meta.pk.to_python(pk)
    except (ValidationError, ValueError, TypeError) as exc:
        message = exc.messages[0] if isinstance(exc, ValidationError) else str(exc)
        raise InvalidStepId(
            f"step id {pk!r} is not a primary key of {model._meta.label}: {message}",
            step_id=pk,
        ) from exc


def step_lock_name(
    model: type[Model] | str,
    pk: Any,
    *,
    task: Any = None,
    arguments: Mapping[str, Any] | None = None,
    app: Any = None,
) -> str:
    """The lock name a StepLockedTask takes for step ``pk``: the lease a writer outside
    Celery must hold to exclude that task.

    A task's lock name comes from its arguments (:func:`celery_steplock.keys.lock_name`), so
    it is derivable from the step alone only when its ``lock_key`` is a template naming no
    argument but ``step_id_arg`` (``"step:{step_id}"``). With ``task``, the name that task
    takes for a call with ``step_id_arg=pk`` and ``arguments`` (defaults applied) is
    returned, whatever its ``lock_key``; without it, the name every such template task of
    ``app`` with this ``step_model`` agrees on.

    Args:
        model: The step model, or ``"app_label.ModelName"``.
        pk: The step's primary key (converted as the model's key field does: ``"5"`` and
            ``5`` name the same lease of an integer key).
        task: A StepLockedTask, or the name of one of ``app``'s tasks.
        arguments: With ``task``, its other arguments (those its ``lock_key`` reads).
        app: The Celery app; default the task's, else ``celery.current_app``.

    Returns:
        The lock name.

    Raises:
        ImproperlyConfigured: ``task`` is no StepLockedTask of this model (naming
            ``task``), or no single name is derivable without it (naming ``lock_name``:
            pass it, or ``task``).
        LockNameError: The task's ``lock_key`` cannot name a lock from these arguments.
        InvalidStepId: ``pk`` is not a key of the model.
    """
    model = resolve_model(model, setting="model")
    pk = _pk_of(model, pk)
    if task is not None:
        task = _step_locked_task(task, app if app is not None else _celery_app(None))
        plan = task.steplock_plan
        if not _same_model(task.step_model, model) or plan.step_id_arg is None:
            raise ImproperlyConfigured(
                f"task {task.name} does not guard {model._meta.label} steps (its step_model "
                f"is {shown(task.step_model)}, its step_id_arg {shown(plan.step_id_arg)})",
                setting="task",
            )
        bound = bind_arguments(task.run, (), {**(arguments or {}), plan.step_id_arg: pk})
        return name_from_arguments(task.name, bound, plan.lock_key, secret=plan.store.name_secret)
    app = _celery_app(app)
    from .leases import import_task_modules

    import_task_modules(app)
    names: dict[str, list[str]] = {}
    opaque: list[str] = []
    for name, candidate in sorted(app.tasks.items()):
        if not is_step_locked(candidate) or not _same_model(candidate.step_model, model):
            continue
        try:
            plan = candidate.steplock_plan
        except ImproperlyConfigured:
            continue  # E004 reports it
        key = plan.lock_key
        if (
            plan.step_id_arg is not None
            and isinstance(key, str)
            and set(template_fields(key)) <= {plan.step_id_arg}
        ):
            lock = name_from_arguments(name, {plan.step_id_arg: pk}, key)
            names.setdefault(lock, []).append(name)
        else:
            opaque.append(name)
    if len(names) == 1:
        return next(iter(names))
    found = "; ".join(f"{n!r} by {', '.join(t)}" for n, t in names.items()) or "none"
    raise ImproperlyConfigured(
        f"cannot derive the lock name of {model._meta.label} pk={pk!r}: the StepLockedTasks "
        f"of the Celery app {app.main!r} whose lock_key names only the step give {found}"
        + (f" (not derivable from the step alone: {', '.join(opaque)})" if opaque else "")
        + "; pass lock_name=, or task= to take the name that task uses",
        setting="lock_name",
    )


class GuardedStep:
    """One step held under its lease by code outside Celery (a view, the admin, a command).

    Made by :func:`guarded_step`; ``with`` it, the flow is a task's: the lease is acquired
    (``lock_acquired``, or ``lock_contended`` and LockContended), renewed by the process's
    heartbeat, a durable transaction opened; the block's :meth:`transition` calls are the
    fenced compare-and-swaps; on leaving, the lease is checked in Redis before COMMIT, and
    released after it. An exception in the block, a conflict, a lost lease or an outage at
    the check rolls everything back: nothing is half-applied.

    It is the sender of the signals it sends (``sender.step_model`` and ``sender.app`` are
    what the event log reads).

    Attributes:
        step_model: The step model.
        step_id: The step's primary key, as the model's key field converts it.
        lock_name: The lock name.
        actor: Who writes (the lease's and the signals' ``task_name``).
        steps: The step store, bound to one database.
        app: The Celery app whose settings and lease store are used.
        steplock_settings: Its settings.
        ttl: The lease TTL, seconds.
        wait: Seconds to wait for a busy lease.
        lease: The lease while held (None before and after).
        results: The transitions applied in the block.
        outbox: The effects declared in the block (:mod:`celery_steplock.effects`; None
            before it): written after its transitions, before the ownership check and
            COMMIT, sent once it commits; an exception, a conflict or a lost lease leaves
            none.
    """

    def __init__(
        self,
        *,
        steps: DjangoStepStore,
        step_id: Any,
        lock_name: str,
        store: Any,
        settings: Any,
        app: Any,
        actor: str,
        ttl: float,
        wait: float,
    ) -> None:
        self.steps = steps
        self.step_model = steps.model
        self.step_id = step_id
        self.lock_name = lock_name
        self.store = store
        self.steplock_settings = settings
        self.app = app
        self.actor = actor
        self.ttl = ttl
        self.wait = wait
        self.lease: Any = None
        self.results: list[TransitionResult] = []
        self.outbox: effects.Outbox | None = None
        self._collecting: Any = None
        self._committing: Any = None
        self._deadline_set = False
        self._used = False

    def __repr__(self) -> str:
        return f"<GuardedStep {self.steps.label}:{self.step_id} lock {self.lock_name!r}>"

    def _fields(self) -> dict[str, Any]:
        return {
            "key": self.store.key(self.lock_name),
            "name": self.lock_name,
            "owner": None,
            "fence": None,
            "task_id": None,
            "task_name": self.actor,
            "ttl": self.ttl,
        }

    def __enter__(self) -> GuardedStep:
        self._first_use()
        self._check_outer()
        settings = self.steplock_settings
        started = time.monotonic()
        try:
            lease = self.store.acquire(
                self.lock_name,
                new_owner_token(),
                self.ttl,
                wait=self.wait,
                metadata=self._metadata(),
            )
        except LockStoreUnavailable as exc:
            self._store_error(exc, self._fields())
            raise
        waited = time.monotonic() - started
        if lease is None:
            raise self._contended(waited, self._holder(self.store.inspect))
        self.lease = lease
        # Renewed before any receiver of lock_acquired runs (a slow one must not let the
        # lease expire), as a task's (StepLockedTask._acquire).
        get_heartbeat().register(
            lease,
            self.store,
            ratio=settings.renewal_ratio,
            sender=self,
            max_hold=settings.max_hold,
        )
        emit(
            signals.lock_acquired, self, logging.DEBUG, wait_seconds=waited, **lease_fields(lease)
        )
        try:
            self._open()
        except BaseException:
            self._end()
            raise
        self._collect()
        return self

    def _first_use(self) -> None:
        if self._used:
            raise InvalidArgument("a GuardedStep is entered once", argument="step")
        self._used = True

    def _check_outer(self) -> None:
        if self.steps.in_outer_transaction():
            raise OuterTransactionError(
                f"a guarded transition of {self.steps.label}:{self.step_id} was called inside "
                f"transaction.atomic() on {self.steps.using!r}: its commit would come after "
                f"the lease is released. Call it outside the block (a view under "
                f"ATOMIC_REQUESTS: decorate it with transaction.non_atomic_requests)."
            )

    def _metadata(self) -> dict[str, Any]:
        renew = max(self.ttl * self.steplock_settings.renewal_ratio, MIN_RENEWAL_INTERVAL)
        return holder_metadata(
            None,
            self.actor,
            None,
            step=self.steps.step_ref(self.step_id),
            renew_ms=int(renew * 1000),
        )

    def _open(self) -> None:
        """Open the durable transaction (the lease is held)."""
        committing = tracing.committing(self.steps.atomic(), self.steps)
        committing.__enter__()
        self._committing = committing

    def _collect(self) -> None:
        """Make the block's outbox the current one, in the block's own context (the
        caller's: an async block's hops run in a copy of it)."""
        self.outbox = effects.Outbox(scope=getattr(self.steps, "effect_scope", None))
        if not isinstance(self, AsyncGuardedStep):
            # The sync block sends its effects after its release (__exit__); the async one
            # at COMMIT, on the block's thread (its connections are closed at the release).
            self.outbox.hold_dispatch()
        collecting = effects.collecting(self.outbox)
        collecting.__enter__()
        self._collecting = collecting

    def _uncollect(self) -> None:
        collecting, self._collecting = self._collecting, None
        if collecting is not None:
            collecting.__exit__(None, None, None)

    def _write_effects(self) -> None:
        """Inside the transaction, after the block's transitions, before the ownership
        check: the block's effects written, dispatched on commit
        (:func:`celery_steplock.effects.write_declared`)."""
        lease, last = self.lease, (self.results[-1] if self.results else None)
        if self.outbox is None:
            return
        effects.write_declared(
            self.outbox,
            self.steps,
            step_id=self.step_id,
            to=last.to if last is not None else None,
            fence=lease.fence,
            tag="",
            owner=lease.owner,
            task_id=None,
            task_name=self.actor,
            on_commit=lambda send: tracing.after_commit(self.steps, send),
        )

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: Any,
    ) -> Literal[False]:
        committing, self._committing = self._committing, None
        self._uncollect()
        try:
            if exc_type is not None:
                committing.__exit__(exc_type, exc, tb)  # ROLLBACK
                return False
            try:
                self._write_effects()
                self._check_owned()
            except BaseException as error:
                committing.__exit__(type(error), error, error.__traceback__)
                raise
            committing.__exit__(None, None, None)  # COMMIT (a failure raises: nothing applied)
            return False
        finally:
            self._end()
            if self.outbox is not None:
                self.outbox.release_dispatch()  # sent once the lease is released

    def status(self) -> str:
        """The step's status now, read in the block's transaction. Raises StepNotFound."""
        return self.steps.status(self.step_id)

    def transition(self, from_: str, to: str, **updates: Any) -> TransitionResult:
        """Move the step from ``from_`` to ``to`` by the fenced compare-and-swap, inside the
        block's transaction (committed when the block ends well).

        Args:
            from_: The status the step must still have.
            to: The status to write.
            **updates: Extra column values written by the same statement.

        Returns:
            The applied :class:`~celery_steplock.steps.TransitionResult` (the conflicts
            raise).

        Raises:
            TransitionConflict: The step left ``from_`` (``transition_conflict`` sent).
            LockLost: The lease is lost, or the row carries a newer fencing token.
            LockContended: The row stayed locked by another transaction past the lease's
                validity (PostgreSQL, ``steplock_db_deadline``).
            InvalidTransition: ``from_ -> to`` is not in the transition table.
            StepNotFound: The row is gone.
            InvalidArgument: Called outside the ``with`` block.
        """
        return self._transition(from_, to, updates, final=False)

    def _transition(
        self, from_: str, to: str, updates: Mapping[str, Any], *, final: bool
    ) -> TransitionResult:
        lease = self.lease
        if lease is None or self._committing is None:
            raise InvalidArgument(
                "GuardedStep.transition() runs inside `with guarded_step(...) as step:`",
                argument="step",
            )
        lease.check()
        deadline = None
        if final and self.steplock_settings.db_deadline:
            # From here to COMMIT the transaction lives no longer than the lease may.
            deadline = lease.remaining()
            self._deadline_set = connections[self.steps.using].vendor == "postgresql"
        result = fenced_cas(
            self,
            self.steps,
            self.step_id,
            from_,
            to,
            lease=lease,
            fields=lease_fields(lease),
            updates=updates,
            deadline=deadline,
            level=logging.INFO,  # a block's outcome is its INFO line; the lease's are DEBUG
        )
        self.results.append(result)
        return result

    def _check_owned(self) -> None:
        """Before COMMIT: the deadline (unless the last CAS carried it), local validity,
        then one round trip to Redis."""
        lease = self._before_owned()
        try:
            left = self.store.owned(lease.name, lease.owner)
        except LockStoreUnavailable as exc:
            self._store_error(exc, lease_fields(lease))
            raise
        self._after_owned(left)

    def _before_owned(self) -> Any:
        lease = self.lease
        lease.check()
        if self.steplock_settings.db_deadline and not self._deadline_set:
            self.steps.set_deadline(lease.remaining())
        return lease

    def _after_owned(self, left: float | None) -> None:
        if left is None:
            lease = self.lease
            lease.mark_lost("pre-commit check found the key gone or held by another owner")
            lease.check()

    def _store_error(self, exc: LockStoreUnavailable, fields: dict[str, Any]) -> None:
        # Fail closed: a writer outside Celery has no retry of its own to fall back on.
        emit(
            signals.lock_store_error,
            self,
            logging.ERROR,
            reason=str(exc),
            policy="fail_closed",
            **fields,
        )

    def _holder(self, inspect: Callable[[str], Any]) -> dict[str, Any]:
        try:
            return inspect(self.lock_name) or {}
        except LockStoreUnavailable:
            return {}

    def _contended(self, waited: float, info: dict[str, Any]) -> LockContended:
        fields = self._fields()
        emit(
            signals.lock_contended,
            self,
            holder=info.get("owner"),
            wait_seconds=waited,
            **fields,
        )
        who = info.get("owner") or "another owner (released since)"
        if info.get("task_name"):
            who = f"{who} ({info['task_name']})"
        return LockContended(
            f"{self.lock_name!r} is held by {who}",
            key=fields["key"],
            holder=info.get("owner"),
            ttl=info.get("ttl"),
            holder_task_id=info.get("task_id"),
            name=self.lock_name,
        )

    def _end(self) -> None:
        """Stop renewing, report a loss, release (errors logged, never raised)."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        self._report_loss(lease, get_heartbeat().unregister(lease))
        release_after_commit(self.store, lease, self)

    def _report_loss(self, lease: Any, unregistered: bool) -> None:
        """Send ``lock_lost`` for a lease lost in the block, unless its heartbeat already
        did (it was no longer registered)."""
        if not unregistered and lease.lost:
            return  # the heartbeat already sent lock_lost
        if lease.lost:
            announce_lost(self.store, self, lease)  # WARNING after an operator's force release


def guarded_step(
    model: type[Model] | str,
    pk: Any,
    *,
    lock_name: str | None = None,
    task: Any = None,
    arguments: Mapping[str, Any] | None = None,
    ttl: float | None = None,
    wait: float | None = None,
    transitions: Mapping[str, Iterable[str]] | None = None,
    using: str | None = None,
    app: Any = None,
    actor: str | None = None,
) -> GuardedStep:
    """A step to change outside Celery under the same guard as a task:
    ``with guarded_step(Order, pk, task=charge) as step: step.transition("pending", "held")``.

    See :class:`GuardedStep` for what the ``with`` block does; :func:`guarded_transition`
    is the one-transition form.

    Args:
        model: The step model, or ``"app_label.ModelName"``.
        pk: The step's primary key.
        lock_name: The lock name to hold: the one the step's tasks take. Default: derived
            by :func:`step_lock_name` (from ``task`` when given).
        task: A StepLockedTask of this step model (or its name): its lock name, TTL, wait,
            transition table and step database are the defaults.
        arguments: With ``task``, its other arguments, for a ``lock_key`` that reads them.
        ttl: The lease TTL, seconds (default: the task's ``lock_ttl``, else
            ``steplock_default_ttl``).
        wait: Seconds to wait for a busy lease (default: the task's ``lock_wait``, else
            ``steplock_lock_wait``).
        transitions: ``{from_: [to, ...]}`` of allowed transitions (default: the task's
            ``step_transitions``, else any).
        using: The database alias (default: the task's ``step_database``, else
            ``steplock_step_database``, else the router's ``db_for_write``).
        app: The Celery app whose settings and lock store to use (default: the task's, else
            ``celery.current_app``).
        actor: Who writes, for people reading the lease and the signals (the lease's
            ``task_name``; default :data:`DEFAULT_ACTOR`), e.g. ``"admin:alice"``.

    Returns:
        The :class:`GuardedStep`, not yet entered: nothing is taken before ``with``.

    Raises:
        ImproperlyConfigured: A setting or argument is invalid, or the lock name is not
            derivable (naming it).
        InvalidArgument: ``ttl``, ``wait`` or ``actor`` is out of bounds.
        LockNameError: ``lock_name`` is no lock name.
        InvalidStepId: ``pk`` is not a key of the model.
    """
    return _make_step(
        GuardedStep,
        model,
        pk,
        lock_name=lock_name,
        task=task,
        arguments=arguments,
        ttl=ttl,
        wait=wait,
        transitions=transitions,
        using=using,
        app=app,
        actor=actor,
    )


def _make_step(
    cls: type[GuardedStep],
    model: type[Model] | str,
    pk: Any,
    *,
    lock_name: str | None,
    task: Any,
    arguments: Mapping[str, Any] | None,
    ttl: float | None,
    wait: float | None,
    transitions: Mapping[str, Iterable[str]] | None,
    using: str | None,
    app: Any,
    actor: str | None,
) -> Any:
    """The arguments of :func:`guarded_step` judged once, for both forms (``cls``)."""
    model = resolve_model(model, setting="model")
    app = _celery_app(app if app is not None or task is None else getattr(task, "app", None))
    settings = Settings(app)
    plan = None
    if task is not None:
        task = _step_locked_task(task, app)
        plan = task.steplock_plan
        if not _same_model(task.step_model, model):
            raise ImproperlyConfigured(
                f"task {task.name} does not guard {model._meta.label} steps (its step_model "
                f"is {shown(task.step_model)})",
                setting="task",
            )
    ttl = check_ttl(ttl, "ttl") if ttl is not None else plan.ttl if plan else settings.default_ttl
    if wait is not None:
        wait = check_seconds(wait, "wait", allow_zero=True, maximum=MAX_WAIT)
    else:
        wait = plan.wait if plan else settings.lock_wait
    if actor is None:
        actor = DEFAULT_ACTOR
    elif not isinstance(actor, str) or not actor:
        raise InvalidArgument(f"actor must be a non-empty str, got {shown(actor)}", "actor")
    if using is None:
        using = getattr(task, "step_database", None) or settings.step_database
    if transitions is None and task is not None:
        transitions = task.step_transitions
    steps = DjangoStepStore(
        model,
        status_field=settings.status_field,
        owner_field=settings.owner_field,
        fence_field=settings.fence_field,
        transitions=transitions,
        using=using,
    ).bind()
    step_id = steps._pk_value(pk)
    if lock_name is None:
        lock_name = step_lock_name(model, step_id, task=task, arguments=arguments, app=app)
    else:
        lock_name = check_name(lock_name)
    return cls(
        steps=steps,
        step_id=step_id,
        lock_name=lock_name,
        store=get_lease_store(app, settings),
        settings=settings,
        app=app,
        actor=actor,
        ttl=ttl,
        wait=wait,
    )


def guarded_transition(
    model: type[Model] | str,
    pk: Any,
    from_: str,
    to: str,
    *,
    lock_name: str | None = None,
    task: Any = None,
    arguments: Mapping[str, Any] | None = None,
    on_conflict: str = "raise",
    updates: Mapping[str, Any] | None = None,
    ttl: float | None = None,
    wait: float | None = None,
    transitions: Mapping[str, Iterable[str]] | None = None,
    using: str | None = None,
    app: Any = None,
    actor: str | None = None,
) -> TransitionResult:
    """Move step ``pk`` from ``from_`` to ``to`` from code outside Celery (a view, the admin,
    a management command, a serializer), under the guard a task's transition has.

    The lease of the step's lock name is acquired (the one its tasks take, so neither runs
    while the other holds it), the fenced compare-and-swap runs in a durable transaction
    (it writes the lease's owner and fencing token, and is refused by a row a newer holder
    wrote), the lease is checked in Redis before COMMIT and released after it. The signals
    are a task's: ``lock_acquired``/``lock_contended``, ``transition_applied`` (after
    COMMIT) or ``transition_conflict``, ``lock_lost``, ``lock_store_error``,
    ``lock_released``; their sender is the :class:`GuardedStep`. Nothing is ever
    half-applied: any error leaves the row as it was.

    Args:
        model: The step model, or ``"app_label.ModelName"``.
        pk: The step's primary key.
        from_: The status the step must still have.
        to: The status to write.
        lock_name: As for :func:`guarded_step`.
        task: As for :func:`guarded_step`.
        arguments: As for :func:`guarded_step`.
        on_conflict: ``"raise"`` (default: TransitionConflict) or ``"return"`` (the
            TransitionResult, not applied, ``current`` the step's status).
        updates: Extra column values written by the same statement.
        ttl: As for :func:`guarded_step`.
        wait: As for :func:`guarded_step`.
        transitions: As for :func:`guarded_step`.
        using: As for :func:`guarded_step`.
        app: As for :func:`guarded_step`.
        actor: As for :func:`guarded_step`.

    Returns:
        The :class:`~celery_steplock.steps.TransitionResult` (applied: its ``fence`` is the
        token now in the row).

    Raises:
        LockContended: Another owner (a task, another writer) holds the lease after
            ``wait`` seconds; nothing ran.
        TransitionConflict: The step left ``from_`` (with ``on_conflict="raise"``).
        LockLost: The lease was lost before COMMIT, or the row carries a newer fencing
            token; nothing committed.
        LockStoreUnavailable: Redis did not answer (at acquire or at the check before
            COMMIT); nothing committed (fail closed).
        LockStoreMisconfigured: Redis refused our credentials or a permission.
        OuterTransactionError: Called inside ``transaction.atomic()`` (ATOMIC_REQUESTS).
        InvalidTransition: ``from_ -> to`` is not in the transition table (before any
            lease is taken).
        StepNotFound: No such step.
        ImproperlyConfigured: An invalid argument or setting, or a lock name that is not
            derivable (naming ``lock_name``).
    """
    on_conflict = check_choice(on_conflict, "on_conflict", ON_CONFLICT)
    step = guarded_step(
        model,
        pk,
        lock_name=lock_name,
        task=task,
        arguments=arguments,
        ttl=ttl,
        wait=wait,
        transitions=transitions,
        using=using,
        app=app,
        actor=actor,
    )
    step.steps.check_allowed(from_, to)
    fence = None
    try:
        with step:
            fence = step.lease.fence
            return step._transition(from_, to, updates or {}, final=True)
    except TransitionConflict as exc:
        if on_conflict == "raise":
            raise
        return TransitionResult(False, step.step_id, from_, to, current=exc.current, fence=fence)


# -- writers outside Celery, from async code -------------------------------------------------


class AsyncGuardedStep(GuardedStep):
    """:class:`GuardedStep` for async code (an async view, an asyncio consumer), made by
    :func:`aguarded_step`: ``async with aguarded_step(Order, pk) as step: await
    step.atransition("pending", "held")``. The same flow, signals and errors; what runs
    where:

    - On the event loop (never blocking it): the lease, with the app's async lease store
      (:func:`celery_steplock.aio.lock.get_async_lease_store`, the same key, fencing token
      and waiter queue as the tasks' sync store), its renewal by the loop's
      :class:`~celery_steplock.aio.heartbeat.AsyncHeartbeat`, the ownership check before
      COMMIT (``await store.owned``), the release after it, and the contention report.
    - In a thread, through ``sync_to_async(thread_sensitive=True)``: everything that touches
      the database. Django has no async transaction (``atomic`` is sync only, and its async
      ORM methods such as ``aupdate`` are each a ``sync_to_async`` hop of their own, so a
      transaction cannot span two of them on another thread), and the fenced
      compare-and-swap must run inside the durable transaction that the ownership check
      precedes. So the block runs in an ``asgiref.sync.ThreadSensitiveContext`` of its own:
      every thread-sensitive hop inside it (ours, and the block's own async ORM calls, which
      are thread-sensitive hops too) goes to one thread, which holds the block's connection
      and transaction. The hops: (1) on entry, the outer-transaction check and
      ``atomic(durable=True)``'s BEGIN; (2) each :meth:`atransition` (the CAS, its
      follow-up read, the signals) and :meth:`astatus`; (3) on exit, the lease's local
      validity and the deadline before the Redis check; (4) COMMIT or ROLLBACK, then the
      thread's connections are closed when the block opened them (a fresh thread: a fresh
      connection per block).

    Called from sync code through ``async_to_sync`` (a thread that already has a sync
    caller), asgiref sends the hops to that caller's thread instead: the outer-transaction
    check then sees its ``atomic()`` blocks, as the sync form does.
    """

    _astore: Any = None
    _context: Any = None
    _contextvars: contextvars.Context
    _opened_connections = False

    async def __aenter__(self) -> AsyncGuardedStep:
        self._first_use()
        from ...aio.heartbeat import get_async_heartbeat
        from ...aio.lock import get_async_lease_store

        self._contextvars = contextvars.copy_context()
        context = ThreadSensitiveContext()
        await context.__aenter__()
        self._context = context
        try:
            await self._hop(self._check_outer_here)
            self._astore = store = get_async_lease_store(self.app)
            settings = self.steplock_settings
            started = time.monotonic()
            try:
                lease = await store.acquire(
                    self.lock_name,
                    None,  # a token of the store's making: a cancellation releases by it
                    self.ttl,
                    wait=self.wait,
                    metadata=self._metadata(),
                )
            except LockStoreUnavailable as exc:
                self._store_error(exc, self._fields())
                raise
            waited = time.monotonic() - started
            if lease is None:
                try:
                    info = await store.inspect(self.lock_name) or {}
                except LockStoreUnavailable:
                    info = {}
                raise self._contended(waited, info)
            self.lease = lease
            get_async_heartbeat().register(
                lease,
                store,
                ratio=settings.renewal_ratio,
                sender=self,
                max_hold=settings.max_hold,
            )
            emit(
                signals.lock_acquired,
                self,
                logging.DEBUG,
                wait_seconds=waited,
                **lease_fields(lease),
            )
            await self._hop(self._open)
        except BaseException:
            await self._aend()
            raise
        self._collect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: Any,
    ) -> Literal[False]:
        committing, self._committing = self._committing, None
        self._uncollect()
        try:
            if exc_type is not None:
                await self._hop(committing.__exit__, exc_type, exc, tb)  # ROLLBACK
                return False
            try:
                await self._hop(self._write_effects)
                lease = await self._hop(self._before_owned)
                try:
                    left = await self._astore.owned(lease.name, lease.owner)
                except LockStoreUnavailable as error:
                    self._store_error(error, lease_fields(lease))
                    raise
                self._after_owned(left)
            except BaseException as error:
                await self._hop(committing.__exit__, type(error), error, error.__traceback__)
                raise
            await self._hop(committing.__exit__, None, None, None)  # COMMIT
            return False
        finally:
            await self._aend()

    def __enter__(self) -> GuardedStep:
        raise InvalidArgument(
            "an AsyncGuardedStep is entered with `async with` (guarded_step() makes the sync one)",
            argument="step",
        )

    async def _hop(self, func: Callable[..., Any], *args: Any) -> Any:
        """``func(*args)`` on the block's thread (``sync_to_async(thread_sensitive=True)``
        inside the block's ``ThreadSensitiveContext``), in the block's one
        ``contextvars.Context``: the transaction's tracing state, set at BEGIN, is reset at
        COMMIT in the context that set it."""
        return await sync_to_async(self._contextvars.run, thread_sensitive=True)(func, *args)

    def _check_outer_here(self) -> None:
        # On the block's thread: a fresh one has no connection (closed at the end).
        self._opened_connections = not connections.all(initialized_only=True)
        self._check_outer()

    def _close_here(self) -> None:
        if self._opened_connections:
            connections.close_all()  # this thread's alone: a fresh thread's connections

    async def astatus(self) -> str:
        """The step's status now, read in the block's transaction (a hop). Raises
        StepNotFound."""
        return await self._hop(self.status)

    async def atransition(self, from_: str, to: str, **updates: Any) -> TransitionResult:
        """:meth:`GuardedStep.transition` from the ``async with`` block: the fenced
        compare-and-swap inside the block's transaction, on its thread (one hop).

        Raises:
            TransitionConflict, LockLost, LockContended, InvalidTransition, StepNotFound,
            InvalidArgument: As :meth:`GuardedStep.transition`.
        """
        return await self._hop(self._transition_kw, from_, to, updates, False)

    def _transition_kw(
        self, from_: str, to: str, updates: Mapping[str, Any], final: bool
    ) -> TransitionResult:
        return self._transition(from_, to, updates, final=final)

    def transition(self, from_: str, to: str, **updates: Any) -> TransitionResult:
        raise InvalidArgument(
            "in `async with aguarded_step(...) as step:` use `await step.atransition(...)`",
            argument="step",
        )

    async def _aend(self) -> None:
        """Close the block's connections, leave its thread, stop renewing, report a loss,
        release with the async store (errors logged, never raised; shielded: a cancelled
        caller still sends the release, else the lease is left to its TTL)."""
        from ...aio.heartbeat import get_async_heartbeat

        context, self._context = self._context, None
        try:
            if context is not None:
                try:
                    await self._hop(self._close_here)
                finally:
                    await context.__aexit__(None, None, None)
        finally:
            lease, self.lease = self.lease, None
            if lease is not None:
                self._report_loss(lease, get_async_heartbeat().unregister(lease))
                try:
                    released = await asyncio.shield(self._astore.release(lease.name, lease.owner))
                except Exception as exc:  # noqa: BLE001 - must never mask the holder's outcome
                    released_after_commit(lease, self, None, exc, 0.0)
                else:
                    held = lease.clock() - lease.acquired_at
                    released_after_commit(lease, self, released, None, held)


def aguarded_step(
    model: type[Model] | str,
    pk: Any,
    *,
    lock_name: str | None = None,
    task: Any = None,
    arguments: Mapping[str, Any] | None = None,
    ttl: float | None = None,
    wait: float | None = None,
    transitions: Mapping[str, Iterable[str]] | None = None,
    using: str | None = None,
    app: Any = None,
    actor: str | None = None,
) -> AsyncGuardedStep:
    """The async form of :func:`guarded_step`: ``async with aguarded_step(Order, pk,
    task=charge) as step: await step.atransition("pending", "held")``. Same arguments,
    defaults and errors; :class:`AsyncGuardedStep` says what runs on the loop and what
    hops to a thread. Nothing is taken before ``async with`` (this call does no I/O).

    Returns:
        The :class:`AsyncGuardedStep`, not yet entered.

    Raises:
        ImproperlyConfigured, InvalidArgument, LockNameError, InvalidStepId: As
            :func:`guarded_step`.
    """
    return _make_step(
        AsyncGuardedStep,
        model,
        pk,
        lock_name=lock_name,
        task=task,
        arguments=arguments,
        ttl=ttl,
        wait=wait,
        transitions=transitions,
        using=using,
        app=app,
        actor=actor,
    )


async def aguarded_transition(
    model: type[Model] | str,
    pk: Any,
    from_: str,
    to: str,
    *,
    lock_name: str | None = None,
    task: Any = None,
    arguments: Mapping[str, Any] | None = None,
    on_conflict: str = "raise",
    updates: Mapping[str, Any] | None = None,
    ttl: float | None = None,
    wait: float | None = None,
    transitions: Mapping[str, Iterable[str]] | None = None,
    using: str | None = None,
    app: Any = None,
    actor: str | None = None,
) -> TransitionResult:
    """The async form of :func:`guarded_transition` (an async view, an asyncio consumer):
    ``await aguarded_transition(Order, pk, "pending", "held")``.

    The lease is taken, renewed, checked before COMMIT and released on the event loop with
    the async lease store (a wait for a busy lease never blocks the loop); the database
    part hops to one thread with ``sync_to_async(thread_sensitive=True)``, in a
    ``ThreadSensitiveContext`` of its own: BEGIN of the durable transaction (with the
    outer-transaction check), then the fenced compare-and-swap (and the PostgreSQL
    deadline), then, after ``await store.owned(...)`` on the loop, COMMIT and the close of
    that thread's connection (:class:`AsyncGuardedStep`). Django's async ORM is not used
    for the CAS: ``aupdate`` is itself a hop of its own with no transaction around it, and
    the CAS must run inside the transaction the ownership check precedes.

    Args, Returns, Raises: As :func:`guarded_transition` (the same signals, sender the
    :class:`AsyncGuardedStep`; nothing is ever half-applied). A cancellation while the
    lease is awaited or held rolls back and releases the lease (or leaves it to its TTL);
    one that arrives once COMMIT is under way on the block's thread cannot stop it (a
    thread cannot be cancelled): the transition is then committed although the caller
    gets ``asyncio.CancelledError``, so a caller that must know reads the step again.
    """
    on_conflict = check_choice(on_conflict, "on_conflict", ON_CONFLICT)
    step = aguarded_step(
        model,
        pk,
        lock_name=lock_name,
        task=task,
        arguments=arguments,
        ttl=ttl,
        wait=wait,
        transitions=transitions,
        using=using,
        app=app,
        actor=actor,
    )
    step.steps.check_allowed(from_, to)
    fence = None
    try:
        async with step:
            fence = step.lease.fence
            return await step._hop(step._transition_kw, from_, to, updates or {}, True)
    except TransitionConflict as exc:
        if on_conflict == "raise":
            raise
        return TransitionResult(False, step.step_id, from_, to, current=exc.current, fence=fence)
