"""DeepSeek-V4's session state held as llama.cpp holds it: the raw window in a ring of
GGML_PAD(n_swa + n_ubatch, 256) slots, the compressor and indexer rows in rings of the last blocks, the
compressed caches per block. Past the ring's wrap the 3 hops still agree with llama.cpp; the bytes a
session holds are the rings plus the blocks, not a row per position; a snapshot taken after the wrap
continues identically in another process; a retried step goes back exactly, an edit further back than the
rings reach goes to a checkpoint (or to 0), and either way the continuation is a fresh prefill's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.tiny import deepseek4_compress_ratios, write_tiny_gguf
from agent.backends.libggswarm import NativeError, NativeModel
from agent.backends.native import CHECKPOINT_EVERY, CHECKPOINTS_MAX
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
SPLITS = [(0, 2), (2, 4), (4, 6)]
RAW_RING = 768  # the tiny file: pad256(16 + 512)
N_LONG = 860  # past the raw ring's wrap
MAX_LOGIT_DIFF = 1e-3  # f32 caches on both sides (test_deepseek4.py says why)
D_HEAD, D_INDEX = 64, 64  # the tiny file's head and indexer key lengths

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_gguf("deepseek4", tmp_path_factory.mktemp("ds4-state") / "deepseek4.gguf"))


@pytest.fixture(scope="module")
def hops(native_lib: None, gguf: str) -> Iterator[list[NativeModel]]:
    models = native_hops(gguf, SPLITS, "f32")  # as llama.cpp below, so the logits agree tightly
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def llama(gguf: str):  # noqa: ANN201
    llm = llama_with_cache(gguf, "f32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ids(llama) -> list[int]:  # noqa: ANN001
    got = list(llama.tokenize(b"\n\n".join(t.read_bytes() for t in TEXTS), add_bos=False))
    assert len(got) >= N_LONG
    return got[:N_LONG]


def test_three_hops_agree_with_llama_cpp_past_the_raw_rings_wrap(
    hops: list[NativeModel],
    llama,  # noqa: ANN001
    ids: list[int],
) -> None:
    llama.reset()
    llama.eval(ids)
    ref = np.asarray(llama.scores[:N_LONG], dtype=np.float32)
    sids = open_sessions(hops)
    try:
        got = logits_rows(native_forward(hops, sids, 0, ids, ids_everywhere=True), N_LONG)
    finally:
        close_sessions(hops, sids)
    sids = open_sessions(hops)
    try:  # decode steps across the ring's slots too
        native_forward(hops, sids, 0, ids[: N_LONG - 40], logits=False, ids_everywhere=True)
        steps = [
            logits_rows(native_forward(hops, sids, p, [ids[p]], ids_everywhere=True), 1)[0]
            for p in range(N_LONG - 40, N_LONG)
        ]
    finally:
        close_sessions(hops, sids)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    diff = float(np.abs(got[RAW_RING:] - ref[RAW_RING:]).max())
    print(f"\ndeepseek4 {N_LONG} positions: top-1 {agree:.4f}, max |logit diff| after the wrap {diff:.3g}")
    assert agree >= 0.995
    assert float(np.abs(got - ref).max()) <= MAX_LOGIT_DIFF
    assert float(np.abs(np.asarray(steps) - ref[N_LONG - 40 :]).max()) <= MAX_LOGIT_DIFF


def _expected_bytes(layers: range, n: int, cap: int, k_bytes: int = 4) -> int:
    """Rings (raw, compressor and indexer rows) plus per-block entries, as the docstring says: the K
    caches (raw ring, entries) in the cache type (`k_bytes` per value), the compressor rows in f32."""
    ratios = deepseek4_compress_ratios(6)

    def entries(r: int) -> int:  # n_comp: every block of the capacity plus a scratch entry
        return cap // r + 1

    b = 0
    for il in layers:
        b += RAW_RING * D_HEAD * k_bytes
        if ratios[il] == 4:
            b += entries(4) * (D_HEAD + D_INDEX) * k_bytes + 8 * (2 * 2 * D_HEAD + 2 * 2 * D_INDEX) * 4
        elif ratios[il] == 128:
            b += entries(128) * D_HEAD * k_bytes + 128 * 2 * D_HEAD * 4
    return b


@pytest.mark.parametrize(("cache_type", "k_bytes"), [("f16", 2), ("f32", 4)])
def test_a_sessions_bytes_are_the_rings_and_the_blocks_not_a_row_per_position(
    gguf: str, cache_type: str, k_bytes: int
) -> None:
    with NativeModel(gguf, 0, 6, n_threads=2) as whole:
        whole.set_cache_type(cache_type)
        whole.set_checkpoints(0, 0)  # the state alone
        sid = whole.open_session(4096)
        native_forward([whole], [sid], 0, list(range(100, 100 + 1024)), logits=False, ids_everywhere=True)
        held = whole.kv_bytes(sid)
        want = _expected_bytes(range(6), 1024, 1024, k_bytes)
        # ggml pads each tensor to its buffer alignment: a few hundred bytes over 19 tensors
        assert want <= held <= want + 19 * 256
        # what a row per position took before: raw K and every compressor row, 1024 positions, f32
        per_position = 1024 * 4 * (6 * D_HEAD + 2 * (4 * D_HEAD + 4 * D_INDEX) + 2 * 2 * D_HEAD)
        assert held < per_position / 2


def test_the_cache_type_is_refused_while_a_session_is_open_and_f32_where_the_architecture_keeps_no_f32(
    gguf: str, tmp_path: Path
) -> None:
    with NativeModel(gguf, 0, 2, n_threads=1) as m:
        sid = m.open_session(64)
        with pytest.raises(NativeError, match="no session is open"):
            m.set_cache_type("f32")
        m.close_session(sid)
        m.set_cache_type("f32")
    qwen3 = write_tiny_gguf("qwen3", tmp_path / "qwen3.gguf")
    with (
        NativeModel(str(qwen3), 0, 4, n_threads=1) as m,
        pytest.raises(NativeError, match="in f16, q8_0, q4_0 in this build, not f32"),
    ):
        m.set_cache_type("f32")


def test_a_snapshot_after_the_wrap_continues_identically_in_another_process(
    gguf: str, hops: list[NativeModel], ids: list[int], tmp_path: Path
) -> None:
    here, there = here_and_in_another_process(
        gguf, hops, SPLITS, ids[:801], tmp_path, ids_everywhere=True, cache_type="f32"
    )
    assert [t for t, _ in there] == [t for t, _ in here]
    assert np.array_equal(np.asarray([lg for _, lg in there]), np.asarray([lg for _, lg in here]))


def _continue_after_truncate(
    hops: list[NativeModel], sids: list[int], target: int, history: list[int]
) -> tuple[list[tuple[int, str]], np.ndarray]:
    """Truncate every hop to `target`, re-prefill from where each landed (they land together), and
    return where they landed and the logits of history[target:]."""
    landed = [h.truncate_to(s, target) for h, s in zip(hops, sids, strict=True)]
    held = landed[0][0]
    assert all(n == held for n, _ in landed)
    got = logits_rows(
        native_forward(hops, sids, held, history[held:], ids_everywhere=True), len(history) - held
    )
    return landed, got[target - held :]


def _fresh(hops: list[NativeModel], history: list[int], start: int) -> np.ndarray:
    sids = open_sessions(hops)
    try:
        return logits_rows(native_forward(hops, sids, 0, history, ids_everywhere=True), len(history))[start:]
    finally:
        close_sessions(hops, sids)


@pytest.mark.parametrize(
    ("every", "first", "target", "landed", "kind"),
    [
        (256, 803, 802, 802, "exact"),  # a retried decode step: the rings still hold what 802 reads
        (256, 800, 797, 797, "exact"),  # a few positions back, inside the rings' reach
        (64, 803, 700, 640, "checkpoint"),  # an edit past the rings: the newest checkpoint before it
        (0, 803, 700, 0, "from_zero"),  # no checkpoint: as llama.cpp, from the start
    ],
    ids=["retried-step", "three-back", "edit-to-checkpoint", "edit-from-zero"],
)
def test_going_back_lands_where_the_rings_allow_and_continues_as_a_fresh_prefill(
    hops: list[NativeModel], ids: list[int], every: int, first: int, target: int, landed: int, kind: str
) -> None:
    history = ids[:target] + ids[30:60]
    for h in hops:
        h.set_checkpoints(every, 16)
    sids = open_sessions(hops)
    try:
        native_forward(hops, sids, 0, ids[: first - 1], logits=False, ids_everywhere=True)
        native_forward(hops, sids, first - 1, [ids[first - 1]], logits=False, ids_everywhere=True)  # a step
        where, got = _continue_after_truncate(hops, sids, target, history)
    finally:
        close_sessions(hops, sids)
        for h in hops:
            h.set_checkpoints(CHECKPOINT_EVERY, CHECKPOINTS_MAX)  # back to the defaults
    assert where == [(landed, kind)] * len(hops)
    assert float(np.abs(got - _fresh(hops, history, target)).max()) <= MAX_LOGIT_DIFF


def test_a_nodes_cache_type_reaches_its_native_shards_and_an_unsupported_one_is_refused_at_load(
    gguf: str, tmp_path: Path
) -> None:
    from agent.artifacts.manifest import build_manifest
    from agent.backends.base import BackendError, ShardSpec
    from agent.backends.native import NativeBackend

    spec = ShardSpec(gguf, 0, 2, build_manifest(gguf, hash_tensors=False), n_threads=1)
    sizes = {}
    for cache_type in ("f16", "f32"):
        be = NativeBackend(spec, cache_type=cache_type)
        try:
            sid = be.model.open_session(256)
            be.model.forward(sid, 0, token_ids=np.arange(100, 356, dtype=np.int32))
            sizes[cache_type] = be.model.kv_bytes(sid)
        finally:
            be.close()
    # layer 0 holds the raw ring, layer 1 also ratio-4 entries and f32 compressor rings: the K caches
    # double in f32, the rings of f32 rows do not
    assert sizes["f16"] < sizes["f32"] < 2 * sizes["f16"]
    qwen3 = str(write_tiny_gguf("qwen3", tmp_path / "qwen3.gguf"))
    qspec = ShardSpec(qwen3, 0, 4, build_manifest(qwen3, hash_tensors=False), n_threads=1)
    with pytest.raises(BackendError, match="not f32"):
        NativeBackend(qspec, cache_type="f32")
