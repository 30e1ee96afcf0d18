"""``manage.py cancel_step <id> [--wait S]``: cancel a pending step from outside Celery.

An operator's tool of the example project, written the way any code outside a task (a view,
a command, a serializer) changes a step: through
:func:`celery_steplock.contrib.django.steps.guarded_transition`, under the lease its tasks
take (``step:<id>``, the ``advance`` task's ``lock_key``), by the fenced compare-and-swap
``pending -> cancelled``. A step a task is working on is refused (the lease is held), a step
that already left ``pending`` is reported as it is; the command exits non-zero in both cases.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from celery_steplock.contrib.django.steps import guarded_transition
from celery_steplock.exceptions import (
    LockContended,
    LockLost,
    LockStoreUnavailable,
    StepLockError,
    TransitionConflict,
)
from django_app.workflows.models import Step
from django_app.workflows.tasks import advance


class Command(BaseCommand):
    help = "Cancel a pending step (pending -> cancelled) under the lease its tasks take."

    def add_arguments(self, parser):
        parser.add_argument("step_id", help="the step's primary key")
        parser.add_argument(
            "--wait",
            type=float,
            default=None,
            metavar="S",
            help="seconds to wait for a task holding the step (default: the task's lock_wait)",
        )

    def handle(self, *args, **options):
        try:
            result = guarded_transition(
                Step,
                options["step_id"],
                Step.Status.PENDING,
                Step.Status.CANCELLED,
                task=advance,
                wait=options["wait"],
                actor="manage.py cancel_step",
            )
        except TransitionConflict as exc:
            raise CommandError(f"step {options['step_id']} is {exc.current}, not pending") from exc
        except LockContended as exc:
            raise CommandError(
                f"step {options['step_id']} is being worked on (lease {exc.name} held by "
                f"{exc.holder}); nothing changed"
            ) from exc
        except (LockLost, LockStoreUnavailable) as exc:
            raise CommandError(f"nothing changed: {exc}") from exc
        except StepLockError as exc:
            raise CommandError(str(exc)) from exc
        if options["verbosity"] >= 1:
            self.stdout.write(f"Step {result.step_id} cancelled (fence {result.fence}).")
