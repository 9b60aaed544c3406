"""Opening route sessions: gather ready shards, choose a chain, mint one token per hop."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from agent.wire import routetoken
from agent.wire.ids import NodeId, SessionId
from webapp.catalog.models import ModelArtifact
from webapp.core.keys import route_signing_key
from webapp.fleet.models import Node, ShardAssignment
from webapp.routing.chooser import ShardCandidate, choose_route, hop_cost_ms
from webapp.routing.measure import assigned_sessions, observed_layer_ms
from webapp.routing.models import RouteSession


@dataclass(frozen=True)
class HopGrant:
    """One hop of an opened route, with the signed token its node will verify."""

    node_id: NodeId
    url: str
    layer_start: int
    layer_end: int
    token: bytes


def ready_candidates(artifact_id: int) -> list[ShardCandidate]:
    """Ready shards on online nodes whose data plane passed its checks, priced with the control plane's
    own load and step-time figures (never the node's `sessions` or `speed` reports: issue 17)."""
    rows = list(
        ShardAssignment.objects.select_related("node")
        .filter(
            artifact_id=artifact_id,
            state=ShardAssignment.State.READY,
            node__state=Node.State.ONLINE,
            node__dataplane_problem="",
        )
        .exclude(node__dataplane_url="")
    )
    node_ids = {r.node_id for r in rows}
    load = assigned_sessions(node_ids)
    layer_ms = observed_layer_ms(node_ids)
    return [
        ShardCandidate(
            NodeId(r.node_id),
            r.node.dataplane_url,
            r.layer_start,
            r.layer_end,
            1.0,
            load.get(r.node_id, 0),
            layer_ms.get(r.node_id),
        )
        for r in rows
    ]


def mint_hops(artifact: ModelArtifact, session_id: uuid.UUID, route: list[ShardCandidate]) -> list[HopGrant]:
    # Each hop's token names the hop after it: in chain mode a hop forwards only there (issue 17).
    tokens = routetoken.mint_route(
        route_signing_key(),
        SessionId(session_id.bytes),
        artifact.sha256,
        [routetoken.RouteHop(s.node_id, s.url, s.layer_start, s.layer_end) for s in route],
        settings.ROUTE_TOKEN_TTL_S,
    )
    return [
        HopGrant(s.node_id, s.url, s.layer_start, s.layer_end, token)
        for s, token in zip(route, tokens, strict=True)
    ]


def open_route(artifact_id: int, user: Any) -> tuple[RouteSession, list[HopGrant]]:
    """Choose a route for a new conversation and record it. Raises NoRoute when none exists."""
    artifact = ModelArtifact.objects.get(pk=artifact_id, state=ModelArtifact.State.READY)
    route = choose_route(ready_candidates(artifact_id), artifact.n_layers)
    session = RouteSession.objects.create(
        artifact=artifact,
        user=user if getattr(user, "is_authenticated", False) else None,
        hops=[
            {"node": s.node_id, "url": s.url, "layer_start": s.layer_start, "layer_end": s.layer_end}
            for s in route
        ],
    )
    return session, mint_hops(artifact, session.id, route)


MAX_POSITIONS = 2**31 - 1  # the column is a 32-bit integer; no context is anywhere near it


def touch_session(session_id: uuid.UUID, n_positions: int) -> None:
    RouteSession.objects.filter(pk=session_id).update(
        last_used=timezone.now(),
        n_positions=min(max(0, int(n_positions)), MAX_POSITIONS),
        n_turns=F("n_turns") + 1,
    )


def close_session(session_id: uuid.UUID, state: str = RouteSession.State.CLOSED) -> None:
    RouteSession.objects.filter(pk=session_id, state=RouteSession.State.OPEN).update(state=state)


# --- failover (issue 14) ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Replacement:
    """A hop taking over a failed hop's layers, and the hand-off grant from the old node to it."""

    grant: HopGrant
    handoff_token: bytes
    previous_token: bytes = b""  # the hop before, minted again to name the new hop as its next one


def replace_hop(
    session_id: uuid.UUID, layer_start: int, layer_end: int, failed_url: str, record: bool = True
) -> Replacement | None:
    """A ready shard of exactly [layer_start, layer_end) on another node for an open session's failed hop
    (the cheapest, so sessions spread over replicas), with its route token and a hand-off token naming
    the old node and the new one; with `record` the session's recorded route is updated (not for a
    warm spare, which only holds a copy). None when there is none."""
    from agent.wire.handofftoken import mint_handoff

    session = RouteSession.objects.select_related("artifact").filter(pk=session_id).first()
    if session is None or session.state != RouteSession.State.OPEN:
        return None
    hops: list[dict[str, Any]] = [h for h in session.hops if isinstance(h, dict)]
    index = next(
        (
            i
            for i, h in enumerate(hops)
            if (h.get("layer_start"), h.get("layer_end")) == (layer_start, layer_end)
        ),
        None,
    )
    if index is None:
        return None
    old_node = str(hops[index].get("node", ""))
    failed = routetoken.normalise_url(failed_url)
    candidates = [
        c
        for c in ready_candidates(session.artifact_id)
        if (c.layer_start, c.layer_end) == (layer_start, layer_end)
        and c.node_id != old_node
        and routetoken.normalise_url(c.url) != failed
    ]
    if not candidates:
        return None
    best = min(candidates, key=lambda c: (hop_cost_ms(c), c.node_id))
    key = route_signing_key()
    # its token names the hop after it; a warm spare (not recorded) gets one too, and so does the hop
    # before it, minted again to name it: a chain route's hop forwards only to the hop its token names
    planned = [
        routetoken.RouteHop(
            str(h.get("node", "")),
            str(h.get("url", "")),
            int(h.get("layer_start", 0)),
            int(h.get("layer_end", 0)),
        )
        for h in hops
    ]
    planned[index] = routetoken.RouteHop(best.node_id, best.url, layer_start, layer_end)
    token, previous = routetoken.mint_replacement(
        key, SessionId(session.id.bytes), session.artifact.sha256, planned, index, settings.ROUTE_TOKEN_TTL_S
    )
    handoff = (
        mint_handoff(
            key, session.id.bytes, session.artifact.sha256, layer_start, layer_end, old_node, best.node_id
        )
        if old_node
        else b""
    )
    if record:
        hops[index] = {
            "node": best.node_id,
            "url": best.url,
            "layer_start": layer_start,
            "layer_end": layer_end,
        }
        RouteSession.objects.filter(pk=session.pk).update(hops=hops)
    return Replacement(HopGrant(best.node_id, best.url, layer_start, layer_end, token), handoff, previous)


def replacement_provider(session_id: uuid.UUID) -> Any:
    """The route client's ReplacementProvider for a session the control plane opened (playground, API)."""
    from channels.db import database_sync_to_async

    from agent.client.recovery import STANDBY, Hop
    from agent.client.recovery import Replacement as ClientReplacement

    async def provide(index: int, route: list[Hop], reason: str) -> ClientReplacement | None:
        hop = route[index]
        rep = await database_sync_to_async(replace_hop)(
            session_id, hop.layer_start, hop.layer_end, hop.url, reason != STANDBY
        )
        if rep is None:
            return None
        g = rep.grant
        return ClientReplacement(
            Hop(g.url, g.layer_start, g.layer_end, g.token), rep.handoff_token, rep.previous_token
        )

    return provide
