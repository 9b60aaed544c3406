"""A route of native qwen35moe hops through the data plane: editing a turn brings every hop back to the
recurrent-state checkpoint at the turn boundary, re-prefills from there, and answers as a fresh route."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.artifacts.tiny import write_tiny_gguf
from agent.client.route import Hop, RouteClient
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams
from tests.native.routes import windows_on_one_node

SPLITS = [(0, 3), (3, 4), (4, 8)]  # the middle hop is the full-attention layer 3 alone
TURN1 = list(range(1000, 1150))
TURN2 = list(range(2000, 2040))
EDITED = TURN2[:10] + list(range(3000, 3030))

pytestmark = pytest.mark.slow


async def test_an_edited_turn_goes_back_to_the_turn_checkpoint_and_answers_like_a_fresh_route(
    native_lib: None,
    signing_key,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    path = write_tiny_gguf("qwen35moe", tmp_path / "qwen35moe.gguf")
    dp, manifest, runner, url = await windows_on_one_node(path, SPLITS, signing_key.public_key(), "node-q")

    def client() -> RouteClient:
        session = os.urandom(16)
        hops = [
            Hop(url, a, b, mint(signing_key, session, manifest.sha256, a, b, "node-q")) for a, b in SPLITS
        ]
        return RouteClient(hops, session_id=session, capacity=1024)

    chat, fresh = client(), client()
    try:
        [t async for t, _ in chat.generate(TURN1, SamplingParams(), 8)]
        turn2 = list(chat.history) + TURN2
        [t async for t, _ in chat.generate(turn2, SamplingParams(), 8)]
        assert chat.last_truncate == {}  # the whole history was reused
        boundary = len(turn2) - len(TURN2)  # where the second turn's prefill began: a checkpoint
        edited = turn2[:boundary] + EDITED
        got = [t async for t, _ in chat.generate(edited, SamplingParams(), 8)]
        assert chat.last_truncate == {"requested": boundary + 10, "held": boundary, "mode": "checkpoint"}
        assert chat.last_prefilled == len(edited) - boundary
        assert dp.counters["truncate_checkpoint"] == 2  # the two hops keeping recurrent state
        want = [t async for t, _ in fresh.generate(edited, SamplingParams(), 8)]
        assert got == want
    finally:
        await chat.close()
        await fresh.close()
        await runner.cleanup()
    assert dp.stats()["sessions"] == 0 and dp.stats()["kv_bytes"] == 0
