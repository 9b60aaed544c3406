"""Failover across the link harness: a chain-mode route of hops in network namespaces (mutual TLS,
delaying relays, shaped links) loses a hop mid-answer and the client's failover replaces it with a
spare in a third namespace; the answer is the undisturbed one, token for token.

The machinery is tests/integration/test_failover.py's (RouteClient with a ReplicaProvider of spares, a
hop killed -9 after some tokens), with the hops in LinkLab rather than on 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest

from agent.client.recovery import RecoveryPolicy, ReplicaProvider, minted_hops
from agent.client.route import RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.dev.links import LinkLab
from agent.wire.routetoken import RouteHop, public_key_b64
from agent.wire.sampling import SamplingParams
from tests.integration.links import fresh_labs, native_labs  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow
# the route's two hops, and in a third namespace a spare of the second's layers
WINDOWS = [(0, 15), (15, 30), (15, 30)]
N_TOKENS = 48
KILL_AT = 16
POLICY = RecoveryPolicy(deadline_floor_s=1.0, deadline_factor=10.0, give_up_s=60.0)


async def _answer(
    lab: LinkLab, key: object, sha256: str, prompt: list[int], spares: bool, disturb_at: int = -1
) -> tuple[list[int], RouteClient]:
    """A greedy answer over the lab's first two hops in chain mode (as the control plane routes); with
    `spares`, every hop of the lab offered as a replacement; the hop of layers 15:30 killed -9 after
    `disturb_at` tokens."""
    session = os.urandom(16)
    plan = [RouteHop(*h) for h in lab.plan()[:2]]
    provider = (
        ReplicaProvider(
            [h.url for h in lab.hops], key, session, probe_timeout_s=2.0, ssl_context=lab.client_ssl()
        )
        if spares
        else None
    )
    client = RouteClient(
        minted_hops(key, session, sha256, plan),
        session_id=session,
        mode="chain",
        replacements=provider,
        recovery=POLICY,
        ssl_context=lab.client_ssl(),
    )
    out: list[int] = []
    try:
        async for tok, _ in client.generate(prompt, SamplingParams(), N_TOKENS):
            out.append(tok)
            if len(out) == disturb_at:
                os.kill(lab.hops[1].proc.pid, signal.SIGKILL)
    finally:
        await client.close()
    return out, client


async def test_a_hop_killed_mid_answer_across_the_namespaces_is_replaced_by_a_spare_and_the_text_is_unchanged(
    native_labs: Callable[..., LinkLab],  # noqa: F811
    signing_key,  # noqa: ANN001
    manifest,  # noqa: ANN001
    model_path: str,
) -> None:
    lab = native_labs(len(WINDOWS))
    lab.start_hops(model_path, WINDOWS, public_key_b64(signing_key.public_key()), backend="native")
    lab.shape(100)
    lab.set_delay(2.0, 0.2)
    prompt = ChatTokenizer(model_path).encode_chat(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]
    )
    reference, _ = await _answer(lab, signing_key, manifest.sha256, prompt, spares=False)
    victim, spare = lab.hops[1], lab.hops[2]

    got, client = await _answer(lab, signing_key, manifest.sha256, prompt, spares=True, disturb_at=KILL_AT)
    assert victim.proc.wait(10) == -signal.SIGKILL
    assert len(reference) == N_TOKENS and got == reference
    # chain mode with no copy on a spare yet: the whole route re-prefilled, hop 0 now dialling the
    # spare's relay in the third namespace
    assert [r["methods"] for r in client.recoveries] == [["reprefill_route"]]
    assert client.hops[1].url == spare.url and spare.link.name != victim.link.name
    assert all(h.url.startswith("https://10.201.") for h in client.hops)  # relays, over mutual TLS
