"""The conformance suite's state half: for every architecture of agent/artifacts/archtable.py, what a
route does with a session's state keeps the logits a fresh session would give. An edited turn goes back
(each hop as far as its state allows: exactly, to a checkpoint, or from zero) and continues like a
fresh prefill; every hop's snapshot continues identically in another process; sessions batched into
one graph (where the row says the architecture batches) get the tokens each gets alone. The C table
holds exactly the rows and their aliases."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts import archs, archtable, layouts
from agent.backends.base import Backend
from tests.native.archcases import (
    CASES,
    MAX_LOGIT_DIFF,
    TEXT,
    Case,
    backend_hops,
    close_route,
    open_route,
    sid_of,
)
from tests.native.routes import here_and_in_another_process, native_hops, route_forward, truncate_route

pytestmark = pytest.mark.slow

TINY = [c for c in CASES if c.tiny]


@pytest.fixture(scope="module", params=TINY, ids=[c.name for c in TINY])
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


@pytest.fixture(scope="module")
def gguf(case: Case, tmp_path_factory: pytest.TempPathFactory) -> str:
    return case.model(tmp_path_factory.mktemp(case.name))


@pytest.fixture(scope="module")
def hops(native_lib: None, case: Case, gguf: str) -> Iterator[list[Backend]]:
    models = backend_hops(gguf, case.splits)
    yield models
    for m in models:
        m.close()


@pytest.fixture(scope="module")
def text_ids(gguf: str) -> list[int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=64, vocab_only=True, verbose=False)
    try:
        ids = list(llm.tokenize(TEXT.read_bytes(), add_bos=True))[:320]
    finally:
        llm.close()
    assert len(ids) >= 300
    return ids


def _prefill(hops: list[Backend], sid: object, cuts: list[int], ids: list[int]) -> np.ndarray:
    """ids fed in chunks ending at `cuts`; the logits of the last chunk."""
    start, out = 0, np.zeros(0)
    for end in [*cuts, len(ids)]:
        if end > start:
            out = route_forward(hops, sid, start, ids[start:end], history=ids[:end], want_logits=True).logits  # type: ignore[arg-type]
            start = end
    return out


def test_an_edited_turn_continues_like_a_fresh_prefill(
    case: Case, hops: list[Backend], text_ids: list[int]
) -> None:
    """Turn 1 (150 tokens), turn 2 (80), then turn 2 rewritten after its 30th token: every hop goes back
    as its state allows (K/V rows exactly; recurrent, ring and compressed states to a checkpoint) and
    the route re-feeds from there."""
    turn1, turn2 = text_ids[:150], text_ids[150:230]
    history = turn1 + text_ids[150:180] + text_ids[240:290]
    sid = sid_of(40)
    open_route(hops, sid)
    try:
        _prefill(hops, sid, [150], turn1 + turn2)
        held, kinds = truncate_route([(h, sid) for h in hops], 180)
        assert 0 <= held <= 180 and all(k in ("exact", "checkpoint", "from_zero") for k in kinds), kinds
        got = route_forward(hops, sid, held, history[held:], history=history, want_logits=True).logits
    finally:
        close_route(hops, sid)
    sid = sid_of(41)
    open_route(hops, sid)
    try:
        fresh = _prefill(hops, sid, sorted({c for c in (150, held) if c <= held}), history)
    finally:
        close_route(hops, sid)
    agree = float((got.argmax(1) == fresh.argmax(1)).mean())
    diff = float(np.abs(got - fresh).max())
    print(
        f"\n{case.name}: edited at 180, went back to {held} ({kinds}); top-1 {agree:.4f}, max diff {diff:.3g}"
    )
    # exact for every row so far (0.0), chunk-exact or not: the fresh session is fed in the same chunks
    assert diff <= MAX_LOGIT_DIFF


def test_every_hops_snapshot_continues_identically_in_another_process(
    native_lib: None, case: Case, gguf: str, tmp_path: Path
) -> None:
    """Every state kind the architecture keeps (K/V, latent rows, recurrent and compressor states,
    rings) moves to a fresh process intact: the same 8 greedy tokens and logits there."""
    prompt = [int(t) for t in np.random.default_rng(5).integers(1, 200, 150)]
    hops = native_hops(gguf, list(case.splits))
    try:
        ids_everywhere = archtable.family(case.arch) == archtable.DSV4  # hash-routed layers read the ids
        here, there = here_and_in_another_process(
            gguf, hops, list(case.splits), prompt, tmp_path, ids_everywhere=ids_everywhere
        )
    finally:
        for h in hops:
            h.close()
    assert here == there


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


# Products over more rows take other ggml kernels (f32: the tiled one; gpt-oss's MXFP4 experts with
# several single-token rows): batched logits differ a little from alone, relative to the logits' scale.
# Observed (AVX-512) max |diff|: llama 1.6e-3, qwen3 4.9e-3, gemma3 2.4e-3 past its 32-position window,
# qwen3moe 7.1e-3, glm4moe 6.3e-3, minimax-m2 7.0e-3, gpt-oss 0.31 on logits of magnitude ~37 (0.8%;
# exact on the batched prefill, from the decode steps on; the routers amplify it). Tokens moved once, on
# AVX2 builds of both ggml copies (2026-12-06): gpt-oss's, at a near tie (alone's pick ahead by 6.8e-4,
# the logits 0.053 apart at that step), so a token may turn only where the margin is within that.
BATCHED_RELATIVE_TOL = 1e-2
STEPS = 40


def test_sessions_batched_get_the_tokens_each_gets_alone_and_batch_as_declared(
    native_lib: None, case: Case, gguf: str
) -> None:
    """Four sessions of different prompt lengths, teacher-forced 40 steps together and alone: the same
    tokens but at near ties; one graph for all of them where the row declares `batches`, else one after another and
    exactly as alone."""
    from agent.backends.libggswarm import NativeModel

    row = archtable.BY_NAME[case.arch]
    m = NativeModel(gguf, 0, archtable.suite_layers(row), n_threads=2)
    try:
        assert m.batches_sessions is row.batches
        prompts = [[(31 * i + 7 * k) % 90 + 3 for k in range(n)] for i, n in enumerate((5, 17, 9, 3))]
        alone: list[Run] = []
        for p in prompts:
            sid, run, ids, pos = m.open_session(256), Run(), p, 0
            for _ in range(STEPS):
                out = m.forward(sid, pos, token_ids=np.asarray(ids), want_logits=True)
                run.tokens.append(out["token"])
                run.logits.append(out["logits"][-1].copy())
                pos, ids = pos + len(ids), [out["token"]]
            m.close_session(sid)
            alone.append(run)
        sids = [m.open_session(256) for _ in prompts]
        pos = [0] * len(prompts)
        diff, same, scale = 0.0, True, max(float(np.abs(x).max()) for r in alone for x in r.logits)
        turned: list[tuple[int, int, float, float]] = []
        for t in range(STEPS):
            feed = [p if t == 0 else [alone[i].tokens[t - 1]] for i, p in enumerate(prompts)]
            outs = m.forward_many(
                [
                    {"sid": sids[i], "pos_start": pos[i], "token_ids": np.asarray(f), "want_logits": True}
                    for i, f in enumerate(feed)
                ]
            )
            for i, o in enumerate(outs):
                assert isinstance(o, dict), o
                want, got = alone[i].logits[t], o["logits"][-1]
                step_diff = float(np.max(np.abs(got - want)))
                diff = max(diff, step_diff)
                if o["token"] != alone[i].tokens[t]:
                    # only a near tie may turn: alone's pick ahead of the batched one by no more than
                    # the two runs' logits moved apart at that step (teacher-forced: nothing cascades)
                    margin = float(want[alone[i].tokens[t]] - want[o["token"]])
                    turned.append((i, t, margin, step_diff))
                    same = same and margin <= 2 * step_diff
                pos[i] += len(feed[i])
        print(
            f"\n{case.name}: batched in one graph {m.batches_sessions}, max |logit diff| {diff:.3g}"
            f" (logits up to {scale:.3g}); tokens turned at near ties (session, step, margin, diff): {turned}"
        )
        assert same
        assert diff <= (BATCHED_RELATIVE_TOL * scale if row.batches else 0.0)
    finally:
        m.close()


def test_the_c_table_holds_exactly_the_declared_architectures(native_lib: None, tmp_path: Path) -> None:
    """A file of an architecture nobody declared is refused, naming what the executor runs: the C
    table's names, which are the Python table's rows."""
    from gguf import GGUFWriter

    from agent.backends.libggswarm import NativeError, NativeModel

    path = tmp_path / "unknown.gguf"
    w = GGUFWriter(str(path), "not-an-architecture")
    w.add_block_count(1)
    layouts.write_file(w)
    with pytest.raises(NativeError, match="not-an-architecture") as e:
        NativeModel(str(path), 0, 1, n_threads=1)
    listed = re.search(r"supported: ([^)]*)\)", str(e.value))
    assert listed is not None, str(e.value)
    assert set(listed.group(1).split(", ")) == archs.SERVABLE_ARCHITECTURES  # the rows and their aliases
