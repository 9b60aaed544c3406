"""The torch reference backend: KV-cached decoding, exact splits, memory accounting, llama.cpp agreement."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import Manifest
from agent.backends.base import BackendError, ShardSpec, StepInput
from agent.backends.torch_llama import TorchLlamaBackend
from agent.wire.ids import SessionId
from tests.helpers import CHAT_PROMPT as PROMPT
from tests.helpers import greedy_through

TEXT = (Path(__file__).resolve().parents[1] / "data" / "teacher_forcing_en.txt").read_text()
SID = SessionId(b"a" * 16)


@pytest.fixture(scope="module")
def shards(model_path: str, manifest: Manifest) -> dict[str, TorchLlamaBackend]:
    def make(a: int, b: int) -> TorchLlamaBackend:
        return TorchLlamaBackend(ShardSpec(model_path, a, b, manifest, n_threads=2))

    return {"full": make(0, 30), "a": make(0, 10), "b": make(10, 20), "c": make(20, 30)}


def test_three_shards_in_one_process_equal_the_whole_model(shards: dict[str, TorchLlamaBackend]) -> None:
    whole = greedy_through([shards["full"]], PROMPT, 16)
    split = greedy_through([shards["a"], shards["b"], shards["c"]], PROMPT, 16)
    assert whole == split
    assert len(set(whole)) > 3  # a real continuation, not one token repeated


def test_a_decode_step_appends_exactly_one_position(
    shards: dict[str, TorchLlamaBackend],
) -> None:
    b = shards["full"]
    b.open_session(SID, 256)
    try:
        r = b.forward(StepInput(SID, 0, token_ids=np.array(PROMPT)))
        assert b.session_len(SID) == len(PROMPT)
        for i in range(3):
            r = b.forward(StepInput(SID, len(PROMPT) + i, token_ids=np.array([r.token])))
            assert b.session_len(SID) == len(PROMPT) + i + 1
    finally:
        b.close_session(SID)


def test_closing_a_session_returns_kv_memory_to_baseline(shards: dict[str, TorchLlamaBackend]) -> None:
    b = shards["b"]
    baseline = b.kv_bytes()
    b.open_session(SID, 4096)
    b.forward(StepInput(SID, 0, hidden=np.zeros((300, 576), np.float32)))
    assert b.kv_bytes(SID) >= 300 * 10 * 2 * 3 * 64 * 4  # 10 layers x K,V x 3 heads x 64 dims x f32
    b.close_session(SID)
    assert b.kv_bytes() == baseline


def test_truncating_then_recomputing_gives_the_same_logits(shards: dict[str, TorchLlamaBackend]) -> None:
    b = shards["full"]
    b.open_session(SID, 256)
    try:
        first = b.forward(StepInput(SID, 0, token_ids=np.array(PROMPT), want_logits=True)).logits
        b.truncate(SID, 10)
        again = b.forward(StepInput(SID, 10, token_ids=np.array(PROMPT[10:]), want_logits=True)).logits
        assert np.allclose(first[10:], again, atol=1e-4)
    finally:
        b.close_session(SID)


def test_bad_inputs_raise_backend_errors(shards: dict[str, TorchLlamaBackend]) -> None:
    b = shards["b"]
    b.open_session(SID, 8)
    try:
        with pytest.raises(BackendError, match="hidden size"):
            b.forward(StepInput(SID, 0, hidden=np.zeros((1, 100), np.float32)))
        with pytest.raises(BackendError, match="does not follow"):
            b.forward(StepInput(SID, 5, hidden=np.zeros((1, 576), np.float32)))
        with pytest.raises(BackendError, match="limit"):
            b.forward(StepInput(SID, 0, hidden=np.zeros((9, 576), np.float32)))
        with pytest.raises(BackendError, match="unknown session"):
            b.forward(StepInput(SessionId(b"z" * 16), 0, hidden=np.zeros((1, 576), np.float32)))
    finally:
        b.close_session(SID)
    with pytest.raises(BackendError, match="vocabulary"):
        shards["a"].open_session(SID, 8)
        try:
            shards["a"].forward(StepInput(SID, 0, token_ids=np.array([10**6])))
        finally:
            shards["a"].close_session(SID)


@pytest.mark.slow
def test_teacher_forced_top1_agrees_with_llama_cpp(
    shards: dict[str, TorchLlamaBackend], model_path: str
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path, n_ctx=1024, n_threads=2, logits_all=True, verbose=False)
    ids = llm.tokenize(TEXT.encode(), add_bos=False)
    assert 280 <= len(ids) <= 400
    llm.eval(ids)
    ref = np.array(llm.scores[: len(ids)])
    sid = SessionId(b"t" * 16)
    parts = [shards["a"], shards["b"], shards["c"]]
    for p in parts:
        p.open_session(sid, 1024)
    h = None
    for p in parts:
        r = p.forward(
            StepInput(sid, 0, token_ids=np.array(ids) if h is None else None, hidden=h, want_logits=True)
        )
        h = r.hidden
    for p in parts:
        p.close_session(sid)
    agree = float((ref.argmax(-1) == r.logits.argmax(-1)).mean())
    print(
        f"teacher-forced top-1 agreement torch 3-shard vs llama.cpp: {agree:.4f} over {len(ids)} positions; "
        f"max |logit diff| {np.abs(ref - r.logits).max():.3f}"
    )
    assert agree >= 0.90
