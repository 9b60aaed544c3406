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

from agent.artifacts.tiny import (
    DEEPSEEK4_FLASH_ROPE_SCALING,
    _Builder,
    _Tensor,
    _tokenizer_fields,
    _values,
)

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


def _common(b: _Builder, ctx: int, d: int, n_all: int, n_head: int, n_kv: int, n_ff: int, eps: float) -> None:
    b.u32("context_length", ctx)
    b.u32("embedding_length", d)
    b.u32("block_count", n_all)
    b.u32("feed_forward_length", n_ff)
    b.u32("attention.head_count", n_head)
    b.u32("attention.head_count_kv", n_kv)
    b.f32("attention.layer_norm_rms_epsilon", eps)


def _moe(b: _Builder, i: int, d: int, n_expert: int, ff: int, ff_sh: int) -> None:
    b.t(f"blk.{i}.ffn_gate_inp.weight", d, n_expert)
    b.t(f"blk.{i}.ffn_gate_exps.weight", d, ff, n_expert)
    b.t(f"blk.{i}.ffn_up_exps.weight", d, ff, n_expert)
    b.t(f"blk.{i}.ffn_down_exps.weight", ff, d, n_expert)
    b.t(f"blk.{i}.ffn_gate_shexp.weight", d, ff_sh)
    b.t(f"blk.{i}.ffn_up_shexp.weight", d, ff_sh)
    b.t(f"blk.{i}.ffn_down_shexp.weight", ff_sh, d)


def _nextn(b: _Builder, i: int, d: int) -> None:
    b.t(f"blk.{i}.nextn.eh_proj.weight", 2 * d, d)
    for n in ("enorm", "hnorm", "shared_head_norm"):
        b.norm(f"blk.{i}.nextn.{n}.weight", d)


def _embd(b: _Builder, d: int, vocab: int) -> None:
    b.t("token_embd.weight", d, vocab, kind="head")
    b.norm("output_norm.weight", d)
    b.t("output.weight", d, vocab, kind="head")


def _deepseek4(b: _Builder, vocab: int) -> None:
    """DeepSeek-V4-Flash: 43 layers + 1 MTP block, 4 hyper-connection streams, ratios 0/0 then 4/128."""
    d, n_layers, head, n_head, n_rot, q_lora, o_groups, o_lora = 4096, 43, 512, 64, 64, 1024, 8, 1024
    n_expert, n_used, ff, hc, idx_heads, idx_len, hash_layers = 256, 6, 2048, 4, 64, 128, 3
    n_all = n_layers + 1
    _common(b, 1048576, d, n_all, n_head, 1, ff, 1e-6)
    b.f32("rope.freq_base", 10000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("rope.dimension_count", n_rot)
    b.u32("attention.q_lora_rank", q_lora)
    b.u32("attention.sliding_window", 128)
    b.u32("expert_count", n_expert)
    b.u32("expert_used_count", n_used)
    b.u32("expert_feed_forward_length", ff)
    b.u32("expert_shared_count", 1)
    b.f32("expert_weights_scale", 1.5)  # est.
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 4)
    b.f32s("swiglu_clamp_exp", [10.0] * n_all)
    b.u32("attention.indexer.head_count", idx_heads)
    b.u32("attention.indexer.key_length", idx_len)
    b.u32("attention.indexer.top_k", 512)  # est.
    b.u32("attention.output_group_count", o_groups)
    b.u32("attention.output_lora_rank", o_lora)
    b.f32("attention.compress_rope_freq_base", 160000.0)
    b.rope_scaling(DEEPSEEK4_FLASH_ROPE_SCALING)
    b.u32("hyper_connection.count", hc)
    b.u32("hyper_connection.sinkhorn_iterations", 20)
    b.f32("hyper_connection.epsilon", 1e-6)
    b.u32("hash_layer_count", hash_layers)
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, n_layers)] + [0]
    b.u32s("attention.compress_ratios", ratios)
    b.u32("nextn_predict_layers", 1)
    _embd(b, d, vocab)
    mix = (2 + hc) * hc
    b.t("output_hc_fn.weight", hc * d, hc, kind="small")
    b.t("output_hc_base.weight", hc, kind="small")
    b.t("output_hc_scale.weight", 1, kind="small")
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", d)
        b.t(f"blk.{i}.attn_sinks.weight", n_head, kind="small")
        b.t(f"blk.{i}.attn_q_a.weight", d, q_lora)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", q_lora, n_head * head)
        b.t(f"blk.{i}.attn_kv.weight", d, head)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", head)
        b.t(f"blk.{i}.attn_output_a.weight", n_head * head // o_groups, o_lora * o_groups)
        b.t(f"blk.{i}.attn_output_b.weight", o_groups * o_lora, d)
        for part in ("attn", "ffn"):
            b.t(f"blk.{i}.hc_{part}_fn.weight", hc * d, mix, kind="small")
            b.t(f"blk.{i}.hc_{part}_base.weight", mix, kind="small")
            b.t(f"blk.{i}.hc_{part}_scale.weight", 3, kind="small")
        ratio = ratios[i]
        if ratio:
            coff = 2 if ratio == 4 else 1
            b.t(f"blk.{i}.attn_compressor_kv.weight", d, coff * head)
            b.t(f"blk.{i}.attn_compressor_gate.weight", d, coff * head)
            b.t(f"blk.{i}.attn_compressor_ape.weight", coff * head, ratio, kind="small")
            b.norm(f"blk.{i}.attn_compressor_norm.weight", head)
            if ratio == 4:
                b.t(f"blk.{i}.indexer.proj.weight", d, idx_heads)
                b.t(f"blk.{i}.indexer.attn_q_b.weight", q_lora, idx_heads * idx_len)
                b.t(f"blk.{i}.indexer_compressor_kv.weight", d, 2 * idx_len)
                b.t(f"blk.{i}.indexer_compressor_gate.weight", d, 2 * idx_len)
                b.t(f"blk.{i}.indexer_compressor_ape.weight", 2 * idx_len, ratio, kind="small")
                b.norm(f"blk.{i}.indexer_compressor_norm.weight", idx_len)
        if i < hash_layers:
            b.t(f"blk.{i}.ffn_gate_tid2eid.weight", n_used, vocab, kind="ids", high=n_expert)
        else:
            b.t(f"blk.{i}.exp_probs_b.bias", n_expert, kind="small")
        b.norm(f"blk.{i}.ffn_norm.weight", d)
        _moe(b, i, d, n_expert, ff, ff)
        if i >= n_layers:
            _nextn(b, i, d)


def glm52_indexer_types(n_layers: int = 78) -> list[int]:
    """GLM-5.2's layout (agent/artifacts/archs.py glm_indexer_full): 0-1 full, then one full in four."""
    return [1 if i < 2 or (i - 2) % 4 == 0 else 0 for i in range(n_layers)]


def _glm_dsa(b: _Builder, vocab: int) -> None:
    """GLM-5.2: 78 layers (3 dense) + MTP, MLA latent KV, DSA indexer shared by groups of four."""
    d, n_layers, n_head, q_lora, kv_lora, n_rot, nope, v_head = 6144, 78, 64, 2048, 512, 64, 192, 256
    n_expert, n_used, ff_exp, n_ff, dense, idx_heads, idx_len = 256, 8, 2048, 12288, 3, 32, 128
    n_all = n_layers + 1
    _common(b, 1048576, d, n_all, n_head, 1, n_ff, 1e-5)
    b.f32("rope.freq_base", 8_000_000.0)
    b.u32("attention.key_length", kv_lora + n_rot)
    b.u32("attention.value_length", kv_lora)
    b.u32("attention.key_length_mla", nope + n_rot)
    b.u32("attention.value_length_mla", v_head)
    b.u32("rope.dimension_count", n_rot)
    b.u32("attention.q_lora_rank", q_lora)
    b.u32("attention.kv_lora_rank", kv_lora)
    b.u32("expert_count", n_expert)
    b.u32("expert_used_count", n_used)
    b.u32("expert_feed_forward_length", ff_exp)
    b.u32("expert_shared_count", 1)
    b.u32("leading_dense_block_count", dense)
    b.f32("expert_weights_scale", 2.5)
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 2)
    b.u32("attention.indexer.head_count", idx_heads)
    b.u32("attention.indexer.key_length", idx_len)
    b.u32("attention.indexer.top_k", 2048)
    types = glm52_indexer_types(n_layers)
    b.u32s("attention.indexer.types", types)
    b.u32("nextn_predict_layers", 1)
    _embd(b, d, vocab)
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", d)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", q_lora)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", kv_lora)
        b.t(f"blk.{i}.attn_q_a.weight", d, q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", q_lora, n_head * (nope + n_rot))
        b.t(f"blk.{i}.attn_kv_a_mqa.weight", d, kv_lora + n_rot)
        b.t(f"blk.{i}.attn_k_b.weight", nope, kv_lora, n_head)
        b.t(f"blk.{i}.attn_v_b.weight", kv_lora, v_head, n_head)
        b.t(f"blk.{i}.attn_output.weight", n_head * v_head, d)
        b.norm(f"blk.{i}.ffn_norm.weight", d)
        if i >= n_layers or types[i]:
            b.norm(f"blk.{i}.indexer.k_norm.weight", idx_len)
            b.t(f"blk.{i}.indexer.k_norm.bias", idx_len, kind="small")
            b.t(f"blk.{i}.indexer.proj.weight", d, idx_heads)
            b.t(f"blk.{i}.indexer.attn_k.weight", d, idx_len)
            b.t(f"blk.{i}.indexer.attn_q_b.weight", q_lora, idx_heads * idx_len)
        if i < dense:
            b.t(f"blk.{i}.ffn_gate.weight", d, n_ff)
            b.t(f"blk.{i}.ffn_up.weight", d, n_ff)
            b.t(f"blk.{i}.ffn_down.weight", n_ff, d)
        else:
            b.t(f"blk.{i}.exp_probs_b.bias", n_expert, kind="small")
            _moe(b, i, d, n_expert, ff_exp, ff_exp)
        if i >= n_layers:
            _nextn(b, i, d)


def _qwen35moe(b: _Builder, vocab: int) -> None:
    """Qwen3.5-397B-A17B: 60 layers (3 gated delta-net : 1 gated attention) + MTP, 512 experts top-10."""
    d, n_layers, n_head, n_kv, head, interval = 4096, 60, 32, 2, 256, 4
    d_state, n_group, dt_rank, d_conv = 128, 16, 64, 4
    n_expert, n_used, ff = 512, 10, 1024
    n_all = n_layers + 1
    _common(b, 262144, d, n_all, n_head, n_kv, ff, 1e-6)
    b.f32("rope.freq_base", 10_000_000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("rope.dimension_count", 64)
    b.i32s("rope.dimension_sections", [11, 11, 10, 0])
    b.u32("ssm.conv_kernel", d_conv)
    b.u32("ssm.state_size", d_state)
    b.u32("ssm.group_count", n_group)
    b.u32("ssm.time_step_rank", dt_rank)
    b.u32("ssm.inner_size", d_state * dt_rank)
    b.u32("full_attention_interval", interval)
    b.u32("nextn_predict_layers", 1)
    b.u32("expert_count", n_expert)
    b.u32("expert_used_count", n_used)
    b.u32("expert_feed_forward_length", ff)
    b.u32("expert_shared_feed_forward_length", ff)
    _embd(b, d, vocab)
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", d)
        b.norm(f"blk.{i}.post_attention_norm.weight", d)
        if i >= n_layers or (i + 1) % interval == 0:
            b.t(f"blk.{i}.attn_q.weight", d, 2 * n_head * head)
            b.t(f"blk.{i}.attn_k.weight", d, n_kv * head)
            b.t(f"blk.{i}.attn_v.weight", d, n_kv * head)
            b.t(f"blk.{i}.attn_output.weight", n_head * head, d)
            b.norm(f"blk.{i}.attn_q_norm.weight", head)
            b.norm(f"blk.{i}.attn_k_norm.weight", head)
        else:
            b.t(f"blk.{i}.attn_qkv.weight", d, 2 * key_dim + value_dim)
            b.t(f"blk.{i}.attn_gate.weight", d, value_dim)
            b.t(f"blk.{i}.ssm_conv1d.weight", d_conv, 2 * key_dim + value_dim, kind="small")
            b.t(f"blk.{i}.ssm_dt.bias", dt_rank, kind="small")
            b.t(f"blk.{i}.ssm_a", dt_rank, kind="neg")
            b.t(f"blk.{i}.ssm_beta.weight", d, dt_rank)
            b.t(f"blk.{i}.ssm_alpha.weight", d, dt_rank)
            b.norm(f"blk.{i}.ssm_norm.weight", d_state)
            b.t(f"blk.{i}.ssm_out.weight", value_dim, d)
        _moe(b, i, d, n_expert, ff, ff)
        b.t(f"blk.{i}.ffn_gate_inp_shexp.weight", d)
        if i >= n_layers:
            _nextn(b, i, d)


_BUILDERS: dict[str, Callable[[_Builder, int], None]] = {
    "deepseek4": _deepseek4,
    "glm-dsa": _glm_dsa,
    "qwen35moe": _qwen35moe,
}


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def qtype_name(t: _Tensor, n_all: int) -> str:
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


def _nbytes(t: _Tensor, qtype: str) -> int:
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
    t: _Tensor,
    qtype: str,
    nbytes: int,
    rng: np.random.Generator,
    pools: dict[tuple[str, int], bytes],
) -> None:
    if qtype in ("F32", "I32"):
        fh.write(np.ascontiguousarray(_values(t, rng)).tobytes())
        return
    if qtype == "F16":
        fh.write((_values(t, rng)).astype(np.float16).tobytes())
        return
    pool = pools.setdefault((qtype, t.ne[0]), _pool(qtype, t.ne[0], rng))
    left = nbytes
    while left > 0:
        chunk = pool[: min(left, len(pool))]
        fh.write(chunk)
        left -= len(chunk)


def tensor_plan(arch: str) -> tuple[_Builder, list[tuple[_Tensor, str, int]]]:
    """The metadata builder and (tensor, ggml type name, bytes) of every tensor of `arch`'s real file."""
    if arch not in _BUILDERS:
        raise RealShapeError(f"no real-shaped generator for {arch!r}; known: {', '.join(ARCHITECTURES)}")
    b = _Builder(arch)
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
    fields = _tokenizer_fields(Path(source).resolve())
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
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    b, plan = tensor_plan(arch)
    data_layers = set(layers_with_data)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), arch)
    w.add_name(f"realshape-{MODEL_NAMES[arch]}-Q4_K_M")
    w.add_uint32("general.file_type", _FTYPE_Q4_K_M)
    w.add_uint32("general.quantization_version", 2)
    scalar = {"u32": GGUFValueType.UINT32, "f32": GGUFValueType.FLOAT32, "bool": GGUFValueType.BOOL}
    scalar["str"] = GGUFValueType.STRING
    element = {"u32[]": GGUFValueType.UINT32, "i32[]": GGUFValueType.INT32, "f32[]": GGUFValueType.FLOAT32}
    for key, value, kind in b.kv:
        if kind in scalar:
            w.add_key_value(key, value, scalar[kind])
        else:
            w.add_key_value(key, value, GGUFValueType.ARRAY, element[kind])
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
