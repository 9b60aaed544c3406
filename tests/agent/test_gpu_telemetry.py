"""GPU telemetry through a fake NVML at the seam (agent/node/gpu.py), and the native compute device."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.node import gpu
from agent.node.config import NodeConfig
from agent.node.control import ControlAgent, hardware_info
from agent.wire.control import Heartbeat, Hello, parse_agent_message

GB = 1 << 30


class NotSupported(Exception):
    """What nvidia-ml-py raises for a query the driver does not support."""


class FakeNvml:
    """The handful of pynvml calls the agent makes, over two GPUs; GPU 1 cannot report its power."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self) -> None:
        self.inits = 0
        self.used = [3 * GB, 1 * GB]

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:  # noqa: N802
        return [b"NVIDIA H200", b"NVIDIA L4"][h]

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:  # noqa: N802
        total = [141 * GB, 24 * GB][h]
        return SimpleNamespace(total=total, used=self.used[h], free=total - self.used[h])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        return SimpleNamespace(gpu=[87, 0][h], memory=[40, 0][h])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:  # noqa: N802
        assert sensor == self.NVML_TEMPERATURE_GPU
        return [64, 31][h]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:  # noqa: N802
        if h == 1:
            raise NotSupported("power")
        return 412_500  # milliwatts


class BrokenNvml(FakeNvml):
    def nvmlInit(self) -> None:  # noqa: N802
        raise RuntimeError("NVML Shared Library Not Found")


def test_nvml_reports_memory_use_utilisation_temperature_and_power_per_gpu() -> None:
    fake = FakeNvml()
    gpus = gpu.nvml_gpus(fake)
    assert [g.name for g in gpus] == ["NVIDIA H200", "NVIDIA L4"]
    h200, l4 = gpus
    assert (h200.index, h200.memory_bytes, h200.memory_used_bytes, h200.memory_free_bytes) == (
        0,
        141 * GB,
        3 * GB,
        138 * GB,
    )
    assert (h200.utilization_percent, h200.temperature_c, h200.power_w) == (87.0, 64.0, 412.5)
    assert l4.index == 1 and l4.power_w is None and l4.temperature_c == 31.0  # unsupported: unknown, not 0
    fake.used[0] = 100 * GB
    assert gpu.nvml_gpus(fake)[0].memory_free_bytes == 41 * GB  # live on every call
    assert fake.inits == 1  # initialised once per process


def test_hello_carries_gpu_sizes_only_and_no_nvml_means_no_gpus() -> None:
    sizes = gpu.nvml_gpus(FakeNvml(), live=False)
    assert sizes[0].memory_bytes == 141 * GB and sizes[0].memory_free_bytes is None
    assert gpu.nvml_gpus(BrokenNvml()) == []


def test_a_cuda_build_puts_shards_on_the_first_gpu_and_names_its_nvml_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    devices = [
        gpu.GgmlDevice("CUDA0", "NVIDIA H200", "gpu", 138 * GB, 141 * GB),
        gpu.GgmlDevice("CUDA1", "NVIDIA L4", "gpu", 23 * GB, 24 * GB),
        gpu.GgmlDevice("CPU", "x86", "cpu", 0, 0),
    ]
    monkeypatch.delenv("GGSWARM_DEVICE", raising=False)
    assert gpu.compute_device(devices) == devices[0]
    monkeypatch.setenv("GGSWARM_DEVICE", "CUDA1")
    assert gpu.compute_device(devices) == devices[1]
    monkeypatch.setattr(gpu, "ggml_devices", lambda: devices)
    assert gpu.native_compute_device() == ("CUDA1", 1)
    monkeypatch.setenv("GGSWARM_DEVICE", "CPU")
    assert gpu.native_compute_device() == ("CPU", None)
    assert gpu.nvml_index("Vulkan0") is None


def test_this_hosts_native_library_lists_its_ggml_devices() -> None:
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    devices = gpu.ggml_devices()
    assert any(d.kind == "cpu" for d in devices)
    dev = gpu.compute_device(devices)
    assert dev is not None and dev.name


class Host:
    def stats(self) -> dict[str, Any]:
        return {"sessions": 1, "kv_bytes": 5, "kv_budget_bytes": 10, "tokens_out": 3, "shards": []}


def test_hello_and_heartbeats_carry_the_gpus_and_the_compute_gpu_over_the_wire(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)  # what `import pynvml` finds: the seam
    monkeypatch.setattr(gpu, "ggml_devices", lambda: [gpu.GgmlDevice("CUDA0", "H200", "gpu", 1, 2)])
    monkeypatch.delenv("GGSWARM_DEVICE", raising=False)
    hw = hardware_info()
    assert hw.compute_device == "CUDA0" and hw.compute_gpu == 0
    assert [g.memory_bytes for g in hw.gpus] == [141 * GB, 24 * GB]

    agent = ControlAgent(
        NodeConfig(server="http://127.0.0.1:1", node_id="n", secret="s", public_key="x"),
        Host(),  # type: ignore[arg-type]  # the control client reads stats() only here
        "http://127.0.0.1:2",
        tmp_path,
        backends=lambda: ["native"],
    )
    hello = parse_agent_message(agent.hello().model_dump_json())
    assert isinstance(hello, Hello) and hello.hardware.compute_gpu == 0
    beat = parse_agent_message(Heartbeat(telemetry=agent.telemetry()).model_dump_json())
    assert isinstance(beat, Heartbeat)
    gpus = beat.telemetry.raw["gpus"]
    assert gpus[0]["memory_free_bytes"] == 138 * GB and gpus[0]["power_w"] == 412.5
    assert gpus[1]["power_w"] is None
