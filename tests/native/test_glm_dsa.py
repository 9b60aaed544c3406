"""glm-dsa (GLM-5.2's layers: MLA latent cache, DeepSeek sparse attention with full and shared
indexers, a leading dense layer, then routed experts with a shared expert) split into 3 native hops at
full-indexer layers agrees with llama-cpp-python's full model on a tiny random-weight file whose
indexer keeps the top 8 positions of a 300-token text; chunked prefill, truncation of an edited turn
and a snapshot in another process continue exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.tiny import glm_dsa_indexer_types, write_tiny_gguf
from agent.backends.libggswarm import NativeError, NativeModel
from tests.native.routes import (
    close_sessions,
    continue_in_another_process,
    llama_greedy,
    logits_rows,
    native_forward,
    native_greedy,
    open_sessions,
)

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
N_LAYERS = 9  # full indexers at 0, 3 and 6; layer 0 dense, the rest MoE
# every window starts at a full-indexer layer and holds the two layers that reuse its top-k
SPLITS = [(0, 3), (3, 6), (6, 9)]
TOP_K = 8  # the tiny file's indexer.top_k: every position past the 8th attends a sparse subset
# f32 weights, the same ggml ops in the same order as llama.cpp: the logits come out equal (max |diff|
# 0.0 so far); the bound leaves room for a ggml build that reorders a reduction
MAX_LOGIT_DIFF = 1e-3
# A one-position chunk runs ggml's single-column matmuls, which round the latent row it caches a little
# differently from a batch (measured: chunks of 100/57/143 give 0.0, a chunk of 1 gives 6.3e-3 at that
# position and at later ones reading its row); greedy decoding, all one-position steps, still matches
# llama.cpp token for token.
CHUNK_LOGIT_DIFF = 1e-2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("glm-dsa") / "glm-dsa.gguf"
    return str(write_tiny_gguf("glm-dsa", path, n_layers=N_LAYERS))


@pytest.fixture(scope="module")
def hops(native_lib: None, gguf: str) -> Iterator[list[NativeModel]]:
    models = [NativeModel(gguf, a, b, n_threads=2) for a, b in SPLITS]
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def llama(gguf: str, hops: list[NativeModel]):  # noqa: ANN201
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(
        model_path=gguf, logits_all=True, n_ctx=1024, n_threads=2, flash_attn=False, verbose=False
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def text_ids(llama) -> list[int]:  # noqa: ANN001
    ids = list(llama.tokenize(TEXT.read_bytes(), add_bos=False))[:300]
    assert len(ids) >= 256 > TOP_K
    return ids


def test_the_split_puts_every_seam_before_a_full_indexer_layer() -> None:
    types = glm_dsa_indexer_types(N_LAYERS)
    assert [types[a] for a, _ in SPLITS] == [1, 1, 1]
    assert all(0 in types[a:b] for a, b in SPLITS)  # each window also holds layers that share its top-k


def test_a_window_starting_at_a_shared_indexer_layer_is_refused_atopen_sessions(
    native_lib: None, gguf: str
) -> None:
    with pytest.raises(NativeError, match="cannot start at layer 4: it reuses layer 3's indexer top-k"):
        NativeModel(gguf, 4, 9, n_threads=2)


def test_three_hops_agree_with_llama_cpp_when_teacher_forced(
    hops: list[NativeModel],
    llama,  # noqa: ANN001
    text_ids: list[int],
) -> None:
    llama.reset()
    llama.eval(text_ids)
    ref = np.asarray(llama.scores[: len(text_ids)], dtype=np.float32)
    sids = open_sessions(hops)
    try:
        got = logits_rows(native_forward(hops, sids, 0, text_ids), len(text_ids))
    finally:
        close_sessions(hops, sids)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    diff = float(np.abs(got - ref).max())
    print(f"\nglm-dsa: {len(text_ids)} positions, top-1 agreement {agree:.4f}, max |logit diff| {diff:.3g}")
    assert agree >= 0.995
    assert diff <= MAX_LOGIT_DIFF


def test_thirty_two_greedy_tokens_equal_llama_cpp(
    hops: list[NativeModel],
    llama,  # noqa: ANN001
    text_ids: list[int],
) -> None:
    prompt = text_ids[:40]
    assert native_greedy(hops, prompt, 32) == llama_greedy(llama, prompt, 32)


def test_prefill_in_chunks_equals_one_shot_prefill(hops: list[NativeModel], text_ids: list[int]) -> None:
    ids = text_ids[:300]
    sids = open_sessions(hops)
    try:
        whole = logits_rows(native_forward(hops, sids, 0, ids), len(ids))
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    parts = []
    try:
        pos = 0
        for n in (100, 57, 1, 142):  # the last chunk crosses the 256-position padding of the span
            parts.append(logits_rows(native_forward(hops, sids, pos, ids[pos : pos + n]), n))
            pos += n
    finally:
        close_sessions(hops, sids)
    got = np.concatenate(parts)
    assert (got.argmax(1) == whole.argmax(1)).all()
    assert float(np.abs(got - whole).max()) <= CHUNK_LOGIT_DIFF


def test_an_edited_history_continues_like_a_fresh_prefill(
    hops: list[NativeModel], text_ids: list[int]
) -> None:
    turn1, turn2 = text_ids[:150], text_ids[150:230]
    edited = text_ids[150:180] + text_ids[240:290]  # the second turn rewritten after its 30th token
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, turn1, logits=False)
        native_forward(hops, sids, 150, turn2, logits=False)
        # latent and indexer-K rows are per position: every hop cuts back exactly
        assert [h.truncate_to(s, 180) for h, s in zip(hops, sids, strict=True)] == [(180, "exact")] * 3
        history = turn1 + edited
        got = logits_rows(native_forward(hops, sids, 180, history[180:]), len(history) - 180)
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    try:
        fresh = logits_rows(native_forward(hops, sids, 0, history), len(history))[180:]
    finally:
        close_sessions(hops, sids)
    assert (got.argmax(1) == fresh.argmax(1)).all()
    assert float(np.abs(got - fresh).max()) <= MAX_LOGIT_DIFF


def test_a_snapshot_restored_in_another_process_continues_identically(
    gguf: str, hops: list[NativeModel], text_ids: list[int], tmp_path: Path
) -> None:
    prompt = text_ids[:120]
    sids = open_sessions(hops)
    try:
        tok = int(native_forward(hops, sids, 0, prompt, logits=False)["token"])
        files = []
        for i, (h, s) in enumerate(zip(hops, sids, strict=True)):
            f = tmp_path / f"hop{i}.snap"
            f.write_bytes(h.snapshot(s))
            files.append(str(f))
        here, t, pos = [], tok, len(prompt)
        for _ in range(8):
            r = native_forward(hops, sids, pos, [t])
            here.append([int(r["token"]), logits_rows(r, 1)[0, :64].tolist()])
            t, pos = here[-1][0], pos + 1
    finally:
        close_sessions(hops, sids)
    there = continue_in_another_process(gguf, SPLITS, files, len(prompt), 8, tok)
    assert [t for t, _ in there] == [t for t, _ in here]
    assert np.array_equal(np.asarray([lg for _, lg in there]), np.asarray([lg for _, lg in here]))


def test_a_file_with_a_multi_token_prediction_block_serves_its_trunk(
    native_lib: None,
    tmp_path: Path,
    text_ids: list[int],
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = str(write_tiny_gguf("glm-dsa", tmp_path / "mtp.gguf", n_layers=N_LAYERS, mtp=True))
    with pytest.raises(NativeError, match="outside 0:9"):
        NativeModel(path, 6, 10, n_threads=2)
    ids = text_ids[:64]
    llm = llama_cpp.Llama(
        model_path=path, logits_all=True, n_ctx=256, n_threads=2, flash_attn=False, verbose=False
    )
    try:
        llm.eval(ids)
        ref = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    hops = [NativeModel(path, a, b, n_threads=2) for a, b in SPLITS]
    try:
        sids = open_sessions(hops)
        got = logits_rows(native_forward(hops, sids, 0, ids), len(ids))
        close_sessions(hops, sids)
    finally:
        for h in hops:
            h.close()
    assert float(np.abs(got - ref).max()) <= MAX_LOGIT_DIFF
