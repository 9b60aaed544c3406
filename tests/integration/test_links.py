"""Routes over the link harness (agent/dev/links.py): hops in network namespaces, mutual TLS, delaying
relays; the same greedy tokens as over loopback, the delay in every step, nothing left behind."""

from __future__ import annotations

import statistics

import pytest

from agent.client.tokenizer import ChatTokenizer
from agent.dev.links import LinkLab, host_links, namespaces, unusable
from agent.wire.routetoken import public_key_b64
from tests.integration.links import decode, lab_pool, link_labs  # noqa: F401 - link_labs is a fixture

pytestmark = pytest.mark.slow
WINDOWS = [(0, 15), (15, 30)]
TOKENS = 12


@pytest.fixture(scope="module")
def native() -> None:
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")


@pytest.fixture(scope="module")
def lab(link_labs, native, signing_key, model_path: str) -> LinkLab:  # noqa: ANN001, F811
    """Two hops of SmolLM2, each in its own namespace, mutual TLS, behind relays."""
    lab = link_labs(2)
    lab.start_hops(model_path, WINDOWS, public_key_b64(signing_key.public_key()), backend="native")
    return lab


@pytest.fixture(scope="module")
def loopback(serve_factory, native) -> list[tuple[str, str, int, int]]:  # noqa: ANN001
    """The same two windows as plain `agent serve` hops on 127.0.0.1: the route to compare with."""
    hops = [serve_factory(f"{a}:{b}", backend="native") for a, b in WINDOWS]
    return [(h.node_id, h.url, a, b) for h, (a, b) in zip(hops, WINDOWS, strict=True)]


@pytest.fixture(scope="module")
def prompt(model_path: str) -> list[int]:
    return ChatTokenizer(model_path).encode_chat([{"role": "user", "content": "Tell me about lighthouses."}])


@pytest.mark.parametrize("mode", ["star", "chain"])
async def test_a_two_hop_route_in_namespaces_decodes_what_loopback_decodes(
    lab: LinkLab,
    loopback,
    signing_key,
    manifest,
    prompt: list[int],
    mode: str,  # noqa: ANN001
) -> None:
    lab.shape(100)
    lab.set_delay(0.5, 0.1)
    want = await decode(loopback, signing_key, manifest.sha256, prompt, TOKENS)
    got = await decode(lab.plan(), signing_key, manifest.sha256, prompt, TOKENS, mode, lab.client_ssl())
    assert all(u.startswith("https://10.201.") for _, u, _, _ in lab.plan())  # the relays, over TLS
    assert got.tokens == want.tokens


@pytest.mark.parametrize("mode", ["star", "chain"])
async def test_a_25_ms_one_way_delay_is_in_every_decode_step(
    lab: LinkLab,
    signing_key,
    manifest,
    prompt: list[int],
    mode: str,  # noqa: ANN001
) -> None:
    lab.shape(None)
    lab.set_delay(25.0)
    try:
        got = await decode(lab.plan(), signing_key, manifest.sha256, prompt, 6, mode, lab.client_ssl())
    finally:
        lab.set_delay(0.0)
    # a step crosses each hop's link there and back (star: the client to each hop; chain: the client
    # to hop 0 and hop to hop, the answer the same way back): 2 x 2 x 25 ms at least, every step
    assert min(got.step_ms) >= 2 * len(WINDOWS) * 25.0, got.step_ms
    # and not much more: the step is the delay plus the hops' work, not a stall behind it
    assert statistics.median(got.step_ms) < 2 * len(WINDOWS) * 25.0 + 150.0, got.step_ms


def test_namespaces_and_veths_are_gone_after_the_labs_even_when_the_body_raises(
    tmp_path_factory,
    native,
    signing_key,
    model_path: str,  # noqa: ANN001
) -> None:
    if reason := unusable():
        pytest.skip(f"the link harness needs network namespaces: {reason}")
    opened: list[LinkLab] = []
    with (
        pytest.raises(RuntimeError, match="the body failed"),
        lab_pool(lambda: tmp_path_factory.mktemp("l")) as labs,
    ):
        opened += [labs(2), labs(1, tls=False)]
        opened[0].start_hops(
            model_path, [(0, 30)], public_key_b64(signing_key.public_key()), backend="native"
        )
        opened[0].shape(20)
        mine = [link.name for lab in opened for link in lab.links]
        veths = [link.host_if for lab in opened for link in lab.links]
        assert len(set(mine)) == 3 and set(mine) <= set(namespaces()) and set(veths) <= set(host_links())
        raise RuntimeError("the body failed")
    assert not set(mine) & set(namespaces())
    assert not set(veths) & set(host_links())
    assert all(h.proc.poll() is not None for h in opened[0].hops)  # the hop stopped too
    relay = opened[0].relay
    assert relay is not None and relay.proc.poll() is not None
