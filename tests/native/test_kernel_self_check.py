"""The open-time self-check of the decode kernels against ggml's ops, and its fallback (attention.cpp)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.backends.libggswarm import NativeModel
from tests.native.test_attention import KERNELS_FAILED_CHECK, KERNELS_ON, NO_KERNELS, decode_logits
from tests.native.tiny_gguf import write_tiny_gguf

# (d_model, n_head, n_head_kv) with head_dim 64, 128 and 256
HEAD_SIZES = {64: (256, 4, 2), 128: (512, 4, 2), 256: (512, 2, 1)}


def kernels_apply(path: Path) -> bool:
    with NativeModel(path, 0, 3) as m:
        return m.info.decode_kernels not in NO_KERNELS


@pytest.mark.parametrize("head_dim", sorted(HEAD_SIZES))
def test_the_self_check_passes_for_head_sizes_64_128_and_256(
    native_lib: None, tmp_path: Path, capfd: pytest.CaptureFixture[str], head_dim: int
) -> None:
    with NativeModel(write_tiny_gguf(tmp_path / "m.gguf", heads=HEAD_SIZES[head_dim]), 0, 3) as m:
        assert m.info.head_dim == head_dim
        if m.info.decode_kernels in NO_KERNELS:
            pytest.skip("decode kernels need AVX-512 in this CPU and in the ggml build")
        assert m.info.decode_kernels == KERNELS_ON
        assert m.decode_kernels
    assert "self-check" not in capfd.readouterr().err


def test_a_forced_self_check_mismatch_switches_the_kernels_off_and_keeps_ggml_logits(
    native_lib: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=HEAD_SIZES[128], context=1024)
    if not kernels_apply(path):
        pytest.skip("decode kernels need AVX-512 in this CPU and in the ggml build")
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    _, ref = decode_logits(path, threads=2)
    monkeypatch.delenv("GGSWARM_GGML_ATTENTION")
    capfd.readouterr()

    monkeypatch.setenv("GGSWARM_KERNEL_SELFCHECK", "corrupt")
    with NativeModel(path, 0, 3) as m:
        assert m.info.decode_kernels == KERNELS_FAILED_CHECK
        assert not m.decode_kernels
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if "self-check" in line]
    assert len(lines) == 1, err
    assert "decode attention kernels off" in lines[0] and "GGSWARM_KERNEL_SELFCHECK=corrupt" in lines[0]

    # the handle runs ggml's ops, so its decode logits are ggml's, bit for bit
    state, got = decode_logits(path, threads=2)
    assert state == KERNELS_FAILED_CHECK
    assert np.array_equal(got, ref), f"max |diff| {np.abs(got - ref).max()}"


def test_the_self_check_hook_changes_nothing_where_the_kernels_do_not_apply(
    native_lib: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GGSWARM_KERNEL_SELFCHECK", "corrupt")
    with NativeModel(write_tiny_gguf(tmp_path / "small.gguf"), 0, 3) as m:  # head_dim 16
        assert m.info.decode_kernels in NO_KERNELS
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    with NativeModel(write_tiny_gguf(tmp_path / "m.gguf", heads=HEAD_SIZES[64]), 0, 3) as m:
        assert m.info.decode_kernels == 0
    assert "self-check" not in capfd.readouterr().err
