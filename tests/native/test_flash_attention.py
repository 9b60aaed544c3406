"""Flash-attention mode (ggml_flash_attn_ext, V cache not transposed) against llama.cpp with flash
attention on, and its KV snapshots against the other modes' (docs/native.md, "Attention modes")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.backends.libggswarm import NativeModel
from tests.native.test_attention import decode_logits
from tests.native.tiny_gguf import VOCAB, write_tiny_gguf

FLASH = -2  # ggswarm_model_info.decode_kernels of a handle in flash-attention mode
REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "native_lighthouse.txt"
SPLITS = [(0, 10), (10, 20), (20, 30)]


@pytest.mark.parametrize(
    "heads", [(256, 4, 2), (512, 4, 2), (512, 2, 1), (64, 4, 2)], ids=lambda h: f"hd{h[0] // h[1]}"
)
def test_flash_mode_agrees_with_ggml_ops_on_every_head_size(
    native_lib: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, heads: tuple[int, int, int]
) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=heads, context=1024)
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    _, ref = decode_logits(path, threads=2)
    monkeypatch.delenv("GGSWARM_GGML_ATTENTION")
    state, got = decode_logits(path, threads=2, flash=True)
    assert state == FLASH
    # another summation order (online softmax over f16 rows), so other bits; these random 3-layer
    # models amplify that (logits up to ~100, measured differences up to 0.84, 0.9% of the scale),
    # while a wrong cache layout or mask would change the logits wholesale
    assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max()
    top2 = np.sort(ref, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1.0
    assert (got.argmax(1) == ref.argmax(1))[clear].all()


def test_flash_mode_ignores_stale_cache_rows_after_a_truncate(native_lib: None, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=(256, 4, 2), context=1024)
    ids = [int(t) for t in np.random.default_rng(1).integers(0, VOCAB, 320)]

    def step_after(*batches: tuple[int, int]) -> np.ndarray:
        """Logits of position 250 after prefilling these batches, cutting the cache back where one
        starts before its end."""
        with NativeModel(path, 0, 3, n_threads=2) as m:
            m.set_flash_attention(True)
            sid = m.open_session(1024)
            for a, b in batches:
                if m.session_len(sid) > a:
                    m.truncate(sid, a)
                m.forward(sid, a, token_ids=ids[a:b])
            return m.forward(sid, 250, token_ids=[ids[250]], want_logits=True)["logits"]

    # ggml's CPU flash attention tiles the query rows of a long batch, so a position's numbers
    # depend on how the prompt was batched (llama.cpp's too): compare equal batchings
    fresh = step_after((0, 200), (200, 250))
    assert np.array_equal(step_after((0, 200), (200, 300), (200, 250)), fresh)


def test_a_flash_mode_snapshot_restores_into_a_handle_of_another_mode(
    native_lib: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", heads=(256, 4, 2), context=1024)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, VOCAB, 300)]
    with NativeModel(path, 0, 3, n_threads=2) as m:
        m.set_flash_attention(True)
        sid = m.open_session(1024)
        m.forward(sid, 0, token_ids=ids[:290])  # grows the cache past 256 positions (V rows copied)
        snap = m.snapshot(sid)
        want = m.forward(sid, 290, token_ids=ids[290:], want_logits=True)["logits"]
        with NativeModel(path, 0, 3, n_threads=2) as again:
            again.set_flash_attention(True)
            sid2 = again.open_session(1024)
            again.restore(sid2, snap)
            assert np.array_equal(
                again.forward(sid2, 290, token_ids=ids[290:], want_logits=True)["logits"], want
            )
    # the payload keeps V transposed in every mode, so the bytes travel unchanged
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    with NativeModel(path, 0, 3, n_threads=2) as ops:
        assert ops.info.decode_kernels == 0
        sid = ops.open_session(1024)
        ops.restore(sid, snap)
        assert ops.snapshot(sid) == snap


# --- SmolLM2 against llama-cpp-python with flash_attn=True (slow) ---


@pytest.fixture(scope="module")
def llama_fa(model_path: str) -> Iterator[object]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        model_path=model_path, logits_all=True, n_ctx=1024, n_threads=2, flash_attn=True, verbose=False
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hops_fa(native_lib: None, model_path: str) -> Iterator[list[NativeModel]]:
    # the same thread count as llama.cpp's: from 512 attended positions ggml's CPU flash attention
    # splits a decode step's positions across the threads and merges their partial sums
    hops = [NativeModel(model_path, a, b, n_threads=2) for a, b in SPLITS]
    for h in hops:
        h.set_flash_attention(True)
    yield hops
    for h in hops:
        h.close()


def _forward(hops: list[NativeModel], sid: int, pos: int, ids: list[int], logits: bool = True) -> np.ndarray:
    out = hops[0].forward(sid, pos, token_ids=ids)
    for h in hops[1:]:
        out = h.forward(sid, pos, hidden=out["hidden"], want_logits=logits and h.is_last)
    return out["logits"] if logits else np.empty(0)


def _open(hops: list[NativeModel]) -> int:
    sids = {h.open_session(1024) for h in hops}
    assert len(sids) == 1  # fresh handles hand out the same ids
    return sids.pop()


@pytest.mark.slow
def test_flash_mode_reproduces_llama_cpp_with_flash_attention_on(
    hops_fa: list[NativeModel], llama_fa
) -> None:  # noqa: ANN001
    assert [h.info.decode_kernels for h in hops_fa] == [FLASH] * 3
    ids = llama_fa.tokenize(TEXT.read_bytes(), add_bos=False)
    # teacher forced: one 512-position micro-batch and the rest, like llama.cpp's n_ubatch
    llama_fa.reset()
    llama_fa.eval(ids)
    ref = np.asarray(llama_fa.scores[: len(ids)], dtype=np.float32)
    sid = _open(hops_fa)
    got = _forward(hops_fa, sid, 0, ids)
    for h in hops_fa:
        h.close_session(sid)
    print(f"\nflash mode, teacher forcing {len(ids)} tokens: max |logit diff| {np.abs(got - ref).max()}")
    assert np.array_equal(got, ref)
    # decode steps across the 256-position padding and into ggml's split-KV path (512 and more)
    for lo, hi in [(250, 258), (508, 516)]:
        llama_fa.reset()
        llama_fa.eval(ids[:lo])
        want = []
        for t in ids[lo:hi]:
            llama_fa.eval([t])
            want.append(np.asarray(llama_fa.scores[llama_fa.n_tokens - 1], dtype=np.float32))
        sid = _open(hops_fa)
        _forward(hops_fa, sid, 0, ids[:lo], logits=False)
        steps = [_forward(hops_fa, sid, lo + i, [t])[0] for i, t in enumerate(ids[lo:hi])]
        for h in hops_fa:
            h.close_session(sid)
        diff = np.abs(np.stack(steps) - np.stack(want)).max()
        print(f"flash mode, decode {lo}..{hi - 1}: max |logit diff| {diff}")
        assert diff == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_a_prompt_the_executor_cuts_at_a_checkpoint_still_equals_llama_cpp_with_flash_attention(
    native_lib: None, tmp_path: Path, arch: str
) -> None:
    """300 positions in one call: with periodic checkpoints every 256 positions (a node's setting, off
    by default) the executor ends a micro-batch at its recurrent checkpoint (256), and
    ggml's CPU flash kernel runs the 44 left tiled only if they are padded to its query tile (llama.cpp
    runs the whole call tiled; 44 alone would run its scalar path, 0.02-0.04 off from position 256 on)."""
    from agent.artifacts.manifest import build_manifest
    from agent.artifacts.tiny import write_tiny_gguf as write_arch_gguf
    from tests.native.routes import logits_rows, native_forward, native_hops, open_sessions

    llama_cpp = pytest.importorskip("llama_cpp")
    path = str(write_arch_gguf(arch, tmp_path / f"{arch}.gguf"))
    llm = llama_cpp.Llama(
        model_path=path, logits_all=True, n_ctx=1024, n_threads=2, flash_attn=True, verbose=False
    )
    try:
        ids = list(
            llm.tokenize((REPO / "tests" / "data" / "teacher_forcing_en.txt").read_bytes(), add_bos=True)
        )[:300]
        llm.eval(ids)
        want = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    m = build_manifest(path, hash_tensors=False)
    n = m.n_layers - m.mtp_layers
    hops = native_hops(path, [(0, 1), (1, n - 1), (n - 1, n)], "f16")
    try:
        for h in hops:
            h.set_flash_attention(True)
            h.set_checkpoints(256, 2)
        got = logits_rows(native_forward(hops, open_sessions(hops), 0, ids), len(ids))
    finally:
        for h in hops:
            h.close()
    assert float(np.abs(got - want).max()) == 0.0
