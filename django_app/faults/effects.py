"""Step tasks of the effects outbox's fault workloads (``tests/support/faults/outbox.py``,
``tests/faults/test_outbox_faults.py``, the ``outbox`` workload of ``scripts/nemesis.py``).

``effect_forward`` moves its step ``pending -> done`` through
:class:`~django_app.faults.tasks.FaultTask` (the probe's barriers, a ``TransitionRecord`` per
committed transition) and *declares* two effects (:mod:`celery_steplock.effects`): position 0
an HTTP POST to the controller's idempotent receiver (``url``; a JSON body naming the step,
the fence, the status and the position), position 1 (with ``sink``) the publication of
``effect_sink`` for the step ``sink``. Both are written in the CAS's transaction and sent
after COMMIT by the outbox, keyed by ``<step>:<fence>:done:<position>``.

``effect_in_body`` is the negative control: the same two effects *performed* in the body,
before the CAS (what a body did before the outbox), with keys of the same shape. An attempt
whose CAS is then refused (its lease lost, a duplicate delivery) has already sent them.

``effect_sink`` is the step-locked receiver of the published task: it moves its own step
``pending -> done`` (so it applies a publication once, whatever the deliveries) and records
which effect it received (``sink_received``: the source step, fence and position) before its
body runs. The task id it was published with is the effect's key.

Settings for the fault workers (only when ``STEPLOCK_FAULTS=1``): the relay leaves a fresh
effect to its committing process for ``STEPLOCK_FAULTS_EFFECT_RELAY_DELAY`` seconds (default
2) and an HTTP effect's request times out after ``STEPLOCK_FAULTS_EFFECT_HTTP_TIMEOUT``
seconds (default 2).
"""

import json
import os
import urllib.request

from celery import current_app, shared_task

from celery_steplock import effects

from . import probe
from .tasks import OPTIONS

if probe.enabled():
    current_app.conf.steplock_effect_relay_delay = float(
        os.environ.get("STEPLOCK_FAULTS_EFFECT_RELAY_DELAY", "2")
    )
    current_app.conf.steplock_effect_http_timeout = float(
        os.environ.get("STEPLOCK_FAULTS_EFFECT_HTTP_TIMEOUT", "2")
    )

SINK = f"{__name__}.effect_sink"
#: Effects declared per committed transition, by the status it wrote (the checker's
#: ``declares``): the HTTP call and, with a sink, the publication.
DECLARES = {"done": 2}


def _described(task, step_id, position):
    lease = task.lease
    return {
        "step": step_id,
        "fence": lease.fence if lease else None,
        "to": "done",
        "position": position,
    }


@shared_task(transition=("pending", "done"), **OPTIONS)
def effect_forward(self, step_id, url, sink=None, work=0.0):
    """pending -> done, declaring an HTTP call to ``url`` and (``sink``) a publication of
    :func:`effect_sink` for the step ``sink``; sent after COMMIT by the outbox."""
    probe.barrier("after_acquire", self, step_id)
    effects.http(url, json=_described(self, step_id, 0))
    if sink is not None:
        effects.publish(SINK, args=(sink,), kwargs=_described(self, step_id, 1))
    probe.work(self, work)
    return {"step_id": step_id, "owner": self.lease.owner, "fence": self.lease.fence}


def body_key(task, step_id, position):
    """The key a body that performs its effects itself gives them: the outbox's shape
    (``step:<id>:<fence>:done:<position>``), so the receivers dedupe what they can."""
    lease = task.lease
    return f"step:{step_id}:{lease.fence if lease else 't' + str(task.request.id)}:done:{position}"


@shared_task(transition=("pending", "done"), **OPTIONS)
def effect_in_body(self, step_id, url, sink=None, work=0.0):
    """The negative control: :func:`effect_forward`'s effects performed in the body, before
    the CAS."""
    probe.barrier("after_acquire", self, step_id)
    request = urllib.request.Request(
        url,
        data=json.dumps(_described(self, step_id, 0)).encode(),
        headers={
            "Content-Type": "application/json",
            "Idempotency-Key": body_key(self, step_id, 0),
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()
    if sink is not None:
        current_app.send_task(
            SINK,
            args=(sink,),
            kwargs=_described(self, step_id, 1),
            task_id=body_key(self, step_id, 1),
        )
    probe.work(self, work)
    return {"step_id": step_id, "owner": self.lease.owner, "fence": self.lease.fence}


@shared_task(transition=("pending", "done"), **OPTIONS)
def effect_sink(self, step_id, step=None, fence=None, to=None, position=None):
    """The step-locked receiver of a published effect: pending -> done on its own step."""
    probe.record(
        "sink_received",
        step=step_id,
        task_id=self.request.id,
        source=step,
        source_fence=fence,
        source_to=to,
        position=position,
    )
    probe.barrier("after_acquire", self, step_id)
    return {"step_id": step_id, "owner": self.lease.owner, "fence": self.lease.fence}
