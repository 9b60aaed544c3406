"""A node's decode lane in process (native backend, one-hop routes): who gets on, what takes a session
off, and refusals that say why."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.client.route import Hop, RouteClient, RouteError
from agent.client.transport import HopTransport
from agent.node.dataplane import DataPlane, start_dataplane
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314]


@pytest.fixture
async def node(model_path: str, manifest: Any, signing_key: Any) -> AsyncIterator[tuple[DataPlane, str]]:
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    dp = DataPlane("node-a", signing_key.public_key())
    dp.load_shard(model_path, manifest, 0, 30, backend="native", n_threads=1)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    yield dp, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def _client(
    url: str, manifest: Any, key: Any, lane: bool = True, transport: HopTransport | None = None
) -> RouteClient:
    session = os.urandom(16)
    return RouteClient(
        [Hop(url, 0, 30, mint(key, session, manifest.sha256, 0, 30, "node-a"))],
        session_id=session,
        lane=lane,
        transport=transport,
    )


async def _tokens(c: RouteClient, n: int = 10, prompt: list[int] = PROMPT) -> list[int]:
    return [t async for t, _ in c.generate(prompt, SamplingParams(), n)]


async def _on_the_lane(*clients: RouteClient) -> None:
    """Until every client's decode steps run on the lane (a bounded poll, ~10 s at most)."""
    import asyncio

    for _ in range(2000):
        if all(c.lane.steps >= 3 for c in clients):
            return
        await asyncio.sleep(0.005)


async def _alone(url: str, manifest: Any, key: Any, cases: list[tuple[list[int], int]]) -> list[list[int]]:
    """The tokens each (prompt, n) gets alone on the Python path: what every test compares with."""
    out = []
    for prompt, n in cases:
        plain = _client(url, manifest, key, lane=False)
        try:
            out.append(await _tokens(plain, n, prompt))
        finally:
            await plain.close()
    return out


async def test_a_lone_session_decodes_on_the_lane_with_the_tokens_of_the_python_path(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    dp, url = node
    plain = _client(url, manifest, signing_key, lane=False)
    try:
        want = await _tokens(plain)
    finally:
        await plain.close()
    batches_before, tokens_before = dp.metrics.batches_total, dp.stats()["tokens_out"]
    c = _client(url, manifest, signing_key)
    try:
        got = await _tokens(c)
        assert dp.stats()["lane_sessions"] == 1, (
            c.lane.steps,
            c.lane.fallbacks,
            c.lane.retry_in,
            dp.lane.counters,
        )
    finally:
        await c.close()
    assert got == want and c.lane.steps == len(want) - 1
    stats = dp.stats()
    assert stats["lane_sessions"] == 0  # closing the session took it off
    assert stats["lane_steps"] == len(want) - 1  # counted though they bypassed the Python path
    # and in the telemetry: every token served, the prompt's batch and each lane step's batch
    assert stats["tokens_out"] - tokens_before == len(want)
    assert dp.metrics.batches_total - batches_before == len(want)


async def test_an_expired_session_is_taken_off_the_lane_first(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    import asyncio

    dp, url = node
    c = _client(url, manifest, signing_key)
    try:
        await _tokens(c, 4)
        assert dp.stats()["lane_sessions"] == 1
        # expired (past the TTL) once the step its client sent ahead has ended: a running lane step is
        # never expired, nor evicted (tests/agent/test_sessions.py)
        later, deadline = time.monotonic() + dp.sessions.ttl_s + 60, time.monotonic() + 10
        while dp.sessions.expire(now=later) == 0:
            assert time.monotonic() < deadline, "the session never expired"
            await asyncio.sleep(0.005)
        assert dp.stats()["lane_sessions"] == 0 and dp.lane.counters["lane_take_offs"] == 1
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("setup", "why"),
    [
        (lambda dp, mp: setattr(dp.lane, "enabled", False), "GGSWARM_LANE=0"),
        (lambda dp, mp: mp.setenv("GGSWARM_LANE_PORT", "70000"), "GGSWARM_LANE_PORT='70000' is not a port"),
    ],
)
async def test_a_refused_lane_says_why_and_the_session_stays_on_the_python_path(
    node: tuple[DataPlane, str],
    manifest: Any,
    signing_key: Any,
    monkeypatch: pytest.MonkeyPatch,
    setup: Any,
    why: str,
) -> None:
    dp, url = node
    setup(dp, monkeypatch)
    c = _client(url, manifest, signing_key)
    try:
        await _tokens(c, 2)  # prefill and one Python step: the hop knows the session
        with pytest.raises(RouteError, match="lane_unavailable") as e:
            await c.link.post(0, c.lane.admit_frame())  # the frame the client sends
        assert why in str(e.value)
        more = await _tokens(c, 6)
    finally:
        await c.close()
    assert len(more) == 6 and c.lane.steps == 0 and c.lane.fallbacks == 0


async def test_sessions_share_the_lane_in_bundles_and_another_sessions_prompt_runs_beside_them(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    import asyncio

    dp, url = node
    prompts = [PROMPT, PROMPT[:9]]
    want = await _alone(url, manifest, signing_key, [(p, 16) for p in prompts])
    transport = HopTransport()
    a, b = (_client(url, manifest, signing_key, transport=transport) for _ in prompts)
    other = _client(url, manifest, signing_key, lane=False)
    try:
        got = await asyncio.gather(_tokens(a, 12, prompts[0]), _tokens(b, 12, prompts[1]))
        assert list(got) == [w[:12] for w in want]
        assert dp.stats()["lane_sessions"] == 2 and transport.lanes.bundles_sent >= 5
        assert a.lane.steps >= 5 and b.lane.steps >= 5
        # another session's prompt (26 new positions) and decode steps run beside them on the Python
        # path, in the lane's small chunks: they stay on the lane
        await _tokens(other, 3, PROMPT * 3)
        assert dp.stats()["lane_sessions"] == 2 and dp.lane.counters["lane_take_offs"] == 0
        # and go on there, exact
        steps = a.lane.steps + b.lane.steps
        more = await asyncio.gather(
            _tokens(a, 4, prompts[0] + want[0][:12]), _tokens(b, 4, prompts[1] + want[1][:12])
        )
        assert list(more) == [w[12:16] for w in want]
        assert a.lane.steps + b.lane.steps >= steps + 6
    finally:
        for c in (a, b, other):
            await c.close()
        await transport.close()


async def test_a_prompt_beside_decoding_lane_sessions_runs_in_mixed_steps_and_all_stay_exact(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    import asyncio

    dp, url = node
    long_prompt = (PROMPT * 10)[:120]
    want = await _alone(url, manifest, signing_key, [(PROMPT, 40), (PROMPT[:9], 40), (long_prompt, 4)])
    transport = HopTransport()
    a, b = (_client(url, manifest, signing_key, transport=transport) for _ in range(2))
    other = _client(url, manifest, signing_key, lane=False)
    try:
        decoding = asyncio.gather(_tokens(a, 40, PROMPT), _tokens(b, 40, PROMPT[:9]))
        await _on_the_lane(a, b)
        # the prompt arrives while they decode: its chunks ride the lane's steps as mixed steps
        got_other = await _tokens(other, 4, long_prompt)
        got = await decoding
        assert [*got, got_other] == want
        figures = dp.stats()
        assert figures["prefill_mixed_chunks"] >= 1 and figures["lane_period_ms"] is not None
        assert dp.lane.counters["lane_take_offs"] == 0
    finally:
        for c in (a, b, other):
            await c.close()
        await transport.close()


async def test_a_prompt_beside_lane_sessions_that_paused_is_not_cut_into_the_smallest_chunks(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    """Lane sessions that stepped within LANE_ACTIVE_S still count as decoding, but send no step (their
    answers gave way to another user's prompt, issue 33): the prompt's chunks find nothing to hold, and
    after the first they cost the quiet chunk's time, not MIN_TOKENS positions each (which had a
    132-token prompt take 2.4 s instead of 0.94 s on a hop)."""
    import asyncio

    from agent.node.prefill_budget import MIN_TOKENS

    dp, url = node
    long_prompt = (PROMPT * 13)[:160]
    want = await _alone(url, manifest, signing_key, [(long_prompt, 2)])
    transport = HopTransport()
    a, b = (_client(url, manifest, signing_key, transport=transport) for _ in range(2))
    other = _client(url, manifest, signing_key, lane=False)
    pacer, chunks = dp.lane.pacer, list[tuple[int, bool]]()
    after_chunk = pacer.after_chunk

    def record(tokens: int, seconds: float, held: bool) -> None:
        chunks.append((tokens, held))
        after_chunk(tokens, seconds, held)

    pacer.after_chunk = record  # type: ignore[method-assign]
    try:
        await asyncio.gather(_tokens(a, 12, PROMPT), _tokens(b, 12, PROMPT[:9]))
        assert a.lane.steps >= 3 and b.lane.steps >= 3 and dp.lane.decoding()
        assert await _tokens(other, 2, long_prompt) == want[0]
        assert chunks, "the prompt was not paced: the lane's sessions no longer counted as decoding"
        assert not any(held for _, held in chunks)  # nothing to hold: the decoders had paused
        # the last chunk is the prompt's remainder, whatever its size (a loaded run gave 8, 8, 64, 72, 8).
        # At most three of the smallest: the first (nothing measured), and when the first wait ran out
        # (the decoders had just stepped), the chunk after it and the one after the verdict doubted
        # right after such a wait (docs/lane.md); then quiet-sized chunks. Cut up, it was 17 of 8.
        assert sum(n == MIN_TOKENS for n, _ in chunks[:-1]) <= 3, chunks
    finally:
        for c in (a, b, other):
            await c.close()
        await transport.close()


async def test_a_prompt_sent_in_steps_awaits_the_caller_between_them_and_gets_the_same_tokens(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    """generate's `prefill_chunk` / `between_chunks` (a control plane holds a heavier user's prompt
    there while a lighter user's prefills, webapp/routing/quota.py): the prompt reaches the hop in
    steps of that size (then doubling), the caller is awaited between two, and the answer is the whole
    prompt's."""
    dp, url = node
    prompt = (PROMPT * 4)[:50]
    want = (await _alone(url, manifest, signing_key, [(prompt, 6)]))[0]
    c = _client(url, manifest, signing_key, lane=False)
    waits: list[int] = []

    async def between() -> None:
        waits.append(dp.stats()["tokens_in"])

    try:
        before = dp.stats()["tokens_in"]
        got = [
            t
            async for t, _ in c.generate(prompt, SamplingParams(), 6, prefill_chunk=4, between_chunks=between)
        ]
        assert got == want
        # eight steps of 4, then 8, then the last 10 (up to 16): awaited between two
        assert [n - before for n in waits] == [4, 8, 12, 16, 20, 24, 28, 32, 40]
    finally:
        await c.close()


async def test_a_prompt_closed_mid_prefill_beside_the_lane_frees_its_session_and_the_decoders_go_on(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    import asyncio

    dp, url = node
    want = await _alone(url, manifest, signing_key, [(PROMPT, 40), (PROMPT[:9], 40)])
    transport = HopTransport()
    a, b = (_client(url, manifest, signing_key, transport=transport) for _ in range(2))
    other = _client(url, manifest, signing_key, lane=False)
    try:
        decoding = asyncio.gather(_tokens(a, 40, PROMPT), _tokens(b, 40, PROMPT[:9]))
        await _on_the_lane(a, b)
        mixed = dp.stats()["prefill_mixed_chunks"]
        prompt = asyncio.ensure_future(_tokens(other, 2, (PROMPT * 40)[:500]))
        for _ in range(2000):  # until the prompt has run a mixed step (bounded poll)
            if dp.stats()["prefill_mixed_chunks"] > mixed:
                break
            await asyncio.sleep(0.005)
        assert dp.stats()["prefill_mixed_chunks"] > mixed
        prompt.cancel()
        await other.close()  # the user went away mid-prompt
        # the decoders were never held for good, and go on exact
        assert list(await decoding) == want
        assert dp.stats()["sessions"] == 2  # the closed prompt's session and KV are gone
    finally:
        for c in (a, b, other):
            await c.close()
        await transport.close()
    assert dp.stats()["sessions"] == 0 and dp.stats()["kv_bytes"] == 0


async def test_a_session_is_admitted_while_another_sessions_step_is_queued_on_the_shard(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any
) -> None:
    import asyncio

    from agent.wire.frames import Kind

    dp, url = node
    (shard,) = dp.shards.values()
    c, other = _client(url, manifest, signing_key), _client(url, manifest, signing_key, lane=False)
    try:
        await _tokens(c, 2)  # prefill and one Python chain step: the hop knows the session
        first = await _tokens(other, 2)  # opened: its next turn's prompt is a step the scheduler queues
        async with shard.lock:  # the shard computes nothing meanwhile: the other's prompt stays queued
            task = asyncio.create_task(_tokens(other, 2, PROMPT + first + PROMPT))
            deadline = time.monotonic() + 10
            while not shard.scheduler.pending():
                assert time.monotonic() < deadline and not task.done(), "the other prompt never queued"
                await asyncio.sleep(0.005)
            resp = await c.link.post(0, c.lane.admit_frame())  # the frame the client sends
        assert resp.kind == Kind.LANE and dp.stats()["lane_sessions"] == 1
        assert len(await task) == 2
    finally:
        await c.close()
        await other.close()


async def test_a_session_that_only_sits_on_the_lane_stops_counting_as_decoding(
    node: tuple[DataPlane, str], manifest: Any, signing_key: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation between turns stays on the lane; counted as decoding, it made every prompt on the
    node prefill in the lane's 8-token chunks for as long as it stayed."""
    import asyncio

    from agent.node import lanes

    dp, url = node
    assert not dp.lane.decoding()
    c = _client(url, manifest, signing_key)
    try:
        monkeypatch.setattr(lanes, "LANE_ACTIVE_S", 30.0)  # a loaded machine may pause between the two
        await _tokens(c)
        assert dp.stats()["lane_sessions"] == 1 and dp.lane.decoding()
        monkeypatch.setattr(lanes, "LANE_ACTIVE_S", 0.3)
        deadline = time.monotonic() + 10
        while dp.lane.decoding():
            assert time.monotonic() < deadline, "an idle lane session still counts as decoding"
            await asyncio.sleep(0.05)
        assert dp.stats()["lane_sessions"] == 1  # still on the lane, only idle
        monkeypatch.setattr(lanes, "LANE_ACTIVE_S", 30.0)
        await _tokens(c, 3, PROMPT + [504])  # it decodes again: it counts again
        assert dp.lane.decoding()
    finally:
        await c.close()


async def test_a_new_session_on_a_full_node_evicts_an_idle_one_not_an_answer_decoding_on_the_lane(
    model_path: str, manifest: Any, signing_key: Any
) -> None:
    """The table saw a lane session as idle since it joined the lane (its steps bypass it), so on a full
    KV budget a new session's admission evicted the running answer before a session idle for longer."""
    import asyncio

    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    block = 256 * 30 * 2 * 3 * 64 * 2  # SmolLM2's KV block: 256 positions, 30 layers, K and V, f16
    dp = DataPlane("node-a", signing_key.public_key(), kv_budget_bytes=2 * block + block // 2)
    dp.load_shard(model_path, manifest, 0, 30, backend="native", n_threads=1)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    want = await _alone(url, manifest, signing_key, [(PROMPT, 200)])
    idle, newcomer = (_client(url, manifest, signing_key, lane=False) for _ in range(2))
    a = _client(url, manifest, signing_key)
    try:
        first = await _tokens(idle, 2)
        answer = asyncio.ensure_future(_tokens(a, 200))  # 213 positions: one KV block
        await _on_the_lane(a)
        await _tokens(idle, 2, PROMPT + first)  # its last turn comes after the answer joined the lane
        assert not answer.done(), "the answer ended before the newcomer came: nothing was tested"
        await _tokens(newcomer, 2)  # a third block: one session must go
        assert dp.sessions.evictions == 1
        assert dp.stats()["lane_sessions"] == 1 and dp.lane.counters["lane_take_offs"] == 0
        assert await answer == want[0]
        (shard,) = dp.shards.values()
        kept = {bytes(sid) for sid, _ in dp.sessions.for_shard(shard.key)}
        assert kept == {bytes(a.link.session), bytes(newcomer.link.session)}  # the idle one went
    finally:
        for c in (idle, newcomer, a):
            await c.close()
        await runner.cleanup()
