"""Fleet websockets: the agents' control socket and the staff dashboard's live updates.

Consumers only authenticate, join groups, relay and call services; decisions live elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime
from typing import Any

from channels.db import database_sync_to_async
from django.conf import settings
from django.template.loader import render_to_string

from agent.wire.control import (
    CLOSE_REMOVED,
    CLOSE_UNAUTHORIZED,
    PROTOCOL_VERSION,
    ControlError,
    ErrorMessage,
    Heartbeat,
    Hello,
    Load,
    Progress,
    Removed,
    Resync,
    ServerMessage,
    UpdateStatus,
    Welcome,
    parse_agent_message,
)
from webapp.core.channels import FLEET_GROUP, node_group, notify_fleet_async
from webapp.core.consumers import BadMessage, SafeJsonConsumer
from webapp.core.nodeauth import authorization_from_scope_headers, parse_node_authorization
from webapp.fleet import services
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.probe import check_dataplane
from webapp.fleet.protocol import reconcile
from webapp.fleet.signals import node_hello, update_reported
from webapp.fleet.tasks import assignment_view, sweep_offline_nodes_async

log = logging.getLogger(__name__)
_last_sweep = 0.0
# An agent socket's join to (or leave of) its node's command group waits at most this for the channel
# layer: a Redis that restarts or accepts and never answers once left a socket accepted and never
# welcomed, the agent heartbeating to nobody. A join that fails closes the socket (1011), and the agent
# connects again with its backoff; a leave that fails is logged and the node still marked disconnected.
GROUP_OP_TIMEOUT_S = 3.0
CLOSE_TRY_AGAIN = 1011


def _hello_sync(
    node_id: str, hello: Hello, dataplane_problem: str = "", rtt_ms: float | None = None
) -> list[ServerMessage]:
    services.apply_hello(node_id, hello, dataplane_problem, rtt_ms)
    rows = list(ShardAssignment.objects.select_related("artifact").filter(node_id=node_id))
    ready, commands = reconcile([assignment_view(a) for a in rows], hello.shards)
    ShardAssignment.objects.filter(pk__in=ready).exclude(state=ShardAssignment.State.DRAINING).update(
        state=ShardAssignment.State.READY, progress=1.0, error=""
    )
    ShardAssignment.objects.filter(pk__in=[c.assignment_id for c in commands if isinstance(c, Load)]).update(
        state=ShardAssignment.State.ASSIGNED, progress=0.0
    )
    node_hello.send(sender=Node, node_id=node_id, version=hello.version)
    return list(commands)


async def _sweep_due() -> None:
    """Any live agent's heartbeat also sweeps for silent ones, every 2 s at most (beat does too, when
    it runs); its health checks and task publishes stay off the shared database thread."""
    global _last_sweep
    if time.monotonic() - _last_sweep >= 2.0:
        _last_sweep = time.monotonic()
        try:
            await sweep_offline_nodes_async()
        except Exception:  # noqa: BLE001 - the control plane's own chore, not the heartbeat's failure
            log.warning("sweeping for silent nodes failed", exc_info=True)


def _progress_sync(node_id: str, p: Progress) -> bool:
    return services.update_progress(
        node_id, p.assignment_id, p.state, p.progress, p.error, p.transfer.to_wire() if p.transfer else None
    )


def _update_status_sync(node_id: str, status: UpdateStatus) -> None:
    log.info("agent %s update to %s: %s %s", node_id, status.version, status.state, status.error)
    update_reported.send(sender=Node, node_id=node_id, status=status)


class AgentConsumer(SafeJsonConsumer):
    """/ws/agent/: authenticated by `Authorization: Node <id>:<secret>`; relays commands and reports.

    A data plane that failed its check is checked again on a heartbeat at most every
    DATAPLANE_REPROBE_S: a probe that timed out once (a busy web process, a hop still starting) would
    otherwise leave the node connected but unroutable until it reconnected."""

    node_id: str | None = None
    connected_at: datetime | None = None
    unroutable_url: str | None = None  # the URL of the last hello, while its check found a problem
    probed_at: float = 0.0

    async def send_message(self, msg: ServerMessage) -> None:
        """Every message to the agent goes through the shared schema."""
        await self.send_json(msg.to_wire())

    async def send_error(self, text: str) -> None:
        await self.send_message(ErrorMessage.about(text))

    async def connect(self) -> None:
        creds = parse_node_authorization(authorization_from_scope_headers(self.scope.get("headers", [])))
        node = await database_sync_to_async(services.authenticate_node)(*creds) if creds else None
        await self.accept()
        if node is None:
            await self.send_error("invalid or missing node credentials (Authorization: Node <id>:<secret>)")
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        try:
            await asyncio.wait_for(
                self.channel_layer.group_add(node_group(node.id), self.channel_name), GROUP_OP_TIMEOUT_S
            )
        except Exception as e:  # noqa: BLE001 - whatever the layer raised, the agent must connect again
            log.warning(
                "agent %s: joining its command group failed (%s): closing", node.id, e.__class__.__name__
            )
            await self.close(code=CLOSE_TRY_AGAIN)
            return
        self.node_id = node.id
        self.connected_at = await database_sync_to_async(services.mark_connected)(node.id)
        await self.send_message(
            Welcome(
                node_id=node.id, protocol=PROTOCOL_VERSION, heartbeat_interval_s=settings.HEARTBEAT_INTERVAL_S
            )
        )
        await notify_fleet_async(node.id)

    async def disconnect(self, code: int) -> None:
        if self.node_id is None:
            return
        try:
            await asyncio.wait_for(
                self.channel_layer.group_discard(node_group(self.node_id), self.channel_name),
                GROUP_OP_TIMEOUT_S,
            )
        except Exception as e:  # noqa: BLE001 - the group forgets a dead channel by itself (its expiry)
            log.warning("agent %s: leaving its command group failed (%s)", self.node_id, e.__class__.__name__)
        if await database_sync_to_async(services.mark_disconnected)(self.node_id, self.connected_at):
            await notify_fleet_async(self.node_id)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if self.node_id is None:
            return
        try:
            msg = parse_agent_message(content)
        except ControlError as e:
            if e.kind == "error":
                log.warning("agent %s sent a malformed error report: %s", self.node_id, e)
                return  # an error is never answered with an error: two ends that disagree would loop
            raise BadMessage(str(e)) from None
        if isinstance(msg, ErrorMessage):
            log.warning("agent %s refused a message: %s", self.node_id, msg.error)
        elif isinstance(msg, Hello):
            # The reported data-plane URL is checked (shape, host = this socket's peer, health probe)
            # before it can be routed to; a node that fails stays connected but unroutable.
            problem, rtt_ms = await self._check_dataplane(self.node_id, msg.dataplane_url)
            if problem:
                log.warning(
                    "agent %s: data plane %s not routable: %s", self.node_id, msg.dataplane_url, problem
                )
            self.unroutable_url = msg.dataplane_url if problem else None
            self.probed_at = time.monotonic()
            commands = await database_sync_to_async(_hello_sync)(self.node_id, msg, problem, rtt_ms)
            await notify_fleet_async(self.node_id)
            for command in commands:
                await self.send_message(command)
        elif isinstance(msg, Heartbeat):
            # True when the node came back from offline and must resync
            if await database_sync_to_async(services.apply_heartbeat)(self.node_id, msg.telemetry):
                await self.send_message(Resync())
            await notify_fleet_async(self.node_id)
            await _sweep_due()
            await self._reprobe()
        elif isinstance(msg, UpdateStatus):
            await database_sync_to_async(_update_status_sync)(self.node_id, msg)
            await notify_fleet_async(self.node_id)
        elif isinstance(msg, Progress):
            if await database_sync_to_async(_progress_sync)(self.node_id, msg):
                await notify_fleet_async(self.node_id, kind="placement")
            else:
                await self.send_error(f"assignment {msg.assignment_id} is not yours or is draining")

    async def _check_dataplane(self, node_id: str, url: str) -> tuple[str, float | None]:
        """webapp.fleet.probe's checks of `url` for `node_id` on this socket's peer address."""
        client = self.scope.get("client")
        return await check_dataplane(
            url,
            node_id,
            str(client[0]) if client else None,
            settings.DATAPLANE_ALLOWED_HOSTS,
            settings.DATAPLANE_PROBE_TIMEOUT_S,
        )

    async def _reprobe(self) -> None:
        url = self.unroutable_url
        if self.node_id is None or url is None:
            return
        if time.monotonic() - self.probed_at < settings.DATAPLANE_REPROBE_S:
            return
        self.probed_at = time.monotonic()
        problem, rtt_ms = await self._check_dataplane(self.node_id, url)
        if not problem:
            self.unroutable_url = None
            log.info("agent %s: data plane %s passed its check again: routable", self.node_id, url)
        # recorded only while the node still reports that URL (a newer hello wins)
        if await database_sync_to_async(services.apply_reprobe)(self.node_id, url, problem, rtt_ms):
            await notify_fleet_async(self.node_id)

    async def node_command(self, event: dict[str, Any]) -> None:
        """A command from a task (already a wire dict: the channel layer carries plain data)."""
        await self.send_json(event["command"])

    async def node_close(self, event: dict[str, Any]) -> None:
        await self.send_message(Removed())
        await self.close(code=CLOSE_REMOVED)


def _render_node_row(node_id: str) -> str:
    node = Node.objects.prefetch_related("shards__artifact").filter(pk=node_id).first()
    if node is None or node.state == Node.State.REMOVED:
        return f'<tr id="node-{node_id}" hx-swap-oob="delete"></tr>'
    html = render_to_string("fleet/htmx/node_row.html", {"node": node})
    return html.replace("<tr ", '<tr hx-swap-oob="outerHTML" ', 1)


class FleetConsumer(SafeJsonConsumer):
    """/ws/fleet/: staff dashboards; pushes re-rendered node rows (htmx out-of-band swaps)."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=CLOSE_UNAUTHORIZED)
            return
        await self.channel_layer.group_add(FLEET_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(FLEET_GROUP, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if not isinstance(content, dict) or content.get("type") != "sweep":
            raise BadMessage('the fleet socket accepts only {"type": "sweep"}')
        await sweep_offline_nodes_async()

    async def fleet_changed(self, event: dict[str, Any]) -> None:
        if event.get("node_id"):
            await self.send(text_data=await database_sync_to_async(_render_node_row)(event["node_id"]))
        if event.get("kind") in ("placement", "models"):
            await self.send(
                text_data='<div id="placement-refresh" hx-swap-oob="true" '
                'hx-get="/fleet/placement/" hx-trigger="load" hx-target="#placement"></div>'
            )
