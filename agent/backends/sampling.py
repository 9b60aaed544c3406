"""Token sampling on the last shard: the reference semantics every backend reproduces.

Order: repetition penalty over the last `repeat_last_n` distinct history tokens (llama.cpp style:
positive logits divided, negative multiplied) -> greedy if temperature <= 0 -> top-k -> softmax(logits /
temperature) -> top-p (smallest prefix of the sorted distribution reaching p) -> min-p (drop tokens with
p < min_p * p_max) -> renormalise -> inverse-CDF draw.

The draw is a pure function of (seed, position): u = splitmix64(seed, position) / 2^64. No RNG state
lives in a session, so re-prefilling on a replacement hop after a fault, or a native backend written in
C, draws exactly the same token as the original run.

The returned logprob is log-softmax of the raw (unpenalised, untempered) logits at the chosen token.
"""

from __future__ import annotations

import numpy as np

from agent.wire.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """Uniform in [0, 1) determined by (seed, position) alone; 53 bits, like a double mantissa."""
    return (splitmix64((seed & _MASK64) ^ splitmix64(position & _MASK64)) >> 11) * (1.0 / (1 << 53))


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    x = logits.astype(np.float64)
    m = float(x.max())
    return float(x[token] - m - np.log(np.exp(x - m).sum()))


def apply_repeat_penalty(logits: np.ndarray, history: list[int] | None, p: SamplingParams) -> np.ndarray:
    if p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0:
        return logits
    recent = history if p.repeat_last_n < 0 else history[-p.repeat_last_n :]
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    ids = ids[(ids >= 0) & (ids < logits.shape[0])]
    out = logits.copy()
    v = out[ids]
    out[ids] = np.where(v > 0, v / p.repeat_penalty, v * p.repeat_penalty)
    return out


def wire_exact(p: SamplingParams) -> SamplingParams:
    """The parameters as the wire carries them (float32), so in-process and routed runs sample alike."""
    f = np.float32
    return SamplingParams(
        temperature=float(f(p.temperature)),
        top_k=p.top_k,
        top_p=float(f(p.top_p)),
        min_p=float(f(p.min_p)),
        repeat_penalty=float(f(p.repeat_penalty)),
        repeat_last_n=p.repeat_last_n,
        seed=p.seed,
    )


def sample(
    logits: np.ndarray, p: SamplingParams, position: int, history: list[int] | None = None
) -> tuple[int, float]:
    """Pick the next token from one position's logits; returns (token id, logprob)."""
    p = wire_exact(p)
    raw = np.asarray(logits, dtype=np.float32)
    x = apply_repeat_penalty(raw, history, p)
    if p.temperature <= 0.0:
        tok = int(np.argmax(x))
        return tok, log_softmax_at(raw, tok)
    x = x.astype(np.float64) / p.temperature
    order = np.argsort(-x, kind="stable")
    if p.top_k > 0:
        order = order[: p.top_k]
    vals = x[order]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    keep = len(order)
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p, side="left")) + 1
        keep = max(1, min(keep, len(order)))
    if p.min_p > 0.0:
        keep = max(1, min(keep, int(np.count_nonzero(probs[:keep] >= p.min_p * probs[0]))))
    probs = probs[:keep] / probs[:keep].sum()
    u = uniform(p.seed, position)
    idx = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    tok = int(order[min(idx, keep - 1)])
    return tok, log_softmax_at(raw, tok)
