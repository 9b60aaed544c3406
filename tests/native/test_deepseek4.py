"""DeepSeek-V4 (deepseek4: 4 hyper-connection streams across the seam, a raw sliding-window K cache on
every layer, ratio-4 compressed K with a lightning indexer's top-k and ratio-128 compressed K, hash-routed
experts) split into native hops: its own facts. With f32 caches the hops equal llama-cpp-python's full
model bit for bit (one hop and three), with f16 caches called the same way too, at contexts where the
window slides, every compression ratio fires and the indexer chooses; chunks ending inside compression
blocks, edits reaching behind the rings (a checkpoint) and hash-routed layers past the first hop.
Greedy decoding, snapshots in another process and batching are the shared suite's (test_archs.py,
test_archs_state.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts import archtable
from agent.artifacts.tiny import deepseek4_compress_ratios, write_tiny_gguf
from agent.backends.libggswarm import NativeError, NativeModel
from agent.backends.native import CHECKPOINT_EVERY, CHECKPOINTS_MAX
from tests.native.routes import (
    close_sessions,
    llama_with_cache,
    logits_rows,
    native_forward,
    native_hops,
    open_sessions,
)

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
# ratios per layer: 0, 4, 128, 0, 4, 128. The seams sit after a ratio-4 layer and after a ratio-0
# layer, so each hop holds a different mix of the three state kinds (the first also the hash layer).
SPLITS = list(archtable.BY_NAME["deepseek4"].suite.splits)
# both with f32 caches (llama.cpp's type_k = type_v = 0, the hops' set_cache_type("f32")): the graph
# follows llama.cpp's op sequence (the fused hyper-connection ops, its compressed-cache mask width), so
# the logits against llama.cpp's are equal bit for bit (they differed by ~3e-5 before); the default f16
# caches, against llama.cpp's, are checked over 600 positions in test_rope_scaling.py
LLAMA_MAX_LOGIT_DIFF = 0.0
MAX_LOGIT_DIFF = 1e-3  # ours against ours: chunked or resumed against one pass (a different batch shape)
N_POSITIONS = 300  # > 128: ratio-128 blocks complete; the 16-position window slides; top-8 of > 8 entries

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf("deepseek4", tmp_path_factory.mktemp("deepseek4") / "deepseek4.gguf"))


@pytest.fixture(scope="module")
def hops(native_lib: None, gguf: str) -> Iterator[list[NativeModel]]:
    models = native_hops(gguf, SPLITS, "f32")  # as llama.cpp below (type_k = 0)
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def llama(gguf: str):  # noqa: ANN201
    llm = llama_with_cache(gguf, "f32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def text_ids(llama) -> list[int]:  # noqa: ANN001
    ids = llama.tokenize(TEXT.read_bytes(), add_bos=False)
    assert len(ids) >= N_POSITIONS
    return list(ids[:N_POSITIONS])


@pytest.fixture(scope="module")
def reference(llama, text_ids: list[int]) -> np.ndarray:  # noqa: ANN001
    llama.reset()
    llama.eval(text_ids)
    return np.array(llama.scores[: len(text_ids)], dtype=np.float32)


def test_the_tiny_model_has_every_compression_ratio_across_the_seams() -> None:
    ratios = deepseek4_compress_ratios(6)
    assert [ratios[a:b] for a, b in SPLITS] == [[0, 4], [128, 0], [4, 128]]


def test_the_boundary_carries_four_streams_of_d_model(hops: list[NativeModel]) -> None:
    assert all(h.d_model == 4 * 64 for h in hops)


def test_one_hop_agrees_with_llama_cpp_when_teacher_forced(
    gguf: str, text_ids: list[int], reference: np.ndarray
) -> None:
    with NativeModel(gguf, 0, 6, n_threads=2) as whole:
        whole.set_cache_type("f32")
        sid = whole.open_session(1024)
        got = logits_rows(native_forward([whole], [sid], 0, text_ids, ids_everywhere=True), len(text_ids))
    agree = float((got.argmax(1) == reference.argmax(1)).mean())
    diff = float(np.abs(got - reference).max())
    print(
        f"deepseek4 1 hop: {len(text_ids)} positions, top-1 agreement {agree:.4f}, max |logit diff| {diff:.3g}"
    )
    assert agree >= 0.995
    assert diff <= LLAMA_MAX_LOGIT_DIFF


def test_three_hops_agree_with_llama_cpp_when_teacher_forced(
    hops: list[NativeModel], text_ids: list[int], reference: np.ndarray
) -> None:
    sids = open_sessions(hops)
    try:
        got = logits_rows(native_forward(hops, sids, 0, text_ids, ids_everywhere=True), len(text_ids))
    finally:
        close_sessions(hops, sids)
    agree = float((got.argmax(1) == reference.argmax(1)).mean())
    diff = float(np.abs(got - reference).max())
    print(
        f"deepseek4 3 hops: {len(text_ids)} positions, top-1 agreement {agree:.4f}, max |logit diff| {diff:.3g}"
    )
    assert agree >= 0.995
    assert diff <= LLAMA_MAX_LOGIT_DIFF


@pytest.mark.parametrize(
    ("flash", "calls"),
    [(False, (300,)), (True, (300,)), (True, (20, 280))],
    ids=["flash-off", "flash-on", "flash-on-short-call-first"],
)
def test_three_hops_with_f16_caches_equal_llama_cpp_called_the_same_way(
    gguf: str, text_ids: list[int], flash: bool, calls: tuple[int, ...]
) -> None:
    """The node's default cache type over 300 positions, each attention mode and the same calls on both
    sides: equal bit for bit (0.0137 apart with flash off and 0.0289 with it on before the graph followed
    llama.cpp's op sequence). With flash attention on, ggml's CPU kernel runs a call of 64 or more
    queries tiled and a shorter one scalar, which round otherwise (llama.cpp's own [256, 44] is 20 logits
    from its [300] on this file): with periodic checkpoints every 256 positions (a node's setting) the
    executor's micro-batches end at 256 inside a 300-position call, and its 44-query remainder must still
    run tiled, while a 20-position call runs scalar."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = text_ids[: sum(calls)]
    llm = llama_cpp.Llama(
        model_path=gguf, logits_all=True, n_ctx=1024, n_threads=2, flash_attn=flash, verbose=False
    )
    try:
        off = 0
        for n in calls:
            llm.eval(ids[off : off + n])
            off += n
        want = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    hops = native_hops(gguf, SPLITS, "f16")
    try:
        for h in hops:
            h.set_flash_attention(flash)
            h.set_checkpoints(256, 2)  # a node's periodic checkpoints (off by default) cut at 256
        sids = open_sessions(hops)
        rows, off = [], 0
        for n in calls:
            rows.append(
                logits_rows(native_forward(hops, sids, off, ids[off : off + n], ids_everywhere=True), n)
            )
            off += n
        got = np.concatenate(rows)
    finally:
        for h in hops:
            h.close()
    diff = float(np.abs(got - want).max())
    print(f"deepseek4 f16, flash {'on' if flash else 'off'}, calls {calls}: max |logit diff| {diff:.3g}")
    assert diff <= LLAMA_MAX_LOGIT_DIFF


def test_prefill_in_chunks_equals_one_shot_prefill(hops: list[NativeModel], text_ids: list[int]) -> None:
    ids = text_ids
    sids = open_sessions(hops)
    try:
        whole = logits_rows(native_forward(hops, sids, 0, ids, ids_everywhere=True), len(ids))
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    parts = []
    try:
        pos = 0
        for n in (99, 30, 1, 2, 168):  # chunk ends inside ratio-4 and ratio-128 blocks
            parts.append(
                logits_rows(native_forward(hops, sids, pos, ids[pos : pos + n], ids_everywhere=True), n)
            )
            pos += n
    finally:
        close_sessions(hops, sids)
    assert float(np.abs(np.concatenate(parts) - whole).max()) <= MAX_LOGIT_DIFF


def test_an_edited_history_continues_with_the_logits_of_a_fresh_prefill(
    hops: list[NativeModel], text_ids: list[int]
) -> None:
    # the raw window and the compressor rows are rings (as llama.cpp keeps them): an edit further back
    # than they reach goes back to the newest checkpoint before it (every 64 positions here) and the
    # route re-prefills from there; cut inside a ratio-4 block and inside the second ratio-128 block
    first, edited_from = text_ids[:270], 201
    history = text_ids[:edited_from] + text_ids[20:80]
    for h in hops:
        h.set_checkpoints(64, 8)
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, first, logits=False, ids_everywhere=True)
        for h, s in zip(hops, sids, strict=True):
            assert h.truncate_to(s, edited_from) == (192, "checkpoint")
        got = logits_rows(
            native_forward(hops, sids, 192, history[192:], ids_everywhere=True), len(history) - 192
        )[edited_from - 192 :]
    finally:
        close_sessions(hops, sids)
        for h in hops:
            h.set_checkpoints(CHECKPOINT_EVERY, CHECKPOINTS_MAX)  # back to the defaults
    sids = open_sessions(hops)
    try:
        fresh = logits_rows(native_forward(hops, sids, 0, history, ids_everywhere=True), len(history))[
            edited_from:
        ]
    finally:
        close_sessions(hops, sids)
    assert float(np.abs(got - fresh).max()) <= MAX_LOGIT_DIFF


def test_a_window_without_the_hash_layer_takes_no_token_ids(
    hops: list[NativeModel], text_ids: list[int]
) -> None:
    # the tiny model routes only layer 0 by token id: later hops run on the hidden rows alone
    sids = open_sessions(hops)
    try:
        x = hops[0].forward(sids[0], 0, token_ids=np.asarray(text_ids[:10], dtype=np.int32))["hidden"]
        hops[1].forward(sids[1], 0, hidden=x)
        with pytest.raises(NativeError, match="hidden size mismatch"):
            hops[2].forward(sids[2], 0, hidden=np.zeros((10, 64), dtype=np.float32))
    finally:
        close_sessions(hops, sids)


def test_hash_routed_layers_after_the_first_hop_agree_with_llama_cpp_when_given_the_ids(
    native_lib: None, tmp_path: Path, text_ids: list[int]
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = str(write_tiny_gguf("deepseek4", tmp_path / "hash3.gguf", hash_layers=3))  # layers 0, 1, 2
    ids = text_ids[:150]
    llm = llama_cpp.Llama(
        model_path=path,
        logits_all=True,
        n_ctx=512,
        n_threads=2,
        flash_attn=False,
        type_k=0,
        type_v=0,
        verbose=False,
    )
    try:
        llm.eval(ids)
        want = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    hops = [NativeModel(path, a, b, n_threads=2) for a, b in SPLITS]
    for h in hops:
        h.set_cache_type("f32")
    try:
        sids = open_sessions(hops)
        got = logits_rows(native_forward(hops, sids, 0, ids, ids_everywhere=True), len(ids))
        with pytest.raises(NativeError, match="route by token id"):
            hops[1].forward(hops[1].open_session(64), 0, hidden=np.zeros((2, 4 * 64), dtype=np.float32))
    finally:
        for h in hops:
            h.close()
    assert float((got.argmax(1) == want.argmax(1)).mean()) >= 0.995
    assert float(np.abs(got - want).max()) <= LLAMA_MAX_LOGIT_DIFF
