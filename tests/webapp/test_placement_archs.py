"""The planner's per-architecture rules: leading dense layers, the head and MTP with the last layers,
unsplittable groups together with a dense prefix, and memory from per-session state at a context."""

from __future__ import annotations

from dataclasses import replace

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
)

MB = 1_000_000


def node(name: str, mb: int, speed: float = 1.0) -> PlannerNode:
    return PlannerNode(NodeId(name), mb * MB, speed)


def moe(n: int = 12, dense: int = 3, dense_mb: int = 2, moe_mb: int = 20, head_mb: int = 30) -> ModelShape:
    """A MoE model: `dense` small dense layers, then MoE layers; untied head and an MTP block last."""
    return ModelShape(
        layer_bytes=tuple([dense_mb * MB] * dense + [moe_mb * MB] * (n - dense)),
        tensor_bytes={
            "token_embd.weight": head_mb * MB,
            "output.weight": head_mb * MB,
            "blk.12.mtp": moe_mb * MB,
        },
        first=frozenset({"token_embd.weight"}),
        last=frozenset({"output.weight", "blk.12.mtp"}),
        leading_dense=dense,
    )


def spans(placements: tuple[Placement, ...] | list[Placement]) -> list[tuple[int, int]]:
    return sorted((p.layer_start, p.layer_end) for p in placements)


def test_leading_dense_layers_stay_with_the_first_shard_and_its_first_moe_layer() -> None:
    for n_nodes in (2, 3, 4, 6, 12):
        plan = plan_placement([node(f"n{i}", 10_000) for i in range(n_nodes)], moe())
        first = min(plan.placements, key=lambda p: p.layer_start)
        assert first.layer_start == 0 and first.layer_end >= 4, n_nodes
        assert spans(plan.placements)[-1][1] == 12


def test_a_share_smaller_than_the_dense_prefix_grows_to_cover_it() -> None:
    # by speed each of six nodes would get 2 layers; the first gets the 3 dense layers and a MoE layer
    plan = plan_placement([node(f"n{i}", 10_000) for i in range(6)], moe())
    assert spans(plan.placements)[0] == (0, 4)
    assert spans(plan.placements)[-1][1] == 12


def test_a_first_node_too_small_for_the_dense_prefix_is_refused_naming_the_rule() -> None:
    # the embedding (30) + 3 dense (6) + the first MoE layer (20) = 56 MB; "a" has 50
    with pytest.raises(PlacementError, match="3 leading dense layers stay with the first shard"):
        plan_placement([node("a", 50), node("b", 50), node("c", 50), node("d", 50), node("e", 50)], moe())


def test_the_head_and_mtp_block_are_counted_on_the_last_shard_only() -> None:
    s = moe()
    assert s.bytes_for(0, 4) == 30 * MB + 3 * 2 * MB + 20 * MB
    assert s.bytes_for(8, 12) == 4 * 20 * MB + 30 * MB + 20 * MB
    # a last node with room for the head, the MTP block and 2 layers only: the rest moves earlier
    plan = plan_placement([node("a", 10_000), node("tail", 90)], s)
    assert {p.node_id: (p.layer_start, p.layer_end) for p in plan.placements}["tail"] == (10, 12)


def test_dense_prefix_and_indexer_groups_combine_to_the_first_allowed_cut() -> None:
    # GLM-5.2-like: 3 dense layers and indexer groups [2,6) [6,10) [10,12): the first cut is at 6
    s = replace(moe(), groups=((2, 6), (6, 10), (10, 12)))
    assert [i for i in range(1, 12) if s.cut_ok(i)] == [6, 10]
    plan = plan_placement([node(f"n{i}", 10_000) for i in range(4)], s)
    assert {p.layer_start for p in plan.placements} - {0} <= {6, 10}


def test_a_replacement_of_the_first_shard_keeps_the_dense_prefix_whole() -> None:
    current = [Placement(NodeId("a"), 0, 6), Placement(NodeId("b"), 6, 12)]
    new = replan_lost([node("c", 45), node("d", 1000)], moe(), current, NodeId("a"))
    assert spans(new)[0][0] == 0 and spans(new)[0][1] >= 4
    assert spans(new)[-1][1] == 6


def test_an_all_dense_model_is_not_forced_onto_one_node() -> None:
    s = replace(moe(n=4, dense=4), leading_dense=4)
    assert not any(s.cut_ok(i) for i in range(1, 4))  # every layer dense: the prefix rule covers them all
    dense_free = replace(s, leading_dense=0)
    assert len(plan_placement([node("a", 1000), node("b", 1000)], dense_free).placements) == 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from agent.artifacts.manifest import build_manifest
    from agent.artifacts.packaged import ModelNotFound, packaged_model_path
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny models carry SmolLM2's tokenizer: {e}")
    root = tmp_path_factory.mktemp("tiny-placement-archs")

    def get(arch: str, mtp: bool = False):  # noqa: ANN202
        return build_manifest(write_tiny_gguf(arch, root / f"{arch}-{mtp}.gguf", mtp=mtp), hash_tensors=False)

    return get


def test_the_manifests_dense_prefix_reaches_the_planner(tiny) -> None:  # noqa: ANN001
    m = tiny("glm-dsa")
    s = shape_from_manifest(m)
    assert m.leading_dense_layers == 1 and s.leading_dense == 1
    assert not s.cut_ok(1)


def test_expected_sessions_multiply_each_layers_state_at_the_context(tiny) -> None:  # noqa: ANN001
    m = tiny("deepseek4")
    one = shape_from_manifest(m, context_tokens=8192)
    four = shape_from_manifest(m, context_tokens=8192, sessions=4)
    for layer, a, b in zip(m.layers, one.layer_bytes, four.layer_bytes, strict=True):
        assert a - layer.nbytes == layer.state_bytes(8192) > 0
        assert b - layer.nbytes == 4 * layer.state_bytes(8192)
    # compressed layers grow with the context far slower than their raw window would suggest
    kinds = {layer.state_kind for layer in m.layers}
    assert kinds == {"kv", "compressed_kv"}
    with pytest.raises(PlacementError, match="at least 1"):
        shape_from_manifest(m, context_tokens=8192, sessions=0)


def test_state_at_a_long_context_spreads_the_model_over_more_nodes(tiny) -> None:  # noqa: ANN001
    m = tiny("glm-dsa")
    weights = replace(shape_from_manifest(m), refusal="")
    busy = replace(shape_from_manifest(m, context_tokens=131072, sessions=8), refusal="")
    cap = weights.total_bytes + 1  # one node holds the weights alone
    assert len(plan_placement([node("a", cap // MB + 1)], weights).placements) == 1
    need = busy.total_bytes
    assert need > 2 * weights.total_bytes
    with pytest.raises(PlacementError):
        plan_placement([node("a", cap // MB + 1)], busy)
    plan = plan_placement([PlannerNode(NodeId(f"n{i}"), need, 1.0) for i in range(3)], busy)
    assert spans(plan.placements)[-1][1] == m.n_layers
