"""Models that run only whole: placed as one llamacpp shard per copy, refused naming the architecture and the
fallback when nothing can run them, and labelled "across nodes" / "whole on one node" in the catalog, the
playground's model picker and /v1/models."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from agent.artifacts import archs, routing
from agent.wire.ids import NodeId
from webapp.fleet.placement import (
    ModelShape,
    Placement,
    PlacementError,
    PlannerNode,
    plan_placement,
    replan_lost,
)

GB = 1 << 30
PHI3 = "architecture 'phi3' has no layer windows in the native executor yet; it runs as a whole model on one node"


def node(nid: str, cap: int, speed: float = 1.0, whole: bool = True) -> PlannerNode:
    return PlannerNode(NodeId(nid), cap, speed, whole)


def whole_shape(n_layers: int = 10, layer: int = 100) -> ModelShape:
    return ModelShape(layer_bytes=(layer,) * n_layers, whole=PHI3)


# -- the planner (pure) ------------------------------------------------------------------------------


def test_each_copy_is_every_layer_on_one_llamacpp_node_the_fastest_that_holds_it_first() -> None:
    nodes = [
        node("slow", 2000, speed=1.0),
        node("fast", 2000, speed=3.0),
        node("no-llamacpp", 50_000, speed=9.0, whole=False),  # fastest and largest, but cannot run it
        node("small", 500, speed=5.0),  # too small to hold all 1000 bytes
    ]
    plan = plan_placement(nodes, whole_shape(), replicas=3)
    assert plan.placements == (Placement(NodeId("fast"), 0, 10, 0), Placement(NodeId("slow"), 0, 10, 1))
    assert plan.replicas == 2
    assert plan.notes[0] == f"whole model on one node per copy: {PHI3}"
    assert "only 2 of 3 requested replicas fit" in plan.notes[1]


def test_a_whole_only_model_is_never_split_even_when_two_nodes_together_would_hold_it() -> None:
    with pytest.raises(PlacementError) as e:
        plan_placement([node("a", 600), node("b", 600)], whole_shape())
    msg = str(e.value)
    assert msg.startswith(PHI3)
    assert "it needs 0.0 MB on one node, but the largest of the 2 node(s) with the llamacpp backend" in msg


def test_a_fleet_without_the_llamacpp_backend_is_told_so_naming_the_architecture() -> None:
    with pytest.raises(PlacementError) as e:
        plan_placement([node("a", 10_000, whole=False)], whole_shape())
    assert str(e.value).startswith("architecture 'phi3' has no layer windows")
    assert "no online node has the llamacpp backend (install the agent with its [llamacpp] extra" in str(
        e.value
    )


def test_a_lost_copy_is_replaced_whole_on_another_llamacpp_node() -> None:
    current = [Placement(NodeId("a"), 0, 10, 0), Placement(NodeId("b"), 0, 10, 1)]
    nodes = [node("a", 5000), node("c", 5000, speed=2.0), node("d", 5000, speed=9.0, whole=False)]
    assert replan_lost(nodes, whole_shape(), current, NodeId("b"), target=2) == [
        Placement(NodeId("c"), 0, 10, 1)
    ]
    # nowhere to put a second copy while one survives: routes still work, nothing to do
    assert replan_lost([node("a", 5000)], whole_shape(), current, NodeId("b"), target=2) == []
    with pytest.raises(PlacementError, match="cannot replace lost node a: architecture 'phi3'"):
        replan_lost([node("c", 500)], whole_shape(), current[:1], NodeId("a"), target=1)


# -- with the database -------------------------------------------------------------------------------


@pytest.fixture
def phi3(artifact: Any) -> Any:
    """SmolLM2's artifact relabelled as a phi3 file: an architecture the executor lacks, llama.cpp runs."""
    m = copy.deepcopy(artifact.manifest)
    m["architecture"] = "phi3"
    artifact.manifest, artifact.architecture, artifact.name = m, "phi3", "Phi-3"
    artifact.save()
    return artifact


def online(name: str, backends: list[str], free: int = 8 * GB) -> Any:
    from webapp.fleet.models import Node

    return Node.objects.create(
        name=name,
        state=Node.State.ONLINE,
        dataplane_url=f"http://{name}:1",
        free_memory_bytes=free,
        backends=backends,
        last_seen=timezone.now(),
    )


@pytest.mark.django_db
def test_placing_a_whole_only_model_puts_every_layer_on_one_node_with_the_llamacpp_backend(phi3: Any) -> None:
    from webapp.fleet.models import ShardAssignment
    from webapp.fleet.tasks import place_model, replace_lost_node

    online("native-only", ["native"], free=64 * GB)
    a, b = online("a", ["native", "llamacpp"]), online("b", ["native", "llamacpp"])
    result = place_model(phi3.pk, replicas=2)
    assert result["ok"] and result["replicas"] == 2, result
    assert any("whole model on one node per copy: architecture 'phi3'" in n for n in result["notes"])
    rows = ShardAssignment.objects.filter(artifact=phi3)
    assert {(r.node_id, r.layer_start, r.layer_end, r.backend) for r in rows} == {
        (a.pk, 0, 30, "llamacpp"),
        (b.pk, 0, 30, "llamacpp"),
    }
    # losing one copy with no other llamacpp node left keeps the survivor and splits nothing
    assert replace_lost_node(b.pk) == {phi3.sha256: []}
    assert not ShardAssignment.objects.filter(artifact=phi3, node__name="native-only").exists()


@pytest.mark.django_db
def test_placing_a_whole_only_model_on_a_fleet_without_llamacpp_says_what_is_missing(phi3: Any) -> None:
    from webapp.fleet.models import ShardAssignment
    from webapp.fleet.tasks import place_model

    online("a", ["native"])
    result = place_model(phi3.pk)
    assert not result["ok"]
    assert result["error"].startswith("architecture 'phi3' has no layer windows in the native executor")
    assert "no online node has the llamacpp backend" in result["error"]
    assert not ShardAssignment.objects.exists()


@pytest.mark.django_db
def test_the_place_button_shows_why_a_whole_only_model_found_no_node(staff_client: Any, phi3: Any) -> None:
    online("a", ["native"])
    r = staff_client.post(f"/models/{phi3.pk}/place", {"replicas": "1"})
    assert r.status_code == 409
    body = r.content.decode().replace("&#x27;", "'")
    assert "<p class=\"error\">architecture 'phi3' has no layer windows in the native executor yet" in body
    assert "no online node has the llamacpp backend" in body


def _register(staff_client: Any, path: Path, capture: Any) -> Any:
    from webapp.catalog.models import ModelArtifact

    with capture(execute=True):
        staff_client.post("/models/register", {"kind": "path", "path": str(path)})
    return ModelArtifact.objects.get()


@pytest.fixture
def tiny_qwen3(tiny_in_models_dir: Callable[[str], Path]) -> Path:
    return tiny_in_models_dir("qwen3")


@pytest.mark.django_db
def test_a_registered_model_without_layer_windows_is_ready_as_whole_only_and_labelled_so(
    staff_client: Any,
    tiny_qwen3: Path,
    django_capture_on_commit_callbacks: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(archs, "SERVABLE_ARCHITECTURES", archs.SERVABLE_ARCHITECTURES - {"qwen3"})
    a = _register(staff_client, tiny_qwen3, django_capture_on_commit_callbacks)
    assert (a.state, a.error, a.architecture) == ("ready", "", "qwen3")
    assert a.routing.mode == "whole" and "'qwen3' has no layer windows" in a.routing.reason
    page = staff_client.get("/models/").content.decode()
    assert 'class="badge routing-whole"' in page and "whole on one node</span>" in page
    assert (
        "it runs as a whole model on one node with the llamacpp backend" in page
    )  # the reason, as its title


@pytest.mark.django_db
def test_registering_a_model_nothing_can_run_is_refused_naming_the_architecture_and_the_fallback(
    staff_client: Any,
    tiny_qwen3: Path,
    django_capture_on_commit_callbacks: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(archs, "SERVABLE_ARCHITECTURES", archs.SERVABLE_ARCHITECTURES - {"qwen3"})
    monkeypatch.setattr(routing, "WHOLE_ARCHITECTURES", routing.WHOLE_ARCHITECTURES - {"qwen3"})
    a = _register(staff_client, tiny_qwen3, django_capture_on_commit_callbacks)
    assert a.state == "failed" and a.sha256 == ""
    assert a.error.startswith("not servable by this agent: architecture 'qwen3' has no layer-window executor")
    assert "the fallback, a whole model on one node with the llamacpp backend, is closed too" in a.error
    assert a.error in staff_client.get("/models/").content.decode().replace("&#x27;", "'")


@pytest.mark.django_db
def test_the_catalog_and_the_playground_label_each_model_across_nodes_or_whole(
    staff_client: Any, phi3: Any, manifest: Any, model_path: str
) -> None:
    from webapp.catalog.models import ModelArtifact

    ModelArtifact.objects.create(
        name="SmolLM2",
        source=ModelArtifact.Source.PACKAGE,
        path=model_path,
        state=ModelArtifact.State.READY,
        sha256="0" * 64,
        n_layers=manifest.n_layers,
        architecture="llama",
        manifest=json.loads(manifest.to_json()),
    )
    catalog = staff_client.get("/models/").content.decode()
    assert (
        catalog.count('class="badge routing-whole"') == 1
        and catalog.count('class="badge routing-layers"') == 1
    )
    page = staff_client.get("/playground/").content.decode()
    assert (
        'data-name="Phi-3" data-routing="whole"' in page and "Phi-3 · whole on one node (not placed)" in page
    )
    assert (
        'data-name="SmolLM2" data-routing="layers"' in page and "SmolLM2 · across nodes (not placed)" in page
    )


@pytest.mark.django_db(transaction=True)
async def test_v1_models_says_for_each_model_whether_it_routes_across_nodes_or_runs_whole(
    async_client: Any, member: Any, phi3: Any, settings: Any
) -> None:
    from channels.db import database_sync_to_async

    from webapp.api import keys

    settings.REDIS_URL = ""  # rate windows in this process
    plain, _ = await database_sync_to_async(keys.create_key)(member, "test")
    headers = {"Authorization": f"Bearer {plain}"}
    body = json.loads((await async_client.get("/v1/models", headers=headers)).content)
    [m] = body["data"]
    assert set(m) == {"id", "object", "created", "owned_by", "x_swarm"}  # OpenAI's shape, our extension
    assert (m["id"], m["object"], m["x_swarm"]["architecture"]) == ("Phi-3", "model", "phi3")
    assert m["x_swarm"]["routing"] == "whole"
    assert m["x_swarm"]["routing_reason"].startswith(PHI3)
    one = json.loads((await async_client.get("/v1/models/Phi-3", headers=headers)).content)
    assert one == m
