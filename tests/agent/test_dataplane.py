"""The data plane in-process: a route may pass through one node twice, on two of its shards."""

from __future__ import annotations

import os

from agent.backends.base import ShardSpec
from agent.backends.torch_llama import TorchLlamaBackend
from agent.client.route import Hop, RouteClient
from agent.node.dataplane import DataPlane, start_dataplane
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port
from tests.helpers import greedy_through

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314]


async def test_a_node_holding_two_consecutive_shards_serves_both_hops_of_one_session(
    model_path, manifest, signing_key
) -> None:  # noqa: ANN001
    dp = DataPlane("node-x", signing_key.public_key())
    dp.load_shard(model_path, manifest, 0, 15, backend="torch", n_threads=2)
    dp.load_shard(model_path, manifest, 15, 30, backend="torch", n_threads=2)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    session = os.urandom(16)
    hops = [
        Hop(url, a, b, mint(signing_key, session, manifest.sha256, a, b, "node-x"))
        for a, b in ((0, 15), (15, 30))
    ]
    client = RouteClient(hops, session_id=session)
    try:
        got = [t async for t, _ in client.generate(PROMPT, SamplingParams(), 8)]
        assert dp.stats()["sessions"] == 2
    finally:
        await client.close()
        await runner.cleanup()
    assert dp.stats()["sessions"] == 0 and dp.stats()["kv_bytes"] == 0

    want = greedy_through([TorchLlamaBackend(ShardSpec(model_path, 0, 30, manifest, n_threads=2))], PROMPT, 8)
    assert got == want


async def test_a_full_kv_budget_evicts_the_idle_session_and_refuses_one_that_cannot_fit(
    model_path, manifest, signing_key
) -> None:  # noqa: ANN001
    from agent.client.route import RouteError

    # All 30 layers on torch hold 46,080 bytes of KV per position, allocated 256 positions (11.8 MB) at a time.
    dp = DataPlane("node-y", signing_key.public_key(), kv_budget_bytes=16 << 20)
    dp.load_shard(model_path, manifest, 0, 30, backend="torch", n_threads=2)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"

    def client() -> RouteClient:
        session = os.urandom(16)
        return RouteClient(
            [Hop(url, 0, 30, mint(signing_key, session, manifest.sha256, 0, 30, "node-y"))],
            session_id=session,
        )

    a, b, big = client(), client(), client()
    try:
        await a.forward(PROMPT, SamplingParams())
        await b.forward(PROMPT, SamplingParams())  # a is idle: evicted to make room
        assert dp.stats()["evictions"] == 1 and dp.stats()["sessions"] == 1
        try:
            await a.forward([5], SamplingParams())
            raise AssertionError("the evicted session answered")
        except RouteError as e:
            assert (e.status, e.code) == (404, "unknown_session")
        try:
            await big.forward(list(range(100, 400)), SamplingParams())  # 512 positions alone exceed 16 MiB
            raise AssertionError("an oversized session was admitted")
        except RouteError as e:
            assert (e.status, e.code) == (503, "kv_budget") and "budget" in str(e)
        stats = dp.stats()
        assert stats["kv_bytes"] <= 16 << 20
        assert stats["kv_remaining_bytes"] == (16 << 20) - stats["kv_bytes"]
        await b.forward([5], SamplingParams())  # the surviving session is unaffected
    finally:
        for c in (a, b, big):
            await c.close()
        await runner.cleanup()


async def test_a_route_that_stops_short_of_the_last_layer_says_so_instead_of_sending_a_bogus_token(
    model_path, manifest, signing_key
) -> None:  # noqa: ANN001
    import pytest

    from agent.client.route import RouteError

    dp = DataPlane("node-z", signing_key.public_key())
    dp.load_shard(model_path, manifest, 0, 15, backend="torch", n_threads=2)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"
    session = os.urandom(16)
    client = RouteClient(
        [Hop(url, 0, 15, mint(signing_key, session, manifest.sha256, 0, 15, "node-z"))], session_id=session
    )
    try:
        with pytest.raises(RouteError, match=r"layers 0:15\) answered F\d+ rather than a sampled token") as e:
            [t async for t, _ in client.generate(PROMPT, SamplingParams(), 4)]
        assert e.value.code == "no_token"
        assert dp.stats()["tokens_in"] == len(PROMPT)  # the prompt went in; no bogus decode step followed
    finally:
        await client.close()
        await runner.cleanup()
