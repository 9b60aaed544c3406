"""Fleet tasks: apply placement plans, push commands to agents, sweep silent nodes, replace lost ones.

Tasks take ids, never ORM objects; they claim work with conditional updates and send commands only
after their transaction commits (transaction.on_commit), so an agent never hears of a row that a
rollback erased.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from celery import shared_task
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agent.artifacts.routing import WHOLE_MODEL_BACKEND
from agent.wire.control import Drain, ServerMessage
from agent.wire.ids import NodeId
from webapp.catalog.models import ModelArtifact
from webapp.core.channels import group_send, node_group, notify_fleet, notify_fleet_async
from webapp.fleet import services
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.passkeys import rotate_passkey, tracker_paths
from webapp.fleet.placement import (
    Placement,
    PlacementError,
    PlannerNode,
    device_free_bytes,
    plan_placement,
    replan_lost,
    shape_from_manifest,
    trusted_speeds,
)
from webapp.fleet.protocol import AssignmentView, choose_backend, load_command, unload_command

log = logging.getLogger(__name__)
ACTIVE = [
    ShardAssignment.State.ASSIGNED,
    ShardAssignment.State.FETCHING,
    ShardAssignment.State.LOADING,
    ShardAssignment.State.READY,
]
PENDING = [ShardAssignment.State.ASSIGNED, ShardAssignment.State.FETCHING, ShardAssignment.State.LOADING]


def assignment_view(a: ShardAssignment) -> AssignmentView:
    tracker_url, web_seed_url = (
        tracker_paths(a.node_id, a.artifact.sha256) if a.artifact.infohash else ("", "")
    )
    return AssignmentView(
        a.pk, a.artifact.sha256, a.layer_start, a.layer_end, a.state, a.backend, tracker_url, web_seed_url
    )


def send_command(node_id: str, command: ServerMessage) -> None:
    """Relay a command to the node's socket; the channel layer carries it as its wire dict."""
    group_send(node_group(node_id), {"type": "node.command", "command": command.to_wire()})


def push_loads(assignment_ids: list[int]) -> None:
    for a in ShardAssignment.objects.select_related("artifact").filter(pk__in=assignment_ids):
        send_command(a.node_id, load_command(assignment_view(a)))
    notify_fleet(kind="placement")


def _planner_nodes(exclude: set[str] | None = None, whole: bool = False) -> list[PlannerNode]:
    """Online nodes with the memory they can still give: reported free memory minus the KV reserve and
    minus shards assigned but not yet loaded (those are not reflected in the report yet), and the speed
    the control plane measured or can bound (never the node's word alone: issue 17). With `whole` (a
    model that runs only whole) the memory is the llamacpp backend's, which its shard will run on."""
    nodes = [
        n
        for n in Node.objects.filter(state=Node.State.ONLINE).exclude(dataplane_url="")
        if not (exclude and n.id in exclude)
    ]
    ids = [n.id for n in nodes]
    speeds = trusted_speeds({n.id: n.speed for n in nodes}, services.wall_layer_ms(ids))
    out = []
    for n in nodes:
        pending = 0
        for a in ShardAssignment.objects.select_related("artifact").filter(node=n, state__in=PENDING):
            pending += shape_from_manifest(a.artifact.parsed_manifest).bytes_for(a.layer_start, a.layer_end)
        # the backend its shards will run on decides which memory counts (a GPU only for native)
        backend = (
            WHOLE_MODEL_BACKEND
            if whole
            else choose_backend(n.backends or [], False, settings.DEFAULT_BACKEND)
        )
        free = device_free_bytes(n.free_memory_bytes, n.hardware or {}, n.telemetry or {}, [backend])
        cap = free - settings.KV_RESERVE_BYTES - pending
        whole_model = WHOLE_MODEL_BACKEND in (n.backends or [])
        out.append(PlannerNode(NodeId(n.id), max(cap, 0), speeds[n.id], whole_model))
    return out


def _create(artifact: ModelArtifact, placements: list[Placement], whole: bool = False) -> list[int]:
    """Record the placements; a model that runs only whole gets the llamacpp backend (the planner chose
    nodes that have it), the others the settings' default where the node has it."""
    backends = dict(Node.objects.filter(pk__in={p.node_id for p in placements}).values_list("id", "backends"))
    preferred = WHOLE_MODEL_BACKEND if whole else settings.DEFAULT_BACKEND
    ids = []
    for p in placements:
        full = p.layer_start == 0 and p.layer_end == artifact.n_layers
        a = ShardAssignment.objects.create(
            node_id=p.node_id,
            artifact=artifact,
            layer_start=p.layer_start,
            layer_end=p.layer_end,
            backend=choose_backend(backends.get(p.node_id) or [], full, preferred),
        )
        ids.append(a.pk)
    return ids


@shared_task
def place_model(artifact_id: int, replicas: int | None = None) -> dict[str, Any]:
    """Plan and record shards for an artifact that has none active, then tell the agents.

    `replicas` (the place form's number) becomes the model's desired_replicas, the count re-placement
    keeps after a node is lost; without it the model's own setting is used (2 by default)."""
    with transaction.atomic():
        artifact = ModelArtifact.objects.select_for_update().get(pk=artifact_id)
        if artifact.state != ModelArtifact.State.READY:
            return {"ok": False, "error": f"model is {artifact.state}, not ready"}
        if ShardAssignment.objects.filter(artifact=artifact, state__in=ACTIVE).exists():
            return {"ok": False, "error": "model is already placed; unplace it first"}
        shape = shape_from_manifest(artifact.parsed_manifest)
        try:
            plan = plan_placement(
                _planner_nodes(whole=bool(shape.whole)), shape, replicas or artifact.desired_replicas
            )
        except PlacementError as e:
            return {"ok": False, "error": str(e)}
        if replicas and replicas != artifact.desired_replicas:
            artifact.desired_replicas = replicas
            artifact.save(update_fields=["desired_replicas", "updated_at"])
        ids = _create(artifact, list(plan.placements), whole=bool(shape.whole))
        transaction.on_commit(lambda: push_loads(ids))
    return {"ok": True, "assignments": ids, "replicas": plan.replicas, "notes": list(plan.notes)}


@shared_task
def unplace_model(artifact_id: int) -> int:
    """Drain every shard of an artifact; agents unload and report, which deletes the rows."""
    with transaction.atomic():
        rows = list(
            ShardAssignment.objects.select_related("artifact")
            .filter(artifact_id=artifact_id)
            .exclude(state=ShardAssignment.State.DRAINING)
        )
        ShardAssignment.objects.filter(pk__in=[a.pk for a in rows]).update(
            state=ShardAssignment.State.DRAINING
        )
        commands = [
            (a.node_id, unload_command(a.artifact.sha256, a.layer_start, a.layer_end, a.pk)) for a in rows
        ]

        def send_all() -> None:
            for n, c in commands:
                send_command(n, c)
            notify_fleet(kind="placement")

        transaction.on_commit(send_all)
    return len(rows)


@shared_task
def drain_node(node_id: str) -> bool:
    """Stop routing to a node and ask it to finish its sessions; its shards are replaced elsewhere."""
    with transaction.atomic():
        if (
            not Node.objects.filter(pk=node_id)
            .exclude(state=Node.State.REMOVED)
            .update(state=Node.State.DRAINING)
        ):
            return False

        def tell_node() -> None:
            send_command(node_id, Drain())
            notify_fleet(node_id)

        transaction.on_commit(tell_node)
    replace_lost_node.delay(node_id, ShardAssignment.State.DRAINING)
    return True


@shared_task
def remove_node(node_id: str) -> bool:
    """Revoke a node's credentials, close its socket, forget its shards and replace them."""
    with transaction.atomic():
        if (
            not Node.objects.filter(pk=node_id)
            .exclude(state=Node.State.REMOVED)
            .update(state=Node.State.REMOVED)
        ):
            return False
        Node.objects.get(pk=node_id).credentials.filter(revoked_at=None).update(revoked_at=timezone.now())
        rotate_passkey(node_id)  # its tracker passkey dies with it, even if the node is restored later

        def close_socket() -> None:
            group_send(node_group(node_id), {"type": "node.close"})
            notify_fleet(node_id)

        transaction.on_commit(close_socket)
    replace_lost_node.delay(node_id)
    return True


@shared_task
def replace_lost_node(node_id: str, mark: str = ShardAssignment.State.FAILED) -> dict[str, Any]:
    """Place the layers that only the lost node held onto the survivors, per artifact it served.

    The lost node's active shards become `mark` (failed when lost, draining when an admin drains it).
    """
    out: dict[str, Any] = {}
    with transaction.atomic():
        lost_rows = list(
            ShardAssignment.objects.select_related("artifact").filter(node_id=node_id, state__in=ACTIVE)
        )
        # Claim: only the first replacer flips them away from active states.
        claimed = ShardAssignment.objects.filter(pk__in=[a.pk for a in lost_rows], state__in=ACTIVE).update(
            state=mark, error="node lost" if mark == ShardAssignment.State.FAILED else "node draining"
        )
        if not claimed:
            return out
        new_ids: list[int] = []
        for artifact in {a.artifact_id: a.artifact for a in lost_rows}.values():
            current = [
                Placement(NodeId(a.node_id), a.layer_start, a.layer_end)
                for a in ShardAssignment.objects.filter(artifact=artifact, state__in=ACTIVE)
            ]
            shape = shape_from_manifest(artifact.parsed_manifest)
            try:
                placements = replan_lost(
                    _planner_nodes(exclude={node_id}, whole=bool(shape.whole)),
                    shape,
                    current,
                    NodeId(node_id),
                    target=artifact.desired_replicas,  # ranges below their replica count, not only holes
                )
            except PlacementError as e:
                log.warning("artifact %s: %s", artifact.pk, e)
                out[artifact.sha256] = str(e)
                if mark == ShardAssignment.State.FAILED:
                    _keep_with_lost_node([a for a in lost_rows if a.artifact_id == artifact.pk], mark)
                continue
            ids = _create(artifact, placements, whole=bool(shape.whole))
            new_ids += ids
            out[artifact.sha256] = ids
        transaction.on_commit(lambda: push_loads(new_ids))
    return out


def _keep_with_lost_node(rows: list[ShardAssignment], mark: str) -> None:
    """No survivor can take the lost node's layers: they stay assigned to it, as they were, rather than
    failed with nowhere to go. A node that was only unheard (the web down longer than the grace: agents
    heartbeat to it) serves them again when it reconnects, and the sweeper tries the replacement again
    on its next pass while the node stays silent (a node that joins meanwhile takes them)."""
    for a in rows:
        ShardAssignment.objects.filter(pk=a.pk, state=mark).update(state=a.state, error=a.error)


def dataplane_gone(node_id: str, url: str) -> bool:
    """Whether an offline node's data plane is gone too (its health check fails): then its shards are
    lost now, not after a grace. A node whose control socket dropped (a web restart, a network blip)
    but whose data plane still answers keeps serving routes, so it gets the grace."""
    if not url:
        return False  # never said where it serves: nothing to check, wait for the grace
    return async_to_sync(_dataplane_gone)(node_id, url)


async def _dataplane_gone(node_id: str, url: str) -> bool:
    from webapp.fleet.probe import probe_health

    problem, _ = await probe_health(url, node_id, float(settings.DATAPLANE_PROBE_TIMEOUT_S))
    return bool(problem)


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep found in the database: the nodes it marked offline, the offline ones lost now, and
    those lost only if their data plane is gone too (node id, data-plane URL: a health check each)."""

    flipped: list[str]
    lost: list[str]
    suspect: list[tuple[str, str]]


def plan_sweep() -> SweepPlan:
    """Mark silent nodes offline (the caller pings the dashboards about them); offline nodes with shards
    are lost once silent for NODE_LOST_AFTER_S, or for NODE_DEAD_AFTER_S (5 s) when their data plane is
    gone too; silence counted from the latest web start at the earliest (services.silence_start)."""
    flipped = [nid for nid in services.stale_online_nodes() if services.mark_offline_if_stale(nid)]
    lost_cutoff = timezone.now() - timedelta(seconds=settings.NODE_LOST_AFTER_S)
    dead_cutoff = timezone.now() - timedelta(seconds=settings.NODE_DEAD_AFTER_S)
    offline = (
        Node.objects.filter(state=Node.State.OFFLINE, shards__state__in=ACTIVE)
        .values_list("id", "last_seen", "dataplane_url")
        .distinct()
    )
    web_started = services.web_started_at()
    lost, suspect = [], []
    for nid, last_seen, url in list(offline):
        if last_seen is None:
            continue
        silent_since = services.silence_start(last_seen, web_started)
        if silent_since < lost_cutoff:
            lost.append(nid)
        elif silent_since < dead_cutoff and url:
            suspect.append((nid, url))
    return SweepPlan(flipped, lost, suspect)


@shared_task
def sweep_offline_nodes() -> list[str]:
    """plan_sweep, then replace the lost nodes' shards; returns the nodes marked offline."""
    plan = plan_sweep()
    for nid in plan.flipped:
        notify_fleet(nid)
    for nid in plan.lost + [nid for nid, url in plan.suspect if dataplane_gone(nid, url)]:
        replace_lost_node.delay(nid)
    return plan.flipped


async def sweep_offline_nodes_async() -> list[str]:
    """sweep_offline_nodes from the event loop (an agent's heartbeat, the fleet page). Only the database
    part runs on the thread that every consumer's database calls share: the health checks (up to
    DATAPLANE_PROBE_TIMEOUT_S each) run on the loop, and a broker's task publish (which waits while
    Redis restarts) in a thread of its own, so neither holds up other agents' welcomes and heartbeats."""
    plan = await database_sync_to_async(plan_sweep)()
    for nid in plan.flipped:  # the dashboards' pings too: from the loop, bounded
        await notify_fleet_async(nid)
    gone = await asyncio.gather(*(_dataplane_gone(nid, url) for nid, url in plan.suspect))
    lost = plan.lost + [nid for (nid, _), g in zip(plan.suspect, gone, strict=True) if g]
    # an eager task runs inline, database and all: that belongs on the shared thread
    publish = (
        database_sync_to_async(replace_lost_node.delay)
        if settings.CELERY_TASK_ALWAYS_EAGER
        else sync_to_async(replace_lost_node.delay, thread_sensitive=False)
    )
    for nid in lost:
        await publish(nid)
    return plan.flipped
