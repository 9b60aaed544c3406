"""libggswarm's CPU decode-attention kernels against ggml's own ops (native/src/attention.cpp)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.backends.libggswarm import NativeModel
from tests.native.tiny_gguf import VOCAB, write_tiny_gguf

# ggswarm_model_info.decode_kernels: the kernels run, or ggml's ops run because the open-time
# self-check found the kernels' bits differ
KERNELS_ON, KERNELS_FAILED_CHECK, KERNELS_FLASH = 1, -1, -2
# no kernels on this CPU or for this head: ggml's ops, or flash attention where the CPU lacks AVX-512
NO_KERNELS = (0, KERNELS_FLASH)

# (d_model, n_head, n_head_kv): head_dim 64 with 5 query heads per KV head (a block of four and one),
# 2, and 1 (no GQA); then head_dim 128 and 256 (real llama/qwen/gemma sizes), with GQA
SHAPES = [(320, 5, 1), (256, 4, 2), (128, 2, 2), (512, 4, 2), (512, 2, 1)]


def shape_id(heads: tuple[int, int, int]) -> str:
    return f"hd{heads[0] // heads[1]}-{heads[1]}q-{heads[2]}kv"


def decode_logits(
    path: Path, threads: int, truncate_at: int | None = None, flash: bool = False
) -> tuple[int, np.ndarray]:
    """(decode_kernels, logits) of 12 single-token steps after a 250-token prefill (the attended span
    crosses 256 positions); with truncate_at, first run to 300 tokens and cut the cache back, so stale
    K/V lies past the end; with flash, in flash-attention mode (as --flash-attn on)."""
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(0, VOCAB, 320)]
    with NativeModel(path, 0, 3, n_threads=threads) as m:
        if flash:
            m.set_flash_attention(True)
        sid = m.open_session(1024)
        if truncate_at is not None:
            m.forward(sid, 0, token_ids=ids[:300])
            m.truncate(sid, truncate_at)
            m.forward(sid, truncate_at, token_ids=ids[truncate_at:250])
        else:
            m.forward(sid, 0, token_ids=ids[:250])
        rows = [
            m.forward(sid, 250 + i, token_ids=[ids[250 + i]], want_logits=True)["logits"] for i in range(12)
        ]
        return int(m.info.decode_kernels), np.concatenate(rows)


@pytest.mark.parametrize("heads", SHAPES, ids=shape_id)
def test_decode_kernels_give_the_same_logits_as_ggml_ops(
    native_lib: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int, int]
) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=heads, context=1024)
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    state, ref = decode_logits(path, threads=2)
    assert state == 0
    monkeypatch.delenv("GGSWARM_GGML_ATTENTION")
    state, got = decode_logits(path, threads=2)
    if state in NO_KERNELS:
        pytest.skip("decode kernels need AVX-512 in this CPU and in the ggml build")
    # the open-time self-check passed for this head shape
    assert state == KERNELS_ON
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"
    # the thread split changes which thread computes what, never how
    for threads in (1, 3):
        assert np.array_equal(decode_logits(path, threads)[1], ref)


def test_decode_kernels_ignore_stale_cache_rows_after_a_truncate(
    native_lib: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=SHAPES[0], context=1024)
    state, fresh = decode_logits(path, threads=2)
    if state in NO_KERNELS:
        pytest.skip("decode kernels need AVX-512 in this CPU and in the ggml build")
    _, after_truncate = decode_logits(path, threads=2, truncate_at=200)
    assert np.array_equal(after_truncate, fresh)
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    assert np.array_equal(decode_logits(path, threads=2, truncate_at=200)[1], fresh)


def test_heads_not_a_multiple_of_64_keep_ggml_ops(native_lib: None, tmp_path: Path) -> None:
    with NativeModel(write_tiny_gguf(tmp_path / "m.gguf"), 0, 3) as m:  # head_dim 16
        assert m.info.head_dim == 16
        assert not m.decode_kernels
        assert m.info.decode_kernels in NO_KERNELS
