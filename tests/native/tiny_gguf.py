"""Tiny synthetic llama-family GGUFs written with the gguf package (for fast native tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from agent.artifacts import layouts

D, N_HEAD, N_KV, FF, VOCAB = 64, 4, 2, 128, 96


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    n_layers: int = 3,
    corrupt: str | None = None,
    tied: bool = True,
    heads: tuple[int, int, int] = (D, N_HEAD, N_KV),
    context: int = 256,
) -> Path:
    """A random-weight model of `arch`; `corrupt` names a tensor whose first value becomes NaN;
    `heads` is (d_model, n_head, n_head_kv)."""
    rng = np.random.default_rng(0)
    d, n_head, n_kv = heads
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(d)
    w.add_feed_forward_length(FF)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    hd = d // n_head

    def t(name: str, *shape: int, scale: float = 0.1) -> None:
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == corrupt:
            a.reshape(-1)[0] = np.nan
        w.add_tensor(name, a)

    t("token_embd.weight", VOCAB, d, scale=1.0)
    for i in range(n_layers):
        norm = np.ones(d, dtype=np.float32)
        if f"blk.{i}.attn_norm.weight" == corrupt:
            norm[0] = np.nan
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        t(f"blk.{i}.attn_q.weight", n_head * hd, d)
        t(f"blk.{i}.attn_k.weight", n_kv * hd, d)
        t(f"blk.{i}.attn_v.weight", n_kv * hd, d)
        if arch == "qwen2":
            t(f"blk.{i}.attn_q.bias", n_head * hd)
            t(f"blk.{i}.attn_k.bias", n_kv * hd)
            t(f"blk.{i}.attn_v.bias", n_kv * hd)
        t(f"blk.{i}.attn_output.weight", d, n_head * hd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", FF, d)
        t(f"blk.{i}.ffn_up.weight", FF, d)
        t(f"blk.{i}.ffn_down.weight", d, FF)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    if not tied:
        t("output.weight", VOCAB, d)
    layouts.write_file(w)
    return path


def write_small_tokenizer(path: Path, n_tokens: int = 256) -> Path:
    """A GGUF holding only an `n_tokens`-token tokenizer, for agent.artifacts.tiny.write_tiny_gguf's
    tokenizer_from where no tokenizer or llama.cpp reads the file: write_tiny_gguf then copies n_tokens
    strings (tiny.tokenizer_fields reads its source with gguf-py's reader, ~2.4 s for SmolLM2's 49,152
    tokens and merges, once per process and source) and the file is a few KB."""
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(n_tokens)])
    w.add_token_types([1] * n_tokens)
    layouts.write_file(w)
    return path
