"""The mixed-step budget: how big and when a prompt's chunk runs on a hop whose lane sessions decode.

Sessions on the node's lane decode outside the shard's scheduler, so a prompt that arrives meanwhile
cannot join their batch in the Python queue. Each chunk instead makes a mixed step with them: it waits
until the lane's next step arrives on this hop, runs while libggswarm holds that step
(`ggswarm_lane_gate`), and then lets it compute. The chunk and the decoders' step thus compute one after
the other while the route's other hops wait, never beside each other: started beside them (after
their step passed, while they computed at other hops), an 8-position chunk took 40-75 ms on a hop of
the 2-core box instead of ~15, every process's threads contending for the same cores.

Each chunk is sized to cost `share` x the decoders' own period on this hop, so their inter-token gap
grows to about (1 + share) x its idle value while the prompt gets share / (1 + share) of the hop's
time. The sizes come from measured costs, kept here: the decoders' period (the gap between two
arrivals less the chunk that delayed the second) and the chunk's cost per position. A chunk never
grows more than twice per step (the cost per position falls as chunks grow, so the first estimates are
pessimistic), never exceeds the executor's micro-batch, and never falls below MIN_TOKENS.

A lane whose sessions are still counted as decoding (a step within the node's LANE_ACTIVE_S) may have
no step to hold: its decoders paused (a control plane has a heavier user's answers give way to a
lighter user's prompt, webapp/routing/quota.py) or stopped. The gate then says at once that no step
came within its timeout, and the next chunks are sized to cost at most QUIET_CHUNK_S (QUIET_PERIODS of
the decoders' period once measured: a verdict that was wrong holds them that long) instead of the
share of a period nobody is using (a wait that runs out is not taken for quiet: decoders may only be
slow, nor is the at-once verdict right after such a wait, whose silence is the wait's own): measured
(bench/abuse.py, 3 decoders given way), a 132-token prompt on such a hop ran in
8-position chunks for 2.4 s where it took 0.94 s whole. A quiet verdict lasts PACE_MIN_S after the
chunk that found it ends, so a later prompt starts from the budget again, and a step that arrives
meanwhile waits for one such chunk at most.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from agent.defaults import env_float

PREFILL_BUDGET = 1.0  # a chunk may cost this share of the decoders' period between passes
PREFILL_BUDGET_ENV = "GGSWARM_PREFILL_BUDGET"  # an operator's override, 0.05..8
MIN_TOKENS = 8  # the first chunk, and the smallest (a smaller one costs more per position than it saves)
MAX_TOKENS = 512  # = native kUBatch
# A chunk waits for the lane's next step twice the decoders' period, within these bounds; until that
# period is measured, GAP_WAITS x the lane's own gap between passes (PACE_MAX_S when none was seen): a
# lane with no step for that long is quiet and the chunk goes at once. (A first wait of PACE_MIN_S found
# decoders slower than that a pass, a loaded hop or a big model's window, "quiet" at every chunk: never
# held, the period never measured, the prompt run unpaced beside them; a first wait of PACE_MAX_S held
# a prompt beside decoders that had just stopped for it: a new user's time to first token went from
# ~200 to ~760 ms on three hops, bench/served.py.)
GAP_WAITS = 2  # as for the period: 3 held a lighter user's prompt beside paused decoders 90 ms a hop
# where 60 ms had done (bench/abuse.py's streams part: TTFT ratio 1.45-1.60 against 1.42-1.53)
PACE_MIN_S = 0.06
PACE_MAX_S = 0.5
SMOOTH = 0.3  # weight of the newest measurement in the running estimates
# A chunk on a quiet lane (the latest wait held no step: the decoders paused or stopped) may cost this
# long, by the measured cost per position: about the longest a chunk waits for the lane's step anyway;
# once the decoders' period is measured, at most QUIET_PERIODS of it. The verdict can be wrong: decoders
# whose round trip outran the gate's timeout (twice their mean period; a stalled client, the other hops'
# chunks) look paused, and a 0.5 s chunk then held them 0.4-0.5 s (on AVX2: p95 gaps of 374-450 ms, 8-15x
# idle, in 2 of 6 bench/served.py runs and 1 of 3 probes; the middle hop took 7-12 of its ~40 chunks for quiet)
QUIET_CHUNK_S = PACE_MAX_S
QUIET_PERIODS = 4


def budget_from_env(env: Mapping[str, str] | None = None) -> float:
    """PREFILL_BUDGET, or the operator's GGSWARM_PREFILL_BUDGET (ValueError when out of range)."""
    v = env_float(PREFILL_BUDGET_ENV, 0.05, 8.0, env)
    return PREFILL_BUDGET if v is None else v


class LanePacer:
    """Sizes and times the chunks of prompts that run beside the lane's decoders on this node.

    `wait_turn(timeout_s)` blocks until the lane's next step arrives on this hop and is held for us
    (True; `release()` lets it go) or the timeout (False; at once when the lane is quiet, nothing
    held); `lane_gap()` is the lane's recent gap between passes here, or None. Called from the shard
    schedulers' worker threads: a lock keeps the estimates whole when two shards of the node prefill at
    once."""

    def __init__(
        self,
        wait_turn: Callable[[float], bool],
        release: Callable[[], None] = lambda: None,
        share: float | None = None,
        lane_gap: Callable[[], float | None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        min_tokens: int = MIN_TOKENS,
        max_tokens: int = MAX_TOKENS,
    ) -> None:
        self._wait_turn, self._release = wait_turn, release
        self._lane_gap = lane_gap  # the lane's recent gap between passes on this hop (its batch log)
        self.share = budget_from_env() if share is None else share
        self._clock = clock
        self.min_tokens, self.max_tokens = max(1, min_tokens), max(min_tokens, max_tokens)
        self._mu = threading.Lock()
        self.period_s: float | None = None  # the decoders' own period between passes here
        self.per_token_s: float | None = None  # a chunk's cost per position
        self._last_pass: float | None = None
        self._chunks_s = 0.0  # chunk compute since the latest pass seen
        self._last_tokens = 0  # about the latest full chunk's positions (growth is bounded by it)
        self._quiet = False  # the latest wait held no step: the lane's decoders paused or stopped
        self._ran_out = False  # the latest wait ran its whole timeout without a step: decoders slow
        self._quiet_at: float | None = None  # when the latest chunk run on a quiet lane ended
        self.mixed_chunks = 0  # chunks that ran while the lane held its step (telemetry, tests)
        self.quiet_chunks = 0  # chunks that found no step to hold (telemetry, tests)
        self.unheld_chunks = 0  # chunks after a wait that ran out or a doubted quiet (telemetry)

    def chunk_tokens(self, prompts: int = 1) -> int:
        """Positions each of `prompts` prompts runs in the next chunk."""
        with self._mu:
            n = self._quiet_tokens() if self._quiet_now() else self._budget_tokens()
        return max(self.min_tokens, n // max(1, prompts))

    def _quiet_now(self) -> bool:
        return self._quiet_at is not None and self._clock() - self._quiet_at <= PACE_MIN_S

    def _quiet_tokens(self) -> int:
        if self.per_token_s is None or self.per_token_s <= 0:
            return self.min_tokens
        cost = QUIET_CHUNK_S if self.period_s is None else min(QUIET_CHUNK_S, QUIET_PERIODS * self.period_s)
        return max(self.min_tokens, min(int(cost / self.per_token_s), self.max_tokens))

    def _budget_tokens(self) -> int:
        if self.period_s is None or self.per_token_s is None or self.per_token_s <= 0:
            return self.min_tokens
        want = int(self.share * self.period_s / self.per_token_s)
        grown = 2 * max(self._last_tokens, self.min_tokens)
        return max(self.min_tokens, min(want, grown, self.max_tokens))

    def before_chunk(self) -> bool:
        """Block until the lane's next step is here and held (True: `after_chunk` releases it), or the
        wait times out (False)."""
        with self._mu:
            period = self.period_s
        # twice the decoders' period; before it is measured, a few of the lane's own gaps between passes
        gap = None if period else self._lane_gap()
        wait = 2 * period if period else (GAP_WAITS * gap if gap else PACE_MAX_S)
        timeout = min(PACE_MAX_S, max(PACE_MIN_S, wait))
        asked = self._clock()
        held = self._wait_turn(timeout)
        with self._mu:
            # quiet: the gate found no step within its timeout and said so at once; a wait that ran
            # out (decoders slower than their period, a busy box) is not, so their steps keep the budget
            at_once = not held and self._clock() - asked < timeout / 2
            # right after a wait that ran out, the lane's silence is that wait's and its chunk's own:
            # a step merely late looks paused, so "quiet" is trusted only from the next wait on
            self._quiet, self._ran_out = at_once and not self._ran_out, not held and not at_once
        if held:
            self.passed(self._clock())
        return held

    def passed(self, now: float) -> None:
        """The lane's step arrived at `now`: the gap since the previous one, less the chunks that ran
        in it (they delayed this one), is the decoders' own period."""
        with self._mu:
            if self._last_pass is not None:
                own = max(0.0, now - self._last_pass - self._chunks_s)
                self.period_s = running_mean(self.period_s, own)
            self._last_pass, self._chunks_s = now, 0.0

    def after_chunk(self, tokens: int, seconds: float, held: bool) -> None:
        """A chunk of `tokens` positions (all prompts' together) computed in `seconds` (0 tokens: it
        failed); the lane's step `before_chunk` held goes on now."""
        if held:
            self._release()
            with self._mu:
                self.mixed_chunks += 1
        with self._mu:
            # the next chunk finds the lane as this one did, if it starts right after: no step to hold
            quiet = self._quiet and not held
            self._quiet_at = self._clock() if quiet else None
            self.quiet_chunks += quiet
            self.unheld_chunks += not held and not self._quiet  # beside the decoders' step, should it come
        if tokens <= 0 or seconds < 0:
            return
        with self._mu:
            self._chunks_s += seconds
            # a prompt's last, short chunk must not send the next prompt back to the smallest chunks
            self._last_tokens = max(tokens, self._last_tokens // 2)
            per = seconds / tokens
            self.per_token_s = running_mean(self.per_token_s, per)

    def figures(self) -> dict[str, float | int | None]:
        """The estimates, for the node's stats."""
        with self._mu:
            return {
                "prefill_budget_share": self.share,
                "lane_period_ms": None if self.period_s is None else round(self.period_s * 1e3, 2),
                "prefill_ms_per_token": None
                if self.per_token_s is None
                else round(self.per_token_s * 1e3, 3),
                "prefill_chunk_tokens": self._budget_tokens(),
                "prefill_mixed_chunks": self.mixed_chunks,
                "prefill_quiet_chunks": self.quiet_chunks,
                "prefill_unheld_chunks": self.unheld_chunks,
            }


def running_mean(old: float | None, new: float) -> float:
    """The running estimate after measurement `new` (the first measurement stands alone)."""
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new
