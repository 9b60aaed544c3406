"""Channel-layer helpers: group names and sending from synchronous code (views, tasks)."""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

FLEET_GROUP = "fleet"


def node_group(node_id: str) -> str:
    """The group an agent's websocket joins; commands for that node are sent to it."""
    return f"node.{node_id}"


def group_send(group: str, message: dict[str, Any]) -> None:
    """Send to a group from synchronous code (a view, a Celery task, or a sync_to_async thread)."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


def notify_fleet(node_id: str | None = None, kind: str = "node") -> None:
    """Tell every open dashboard that a node (or the placement) changed."""
    group_send(FLEET_GROUP, {"type": "fleet.changed", "kind": kind, "node_id": node_id or ""})
