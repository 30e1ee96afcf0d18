"""The step-store protocol: where a step's status lives and how a transition commits.

The core (:mod:`celery_steplock.task`, :mod:`celery_steplock.plan`) imports no database
framework: it talks to a :class:`StepStore`, one per step model, built by the factory that
the ``steplock_step_store`` setting names as a qualified string (Celery's idiom for
``Task.Request``), ``"celery_steplock.contrib.django.steps:DjangoStepStore"`` by default.

A store guarantees what the safety model rests on (SPEC section 3): :meth:`StepStore.transition`
is a compare-and-swap that updates the row only while it is still in ``from_`` and carries no
newer fencing token than the caller's, and it runs inside :meth:`StepStore.atomic`, the one
transaction in which the body's own writes commit. A store for another framework implements
the same methods; :class:`StepStore` is a :class:`typing.Protocol`, so no subclassing is
needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import (
    Any,
    Callable,
    ContextManager,
    Iterable,
    Mapping,
    Protocol,
    cast,
    runtime_checkable,
)

from celery.utils.imports import symbol_by_name

from ._checks import describe
from .exceptions import ImproperlyConfigured

__all__ = [
    "StepStore",
    "TransitionResult",
    "load_step_store",
    "check_transitions",
    "check_known_database",
    "step_store_factory",
    "DEFAULT_STEP_STORE",
]

#: The ``steplock_step_store`` default: the Django ORM store of ``contrib.django``.
DEFAULT_STEP_STORE = "celery_steplock.contrib.django.steps:DjangoStepStore"


@dataclass(frozen=True)
class TransitionResult:
    """The outcome of one compare-and-swap. Truthy when applied.

    Attributes:
        applied: Whether the row was updated.
        step_id: The step's primary key.
        from_: The status the transition expected.
        to: The status it wrote (or was to write).
        current: The status read after a conflict (None when applied).
        fence: The fencing token written with the transition, if any.
    """

    applied: bool
    step_id: Any
    from_: str
    to: str
    current: str | None = None
    fence: int | None = None

    def __bool__(self) -> bool:
        return self.applied


@runtime_checkable
class StepStore(Protocol):
    """The steps of one model, as the task's execution needs them.

    Optional, looked up with ``getattr``: ``bind()`` returns a store whose every call goes
    to the database ``using`` names at that moment (a store that picks its database per
    call, e.g. through a router that reads a tenant from the context, fixes it there); the
    task calls it once per execution, before the outer-transaction check, so that the
    check, the precheck, the transaction, the compare-and-swap, its follow-up read and
    ``on_commit`` all use one database. A store without it is used as it is.
    ``in_outer_transaction()`` (bool) and ``savepoint()`` (a context manager nested in the
    caller's transaction) let an eager execution (``apply()``, ``task_always_eager``) inside
    the caller's transaction run as a savepoint of it; a store without them refuses it with
    ``check_not_nested``. ``owner_max_length`` (int or None): the owner column's length,
    when it has one; an owner token longer than it is made in its short form
    (:func:`~celery_steplock.lease.new_owner_token`). On the factory: ``databases()`` lists the database names a
    ``using=`` may take (None: it cannot tell), for :func:`load_step_store` to refuse an
    unknown one by name.

    Attributes:
        label: The model (``"app_label.model"``, lower case).
        using: The database every call goes to: the model's write database, the precheck
            included, so a lagging replica can never decide anything.
    """

    label: str

    @property
    def using(self) -> str:
        """The database every call goes to (read-only for callers)."""
        ...

    def status(self, step_id: Any) -> str:
        """The step's current status.

        Args:
            step_id: The step's primary key.

        Returns:
            Its status.

        Raises:
            StepNotFound: No row has that key.
        """

    def step_ref(self, step_id: Any) -> str:
        """The step's identity as the store's rows spell it (the reaper compares it).

        Args:
            step_id: The step's primary key.

        Returns:
            ``"<label>:<key>"``.

        Raises:
            InvalidStepId: A key the model cannot have.
        """

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
        """Compare-and-swap ``from_ -> to``, inside :meth:`atomic`.

        Updates the row only while it is still in ``from_`` and carries no newer fencing
        token than ``fence``.

        Args:
            step_id: The step's primary key.
            from_: The status the row must be in.
            to: The status to write.
            owner: The owner token to write.
            fence: The fencing token to write (and to compare).
            updates: More columns to write.
            deadline: Seconds (optional): from this statement to COMMIT the transaction may
                wait for the row and sit idle for at most that long (the lease's remaining
                validity), where the database supports it.
            raise_on_conflict: Raise on a conflict rather than return it.

        Returns:
            The :class:`TransitionResult`.

        Raises:
            TransitionConflict: No row updated (when ``raise_on_conflict``).
            InvalidTransition: ``from_ -> to`` is not allowed.
            StepNotFound: No row has that key.
        """

    def set_deadline(self, seconds: float) -> bool:
        """Bound the current transaction's waits, as a statement of its own.

        Args:
            seconds: The bound of the wait for row locks and of the time idle before
                COMMIT.

        Returns:
            False where the database has no such bound, else True.
        """

    def atomic(self) -> ContextManager[Any]:
        """A durable transaction on :attr:`using`.

        Returns:
            A context manager that really commits when it exits.
        """

    def on_commit(self, func: Callable[[], None]) -> None:
        """Run a callable after the current transaction commits (at once outside one).

        Args:
            func: Called without arguments.
        """

    def check_not_nested(self, task_name: str) -> None:
        """Refuse to run inside a caller's transaction.

        Args:
            task_name: The task, for the message.

        Raises:
            OuterTransactionError: Called inside a caller's transaction, whose commit would
                come after the lease's release.
        """

    def is_lost_connection(self, exc: BaseException) -> bool:
        """Whether an error means the connection broke (the commit may not have happened).

        Args:
            exc: The error.

        Returns:
            True when the connection broke.
        """

    def is_lock_timeout(self, exc: BaseException) -> bool:
        """Whether an error is the row-lock wait running past ``deadline``.

        Args:
            exc: The error.

        Returns:
            True when it is.
        """


def check_transitions(
    table: Any, setting: str = "step_transitions"
) -> Mapping[str, Iterable[str]]:
    """Check an allowed-transition table.

    Args:
        table: ``{from_: [to, ...]}`` with status strings (a bare string as the targets
            would be read as its letters).
        setting: The setting or option named by the error.

    Returns:
        ``table``.

    Raises:
        ImproperlyConfigured: ``table`` is not such a mapping (naming ``setting``).
    """
    if not isinstance(table, Mapping) or not all(
        isinstance(k, str)
        and not isinstance(v, (str, bytes))
        and isinstance(v, Iterable)
        and all(isinstance(t, str) for t in v)
        for k, v in table.items()
    ):
        raise ImproperlyConfigured(
            f"{setting} must map a status to a list of statuses, "
            f'e.g. {{"pending": ["running"]}}, got {table!r}',
            setting=setting,
        )
    return table


def load_step_store(
    spec: Any,
    model: Any,
    *,
    status_field: str,
    owner_field: str,
    fence_field: str,
    transitions: Mapping[str, Iterable[str]] | None = None,
    setting: str = "steplock_step_store",
    using: str | None = None,
    using_setting: str = "step_database",
) -> StepStore:
    """Build the step store of a model with the factory ``spec`` names.

    The factory is called as ``factory(model, status_field=..., owner_field=...,
    fence_field=..., transitions=...)``, plus ``using=`` when ``using`` is given.

    Args:
        spec: A qualified string ``"package.module:Name"`` (or ``package.module.Name``) or
            the factory itself.
        model: The step model.
        status_field: The status column.
        owner_field: The owner token column.
        fence_field: The fencing token column.
        transitions: The allowed-transition table, or None.
        setting: The setting named when the factory cannot be imported.
        using: A database name (e.g. the task's ``step_database``); None leaves the choice
            to the store (the Django store: the router's write database).
        using_setting: The option named when the factory's ``databases()`` does not list
            ``using``.

    Returns:
        The :class:`StepStore`.

    Raises:
        ImproperlyConfigured: The factory cannot be imported (naming ``setting``) or does
            not know ``using`` (naming ``using_setting``); and whatever the factory raises
            about the model.
    """
    factory = step_store_factory(spec, setting)
    database: dict[str, str] = {}
    if using is not None:
        check_known_database(factory, using, using_setting)
        database["using"] = using
    return cast(
        StepStore,
        factory(
            model,
            status_field=status_field,
            owner_field=owner_field,
            fence_field=fence_field,
            transitions=transitions,
            **database,
        ),
    )


def step_store_factory(spec: Any, setting: str = "steplock_step_store") -> Callable[..., Any]:
    """The step-store factory a spec names.

    Args:
        spec: A qualified string, or the factory itself.
        setting: The setting named by the error.

    Returns:
        The factory.

    Raises:
        ImproperlyConfigured: It cannot be imported or is not callable (naming
            ``setting``).
    """
    try:
        factory = symbol_by_name(spec) if isinstance(spec, str) else spec
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImproperlyConfigured(
            f"{setting}={spec!r} cannot be imported: {exc}", setting=setting
        ) from exc
    if not callable(factory):
        raise ImproperlyConfigured(
            f"{setting} must name a step-store factory, got {spec!r}", setting=setting
        )
    return cast(Callable[..., Any], factory)


def check_known_database(factory: Any, using: str, setting: str = "step_database") -> None:
    """Refuse a database the step-store factory does not know.

    Args:
        factory: The step-store factory.
        using: The database name.
        setting: The option named by the error.

    Raises:
        ImproperlyConfigured: ``factory.databases()`` (if the factory has it and it can
            tell) does not list ``using`` (naming ``setting``).
    """
    listing = getattr(factory, "databases", None)
    known = listing() if callable(listing) else None
    if known is not None and using not in known:
        raise ImproperlyConfigured(
            f"{describe(setting)}: {using!r} is not a configured database (known: "
            f"{', '.join(map(repr, known)) or 'none'})",
            setting=setting,
        )
