"""Multi-token prediction (API v15; its state in snapshots, v16): the last hop's nextn block (DeepSeek-V4's
and GLM-5.x's MTP head) against llama.cpp's MTP context on the same tiny file, position by position and in chained drafts (the
trunk's own logits with the block attached against llama.cpp's target too), and the block's state (kept
per session, cut back after a draft and after the trunk goes back, carried by snapshots, charged to the
budget)."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.libggswarm import NativeBudget, NativeError, NativeModel
from tests.native.routes import close_sessions, native_forward, native_hops, open_sessions

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
# as tests/native/test_deepseek4.py: ratios 0, 4, 128, 0, 4, 128 over three hops (hash layer on the first)
SPLITS = [(0, 2), (2, 4), (4, 6)]
N_POSITIONS = 300  # > 128: ratio-128 blocks complete; the 16-position window slides (trunk and block)
PROMPT = 40  # the first positions go as one call (the block catches up in one batch), the rest one by one
CHAIN_AT = (PROMPT, 131, 262)  # where a 4-token chain is drafted and compared
CHAIN = 4
# our block against llama.cpp's MTP context, f32 caches on both sides: measured 0.0 (bit for bit) on
# AVX-512; the bound leaves room for a CPU whose kernels round otherwise
LLAMA_MAX_LOGIT_DIFF = 1e-4

pytestmark = pytest.mark.slow


# per architecture: the tiny file's arguments, the hops, the caches (llama.cpp's type: 0 f32, 1 f16) and
# whether the first hop alone reads token ids (deepseek4's hash layer; the last hop's block reads them too)
CASES: dict[str, tuple[dict[str, Any], list[tuple[int, int]], str, int]] = {
    # indexer keys (128) wider than the heads (64), as in the real files: llama.cpp cannot create an MTP
    # context for a file whose heads are as wide as the indexer's keys (the tiny default)
    "deepseek4": ({"indexer_key_length": 128}, SPLITS, "f32", 0),
    # as tests/native/test_glm_dsa.py: full indexers at 0, 3 and 6, windows starting at them; f16 caches
    "glm-dsa": ({"n_layers": 9}, [(0, 3), (3, 6), (6, 9)], "f16", 1),
}


def tiny_mtp(arch: str, path: Path) -> str:
    return str(write_tiny_gguf(arch, path, mtp=True, **CASES[arch][0]))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_mtp("deepseek4", tmp_path_factory.mktemp("deepseek4-mtp") / "deepseek4-mtp.gguf")


@pytest.fixture(scope="module")
def hops(native_lib: None, gguf: str) -> Iterator[list[NativeModel]]:
    models = native_hops(gguf, SPLITS, "f32")
    models[-1].mtp_open(gguf)
    yield models
    for m in models:
        m.close()


class LlamaMtp:
    """llama.cpp's target and MTP contexts on one model loaded with its MTP layers (load_mtp), through
    llama-cpp-python's bindings of the 0.3.36 C API (ctx_type, the extended batch) and the staging C++
    functions of src/llama-ext.h that libllama exports (nextn embeddings), as common/speculative.cpp's
    draft-mtp drives them: the target's unmasked nextn rows, the MTP context's masked ones."""

    def __init__(self, path: str, width: int, n_ctx: int = 1024, cache: int = 0) -> None:
        """cache: the caches' ggml type (0 f32, 1 f16)."""
        lc = pytest.importorskip("llama_cpp")
        low = lc.llama_cpp
        self.L = low
        lc.llama_backend_init()
        mp = low.llama_model_default_params()
        mp.load_mtp = True
        self.model = low.llama_model_load_from_file(path.encode(), mp)
        assert self.model
        self.n_vocab = int(low.llama_vocab_n_tokens(low.llama_model_get_vocab(self.model)))
        self.width = width

        def params(mtp: bool) -> Any:
            c = low.llama_context_default_params()
            c.n_ctx, c.n_batch, c.n_ubatch, c.n_seq_max = n_ctx, 512, 512, 1
            c.n_threads = c.n_threads_batch = 2
            c.type_k = c.type_v = cache  # as the hops' set_cache_type
            c.flash_attn_type = 0  # off: llama.cpp's CPU default path, as the hops'
            c.swa_full = False  # common's default: the sliding-window cache as a ring
            c.ctx_type = low.LLAMA_CONTEXT_TYPE_MTP if mtp else low.LLAMA_CONTEXT_TYPE_DEFAULT
            return c

        self.tgt = low.llama_init_from_model(self.model, params(False))
        self.dft = low.llama_init_from_model(self.model, params(True))
        assert self.tgt and self.dft
        lib = low._lib
        set_nextn = lib._Z26llama_set_embeddings_nextnP13llama_contextbb
        set_nextn.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]
        set_nextn.restype = None
        self._ith = lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti
        self._ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self._ith.restype = ctypes.POINTER(ctypes.c_float)
        set_nextn(self.tgt, True, False)
        set_nextn(self.dft, True, True)

    def close(self) -> None:
        self.L.llama_free(self.dft)
        self.L.llama_free(self.tgt)
        self.L.llama_model_free(self.model)

    def _decode(self, ctx: Any, tokens: list[int], pos0: int, rows: np.ndarray | None) -> None:
        low = self.L
        b = low.llama_batch_ext_init(ctx)
        keep: list[Any] = []
        try:
            for i, t in enumerate(tokens):
                idx = low.llama_batch_ext_add_token(b, 0, int(t))
                assert idx == i
                pos = (ctypes.c_int32 * 4)(pos0 + i, 0, 0, 0)
                keep.append(pos)
                assert low.llama_batch_ext_set_pos(b, idx, pos)
                if rows is not None:
                    row = np.ascontiguousarray(rows[i], dtype=np.float32)
                    keep.append(row)
                    e = low.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, row.size)
                    assert low.llama_batch_ext_set_embd_token(b, idx, e)
                if i == len(tokens) - 1:
                    low.llama_batch_ext_set_output_logits(b, idx, True)
            assert low.llama_process(ctx, low.LLAMA_PROCESS_TYPE_DECODE, b) == 0
        finally:
            low.llama_batch_ext_free(b)

    def _row(self, ctx: Any, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(self._ith(ctx, i), shape=(self.width,)).copy()

    def target(self, tokens: list[int], pos0: int) -> np.ndarray:
        """Decode on the target; every position's nextn row (deepseek4: the streams before the head;
        glm-dsa: after the output norm); the last position's logits in `self.logits`."""
        self._decode(self.tgt, tokens, pos0, None)
        self.logits = np.ctypeslib.as_array(
            self.L.llama_get_logits_ith(self.tgt, -1), shape=(self.n_vocab,)
        ).copy()
        return np.stack([self._row(self.tgt, i) for i in range(len(tokens))])

    def mtp(self, tokens: list[int], pos0: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decode on the MTP context (each token with the row of the position before); the last
        position's logits and its own nextn row."""
        self._decode(self.dft, tokens, pos0, rows)
        logits = np.ctypeslib.as_array(
            self.L.llama_get_logits_ith(self.dft, -1), shape=(self.n_vocab,)
        ).copy()
        return logits, self._row(self.dft, len(tokens) - 1)  # by batch index (the output's)

    def mtp_cut(self, pos: int) -> None:
        self.L.llama_memory_seq_rm(self.L.llama_get_memory(self.dft), 0, pos, -1)


@pytest.fixture(scope="module", params=list(CASES))
def walk(
    request: pytest.FixtureRequest, native_lib: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """Teacher forcing over N_POSITIONS: after each position p, the block's draft for p + 2 from the
    token at p + 1 (ours: ggswarm_mtp_draft; llama.cpp: its MTP context's decode of that token with the
    target's row of p), and at CHAIN_AT a chain of CHAIN drafts, as common's draft-mtp runs it; and the
    trunk's logits of each position (the block attached) against llama.cpp's target's."""
    arch = request.param
    _, splits, cache, llama_cache = CASES[arch]
    path = tiny_mtp(arch, tmp_path_factory.mktemp(f"{arch}-walk") / "mtp.gguf")
    hops = native_hops(path, splits, cache)
    hops[-1].mtp_open(path)
    ref = LlamaMtp(path, hops[-1].d_model, cache=llama_cache)
    ids = [int(x) for x in np.random.default_rng(0).integers(100, 20000, N_POSITIONS)]
    sids = open_sessions(hops)
    out: dict[str, Any] = {"arch": arch, "diffs": [], "chains": [], "argmax_equal": 0, "trunk": []}
    try:
        native_forward(hops, sids, 0, ids[:PROMPT], False, True)
        rows = ref.target(ids[:PROMPT], 0)
        ref.mtp(ids[:PROMPT], 0, np.vstack([np.zeros((1, ref.width), np.float32), rows[:-1]]))
        h_prev = rows[-1]
        for p in range(PROMPT - 1, N_POSITIONS - 1):
            nxt = ids[p + 1]
            if p + 1 in CHAIN_AT:
                ours = hops[-1].mtp_draft(sids[-1], nxt, CHAIN, want_logits=True)
                tok, h, theirs, logits = nxt, h_prev, [], []
                for i in range(CHAIN):
                    lg, h = ref.mtp([tok], p + 1 + i, h[None])
                    logits.append(lg)
                    tok = int(np.argmax(lg))  # common's top-k sampler: its first candidate
                    theirs.append(tok)
                ref.mtp_cut(p + 1)  # the drafted positions go (p + 1 is redone below)
                diff = float(np.abs(ours["logits"] - np.stack(logits)).max())
                out["chains"].append((p + 1, ours["drafts"], theirs, diff))
            ours = hops[-1].mtp_draft(sids[-1], nxt, 1, want_logits=True)
            lg, _ = ref.mtp([nxt], p + 1, h_prev[None])
            out["diffs"].append(float(np.abs(ours["logits"][0] - lg).max()))
            out["argmax_equal"] += ours["drafts"][0] == int(np.argmax(lg))
            r = native_forward(hops, sids, p + 1, [nxt], True, True)
            h_prev = ref.target([nxt], p + 1)[0]
            out["trunk"].append(float(np.abs(r["logits"][-1] - ref.logits).max()))
        yield out
    finally:
        close_sessions(hops, sids)
        ref.close()
        for h in hops:
            h.close()


def test_mtp_logits_equal_llama_cpp_position_by_position(walk: dict[str, Any]) -> None:
    diffs, trunk = walk["diffs"], walk["trunk"]
    assert len(diffs) == len(trunk) == N_POSITIONS - PROMPT
    print(f"{walk['arch']}: MTP logits, {len(diffs)} positions: max |ours - llama.cpp| = {max(diffs):.3g}")
    print(
        f"{walk['arch']}: the trunk's logits, the block attached: max |ours - llama.cpp| = {max(trunk):.3g}"
    )
    assert max(diffs) <= LLAMA_MAX_LOGIT_DIFF
    assert max(trunk) <= LLAMA_MAX_LOGIT_DIFF
    assert walk["argmax_equal"] == len(diffs)


def test_chained_drafts_equal_llama_cpp(walk: dict[str, Any]) -> None:
    assert [c[0] for c in walk["chains"]] == list(CHAIN_AT)
    for pos, ours, theirs, diff in walk["chains"]:
        print(f"{walk['arch']}: chain at {pos}: ours {ours} llama.cpp {theirs} max |diff| {diff:.3g}")
        assert ours == theirs
        assert diff <= LLAMA_MAX_LOGIT_DIFF


def test_a_draft_leaves_the_session_as_it_was(hops: list[NativeModel]) -> None:
    ids = [int(x) for x in np.random.default_rng(1).integers(100, 20000, 30)]
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, ids[:20], False, True)
        snap = hops[-1].snapshot(sids[-1])
        first = hops[-1].mtp_draft(sids[-1], ids[20], 5, want_logits=True)
        again = hops[-1].mtp_draft(sids[-1], ids[20], 5, want_logits=True)
        assert first["drafts"] == again["drafts"]
        assert np.array_equal(first["logits"], again["logits"])
        assert hops[-1].snapshot(sids[-1]) == snap
        assert hops[-1].session_len(sids[-1]) == 20
    finally:
        close_sessions(hops, sids)


def _last_hop_with_block(gguf: str) -> NativeModel:
    """A fresh handle of the last window with its block attached: what a hand-off's target opens."""
    last = native_hops(gguf, [SPLITS[-1]], "f32")[0]
    last.mtp_open(gguf)
    return last


def _as_format_2(snap: bytes) -> bytes:
    """The same snapshot as format 2 wrote it (API v15 and before): the 184-byte header and the trunk's
    payload, no nextn trailer."""
    head = bytearray(snap[:184])
    head[8:16] = struct.pack("<II", 2, 184)
    (payload,) = struct.unpack_from("<Q", snap, 152)
    return bytes(head) + snap[200 : 200 + payload]


def test_a_snapshot_carries_the_block_state_so_a_restored_session_drafts_on(
    hops: list[NativeModel], gguf: str
) -> None:
    """API v16: the block's state travels in the snapshot's trailer. The last hop's snapshot restored
    into another handle (a hand-off's target) drafts exactly what the original drafts, there and after
    more positions; the other hops' snapshots carry none."""
    ids = [int(x) for x in np.random.default_rng(4).integers(100, 20000, 30)]
    a = open_sessions(hops)
    other = _last_hop_with_block(gguf)
    try:
        native_forward(hops, a, 0, ids[:20], False, True)
        snaps = [h.snapshot(s) for h, s in zip(hops, a, strict=True)]
        assert [struct.unpack_from("<II", x, 8) for x in snaps] == [(3, 200)] * 3
        trailers = [struct.unpack_from("<Q", x, 184)[0] for x in snaps]
        assert trailers[:2] == [0, 0] and trailers[2] > 0, trailers
        sb = other.open_session(64)
        other.restore(sb, snaps[-1])
        assert other.snapshot(sb) == snaps[-1]
        for at in (20, 22):
            want = hops[-1].mtp_draft(a[-1], ids[at], 3, want_logits=True)
            got = other.mtp_draft(sb, ids[at], 3, want_logits=True)
            assert got["drafts"] == want["drafts"]
            assert np.array_equal(got["logits"], want["logits"])
            hidden = native_forward(hops[:-1], a[:-1], at, ids[at : at + 2], False, True)["hidden"]
            for h, s in ((hops[-1], a[-1]), (other, sb)):
                h.forward(s, at, hidden=hidden, token_ids=np.asarray(ids[at : at + 2], dtype=np.int32))
    finally:
        close_sessions(hops, a)
        other.close()


def test_a_snapshot_without_the_block_state_restores_and_drafts_start_over(
    hops: list[NativeModel], gguf: str
) -> None:
    """A format-2 snapshot (no trailer) restores the trunk; the block cannot follow it (refused,
    GGSWARM_E_RANGE) until the session starts over from position 0. A trailer whose bytes were changed
    is refused and leaves the session as it was."""
    ids = [int(x) for x in np.random.default_rng(5).integers(100, 20000, 30)]
    a = open_sessions(hops)
    other = _last_hop_with_block(gguf)
    try:
        hidden = native_forward(hops[:-1], a[:-1], 0, ids[:20], False, True)["hidden"]
        tokens = np.asarray(ids[:20], dtype=np.int32)
        hops[-1].forward(a[-1], 0, hidden=hidden, token_ids=tokens)
        snap = hops[-1].snapshot(a[-1])
        sb = other.open_session(64)
        bad = bytearray(snap)
        bad[-1] ^= 1
        with pytest.raises(NativeError, match="trailer checksum"):
            other.restore(sb, bytes(bad))
        assert other.session_len(sb) == 0
        other.restore(sb, _as_format_2(snap))
        assert other.session_len(sb) == 20
        with pytest.raises(NativeError, match="has not followed"):
            other.mtp_draft(sb, ids[20], 2)
        other.truncate(sb, 0)
        other.forward(sb, 0, hidden=hidden, token_ids=tokens)
        want = hops[-1].mtp_draft(a[-1], ids[20], 2, want_logits=True)
        got = other.mtp_draft(sb, ids[20], 2, want_logits=True)
        assert np.array_equal(want["logits"], got["logits"])
    finally:
        close_sessions(hops, a)
        other.close()


def test_the_block_follows_the_trunk_back(hops: list[NativeModel]) -> None:
    """Positions the trunk computes and then drops (a verification cut short) leave the block as a
    session that never saw them: its drafts after are the same."""
    ids = [int(x) for x in np.random.default_rng(2).integers(100, 20000, 40)]
    plain, spec = open_sessions(hops), open_sessions(hops)
    try:
        native_forward(hops, plain, 0, ids[:30], False, True)
        native_forward(hops, spec, 0, ids[:26], False, True)
        native_forward(hops, spec, 26, [1, 2, 3, 4, 5, 6], False, True)  # 6 positions, then cut back
        for h, s in zip(hops, spec, strict=True):
            h.truncate_to(s, 26)
        native_forward(hops, spec, 26, ids[26:30], False, True)
        a = hops[-1].mtp_draft(plain[-1], ids[30], 3, want_logits=True)
        b = hops[-1].mtp_draft(spec[-1], ids[30], 3, want_logits=True)
        assert a["drafts"] == b["drafts"]
        assert np.array_equal(a["logits"], b["logits"])
        # drafting right after a cut, before any new call: the block goes back with the trunk
        close_sessions(hops, spec)
        spec = open_sessions(hops)
        native_forward(hops, spec, 0, ids[:28], False, True)
        for h, s in zip(hops, plain, strict=True):
            assert h.truncate_to(s, 28)[0] == 28, "the rings still hold position 28"
        a = hops[-1].mtp_draft(plain[-1], ids[28], 2, want_logits=True)
        b = hops[-1].mtp_draft(spec[-1], ids[28], 2, want_logits=True)
        assert np.array_equal(a["logits"], b["logits"])
    finally:
        close_sessions(hops, plain)
        close_sessions(hops, spec)


def test_drafts_after_a_verification_start_where_its_drafts_stood(hops: list[NativeModel]) -> None:
    """A verification's positions all run; drafting after the ones that stood (pos < the session's
    length) gives what a session that ran only those gives, and the next step goes on from there."""
    ids = [int(x) for x in np.random.default_rng(3).integers(100, 20000, 40)]
    plain, spec = open_sessions(hops), open_sessions(hops)
    try:
        native_forward(hops, plain, 0, ids[:22], False, True)
        native_forward(hops, spec, 0, ids[:20], False, True)
        native_forward(hops, spec, 20, [*ids[20:22], 7], False, True)  # 2 stood, 1 did not
        a = hops[-1].mtp_draft(plain[-1], ids[22], 3, want_logits=True)
        b = hops[-1].mtp_draft(spec[-1], ids[22], 3, want_logits=True, pos=22)
        assert a["drafts"] == b["drafts"]
        assert np.array_equal(a["logits"], b["logits"])
        for h, s in zip(hops, spec, strict=True):  # the next step cuts the trunk back (agent/node/verify.py)
            assert h.truncate_to(s, 22)[0] == 22, "the compressor rings still hold what 22 needs"
        native_forward(hops, plain, 22, ids[22:24], False, True)
        native_forward(hops, spec, 22, ids[22:24], False, True)
        a = hops[-1].mtp_draft(plain[-1], ids[24], 2, want_logits=True)
        b = hops[-1].mtp_draft(spec[-1], ids[24], 2, want_logits=True)
        assert np.array_equal(a["logits"], b["logits"])
        with pytest.raises(NativeError, match="holds 24"):
            hops[-1].mtp_draft(spec[-1], ids[24], 2, pos=25)
    finally:
        close_sessions(hops, plain)
        close_sessions(hops, spec)


def test_the_block_state_is_charged_to_the_budget_and_freed_with_the_session(
    native_lib: None, gguf: str
) -> None:
    budget = NativeBudget(64 << 20)
    whole = NativeModel(gguf, 0, 6, n_threads=2, budget=budget)
    try:
        whole.set_cache_type("f32")
        whole.mtp_open(gguf)
        sid = whole.open_session(512)
        whole.forward(sid, 0, token_ids=np.arange(100, 120, dtype=np.int32))
        assert budget.used > whole.kv_bytes(sid) > 0  # the block's state is charged beside the trunk's
        assert whole.mtp_draft(sid, 7, 2)["drafts"]
        whole.close_session(sid)
        assert budget.used == 0
    finally:
        whole.close()
        budget.close()


def test_refusals(native_lib: None, gguf: str, tmp_path: Path) -> None:
    first = NativeModel(gguf, 0, 2, n_threads=1)
    try:
        with pytest.raises(NativeError, match="last window"):
            first.mtp_open(gguf)
    finally:
        first.close()
    plain = str(write_tiny_gguf("deepseek4", tmp_path / "no-mtp.gguf", indexer_key_length=128))
    last = NativeModel(plain, 4, 6, n_threads=1)
    try:
        with pytest.raises(NativeError, match="nextn_predict_layers"):
            last.mtp_open(plain)
    finally:
        last.close()
    whole = NativeModel(gguf, 0, 6, n_threads=1)
    try:
        sid = whole.open_session(64)
        with pytest.raises(NativeError, match="before opening sessions"):
            whole.mtp_open(gguf)
        whole.close_session(sid)
        whole.mtp_open(gguf)
        sid = whole.open_session(64)
        with pytest.raises(NativeError, match="n_draft"):
            whole.mtp_draft(sid, 1, 16)
        whole.forward(sid, 0, token_ids=np.arange(100, 110, dtype=np.int32))
        assert len(whole.mtp_draft(sid, 1, 15)["drafts"]) == 15
    finally:
        whole.close()
