"""The Qwen3.5 hybrid (qwen35, qwen35moe: gated delta-net layers with recurrent state, gated full
attention every 4th layer, routed experts with a shared expert) split into 3 native hops: its own
facts. Quantized weights agree with llama.cpp too; a chunked prefill crosses a periodic checkpoint
exactly; checkpoints serve an edited turn, a chat's next turn and a regenerate, bounded in number and
charged to the node's budget. Parity with llama.cpp over 3 hops, greedy decoding, snapshots in another
process and batching are the shared suite's (test_archs.py, test_archs_state.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts import archtable
from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.libggswarm import NativeBudget, NativeError, NativeModel
from agent.backends.native import CHECKPOINT_EVERY, CHECKPOINTS_MAX
from tests.native.routes import (
    close_sessions,
    logits_rows,
    native_forward,
    native_greedy,
    open_sessions,
    truncate_route,
)

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
# full attention at layers 3 and 7 of 8: the first seam sits right before one, the second right after
SPLITS = list(archtable.BY_NAME["qwen35"].suite.splits)
# f32 weights, the same ggml ops in the same order as llama.cpp: the logits come out equal (0.0 in
# every run so far); the bound leaves room for a ggml build that reorders a reduction
MAX_LOGIT_DIFF = 1e-3
ARCHS = ["qwen35", "qwen35moe"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gguf(arch: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf(arch, tmp_path_factory.mktemp(arch) / f"{arch}.gguf"))


@pytest.fixture(scope="module")
def hops(native_lib: None, gguf: str) -> Iterator[list[NativeModel]]:
    models = [NativeModel(gguf, a, b, n_threads=2) for a, b in SPLITS]
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def llama(gguf: str, hops: list[NativeModel]):  # noqa: ANN201
    llama_cpp = pytest.importorskip("llama_cpp")
    flash = hops[0].info.decode_kernels == -2  # flash-attention mode reproduces llama.cpp's flash path
    llm = llama_cpp.Llama(
        model_path=gguf, logits_all=True, n_ctx=1024, n_threads=2, flash_attn=flash, verbose=False
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def text_ids(llama) -> list[int]:  # noqa: ANN001
    ids = llama.tokenize(TEXT.read_bytes(), add_bos=False)
    assert len(ids) >= 256
    return list(ids)


def test_quantized_weights_agree_with_llama_cpp_too(native_lib: None, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    path = str(write_tiny_gguf("qwen35moe", tmp_path / "q8.gguf", dtype="q8_0"))
    hops = [NativeModel(path, a, b, n_threads=2) for a, b in SPLITS]
    flash = hops[0].info.decode_kernels == -2
    llm = llama_cpp.Llama(
        model_path=path, logits_all=True, n_ctx=512, n_threads=2, flash_attn=flash, verbose=False
    )
    try:
        ids = llm.tokenize(TEXT.read_bytes(), add_bos=False)[:200]
        llm.eval(ids)
        want = np.array(llm.scores[: len(ids)], dtype=np.float32)
        sids = open_sessions(hops)
        got = logits_rows(native_forward(hops, sids, 0, ids), len(ids))
    finally:
        llm.close()
        for h in hops:
            h.close()
    assert float(np.abs(got - want).max()) <= MAX_LOGIT_DIFF


def test_prefill_in_chunks_equals_one_shot_prefill(
    gguf: str, text_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # ggml's ops for attention (read when a handle opens): this is about the recurrent state and its
    # checkpoint across cuts. In flash-attention mode (CPUs without AVX-512) a cut changes ggml's
    # flash-attention rounding, in llama.cpp itself too: these cuts move llama-cpp-python's own logits
    # by 0.023 (qwen35) and 0.091 (qwen35moe) against one 300-token eval, and ours by the same.
    monkeypatch.setenv("GGSWARM_GGML_ATTENTION", "1")
    hops = [NativeModel(gguf, a, b, n_threads=2) for a, b in SPLITS]
    try:
        for h in hops:  # a node's periodic checkpoints (off by default) cut the micro-batches at 256
            h.set_checkpoints(256, 8)
        _chunked_equals_whole(hops, text_ids[:300])
    finally:
        for m in hops:
            m.close()


def _chunked_equals_whole(hops: list[NativeModel], ids: list[int]) -> None:
    sids = open_sessions(hops)
    try:
        whole = logits_rows(native_forward(hops, sids, 0, ids), len(ids))
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    parts = []
    try:
        pos = 0
        for n in (100, 57, 1, 142):  # crosses the 256-position checkpoint inside the last chunk
            parts.append(logits_rows(native_forward(hops, sids, pos, ids[pos : pos + n]), n))
            pos += n
    finally:
        close_sessions(hops, sids)
    assert float(np.abs(np.concatenate(parts) - whole).max()) <= MAX_LOGIT_DIFF


def test_an_edited_turn_restores_a_checkpoint_and_continues_like_a_fresh_prefill(
    hops: list[NativeModel], text_ids: list[int]
) -> None:
    turn1, turn2 = text_ids[:150], text_ids[150:230]
    edited = text_ids[150:180] + text_ids[240:290]  # the second turn rewritten after its 30th token
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, turn1, logits=False)
        native_forward(hops, sids, 150, turn2, logits=False)
        assert hops[0].checkpoints(sids[0]) == [150, 230]  # the turn boundaries
        assert hops[1].checkpoints(sids[1]) == []  # a window of full attention only keeps none
        held, kinds = truncate_route(list(zip(hops, sids, strict=True)), 180)
        assert held == 150
        assert kinds == ["checkpoint", "exact", "checkpoint"]
        history = turn1 + edited
        got = logits_rows(native_forward(hops, sids, held, history[held:]), len(history) - held)
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    try:
        fresh = logits_rows(native_forward(hops, sids, 0, history), len(history))[held:]
    finally:
        close_sessions(hops, sids)
    assert float(np.abs(got - fresh).max()) <= MAX_LOGIT_DIFF


def test_without_a_checkpoint_the_route_reprefills_from_zero(
    hops: list[NativeModel], text_ids: list[int]
) -> None:
    sids = open_sessions(hops)
    try:
        for h in hops:
            h.set_checkpoints(0, 0)
        native_forward(hops, sids, 0, text_ids[:100], logits=False)
        assert hops[0].checkpoints(sids[0]) == []
        held, kinds = truncate_route(list(zip(hops, sids, strict=True)), 60)
        assert (held, kinds[0]) == (0, "from_zero")
        native_forward(hops, sids, 0, text_ids[:10], logits=False)
        hops[0].truncate(sids[0], 5)  # the plain truncate goes back as far as it must, too
        assert hops[0].session_len(sids[0]) == 0
    finally:
        for h in hops:
            h.set_checkpoints(CHECKPOINT_EVERY, CHECKPOINTS_MAX)  # back to the defaults
        close_sessions(hops, sids)


def _greedy_from(hops: list[NativeModel], sids: list[int], pos: int, first: int, n: int) -> list[int]:
    """n greedy tokens from `first` (sampled for position pos - 1, not fed yet), fed one at a time."""
    got = [first]
    while len(got) < n:
        got.append(int(native_forward(hops, sids, pos + len(got) - 1, [got[-1]], logits=False)["token"]))
    return got


def test_the_default_checkpoints_serve_a_chats_rollbacks_and_stay_bounded(
    gguf: str, hops: list[NativeModel], text_ids: list[int]
) -> None:
    """The default policy (the start and end of every multi-token call, at most 2 per session, none
    periodic): a chat's next turn that re-renders the previous answer goes back to the end of the first
    prompt, a regenerate to the start of the latest call, each without re-prefilling from 0 and
    answering as a fresh session does; a verification's own checkpoint pushes no turn checkpoint out."""
    prompt1 = text_ids[:120]
    sids = open_sessions(hops)
    try:
        for h in hops:
            h.set_checkpoints(CHECKPOINT_EVERY, CHECKPOINTS_MAX)
        r: dict = {}
        for pos in range(0, 120, 40):  # the prompt in chunks, as the route prefills it: one call each
            r = native_forward(hops, sids, pos, prompt1[pos : pos + 40], logits=False)
        assert hops[0].checkpoints(sids[0]) == [80, 120]  # 40 went first: at most 2
        answer1 = _greedy_from(hops, sids, 120, int(r["token"]), 9)  # positions 120..127 fed
        assert hops[0].checkpoints(sids[0]) == [80, 120]  # decode steps take none
        # turn 2 re-renders the first answer (a stripped reasoning block): it shares 2 tokens of it
        prompt2 = prompt1 + answer1[:2] + text_ids[200:205] + text_ids[130:190]
        held, kinds = truncate_route(list(zip(hops, sids, strict=True)), 122)
        assert held == 120  # the end of the first prompt, not 0
        assert kinds == ["checkpoint", "exact", "checkpoint"]
        r = native_forward(hops, sids, 120, prompt2[120:], logits=False)
        p2 = len(prompt2)
        assert hops[0].checkpoints(sids[0]) == hops[2].checkpoints(sids[2]) == [120, p2]
        answer2 = _greedy_from(hops, sids, p2, int(r["token"]), 8)
        assert answer2 == native_greedy(hops, prompt2, 8)  # as a fresh session
        # a verification's checkpoint is held apart: outside the maximum, and it pushes nothing out
        assert hops[0].checkpoint(sids[0])
        assert hops[0].checkpoints(sids[0]) == [120, p2, p2 + 7]
        hops[0].drop_checkpoint(sids[0], p2 + 7)
        assert hops[0].checkpoints(sids[0]) == [120, p2]
        # regenerate: the same prompt again, its last position recomputed (RouteClient.generate)
        held, kinds = truncate_route(list(zip(hops, sids, strict=True)), p2 - 1)
        assert (held, kinds[0]) == (120, "checkpoint")  # the latest call's start
        r = native_forward(hops, sids, 120, prompt2[120:], logits=False)
        assert _greedy_from(hops, sids, p2, int(r["token"]), 8) == answer2
        assert hops[0].checkpoints(sids[0]) == [120, p2]
    finally:
        close_sessions(hops, sids)
    fresh = NativeModel(gguf, 0, 3, n_threads=2)  # the library's own defaults: none periodic, 2 at most
    try:
        sid = fresh.open_session(1024)
        fresh.forward(sid, 0, token_ids=np.asarray(text_ids[:300], dtype=np.int32))  # past 256
        fresh.forward(sid, 300, token_ids=np.asarray(text_ids[300:330], dtype=np.int32))
        assert fresh.checkpoints(sid) == [300, 330]
    finally:
        fresh.close()


def test_state_and_checkpoints_are_charged_to_the_node_budget(gguf: str, text_ids: list[int]) -> None:
    budget = NativeBudget(64 << 20)
    hop = NativeModel(gguf, 0, 3, n_threads=2, budget=budget)  # delta-net layers only
    try:
        sid = hop.open_session(1024)
        hop.forward(sid, 0, token_ids=np.asarray(text_ids[:10], dtype=np.int32))
        state = hop.kv_bytes(sid)
        assert state > 0 and budget.used == state
        assert len(hop.snapshot(sid)) > state // 2  # the recurrent state travels in snapshots
        hop.forward(sid, 10, token_ids=np.asarray(text_ids[10:20], dtype=np.int32))  # two checkpoints
        assert hop.checkpoints(sid) == [10, 20]
        assert budget.used == hop.kv_bytes(sid) > state
        hop.close_session(sid)
        assert budget.used == 0
    finally:
        hop.close()
        budget.close()


def _fill_with_checkpoints(hop: NativeModel, text_ids: list[int]) -> int:
    """A session of 20 positions fed in two calls: checkpoints at 10 and 20."""
    a = hop.open_session(1024)
    hop.forward(a, 0, token_ids=np.asarray(text_ids[:10], dtype=np.int32))
    hop.forward(a, 10, token_ids=np.asarray(text_ids[10:20], dtype=np.int32))
    assert hop.checkpoints(a) == [10, 20]
    return a


def test_a_sessions_growth_takes_back_checkpoints_before_the_budget_refuses_it(
    gguf: str, text_ids: list[int]
) -> None:
    """Checkpoints only borrow the budget's free room (docs/native.md, "Checkpoints"): another session
    that needs it gets it, the oldest checkpoint going first, and a truncate that needed it re-prefills
    from zero; where even all of them would not make room, none goes."""
    roomy = NativeBudget(256 << 20)
    hop = NativeModel(gguf, 0, 4, n_threads=2, budget=roomy)  # delta-net layers and a full-attention one
    try:  # the same calls on a roomy budget first, to size the tight one
        _fill_with_checkpoints(hop, text_ids)
        held, ckpts = roomy.used, hop.checkpoints_reclaimable()
        b = hop.open_session(1024)
        need = hop.growth_bytes(b, 100)
        assert ckpts > 0 and need > ckpts
    finally:
        hop.close()
        roomy.close()
    # the budget short by half the checkpoints' bytes (taking the older one back is enough), then by all
    # of them and a byte (nothing is)
    for short_by, fits in ((ckpts - ckpts // 2, True), (ckpts + 1, False)):
        budget = NativeBudget(held + need - short_by)
        hop = NativeModel(gguf, 0, 4, n_threads=2, budget=budget)
        try:
            a = _fill_with_checkpoints(hop, text_ids)
            assert budget.used == held
            b = hop.open_session(1024)
            ids = np.asarray(text_ids[20:120], dtype=np.int32)
            if fits:
                hop.forward(b, 0, token_ids=ids)
                assert hop.checkpoints(a) == [20]  # the one taken first went
                assert hop.session_len(b) == 100
                assert hop.truncate_to(a, 15) == (0, "from_zero")  # 10 is gone: a re-prefill from 0
            else:
                with pytest.raises(NativeError, match="KV budget exhausted"):
                    hop.forward(b, 0, token_ids=ids)
                assert hop.checkpoints(a) == [10, 20]  # taking them would not have been enough
                assert budget.used == held
        finally:
            hop.close()
            budget.close()


def test_the_backend_takes_its_checkpoint_interval_from_its_options(gguf: str, text_ids: list[int]) -> None:
    from agent.artifacts.manifest import build_manifest
    from agent.backends.base import BackendError, ShardSpec, StepInput
    from agent.backends.native import NativeBackend
    from agent.wire.ids import SessionId

    spec = ShardSpec(gguf, 0, 3, build_manifest(gguf, hash_tensors=False), n_threads=2)
    be = NativeBackend(spec, checkpoint_every=100, checkpoints_max=2)
    sid = SessionId(bytes(16))
    try:
        be.open_session(sid, 1024)
        be.forward(StepInput(sid, 0, token_ids=np.asarray(text_ids[:250], dtype=np.int32)))
        assert be.model.checkpoints(be.sessions[sid]) == [200, 250]  # 100 went first: at most 2
        assert be.truncate_to(sid, 230) == (200, "checkpoint")
        assert be.session_len(sid) == 200
    finally:
        be.close()
    be = NativeBackend(spec, checkpoints_max=1)  # the interval left at its default: none periodic
    try:
        be.open_session(sid, 1024)
        be.forward(StepInput(sid, 0, token_ids=np.asarray(text_ids[:250], dtype=np.int32)))
        be.forward(StepInput(sid, 250, token_ids=np.asarray(text_ids[250:290], dtype=np.int32)))
        assert be.model.checkpoints(be.sessions[sid]) == [290]
    finally:
        be.close()
    for bad in ({"checkpoints_max": -1}, {"checkpoint_every": -5}, {"checkpoints_max": "many"}):
        with pytest.raises(BackendError, match="bad checkpoint settings"):
            NativeBackend(spec, **bad)
