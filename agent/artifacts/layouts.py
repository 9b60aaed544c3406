"""The GGUF metadata keys and tensor sets of the architectures, at any size: what the tiny writer (tiny.py)
and the real-shaped writer (realshape.py) both lay out, from llama.cpp's loader rules (which keys are
required, tensor names and shapes; not its code). A layout only lists; the writers choose the values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# DeepSeek-V4-Flash's rope.scaling.* keys as its GGUFs carry them (YaRN, applied in compressing layers).
DEEPSEEK4_FLASH_ROPE_SCALING: dict[str, str | float | int] = {
    "type": "yarn",
    "factor": 16.0,
    "original_context_length": 65536,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
}


@dataclass
class Tensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne0 (fastest varying) first
    kind: str  # "matmul", "head", "norm", "small", "neg", "ids": what values suit it; "mxfp4": a matmul
    # stored in MXFP4 whatever the file's dtype (gpt-oss's experts)
    high: int = 0  # exclusive upper bound for "ids"


@dataclass
class Builder:
    """Collects one file's metadata and tensor list before anything is written."""

    arch: str
    kv: list[tuple[str, Any, str]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)

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

    def u32s(self, key: str, values: list[int]) -> None:
        self.kv.append((f"{self.arch}.{key}", [int(v) for v in values], "u32[]"))

    def i32s(self, key: str, values: list[int]) -> None:
        self.kv.append((f"{self.arch}.{key}", [int(v) for v in values], "i32[]"))

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

    def t(self, name: str, *ne: int, kind: str = "matmul", high: int = 0) -> None:
        self.tensors.append(Tensor(name, tuple(int(x) for x in ne), kind, high))

    def norm(self, name: str, n: int) -> None:
        self.t(name, n, kind="norm")


def write_kv(writer: Any, b: Builder) -> None:
    """The builder's metadata into a gguf.GGUFWriter, with the GGUF types it was given."""
    from gguf import GGUFValueType

    scalar = {
        "u32": GGUFValueType.UINT32,
        "f32": GGUFValueType.FLOAT32,
        "bool": GGUFValueType.BOOL,
        "str": GGUFValueType.STRING,
    }
    element = {"u32[]": GGUFValueType.UINT32, "i32[]": GGUFValueType.INT32, "f32[]": GGUFValueType.FLOAT32}
    for key, value, kind in b.kv:
        if kind in scalar:
            writer.add_key_value(key, value, scalar[kind])
        else:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, element[kind])


def write_file(writer: Any) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors to its file, then close it (also on error)."""
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


# --- the pieces architectures share -------------------------------------------------------------------


def common(b: Builder, d: int, n_layers: int, n_head: int, n_kv: int, n_ff: int, *, ctx: int, eps: float,
           rope_base: float) -> None:  # fmt: skip
    b.u32("context_length", ctx)
    b.u32("embedding_length", d)
    b.u32("block_count", n_layers)
    b.u32("feed_forward_length", n_ff)
    b.u32("attention.head_count", n_head)
    b.u32("attention.head_count_kv", n_kv)
    b.f32("attention.layer_norm_rms_epsilon", eps)
    b.f32("rope.freq_base", rope_base)


def embd(b: Builder, d: int, vocab: int, *, output: bool) -> None:
    b.t("token_embd.weight", d, vocab, kind="head")
    b.norm("output_norm.weight", d)
    if output:
        b.t("output.weight", d, vocab, kind="head")


def ffn(b: Builder, i: int, d: int, n_ff: int) -> None:
    b.t(f"blk.{i}.ffn_gate.weight", d, n_ff)
    b.t(f"blk.{i}.ffn_up.weight", d, n_ff)
    b.t(f"blk.{i}.ffn_down.weight", n_ff, d)


GUD = ("gate", "up", "down")  # the order Qwen3.5's converter writes an FFN's three tensors in
GDU = ("gate", "down", "up")  # Qwen3-MoE's, GLM's and DeepSeek's


def expert_table(
    b: Builder, i: int, d: int, n_ff: int, n_expert: int = 0, order: tuple[str, ...] = GDU
) -> None:
    """Layer i's routed experts (`n_expert` stacked: ffn_*_exps) or, with n_expert 0, its shared one
    (ffn_*_shexp), in `order`: the writers order tensors as the converters do."""
    shapes = {"gate": (d, n_ff), "up": (d, n_ff), "down": (n_ff, d)}
    suffix, stack = ("exps", (n_expert,)) if n_expert else ("shexp", ())
    for name in order:
        b.t(f"blk.{i}.ffn_{name}_{suffix}.weight", *shapes[name], *stack)


def experts(b: Builder, i: int, d: int, n_expert: int, n_ff_exp: int, n_ff_shexp: int) -> None:
    """Qwen3.5-MoE's router, routed experts and shared expert."""
    b.t(f"blk.{i}.ffn_gate_inp.weight", d, n_expert)
    expert_table(b, i, d, n_ff_exp, n_expert, GUD)
    expert_table(b, i, d, n_ff_shexp, 0, GUD)


def routed_experts(b: Builder, i: int, d: int, n_expert: int, n_ff_exp: int) -> None:
    """The MLA / DeepSeek order: the routed experts (gate, down, up), then the shared one."""
    expert_table(b, i, d, n_ff_exp, n_expert)
    expert_table(b, i, d, n_ff_exp)


def qkv(b: Builder, i: int, d: int, n_q: int, n_kv: int, n_out: int) -> None:
    b.t(f"blk.{i}.attn_q.weight", d, n_q)
    b.t(f"blk.{i}.attn_k.weight", d, n_kv)
    b.t(f"blk.{i}.attn_v.weight", d, n_kv)
    b.t(f"blk.{i}.attn_output.weight", n_out, d)


def nextn(b: Builder, i: int, d: int) -> None:
    b.t(f"blk.{i}.nextn.eh_proj.weight", 2 * d, d)
    b.norm(f"blk.{i}.nextn.enorm.weight", d)
    b.norm(f"blk.{i}.nextn.hnorm.weight", d)
    b.norm(f"blk.{i}.nextn.shared_head_norm.weight", d)


# --- DeepSeek-V4 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dsv4Dims:
    """deepseek4's sizes; `ratios` one per trunk layer (0, 4 or 128), `mtp` adds a nextn block."""

    d: int
    n_layers: int
    vocab: int
    ratios: tuple[int, ...]
    ctx: int = 4096
    head: int = 64
    n_head: int = 4
    n_rot: int = 16
    q_lora: int = 32
    o_groups: int = 2
    o_lora: int = 16
    n_expert: int = 4
    n_used: int = 2
    n_ff_exp: int = 32
    hc: int = 4
    idx_heads: int = 2
    idx_len: int = 64  # a multiple of 64
    top_k: int = 8
    swa: int = 16
    hash_layers: int = 1
    w_scale: float = 1.5
    mtp: bool = False


def deepseek4(b: Builder, m: Dsv4Dims) -> None:
    """DeepSeek-V4: 4 hyper-connection streams, K = V single-head raw window + compressed caches."""
    n_all = m.n_layers + (1 if m.mtp else 0)
    d, head, hc = m.d, m.head, m.hc
    common(b, d, n_all, m.n_head, 1, m.n_ff_exp, ctx=m.ctx, eps=1e-6, rope_base=10000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("rope.dimension_count", m.n_rot)
    b.u32("attention.q_lora_rank", m.q_lora)
    b.u32("attention.sliding_window", m.swa)
    b.u32("expert_count", m.n_expert)
    b.u32("expert_used_count", m.n_used)
    b.u32("expert_feed_forward_length", m.n_ff_exp)
    b.u32("expert_shared_count", 1)
    b.f32("expert_weights_scale", m.w_scale)
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 4)  # sqrt(softplus): the only scoring llama.cpp's loader accepts
    # per layer, as llama.cpp's converter writes it (the MTP block included); read with get_key_or_arr
    b.f32s("swiglu_clamp_exp", [10.0] * n_all)
    b.u32("attention.indexer.head_count", m.idx_heads)
    b.u32("attention.indexer.key_length", m.idx_len)
    b.u32("attention.indexer.top_k", m.top_k)
    b.u32("attention.output_group_count", m.o_groups)
    b.u32("attention.output_lora_rank", m.o_lora)
    b.f32("attention.compress_rope_freq_base", 160000.0)
    b.rope_scaling(DEEPSEEK4_FLASH_ROPE_SCALING)
    b.u32("hyper_connection.count", hc)
    b.u32("hyper_connection.sinkhorn_iterations", 20)
    b.f32("hyper_connection.epsilon", 1e-6)
    b.u32("hash_layer_count", m.hash_layers)
    ratios = list(m.ratios) + [0] * (n_all - m.n_layers)
    b.u32s("attention.compress_ratios", ratios)
    if m.mtp:
        b.u32("nextn_predict_layers", 1)
    embd(b, d, m.vocab, output=True)  # deepseek4 requires a separate output head
    hc_mix = (2 + hc) * hc
    b.t("output_hc_fn.weight", hc * d, hc, kind="small")
    b.t("output_hc_base.weight", hc, kind="small")
    b.t("output_hc_scale.weight", 1, kind="small")
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", d)
        b.t(f"blk.{i}.attn_sinks.weight", m.n_head, kind="small")
        b.t(f"blk.{i}.attn_q_a.weight", d, m.q_lora)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", m.q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", m.q_lora, m.n_head * head)
        b.t(f"blk.{i}.attn_kv.weight", d, head)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", head)
        # stored as (n_head*head/o_groups, o_lora*o_groups); the loader reshapes it per group
        b.t(f"blk.{i}.attn_output_a.weight", m.n_head * head // m.o_groups, m.o_lora * m.o_groups)
        b.t(f"blk.{i}.attn_output_b.weight", m.o_groups * m.o_lora, d)
        for part in ("attn", "ffn"):
            b.t(f"blk.{i}.hc_{part}_fn.weight", hc * d, hc_mix, kind="small")
            b.t(f"blk.{i}.hc_{part}_base.weight", hc_mix, kind="small")
            b.t(f"blk.{i}.hc_{part}_scale.weight", 3, kind="small")
        ratio = ratios[i]
        if ratio:
            coff = 2 if ratio == 4 else 1
            b.t(f"blk.{i}.attn_compressor_kv.weight", d, coff * head)
            b.t(f"blk.{i}.attn_compressor_gate.weight", d, coff * head)
            b.t(f"blk.{i}.attn_compressor_ape.weight", coff * head, ratio, kind="small")
            b.norm(f"blk.{i}.attn_compressor_norm.weight", head)
            if ratio == 4:
                b.t(f"blk.{i}.indexer.proj.weight", d, m.idx_heads)
                b.t(f"blk.{i}.indexer.attn_q_b.weight", m.q_lora, m.idx_heads * m.idx_len)
                b.t(f"blk.{i}.indexer_compressor_kv.weight", d, 2 * m.idx_len)
                b.t(f"blk.{i}.indexer_compressor_gate.weight", d, 2 * m.idx_len)
                b.t(f"blk.{i}.indexer_compressor_ape.weight", 2 * m.idx_len, ratio, kind="small")
                b.norm(f"blk.{i}.indexer_compressor_norm.weight", m.idx_len)
        b.t(f"blk.{i}.ffn_gate_inp.weight", d, m.n_expert)
        if i < m.hash_layers:  # hash routing: token id -> the experts it always uses
            b.t(f"blk.{i}.ffn_gate_tid2eid.weight", m.n_used, m.vocab, kind="ids", high=m.n_expert)
        else:
            b.t(f"blk.{i}.exp_probs_b.bias", m.n_expert, kind="small")
        b.norm(f"blk.{i}.ffn_norm.weight", d)
        routed_experts(b, i, d, m.n_expert, m.n_ff_exp)
        if i >= m.n_layers:
            nextn(b, i, d)


# --- GLM-5.x (glm-dsa) ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GlmDims:
    """glm-dsa's sizes; `types` one per trunk layer: 1 = its own indexer, 0 = shares the last full one."""

    d: int
    n_layers: int
    vocab: int
    types: tuple[int, ...]
    ctx: int = 4096
    eps: float = 1e-6
    n_head: int = 4
    q_lora: int = 32
    kv_lora: int = 32
    n_rot: int = 16
    nope: int = 16
    v_head: int = 16
    n_expert: int = 4
    n_used: int = 2
    n_ff_exp: int = 32
    n_ff: int = 128
    dense_lead: int = 1
    idx_heads: int = 2
    idx_len: int = 64  # a power of two >= 64
    top_k: int = 8
    mtp: bool = False


def glm_dsa(b: Builder, m: GlmDims) -> None:
    """GLM-5.2: MLA latent cache, DeepSeek sparse attention with full and shared indexers, MoE."""
    n_all = m.n_layers + (1 if m.mtp else 0)
    d = m.d
    common(b, d, n_all, m.n_head, 1, m.n_ff, ctx=m.ctx, eps=m.eps, rope_base=8_000_000.0)  # GLM-5.2's base
    b.u32("attention.key_length", m.kv_lora + m.n_rot)
    b.u32("attention.value_length", m.kv_lora)
    b.u32("attention.key_length_mla", m.nope + m.n_rot)
    b.u32("attention.value_length_mla", m.v_head)
    b.u32("rope.dimension_count", m.n_rot)
    b.u32("attention.q_lora_rank", m.q_lora)
    b.u32("attention.kv_lora_rank", m.kv_lora)
    b.u32("expert_count", m.n_expert)
    b.u32("expert_used_count", m.n_used)
    b.u32("expert_feed_forward_length", m.n_ff_exp)
    b.u32("expert_shared_count", 1)
    b.u32("leading_dense_block_count", m.dense_lead)
    b.f32("expert_weights_scale", 2.5)
    b.flag("expert_weights_norm", True)
    b.u32("expert_gating_func", 2)  # sigmoid
    b.u32("attention.indexer.head_count", m.idx_heads)
    b.u32("attention.indexer.key_length", m.idx_len)
    b.u32("attention.indexer.top_k", m.top_k)
    b.u32s("attention.indexer.types", list(m.types))
    if m.mtp:
        b.u32("nextn_predict_layers", 1)
    embd(b, d, m.vocab, output=True)
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", d)
        b.norm(f"blk.{i}.attn_q_a_norm.weight", m.q_lora)
        b.norm(f"blk.{i}.attn_kv_a_norm.weight", m.kv_lora)
        b.t(f"blk.{i}.attn_q_a.weight", d, m.q_lora)
        b.t(f"blk.{i}.attn_q_b.weight", m.q_lora, m.n_head * (m.nope + m.n_rot))
        b.t(f"blk.{i}.attn_kv_a_mqa.weight", d, m.kv_lora + m.n_rot)
        b.t(f"blk.{i}.attn_k_b.weight", m.nope, m.kv_lora, m.n_head)
        b.t(f"blk.{i}.attn_v_b.weight", m.kv_lora, m.v_head, m.n_head)
        b.t(f"blk.{i}.attn_output.weight", m.n_head * m.v_head, d)
        b.norm(f"blk.{i}.ffn_norm.weight", d)
        if i >= m.n_layers or m.types[i]:
            b.norm(f"blk.{i}.indexer.k_norm.weight", m.idx_len)
            b.t(f"blk.{i}.indexer.k_norm.bias", m.idx_len, kind="small")
            b.t(f"blk.{i}.indexer.proj.weight", d, m.idx_heads)
            b.t(f"blk.{i}.indexer.attn_k.weight", d, m.idx_len)
            b.t(f"blk.{i}.indexer.attn_q_b.weight", m.q_lora, m.idx_heads * m.idx_len)
        if i < m.dense_lead:
            ffn(b, i, d, m.n_ff)
        else:
            b.t(f"blk.{i}.ffn_gate_inp.weight", d, m.n_expert)
            b.t(f"blk.{i}.exp_probs_b.bias", m.n_expert, kind="small")
            routed_experts(b, i, d, m.n_expert, m.n_ff_exp)
        if i >= m.n_layers:
            nextn(b, i, d)


# --- Qwen3.5 (qwen35, qwen35moe) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Qwen35Dims:
    """The Qwen3.5 hybrid's sizes: gated delta-net layers, full attention every `interval`-th layer."""

    d: int
    n_layers: int
    vocab: int
    moe: bool
    ctx: int = 4096
    head: int = 16
    n_head: int = 4
    n_kv: int = 2
    n_ff: int = 128
    interval: int = 4
    n_rot: int = 8
    sections: tuple[int, ...] = (2, 1, 1, 0)  # sums to n_rot / 2
    # delta-net: k and v heads both of size state_size; v heads a multiple of k heads (groups);
    # inner_size = state_size x time_step_rank
    d_state: int = 16
    n_group: int = 2
    dt_rank: int = 4
    d_conv: int = 4
    n_expert: int = 4
    n_used: int = 2
    n_ff_exp: int = 32
    mtp: bool = False


def qwen35(b: Builder, m: Qwen35Dims) -> None:
    """Qwen3.5 hybrid: gated delta-net layers, full attention every `full_attention_interval`-th."""
    n_all = m.n_layers + (1 if m.mtp else 0)
    d, head = m.d, m.head
    common(b, d, n_all, m.n_head, m.n_kv, m.n_ff, ctx=m.ctx, eps=1e-6, rope_base=10_000_000.0)
    b.u32("attention.key_length", head)
    b.u32("attention.value_length", head)
    b.u32("rope.dimension_count", m.n_rot)
    b.i32s("rope.dimension_sections", list(m.sections))
    b.u32("ssm.conv_kernel", m.d_conv)
    b.u32("ssm.state_size", m.d_state)
    b.u32("ssm.group_count", m.n_group)
    b.u32("ssm.time_step_rank", m.dt_rank)
    b.u32("ssm.inner_size", m.d_state * m.dt_rank)
    b.u32("full_attention_interval", m.interval)
    if m.mtp:
        b.u32("nextn_predict_layers", 1)
    if m.moe:
        b.u32("expert_count", m.n_expert)
        b.u32("expert_used_count", m.n_used)
        b.u32("expert_feed_forward_length", m.n_ff_exp)
        b.u32("expert_shared_feed_forward_length", m.n_ff_exp)
    embd(b, d, m.vocab, output=True)
    key_dim, value_dim = m.d_state * m.n_group, m.d_state * m.dt_rank
    for i in range(n_all):
        b.norm(f"blk.{i}.attn_norm.weight", d)
        b.norm(f"blk.{i}.post_attention_norm.weight", d)
        if i >= m.n_layers or (i + 1) % m.interval == 0:
            # q is [q | gate] per head: twice as wide; the gate is a sigmoid on the attention output
            qkv(b, i, d, 2 * m.n_head * head, m.n_kv * head, m.n_head * head)
            b.norm(f"blk.{i}.attn_q_norm.weight", head)
            b.norm(f"blk.{i}.attn_k_norm.weight", head)
        else:
            b.t(f"blk.{i}.attn_qkv.weight", d, 2 * key_dim + value_dim)
            b.t(f"blk.{i}.attn_gate.weight", d, value_dim)
            b.t(f"blk.{i}.ssm_conv1d.weight", m.d_conv, 2 * key_dim + value_dim)
            b.t(f"blk.{i}.ssm_dt.bias", m.dt_rank, kind="small")
            b.t(f"blk.{i}.ssm_a", m.dt_rank, kind="neg")
            b.t(f"blk.{i}.ssm_beta.weight", d, m.dt_rank)
            b.t(f"blk.{i}.ssm_alpha.weight", d, m.dt_rank)
            b.norm(f"blk.{i}.ssm_norm.weight", m.d_state)
            b.t(f"blk.{i}.ssm_out.weight", value_dim, d)
        if m.moe:
            experts(b, i, d, m.n_expert, m.n_ff_exp, m.n_ff_exp)
            b.t(f"blk.{i}.ffn_gate_inp_shexp.weight", d)
        else:
            ffn(b, i, d, m.n_ff)
        if i >= m.n_layers:
            nextn(b, i, d)
