"""gemma3's sliding-window layers keep K and V in a ring, as llama.cpp's SWA cache does: GGML_PAD(n_swa +
n_ubatch, 256) slots (768 for the tiny file's 32-position window), position p in slot p % 768. Past the
ring's wrap 3 hops still agree with llama.cpp, alone and batched; the bytes held stop growing with the
context on those layers; a snapshot taken after the wrap continues identically in another process; going
back a little is exact, going back past the ring goes to 0 (llama.cpp's SWA cache cannot go back either)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.libggswarm import NativeModel
from tests.native.routes import (
    close_sessions,
    here_and_in_another_process,
    llama_with_cache,
    logits_rows,
    native_forward,
    native_hops,
    open_sessions,
)

REPO = Path(__file__).resolve().parents[2]
TEXTS = [REPO / "tests" / "data" / n for n in ("teacher_forcing_en.txt", "native_lighthouse.txt")]
SPLITS = [(0, 2), (2, 5), (5, 6)]  # sliding-window layers 0-4, the global layer 5
RING = 768  # pad256(32 + 512)
N_LONG = 860
MAX_LOGIT_DIFF = 1e-3
# a batch's row-wise kernels round differently from one row's: batched against alone differs by up to
# 1.9e-3 on this file before the wrap (positions 300-310) and 2.1e-3 after it (820-830), same as ever
BATCH_LOGIT_DIFF = 5e-3
# the references run llama.cpp's own SWA ring (swa_full=False), the layout ours has: with
# llama-cpp-python's default full-size SWA cache the softmax sums the same terms in another slot order,
# which on AVX2 moved logits by up to 2.1e-3 past the wrap (within 1e-3 on AVX-512)
D_KV = 16  # one kv head of 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf("gemma3", tmp_path_factory.mktemp("swa") / "gemma3.gguf"))


@pytest.fixture(scope="module")
def hops(native_lib: None, gguf: str) -> Iterator[list[NativeModel]]:
    models = native_hops(gguf, SPLITS)
    if models[0].info.decode_kernels == -2:  # flash attention: llama.cpp below runs without it
        pytest.skip("this CPU runs flash attention; the reference here is llama.cpp's non-flash path")
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def ids(gguf: str) -> list[int]:
    llm = llama_with_cache(gguf, "f16", n_ctx=1024, swa_full=False)
    try:
        got = list(llm.tokenize(b"\n\n".join(t.read_bytes() for t in TEXTS), add_bos=True))
    finally:
        llm.close()
    assert len(got) >= N_LONG
    return got[:N_LONG]


@pytest.fixture(scope="module")
def reference(gguf: str, ids: list[int]) -> np.ndarray:
    llm = llama_with_cache(gguf, "f16", n_ctx=1024, swa_full=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:N_LONG], dtype=np.float32)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def reference_steps(gguf: str, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits of the last 40 positions as one-position decode steps (a step's kernels
    round differently from a batch's: compare steps with steps)."""
    llm = llama_with_cache(gguf, "f16", n_ctx=1024, swa_full=False)
    try:
        llm.eval(ids[: N_LONG - 40])
        rows = []
        for p in range(N_LONG - 40, N_LONG):
            llm.eval([ids[p]])
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
        return np.asarray(rows)
    finally:
        llm.close()


def test_three_hops_agree_with_llama_cpp_past_the_rings_wrap(
    hops: list[NativeModel], ids: list[int], reference: np.ndarray, reference_steps: np.ndarray
) -> None:
    sids = open_sessions(hops)
    try:
        got = logits_rows(native_forward(hops, sids, 0, ids), N_LONG)
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    try:  # decode steps through the wrapped slots
        native_forward(hops, sids, 0, ids[: N_LONG - 40], logits=False)
        steps = [
            logits_rows(native_forward(hops, sids, p, [ids[p]]), 1)[0] for p in range(N_LONG - 40, N_LONG)
        ]
    finally:
        close_sessions(hops, sids)
    diff = float(np.abs(got - reference).max())
    print(f"\ngemma3 {N_LONG} positions: max |logit diff| {diff:.3g}")
    assert float((got.argmax(1) == reference.argmax(1)).mean()) >= 0.995
    assert diff <= MAX_LOGIT_DIFF
    assert float(np.abs(np.asarray(steps) - reference_steps).max()) <= MAX_LOGIT_DIFF


def test_sessions_batched_past_the_wrap_get_the_logits_they_get_alone(
    hops: list[NativeModel], ids: list[int]
) -> None:
    whole = hops  # steps of two sessions at different positions in one graph per hop
    sids = [open_sessions(whole), open_sessions(whole)]
    starts = (N_LONG - 40, N_LONG - 30)
    try:
        for s, start in zip(sids, starts, strict=True):
            native_forward(whole, s, 0, ids[:start], logits=False)
        got: list[list[np.ndarray]] = [[], []]
        for k in range(10):
            x: list[np.ndarray | None] = [None, None]
            for h_i, h in enumerate(whole):
                steps = []
                for j in range(2):
                    p = starts[j] + k
                    step = {"sid": sids[j][h_i], "pos_start": p, "want_logits": h.is_last}
                    if h.is_first:
                        step["token_ids"] = np.asarray([ids[p]], dtype=np.int32)
                    else:
                        step["hidden"] = x[j]
                    steps.append(step)
                out = h.forward_many(steps)
                for j, r in enumerate(out):
                    assert not isinstance(r, Exception), r
                    x[j] = r.get("hidden")
                    if h.is_last:
                        got[j].append(np.asarray(r["logits"], dtype=np.float32).reshape(-1))
    finally:
        for s in sids:
            close_sessions(whole, s)
    alone = reference_steps_native(hops, ids)
    for j, start in enumerate(starts):
        want = alone[start - (N_LONG - 40) :][:10]
        assert float(np.abs(np.asarray(got[j]) - want).max()) <= BATCH_LOGIT_DIFF
        assert np.array_equal(np.asarray(got[j]).argmax(1), want.argmax(1))


def reference_steps_native(hops: list[NativeModel], ids: list[int]) -> np.ndarray:
    """The hops' own logits of the last 40 positions as one session's decode steps."""
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, ids[: N_LONG - 40], logits=False)
        return np.asarray(
            [logits_rows(native_forward(hops, sids, p, [ids[p]]), 1)[0] for p in range(N_LONG - 40, N_LONG)]
        )
    finally:
        close_sessions(hops, sids)


def test_the_sliding_layers_bytes_stop_at_the_ring(gguf: str) -> None:
    with NativeModel(gguf, 0, 6, n_threads=2) as whole:
        held = {}
        for n in (1024, 2048):
            sid = whole.open_session(n)
            native_forward([whole], [sid], 0, list(range(100, 100 + n)), logits=False)
            held[n] = whole.kv_bytes(sid)
            whole.close_session(sid)
    row = 2 * D_KV * 2  # K and V, f16, per position
    assert held[1024] == 5 * RING * row + 1024 * row
    assert held[2048] - held[1024] == 1024 * row  # only the global layer grows


def test_a_snapshot_after_the_wrap_continues_identically_in_another_process(
    gguf: str, hops: list[NativeModel], ids: list[int], tmp_path: Path
) -> None:
    here, there = here_and_in_another_process(gguf, hops, SPLITS, ids[:801], tmp_path)
    assert [t for t, _ in there] == [t for t, _ in here]
    assert np.array_equal(np.asarray([lg for _, lg in there]), np.asarray([lg for _, lg in here]))


# 860 positions in a ring of 768 hold [92, 860): a target whose 32-position window starts there or later
# goes back exactly
@pytest.mark.parametrize(
    ("target", "landed", "kind"), [(850, 850, "exact"), (300, 300, "exact"), (100, 0, "from_zero")]
)
def test_going_back_is_exact_within_the_ring_and_from_zero_past_it(
    hops: list[NativeModel], ids: list[int], reference: np.ndarray, target: int, landed: int, kind: str
) -> None:
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, ids, logits=False)
        where = [h.truncate_to(s, target) for h, s in zip(hops, sids, strict=True)]
        held = min(n for n, _ in where)  # as the route client does: every hop to the shortest
        for h, s in zip(hops, sids, strict=True):
            h.truncate_to(s, held)
        got = logits_rows(native_forward(hops, sids, held, ids[held:]), N_LONG - held)
    finally:
        close_sessions(hops, sids)
    # windows with sliding layers land where their rings allow; the global-only hop anywhere
    assert where == [(landed, kind), (landed, kind), (target, "exact")]
    assert float(np.abs(got - reference[held:]).max()) <= MAX_LOGIT_DIFF
