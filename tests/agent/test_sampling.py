"""Reference sampling: greedy, filters, penalties, and draws that depend only on (seed, position)."""

from __future__ import annotations

import numpy as np

from agent.backends.sampling import apply_repeat_penalty, sample, uniform
from agent.wire.sampling import SamplingParams


def logits(seed: int = 0, n: int = 500) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=n).astype(np.float32) * 3


def test_greedy_picks_the_argmax_with_its_logprob() -> None:
    x = logits()
    tok, lp = sample(x, SamplingParams(), position=0)
    assert tok == int(np.argmax(x))
    ref = x.astype(np.float64)[tok] - np.log(np.exp(x.astype(np.float64)).sum())
    assert lp == np.float64(ref).round(6) or abs(lp - ref) < 1e-6


def test_top_k_of_one_is_greedy_at_any_temperature() -> None:
    x = logits(1)
    for pos in range(20):
        assert sample(x, SamplingParams(temperature=5.0, top_k=1, seed=pos), pos)[0] == int(np.argmax(x))


def test_the_same_seed_and_position_draw_the_same_token() -> None:
    x = logits(2)
    p = SamplingParams(temperature=1.0, seed=1234)
    assert [sample(x, p, i)[0] for i in range(50)] == [sample(x, p, i)[0] for i in range(50)]
    other = SamplingParams(temperature=1.0, seed=99)
    assert [sample(x, p, i)[0] for i in range(50)] != [sample(x, other, i)[0] for i in range(50)]


def test_uniform_draws_are_spread_over_the_unit_interval() -> None:
    u = np.array([uniform(7, i) for i in range(4000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 0.03


def test_top_p_and_min_p_keep_only_likely_tokens() -> None:
    x = np.full(100, -10.0, dtype=np.float32)
    x[[3, 4]] = [5.0, 4.9]  # two tokens hold almost all the mass
    picked = {sample(x, SamplingParams(temperature=1.0, top_p=0.9, seed=s), 0)[0] for s in range(200)}
    assert picked == {3, 4}
    picked = {sample(x, SamplingParams(temperature=1.0, min_p=0.5, seed=s), 0)[0] for s in range(200)}
    assert picked == {3, 4}


def test_repetition_penalty_pushes_seen_tokens_down() -> None:
    x = np.array([2.0, -1.0, 1.9], dtype=np.float32)
    y = apply_repeat_penalty(x, [0, 1], SamplingParams(repeat_penalty=2.0))
    assert list(y) == [1.0, -2.0, 1.9]
    assert sample(x, SamplingParams(repeat_penalty=2.0), 0, history=[0])[0] == 2
