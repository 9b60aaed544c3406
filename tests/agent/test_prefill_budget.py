"""The mixed-step budget: a prompt's chunk runs while the lane's next step is held, costs the set share
of the decoders' own period (measured from the steps it sees arrive and the chunks' cost), grows at
most twice per step, stays within its bounds, and always lets the held step go."""

from __future__ import annotations

import pytest

from agent.node.prefill_budget import (
    MAX_TOKENS,
    MIN_TOKENS,
    PACE_MAX_S,
    PACE_MIN_S,
    PREFILL_BUDGET,
    QUIET_CHUNK_S,
    QUIET_PERIODS,
    LanePacer,
    budget_from_env,
)


def _pacer(share: float = 1.0) -> LanePacer:
    return LanePacer(lambda _t: False, share=share, clock=lambda: 0.0)


def _settle(p: LanePacer, period: float, per_token: float, rounds: int = 40) -> list[int]:
    """Passes every `period` s of the decoders' own time, each delayed by the chunk run after the
    previous one (cost `per_token` per position): the sizes chosen, round by round."""
    now, sizes = 0.0, []
    p.passed(now)
    for _ in range(rounds):
        n = p.chunk_tokens()
        sizes.append(n)
        cost = n * per_token
        p.after_chunk(n, cost, held=True)
        now += period + cost
        p.passed(now)
    return sizes


def test_before_any_measurement_a_chunk_is_the_smallest() -> None:
    assert _pacer().chunk_tokens() == MIN_TOKENS


@pytest.mark.parametrize(
    ("lane_gap", "first_wait"),
    [(None, PACE_MAX_S), (0.15, 2 * 0.15), (0.01, PACE_MIN_S), (1.0, PACE_MAX_S)],
)
def test_until_the_period_is_measured_a_chunk_waits_a_few_of_the_lanes_gaps_then_twice_the_period(
    lane_gap: float | None, first_wait: float
) -> None:
    """A first wait of PACE_MIN_S found decoders slower than that (a loaded hop, a big model's window)
    "quiet" at every chunk: nothing held, no period measured, the prompt unpaced beside them. A first wait
    of PACE_MAX_S held a prompt beside decoders that had just stopped for half a second at every hop."""
    asked: list[float] = []
    now = [0.0]

    def wait_turn(timeout_s: float) -> bool:
        asked.append(timeout_s)
        now[0] += 0.15  # the decoders' next step comes 150 ms on
        return True

    p = LanePacer(wait_turn, share=1.0, clock=lambda: now[0], lane_gap=lambda: lane_gap)
    for _ in range(3):
        assert p.before_chunk()
        p.after_chunk(MIN_TOKENS, 0.01, held=True)
        now[0] += 0.01
    assert asked[:2] == pytest.approx([first_wait, first_wait]) and asked[2] == pytest.approx(0.3)
    assert p.period_s == pytest.approx(0.15)


def test_a_chunk_settles_at_the_share_of_the_decoders_own_period() -> None:
    p = _pacer(share=1.0)
    sizes = _settle(p, period=0.040, per_token=0.001)
    # 40 ms of the decoders' own period, 1 ms a position: 40 positions, not the delayed gap's 80
    assert sizes[-1] == pytest.approx(40, abs=1)
    assert p.period_s == pytest.approx(0.040, rel=0.01)


def test_the_share_scales_the_chunk() -> None:
    assert _settle(_pacer(share=0.5), 0.040, 0.001)[-1] == pytest.approx(20, abs=1)
    assert _settle(_pacer(share=2.0), 0.040, 0.001)[-1] == pytest.approx(80, abs=2)


def test_a_chunk_at_most_doubles_per_pass_and_stays_within_bounds() -> None:
    sizes = _settle(_pacer(share=8.0), period=1.0, per_token=0.0001)
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:], strict=False))
    assert max(sizes) == MAX_TOKENS
    tiny = _settle(_pacer(share=0.05), period=0.001, per_token=0.01)
    assert min(tiny) == MIN_TOKENS


def test_prompts_prefilling_together_share_the_budget() -> None:
    p = _pacer()
    _settle(p, 0.064, 0.001)
    one = p.chunk_tokens(1)
    assert p.chunk_tokens(2) == one // 2
    assert p.chunk_tokens(100) == MIN_TOKENS


def test_a_wait_that_sees_no_step_measures_nothing_and_releases_nothing() -> None:
    calls: list[float] = []
    released: list[bool] = []
    p = LanePacer(lambda t: calls.append(t) is not None, lambda: released.append(True), share=1.0)
    held = p.before_chunk()
    p.after_chunk(8, 0.01, held)
    assert calls and not held and p.period_s is None and released == []


def test_a_held_step_is_released_after_the_chunk_even_when_it_failed() -> None:
    released: list[bool] = []
    p = LanePacer(lambda _t: True, lambda: released.append(True), share=1.0, clock=lambda: 1.0)
    assert p.before_chunk() is True
    p.after_chunk(0, 0.0, held=True)  # the chunk raised: nothing measured, the step goes on
    assert released == [True] and p.per_token_s is None


def test_the_operator_sets_the_share_and_a_bad_value_is_refused() -> None:
    assert budget_from_env({}) == PREFILL_BUDGET
    assert budget_from_env({"GGSWARM_PREFILL_BUDGET": "0.5"}) == 0.5
    for bad in ("0", "nan", "abc", "9"):
        with pytest.raises(ValueError, match="GGSWARM_PREFILL_BUDGET"):
            budget_from_env({"GGSWARM_PREFILL_BUDGET": bad})


def test_a_prompts_short_last_chunk_does_not_send_the_next_prompt_back_to_the_smallest() -> None:
    p = _pacer()
    _settle(p, 0.064, 0.001)
    full = p.chunk_tokens()
    p.after_chunk(3, 0.003, held=True)  # the remainder of a prompt
    assert p.chunk_tokens() == full


def test_a_lane_with_no_step_to_hold_gets_chunks_of_the_quiet_cost_not_the_smallest() -> None:
    # the lane's sessions still count as decoding, but their steps paused (given way to another user's
    # prompt): the wait holds nothing, and the next chunk costs QUIET_CHUNK_S, not MIN_TOKENS again
    now = [0.0]
    p = LanePacer(lambda _t: False, share=1.0, clock=lambda: now[0])
    assert p.chunk_tokens() == MIN_TOKENS  # nothing known yet
    held = p.before_chunk()
    p.after_chunk(MIN_TOKENS, MIN_TOKENS * 0.004, held)  # 4 ms a position
    quiet = p.chunk_tokens()
    assert quiet == int(QUIET_CHUNK_S / 0.004) and p.quiet_chunks == 1
    assert p.chunk_tokens(2) == quiet // 2  # prompts together share it
    # a later prompt, past the verdict's life, starts from the budget again
    now[0] += PACE_MIN_S + 0.01
    assert p.chunk_tokens() == MIN_TOKENS


def test_once_the_decoders_period_is_measured_a_quiet_chunk_costs_a_few_periods_not_half_a_second() -> None:
    # a quiet verdict can be wrong: decoders whose round trip outran the gate's timeout look paused, and
    # the chunk it sizes holds them for its whole cost (bench/served.py on AVX2: p95 gaps of 374-450 ms)
    turns = [True]
    p = LanePacer(lambda _t: turns[0], share=1.0, clock=lambda: 0.0)
    _settle(p, 0.05, 0.001)
    assert p.period_s is not None and p.per_token_s is not None
    turns[0] = False  # the next wait finds no step and says so at once
    n = p.chunk_tokens()
    p.after_chunk(n, n * 0.001, p.before_chunk())
    assert p.quiet_chunks == 1
    quiet = p.chunk_tokens()
    assert quiet == int(QUIET_PERIODS * p.period_s / p.per_token_s)
    assert quiet < int(QUIET_CHUNK_S / 0.001)  # 200 positions, not 500


def test_a_quiet_chunk_never_exceeds_the_micro_batch_and_a_held_step_ends_the_quiet() -> None:
    turns = [False]
    p = LanePacer(lambda _t: turns[0], share=1.0, clock=lambda: 0.0)
    p.after_chunk(MIN_TOKENS, 1e-6, p.before_chunk())
    assert p.chunk_tokens() == MAX_TOKENS
    turns[0] = True  # the decoders are back: the next wait holds their step, the budget sizes again
    p.after_chunk(MAX_TOKENS, 1e-3, p.before_chunk())
    assert p.chunk_tokens() == MIN_TOKENS  # one pass seen: no period measured yet
    assert p.quiet_chunks == 1 and p.mixed_chunks == 1


def test_a_wait_that_runs_out_is_not_taken_for_a_quiet_lane() -> None:
    # the decoders stepped within the gate's timeout but their next step did not come in time (slow,
    # a busy box): they are decoding, so the next chunk keeps the budget's size
    now = [0.0]

    def times_out(timeout_s: float) -> bool:
        now[0] += timeout_s
        return False

    p = LanePacer(times_out, share=1.0, clock=lambda: now[0])
    p.after_chunk(MIN_TOKENS, MIN_TOKENS * 0.004, p.before_chunk())
    assert p.chunk_tokens() == MIN_TOKENS and p.quiet_chunks == 0


def test_a_lane_found_quiet_right_after_a_wait_ran_out_gets_a_budget_chunk_before_a_quiet_one() -> None:
    # after a wait that ran out (decoders slower than twice their period) and the chunk run then, the
    # lane's silence is that wait's and chunk's own: the gate says "quiet" at once whether the decoders
    # paused or their step is merely late, and a late step found a quiet-sized chunk (four periods)
    # computing beside it (bench/served.py --itl-only, AVX-512: the middle hop's quiet chunks followed
    # its waits that ran out). The verdict is trusted at the next wait that still finds no step.
    now = [0.0]
    answers: list[str] = []

    def wait_turn(timeout_s: float) -> bool:
        a = answers.pop(0)
        if a == "held":
            now[0] += 0.01
            return True
        if a == "ran_out":
            now[0] += timeout_s
        return False  # "quiet": at once

    p = LanePacer(wait_turn, share=1.0, clock=lambda: now[0])
    _settle(p, 0.05, 0.001)  # period 50 ms, 1 ms a position: a budget chunk is 50 positions
    budget = p.chunk_tokens()
    assert budget == pytest.approx(50, abs=1)

    def chunk() -> int:
        n = p.chunk_tokens()
        held = p.before_chunk()
        p.after_chunk(n, n * 0.001, held)
        return p.chunk_tokens()

    answers += ["ran_out", "quiet", "quiet"]
    assert chunk() == budget and p.unheld_chunks == 1  # slow decoders: the budget, beside their step
    assert chunk() == budget and p.quiet_chunks == 0  # no step yet: its wait's own silence, not quiet
    assert chunk() == int(QUIET_PERIODS * p.period_s / p.per_token_s) and p.quiet_chunks == 1
    # a lane found quiet without a wait running out before is quiet at once, as before
    answers += ["held", "quiet"]
    chunk()
    assert chunk() > budget and p.quiet_chunks == 2
