"""Sampling parameters as every party sees them: the API, the route client, the frame codec, the hops."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options applied on the last shard; temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0
