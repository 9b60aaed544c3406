"""Listens to the fleet's agent events (webapp.fleet.signals): reports and hellos advance rollouts."""

from __future__ import annotations

from typing import Any

from django.dispatch import receiver

from agent.wire.control import UpdateStatus
from webapp.fleet.signals import node_hello, update_reported
from webapp.releases import services
from webapp.releases.tasks import enqueue_advance


@receiver(update_reported)
def on_update_reported(sender: Any, node_id: str, status: UpdateStatus, **kwargs: Any) -> None:
    rollout_id = services.apply_report(node_id, status)
    if rollout_id is not None:
        enqueue_advance(rollout_id)


@receiver(node_hello)
def on_node_hello(sender: Any, node_id: str, version: str, **kwargs: Any) -> None:
    rollout_id = services.rollout_for_node(node_id)
    if rollout_id is not None:
        enqueue_advance(rollout_id)
