"""Real-shaped sparse GGUFs of DeepSeek-V4-Flash, GLM-5.2 and Qwen3.5-397B-A17B: real sizes, holes for data.

Every tensor of the real file is in the table, at its real shape and at the type llama.cpp's Q4_K_M
quantizer (llama-quant.cpp of llama-cpp-python 0.3.36) gives it; only the layers in `layers_with_data`
hold bytes (valid quantized blocks: random quants, fixed small scales). The rest of the file is holes
(the file is truncated to its full size, never written), so a 150-400 GB file costs a few GB of disk,
and an all-hole window is still valid (zero blocks decode to zeros). The tensor set and key names are
agent/artifacts/tiny.py's (the executor's and llama.cpp's loaders), the sizes the model cards' as the
control plane's specs (webapp/fleet/specs/models/*.json) record them; numbers the specs mark as
estimates (e.g. indexer top-k) are marked `# est.` here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from agent.artifacts import layouts
from agent.artifacts.layouts import Builder, Tensor
from agent.artifacts.tiny import tensor_values, tokenizer_fields

ARCHITECTURES = ("deepseek4", "glm-dsa", "qwen35moe")
MODEL_NAMES = {
    "deepseek4": "DeepSeek-V4-Flash",
    "glm-dsa": "GLM-5.2",
    "qwen35moe": "Qwen3.5-397B-A17B",
}
VOCAB = {"deepseek4": 129280, "glm-dsa": 154880, "qwen35moe": 248320}
_KEEP_F32 = ("ssm_conv1d", "hc_", "_ape", "ffn_gate_inp", "_norm.weight")  # as llama.cpp/tiny keep them
_FTYPE_Q4_K_M = 15
_ALIGN = 32


class RealShapeError(ValueError):
    """The requested real-shaped file cannot be built; the message says why."""


def _deepseek4(b: Builder, vocab: int) -> None:
    """DeepSeek-V4-Flash: 43 layers + 1 MTP block, 4 hyper-connection streams, ratios 0/0 then 4/128."""
    ratios = (0, 0) + tuple(4 if i % 2 == 0 else 128 for i in range(2, 43))
    dims = layouts.Dsv4Dims(
        d=4096, n_layers=43, vocab=vocab, ratios=ratios, ctx=1048576, head=512, n_head=64, n_rot=64,
        q_lora=1024, o_groups=8, o_lora=1024, n_expert=256, n_used=6, n_ff_exp=2048, hc=4,
        idx_heads=64, idx_len=128, top_k=512, swa=128, hash_layers=3, w_scale=1.5, mtp=True,
    )  # fmt: skip
    layouts.deepseek4(b, dims)  # top_k 512 and w_scale 1.5: est.


def glm52_indexer_types(n_layers: int = 78) -> list[int]:
    """GLM-5.2's layout (agent/artifacts/archs.py glm_indexer_full): 0-1 full, then one full in four."""
    return [1 if i < 2 or (i - 2) % 4 == 0 else 0 for i in range(n_layers)]


def _glm_dsa(b: Builder, vocab: int) -> None:
    """GLM-5.2: 78 layers (3 dense) + MTP, MLA latent KV, DSA indexer shared by groups of four."""
    dims = layouts.GlmDims(
        d=6144, n_layers=78, vocab=vocab, types=tuple(glm52_indexer_types(78)), ctx=1048576, eps=1e-5,
        n_head=64, q_lora=2048, kv_lora=512, n_rot=64, nope=192, v_head=256, n_expert=256, n_used=8,
        n_ff_exp=2048, n_ff=12288, dense_lead=3, idx_heads=32, idx_len=128, top_k=2048, mtp=True,
    )  # fmt: skip
    layouts.glm_dsa(b, dims)


def _qwen35moe(b: Builder, vocab: int) -> None:
    """Qwen3.5-397B-A17B: 60 layers (3 gated delta-net : 1 gated attention) + MTP, 512 experts top-10."""
    dims = layouts.Qwen35Dims(
        d=4096, n_layers=60, vocab=vocab, moe=True, ctx=262144, head=256, n_head=32, n_kv=2, n_ff=1024,
        interval=4, n_rot=64, sections=(11, 11, 10, 0), d_state=128, n_group=16, dt_rank=64, d_conv=4,
        n_expert=512, n_used=10, n_ff_exp=1024, mtp=True,
    )  # fmt: skip
    layouts.qwen35(b, dims)


_BUILDERS: dict[str, Callable[[Builder, int], None]] = {
    "deepseek4": _deepseek4,
    "glm-dsa": _glm_dsa,
    "qwen35moe": _qwen35moe,
}


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def qtype_name(t: Tensor, n_all: int) -> str:
    """The ggml type llama.cpp's Q4_K_M quantizer (llama_tensor_get_type, n_expert != 8) gives `t`."""
    if t.kind == "ids":
        return "I32"
    if len(t.ne) < 2 or not t.name.endswith("weight") or any(k in t.name for k in _KEEP_F32):
        return "F32"
    if t.name == "output.weight":
        return "Q6_K" if t.ne[0] % 256 == 0 else "Q8_0"
    want = "Q4_K"
    if t.name.startswith("blk."):
        i = int(t.name.split(".")[1])
        # ffn_down*: by the layer in the name; attn_v/attn_qkv: by their running count, one per layer here
        if ("ffn_down" in t.name or "attn_v.weight" in t.name or "attn_qkv.weight" in t.name) and _more_bits(
            i, n_all
        ):
            want = "Q6_K"
    if t.ne[0] % 256:  # tensor_type_fallback
        want = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[want]
        if t.ne[0] % 32:
            want = "F16"
    return want


# (bytes per block, elements per block, offset of the f16 scale d, f16 dmin offset or -1, element std / d)
_BLOCKS = {
    "Q4_K": (144, 256, 0, 2, 257.0),  # d * sc * q - dmin * m, with dmin = 7.5 d: about zero mean
    "Q6_K": (210, 256, 208, -1, 1369.0),  # d * scale(int8) * (q - 32)
    "Q8_0": (34, 32, 0, -1, 74.0),  # d * q(int8)
    "Q5_0": (22, 32, 0, -1, 9.2),  # d * (q - 16)
}


def _nbytes(t: Tensor, qtype: str) -> int:
    n = int(np.prod(t.ne))
    if qtype in ("F32", "I32"):
        return 4 * n
    if qtype == "F16":
        return 2 * n
    size, per, *_ = _BLOCKS[qtype]
    return n // per * size


def _pool(qtype: str, ne0: int, rng: np.random.Generator, nbytes: int = 8 << 20) -> bytes:
    """About `nbytes` of valid `qtype` blocks: random quants, every scale d giving elements of std
    1/sqrt(ne0) (activations stay O(1) through random layers, no inf in an f16 cache)."""
    size, _, d_off, m_off, per_d = _BLOCKS[qtype]
    blocks = np.frombuffer(rng.bytes(nbytes // size * size), dtype=np.uint8).reshape(-1, size).copy()
    d = np.float16(1.0 / (per_d * ne0**0.5))
    blocks[:, d_off : d_off + 2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    if m_off >= 0:
        blocks[:, m_off : m_off + 2] = np.frombuffer(np.float16(7.5 * float(d)).tobytes(), dtype=np.uint8)
    return blocks.tobytes()


def _write_tensor(
    fh: Any,
    t: Tensor,
    qtype: str,
    nbytes: int,
    rng: np.random.Generator,
    pools: dict[tuple[str, int], bytes],
) -> None:
    if qtype in ("F32", "I32"):
        fh.write(np.ascontiguousarray(tensor_values(t, rng)).tobytes())
        return
    if qtype == "F16":
        fh.write((tensor_values(t, rng)).astype(np.float16).tobytes())
        return
    pool = pools.setdefault((qtype, t.ne[0]), _pool(qtype, t.ne[0], rng))
    left = nbytes
    while left > 0:
        chunk = pool[: min(left, len(pool))]
        fh.write(chunk)
        left -= len(chunk)


def tensor_plan(arch: str) -> tuple[Builder, list[tuple[Tensor, str, int]]]:
    """The metadata builder and (tensor, ggml type name, bytes) of every tensor of `arch`'s real file."""
    if arch not in _BUILDERS:
        raise RealShapeError(f"no real-shaped generator for {arch!r}; known: {', '.join(ARCHITECTURES)}")
    b = Builder(arch)
    _BUILDERS[arch](b, VOCAB[arch])
    n_all = next(int(v) for k, v, _ in b.kv if k == f"{arch}.block_count")
    plan = []
    for t in b.tensors:
        q = qtype_name(t, n_all)
        plan.append((t, q, _nbytes(t, q)))
    return b, plan


def _padded_tokenizer(vocab: int, source: str | os.PathLike[str] | None) -> list[tuple[str, Any, Any, Any]]:
    """SmolLM2's tokenizer fields, the per-token arrays padded to `vocab` entries as llama.cpp's converter
    pads a vocabulary ("[PADn]", token type UNUSED = 5)."""
    if source is None:
        from agent.artifacts.packaged import packaged_model_path

        source = packaged_model_path("smollm2")
    fields = tokenizer_fields(Path(source).resolve())
    n_tok = len(next(v for k, v, *_ in fields if k == "tokenizer.ggml.tokens"))
    if n_tok > vocab:
        raise RealShapeError(f"the tokenizer has {n_tok} tokens, more than the vocabulary {vocab}")
    pad: dict[str, list[Any]] = {"tokenizer.ggml.tokens": [f"[PAD{i}]" for i in range(n_tok, vocab)]}
    pad["tokenizer.ggml.token_type"] = [5] * (vocab - n_tok)
    pad["tokenizer.ggml.scores"] = [0.0] * (vocab - n_tok)
    out = []
    for key, value, vtype, sub in fields:
        if key in pad and isinstance(value, list) and len(value) == n_tok:
            value = list(value) + pad[key]
        out.append((key, value, vtype, sub))
    return out


def write_realshape_gguf(
    arch: str,
    path: str | os.PathLike[str],
    *,
    layers_with_data: Iterable[int] = (),
    head: bool = False,
    seed: int = 0,
    tokenizer_from: str | os.PathLike[str] | None = None,
) -> Path:
    """Write `arch`'s real-shaped file to `path` as a sparse file; only the trunk layers in
    `layers_with_data` (and the embedding and output head when `head`) hold bytes, plus the small
    non-layer tensors (norms, DeepSeek-V4's output hyper-connection). Returns the path."""
    from gguf import GGMLQuantizationType, GGUFWriter

    b, plan = tensor_plan(arch)
    data_layers = set(layers_with_data)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), arch)
    w.add_name(f"realshape-{MODEL_NAMES[arch]}-Q4_K_M")
    w.add_uint32("general.file_type", _FTYPE_Q4_K_M)
    w.add_uint32("general.quantization_version", 2)
    layouts.write_kv(w, b)
    for key, value, vtype, sub in _padded_tokenizer(VOCAB[arch], tokenizer_from):
        w.add_key_value(key, value, vtype, sub)
    offsets, total = [], 0
    for t, q, nbytes in plan:
        shape = tuple(reversed(t.ne))
        raw = GGMLQuantizationType[q]
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), nbytes, raw_dtype=raw)
        offsets.append(total)
        total += -(-nbytes // _ALIGN) * _ALIGN
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        assert w.fout is not None
        fh = w.fout[0]
        start = -(-fh.tell() // _ALIGN) * _ALIGN
        fh.write(b"\0" * (start - fh.tell()))
        rng = np.random.default_rng(seed)
        pools: dict[tuple[str, int], bytes] = {}
        for (t, q, nbytes), off in zip(plan, offsets, strict=True):
            layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
            if (layer in data_layers) if layer is not None else (head or t.kind != "head"):
                fh.seek(start + off)
                _write_tensor(fh, t, q, nbytes, rng, pools)
        fh.flush()
    finally:
        w.close()
    os.truncate(out, start + total)
    return out


def type_summary(arch: str) -> dict[str, int]:
    """Bytes per ggml type in `arch`'s whole real-shaped file."""
    out: dict[str, int] = {}
    for _, q, nbytes in tensor_plan(arch)[1]:
        out[q] = out.get(q, 0) + nbytes
    return out
