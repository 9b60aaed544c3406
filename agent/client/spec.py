"""Speculative decoding over a route: drafts, how many of them a verification step accepts, its figures.

A draft of k tokens travels with the token it follows as one step of k+1 positions (one round trip
per hop); the last hop samples every position as plain decoding would (Flag.SAMPLE_ALL, the draw a pure
function of seed and position), and the drafts that equal those samples are accepted, so the output is
the plain output token for token, greedy or sampled. The hops' state past the accepted tokens is then
cut back by the hops themselves when the next step arrives (docs/speculative.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from agent.wire.frames import MAX_SAMPLE_ALL_TOKENS

MAX_DRAFT = MAX_SAMPLE_ALL_TOKENS - 1  # a step carries the draft and the token it follows


class Drafter(Protocol):
    """Proposes up to `k` tokens likely to follow `context` (every token so far, prompt included)."""

    def propose(self, context: list[int], k: int) -> list[int]: ...


@dataclass
class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last
    n-gram (longest n first). Code edits, quotations and summaries repeat their input; chat rarely."""

    max_ngram: int = 3
    min_ngram: int = 1
    # how far back to look: the search is O(window) per step on the client, never O(context)
    window: int = 4096

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0 or len(context) < 2:
            return []
        start = max(0, len(context) - self.window)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            # newest occurrence first: the recent past predicts the near future best
            for i in range(len(context) - n - 1, start - 1, -1):
                if context[i : i + n] == tail:
                    follow = context[i + n : i + n + k]
                    if follow:
                        return follow
        return []


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal what the route sampled after each of their predecessors:
    `sampled[i]` is the token sampled at the step's position i (after the step's first token, then
    after each draft), so draft i stands when it equals sampled[i] and every draft before it stood."""
    m = 0
    for d, s in zip(drafts, sampled, strict=False):
        if d != s:
            break
        m += 1
    return m


@dataclass
class SpecStats:
    """One answer's speculation: verification steps, drafted and accepted tokens, plain steps."""

    steps: int = 0  # verification steps (one round trip of the route each)
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0  # steps with no draft to verify

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def as_dict(self) -> dict[str, Any]:
        round_trips = self.steps + self.plain_steps
        tokens = self.steps + self.accepted + self.plain_steps
        return {
            "verify_steps": self.steps,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else 0.0,
            # every round trip yields its sampled token plus the drafts it accepted
            "tokens_per_round_trip": round(tokens / round_trips, 3) if round_trips else 0.0,
        }
