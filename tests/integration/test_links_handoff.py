"""KV hand-off across the link harness: a session moves by snapshot from a hop in one network namespace
to a hop in another (mutual TLS), the snapshot crossing both namespaces' shaped links and a delaying
relay, and the answer goes on there exactly as if it had never moved.

tests/agent/test_handoff.py's exchange (POST /v1/handoff/export naming the target, a hand-off token
naming both nodes), between `agent serve` processes in LinkLab rather than in-process data planes.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable

import pytest
from aiohttp import ClientSession, TCPConnector

from agent.client.route import Hop, RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.dev.links import LinkLab, NetnsHop
from agent.wire.handofftoken import mint_handoff
from agent.wire.routetoken import mint, public_key_b64
from agent.wire.sampling import SamplingParams
from tests.integration.links import fresh_labs, native_labs  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow
LAYERS = (0, 30)
BEFORE, AFTER = 12, 12  # tokens on the first hop, then on the second
RATE_MBIT = 20.0
DELAY_MS = 10.0


def _hop(hop: NetnsHop, session: bytes, key: object, sha256: str) -> Hop:
    return Hop(hop.url, *LAYERS, mint(key, session, sha256, *LAYERS, hop.node_id))


async def test_a_session_handed_off_to_another_namespace_over_the_shaped_link_continues_exactly(
    native_labs: Callable[..., LinkLab],  # noqa: F811
    signing_key,  # noqa: ANN001
    manifest,  # noqa: ANN001
    model_path: str,
) -> None:
    lab = native_labs(2)
    a, b = lab.start_hops(
        model_path, [LAYERS, LAYERS], public_key_b64(signing_key.public_key()), backend="native"
    )
    sha, tls = manifest.sha256, lab.client_ssl()
    prompt = ChatTokenizer(model_path).encode_chat(
        [
            {
                "role": "user",
                "content": "Describe, in some detail, how a lighthouse keeper spends a stormy night.",
            }
        ]
    )
    other = os.urandom(16)  # the undisturbed answer, all of it on the first hop
    undisturbed = RouteClient([_hop(a, other, signing_key, sha)], session_id=other, ssl_context=tls)
    try:
        want = [t async for t, _ in undisturbed.generate(prompt, SamplingParams(), BEFORE + AFTER)]
    finally:
        await undisturbed.close()

    session = os.urandom(16)
    client = RouteClient([_hop(a, session, signing_key, sha)], session_id=session, ssl_context=tls)
    got = [t async for t, _ in client.generate(prompt, SamplingParams(), BEFORE)]
    lab.shape(RATE_MBIT)
    lab.set_delay(DELAY_MS)
    token = mint_handoff(signing_key, session, sha, *LAYERS, a.node_id, b.node_id)
    body = {"token": base64.b64encode(token).decode(), "target": b.url}  # b's relay, from a's namespace
    async with (
        ClientSession(connector=TCPConnector(ssl=tls)) as http,
        http.post(a.url + "/v1/handoff/export", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        moved = await r.json()
    assert moved["session_len"] == len(client.history)
    # the snapshot went from a's namespace through its link, b's relay and b's link, both limited to
    # RATE_MBIT: it took at least its bytes' time at that rate, and the relay's delay there and back
    print(f"\nhand-off: {moved['bytes']} bytes in {moved['export_ms']} ms at {RATE_MBIT:g} Mbit/s")
    assert moved["bytes"] > 100_000
    assert moved["export_ms"] >= max(moved["bytes"] * 8 / (RATE_MBIT * 1e6) * 1e3, 2 * DELAY_MS)

    client.hops[0] = _hop(b, session, signing_key, sha)  # the same client goes on against b
    try:
        got += [t async for t, _ in client.generate(prompt + got, SamplingParams(), AFTER)]
    finally:
        await client.close()
    assert client.last_prefilled == 1  # only the last token recomputed: b holds the moved KV
    assert got == want
