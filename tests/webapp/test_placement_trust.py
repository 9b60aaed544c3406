"""Issue 17, lying node at placement: a node's own speed report never wins it layers or layer 0.

A node claiming speed 1e6 once got the largest share of a chain and layer 0 (which sees every prompt),
because placement believed the clamped self-report. Now placement uses `trusted_speeds`: the wall-clock
step time the web process measured on routes through the node, else a neutral figure that the node's
claim can only lower.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from agent.wire.ids import NodeId
from webapp.catalog.models import ModelArtifact
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.placement import ModelShape, PlannerNode, plan_placement, trusted_speeds
from webapp.fleet.services import wall_layer_ms
from webapp.fleet.tasks import place_model
from webapp.routing.models import RouteSession
from webapp.telemetry.models import GenerationRecord

GB = 1 << 30

# --- the pure decision ---------------------------------------------------------------------------------


def test_unmeasured_nodes_get_the_neutral_speed_whatever_they_claim_above_it() -> None:
    assert trusted_speeds({"liar": 1e6, "honest": 1.0}, {}) == {"liar": 1.0, "honest": 1.0}


def test_a_claim_below_the_fleet_s_lower_median_lowers_an_unmeasured_node() -> None:
    speeds = trusted_speeds({"slow": 10.0, "mid": 20.0, "liar": 1e6}, {})
    assert speeds == {"slow": 0.5, "mid": 1.0, "liar": 1.0}


def test_claims_that_say_nothing_leave_the_neutral_figure() -> None:
    speeds = trusted_speeds({"nan": float("nan"), "zero": 0.0, "inf": float("inf"), "one": 1.0}, {})
    assert speeds == {"nan": 1.0, "zero": 1.0, "inf": 1.0, "one": 1.0}


def test_a_measured_node_gets_its_measurement_and_its_claim_is_ignored() -> None:
    speeds = trusted_speeds({"slow": 1e6, "fast": 1.0}, {"slow": 10.0, "fast": 2.0})
    assert speeds == pytest.approx({"slow": 0.1, "fast": 0.5})


def test_an_unmeasured_node_gets_the_median_measured_speed_at_most() -> None:
    claimed = {"a": 1.0, "b": 1.0, "c": 1.0, "new": 1e6, "modest": 0.5}
    speeds = trusted_speeds(claimed, {"a": 1.0, "b": 2.0, "c": 4.0})
    assert speeds["new"] == pytest.approx(0.5)  # the median of 1/1, 1/2, 1/4
    assert speeds["modest"] == pytest.approx(0.25)  # half the reference claim (1.0): half of neutral


def test_measurements_of_other_nodes_or_impossible_ones_are_not_used() -> None:
    speeds = trusted_speeds({"a": 1.0, "b": 1.0}, {"gone": 1.0, "a": 0.0, "b": float("nan")})
    assert speeds == {"a": 1.0, "b": 1.0}


def test_the_planner_given_trusted_speeds_gives_a_liar_no_more_layers_nor_layer_0() -> None:
    shape = ModelShape(layer_bytes=(10,) * 30)
    claimed = {"node-a-honest": 1.0, "node-b-liar": 1e6}

    def plan(speeds: dict[str, float]) -> dict[str, tuple[int, int]]:
        nodes = [PlannerNode(NodeId(n), 10**6, speeds[n]) for n in claimed]
        return {p.node_id: (p.layer_start, p.layer_end) for p in plan_placement(nodes, shape).placements}

    # The attack this closes: on the raw claims the liar got most layers and layer 0.
    believed = plan(claimed)
    assert believed["node-b-liar"] == (0, 24)
    trusted = plan(trusted_speeds(claimed, {}))
    assert trusted == {"node-a-honest": (0, 15), "node-b-liar": (15, 30)}


# --- through place_model, with nodes in the database -----------------------------------------------------


def _online(node_id: str, speed: float) -> Node:
    return Node.objects.create(
        id=node_id,
        name=node_id,
        state=Node.State.ONLINE,
        dataplane_url=f"http://{node_id}:1",
        free_memory_bytes=4 * GB,
        speed=speed,
        backends=["torch"],
        last_seen=timezone.now(),
    )


def _layers(artifact: Any) -> dict[str, tuple[int, int]]:
    rows = ShardAssignment.objects.filter(artifact=artifact).values_list(
        "node_id", "layer_start", "layer_end"
    )
    return {n: (a, b) for n, a, b in rows}


def _served(node: Node, tok_s: float, layers: int = 30) -> None:
    """An answer the web process recorded on a one-hop route through `node`, at `tok_s` (its clock),
    with per-hop figures the node could have faked to look nearly free."""
    other = ModelArtifact.objects.create(
        name=f"served-{node.id}-{tok_s}",
        source="path",
        path="/nonexistent",
        state=ModelArtifact.State.READY,
        sha256=hashlib.sha256(f"{node.id} {tok_s}".encode()).hexdigest(),
        n_layers=layers,
    )
    session = RouteSession.objects.create(
        artifact=other,
        hops=[{"node": node.id, "url": node.dataplane_url, "layer_start": 0, "layer_end": layers}],
        state=RouteSession.State.CLOSED,
    )
    GenerationRecord.objects.create(
        session=session,
        artifact=other,
        n_generated=20,
        tok_s=tok_s,
        hops=[{"url": node.dataplane_url, "layers": [0, layers], "compute_ms": 0.0, "network_ms": 0.01}],
    )


@pytest.mark.django_db
def test_a_node_claiming_speed_1e6_gets_no_more_layers_than_an_honest_one_before_either_served(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    honest, liar = _online("node-a-honest", 1.0), _online("node-b-liar", 1e6)
    assert place_model(artifact.pk, replicas=1)["ok"]
    placed = _layers(artifact)
    span = {n: b - a for n, (a, b) in placed.items()}
    assert span[liar.id] <= span[honest.id], placed
    assert placed[honest.id][0] == 0, placed
    # The claim changed nothing: the liar claiming what the honest node claims gets the same plan.
    ShardAssignment.objects.filter(artifact=artifact).delete()
    Node.objects.filter(pk=liar.pk).update(speed=1.0)
    assert place_model(artifact.pk, replicas=1)["ok"]
    assert _layers(artifact) == placed


@pytest.mark.django_db
def test_after_serving_the_faster_measured_node_gets_the_larger_share_and_layer_0(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    # The slow one claims 1e6 and sorts first by id: neither wins it anything once it is measured.
    slow, fast = _online("node-a-slow", 1e6), _online("node-b-fast", 1.0)
    _served(slow, tok_s=10.0)
    _served(fast, tok_s=30.0)
    assert wall_layer_ms([slow.id, fast.id]) == pytest.approx({slow.id: 100 / 30, fast.id: 100 / 90})
    assert place_model(artifact.pk, replicas=1)["ok"]
    placed = _layers(artifact)
    span = {n: b - a for n, (a, b) in placed.items()}
    assert span[fast.id] > span[slow.id], placed
    assert placed[fast.id][0] == 0, placed


@pytest.mark.django_db
def test_the_wall_clock_figure_ignores_old_failed_and_unrouted_answers() -> None:
    node = _online("node-a", 1.0)
    _served(node, tok_s=10.0)
    fresh = GenerationRecord.objects.get()
    GenerationRecord.objects.create(session=fresh.session, tok_s=1000.0, error="hop failed")
    GenerationRecord.objects.create(session=None, tok_s=1000.0)
    old = GenerationRecord.objects.create(session=fresh.session, tok_s=1000.0)
    GenerationRecord.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(hours=2))
    GenerationRecord.objects.create(session=fresh.session, tok_s=0.0)  # one token: no decode rate
    assert wall_layer_ms([node.id, "node-never-served"]) == pytest.approx({node.id: 100 / 30})
