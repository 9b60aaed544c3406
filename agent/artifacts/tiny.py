"""Tiny random-weight GGUFs of every architecture the route targets, carrying SmolLM2's tokenizer.

Each file has the architecture's full metadata and tensor set as the vendored llama.cpp of
llama-cpp-python 0.3.36 loads it (hidden 64, a handful of layers), so llama.cpp running the same file
is the oracle for the native executor's layer windows. Written from llama.cpp's loader rules (which keys
are required, tensor names and shapes), not from its code. The weights are a pure function of the seed.

Why it lives in `agent/artifacts` and not under `tests/`: bench/archs.py, the native tests and
`python -m agent tiny --arch A --out F` (a file to `inspect` or register with the control plane) all
need it, and it is a model-file producer like the rest of this package.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = ("llama", "qwen3", "gemma3", "qwen35", "qwen35moe", "deepseek4", "glm-dsa")
DTYPES = ("f32", "f16", "q8_0")
D_MODEL = 64
DEFAULT_LAYERS = {
    "llama": 4,
    "qwen3": 4,
    "gemma3": 6,  # five sliding-window layers, then a global one (llama.cpp's default pattern of 6)
    "qwen35": 8,  # full attention at layers 3 and 7
    "qwen35moe": 8,
    "deepseek4": 6,
    "glm-dsa": 6,
}
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7}
# Only matmul weights take the file's dtype; these stay f32 (the graphs read them as f32).
_KEEP_F32 = ("ssm_conv1d", "hc_", "_ape")  # 1-D tensors (norms, biases, ssm_a, sinks) stay f32 anyway


class TinyModelError(ValueError):
    """The requested tiny model cannot be built; the message says why."""


@dataclass
class _Tensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne0 (fastest varying) first
    kind: str  # "matmul", "head", "norm", "small", "neg", "ids"
    high: int = 0  # exclusive upper bound for "ids"


@dataclass
class _Builder:
    """Collects one file's metadata and tensor list before anything is written."""

    arch: str
    kv: list[tuple[str, Any, str]] = field(default_factory=list)
    tensors: list[_Tensor] = field(default_factory=list)

    def u32(self, key: str, value: int) -> None:
        self.kv.append((f"{self.arch}.{key}", int(value), "u32"))

    def f32(self, key: str, value: float) -> None:
        self.kv.append((f"{self.arch}.{key}", float(value), "f32"))

    def flag(self, key: str, value: bool) -> None:
        self.kv.append((f"{self.arch}.{key}", bool(value), "bool"))

    def text(self, key: str, value: str) -> None:
        self.kv.append((f"{self.arch}.{key}", str(value), "str"))

    def f32s(self, key: str, values: list[float]) -> None:
        self.kv.append((f"{self.arch}.{key}", [float(v) for v in values], "f32[]"))

    def rope_scaling(self, fields: dict[str, str | float | int]) -> None:
        """Replace every rope.scaling.* key with `fields` (type: string, original_context_length: u32,
        the rest f32), as llama.cpp's converter writes them."""
        self.kv = [kv for kv in self.kv if not kv[0].startswith(f"{self.arch}.rope.scaling.")]
        for name, value in fields.items():
            key = f"rope.scaling.{name}"
            if name == "type":
                self.text(key, str(value))
            elif name == "original_context_length":
                self.u32(key, int(value))
            else:
                self.f32(key, float(value))

    def u32s(self, key: str, values: list[int]) -> None:
        self.kv.append((f"{self.arch}.{key}", [int(v) for v in values], "u32[]"))

    def i32s(self, key: str, values: list[int]) -> None:
        self.kv.append((f"{self.arch}.{key}", [int(v) for v in values], "i32[]"))

    def t(self, name: str, *ne: int, kind: str = "matmul", high: int = 0) -> None:
        self.tensors.append(_Tensor(name, tuple(int(x) for x in ne), kind, high))

    def norm(self, name: str, n: int) -> None:
        self.t(name, n, kind="norm")


def _common(
    b: _Builder, n_layers: int, n_head: int, n_head_kv: int, n_ff: int, rope_base: float = 10000.0
) -> None:
    b.u32("context_length", 4096)
    b.u32("embedding_length", D_MODEL)
    b.u32("block_count", n_layers)
    b.u32("feed_forward_length", n_ff)
    b.u32("attention.head_count", n_head)
    b.u32("attention.head_count_kv", n_head_kv)
    b.f32("attention.layer_norm_rms_epsilon", 1e-6)
    b.f32("rope.freq_base", rope_base)


def _embd(b: _Builder, vocab: int, *, output: bool) -> None:
    # unit-variance rows: logits spread ~8 wide, so the top token wins by a margin that f32 rounding
    # differences between executors cannot flip (with 1/sqrt(d) rows 49k logits are nearly tied)
    b.t("token_embd.weight", D_MODEL, vocab, kind="head")
    b.norm("output_norm.weight", D_MODEL)
    if output:
        b.t("output.weight", D_MODEL, vocab, kind="head")


def _ffn(b: _Builder, i: int, n_ff: int) -> None:
    b.t(f"blk.{i}.ffn_gate.weight", D_MODEL, n_ff)
    b.t(f"blk.{i}.ffn_up.weight", D_MODEL, n_ff)
    b.t(f"blk.{i}.ffn_down.weight", n_ff, D_MODEL)


def _experts(b: _Builder, i: int, n_expert: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    b.t(f"blk.{i}.ffn_gate_inp.weight", D_MODEL, n_expert)
    b.t(f"blk.{i}.ffn_gate_exps.weight", D_MODEL, n_ff_exp, n_expert)
    b.t(f"blk.{i}.ffn_up_exps.weight", D_MODEL, n_ff_exp, n_expert)
    b.t(f"blk.{i}.ffn_down_exps.weight", n_ff_exp, D_MODEL, n_expert)
    b.t(f"blk.{i}.ffn_gate_shexp.weight", D_MODEL, n_ff_shexp)
    b.t(f"blk.{i}.ffn_up_shexp.weight", D_MODEL, n_ff_shexp)
    b.t(f"blk.{i}.ffn_down_shexp.weight", n_ff_shexp, D_MODEL)


def _qkv(b: _Builder, i: int, n_q: int, n_kv: int, n_out: int) -> None:
    b.t(f"blk.{i}.attn_q.weight", D_MODEL, n_q)
    b.t(f"blk.{i}.attn_k.weight", D_MODEL, n_kv)
    b.t(f"blk.{i}.attn_v.weight", D_MODEL, n_kv)
    b.t(f"blk.{i}.attn_output.weight", n_out, D_MODEL)


def _llama(b: _Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    head, n_head, n_kv, n_ff = 16, 4, 2, 128
    _common(b, n_layers, n_head, n_kv, n_ff)
    b.u32("vocab_size", vocab)
    b.u32("rope.dimension_count", head)
    _embd(b, vocab, output=False)
    for i in range(n_layers):
        b.norm(f"blk.{i}.attn_norm.weight", D_MODEL)
        _qkv(b, i, n_head * head, n_kv * head, n_head * head)
        b.norm(f"blk.{i}.ffn_norm.weight", D_MODEL)
        _ffn(b, i, n_ff)


def _qwen3(b: _Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    head, n_head, n_kv, n_ff = 16, 4, 2, 128
    _common(b, n_layers, n_head, n_kv, n_ff, rope_base=1_000_000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    _embd(b, vocab, output=True)
    for i in range(n_layers):
        b.norm(f"blk.{i}.attn_norm.weight", D_MODEL)
        _qkv(b, i, n_head * head, n_kv * head, n_head * head)
        b.norm(f"blk.{i}.attn_q_norm.weight", head)
        b.norm(f"blk.{i}.attn_k_norm.weight", head)
        b.norm(f"blk.{i}.ffn_norm.weight", D_MODEL)
        _ffn(b, i, n_ff)


def _gemma3(b: _Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    head, n_head, n_kv, n_ff = 16, 4, 1, 128
    _common(b, n_layers, n_head, n_kv, n_ff, rope_base=1_000_000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("attention.sliding_window", 32)
    b.f32("rope.freq_base_swa", 10000.0)
    _embd(b, vocab, output=False)  # gemma3 ties the output to the token embedding
    for i in range(n_layers):
        b.norm(f"blk.{i}.attn_norm.weight", D_MODEL)
        _qkv(b, i, n_head * head, n_kv * head, n_head * head)
        b.norm(f"blk.{i}.post_attention_norm.weight", D_MODEL)
        b.norm(f"blk.{i}.attn_q_norm.weight", head)
        b.norm(f"blk.{i}.attn_k_norm.weight", head)
        b.norm(f"blk.{i}.ffn_norm.weight", D_MODEL)
        _ffn(b, i, n_ff)
        b.norm(f"blk.{i}.post_ffw_norm.weight", D_MODEL)


def _qwen35_family(b: _Builder, n_layers: int, vocab: int, mtp: bool, moe: bool) -> None:
    """Qwen3.5 hybrid: gated delta-net layers, full attention every `full_attention_interval`-th."""
    head, n_head, n_kv, n_ff, interval = 16, 4, 2, 128, 4
    # Delta-net: k and v heads both of size state_size; v heads a multiple of k heads (groups);
    # inner_size = state_size x time_step_rank.
    d_state, n_group, dt_rank, d_conv = 16, 2, 4, 4
    n_expert, n_used, n_ff_exp = 4, 2, 32
    n_all = n_layers + (1 if mtp else 0)
    _common(b, n_all, n_head, n_kv, n_ff, rope_base=10_000_000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("rope.dimension_count", 8)
    b.i32s("rope.dimension_sections", [2, 1, 1, 0])  # sums to rope.dimension_count / 2
    b.u32("ssm.conv_kernel", d_conv)
    b.u32("ssm.state_size", d_state)
    b.u32("ssm.group_count", n_group)
    b.u32("ssm.time_step_rank", dt_rank)
    b.u32("ssm.inner_size", d_state * dt_rank)
    b.u32("full_attention_interval", interval)
    if mtp:
        b.u32("nextn_predict_layers", 1)
    if moe:
        b.u32("expert_count", n_expert)
        b.u32("expert_used_count", n_used)
        b.u32("expert_feed_forward_length", n_ff_exp)
        b.u32("expert_shared_feed_forward_length", n_ff_exp)
    _embd(b, vocab, output=True)
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", D_MODEL)
        b.norm(f"blk.{i}.post_attention_norm.weight", D_MODEL)
        if i >= n_layers or (i + 1) % interval == 0:
            # q is [q | gate] per head: twice as wide; the gate is a sigmoid on the attention output
            _qkv(b, i, 2 * n_head * head, n_kv * head, n_head * head)
            b.norm(f"blk.{i}.attn_q_norm.weight", head)
            b.norm(f"blk.{i}.attn_k_norm.weight", head)
        else:
            b.t(f"blk.{i}.attn_qkv.weight", D_MODEL, 2 * key_dim + value_dim)
            b.t(f"blk.{i}.attn_gate.weight", D_MODEL, value_dim)
            b.t(f"blk.{i}.ssm_conv1d.weight", d_conv, 2 * key_dim + value_dim)
            b.t(f"blk.{i}.ssm_dt.bias", dt_rank, kind="small")
            b.t(f"blk.{i}.ssm_a", dt_rank, kind="neg")
            b.t(f"blk.{i}.ssm_beta.weight", D_MODEL, dt_rank)
            b.t(f"blk.{i}.ssm_alpha.weight", D_MODEL, dt_rank)
            b.norm(f"blk.{i}.ssm_norm.weight", d_state)
            b.t(f"blk.{i}.ssm_out.weight", value_dim, D_MODEL)
        if moe:
            _experts(b, i, n_expert, n_ff_exp, n_ff_exp)
            b.t(f"blk.{i}.ffn_gate_inp_shexp.weight", D_MODEL)
        else:
            _ffn(b, i, n_ff)
        if i >= n_layers:
            _nextn(b, i)


def _nextn(b: _Builder, i: int) -> None:
    b.t(f"blk.{i}.nextn.eh_proj.weight", 2 * D_MODEL, D_MODEL)
    b.norm(f"blk.{i}.nextn.enorm.weight", D_MODEL)
    b.norm(f"blk.{i}.nextn.hnorm.weight", D_MODEL)
    b.norm(f"blk.{i}.nextn.shared_head_norm.weight", D_MODEL)


def _qwen35(b: _Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    _qwen35_family(b, n_layers, vocab, mtp, moe=False)


def _qwen35moe(b: _Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    _qwen35_family(b, n_layers, vocab, mtp, moe=True)


# DeepSeek-V4-Flash's rope.scaling.* keys as its GGUFs carry them (rope.freq_base 10000 is _common's).
DEEPSEEK4_FLASH_ROPE_SCALING: dict[str, str | float | int] = {
    "type": "yarn",
    "factor": 16.0,
    "original_context_length": 65536,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
}


def deepseek4_compress_ratios(n_layers: int) -> list[int]:
    """Per-layer compression ratios of the tiny deepseek4: 0 (raw window only), 4 and 128 in turn."""
    return [(0, 4, 128)[i % 3] for i in range(n_layers)]


def _deepseek4(b: _Builder, n_layers: int, vocab: int, mtp: bool, hash_layers: int = 1) -> None:
    """DeepSeek-V4: 4 hyper-connection streams, K = V single-head raw window + compressed caches."""
    head, n_head, n_rot, q_lora, o_groups, o_lora = 64, 4, 16, 32, 2, 16
    n_expert, n_used, n_ff_exp, hc = 4, 2, 32, 4
    idx_heads, idx_len = 2, 64  # the indexer key length must be a multiple of 64
    n_all = n_layers + (1 if mtp else 0)
    _common(b, n_all, n_head, 1, n_ff_exp)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("rope.dimension_count", n_rot)
    b.u32("attention.q_lora_rank", q_lora)
    b.u32("attention.sliding_window", 16)
    b.u32("expert_count", n_expert)
    b.u32("expert_used_count", n_used)
    b.u32("expert_feed_forward_length", n_ff_exp)
    b.u32("expert_shared_count", 1)
    b.f32("expert_weights_scale", 1.5)
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 4)  # sqrt(softplus): the only scoring the loader accepts
    # per layer, as llama.cpp's converter writes it (the MTP block included); read with get_key_or_arr
    b.f32s("swiglu_clamp_exp", [10.0] * n_all)
    b.u32("attention.indexer.head_count", idx_heads)
    b.u32("attention.indexer.key_length", idx_len)
    b.u32("attention.indexer.top_k", 8)
    b.u32("attention.output_group_count", o_groups)
    b.u32("attention.output_lora_rank", o_lora)
    b.f32("attention.compress_rope_freq_base", 160000.0)
    b.rope_scaling(DEEPSEEK4_FLASH_ROPE_SCALING)  # YaRN, applied in the compressing layers only
    b.u32("hyper_connection.count", hc)
    b.u32("hyper_connection.sinkhorn_iterations", 20)
    b.f32("hyper_connection.epsilon", 1e-6)
    b.u32("hash_layer_count", hash_layers)
    ratios = deepseek4_compress_ratios(n_layers) + [0] * (n_all - n_layers)
    b.u32s("attention.compress_ratios", ratios)
    if mtp:
        b.u32("nextn_predict_layers", 1)
    _embd(b, vocab, output=True)  # deepseek4 requires a separate output head
    hc_mix = (2 + hc) * hc
    b.t("output_hc_fn.weight", hc * D_MODEL, hc, kind="small")
    b.t("output_hc_base.weight", hc, kind="small")
    b.t("output_hc_scale.weight", 1, kind="small")
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", D_MODEL)
        b.t(f"blk.{i}.attn_sinks.weight", n_head, kind="small")
        b.t(f"blk.{i}.attn_q_a.weight", D_MODEL, q_lora)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", q_lora, n_head * head)
        b.t(f"blk.{i}.attn_kv.weight", D_MODEL, head)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", head)
        # stored as (n_head*head/o_groups, o_lora*o_groups); the loader reshapes it per group
        b.t(f"blk.{i}.attn_output_a.weight", n_head * head // o_groups, o_lora * o_groups)
        b.t(f"blk.{i}.attn_output_b.weight", o_groups * o_lora, D_MODEL)
        for part in ("attn", "ffn"):
            b.t(f"blk.{i}.hc_{part}_fn.weight", hc * D_MODEL, hc_mix, kind="small")
            b.t(f"blk.{i}.hc_{part}_base.weight", hc_mix, kind="small")
            b.t(f"blk.{i}.hc_{part}_scale.weight", 3, kind="small")
        ratio = ratios[i]
        if ratio:
            coff = 2 if ratio == 4 else 1
            b.t(f"blk.{i}.attn_compressor_kv.weight", D_MODEL, coff * head)
            b.t(f"blk.{i}.attn_compressor_gate.weight", D_MODEL, coff * head)
            b.t(f"blk.{i}.attn_compressor_ape.weight", coff * head, ratio, kind="small")
            b.norm(f"blk.{i}.attn_compressor_norm.weight", head)
            if ratio == 4:
                b.t(f"blk.{i}.indexer.proj.weight", D_MODEL, idx_heads)
                b.t(f"blk.{i}.indexer.attn_q_b.weight", q_lora, idx_heads * idx_len)
                b.t(f"blk.{i}.indexer_compressor_kv.weight", D_MODEL, 2 * idx_len)
                b.t(f"blk.{i}.indexer_compressor_gate.weight", D_MODEL, 2 * idx_len)
                b.t(f"blk.{i}.indexer_compressor_ape.weight", 2 * idx_len, ratio, kind="small")
                b.norm(f"blk.{i}.indexer_compressor_norm.weight", idx_len)
        b.t(f"blk.{i}.ffn_gate_inp.weight", D_MODEL, n_expert)
        if i < hash_layers:
            # hash routing: token id -> the experts it always uses
            b.t(f"blk.{i}.ffn_gate_tid2eid.weight", n_used, vocab, kind="ids", high=n_expert)
        else:
            b.t(f"blk.{i}.exp_probs_b.bias", n_expert, kind="small")
        b.norm(f"blk.{i}.ffn_norm.weight", D_MODEL)
        b.t(f"blk.{i}.ffn_gate_exps.weight", D_MODEL, n_ff_exp, n_expert)
        b.t(f"blk.{i}.ffn_down_exps.weight", n_ff_exp, D_MODEL, n_expert)
        b.t(f"blk.{i}.ffn_up_exps.weight", D_MODEL, n_ff_exp, n_expert)
        b.t(f"blk.{i}.ffn_gate_shexp.weight", D_MODEL, n_ff_exp)
        b.t(f"blk.{i}.ffn_down_shexp.weight", n_ff_exp, D_MODEL)
        b.t(f"blk.{i}.ffn_up_shexp.weight", D_MODEL, n_ff_exp)
        if i >= n_layers:
            _nextn(b, i)


def glm_dsa_indexer_types(n_layers: int) -> list[int]:
    """1 = full indexer, 0 = shares the previous full layer's top-k; the first layer must be full."""
    return [1 if i % 3 == 0 else 0 for i in range(n_layers)]


def _glm_dsa(b: _Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    """GLM-5.2: MLA latent cache, DeepSeek sparse attention with full and shared indexers, MoE."""
    n_head, q_lora, kv_lora, n_rot, nope, v_head = 4, 32, 32, 16, 16, 16
    n_expert, n_used, n_ff_exp, n_ff, dense_lead = 4, 2, 32, 128, 1
    idx_heads, idx_len = 2, 64  # power of two >= 64
    n_all = n_layers + (1 if mtp else 0)
    _common(b, n_all, n_head, 1, n_ff, rope_base=8_000_000.0)  # GLM-5.2's base
    b.u32("attention.key_length", kv_lora + n_rot)
    b.u32("attention.value_length", kv_lora)
    b.u32("attention.key_length_mla", nope + n_rot)
    b.u32("attention.value_length_mla", v_head)
    b.u32("rope.dimension_count", n_rot)
    b.u32("attention.q_lora_rank", q_lora)
    b.u32("attention.kv_lora_rank", kv_lora)
    b.u32("expert_count", n_expert)
    b.u32("expert_used_count", n_used)
    b.u32("expert_feed_forward_length", n_ff_exp)
    b.u32("expert_shared_count", 1)
    b.u32("leading_dense_block_count", dense_lead)
    b.f32("expert_weights_scale", 2.5)
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 2)  # sigmoid
    b.u32("attention.indexer.head_count", idx_heads)
    b.u32("attention.indexer.key_length", idx_len)
    b.u32("attention.indexer.top_k", 8)
    types = glm_dsa_indexer_types(n_layers)
    b.u32s("attention.indexer.types", types)
    if mtp:
        b.u32("nextn_predict_layers", 1)
    _embd(b, vocab, output=True)
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", D_MODEL)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", q_lora)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", kv_lora)
        b.t(f"blk.{i}.attn_q_a.weight", D_MODEL, q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", q_lora, n_head * (nope + n_rot))
        b.t(f"blk.{i}.attn_kv_a_mqa.weight", D_MODEL, kv_lora + n_rot)
        b.t(f"blk.{i}.attn_k_b.weight", nope, kv_lora, n_head)
        b.t(f"blk.{i}.attn_v_b.weight", kv_lora, v_head, n_head)
        b.t(f"blk.{i}.attn_output.weight", n_head * v_head, D_MODEL)
        b.norm(f"blk.{i}.ffn_norm.weight", D_MODEL)
        if i >= n_layers or types[i]:
            b.norm(f"blk.{i}.indexer.k_norm.weight", idx_len)
            b.t(f"blk.{i}.indexer.k_norm.bias", idx_len, kind="small")
            b.t(f"blk.{i}.indexer.proj.weight", D_MODEL, idx_heads)
            b.t(f"blk.{i}.indexer.attn_k.weight", D_MODEL, idx_len)
            b.t(f"blk.{i}.indexer.attn_q_b.weight", q_lora, idx_heads * idx_len)
        if i < dense_lead:
            _ffn(b, i, n_ff)
        else:
            b.t(f"blk.{i}.ffn_gate_inp.weight", D_MODEL, n_expert)
            b.t(f"blk.{i}.exp_probs_b.bias", n_expert, kind="small")
            b.t(f"blk.{i}.ffn_gate_exps.weight", D_MODEL, n_ff_exp, n_expert)
            b.t(f"blk.{i}.ffn_down_exps.weight", n_ff_exp, D_MODEL, n_expert)
            b.t(f"blk.{i}.ffn_up_exps.weight", D_MODEL, n_ff_exp, n_expert)
            b.t(f"blk.{i}.ffn_gate_shexp.weight", D_MODEL, n_ff_exp)
            b.t(f"blk.{i}.ffn_down_shexp.weight", n_ff_exp, D_MODEL)
            b.t(f"blk.{i}.ffn_up_shexp.weight", D_MODEL, n_ff_exp)
        if i >= n_layers:
            _nextn(b, i)


_BUILDERS: dict[str, Callable[[_Builder, int, int, bool], None]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "qwen35": _qwen35,
    "qwen35moe": _qwen35moe,
    "deepseek4": _deepseek4,
    "glm-dsa": _glm_dsa,
}
_MTP_ARCHS = ("qwen35", "qwen35moe", "deepseek4", "glm-dsa")


def _values(t: _Tensor, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    shape = tuple(reversed(t.ne))  # numpy order is ggml's reversed
    if t.kind == "ids":
        # each token routes to n_used distinct experts
        ids = np.argsort(rng.random((t.ne[1], t.high)), axis=1)[:, : t.ne[0]]
        return ids.astype(np.int32)
    if t.kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if t.kind == "head":
        return rng.standard_normal(shape).astype(np.float32)
    if t.kind == "small":
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if t.kind == "neg":
        return (-rng.uniform(0.5, 1.5, shape)).astype(np.float32)
    scale = 1.0 / float(t.ne[0]) ** 0.5  # keeps activations O(1) through random layers
    out: np.ndarray[Any, Any] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return out


def _encode(
    name: str, kind: str, values: np.ndarray[Any, Any], dtype: str
) -> tuple[np.ndarray[Any, Any], Any]:
    """(array, raw ggml type or None) for `values` at the file's dtype; non-matmul tensors stay f32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if (
        dtype == "f32"
        or kind not in ("matmul", "head")
        or values.ndim < 2
        or any(k in name for k in _KEEP_F32)
    ):
        return values, None
    if dtype == "f16":
        return values.astype(np.float16), None
    if values.shape[-1] % 32 != 0:  # q8_0 blocks are 32 wide along ne0
        return values, None
    return quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: Path) -> tuple[tuple[str, Any, Any, Any], ...]:
    """(key, value, type, array element type) of every tokenizer.* field of `source`.

    Cached: reading SmolLM2's 49k tokens and merges takes seconds, and a test session writes many files.
    """
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source, "r")
    out: list[tuple[str, Any, Any, Any]] = []
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        out.append((key, f.contents(), vtype, sub))
    if not any(k == "tokenizer.ggml.tokens" for k, *_ in out):
        raise TinyModelError(f"{source}: has no tokenizer.ggml.tokens to copy")
    return tuple(out)


def write_tiny_gguf(
    arch: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    n_layers: int | None = None,
    dtype: str = "f32",
    mtp: bool = False,
    tokenizer_from: str | os.PathLike[str] | None = None,
    hash_layers: int | None = None,
    rope_scaling: dict[str, str | float | int] | None = None,
    swiglu_clamp: float | list[float] | None = None,
) -> Path:
    """Write a tiny random-weight GGUF of `arch` to `path`; the same arguments give the same bytes.

    `mtp` adds one multi-token-prediction block after the trunk (`nextn_predict_layers` = 1), for the
    architectures that have one. The tokenizer is copied from SmolLM2's packaged GGUF unless
    `tokenizer_from` names another file. `hash_layers` (deepseek4 only, default 1): how many leading
    layers route their experts by token id. `rope_scaling` replaces the file's rope.scaling.* keys
    (deepseek4 carries DeepSeek-V4-Flash's YaRN keys by default; `{}` writes none), e.g.
    `{"type": "yarn", "factor": 4, "original_context_length": 32768}` as Qwen3's long-context files.
    `swiglu_clamp` (deepseek4): the experts' SwiGLU limit, one number or a list written as given
    (default 10.0 per layer, as an array like llama.cpp's converter writes it).
    """
    from gguf import GGUFValueType, GGUFWriter

    if arch not in _BUILDERS:
        raise TinyModelError(
            f"no tiny generator for architecture {arch!r}; known: {', '.join(ARCHITECTURES)}"
        )
    if dtype not in DTYPES:
        raise TinyModelError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if mtp and arch not in _MTP_ARCHS:
        raise TinyModelError(
            f"{arch} has no multi-token-prediction block (those that do: {', '.join(_MTP_ARCHS)})"
        )
    layers = DEFAULT_LAYERS[arch] if n_layers is None else n_layers
    if not 1 <= layers <= 64:
        raise TinyModelError(f"n_layers must be in 1..64, got {layers}")
    if tokenizer_from is None:
        from agent.artifacts.packaged import packaged_model_path

        tokenizer_from = packaged_model_path("smollm2")
    tok = _tokenizer_fields(Path(tokenizer_from).resolve())
    vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))

    b = _Builder(arch)
    if hash_layers is not None:
        if arch != "deepseek4" or not 0 <= hash_layers <= layers:
            raise TinyModelError(f"hash_layers applies to deepseek4 only, 0..{layers}")
        _deepseek4(b, layers, vocab, mtp, hash_layers)
    else:
        _BUILDERS[arch](b, layers, vocab, mtp)
    if rope_scaling is not None:
        b.rope_scaling(rope_scaling)
    if swiglu_clamp is not None:
        if arch != "deepseek4":
            raise TinyModelError("swiglu_clamp applies to deepseek4 only")
        key = f"{arch}.swiglu_clamp_exp"
        b.kv = [kv for kv in b.kv if kv[0] != key]
        if isinstance(swiglu_clamp, list):
            b.f32s("swiglu_clamp_exp", swiglu_clamp)
        else:
            b.f32("swiglu_clamp_exp", swiglu_clamp)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}-{layers}L-{dtype}-seed{seed}")
    w.add_uint32("general.file_type", _FILE_TYPE[dtype])
    scalar = {
        "u32": GGUFValueType.UINT32,
        "f32": GGUFValueType.FLOAT32,
        "bool": GGUFValueType.BOOL,
        "str": GGUFValueType.STRING,
    }
    element = {
        "u32[]": GGUFValueType.UINT32,
        "i32[]": GGUFValueType.INT32,
        "f32[]": GGUFValueType.FLOAT32,
    }
    for key, value, kind in b.kv:
        if kind in scalar:
            w.add_key_value(key, value, scalar[kind])
        else:
            w.add_key_value(key, value, GGUFValueType.ARRAY, element[kind])
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    rng = np.random.default_rng(seed)
    for t in b.tensors:
        arr, raw = _encode(t.name, t.kind, _values(t, rng), dtype)
        w.add_tensor(t.name, arr, raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m agent.artifacts.tiny --arch A --out F`; the agent CLI's `tiny` command calls this too."""
    import argparse

    ap = argparse.ArgumentParser(prog="tiny", description=main.__doc__)
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: Any) -> None:
    ap.add_argument("--arch", required=True, choices=ARCHITECTURES)
    ap.add_argument("--out", required=True, help="path of the GGUF to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="trunk layers (default per architecture)")
    ap.add_argument("--dtype", choices=DTYPES, default="f32")
    ap.add_argument("--mtp", action="store_true", help="add a multi-token-prediction block")


def run(args: Any) -> int:
    import logging

    logging.getLogger("gguf").setLevel(logging.WARNING)  # the writer narrates every file at INFO
    try:
        p = write_tiny_gguf(
            args.arch, args.out, seed=args.seed, n_layers=args.layers, dtype=args.dtype, mtp=args.mtp
        )
    except TinyModelError as e:
        print(f"error: {e}")
        return 2
    print(f"{p}  ({p.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
