"""Continuous batching: several sessions' steps in one libggswarm graph give each session its own tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import Manifest
from agent.backends.base import BackendError, ForwardResult, ShardSpec, StepInput
from agent.backends.native import NativeBackend
from agent.wire.ids import SessionId

# eight prompts of mixed lengths; session LATE's prompt arrives at decode step LATE_AT, in the same
# batch as the others' one-token steps; sessions in CLOSE_AFTER stop (and are closed) early
LENGTHS = (5, 17, 9, 31, 3, 12, 24, 7)
LATE, LATE_AT = 7, 4
CLOSE_AFTER = {1: 6, 4: 10}
STEPS = 16
SPLITS = ((0, 10), (10, 20), (20, 30))
# |logit| difference allowed between a batched step and the same step run alone (docs/native.md,
# "Continuous batching": matrix products over more rows may take other ggml kernels)
LOGIT_TOL = 2e-3


def _prompt(i: int) -> list[int]:
    return [(97 * i + 31 * k) % 40000 + 200 for k in range(LENGTHS[i])]


def _sid(i: int) -> SessionId:
    return SessionId(bytes([i + 1]) * 16)


@dataclass
class Run:
    """What one session produced: its generated tokens and, per step, the final position's logits."""

    tokens: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


def _whole(model_path: str, manifest: Manifest) -> NativeBackend:
    return NativeBackend(ShardSpec(model_path, 0, 30, manifest, n_threads=2))


@pytest.fixture(scope="module")
def alone(native_lib: None, model_path: str, manifest: Manifest) -> dict[int, Run]:
    """Each session run alone, step by step, through forward() on the whole model."""
    be = _whole(model_path, manifest)
    runs: dict[int, Run] = {}
    for i in range(len(LENGTHS)):
        sid, run, ids, pos = _sid(i), Run(), _prompt(i), 0
        be.open_session(sid, 256)
        for _ in range(CLOSE_AFTER.get(i, STEPS)):
            r = be.forward(StepInput(sid, pos, token_ids=np.asarray(ids), want_logits=True))
            assert r.token is not None and r.logits is not None
            run.tokens.append(r.token)
            run.logits.append(r.logits[-1].copy())
            pos += len(ids)
            ids = [r.token]
        be.close_session(sid)
        runs[i] = run
    be.close()
    return runs


def _batched(stages: list[NativeBackend]) -> tuple[dict[int, Run], list[int]]:
    """All sessions decoded together through forward_batch on the stages (hidden rows passed on);
    returns the runs and the total KV bytes of the first stage after each early close."""
    runs = {i: Run() for i in range(len(LENGTHS))}
    pending = {i: _prompt(i) for i in range(len(LENGTHS))}
    pos = dict.fromkeys(range(len(LENGTHS)), 0)
    active: list[int] = []
    kv_after_close: list[int] = []
    for t in range(STEPS + LATE_AT):
        for i in range(len(LENGTHS)):
            if i not in active and not runs[i].tokens and (i != LATE or t == LATE_AT):
                for st in stages:
                    st.open_session(_sid(i), 256)
                active.append(i)
        if not active:
            break
        hidden: list[np.ndarray | None] = [None] * len(active)
        results: list[ForwardResult | BackendError] = []
        for k, st in enumerate(stages):
            steps = [
                StepInput(
                    _sid(i),
                    pos[i],
                    token_ids=np.asarray(pending[i]) if k == 0 else None,
                    hidden=hidden[j],
                    want_logits=k == len(stages) - 1,
                )
                for j, i in enumerate(active)
            ]
            results = st.forward_batch(steps)
            for j, r in enumerate(results):
                assert isinstance(r, ForwardResult), f"session {active[j]}: {r}"
                hidden[j] = r.hidden
        for j, i in enumerate(list(active)):
            r = results[j]
            assert isinstance(r, ForwardResult) and r.token is not None and r.logits is not None
            runs[i].tokens.append(r.token)
            runs[i].logits.append(r.logits[-1].copy())
            pos[i] += len(pending[i])
            pending[i] = [r.token]
            if len(runs[i].tokens) == CLOSE_AFTER.get(i, STEPS):
                before = stages[0].kv_bytes()
                for st in stages:
                    st.close_session(_sid(i))
                active.remove(i)
                if i in CLOSE_AFTER:
                    assert stages[0].kv_bytes() < before  # its KV is freed at once
                    kv_after_close.append(stages[0].kv_bytes())
    return runs, kv_after_close


def _max_diff(a: dict[int, Run], b: dict[int, Run]) -> float:
    return max(float(np.max(np.abs(x - y))) for i in a for x, y in zip(a[i].logits, b[i].logits, strict=True))


@pytest.fixture
def whole(native_lib: None, model_path: str, manifest: Manifest) -> Iterator[NativeBackend]:
    be = _whole(model_path, manifest)
    yield be
    be.close()


def test_smollm2_batches_sessions_in_one_graph(whole: NativeBackend) -> None:
    assert whole.batches_sessions and whole.model.batches_sessions


def test_eight_sessions_decoded_together_give_each_the_tokens_it_gets_alone(
    whole: NativeBackend, alone: dict[int, Run]
) -> None:
    got, freed = _batched([whole])
    assert len(freed) == len(CLOSE_AFTER)
    for i in range(len(LENGTHS)):
        assert got[i].tokens == alone[i].tokens, f"session {i}"
    diff = _max_diff(got, alone)
    print(f"max |logit diff| batched vs alone (whole model): {diff:.3g}")
    assert diff <= LOGIT_TOL


def test_eight_sessions_batched_through_three_windows_give_the_tokens_of_one_alone(
    native_lib: None, model_path: str, manifest: Manifest, alone: dict[int, Run]
) -> None:
    stages = [NativeBackend(ShardSpec(model_path, a, b, manifest, n_threads=2)) for a, b in SPLITS]
    try:
        assert all(st.batches_sessions for st in stages)
        got, _ = _batched(stages)
    finally:
        for st in stages:
            st.close()
    for i in range(len(LENGTHS)):
        assert got[i].tokens == alone[i].tokens, f"session {i}"
    diff = _max_diff(got, alone)
    print(f"max |logit diff| batched over 3 windows vs alone: {diff:.3g}")
    assert diff <= LOGIT_TOL


def test_a_batched_step_with_invalid_members_fails_only_those(
    whole: NativeBackend, alone: dict[int, Run]
) -> None:
    for i in range(3):
        whole.open_session(_sid(i), 256)
    steps = [
        StepInput(_sid(0), 0, token_ids=np.asarray(_prompt(0))),
        StepInput(_sid(1), 5, token_ids=np.asarray(_prompt(1))),  # does not follow its 0 positions
        StepInput(_sid(9), 0, token_ids=np.asarray([1, 2])),  # never opened
        StepInput(_sid(2), 0, token_ids=np.asarray(_prompt(2))),
        StepInput(_sid(0), 0, token_ids=np.asarray(_prompt(0))),  # the same session twice
    ]
    out = whole.forward_batch(steps)
    assert isinstance(out[1], BackendError) and "pos_start 5" in str(out[1])
    assert isinstance(out[2], BackendError) and "unknown session" in str(out[2])
    assert isinstance(out[4], BackendError) and "already step 0" in str(out[4])
    for k, i in ((0, 0), (3, 2)):
        r = out[k]
        assert isinstance(r, ForwardResult) and r.token == alone[i].tokens[0]
    # the failed step left its session untouched: it still starts at 0
    assert whole.session_len(_sid(1)) == 0
    assert [whole.session_len(_sid(i)) for i in (0, 2)] == [LENGTHS[0], LENGTHS[2]]
    r1 = whole.forward_batch([StepInput(_sid(1), 0, token_ids=np.asarray(_prompt(1)))])[0]
    assert isinstance(r1, ForwardResult) and r1.token == alone[1].tokens[0]


# gemma3 (tiny, q8_0 weights, which ggml multiplies with llamafile's tiled kernels, as the real 270M's
# Q5_0 and Q8_0 tensors): sliding-window layers (32 positions) and products whose per-element sums may
# depend on how many rows they have, as in llama.cpp; so batching may change the logits by float rounding.
# Two prompts start past the window and one crosses it during the steps; their prefills (without logits)
# and steps run as one batch through the backend's forward_batch. Teacher-forced, so one flipped token
# does not carry on: top-1 agreement and the largest difference are bounded, at positions past the window.
GEMMA_LENGTHS = (50, 35, 20)
GEMMA_STEPS = 16
GEMMA_TOP1 = 0.9
GEMMA_LOGIT_TOL = 2e-2


def test_gemma3_sessions_past_the_sliding_window_batched_track_the_same_steps_alone(
    native_lib: None, tmp_path: Path
) -> None:
    from agent.artifacts.manifest import build_manifest
    from agent.artifacts.tiny import write_tiny_gguf
    from tests.native.tiny_gguf import write_small_tokenizer

    # a 512-token tokenizer (no tokenizer reads the file; SmolLM2's 49k tokens cost the manifest 2 s)
    tokenizer = write_small_tokenizer(tmp_path / "tokenizer.gguf", 512)
    path = str(write_tiny_gguf("gemma3", tmp_path / "gemma3.gguf", dtype="q8_0", tokenizer_from=tokenizer))
    man = build_manifest(path)
    be = NativeBackend(ShardSpec(path, 0, man.n_layers, man, n_threads=2))
    try:
        assert be.batches_sessions
        prompts = [[(97 * i + 31 * k) % 500 + 3 for k in range(n)] for i, n in enumerate(GEMMA_LENGTHS)]
        # each prompt but its last position goes first without logits, alone and batched alike
        alone: list[Run] = []
        for i, p in enumerate(prompts):
            sid, run, ids, pos = _sid(i), Run(), p[-1:], len(p) - 1
            be.open_session(sid, 1024)
            be.forward(StepInput(sid, 0, token_ids=np.asarray(p[:-1])))
            for _ in range(GEMMA_STEPS):
                r = be.forward(StepInput(sid, pos, token_ids=np.asarray(ids), want_logits=True))
                assert r.token is not None and r.logits is not None
                run.tokens.append(r.token)
                run.logits.append(r.logits[-1].copy())
                pos, ids = pos + len(ids), [r.token]
            be.close_session(sid)
            alone.append(run)
        got = [Run() for _ in prompts]
        for i in range(len(prompts)):
            be.open_session(_sid(i), 1024)
        be.forward_batch([StepInput(_sid(i), 0, token_ids=np.asarray(p[:-1])) for i, p in enumerate(prompts)])
        pos = [len(p) - 1 for p in prompts]
        prompts = [p[-1:] for p in prompts]
        for t in range(GEMMA_STEPS):
            feed = [p if t == 0 else [alone[i].tokens[t - 1]] for i, p in enumerate(prompts)]
            out = be.forward_batch(
                [
                    StepInput(_sid(i), pos[i], token_ids=np.asarray(f), want_logits=True)
                    for i, f in enumerate(feed)
                ]
            )
            for i, r in enumerate(out):
                assert isinstance(r, ForwardResult) and r.logits is not None, r
                got[i].logits.append(r.logits[-1].copy())
                pos[i] += len(feed[i])
        pairs = [
            (x, y) for g, a in zip(got, alone, strict=True) for x, y in zip(g.logits, a.logits, strict=True)
        ]
        top1 = float(np.mean([int(np.argmax(x)) == int(np.argmax(y)) for x, y in pairs]))
        diff = max(float(np.max(np.abs(x - y))) for x, y in pairs)
        print(f"gemma3 batched vs alone, teacher-forced: top-1 {top1:.3f}, max |logit diff| {diff:.3g}")
        assert top1 >= GEMMA_TOP1
        assert diff <= GEMMA_LOGIT_TOL
    finally:
        be.close()


def test_batched_hidden_rows_come_back_in_the_asked_dtype_as_alone(
    native_lib: None, model_path: str, manifest: Manifest
) -> None:
    first = NativeBackend(ShardSpec(model_path, 0, 10, manifest, n_threads=2))
    mid = NativeBackend(ShardSpec(model_path, 10, 20, manifest, n_threads=2))
    try:
        want = []
        for i in range(2):
            for be in (first, mid):
                be.open_session(_sid(i), 64)
            h = first.forward(
                StepInput(_sid(i), 0, token_ids=np.asarray(_prompt(i)), hidden_dtype="f16")
            ).hidden
            want.append(mid.forward(StepInput(_sid(i), 0, hidden=h, hidden_dtype="f16")).hidden)
            for be in (first, mid):
                be.close_session(_sid(i))
        for i in range(2):
            for be in (first, mid):
                be.open_session(_sid(i), 64)
        steps = [
            StepInput(_sid(i), 0, token_ids=np.asarray(_prompt(i)), hidden_dtype="f16") for i in range(2)
        ]
        hs = [r.hidden for r in first.forward_batch(steps) if isinstance(r, ForwardResult)]
        got = mid.forward_batch([StepInput(_sid(i), 0, hidden=hs[i], hidden_dtype="f16") for i in range(2)])
        for i, r in enumerate(got):
            assert isinstance(r, ForwardResult) and r.hidden is not None and want[i] is not None
            assert r.hidden.dtype == np.float16 and r.hidden.shape == (LENGTHS[i], manifest.boundary_dim)
            assert np.array_equal(r.hidden, want[i])
    finally:
        first.close()
        mid.close()
