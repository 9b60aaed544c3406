"""A route of native deepseek4 hops through the data plane, on a tiny model whose first three layers
route their experts by token id: the ids travel with the hidden states to the hop holding layer 2, in
star mode from the route client and in chain mode from the hop before it, and the route answers as the
whole model does; without them that hop refuses the frame."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import build_manifest
from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.libggswarm import NativeModel
from agent.client.route import Hop, RouteClient
from agent.wire.routetoken import RouteHop, mint_route
from agent.wire.sampling import SamplingParams
from tests.native.routes import windows_on_one_node

SPLITS = [(0, 2), (2, 4), (4, 6)]  # the second hop starts with hash-routed layer 2
PROMPT = list(range(1000, 1140))  # past position 127: every compression ratio has fired
N_NEW = 12

pytestmark = pytest.mark.slow


def _whole_model_tokens(path: Path) -> list[int]:
    with NativeModel(str(path), 0, 6, n_threads=2) as m:
        sid = m.open_session(1024)
        out = [int(m.forward(sid, 0, token_ids=np.asarray(PROMPT, dtype=np.int32))["token"])]
        while len(out) < N_NEW:
            pos = len(PROMPT) + len(out) - 1
            out.append(int(m.forward(sid, pos, token_ids=np.asarray(out[-1:], dtype=np.int32))["token"]))
    return out


async def test_token_ids_reach_a_downstream_hash_routed_window_in_star_and_chain_mode(
    native_lib: None,
    signing_key,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    path = write_tiny_gguf("deepseek4", tmp_path / "deepseek4.gguf", hash_layers=3)
    manifest = build_manifest(str(path))
    assert [layer.needs_token_ids for layer in manifest.layers] == [True] * 3 + [False] * 3
    want = _whole_model_tokens(path)
    dp, _, runner, url = await windows_on_one_node(path, SPLITS, signing_key.public_key(), "node-d")

    def client(mode: str, token_id_layers: int) -> RouteClient:
        session = os.urandom(16)
        # each token names the next hop: chain mode forwards only there
        plan = [RouteHop("node-d", url, a, b) for a, b in SPLITS]
        tokens = mint_route(signing_key, session, manifest.sha256, plan)
        hops = [Hop(url, a, b, t) for (a, b), t in zip(SPLITS, tokens, strict=True)]
        return RouteClient(
            hops,
            session_id=session,
            mode=mode,
            capacity=1024,
            hidden_dtype="f32",
            token_id_layers=token_id_layers,
        )

    star, chain, blind = client("star", 3), client("chain", 0), client("star", 0)
    try:
        assert [t async for t, _ in star.generate(PROMPT, SamplingParams(), N_NEW)] == want
        assert [t async for t, _ in chain.generate(PROMPT, SamplingParams(), N_NEW)] == want
        with pytest.raises(Exception, match="route by token id"):
            [t async for t, _ in blind.generate(PROMPT, SamplingParams(), N_NEW)]
    finally:
        for c in (star, chain, blind):
            await c.close()
        await runner.cleanup()
