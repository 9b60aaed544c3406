"""The C sampler (ggswarm_sample) picks exactly what agent/backends/sampling.py picks."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from agent.backends import libggswarm as native
from agent.backends.sampling import sample as reference_sample
from agent.backends.sampling import uniform
from agent.wire.sampling import SamplingParams

PARAM_SETS = [
    SamplingParams(**kw)
    for kw in [
        {},
        {"repeat_penalty": 1.3, "repeat_last_n": 8},
        {"temperature": 0.7},
        {"temperature": 1.0, "seed": 42},
        {"temperature": 1.3, "top_k": 40, "seed": 7},
        {"temperature": 0.8, "top_p": 0.9, "seed": 123},
        {"temperature": 0.9, "min_p": 0.05, "seed": 5},
        {"temperature": 1.1, "top_k": 50, "top_p": 0.95, "min_p": 0.02, "seed": 2**63 + 11},
        {"temperature": 0.6, "top_p": 0.5, "repeat_penalty": 1.15, "repeat_last_n": -1, "seed": 99},
        {"temperature": 2.0, "top_k": 1, "seed": 3},
        {"temperature": 1.0, "top_p": 0.0, "seed": 4},
        {"temperature": 1.0, "min_p": 1.0, "seed": 8},
        {"temperature": 5.0, "top_k": 3, "repeat_penalty": 0.8, "repeat_last_n": 0, "seed": 77},
    ]
]


# The library sums the vocabulary's exponentials in float (sampler.cpp log_softmax_at); the reference
# does it in double. A token's log-probability then differs by ~1e-7.
LOGPROB_ABS_TOL = 1e-6


def _log_softmax64(x: np.ndarray, token: int) -> float:
    x64 = x.astype(np.float64)
    m = x64[np.isfinite(x64)].max() if np.isfinite(x64).any() else -np.inf
    return float(x64[token] - m - np.log(np.exp(x64 - m).sum()))


def _c_params(p: SamplingParams) -> native.ggswarm_sampling:
    return native.sampling_struct(
        p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n, p.seed
    )


def test_uniform_draw_matches_the_reference_splitmix(native_lib: None) -> None:
    # greedy-free single-candidate distributions expose u through the picked index
    for seed, pos in itertools.product([0, 1, 2**64 - 1, 1234567], [0, 1, 17, 4095, 2**40]):
        u = uniform(seed, pos)
        probs = np.log(np.full(1000, 1.0 / 1000, dtype=np.float32))
        tok, _ = native.sample(probs, _c_params(SamplingParams(temperature=1.0, seed=seed)), pos)
        assert tok == min(int(u * 1000), 999) or abs(u * 1000 - round(u * 1000)) < 1e-9


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_c_sampler_picks_the_same_tokens_as_agent_sampling(native_lib: None, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    trials = 40 if vocab < 49152 else 6
    mismatches = []
    for p in PARAM_SETS:
        for t in range(trials):
            scale = [1.0, 3.0, 10.0][t % 3]
            logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
            if t % 5 == 0:
                logits[rng.integers(0, vocab, 3)] = logits.max()  # exact ties
            history = [int(x) for x in rng.integers(0, vocab, int(rng.integers(0, 100)))]
            position = int(rng.integers(0, 1 << 20))
            want_tok, want_lp = reference_sample(logits, p, position=position, history=history)
            got_tok, got_lp = native.sample(logits, _c_params(p), position, history)
            if got_tok != want_tok:
                mismatches.append((p, t, want_tok, got_tok))
            assert got_lp == pytest.approx(want_lp, abs=LOGPROB_ABS_TOL)
    assert not mismatches, f"{len(mismatches)} picks differ, first: {mismatches[0]}"


def test_c_sampler_rejects_bad_arguments_without_crashing(native_lib: None) -> None:
    with pytest.raises(native.NativeError):
        native.sample(np.zeros(0, dtype=np.float32), _c_params(SamplingParams()), 0)


def test_the_backend_passes_the_sampler_only_the_history_it_reads(native_lib: None) -> None:
    """NativeBackend hands the library the tail of a session's history that the repetition penalty
    reads (not the whole context on every decode step); the sampler picks the same token either way."""
    from agent.backends.native import _penalised

    rng = np.random.default_rng(3)
    vocab = 1000
    history = rng.integers(0, vocab, 600).tolist()
    for p in PARAM_SETS:
        kept = _penalised(history, p)
        if p.repeat_penalty == 1.0 or p.repeat_last_n == 0:
            assert kept is None
        else:
            assert kept == (history[-p.repeat_last_n :] if p.repeat_last_n > 0 else history)
        for pos in range(20):
            logits = (rng.standard_normal(vocab) * 3).astype(np.float32)
            logits[history[-5:]] += 4.0  # recent tokens lead: the penalty decides
            full = native.sample(logits, _c_params(p), pos, history)
            tail = native.sample(logits, _c_params(p), pos, kept)
            assert tail == full, (p, pos)


def test_greedy_takes_the_first_of_tied_maxima_wherever_they_sit(native_lib: None) -> None:
    """The greedy pick runs in blocks of 1,024 values and lanes of 16 (sampler.cpp argmax_first): ties
    across block and lane edges and in the ragged tail, all -inf, and NaN give what a plain scan with
    `>` gives (a NaN never wins, except at index 0, where the scan keeps it)."""
    greedy = _c_params(SamplingParams(temperature=0.0))
    rng = np.random.default_rng(7)
    for n in (1, 15, 16, 17, 1023, 1024, 1025, 3000, 49152, 151936):
        for first, second in ((0, n - 1), (n - 1, 0), (n // 2, n // 3), (min(1023, n - 1), min(1024, n - 1))):
            x = rng.standard_normal(n).astype(np.float32)
            x[[first, second]] = 9.0
            assert native.sample(x, greedy, 0)[0] == min(first, second)
    x = np.full(3000, -np.inf, dtype=np.float32)
    assert native.sample(x, greedy, 0)[0] == 0
    x[2500] = -1e30
    assert native.sample(x, greedy, 0)[0] == 2500
    x = rng.standard_normal(3000).astype(np.float32)
    x[[5, 2000]] = np.nan
    assert native.sample(x, greedy, 0)[0] == int(np.nanargmax(x))
    x[0] = np.nan
    assert native.sample(x, greedy, 0)[0] == 0


def test_the_logprob_is_the_double_log_softmax_at_any_length_spread_and_masking(native_lib: None) -> None:
    """log_softmax_at runs in lanes of 8 over blocks of 512 with its own float exp: lengths around those
    edges, logits spread far past exp's float range (terms below e^-87 count as 0), masked (-inf)
    entries, the most and the least likely token all agree with the double-precision log-softmax."""
    greedy = _c_params(SamplingParams(temperature=0.0))
    rng = np.random.default_rng(11)
    for n in (1, 7, 8, 9, 511, 512, 513, 4099, 49152, 151936):
        for scale in (0.5, 4.0, 40.0):
            x = (rng.standard_normal(n) * scale).astype(np.float32)
            if n > 8:
                x[rng.integers(0, n, n // 8)] = -np.inf
            tok, lp = native.sample(x, greedy, 0)
            assert tok == int(np.argmax(x))
            assert lp == pytest.approx(_log_softmax64(x, tok), abs=LOGPROB_ABS_TOL), (n, scale)
            # the least likely finite token, through a sampled pick's path: its logprob as well
            low = int(np.argmin(np.where(np.isfinite(x), x, np.inf)))
            one = _c_params(SamplingParams(temperature=1.0, top_k=1))
            x2 = x.copy()
            x2[low] = np.float32(x.max() + 1.0)  # now the only candidate top_k=1 keeps
            tok2, lp2 = native.sample(x2, one, 0)
            assert tok2 == low
            assert lp2 == pytest.approx(_log_softmax64(x2, low), abs=LOGPROB_ABS_TOL), (n, scale)
    x = np.full(100, -np.inf, dtype=np.float32)
    x[42] = 3.0
    assert native.sample(x, greedy, 0) == (42, 0.0)
    x[7] = np.nan
    assert np.isnan(native.sample(x, greedy, 0)[1])


def test_a_last_windows_logprob_is_the_log_softmax_of_the_logits_it_returns(
    native_lib: None, tmp_path: Path
) -> None:
    """The forward call's logprob (computed from the host logits, not a graph softmax) agrees with the
    log-softmax of the very logits it hands back, at every decode step."""
    from agent.artifacts.tiny import write_tiny_gguf
    from agent.backends.libggswarm import NativeModel

    path = str(write_tiny_gguf("llama", tmp_path / "llama.gguf", n_layers=2))
    m = NativeModel(path, 0, 2, n_threads=2)
    try:
        sid = m.open_session(64)
        ids, pos = [1, 5, 9, 2], 0
        for _ in range(6):
            out = m.forward(sid, pos, token_ids=np.asarray(ids, dtype=np.int32), want_logits=True)
            last = out["logits"][-1]
            assert out["token"] == int(np.argmax(last))
            assert out["logprob"] == pytest.approx(_log_softmax64(last, out["token"]), abs=LOGPROB_ABS_TOL)
            pos, ids = pos + len(ids), [out["token"]]
    finally:
        m.close()
