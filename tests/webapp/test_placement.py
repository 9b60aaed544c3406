"""The placement planner: pure functions, no database."""

from __future__ import annotations

import pytest

from agent.wire.ids import NodeId
from webapp.fleet.placement import (
    ModelShape,
    Placement,
    PlacementError,
    PlannerNode,
    plan_placement,
    replan_lost,
    shape_from_manifest,
    uncovered_ranges,
)

MB = 1_000_000


def shape(n: int = 30, per_layer: int = 10 * MB, embd: int = 20 * MB) -> ModelShape:
    """A llama-like model with tied embeddings: first and last shards both need token_embd."""
    return ModelShape(
        layer_bytes=tuple([per_layer] * n),
        tensor_bytes={"token_embd.weight": embd, "output_norm.weight": 1},
        first=frozenset({"token_embd.weight"}),
        last=frozenset({"output_norm.weight", "token_embd.weight"}),
    )


def node(name: str, mb: int, speed: float = 1.0) -> PlannerNode:
    return PlannerNode(NodeId(name), mb * MB, speed)


def covers(placements: list[Placement], n: int) -> bool:
    ordered = sorted(placements, key=lambda p: p.layer_start)
    pos = 0
    for p in ordered:
        if p.layer_start != pos:
            return False
        pos = p.layer_end
    return pos == n


def test_one_replica_uses_every_node_and_covers_all_layers_contiguously() -> None:
    plan = plan_placement([node("a", 1000), node("b", 1000)], shape())
    assert plan.replicas == 1
    assert covers(list(plan.placements), 30)
    assert {p.node_id for p in plan.placements} == {"a", "b"}
    assert sorted(p.layer_end - p.layer_start for p in plan.placements) == [15, 15]


def test_a_heterogeneous_fleet_gets_shares_proportional_to_speed() -> None:
    plan = plan_placement([node("fast", 1000, 3.0), node("slow", 1000, 1.0)], shape(n=40))
    sizes = {p.node_id: p.layer_end - p.layer_start for p in plan.placements}
    assert sizes == {"fast": 30, "slow": 10}


def test_memory_caps_a_fast_node_and_the_rest_goes_to_others() -> None:
    # "fast" would get 30 of 40 layers by speed, but only 100 MB fit: embedding 20 MB + 8 layers.
    plan = plan_placement([node("fast", 100, 3.0), node("slow", 1000, 1.0)], shape(n=40))
    sizes = {p.node_id: (p.layer_start, p.layer_end) for p in plan.placements}
    assert sizes["fast"] == (0, 8)
    assert sizes["slow"] == (8, 40)
    assert covers(list(plan.placements), 40)


def test_a_node_is_never_given_more_than_it_can_hold() -> None:
    s = shape(n=30)
    nodes = [node("a", 90, 5.0), node("b", 120, 1.0), node("c", 200, 1.0)]
    plan = plan_placement(nodes, s)
    cap = {n.node_id: n.capacity_bytes for n in nodes}
    for p in plan.placements:
        assert s.bytes_for(p.layer_start, p.layer_end) <= cap[p.node_id]
    assert covers(list(plan.placements), 30)


def test_replicas_are_disjoint_chains_each_covering_every_layer() -> None:
    nodes = [node(f"n{i}", 400, 1.0 + i) for i in range(4)]
    plan = plan_placement(nodes, shape(), replicas=2)
    assert plan.replicas == 2
    chains = {c: [p for p in plan.placements if p.chain == c] for c in (0, 1)}
    for ch in chains.values():
        assert covers(ch, 30)
    assert not ({p.node_id for p in chains[0]} & {p.node_id for p in chains[1]})


def test_fewer_replicas_than_requested_when_memory_is_short_with_a_note() -> None:
    # Whole model is 340 MB (30 x 10 + 20 + 20 for the tied embedding at both ends... counted once: 320).
    nodes = [node("a", 200), node("b", 200), node("c", 100)]
    plan = plan_placement(nodes, shape(), replicas=3)
    assert plan.replicas == 1
    assert covers(list(plan.placements), 30)
    assert "only 1 of 3" in plan.notes[0]


def test_a_fleet_too_small_gets_a_clear_error_naming_the_shortfall() -> None:
    with pytest.raises(
        PlacementError, match=r"cannot hold the model: it needs 320\.0 MB.*2 node\(s\) have 200\.0 MB"
    ):
        plan_placement([node("a", 100), node("b", 100)], shape())


def test_an_empty_fleet_gets_a_clear_error() -> None:
    with pytest.raises(PlacementError, match="no node has free memory"):
        plan_placement([node("a", 0)], shape())


def test_a_tied_embedding_is_counted_once_when_one_node_holds_both_ends() -> None:
    s = shape(n=2, per_layer=1, embd=100)
    assert s.bytes_for(0, 2) == 2 + 100 + 1
    assert s.bytes_for(0, 1) == 1 + 100
    assert s.bytes_for(1, 2) == 1 + 100 + 1


def test_a_lost_node_is_replaced_for_exactly_the_range_it_held() -> None:
    s = shape()
    current = [Placement(NodeId("a"), 0, 10), Placement(NodeId("b"), 10, 20), Placement(NodeId("c"), 20, 30)]
    survivors = [node("a", 500, 1.0), node("c", 500, 2.0), node("d", 500, 3.0)]
    new = replan_lost(survivors, s, current, NodeId("b"))
    assert new == [Placement(NodeId("d"), 10, 20)]


def test_a_lost_range_is_split_when_no_single_survivor_can_hold_it() -> None:
    s = shape()
    current = [Placement(NodeId("a"), 0, 10), Placement(NodeId("b"), 10, 30)]
    survivors = [node("c", 120), node("d", 120)]  # the lost range needs 20 x 10 MB + embedding
    new = replan_lost(survivors, s, current, NodeId("b"))
    assert covers([current[0], *new], 30)
    assert {p.node_id for p in new} == {"c", "d"}


def test_a_lost_node_with_a_live_replica_needs_no_new_shards() -> None:
    current = [Placement(NodeId("a"), 0, 30, 0), Placement(NodeId("b"), 0, 30, 1)]
    assert replan_lost([node("a", 0), node("c", 1000)], shape(), current, NodeId("b")) == []


def test_replacing_a_lost_node_fails_clearly_when_survivors_are_full() -> None:
    current = [Placement(NodeId("a"), 0, 15), Placement(NodeId("b"), 15, 30)]
    with pytest.raises(PlacementError, match="cannot replace lost node b"):
        replan_lost([node("a", 10)], shape(), current, NodeId("b"))


def test_uncovered_ranges_are_maximal_runs() -> None:
    ps = [Placement(NodeId("a"), 0, 3), Placement(NodeId("b"), 5, 6)]
    assert uncovered_ranges(8, ps) == [(3, 5), (6, 8)]


def test_the_shape_of_the_real_smollm2_manifest_places_across_two_nodes(manifest) -> None:  # noqa: ANN001
    s = shape_from_manifest(manifest)
    assert s.n_layers == 30
    assert s.total_bytes == manifest.bytes_for_range(0, 30)
    assert s.bytes_for(0, 12) == manifest.bytes_for_range(0, 12)
    assert s.bytes_for(12, 30) == manifest.bytes_for_range(12, 30)
    plan = plan_placement([node("a", 10_000), node("b", 10_000)], s)
    assert covers(list(plan.placements), 30) and len(plan.placements) == 2


def test_a_wildly_low_speed_probe_is_clamped_so_no_node_gets_a_sliver() -> None:
    plan = plan_placement([node("fast", 1000, 30.0), node("noisy", 1000, 0.2)], shape(n=30))
    sizes = {p.node_id: p.layer_end - p.layer_start for p in plan.placements}
    assert sizes == {"fast": 24, "noisy": 6}
