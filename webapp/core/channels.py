"""Channel-layer helpers: group names, sending from synchronous code, and the dashboards' change pings."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

FLEET_GROUP = "fleet"
# A dashboard ping waits at most this for the channel layer. channels-redis waits out its socket
# timeout (30 s) on a Redis that accepts and never answers; a ping is worth a page's refresh, not that.
NOTIFY_TIMEOUT_S = 2.0

log = logging.getLogger(__name__)


def node_group(node_id: str) -> str:
    """The group an agent's websocket joins; commands for that node are sent to it."""
    return f"node.{node_id}"


def group_send(group: str, message: dict[str, Any]) -> None:
    """Send to a group from synchronous code (a view, a Celery task, or a sync_to_async thread)."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, message)


async def notify_fleet_async(node_id: str | None = None, kind: str = "node") -> None:
    """Tell every open dashboard that a node (or the placement, or the answers) changed. Best effort:
    a channel layer that fails or does not answer within NOTIFY_TIMEOUT_S costs the pages one refresh
    (logged), never the caller's work: consumers await this on the event loop, not on the database
    thread they share."""
    layer = get_channel_layer()
    if layer is None:
        return
    message = {"type": "fleet.changed", "kind": kind, "node_id": node_id or ""}
    try:
        await asyncio.wait_for(layer.group_send(FLEET_GROUP, message), NOTIFY_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - a dashboard ping must not fail what changed
        log.warning("dashboard ping (%s %s) not sent: %s", kind, node_id or "-", e.__class__.__name__)


def notify_fleet(node_id: str | None = None, kind: str = "node") -> None:
    """notify_fleet_async from synchronous code (a view, a Celery task), bounded the same way."""
    async_to_sync(notify_fleet_async)(node_id, kind)
