"""Per-architecture structure of a GGUF: what state each layer keeps, what crosses a seam, what may not be split.

The manifest calls `describe` once per file; everything is derived from the architecture's metadata
(the same keys llama.cpp's loader reads), so an old manifest can be re-described from its hparams.
`SERVABLE_ARCHITECTURES` is the one list of what this agent's executor runs; inspect, placement and
the control plane refuse the rest with `servable_problem`'s message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.artifacts import archtable
from agent.wire.frames import CONTEXT_CAP

# What the native executor runs today: the rows of agent/artifacts/archtable.py and their aliases. Add a
# row (with the C architecture, native/src/archs/) when its layer windows are proved against llama.cpp
# (tests/native/test_archs.py runs every row).
SERVABLE_ARCHITECTURES: frozenset[str] = frozenset(
    name for a in archtable.ARCHITECTURES for name in (a.name, *a.aliases)
)

STATE_KINDS = ("kv", "recurrent", "latent_kv", "compressed_kv")
# Bytes per cached element in each attention-cache type a node may run (defaults.CACHE_TYPES): ggml's
# q8_0 keeps 32 values in 34 bytes, q4_0 in 18.
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_DSV4_CSA, _DSV4_HCA = 4, 128


@dataclass(frozen=True)
class StatePart:
    """One piece of a layer's per-sequence state: a cache that grows with the context, or a fixed tensor."""

    name: str
    elements: int  # per cached row (a row per token, or per `ratio` tokens); per sequence when `fixed`
    fixed: bool = False
    window: int = 0  # rows cover at most this many recent tokens (0: the whole context)
    ratio: int = 1  # one row per `ratio` tokens (compressed caches)
    f32: bool = False  # kept in f32 whatever the KV cache type (recurrent and compressor states)

    def elements_at(self, n_ctx: int) -> int:
        if self.fixed:
            return self.elements
        tokens = min(n_ctx, self.window) if self.window else n_ctx
        return self.elements * -(-tokens // self.ratio)

    def bytes_at(self, n_ctx: int, kv_bytes: float = 2.0) -> int:
        """Bytes at a context of `n_ctx` tokens with a KV cache of `kv_bytes` per element (f16: 2)."""
        return int(self.elements_at(n_ctx) * (4 if self.f32 else kv_bytes))


@dataclass(frozen=True)
class LayerDescription:
    """What `describe` says about one trunk layer."""

    state_kind: str
    state: list[StatePart] = field(default_factory=list)
    needs_token_ids: bool = False  # the layer reads the token ids (deepseek4's hash-routed MoE)


@dataclass(frozen=True)
class ArchDescription:
    """The architecture-level answer: layers, seam width, groups a boundary may not split."""

    n_layers: int  # trunk layers (block_count less the multi-token-prediction blocks)
    mtp_layers: int
    boundary_dim: int
    layers: list[LayerDescription]
    groups: list[tuple[int, int]]  # unsplittable [start, end) layer ranges
    leading_dense_layers: int


def _int(hp: dict[str, Any], key: str, default: int = 0) -> int:
    v = hp.get(key, default)
    if isinstance(v, list):
        return int(v[0]) if v else default
    return int(v)


def _per_layer(hp: dict[str, Any], key: str, i: int, default: int) -> int:
    """A key llama.cpp reads with get_key_or_arr: one value for every layer, or one per layer."""
    v = hp.get(key, default)
    if isinstance(v, list):
        return int(v[i]) if i < len(v) else default
    return int(v)


def _kv_parts(hp: dict[str, Any], i: int, d_model: int) -> list[StatePart]:
    n_head = max(_per_layer(hp, "attention.head_count", i, 1), 1)
    n_kv = _per_layer(hp, "attention.head_count_kv", i, n_head)
    k_len = _int(hp, "attention.key_length", d_model // n_head)
    v_len = _int(hp, "attention.value_length", d_model // n_head)
    return [StatePart("k", n_kv * k_len), StatePart("v", n_kv * v_len)]


def _delta_net(hp: dict[str, Any], n_layers: int, d_model: int) -> list[LayerDescription]:
    recurrent = hp.get("attention.recurrent_layers")
    if isinstance(recurrent, list):
        is_recr = [bool(recurrent[i]) if i < len(recurrent) else False for i in range(n_layers)]
    else:
        interval = _int(hp, "full_attention_interval", 4)
        is_recr = [(i + 1) % interval != 0 for i in range(n_layers)]
    d_conv = _int(hp, "ssm.conv_kernel")
    d_state = _int(hp, "ssm.state_size")
    d_inner = _int(hp, "ssm.inner_size")
    n_group = _int(hp, "ssm.group_count")
    conv = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    out = []
    for i in range(n_layers):
        if is_recr[i]:
            parts = [
                StatePart("conv", conv, fixed=True, f32=True),
                StatePart("ssm", d_state * d_inner, fixed=True, f32=True),
            ]
            out.append(LayerDescription("recurrent", parts))
        else:
            out.append(LayerDescription("kv", _kv_parts(hp, i, d_model)))
    return out


def glm_indexer_full(hp: dict[str, Any], n_layers: int) -> list[bool]:
    """Which glm-dsa layers run their own indexer (the rest reuse the previous full layer's top-k)."""
    types = hp.get("attention.indexer.types")
    if isinstance(types, list):
        return [bool(types[i]) if i < len(types) else False for i in range(n_layers)]
    if _int(hp, "context_length") < 1048576:  # GLM 5 / 5.1: every layer has a full indexer
        return [True] * n_layers
    # GLM-5.2's layout when the file does not say: two full layers, then one full layer in four.
    return [i < 2 or (i < 78 and (i - 2) % 4 == 0) for i in range(n_layers)]


def _mla(
    arch: str, hp: dict[str, Any], n_layers: int
) -> tuple[list[LayerDescription], list[tuple[int, int]]]:
    latent = StatePart("latent", _int(hp, "attention.kv_lora_rank"))
    rope = StatePart("rope", _int(hp, "rope.dimension_count"))
    if archtable.family(arch) != archtable.MLA_INDEXED:
        return [LayerDescription("latent_kv", [latent, rope]) for _ in range(n_layers)], []
    full = glm_indexer_full(hp, n_layers)
    idx_k = StatePart("indexer_k", _int(hp, "attention.indexer.key_length"))
    layers = [LayerDescription("latent_kv", [latent, rope, idx_k] if f else [latent, rope]) for f in full]
    # A shared-indexer layer needs the top-k indices its group's full layer computed: keep the group whole.
    groups: list[tuple[int, int]] = []
    starts = [i for i in range(n_layers) if full[i]] + [n_layers]
    for s, e in zip(starts, starts[1:], strict=False):
        if e - s > 1:
            groups.append((s, e))
    return layers, groups


# llama.cpp's micro-batch (n_ubatch) and the executor's (native/src/model.h kUBatch): the raw window's
# ring also holds one micro-batch's new rows
_UBATCH = 512


def _window_ring(hp: dict[str, Any]) -> int:
    """The slots of a sliding window's ring, as llama.cpp sizes its SWA cache and the executor its rings
    (native/src/kv.cpp swa_rows): GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256), n_ctx the file's capped."""
    n_ctx = min(_int(hp, "context_length", CONTEXT_CAP) or CONTEXT_CAP, CONTEXT_CAP)
    n = min(n_ctx, _int(hp, "attention.sliding_window") + _UBATCH)
    return max(256, -(-n // 256) * 256)


def _swa_windows(arch: str, hp: dict[str, Any], n_layers: int) -> list[int]:
    """Per layer, the ring a sliding-window layer keeps (GGML_PAD(min(n_ctx, n_swa + n_ubatch), 256)),
    or 0 (the whole context); the pattern as llama.cpp's loader reads it (an array of per-layer flags,
    else every `sliding_window_pattern`-th layer is global: default 6 for gemma3, 2 for gpt-oss)."""
    n_swa = _int(hp, "attention.sliding_window")
    row = archtable.facts(arch)
    if row is None or not row.swa_pattern or n_swa <= 0:
        return [0] * n_layers
    ring = _window_ring(hp)
    pattern = hp.get("attention.sliding_window_pattern", row.swa_pattern)
    if isinstance(pattern, list):
        swa = [bool(pattern[i]) if i < len(pattern) else False for i in range(n_layers)]
    else:
        every = int(pattern)
        swa = [every == 0 or i % every < every - 1 for i in range(n_layers)]
    return [ring if swa[i] else 0 for i in range(n_layers)]


def _deepseek4(hp: dict[str, Any], n_layers: int) -> list[LayerDescription]:
    # As native/src/archs/deepseek4_state.cpp keeps it (parts()), which is as llama.cpp keeps it
    # (llama-kv-cache-dsv4.cpp): the raw K (K = V) in a ring of GGML_PAD(min(n_ctx, n_swa + n_ubatch),
    # 256) slots; per block of `ratio` positions one compressed K entry (and an indexer K entry at
    # ratio 4); the compressor's and indexer's kv and score rows, f32, in rings of the last two blocks
    # (ratio 4, whose windows overlap) or of the block being filled (ratio 128). The K caches take the
    # node's cache type (f16 by default, as llama.cpp's); the compressor rows are f32 in both.
    head = _int(hp, "attention.key_length")
    idx_len = _int(hp, "attention.indexer.key_length")
    ratios = hp.get("attention.compress_ratios")
    hash_layers = _int(hp, "hash_layer_count")
    raw_rows = _window_ring(hp)
    out = []
    for i in range(n_layers):
        ratio = int(ratios[i]) if isinstance(ratios, list) and i < len(ratios) else 0
        parts = [StatePart("raw_k", raw_rows * head, fixed=True)]
        if ratio == _DSV4_CSA:
            rows = 2 * _DSV4_CSA
            parts += [
                StatePart("compressed_k", head, ratio=ratio),
                StatePart("indexer_k", idx_len, ratio=ratio),
                # the compressor's kv and score rows ([2 head] each) and the indexer's ([2 idx_len])
                StatePart("compressor", rows * 2 * 2 * head, fixed=True, f32=True),
                StatePart("indexer_compressor", rows * 2 * 2 * idx_len, fixed=True, f32=True),
            ]
        elif ratio == _DSV4_HCA:
            parts += [
                StatePart("compressed_k", head, ratio=ratio),
                StatePart("compressor", _DSV4_HCA * 2 * head, fixed=True, f32=True),
            ]
        out.append(
            LayerDescription("compressed_kv" if ratio else "kv", parts, needs_token_ids=i < hash_layers)
        )
    return out


def describe(
    arch: str, hp: dict[str, Any], block_count: int, d_model: int, tensor_names: Sequence[str]
) -> ArchDescription:
    """Layer kinds, seam width, groups and MTP blocks of a file, from its metadata and tensor names."""
    mtp = _int(hp, "nextn_predict_layers")
    kind = archtable.family(arch)
    if kind == archtable.DSV4 and mtp and f"blk.{block_count - mtp}.nextn.eh_proj.weight" not in tensor_names:
        mtp = 0  # llama.cpp treats the blocks as trunk layers when the MTP tensors are absent
    n_layers = block_count - mtp
    row = archtable.facts(arch)
    boundary_dim = d_model
    if row is not None and row.seam_streams_key:
        # hyper-connections: the residual travels as `count` streams of d_model between layers
        boundary_dim = d_model * _int(hp, row.seam_streams_key, row.seam_streams_default)
    groups: list[tuple[int, int]] = []
    if kind == archtable.DELTA_NET:
        layers = _delta_net(hp, n_layers, d_model)
    elif kind in (archtable.MLA, archtable.MLA_INDEXED):
        layers, groups = _mla(arch, hp, n_layers)
    elif kind == archtable.DSV4:
        layers = _deepseek4(hp, n_layers)
    else:
        # Sliding-window layers (gemma3, gpt-oss) keep a ring of their last positions, as llama.cpp's SWA cache
        # (native/src/kv.cpp swa_rows): counted at that window, the others at the whole context.
        windows = _swa_windows(arch, hp, n_layers)
        layers = [
            LayerDescription("kv", [replace(p, window=windows[i]) for p in _kv_parts(hp, i, d_model)])
            for i in range(n_layers)
        ]
    return ArchDescription(
        n_layers=n_layers,
        mtp_layers=mtp,
        boundary_dim=boundary_dim,
        layers=layers,
        groups=groups,
        leading_dense_layers=_int(hp, "leading_dense_block_count"),
    )


def servable_problem(arch: str) -> str:
    """Why this agent cannot serve `arch` layer by layer ("" when it can)."""
    if arch in SERVABLE_ARCHITECTURES:
        return ""
    return (
        f"not servable by this agent: architecture {arch!r} has no layer-window executor yet "
        f"(servable: {', '.join(sorted(SERVABLE_ARCHITECTURES))})"
    )
