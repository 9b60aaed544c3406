"""glm-dsa's own facts (GLM-5.2's layers: MLA latent cache, DeepSeek sparse attention with full and
shared indexers, a leading dense layer, then routed experts with a shared expert): its split puts every
seam before a full-indexer layer, a window starting at a shared-indexer layer is refused, and a file
with the multi-token-prediction block serves its trunk. Parity with llama.cpp over 3 hops, chunking,
edits, snapshots and batching are the shared suite's (test_archs.py, test_archs_state.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.artifacts import archtable
from agent.artifacts.tiny import glm_dsa_indexer_types, write_tiny_gguf
from agent.backends.libggswarm import NativeError, NativeModel
from tests.native.routes import (
    close_sessions,
    logits_rows,
    native_forward,
    open_sessions,
)

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
ROW = archtable.BY_NAME["glm-dsa"]
N_LAYERS = archtable.suite_layers(ROW)  # 9: full indexers at 0, 3 and 6; layer 0 dense, the rest MoE
# every window starts at a full-indexer layer and holds the two layers that reuse its top-k
SPLITS = list(ROW.suite.splits)
TOP_K = 8  # the tiny file's indexer.top_k: every position past the 8th attends a sparse subset
# f32 weights, the same ggml ops in the same order as llama.cpp: the logits come out equal (max |diff|
# 0.0 so far); the bound leaves room for a ggml build that reorders a reduction
MAX_LOGIT_DIFF = 1e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("glm-dsa") / "glm-dsa.gguf"
    return str(write_tiny_gguf("glm-dsa", path, n_layers=N_LAYERS))


@pytest.fixture(scope="module")
def llama(gguf: str):  # noqa: ANN201
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
