"""The placement planner: pure functions, no database."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agent.wire.ids import NodeId
from webapp.fleet.placement import (
    ModelShape,
    Placement,
    PlacementError,
    PlannerNode,
    below_target,
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


def test_replica_chains_take_the_first_chain_s_ranges_so_every_hop_has_an_exact_spare() -> None:
    # speeds differ, so each chain split on its own would cut elsewhere (24 and 18): no hop would have
    # a copy of exactly its layers for the route client to move to
    nodes = [node(f"n{i}", 400, 1.0 + i) for i in range(4)]
    plan = plan_placement(nodes, shape(), replicas=2)
    spans = {c: sorted((p.layer_start, p.layer_end) for p in plan.placements if p.chain == c) for c in (0, 1)}
    assert spans[0] == spans[1] == [(0, 24), (24, 30)]
    assert below_target(30, list(plan.placements), 2) == [] and plan.notes == ()
    for a, b in spans[0]:
        assert len({p.node_id for p in plan.placements if (p.layer_start, p.layer_end) == (a, b)}) == 2
    # the larger range goes to the faster node of the second chain
    assert {(p.node_id, p.layer_start) for p in plan.placements if p.chain == 1} == {("n2", 0), ("n1", 24)}


def test_two_nodes_that_each_hold_the_model_get_a_whole_copy_each() -> None:
    plan = plan_placement([node("a", 1000), node("b", 1000)], shape(), replicas=2)
    assert plan.replicas == 2 and plan.notes == ()
    assert sorted((p.node_id, p.layer_start, p.layer_end) for p in plan.placements) == [
        ("a", 0, 30),
        ("b", 0, 30),
    ]


def test_replicas_that_cannot_share_boundaries_say_so() -> None:
    # three nodes, two chains: one node alone holds a whole copy, the other two split theirs
    plan = plan_placement([node("a", 1000, 3.0), node("b", 1000, 2.0), node("c", 1000, 1.0)], shape(), 2)
    assert plan.replicas == 2
    assert any("do not share their layer boundaries" in n for n in plan.notes)


def test_two_replicas_requested_but_memory_for_one_gives_one_with_a_note() -> None:
    plan = plan_placement([node("a", 200), node("b", 200)], shape(), replicas=2)  # the model needs 320 MB
    assert plan.replicas == 1 and covers(list(plan.placements), 30)
    assert plan.notes == ("only 1 of 2 requested replicas fit in the fleet's memory",)


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


# -- architecture rules: unsplittable groups, real (expert) bytes, the MTP head, refusal ------------------
def grouped(n: int = 12, size: int = 3, per_layer: int = 10 * MB) -> ModelShape:
    """A model whose layers come in unsplittable groups of `size` (glm-dsa's indexer groups)."""
    return replace(shape(n=n, per_layer=per_layer), groups=tuple((s, s + size) for s in range(0, n, size)))


def boundaries(placements: list[Placement]) -> set[int]:
    return {p.layer_start for p in placements} - {0}


def test_a_boundary_never_splits_an_unsplittable_layer_group() -> None:
    for n_nodes in (2, 3, 4, 5):
        plan = plan_placement([node(f"n{i}", 1000) for i in range(n_nodes)], grouped())
        assert covers(list(plan.placements), 12)
        assert boundaries(list(plan.placements)) <= {3, 6, 9}, n_nodes


def test_a_memory_cap_inside_a_group_cuts_before_the_group() -> None:
    # "a" could hold the embedding and 5 layers, but layers 3-5 are one group: it gets 0:3
    plan = plan_placement([node("a", 75, 3.0), node("b", 1000)], grouped())
    spans = {p.node_id: (p.layer_start, p.layer_end) for p in plan.placements}
    assert spans == {"a": (0, 3), "b": (3, 12)}


def test_a_group_no_node_can_hold_is_refused_naming_the_groups() -> None:
    with pytest.raises(PlacementError, match=r"layer groups .*0:6.* are never split"):
        plan_placement([node("a", 60), node("b", 60), node("c", 60)], grouped(size=6))


def test_replacing_a_lost_node_keeps_groups_whole() -> None:
    s = grouped()
    current = [Placement(NodeId("a"), 0, 3), Placement(NodeId("b"), 3, 12)]
    new = replan_lost([node("c", 50), node("d", 90)], s, current, NodeId("b"))
    assert covers([current[0], *new], 12)
    assert boundaries([current[0], *new]) <= {3, 6, 9}


def test_an_architecture_the_agent_cannot_serve_is_refused_before_planning() -> None:
    s = replace(shape(), refusal="not servable by this agent: architecture 'x' has no layer-window executor")
    with pytest.raises(PlacementError, match="not servable by this agent"):
        plan_placement([node("a", 10_000)], s)
    with pytest.raises(PlacementError, match="not servable by this agent"):
        replan_lost([node("a", 10_000)], s, [Placement(NodeId("b"), 0, 30)], NodeId("b"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from agent.artifacts.manifest import build_manifest
    from agent.artifacts.packaged import ModelNotFound, packaged_model_path
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny models carry SmolLM2's tokenizer: {e}")
    root = tmp_path_factory.mktemp("tiny-placement")

    def get(arch: str, mtp: bool = False):  # noqa: ANN202
        return build_manifest(write_tiny_gguf(arch, root / f"{arch}-{mtp}.gguf", mtp=mtp), hash_tensors=False)

    return get


def test_moe_layers_are_planned_with_their_experts_and_the_mtp_block_with_the_last_layers(tiny) -> None:  # noqa: ANN001
    m = tiny("qwen35moe", mtp=True)
    s = replace(shape_from_manifest(m), refusal="")  # planned as if the executor ran it
    assert s.layer_bytes == tuple(layer.nbytes for layer in m.layers)
    assert all(b > layer.expert_bytes > 0 for b, layer in zip(s.layer_bytes, m.layers, strict=True))
    mtp = sum(t.nbytes for t in m.tensors if t.layer == m.n_layers)
    assert s.bytes_for(4, 8) == m.bytes_for_range(4, 8) > sum(s.layer_bytes[4:8]) + mtp
    assert s.bytes_for(0, 4) == m.bytes_for_range(0, 4)
    assert shape_from_manifest(m).refusal == ""  # qwen35moe is servable since 21651fe


def test_glm_dsa_is_split_only_between_indexer_groups(tiny) -> None:  # noqa: ANN001
    s = replace(shape_from_manifest(tiny("glm-dsa")), refusal="")
    assert s.groups == ((0, 3), (3, 6))
    plan = plan_placement([node("a", 1000), node("b", 1000), node("c", 1000)], s)
    assert boundaries(list(plan.placements)) == {3}


def test_a_context_adds_each_layers_state_at_that_length(tiny) -> None:  # noqa: ANN001
    m = tiny("qwen35")
    at_4k = shape_from_manifest(m, context_tokens=4096)
    for layer, b in zip(m.layers, at_4k.layer_bytes, strict=True):
        assert b == layer.nbytes + layer.state_bytes(4096)
    # recurrent layers keep a fixed state; attention layers grow with the context
    assert at_4k.layer_bytes[0] - m.layers[0].nbytes == 4 * (384 + 1024)
    assert at_4k.layer_bytes[3] - m.layers[3].nbytes == 4096 * 2 * 2 * 16 * 2


@pytest.mark.django_db
def test_registering_a_model_the_agent_cannot_serve_marks_it_failed_with_the_reason(
    staff_client,
    tiny,
    tmp_path: Path,
    django_capture_on_commit_callbacks,  # noqa: ANN001
    settings,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.artifacts import archs, routing
    from agent.artifacts.tiny import write_tiny_gguf
    from webapp.catalog.models import ModelArtifact
    from webapp.fleet.tasks import place_model

    # every tiny architecture is servable now: take one away, from llama.cpp's too (else it would be
    # ready as whole-model-only, tests/webapp/test_routing_modes.py), to see the refusal
    monkeypatch.setattr(archs, "SERVABLE_ARCHITECTURES", archs.SERVABLE_ARCHITECTURES - {"deepseek4"})
    monkeypatch.setattr(routing, "WHOLE_ARCHITECTURES", routing.WHOLE_ARCHITECTURES - {"deepseek4"})
    path = write_tiny_gguf("deepseek4", tmp_path / "deepseek4.gguf")
    settings.MODELS_DIR = tmp_path  # path registrations only name files in the models directory
    with django_capture_on_commit_callbacks(execute=True):
        staff_client.post("/models/register", {"kind": "path", "path": str(path)})
    a = ModelArtifact.objects.get()
    assert a.state == ModelArtifact.State.FAILED
    assert a.error.startswith("not servable by this agent: architecture 'deepseek4'")
    assert (a.architecture, a.n_layers, a.sha256) == ("deepseek4", 6, "")
    assert place_model(a.pk) == {"ok": False, "error": "model is failed, not ready"}
