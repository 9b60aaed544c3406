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
from agent.wire.prefix import common_prefix

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


def expected_tokens(a: float, k: int) -> float:
    """Tokens one verification of k drafts yields when each stands with probability a after the one
    before it stood: the sampled token plus the accepted run, 1 + a + ... + a^k."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


MEASURE_STEPS = 3  # an answer's first decode steps go plain: they measure its route's costs
# a draft must promise this much more than a plain step: a verification leaves the native lane and may
# leave rejected drafts to cut, costs the rate below does not count
MIN_GAIN = 1.1
PROBE_EVERY = 8  # plain steps in a row before a one-token probe when drafts have not been paying


def draft_length(
    a: float,
    round_trip_ms: float,
    row_ms: float,
    k_max: int,
    draft_ms: float = 0.0,
    verify_round_trip_ms: float | None = None,
) -> int:
    """The draft length that yields the most tokens per millisecond: a step costs the route's round
    trip plus one row's compute per position (rows run one at a time, agent/node/verify.py), plus
    `draft_ms` per drafted token for a drafter that computes (a draft model). A verification's own
    round trip (`verify_round_trip_ms`, once measured) can exceed a plain step's: it leaves the native
    lanes, and the step after it comes back to them. Long drafts pay where round trips dominate and
    drafts stand; on a fast link they only add compute (0: go plain)."""
    verify_rt = max(round_trip_ms if verify_round_trip_ms is None else verify_round_trip_ms, 0.0)
    row, per = max(row_ms, 1e-3), max(draft_ms, 0.0)
    plain = 1.0 / (max(round_trip_ms, 0.0) + row)
    best_k, best, prev = 0, plain, 0.0
    # From one draft on, tokens a step yields are concave in k and its cost is affine, so the rate rises
    # to one peak and then only falls: the search stops at the first fall (it runs every decode step).
    for k in range(1, max(0, k_max) + 1):
        r = expected_tokens(a, k) / (verify_rt + (k + 1) * row + k * per)
        if r > best:
            best_k, best = k, r
        if r < prev:
            break
        prev = r
    return best_k if best >= MIN_GAIN * plain else 0


def sized_draft(stats: SpecStats, k_max: int) -> int:
    """The next step's draft length, at most k_max, from what the answer's steps measured: none for its
    first MEASURE_STEPS steps (they measure the route), then draft_length's; where that is none but
    drafts that always stood would pay on this route at all, one draft after PROBE_EVERY plain steps in
    a row, so the acceptance estimate keeps learning (a probe that stands starts no run of probes).

    Until a verification is measured, its round trip is priced a row's compute above a plain step's: it
    leaves the native lanes and comes back, which a plain step's round trip does not show (on loopback
    6-8 ms beyond a plain step's 1.7, rows ~10 ms). Priced as a plain step's, every playground answer on
    one machine paid a probe costing ~13% of a 48-token answer (docs/benchmarks.md, 2026-12-07)."""
    if stats.steps + stats.plain_steps < MEASURE_STEPS:
        return 0
    rt, row, per, vrt = stats.round_trip_ms, stats.row_ms, stats.draft_ms, stats.verify_round_trip_ms
    if vrt is None:
        vrt = rt + row
    k = draft_length(stats.acceptance_rate(), rt, row, k_max, per, vrt)
    if k == 0 and stats.plain_run >= PROBE_EVERY and draft_length(1.0, rt, row, k_max, per, vrt):
        return min(1, k_max)
    return k


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts equal what the route sampled after each of their predecessors:
    `sampled[i]` is the token sampled at the step's position i (after the step's first token, then
    after each draft), so draft i stands when it equals sampled[i] and every draft before it stood."""
    return common_prefix(drafts, sampled)


@dataclass
class SpecStats:
    """One answer's speculation: verification steps, drafted and accepted tokens, plain steps, and
    the measured costs and acceptance that size the next draft."""

    steps: int = 0  # verification steps (one round trip of the route each)
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0  # verifications that stopped at a draft that did not stand
    plain_steps: int = 0  # steps with no draft to verify
    plain_run: int = 0  # plain steps since the last verification
    round_trip_ms: float = 0.0  # a step's wall time less the hops' compute (moving average)
    row_ms: float = 0.0  # the hops' compute per position (moving average)
    draft_ms: float = 0.0  # the drafter's time per drafted token (moving average; 0 for lookups)
    timed_steps: int = 0
    drafts_timed: int = 0
    verify_round_trip_ms: float | None = None  # a verification's round trip with the way back after it
    _verify_rt_step: float = 0.0
    _after_verify: bool = False

    def plain(self) -> None:
        """A step with no draft to verify."""
        self.plain_steps += 1
        self.plain_run += 1

    def record(self, drafted: int, accepted: int) -> None:
        """A verification of `drafted` drafts, `accepted` of which stood."""
        self.steps += 1
        self.plain_run = 0
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += accepted < drafted

    def timed(self, rows: int, wall_ms: float, compute_ms: float, verify: bool = False) -> None:
        """A step's costs: the round trip (what speculation amortises) and the compute per row. One
        step held up by something else on the machine moves the round trip by at most a tenth of its
        excess, so a stall does not read as a slow link. A verification's round trip is kept apart
        (`verify`), and so is the plain step after it, whose extra (back onto the lanes, cutting the
        hops back) is the verification's cost, not the link's."""
        rt, row = max(wall_ms - compute_ms, 0.0), compute_ms / max(rows, 1)
        if verify or self._after_verify:
            extra = rt if verify else max(rt - self.round_trip_ms, 0.0)
            if verify:
                if self._after_verify:  # verifications back to back: the one before had no way back
                    self._verify_priced(self._verify_rt_step)
                self._verify_rt_step = extra
                self._after_verify = True
                self.row_ms = 0.8 * self.row_ms + 0.2 * row if self.row_ms else row
                return
            self._verify_priced(self._verify_rt_step + extra)  # the verification and the way back
            self._after_verify = False
            return
        self.timed_steps += 1
        if self.timed_steps == 1:
            self.round_trip_ms, self.row_ms = rt, row
            return
        if self.timed_steps <= MEASURE_STEPS:  # the fastest of the first steps: the very first pays for
            self.round_trip_ms = min(self.round_trip_ms, rt)  # connections and the lane's admission
        else:
            self.round_trip_ms += (0.2 if rt < self.round_trip_ms else 0.1) * (rt - self.round_trip_ms)
        self.row_ms = 0.8 * self.row_ms + 0.2 * row

    def _verify_priced(self, total: float) -> None:
        v = self.verify_round_trip_ms
        self.verify_round_trip_ms = total if v is None else 0.7 * v + 0.3 * total

    def drafting(self, tokens: int, ms: float) -> None:
        """What a draft of `tokens` took the drafter to propose. An answer's first draft is not
        counted: a draft model catches up with the whole prompt there, once, not per drafted token
        (counted, it would price drafts out for the rest of the answer)."""
        if tokens <= 0:
            return
        self.drafts_timed += 1
        if self.drafts_timed == 1:
            return
        per = ms / tokens
        self.draft_ms = per if self.draft_ms == 0.0 else 0.8 * self.draft_ms + 0.2 * per

    def acceptance_rate(self, prior: float = 0.5, weight: float = 2.0) -> float:
        """Probability that a draft stands once its predecessor did (the run lengths' estimate, pulled
        towards `prior` while few verifications are in)."""
        return (self.accepted + prior * weight) / (self.accepted + self.rejections + weight)

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
