"""Devices of this host: NVIDIA GPUs through NVML (live memory, utilisation, temperature, power) and the
ggml devices the native library can run on, with the one its shards use.

NVML comes from `nvidia-ml-py` (the `gpu` extra; module `pynvml`); every function takes the module as
an argument (`nvml=None`: import it), which is the seam the tests fill with a fake. A GPU whose driver
does not support one query (power on many consumer cards) reports None for that figure, never a guess.

The native library picks its device as native/src/loader.cpp does (`GGSWARM_DEVICE`, else ggml's first
GPU, else the CPU); a CUDA device `CUDA<n>` is CUDA ordinal n, which is NVML index n when
`CUDA_DEVICE_ORDER=PCI_BUS_ID` (the systemd unit and the CUDA image set it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import weakref
from dataclasses import dataclass
from typing import Any

from agent.wire.control import MAX_NAME, Gpu

log = logging.getLogger("agent.node.gpu")
MAX_GPUS = 64
_initialised: weakref.WeakSet[Any] = weakref.WeakSet()  # NVML modules whose nvmlInit succeeded here

# enum ggml_backend_dev_type (ggml-backend.h of llama-cpp-python 0.3.36's ggml)
GGML_DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


def _nvml(nvml: Any | None) -> Any | None:
    """The NVML module, initialised once; None when it is not installed or finds no driver."""
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError:
            return None
    if nvml not in _initialised:
        try:
            nvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded: no GPU here
            log.debug("NVML unavailable: %s", e)
            return None
        _initialised.add(nvml)
    return nvml


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends: the figure is unknown
        return None


def nvml_gpus(nvml: Any | None = None, live: bool = True) -> list[Gpu]:
    """One `Gpu` per NVML device; with `live`, also memory used/free, utilisation, temperature, power."""
    mod = _nvml(nvml)
    if mod is None:
        return []
    count = _try(mod.nvmlDeviceGetCount) or 0
    gpus: list[Gpu] = []
    for i in range(min(int(count), MAX_GPUS)):
        h = _try(mod.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            continue
        name = _try(mod.nvmlDeviceGetName, h) or ""
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        mem = _try(mod.nvmlDeviceGetMemoryInfo, h)
        fields: dict[str, Any] = {
            "index": i,
            "name": name[:MAX_NAME],
            "memory_bytes": max(int(mem.total), 0) if mem is not None else 0,
        }
        if live:
            if mem is not None:
                fields["memory_used_bytes"] = max(int(mem.used), 0)
                fields["memory_free_bytes"] = max(int(mem.free), 0)
            util = _try(mod.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                fields["utilization_percent"] = min(max(float(util.gpu), 0.0), 100.0)
            temp = _try(mod.nvmlDeviceGetTemperature, h, getattr(mod, "NVML_TEMPERATURE_GPU", 0))
            if temp is not None:
                fields["temperature_c"] = max(float(temp), 0.0)
            power_mw = _try(mod.nvmlDeviceGetPowerUsage, h)
            if power_mw is not None:
                fields["power_w"] = max(float(power_mw) / 1000.0, 0.0)
        gpus.append(Gpu.model_validate(fields))
    return gpus


@dataclass(frozen=True)
class GgmlDevice:
    """A ggml backend device as the native library sees it."""

    name: str
    description: str
    kind: str  # cpu, gpu, igpu, accel
    free_bytes: int
    total_bytes: int


def ggml_devices() -> list[GgmlDevice]:
    """The ggml devices of the ggml the native library runs on (raises OSError when it is not loadable)."""
    from agent.backends import ggswarm_lib

    ggswarm_lib.load_library()  # preloads llama-cpp-python's ggml, so the soname below is that one
    ggml = ctypes.CDLL("libggml.so.0")
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(ggml, fn).argtypes = [ctypes.c_void_p]
        getattr(ggml, fn).restype = ctypes.c_char_p
    ggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_dev_type.restype = ctypes.c_int
    size_p = ctypes.POINTER(ctypes.c_size_t)
    ggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    ggml.ggml_backend_dev_memory.restype = None
    out = []
    for i in range(int(ggml.ggml_backend_dev_count())):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(
            GgmlDevice(
                name=(ggml.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                description=(ggml.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
                kind=GGML_DEVICE_TYPES.get(int(ggml.ggml_backend_dev_type(dev)), "unknown"),
                free_bytes=int(free.value),
                total_bytes=int(total.value),
            )
        )
    return out


def compute_device(devices: list[GgmlDevice]) -> GgmlDevice | None:
    """The device the native library puts a shard on (the rule of native/src/loader.cpp)."""
    want = os.environ.get("GGSWARM_DEVICE", "")
    if want:
        return next((d for d in devices if d.name == want), None)
    return next((d for d in devices if d.kind == "gpu"), None) or next(
        (d for d in devices if d.kind == "cpu"), None
    )


def nvml_index(device_name: str) -> int | None:
    """The NVML index of a ggml CUDA device (`CUDA<n>` -> n), None for any other device."""
    m = re.fullmatch(r"CUDA(\d+)", device_name)
    return int(m.group(1)) if m else None


def native_compute_device() -> tuple[str, int | None]:
    """(ggml device name, NVML index or None) the native backend runs on; ("", None) without it."""
    try:
        dev = compute_device(ggml_devices())
    except OSError:
        return "", None
    if dev is None:
        return "", None
    return dev.name[:MAX_NAME], nvml_index(dev.name) if dev.kind == "gpu" else None
