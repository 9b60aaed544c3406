"""RouteClient.generate sends each decode step before its consumer handles the token before it, and
leaves the route agreeing with its history however the consumer stops. The seam faked here is
`RouteClient.forward` (one step of the whole route); the real route runs in tests/integration."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import numpy as np
import pytest

from agent.client.recovery import RecoveryPolicy, minted_hops
from agent.client.route import RouteClient, RouteError
from agent.wire.frames import Kind, Response
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams

PROMPT = [1, 2, 3]


class StepClient(RouteClient):
    """A route whose step answers token len(history) + 100 after `delay_s`, logging every event."""

    def __init__(self, signing_key: Any, delay_s: float = 0.01) -> None:
        session = os.urandom(16)
        hops = minted_hops(signing_key, session, "ab" * 32, [RouteHop("node-0", "http://127.0.0.1:9/", 0, 4)])
        super().__init__(hops, session_id=session, capacity=64)
        self.delay_s = delay_s
        self.events: list[str] = []
        self.fail_at: int | None = None  # the history length whose step raises
        # the history length whose step answers only once `release` is set (never: a hung hop)
        self.hold_at: int | None = None
        self.release = asyncio.Event()

    async def truncate(self, n: int) -> int:
        del self.history[n:]
        return len(self.history)

    async def forward(
        self, ids: list[int], sampling: SamplingParams, want_logits: bool = False, sample_all: bool = False
    ) -> Response:
        pos = len(self.history)
        self.events.append(f"send {pos}")
        await asyncio.sleep(self.delay_s)
        if self.hold_at == pos:
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.events.append(f"cancelled {pos}")
                raise
        if self.fail_at == pos:
            self.events.append(f"fail {pos}")
            raise RouteError("the hop went away")
        self.history.extend(ids)
        self.events.append(f"done {pos}")
        return Response(step=0, kind=Kind.TOKEN, session_len=len(self.history), n_tokens=1, token=100 + pos)


async def _consume(c: StepClient, n: int, stop_after: int | None = None, **kw: Any) -> list[int]:
    got: list[int] = []
    gen = c.generate(PROMPT, SamplingParams(), n, **kw)
    try:
        async for tok, _ in gen:
            c.events.append(f"got {tok}")
            await asyncio.sleep(c.delay_s / 2)  # the consumer's own work: detokenizing, a socket write
            c.events.append(f"handled {tok}")
            got.append(tok)
            if stop_after is not None and len(got) == stop_after:
                break
    finally:
        await gen.aclose()
        await c.close()
    return got


async def test_the_next_step_is_on_its_way_while_the_consumer_handles_a_token(signing_key: Any) -> None:
    c = StepClient(signing_key)
    got = await _consume(c, 4)
    assert got == [100, 103, 104, 105]
    # the first decode step (position 3) went out before token 100 was handled, and so on
    for pos, tok in ((3, 100), (4, 103), (5, 104)):
        assert c.events.index(f"send {pos}") < c.events.index(f"handled {tok}")
    # nothing beyond max_tokens: the last token is not sent on
    assert "send 6" not in c.events
    assert c.history == PROMPT + [100, 103, 104]


async def test_a_consumer_that_stops_leaves_the_history_equal_to_what_the_route_holds(
    signing_key: Any,
) -> None:
    c = StepClient(signing_key)
    got = await _consume(c, 10, stop_after=2)
    assert got == [100, 103]
    # the step sent ahead with token 103 finished before aclose returned; nothing was sent after it
    assert c.events[-1] == "done 4"
    assert c.history == PROMPT + [100, 103]
    assert [e for e in c.events if e.startswith("send")] == ["send 0", "send 3", "send 4"]


async def test_no_step_goes_ahead_of_a_stop_token(signing_key: Any) -> None:
    c = StepClient(signing_key)
    got = await _consume(c, 10, stop_ids={103})
    assert got == [100, 103]
    assert [e for e in c.events if e.startswith("send")] == ["send 0", "send 3"]


async def test_with_logits_each_step_waits_for_the_consumer(signing_key: Any) -> None:
    c = StepClient(signing_key)
    got = await _consume(c, 3, want_logits=True)
    # the consumer reads last_response's logits while it handles a token: nothing replaces it meanwhile
    # (the prompt's last position went alone, for its logits: the first token is 102)
    assert got == [102, 103, 104]
    for pos, tok in ((3, 102), (4, 103)):
        assert c.events.index(f"handled {tok}") < c.events.index(f"send {pos}")


async def test_a_step_failing_ahead_of_a_live_consumer_raises_at_the_next_token(signing_key: Any) -> None:
    c = StepClient(signing_key)
    c.fail_at = 4
    with pytest.raises(RouteError, match="went away"):
        await _consume(c, 10)
    # the token before the failure was delivered and handled first
    assert "handled 103" in c.events


async def test_a_step_failing_ahead_of_a_stopped_consumer_is_logged_not_raised(
    signing_key: Any, caplog: pytest.LogCaptureFixture
) -> None:
    c = StepClient(signing_key)
    c.fail_at = 4
    with caplog.at_level(logging.WARNING, logger="agent.client.ahead"):
        got = await _consume(c, 10, stop_after=2)
    assert got == [100, 103]  # every token the consumer took arrived
    assert "fail 4" in c.events
    assert any("sent ahead" in r.message and "went away" in r.message for r in caplog.records)


async def test_a_consumer_that_breaks_out_without_closing_holds_the_next_generate_until_its_step_ends(
    signing_key: Any,
) -> None:
    c = StepClient(signing_key)
    got: list[int] = []
    try:
        async for tok, _ in c.generate(PROMPT, SamplingParams(), 10):  # never closed: left to the GC
            got.append(tok)
            if len(got) == 2:
                break
        assert "done 4" not in c.events  # the step sent ahead with token 103 is still on its way
        more = [t async for t, _ in c.generate(PROMPT + got + [7], SamplingParams(), 2)]
    finally:
        await c.close()
    # it finished before the second answer touched the route, whose history then held token 103 too
    assert c.events.index("done 4") < c.events.index("send 5")
    assert [e for e in c.events if e.startswith("send")] == ["send 0", "send 3", "send 4", "send 5", "send 6"]
    assert more == [105, 106]


# -- speculative decoding (agent/client/speculate.py): the same overlap, drafts and all ------------------


class SpecStepClient(StepClient):
    """StepClient that verifies drafts: position p samples 100 + p whether it runs alone or in a step."""

    def __init__(self, signing_key: Any, delay_s: float = 0.01) -> None:
        super().__init__(signing_key, delay_s)
        self.spec_adaptive = False  # `speculate` drafts every step: the test decides, not the costs

    async def forward(
        self, ids: list[int], sampling: SamplingParams, want_logits: bool = False, sample_all: bool = False
    ) -> Response:
        if not sample_all:
            return await super().forward(ids, sampling, want_logits)
        pos = len(self.history)
        self.events.append(f"send {pos}+{len(ids) - 1}")
        await asyncio.sleep(self.delay_s)
        self.history.extend(ids)
        self.events.append(f"done {pos}")
        n = len(ids)
        payload = np.arange(100 + pos, 100 + pos + n, dtype="<i4").tobytes() + np.zeros(n, "<f4").tobytes()
        return Response(step=0, kind=Kind.TOKENS, session_len=len(self.history), n_tokens=n, payload=payload)


class Drafts:
    """Proposes the model's own next tokens (all stand), or `wrong` ones from the second draft on."""

    def __init__(self, wrong: bool = False) -> None:
        self.wrong = wrong

    def propose(self, context: list[int], k: int) -> list[int]:
        # the step sends context[-1] at position len(context) - 1, which samples 100 + that position
        nxt = [100 + len(context) - 1 + i for i in range(k)]
        return nxt[:1] + [7] * (k - 1) if self.wrong else nxt


async def test_a_speculative_step_drafts_and_all_is_on_its_way_while_the_consumer_handles_tokens(
    signing_key: Any,
) -> None:
    c = SpecStepClient(signing_key)
    got = await _consume(c, 7, speculate=2, drafter=Drafts())
    assert got == [100, 103, 104, 105, 106, 107, 108]  # plain decoding's tokens
    # the verification at position 3 left before token 100 was handled, the one at 6 (after 103-105
    # stood) before 103 was
    assert c.events.index("send 3+2") < c.events.index("handled 100")
    assert c.events.index("send 6+2") < c.events.index("handled 103")
    # the last step drafts only up to max_tokens, and nothing goes after the answer's last token
    assert [e for e in c.events if e.startswith("send")] == ["send 0", "send 3+2", "send 6+2"]


async def test_a_rejected_draft_in_a_step_sent_ahead_leaves_plain_decodings_tokens(signing_key: Any) -> None:
    c = SpecStepClient(signing_key)
    got = await _consume(c, 6, speculate=3, drafter=Drafts(wrong=True))
    assert got == [100, 103, 104, 105, 106, 107]
    # each verification kept its first draft and the sample after it, the rest cut back; drafts stop
    # at the answer's end (the last step goes plain)
    assert [e for e in c.events if e.startswith("send")] == ["send 0", "send 3+3", "send 5+2", "send 7"]


async def test_a_consumer_that_stops_with_a_verification_in_flight_lets_it_finish(signing_key: Any) -> None:
    c = SpecStepClient(signing_key)
    got = await _consume(c, 20, stop_after=2, speculate=2, drafter=Drafts())
    assert got == [100, 103]
    # the step sent ahead (after 103-105 stood) finished before aclose returned, and nothing followed
    assert c.events[-1] == "done 6"
    assert [e for e in c.events if e.startswith("send")] == ["send 0", "send 3+2", "send 6+2"]
    assert c.history == PROMPT + [100, 103, 104, 105, 106, 107]  # what the route holds


async def test_a_slow_consumer_does_not_read_as_a_slow_route_when_drafts_are_sized(signing_key: Any) -> None:
    c = SpecStepClient(signing_key, delay_s=0.01)
    c.spec_adaptive = True
    got: list[int] = []
    gen = c.generate(PROMPT, SamplingParams(), 6, speculate=2, drafter=Drafts())
    try:
        async for tok, _ in gen:
            got.append(tok)
            await asyncio.sleep(0.15)  # a consumer far slower than the route
    finally:
        await gen.aclose()
        await c.close()
    assert got == [100, 103, 104, 105, 106, 107]
    # the round trip is timed to the answer's arrival, not to when the loop came back for it
    assert 0 < c.last_spec.round_trip_ms < 100, c.last_spec


async def test_a_speculating_answer_closed_by_its_consumer_settles_its_step_before_aclose_returns(
    signing_key: Any,
) -> None:
    c = SpecStepClient(signing_key)
    gen = c.generate(PROMPT, SamplingParams(), 20, speculate=2, drafter=Drafts())
    got: list[int] = []
    try:
        async for tok, _ in gen:
            got.append(tok)
            if len(got) == 2:
                break  # a stop string: the API closes the answer here
        await gen.aclose()
        # the verification sent ahead (after 103-105 stood) ended inside aclose: left to the garbage
        # collector's own task, it extended the history after the route's next answer had truncated it
        assert c.events[-1] == "done 6"
        assert c.history == PROMPT + [100, 103, 104, 105, 106, 107]
    finally:
        await c.close()


async def test_a_consumer_cancelled_with_a_step_ahead_holds_the_next_generate_until_the_step_ends(
    signing_key: Any,
) -> None:
    c = StepClient(signing_key)
    c.hold_at = 3  # the step sent ahead with token 100 waits for the test

    async def consume() -> None:
        async for _ in c.generate(PROMPT, SamplingParams(), 10):
            c.events.append("handled")  # at once: the consumer then waits for the step's answer

    task = asyncio.create_task(consume())
    try:
        for _ in range(500):
            if "send 3" in c.events and "handled" in c.events:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()  # the web client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        c.release.set()  # the step's frame had left: its answer comes
        more = [t async for t, _ in c.generate(PROMPT + [100, 103, 7], SamplingParams(), 2)]
    finally:
        await c.close()
    # the cancellation left the step running, and the next answer began only after it ended
    assert c.events.index("done 3") < c.events.index("send 4")
    assert more == [104, 106]  # its prompt's new tokens went at position 4, right after token 100
    assert c.history == PROMPT + [100, 103, 7, 104]


async def test_closing_a_route_cancels_a_step_ahead_that_has_not_ended_within_the_grace(
    signing_key: Any,
) -> None:
    c = StepClient(signing_key)
    c.hold_at = 3  # the step sent ahead with token 100 never answers: a hung hop
    c.policy = RecoveryPolicy(deadline_floor_s=0.1)

    async def consume() -> None:
        async for _ in c.generate(PROMPT, SamplingParams(), 10):
            pass

    task = asyncio.create_task(consume())
    for _ in range(200):  # until the consumer waits for the hung step
        if "send 3" in c.events:
            break
        await asyncio.sleep(0.01)
    task.cancel()  # Stop gave up on the step (the playground abandons it and closes the route)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "cancelled 3" not in c.events  # the consumer's cancellation left the step running
    t0 = time.monotonic()
    await c.close()
    # the close waited twice the deadline floor for it, then cancelled it: its KV goes with the session
    assert "cancelled 3" in c.events, (c.events, time.monotonic() - t0)
    assert 0.15 <= time.monotonic() - t0 < 2.0
