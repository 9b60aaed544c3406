"""Tiny synthetic llama-family GGUFs written with the gguf package (for fast native tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

D, N_HEAD, N_KV, FF, VOCAB = 64, 4, 2, 128, 96


def write_tiny_gguf(
    path: Path, arch: str = "llama", n_layers: int = 3, corrupt: str | None = None, tied: bool = True
) -> Path:
    """A random-weight model of `arch`; `corrupt` names a tensor whose first value becomes NaN."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    hd = D // N_HEAD

    def t(name: str, *shape: int, scale: float = 0.1) -> None:
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == corrupt:
            a.reshape(-1)[0] = np.nan
        w.add_tensor(name, a)

    t("token_embd.weight", VOCAB, D, scale=1.0)
    for i in range(n_layers):
        norm = np.ones(D, dtype=np.float32)
        if f"blk.{i}.attn_norm.weight" == corrupt:
            norm[0] = np.nan
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        t(f"blk.{i}.attn_q.weight", N_HEAD * hd, D)
        t(f"blk.{i}.attn_k.weight", N_KV * hd, D)
        t(f"blk.{i}.attn_v.weight", N_KV * hd, D)
        if arch == "qwen2":
            t(f"blk.{i}.attn_q.bias", N_HEAD * hd)
            t(f"blk.{i}.attn_k.bias", N_KV * hd)
            t(f"blk.{i}.attn_v.bias", N_KV * hd)
        t(f"blk.{i}.attn_output.weight", D, N_HEAD * hd)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(D, dtype=np.float32))
        t(f"blk.{i}.ffn_gate.weight", FF, D)
        t(f"blk.{i}.ffn_up.weight", FF, D)
        t(f"blk.{i}.ffn_down.weight", D, FF)
    w.add_tensor("output_norm.weight", np.ones(D, dtype=np.float32))
    if not tied:
        t("output.weight", VOCAB, D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
