"""Tiny random-weight GGUFs of each target architecture load and run in llama.cpp (the oracle)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.artifacts.tiny import ARCHITECTURES, TinyModelError, write_tiny_gguf

REPO = Path(__file__).resolve().parents[2]
# Long enough that deepseek4's ratio-128 compressor emits a row and every sliding window and sparse
# top-k (window 16/32, top-k 8) is exceeded.
N_TOKENS = 160


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tokenizer comes from SmolLM2: {e}")
    return tmp_path_factory.mktemp("tiny")


def _logits(path: Path, n_tokens: int = N_TOKENS) -> np.ndarray:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, logits_all=True, verbose=False)
    try:
        ids = [int(x) for x in np.random.default_rng(7).integers(2, llm.n_vocab(), n_tokens)]
        llm.eval(ids)
        return np.array(llm.scores[:n_tokens], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_llama_cpp_loads_the_tiny_model_and_its_logits_are_finite(arch: str, tiny_dir: Path) -> None:
    path = write_tiny_gguf(arch, tiny_dir / f"{arch}.gguf")
    logits = _logits(path)
    assert logits.shape == (N_TOKENS, 49152)
    assert np.isfinite(logits).all()
    # random weights still give position-dependent, non-degenerate distributions
    assert logits.std() > 0.1
    assert len({int(a) for a in logits.argmax(axis=1)}) > 10


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(tiny_dir: Path) -> None:
    def digest(name: str, seed: int) -> str:
        p = write_tiny_gguf("qwen35moe", tiny_dir / name, seed=seed)
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest("a.gguf", 3) == digest("b.gguf", 3)
    assert digest("c.gguf", 4) != digest("a.gguf", 3)


@pytest.mark.parametrize(("arch", "dtype"), [("llama", "f16"), ("qwen35moe", "q8_0"), ("glm-dsa", "f16")])
def test_f16_and_q8_0_files_load_and_track_the_f32_logits(arch: str, dtype: str, tiny_dir: Path) -> None:
    ref = _logits(write_tiny_gguf(arch, tiny_dir / f"{arch}-f32.gguf"), 32)
    got = _logits(write_tiny_gguf(arch, tiny_dir / f"{arch}-{dtype}.gguf", dtype=dtype), 32)
    assert np.isfinite(got).all()
    # not argmax agreement: quantization noise legitimately flips MoE routing now and then
    corr = np.corrcoef(got.ravel(), ref.ravel())[0, 1]
    assert corr > 0.9, corr


def test_an_mtp_block_is_loaded_but_not_run_in_the_main_pass(tiny_dir: Path) -> None:
    trunk = write_tiny_gguf("qwen35moe", tiny_dir / "trunk.gguf")
    with_mtp = write_tiny_gguf("qwen35moe", tiny_dir / "mtp.gguf", mtp=True)
    m = build_manifest(with_mtp, hash_tensors=False)
    assert (m.n_layers, m.mtp_layers, m.hparams["block_count"]) == (8, 1, 9)
    np.testing.assert_array_equal(_logits(with_mtp, 24), _logits(trunk, 24))


def test_the_qwen35moe_metadata_keeps_the_loader_invariants(tiny_dir: Path) -> None:
    hp = build_manifest(write_tiny_gguf("qwen35moe", tiny_dir / "q.gguf"), hash_tensors=False).hparams
    assert hp["ssm.inner_size"] == hp["ssm.state_size"] * hp["ssm.time_step_rank"]
    assert hp["ssm.time_step_rank"] % hp["ssm.group_count"] == 0
    assert hp["attention.key_length"] == hp["attention.value_length"]
    assert sum(hp["rope.dimension_sections"]) * 2 == hp["rope.dimension_count"]


def test_bad_requests_are_refused_with_the_reason(tiny_dir: Path) -> None:
    with pytest.raises(TinyModelError, match="known: llama"):
        write_tiny_gguf("falcon", tiny_dir / "x.gguf")
    with pytest.raises(TinyModelError, match="multi-token-prediction"):
        write_tiny_gguf("llama", tiny_dir / "x.gguf", mtp=True)
    with pytest.raises(TinyModelError, match="dtype"):
        write_tiny_gguf("llama", tiny_dir / "x.gguf", dtype="q4_0")


def test_the_agent_cli_writes_a_tiny_model_that_inspect_reads(tiny_dir: Path) -> None:
    out = tiny_dir / "cli.gguf"
    run = [sys.executable, "-m", "agent"]
    subprocess.run(
        [*run, "tiny", "--arch", "gemma3", "--out", str(out)], cwd=REPO, check=True, capture_output=True
    )
    shown = subprocess.run([*run, "inspect", str(out)], cwd=REPO, check=True, capture_output=True, text=True)
    assert "arch=gemma3" in shown.stdout
    assert any(line.split() == ["servable", "yes"] for line in shown.stdout.splitlines()), shown.stdout
