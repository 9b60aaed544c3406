"""A deepseek4 route recovers a dead hop whose layers route experts by token id: the replacement is
re-prefilled with the hidden rows the client kept *and* the token ids of those positions (as on the
first pass), so the answer equals an undisturbed one. Without the ids the replacement refuses the
replayed frame ("this shard's layers route by token id") and the answer fails."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.tiny import write_tiny_gguf
from agent.client.recovery import RecoveryPolicy, ReplicaProvider
from agent.client.route import Hop, RouteClient
from agent.node.dataplane import DataPlane, start_dataplane
from agent.wire.routetoken import RouteHop, mint_route
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port

SPLITS = [(0, 2), (2, 4), (4, 6)]  # hop 1 starts with hash-routed layer 2: it needs the ids
HASH_LAYERS = 3
PROMPT = list(range(1000, 1140))  # past position 127: every compression ratio has fired
N_NEW = 12
KILL_AFTER = 5  # tokens streamed before hop 1's node goes away

pytestmark = pytest.mark.slow


class Node:
    """An in-process data plane holding some ranges of the model, that can be killed."""

    def __init__(self, name: str, key: Any, path: Path, manifest: Manifest, ranges: list[tuple[int, int]]):
        self.dp = DataPlane(name, key.public_key())
        self.manifest = manifest
        for a, b in ranges:
            # one thread: on a loaded machine two spinning threads made a prefill 80x slower
            self.dp.load_shard(str(path), manifest, a, b, backend="native", n_threads=1)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.runner: Any = None

    async def start(self) -> Node:
        self.runner = await start_dataplane(self.dp, "127.0.0.1", self.port)
        return self

    async def kill(self) -> None:
        """Stop answering and forget every session (what kill -9 leaves behind, seen from the route)."""
        if self.runner is not None:
            # reset the open connections first (a dead process answers nothing more): a graceful
            # stop would wait for the client's keep-alive connections to go idle
            for handler in self.runner.server.connections if self.runner.server else []:
                if handler.transport is not None:
                    handler.transport.abort()
            await self.runner.cleanup()
            self.runner = None
        for a, b in list((k[1], k[2]) for k in self.dp.shards):
            self.dp.unload_shard(self.manifest.sha256, a, b)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest]:
    path = write_tiny_gguf(
        "deepseek4", tmp_path_factory.mktemp("ds4-failover") / "deepseek4.gguf", hash_layers=HASH_LAYERS
    )
    return path, build_manifest(str(path))


@pytest.mark.parametrize(
    ("seam_cache_bytes", "method"),
    [
        (512 << 20, "reprefill"),  # the seams were kept: only the replacement is re-prefilled
        (1, "reprefill_route"),  # they were dropped: every hop is re-prefilled from hop 0's ids
    ],
)
async def test_a_replaced_hash_routed_hop_is_replayed_with_the_token_ids_and_the_answer_is_unchanged(
    native_lib: None,
    signing_key: Any,
    model: tuple[Path, Manifest],
    seam_cache_bytes: int,
    method: str,
) -> None:
    path, manifest = model
    assert manifest.token_id_layers == HASH_LAYERS
    ends = await Node("node-a", signing_key, path, manifest, [SPLITS[0], SPLITS[2]]).start()
    middle = await Node("node-b", signing_key, path, manifest, [SPLITS[1]]).start()
    spare = await Node("node-c", signing_key, path, manifest, [SPLITS[1]]).start()
    route = [(ends, SPLITS[0]), (middle, SPLITS[1]), (ends, SPLITS[2])]

    def client() -> RouteClient:
        session = os.urandom(16)
        plan = [RouteHop(n.dp.node_id, n.url, a, b) for n, (a, b) in route]
        tokens = mint_route(signing_key, session, manifest.sha256, plan)
        return RouteClient(
            [Hop(n.url, a, b, t) for (n, (a, b)), t in zip(route, tokens, strict=True)],
            session_id=session,
            capacity=1024,
            hidden_dtype="f32",
            token_id_layers=manifest.token_id_layers,
            replacements=ReplicaProvider([spare.url], signing_key, session),
            recovery=RecoveryPolicy(checkpoint_tokens=0, seam_cache_bytes=seam_cache_bytes),
        )

    undisturbed, disturbed = client(), client()
    try:
        want = [t async for t, _ in undisturbed.generate(PROMPT, SamplingParams(), N_NEW)]
        assert undisturbed.recoveries == []
        got: list[int] = []
        async for t, _ in disturbed.generate(PROMPT, SamplingParams(), N_NEW):
            got.append(t)
            if len(got) == KILL_AFTER:
                await middle.kill()
        assert got == want
        assert [r["methods"] for r in disturbed.recoveries] == [[method]]
        assert disturbed.hops[1].url == spare.url
        assert spare.dp.stats()["sessions"] == 1
    finally:
        for c in (undisturbed, disturbed):
            await c.close()
        for n in (ends, middle, spare):
            await n.kill()
