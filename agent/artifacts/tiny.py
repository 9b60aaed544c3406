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
from pathlib import Path
from typing import Any

import numpy as np

from agent.artifacts import archtable, layouts, layouts_moe
from agent.artifacts.layouts import DEEPSEEK4_FLASH_ROPE_SCALING as DEEPSEEK4_FLASH_ROPE_SCALING
from agent.artifacts.layouts import Builder, Tensor
from agent.artifacts.layouts_moe import DEEPSEEK_V3_ROPE_SCALING

ARCHITECTURES = tuple(a.name for a in archtable.ARCHITECTURES)
DTYPES = ("f32", "f16", "q8_0")
D_MODEL = 64
# gemma3: five sliding-window layers, then a global one; qwen35: full attention at layers 3 and 7;
# glm4moe and deepseek2: layer 0 dense, then experts; gpt-oss: sliding-window layers 0 and 2 (archtable.py)
DEFAULT_LAYERS = {a.name: a.tiny_layers for a in archtable.ARCHITECTURES}
_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7}
# Only matmul weights take the file's dtype; these stay f32 (the graphs read them as f32).
_KEEP_F32 = ("ssm_conv1d", "hc_", "_ape")  # 1-D tensors (norms, biases, ssm_a, sinks) stay f32 anyway


class TinyModelError(ValueError):
    """The requested tiny model cannot be built; the message says why."""


def _common(b: Builder, n_layers: int, n_head: int, n_kv: int, n_ff: int, rope_base: float = 10000.0) -> None:
    layouts.common(b, D_MODEL, n_layers, n_head, n_kv, n_ff, ctx=4096, eps=1e-6, rope_base=rope_base)


def _embd(b: Builder, vocab: int, *, output: bool) -> None:
    # unit-variance rows ("head" values): logits spread ~8 wide, so the top token wins by a margin that
    # f32 rounding differences between executors cannot flip (with 1/sqrt(d) rows 49k logits are nearly tied)
    layouts.embd(b, D_MODEL, vocab, output=output)


def _qkv(b: Builder, i: int, n_q: int, n_kv: int, n_out: int) -> None:
    layouts.qkv(b, i, D_MODEL, n_q, n_kv, n_out)


def _ffn(b: Builder, i: int, n_ff: int) -> None:
    layouts.ffn(b, i, D_MODEL, n_ff)


def _llama(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
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


def _qwen3(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
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


def _gemma3(b: Builder, n_layers: int, vocab: int, mtp: bool, head: int = 16) -> None:
    n_head, n_kv, n_ff = 4, 1, 128
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


def _qwen35(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    layouts.qwen35(b, layouts.Qwen35Dims(D_MODEL, n_layers, vocab, moe=False, mtp=mtp))


def _qwen35moe(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    layouts.qwen35(b, layouts.Qwen35Dims(D_MODEL, n_layers, vocab, moe=True, mtp=mtp))


def _wide_heads(arch: str, b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    """Heads as quantized caches need them (whole q8_0 blocks, a multiple of 64 that llama.cpp's Hadamard
    rotation takes), in the real files' proportions: Qwen3.5 rotates a quarter of its head (64 of 256),
    GLM-5's latent row (512 + 64 = 576) rotates in blocks of 64, as 160 + 32 = 192 does; gemma3's heads
    are Gemma 3 270M's 256 (4 query heads, 1 kv head)."""
    if arch == "gemma3":
        _gemma3(b, n_layers, vocab, mtp, head=256)
    elif arch in ("qwen35", "qwen35moe"):
        dims = layouts.Qwen35Dims(
            D_MODEL,
            n_layers,
            vocab,
            moe=arch == "qwen35moe",
            mtp=mtp,
            head=64,
            n_rot=16,
            sections=(3, 3, 2, 0),
        )
        layouts.qwen35(b, dims)
    else:
        types = tuple(glm_dsa_indexer_types(n_layers))
        layouts.glm_dsa(b, layouts.GlmDims(D_MODEL, n_layers, vocab, types, mtp=mtp, kv_lora=160, n_rot=32))


# the others' tiny heads are 64 wide already
_WIDE_HEADS_ARCHS = tuple(a.name for a in archtable.ARCHITECTURES if a.wide_heads)


def deepseek4_compress_ratios(n_layers: int) -> list[int]:
    """Per-layer compression ratios of the tiny deepseek4: 0 (raw window only), 4 and 128 in turn."""
    return [(0, 4, 128)[i % 3] for i in range(n_layers)]


def _deepseek4(
    b: Builder, n_layers: int, vocab: int, mtp: bool, hash_layers: int = 1, idx_len: int = 64
) -> None:
    ratios = tuple(deepseek4_compress_ratios(n_layers))
    dims = layouts.Dsv4Dims(
        D_MODEL, n_layers, vocab, ratios, hash_layers=hash_layers, mtp=mtp, idx_len=idx_len
    )
    layouts.deepseek4(b, dims)


def glm_dsa_indexer_types(n_layers: int) -> list[int]:
    """1 = full indexer, 0 = shares the previous full layer's top-k; the first layer must be full."""
    return [1 if i % 3 == 0 else 0 for i in range(n_layers)]


def _glm_dsa(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    types = tuple(glm_dsa_indexer_types(n_layers))
    layouts.glm_dsa(b, layouts.GlmDims(D_MODEL, n_layers, vocab, types, mtp=mtp))


def _qwen3moe(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    # Qwen3-235B-A22B's proportions: 4 query heads per KV head, softmax over 8 experts (of 128), 2 used
    layouts_moe.qwen3moe(b, layouts_moe.MoeDims(D_MODEL, n_layers, vocab))


def _glm4moe(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    # GLM-4.5's: RoPE on half of each head, eps 1e-5, rope base 1e6, one expert group (no group limit);
    # its files always carry the MTP block
    dims = layouts_moe.MoeDims(
        D_MODEL, n_layers, vocab, ctx=131072, eps=1e-5, n_rot=32, groups=1, group_used=1
    )
    layouts_moe.glm4moe(b, dims)


def _deepseek2(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    # DeepSeek-V3's: a latent row of kv_lora + rope (64 + 32 here, 512 + 64 there: whole q8_0 blocks of
    # both, as llama.cpp requires of K and V), experts in 4 groups of which the best 2 compete (8 groups,
    # 4 there), YaRN factor 40 over a 4K original context
    dims = layouts_moe.MoeDims(
        D_MODEL, n_layers, vocab, ctx=163840, rope_base=10000.0, n_head=4, n_kv=1, n_rot=32, groups=4,
        group_used=2, kv_lora=64, mtp=mtp,
    )  # fmt: skip
    layouts_moe.deepseek2(b, dims)
    b.rope_scaling(DEEPSEEK_V3_ROPE_SCALING)


def _gpt_oss(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    # gpt-oss-120b's key set: 2 query heads per KV head (8 there), 4 of 8 experts used (4 of 128 there),
    # window 128, YaRN factor 32 over 4K, rope base 150,000; experts in MXFP4 as the real files keep them
    layouts_moe.gpt_oss(b, layouts_moe.GptOssDims(D_MODEL, n_layers, vocab))


def _minimax_m2(b: Builder, n_layers: int, vocab: int, mtp: bool) -> None:
    # MiniMax-M2's key set: 6 query heads per KV head, RoPE on half of each head (64 of 128 there), q/k
    # norms across all heads, sigmoid routing with a selection bias over 16 experts, 4 used (8 of 256
    # there), rope base 5e6; no MTP blocks, as its converted files have none
    layouts_moe.minimax_m2(b, layouts_moe.MinimaxM2Dims(D_MODEL, n_layers, vocab))


_BUILDERS: dict[str, Callable[[Builder, int, int, bool], None]] = {
    "llama": _llama,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "qwen35": _qwen35,
    "qwen35moe": _qwen35moe,
    "deepseek4": _deepseek4,
    "glm-dsa": _glm_dsa,
    "qwen3moe": _qwen3moe,
    "glm4moe": _glm4moe,
    "deepseek2": _deepseek2,
    "gpt-oss": _gpt_oss,
    "minimax-m2": _minimax_m2,
}
# glm4moe is not listed: its files always end with the MTP block, `mtp` or not
_MTP_ARCHS = ("qwen35", "qwen35moe", "deepseek4", "glm-dsa", "deepseek2")


def tensor_values(t: Tensor, rng: np.random.Generator) -> np.ndarray[Any, Any]:
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

    if kind == "mxfp4":  # gpt-oss's experts, as its files store them (blocks of 32 along ne0)
        return quantize(values, GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4
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
def tokenizer_fields(source: Path) -> tuple[tuple[str, Any, Any, Any], ...]:
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
    wide_heads: bool = False,
    indexer_key_length: int | None = None,
) -> Path:
    """Write a tiny random-weight GGUF of `arch` to `path`; the same arguments give the same bytes.

    `mtp` adds one multi-token-prediction block after the trunk (`nextn_predict_layers` = 1), for the
    architectures that have one (glm4moe always has it, as every GLM-4.5/4.6/4.7 file does). The tokenizer is copied from SmolLM2's packaged GGUF unless
    `tokenizer_from` names another file. `hash_layers` (deepseek4 only, default 1): how many leading
    layers route their experts by token id. `rope_scaling` replaces the file's rope.scaling.* keys
    (deepseek4 carries DeepSeek-V4-Flash's YaRN keys by default, deepseek2 DeepSeek-V3's; `{}` writes
    none), e.g.
    `{"type": "yarn", "factor": 4, "original_context_length": 32768}` as Qwen3's long-context files.
    `swiglu_clamp` (deepseek4): the experts' SwiGLU limit, one number or a list written as given
    (default 10.0 per layer, as an array like llama.cpp's converter writes it). `wide_heads` (qwen35,
    qwen35moe, glm-dsa, gemma3): attention heads wide enough for q8_0 / q4_0 caches (see _wide_heads).
    `indexer_key_length` (deepseek4, a multiple of 64; default 64, the head size): 128 keeps the heads
    unlike the indexer's keys, as in the real files (llama.cpp then rotates no cache but the indexer's;
    its MTP context cannot be created for a file whose heads are as wide as the indexer's keys).
    """
    from gguf import GGUFWriter

    if arch not in _BUILDERS:
        raise TinyModelError(
            f"no tiny generator for architecture {arch!r}; known: {', '.join(ARCHITECTURES)}"
        )
    if dtype not in DTYPES:
        raise TinyModelError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if mtp and arch not in _MTP_ARCHS and arch != "glm4moe":
        raise TinyModelError(
            f"{arch} has no multi-token-prediction block (those that do: {', '.join(_MTP_ARCHS)})"
        )
    layers = DEFAULT_LAYERS[arch] if n_layers is None else n_layers
    if not 1 <= layers <= 64:
        raise TinyModelError(f"n_layers must be in 1..64, got {layers}")
    if tokenizer_from is None:
        from agent.artifacts.packaged import packaged_model_path

        tokenizer_from = packaged_model_path("smollm2")
    tok = tokenizer_fields(Path(tokenizer_from).resolve())
    vocab = len(next(v for k, v, *_ in tok if k == "tokenizer.ggml.tokens"))

    b = Builder(arch)
    if indexer_key_length is not None and (arch != "deepseek4" or indexer_key_length % 64):
        raise TinyModelError("indexer_key_length applies to deepseek4 only, a multiple of 64")
    if hash_layers is not None or indexer_key_length is not None:
        if arch != "deepseek4" or not 0 <= (1 if hash_layers is None else hash_layers) <= layers:
            raise TinyModelError(f"hash_layers applies to deepseek4 only, 0..{layers}")
        _deepseek4(
            b,
            layers,
            vocab,
            mtp,
            1 if hash_layers is None else hash_layers,
            indexer_key_length or 64,
        )
    elif wide_heads:
        if arch not in _WIDE_HEADS_ARCHS:
            raise TinyModelError(f"wide_heads applies to {', '.join(_WIDE_HEADS_ARCHS)} only")
        _wide_heads(arch, b, layers, vocab, mtp)
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
    layouts.write_kv(w, b)
    for key, value, vtype, sub in tok:
        w.add_key_value(key, value, vtype, sub)
    rng = np.random.default_rng(seed)
    for t in b.tensors:
        arr, raw = _encode(t.name, t.kind, tensor_values(t, rng), dtype)
        w.add_tensor(t.name, arr, raw_dtype=raw)
    layouts.write_file(w)
    return out


def write_suite_gguf(arch: str, directory: str | os.PathLike[str], **overrides: Any) -> Path:
    """`arch`'s suite file: the tiny file the conformance suite (tests/native/archcases.py) and
    bench/archs.py run, at its row's suite layer count and options (`overrides` on top), as
    `directory`/<arch>.gguf."""
    a = archtable.BY_NAME[arch]
    options: dict[str, Any] = {"n_layers": archtable.suite_layers(a), **a.suite.tiny_options, **overrides}
    return write_tiny_gguf(arch, Path(directory) / f"{arch}.gguf", **options)


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
