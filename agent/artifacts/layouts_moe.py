"""The layouts of the mixture-of-experts architectures people run distributed (issue 35): Qwen3-MoE, GLM-4.5
(glm4moe), DeepSeek-V3 (deepseek2), gpt-oss and MiniMax-M2, on the pieces layouts.py shares; the same
rules as there (llama.cpp's loader: keys, tensor names and shapes), listed only."""

from __future__ import annotations

from dataclasses import dataclass

from agent.artifacts.layouts import Builder, common, embd, expert_table, ffn, nextn, qkv

# DeepSeek-V3's (and R1's) rope.scaling.* keys as llama.cpp's converter writes them from its config: YaRN
# over a 4K original context (163,840 / 40), its betas, and yarn_log_multiplier 0.1 x mscale_all_dim (1.0).
DEEPSEEK_V3_ROPE_SCALING: dict[str, str | float | int] = {
    "type": "yarn",
    "factor": 40.0,
    "original_context_length": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_log_multiplier": 0.1,
}

# gpt-oss-20b's and -120b's rope.scaling.* keys as llama.cpp's converter writes them from their config: YaRN
# factor 32 over a 4K original context (131,072 / 32), betas 32 / 1.
GPT_OSS_ROPE_SCALING: dict[str, str | float | int] = {
    "type": "yarn",
    "factor": 32.0,
    "original_context_length": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
}


# --- Qwen3 MoE, GLM-4.5 (glm4moe), DeepSeek-V3 (deepseek2) -------------------------------------------------


@dataclass(frozen=True)
class MoeDims:
    """The attention and expert sizes of qwen3moe, glm4moe and deepseek2 files (each uses what it has)."""

    d: int
    n_layers: int
    vocab: int
    ctx: int = 4096
    eps: float = 1e-6
    rope_base: float = 1_000_000.0
    head: int = 64
    n_head: int = 4
    n_kv: int = 2
    n_rot: int = 64
    n_ff: int = 128
    n_expert: int = 8
    n_used: int = 2
    n_ff_exp: int = 32
    n_shexp: int = 1
    dense_lead: int = 1
    w_scale: float = 2.5
    groups: int = 0  # expert_group_count (n_group: GLM-4.5's 1, DeepSeek-V3's 8); 0 writes none
    group_used: int = 0
    # deepseek2's multi-head latent attention
    q_lora: int = 32
    kv_lora: int = 64
    nope: int = 32
    v_head: int = 32
    mtp: bool = False


def qwen3moe(b: Builder, m: MoeDims) -> None:
    """Qwen3-MoE (30B-A3B, 235B-A22B, Coder-480B): the qwen3 layer with softmax-routed experts, no shared one."""
    common(b, m.d, m.n_layers, m.n_head, m.n_kv, m.n_ff, ctx=m.ctx, eps=m.eps, rope_base=m.rope_base)
    b.u32("attention.key_length", m.head)
    b.u32("attention.value_length", m.head)
    b.u32("expert_count", m.n_expert)
    b.u32("expert_used_count", m.n_used)
    b.u32("expert_feed_forward_length", m.n_ff_exp)
    embd(b, m.d, m.vocab, output=True)
    for i in range(m.n_layers):
        b.norm(f"blk.{i}.attn_norm.weight", m.d)
        qkv(b, i, m.d, m.n_head * m.head, m.n_kv * m.head, m.n_head * m.head)
        b.norm(f"blk.{i}.attn_q_norm.weight", m.head)
        b.norm(f"blk.{i}.attn_k_norm.weight", m.head)
        b.norm(f"blk.{i}.ffn_norm.weight", m.d)
        b.t(f"blk.{i}.ffn_gate_inp.weight", m.d, m.n_expert)
        expert_table(b, i, m.d, m.n_ff_exp, m.n_expert)


def _moe_keys(b: Builder, m: MoeDims) -> None:
    """The routed and shared expert keys GLM-4.5 and DeepSeek-V3 files carry (sigmoid gating)."""
    b.u32("expert_count", m.n_expert)
    b.u32("expert_used_count", m.n_used)
    b.u32("expert_feed_forward_length", m.n_ff_exp)
    b.u32("expert_shared_count", m.n_shexp)
    b.u32("leading_dense_block_count", m.dense_lead)
    b.f32("expert_weights_scale", m.w_scale)
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 2)  # sigmoid
    if m.groups:
        b.u32("expert_group_count", m.groups)
        b.u32("expert_group_used_count", m.group_used)


def _moe_ffn(b: Builder, i: int, m: MoeDims) -> None:
    """Layer i's FFN: dense below leading_dense_block_count, else biased router, experts, shared expert."""
    if i < m.dense_lead:
        ffn(b, i, m.d, m.n_ff)
        return
    b.t(f"blk.{i}.ffn_gate_inp.weight", m.d, m.n_expert)
    b.t(f"blk.{i}.exp_probs_b.bias", m.n_expert, kind="small")
    expert_table(b, i, m.d, m.n_ff_exp, m.n_expert)
    expert_table(b, i, m.d, m.n_ff_exp * m.n_shexp)


def glm4moe(b: Builder, m: MoeDims) -> None:
    """GLM-4.5/4.6/4.7: q/k/v biases, q/k norms, partial NEOX RoPE, leading dense layers, sigmoid-routed
    experts with a selection bias and a shared expert; the last block is the MTP layer, always present."""
    n_all = m.n_layers + 1
    common(b, m.d, n_all, m.n_head, m.n_kv, m.n_ff, ctx=m.ctx, eps=m.eps, rope_base=m.rope_base)
    b.u32("attention.key_length", m.head)
    b.u32("attention.value_length", m.head)
    b.u32("rope.dimension_count", m.n_rot)
    _moe_keys(b, m)
    b.u32("nextn_predict_layers", 1)
    embd(b, m.d, m.vocab, output=True)
    n_q, n_kv = m.n_head * m.head, m.n_kv * m.head
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", m.d)
        qkv(b, i, m.d, n_q, n_kv, n_q)
        b.t(f"blk.{i}.attn_q.bias", n_q, kind="small")
        b.t(f"blk.{i}.attn_k.bias", n_kv, kind="small")
        b.t(f"blk.{i}.attn_v.bias", n_kv, kind="small")
        b.norm(f"blk.{i}.attn_q_norm.weight", m.head)
        b.norm(f"blk.{i}.attn_k_norm.weight", m.head)
        b.norm(f"blk.{i}.post_attention_norm.weight", m.d)
        _moe_ffn(b, i, m)
        if i >= m.n_layers:
            nextn(b, i, m.d)


def deepseek2(b: Builder, m: MoeDims) -> None:
    """DeepSeek-V3/R1, Kimi-K2: MLA (split attn_k_b / attn_v_b, a latent cache of kv_lora + rope), leading
    dense layers, sigmoid-routed grouped experts with a selection bias and shared experts."""
    n_all = m.n_layers + (1 if m.mtp else 0)
    common(b, m.d, n_all, m.n_head, 1, m.n_ff, ctx=m.ctx, eps=m.eps, rope_base=m.rope_base)
    b.u32("vocab_size", m.vocab)
    b.u32("attention.key_length", m.kv_lora + m.n_rot)
    b.u32("attention.value_length", m.kv_lora)
    b.u32("attention.key_length_mla", m.nope + m.n_rot)
    b.u32("attention.value_length_mla", m.v_head)
    b.u32("rope.dimension_count", m.n_rot)
    b.u32("attention.q_lora_rank", m.q_lora)
    b.u32("attention.kv_lora_rank", m.kv_lora)
    _moe_keys(b, m)
    if m.mtp:
        b.u32("nextn_predict_layers", 1)
    embd(b, m.d, m.vocab, output=True)
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", m.d)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", m.q_lora)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", m.kv_lora)
        b.t(f"blk.{i}.attn_q_a.weight", m.d, m.q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", m.q_lora, m.n_head * (m.nope + m.n_rot))
        b.t(f"blk.{i}.attn_kv_a_mqa.weight", m.d, m.kv_lora + m.n_rot)
        b.t(f"blk.{i}.attn_k_b.weight", m.nope, m.kv_lora, m.n_head)
        b.t(f"blk.{i}.attn_v_b.weight", m.kv_lora, m.v_head, m.n_head)
        b.t(f"blk.{i}.attn_output.weight", m.n_head * m.v_head, m.d)
        b.norm(f"blk.{i}.ffn_norm.weight", m.d)
        _moe_ffn(b, i, m)
        if i >= m.n_layers:
            nextn(b, i, m.d)


# --- gpt-oss ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptOssDims:
    """gpt-oss's sizes (120b: d 2880, 36 layers, 64 query heads of 64 over 8 KV heads, 128 experts of 2880,
    4 used, window 128)."""

    d: int
    n_layers: int
    vocab: int
    ctx: int = 131072
    eps: float = 1e-5
    rope_base: float = 150000.0
    head: int = 64
    n_head: int = 4
    n_kv: int = 2
    n_ff_exp: int = 32
    n_expert: int = 8
    n_used: int = 4
    window: int = 128


def gpt_oss(b: Builder, m: GptOssDims) -> None:
    """gpt-oss-20b/120b: q/k/v/o biases, attention sinks, sliding and full layers in turn (the loader's
    default pattern of 2), YaRN, a biased router and biased experts (MXFP4 in the real files: kind "mxfp4")."""
    common(b, m.d, m.n_layers, m.n_head, m.n_kv, m.n_ff_exp, ctx=m.ctx, eps=m.eps, rope_base=m.rope_base)
    b.u32("expert_count", m.n_expert)
    b.u32("expert_used_count", m.n_used)
    b.u32("attention.key_length", m.head)
    b.u32("attention.value_length", m.head)
    b.u32("attention.sliding_window", m.window)
    b.u32("expert_feed_forward_length", m.n_ff_exp)
    b.rope_scaling(GPT_OSS_ROPE_SCALING)
    embd(b, m.d, m.vocab, output=True)
    n_q, n_kv = m.n_head * m.head, m.n_kv * m.head
    for i in range(m.n_layers):
        b.norm(f"blk.{i}.attn_norm.weight", m.d)
        b.t(f"blk.{i}.attn_output.bias", m.d, kind="small")
        b.t(f"blk.{i}.attn_output.weight", n_q, m.d)
        b.t(f"blk.{i}.attn_sinks.weight", m.n_head, kind="head")  # logits of the order of the scores
        for name, n in (("k", n_kv), ("q", n_q), ("v", n_kv)):
            b.t(f"blk.{i}.attn_{name}.bias", n, kind="small")
            b.t(f"blk.{i}.attn_{name}.weight", m.d, n)
        for name in ("down", "gate", "up"):
            ne0, ne1 = (m.d, m.n_ff_exp) if name != "down" else (m.n_ff_exp, m.d)
            b.t(f"blk.{i}.ffn_{name}_exps.bias", ne1, m.n_expert, kind="small")
            b.t(f"blk.{i}.ffn_{name}_exps.weight", ne0, ne1, m.n_expert, kind="mxfp4")
        b.t(f"blk.{i}.ffn_gate_inp.bias", m.n_expert, kind="small")
        b.t(f"blk.{i}.ffn_gate_inp.weight", m.d, m.n_expert)
        b.norm(f"blk.{i}.post_attention_norm.weight", m.d)


# --- MiniMax-M2 ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MinimaxM2Dims:
    """MiniMax-M2's sizes (M2 and M2.1: d 3072, 62 layers, 48 query heads of 128 over 8 KV heads, RoPE on
    64 channels of each head, 256 experts of 1536, 8 used; no MTP blocks in the converted files)."""

    d: int
    n_layers: int
    vocab: int
    ctx: int = 196608
    eps: float = 1e-6
    rope_base: float = 5_000_000.0
    head: int = 64
    n_rot: int = 32
    n_head: int = 12
    n_kv: int = 2
    n_ff_exp: int = 32
    n_expert: int = 16
    n_used: int = 4


def minimax_m2(b: Builder, m: MinimaxM2Dims) -> None:
    """MiniMax-M2 / M2.1: q and k RMS norms over the whole projection (all heads together), partial NEOX
    RoPE, sigmoid-routed experts (expert_gating_func 2) with the exp_probs_b selection bias, no shared
    expert. llama.cpp's converter writes feed_forward_length and expert_feed_forward_length both from
    intermediate_size."""
    common(b, m.d, m.n_layers, m.n_head, m.n_kv, m.n_ff_exp, ctx=m.ctx, eps=m.eps, rope_base=m.rope_base)
    b.u32("expert_count", m.n_expert)
    b.u32("expert_used_count", m.n_used)
    b.u32("expert_gating_func", 2)  # sigmoid
    b.u32("attention.key_length", m.head)
    b.u32("attention.value_length", m.head)
    b.u32("expert_feed_forward_length", m.n_ff_exp)
    b.u32("rope.dimension_count", m.n_rot)
    embd(b, m.d, m.vocab, output=True)
    n_q, n_kv = m.n_head * m.head, m.n_kv * m.head
    for i in range(m.n_layers):
        b.norm(f"blk.{i}.attn_norm.weight", m.d)
        qkv(b, i, m.d, n_q, n_kv, n_q)
        b.norm(f"blk.{i}.attn_q_norm.weight", n_q)
        b.norm(f"blk.{i}.attn_k_norm.weight", n_kv)
        b.norm(f"blk.{i}.ffn_norm.weight", m.d)
        b.t(f"blk.{i}.ffn_gate_inp.weight", m.d, m.n_expert)
        b.t(f"blk.{i}.exp_probs_b.bias", m.n_expert, kind="small")
        expert_table(b, i, m.d, m.n_ff_exp, m.n_expert)
