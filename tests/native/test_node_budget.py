"""One KV budget per node: two native shards share it in libggswarm, and health reports what C holds."""

from __future__ import annotations

import os

import numpy as np
from aiohttp import ClientSession

from agent.artifacts.manifest import Manifest
from agent.backends.base import StepInput
from agent.client.route import Hop, RouteClient, RouteError
from agent.node.dataplane import DataPlane, start_dataplane
from agent.procs import free_port
from agent.wire.routetoken import mint
from agent.wire.sampling import SamplingParams

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314]
BUDGET = 8 << 20
SPLITS = ((0, 15), (15, 30))


async def _health(url: str) -> dict:
    async with ClientSession() as http, http.get(url + "/v1/health") as r:
        assert r.status == 200
        return await r.json()


async def test_a_node_with_two_native_shards_refuses_a_session_that_would_take_it_over_its_budget(
    native_lib: None, model_path: str, manifest: Manifest, signing_key
) -> None:  # noqa: ANN001
    dp = DataPlane("node-b", signing_key.public_key(), kv_budget_bytes=BUDGET)
    for a, b in SPLITS:
        dp.load_shard(model_path, manifest, a, b, backend="native", n_threads=2)
    budget = dp.sessions.native_budget()
    seen: list[tuple[str, object, object]] = []  # (shard, dtype of the hidden rows in, dtype out)
    for shard in dp.shards.values():
        inner = shard.backend.forward

        def spy(step: StepInput, _inner=inner, _name=f"{shard.spec.layer_start}:{shard.spec.layer_end}"):  # noqa: ANN001, ANN202
            res = _inner(step)
            hidden = step.hidden
            seen.append(
                (
                    _name,
                    None if hidden is None else hidden.dtype,
                    None if res.hidden is None else res.hidden.dtype,
                )
            )
            return res

        shard.backend.forward = spy  # type: ignore[method-assign]  # records what crosses the seam
    # SmolLM2: 15 layers x 3 KV heads x 64 x (K + V) x f16 = 11,520 bytes per position on each shard
    per_position = 15 * 3 * 64 * 2 * 2
    # a 300-token prompt takes 512 positions on each shard: either alone fits the node, both do not
    assert 512 * per_position < BUDGET < 2 * 512 * per_position
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    url = f"http://127.0.0.1:{port}"

    def client() -> RouteClient:
        session = os.urandom(16)
        hops = [
            Hop(url, a, b, mint(signing_key, session, manifest.sha256, a, b, "node-b")) for a, b in SPLITS
        ]
        return RouteClient(hops, session_id=session, hidden_dtype="f16")

    small, big = client(), client()
    try:
        await small.forward(PROMPT, SamplingParams())
        # an f16 seam (asked for: the default is f32): the first shard's library writes f16 rows, and
        # the frame's f16 payload reaches the second shard's library as f16 (no f32 copy in between)
        assert seen == [("0:15", None, np.float16), ("15:30", np.float16, None)]
        health = await _health(url)
        total, used = budget.usage()
        assert used == 2 * 256 * per_position  # 256-position blocks, on both shards, in one budget
        assert (health["kv_budget_bytes"], health["kv_bytes"]) == (total, used) == (BUDGET, used)
        assert health["kv_remaining_bytes"] == total - used

        try:
            await big.forward(list(range(100, 400)), SamplingParams())
            raise AssertionError("the node admitted more KV than its budget")
        except RouteError as e:
            assert (e.status, e.code, e.hop) == (503, "kv_budget", 1), e
        # the first shard evicted the idle small session to take big's first half; the second could
        # only have made room by evicting big's own first half, which admission never does
        assert dp.sessions.evictions == 2
        total, used = budget.usage()
        assert used == 512 * per_position <= BUDGET
        health = await _health(url)
        assert (health["kv_bytes"], health["kv_remaining_bytes"]) == (used, total - used)
    finally:
        for c in (small, big):
            await c.close()
        await runner.cleanup()
    assert budget.usage()[1] == 0  # closing the sessions gave every byte back
    for shard in list(dp.shards.values()):
        dp.unload_shard(*shard.key)
