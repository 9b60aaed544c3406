"""Release tasks, thin: advance a rollout (claimed under a row lock), send the command after commit."""

from __future__ import annotations

import logging

from celery import shared_task
from django.db import transaction

from webapp.core.broker import BrokerUnavailable, publish
from webapp.core.channels import notify_fleet
from webapp.fleet.tasks import send_command
from webapp.releases import services
from webapp.releases.models import RolloutNode

log = logging.getLogger(__name__)


@shared_task
def advance_rollout(rollout_id: int) -> bool:
    """One step of a rollout; True when a node was sent the release."""
    with transaction.atomic():
        command = services.advance(rollout_id)
        if command is not None:
            node_id = RolloutNode.objects.get(rollout_id=rollout_id, state="sent").node_id
            transaction.on_commit(lambda: send_command(node_id, command))
        transaction.on_commit(lambda: notify_fleet(kind="release"))
    return command is not None


@shared_task
def advance_rollouts() -> int:
    """Beat: advance every active rollout (catches timeouts and nodes that came back)."""
    ids = services.active_rollout_ids()
    for rid in ids:
        advance_rollout.delay(rid)
    return len(ids)


def enqueue_advance(rollout_id: int) -> None:
    """Advance a rollout once the caller's transaction (if any) has committed. Called from agents'
    hellos and reports: a broker that cannot take the task (bounded by the transport's timeouts) is
    logged, not the agent's failure; beat's advance_rollouts advances every active rollout anyway."""

    def send() -> None:
        try:
            publish(advance_rollout, rollout_id)
        except BrokerUnavailable:
            log.warning("rollout %s not advanced now: the broker did not take the task", rollout_id)

    transaction.on_commit(send)
