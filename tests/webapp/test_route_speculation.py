"""An answer asks its route client to speculate as settings say, and reports what the drafts did."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from agent.client.spec import SpecStats
from agent.wire.sampling import SamplingParams
from tests.webapp.test_route_prefix import Client, Tok
from webapp.routing.answer import Answer, AnswerSpec, LiveRoute


class SpeculatingClient(Client):
    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        self.last_spec = SpecStats()
        if kw["speculate"]:  # one verification of 4 drafts, 2 of them kept, and one plain step
            self.last_spec.record(4, 2)
            self.last_spec.plain_steps += 1
        async for item in super().generate(prompt, *args, **kw):
            yield item


def answer_with(client: Client, speculate: int) -> dict[str, Any]:
    live = LiveRoute(uuid.uuid4(), 1, client, [], 8192)
    answer = Answer(
        live, Tok(), [1, 2, 3], AnswerSpec(SamplingParams(), 4, speculate=speculate), reused=False
    )

    async def run() -> None:
        async for _ in answer.pieces():
            pass

    asyncio.run(run())
    return answer.telemetry()


def test_an_answer_passes_its_draft_limit_and_reports_tokens_per_round_trip() -> None:
    client = SpeculatingClient()
    t = answer_with(client, 8)
    assert client.kwargs["speculate"] == 8
    assert t["speculation"]["verify_steps"] == 1 and t["speculation"]["accepted"] == 2
    assert t["speculation"]["tokens_per_round_trip"] == (3 + 1) / 2


def test_an_answer_that_may_not_speculate_says_so() -> None:
    client = SpeculatingClient()
    t = answer_with(client, 0)
    assert client.kwargs["speculate"] == 0
    assert t["speculation"]["verify_steps"] == 0 and t["speculation"]["tokens_per_round_trip"] == 0.0
