"""Reading single tensors out of a GGUF by absolute byte range (partial, sparse-file friendly)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from agent.artifacts.manifest import TensorInfo


def read_tensor_bytes(path: str, t: TensorInfo) -> np.ndarray:
    """The raw bytes of one tensor; reads only its range, so unfetched parts of a sparse file are never touched."""
    with open(path, "rb") as f:
        f.seek(t.offset)
        buf = f.read(t.nbytes)
    if len(buf) != t.nbytes:
        raise ValueError(f"{path}: tensor {t.name} is truncated ({len(buf)} of {t.nbytes} bytes)")
    return np.frombuffer(buf, dtype=np.uint8)


def read_tensor_f32(path: str, t: TensorInfo) -> np.ndarray:
    """Dequantize one tensor to float32 in row-major (numpy) shape, i.e. ggml shape reversed."""
    qtype = GGMLQuantizationType[t.ggml_type]
    raw = read_tensor_bytes(path, t)
    shape = tuple(reversed(t.shape))
    if qtype == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if qtype == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    out = dequantize(raw.reshape(shape[:-1] + (-1,)) if len(shape) > 1 else raw, qtype)
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)
