"""GPU-aware placement: a node whose native backend runs on a GPU is budgeted by that GPU's free memory."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from agent.wire.control import Gpu, Hardware, Hello, Telemetry
from webapp.fleet.models import Node, ShardAssignment
from webapp.fleet.placement import device_free_bytes
from webapp.fleet.services import apply_heartbeat, apply_hello
from webapp.fleet.tasks import place_model

GB = 1 << 30
MB = 1 << 20
H200 = {"index": 0, "name": "NVIDIA H200", "memory_bytes": 141 * GB}


def test_a_native_node_on_a_gpu_is_budgeted_by_that_gpus_free_memory() -> None:
    hw = {
        "compute_device": "CUDA1",
        "compute_gpu": 1,
        "gpus": [H200, {**H200, "index": 1, "memory_bytes": 24 * GB}],
    }
    live = {"gpus": [{"index": 0, "memory_free_bytes": 100 * GB}, {"index": 1, "memory_free_bytes": 20 * GB}]}
    assert device_free_bytes(8 * GB, hw, live, ["native", "llamacpp"]) == 20 * GB
    # no heartbeat yet: the GPU's size from hello
    assert device_free_bytes(8 * GB, hw, {}, ["native"]) == 24 * GB


@pytest.mark.parametrize(
    ("hardware", "backends"),
    [
        ({"compute_device": "CPU", "compute_gpu": None, "gpus": [H200]}, ["native"]),  # CPU build of ggml
        ({"compute_device": "CUDA0", "compute_gpu": 0, "gpus": [H200]}, ["torch"]),  # no native backend
        ({"compute_device": "CUDA3", "compute_gpu": 3, "gpus": [H200]}, ["native"]),  # GPU not reported
        ({}, ["native"]),  # an agent from before GPU telemetry
    ],
)
def test_host_memory_budgets_every_other_node(hardware: dict[str, Any], backends: list[str]) -> None:
    assert (
        device_free_bytes(8 * GB, hardware, {"gpus": [{"index": 0, "memory_free_bytes": GB}]}, backends)
        == 8 * GB
    )


def gpu_node(name: str, host_free: int, gpu_free: int, backends: list[str]) -> Node:
    """A node that said hello and sent a heartbeat the way an agent on a GPU host does."""
    node = Node.objects.create(name=name, state=Node.State.ONLINE, last_seen=timezone.now())
    apply_hello(
        node.pk,
        Hello(
            hardware=Hardware(
                compute_device="CUDA0",
                compute_gpu=0,
                gpus=[Gpu(index=0, name="NVIDIA L4", memory_bytes=24 * GB)],
            ),
            backends=backends,
            dataplane_url=f"http://{name}:1",
            speed=5.0,
            free_memory_bytes=host_free,
        ),
    )
    apply_heartbeat(
        node.pk,
        Telemetry(
            free_memory_bytes=host_free,
            gpus=[
                Gpu(
                    index=0,
                    name="NVIDIA L4",
                    memory_bytes=24 * GB,
                    memory_used_bytes=24 * GB - gpu_free,
                    memory_free_bytes=gpu_free,
                    utilization_percent=3.0,
                    temperature_c=40.0,
                    power_w=20.0,
                )
            ],
        ),
    )
    return node


@pytest.mark.django_db
def test_a_gpu_node_with_little_host_ram_holds_the_model_in_its_gpu_memory(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    node = gpu_node("gpu-host", host_free=10 * MB, gpu_free=4 * GB, backends=["native"])
    assert Node.objects.get(pk=node.pk).telemetry["gpus"][0]["memory_free_bytes"] == 4 * GB
    result = place_model(artifact.pk)
    assert result["ok"], result
    assert list(ShardAssignment.objects.values_list("node_id", "layer_start", "layer_end")) == [
        (node.pk, 0, artifact.n_layers)
    ]


@pytest.mark.django_db
def test_a_gpu_too_full_for_the_model_refuses_it_whatever_the_host_ram(artifact: Any, settings: Any) -> None:
    settings.KV_RESERVE_BYTES = 0
    gpu_node("gpu-host", host_free=64 * GB, gpu_free=10 * MB, backends=["native"])
    result = place_model(artifact.pk)
    assert not result["ok"] and "cannot hold the model" in result["error"]


@pytest.mark.django_db
def test_a_gpu_node_whose_shards_will_run_on_torch_is_budgeted_by_host_ram(
    artifact: Any, settings: Any
) -> None:
    settings.KV_RESERVE_BYTES = 0
    settings.DEFAULT_BACKEND = "torch"  # the planner's task assigns torch: the GPU is not where it runs
    gpu_node("gpu-host", host_free=10 * MB, gpu_free=4 * GB, backends=["native", "torch"])
    result = place_model(artifact.pk)
    assert not result["ok"] and "cannot hold the model" in result["error"]
