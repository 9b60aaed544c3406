"""Route tokens: signed grants verified offline; forged, expired and malformed tokens refused."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from agent.wire.routetoken import (
    RouteClaims,
    RouteHop,
    TokenError,
    TokenVerifier,
    decode_unverified,
    generate_key,
    load_public_key,
    mint,
    mint_replacement,
    mint_route,
    public_key_b64,
)

SHA = "ab" * 32


def test_a_minted_token_verifies_and_names_its_grant() -> None:
    key = generate_key()
    tok = mint(key, b"s" * 16, SHA, 10, 20, "node-a", ttl_s=60)
    claims = TokenVerifier(load_public_key(public_key_b64(key.public_key()))).verify(tok)
    assert (claims.session, claims.model_sha256, claims.layer_start, claims.layer_end, claims.node) == (
        b"s" * 16,
        SHA,
        10,
        20,
        "node-a",
    )


def test_a_token_signed_by_another_key_is_forged() -> None:
    tok = mint(generate_key(), b"s" * 16, SHA, 0, 10, "n")
    with pytest.raises(TokenError, match="signature"):
        TokenVerifier(generate_key().public_key()).verify(tok)


def test_a_tampered_layer_range_breaks_the_signature() -> None:
    key = generate_key()
    tok = bytearray(mint(key, b"s" * 16, SHA, 0, 10, "n"))
    tok[1 + 16 + 32 + 2] = 30  # layer_end 10 -> 30
    with pytest.raises(TokenError, match="signature"):
        TokenVerifier(key.public_key()).verify(bytes(tok))


def test_an_expired_token_is_refused_even_when_cached() -> None:
    key = generate_key()
    v = TokenVerifier(key.public_key())
    tok = mint(key, b"s" * 16, SHA, 0, 10, "n", ttl_s=5)
    v.verify(tok)
    with pytest.raises(TokenError, match="expired"):
        v.verify(tok, now=time.time() + 10)


@pytest.mark.parametrize("raw", [b"", b"\x01" * 10, b"\x02" + b"\0" * 200, b"\x01" * 2000])
def test_malformed_tokens_are_refused(raw: bytes) -> None:
    with pytest.raises(TokenError):
        TokenVerifier(generate_key().public_key()).verify(raw)


def test_decoding_reads_the_claims_without_the_key() -> None:
    tok = mint(generate_key(), b"q" * 16, SHA, 3, 4, "node-ü")
    assert decode_unverified(tok).node == "node-ü"


def test_a_minted_route_binds_each_hop_to_the_next_and_the_last_to_none() -> None:
    key = generate_key()
    hops = [RouteHop("node-a", "http://a:1/", 0, 10), RouteHop("node-b", "https://b:2", 10, 20)]
    first, last = (TokenVerifier(key.public_key()).verify(t) for t in mint_route(key, b"s" * 16, SHA, hops))
    assert (first.node, first.next_node, first.next_url) == ("node-a", "node-b", "https://b:2")
    assert (last.node, last.next_node, last.next_url) == ("node-b", "", "")
    # the URL is signed without its trailing slash, as a hop compares it
    assert decode_unverified(mint_route(key, b"s" * 16, SHA, hops[::-1])[0]).next_url == "http://a:1"


def test_a_replacement_is_named_by_the_hop_before_it_and_names_the_hop_after_it() -> None:
    key = generate_key()
    route = [
        RouteHop("node-a", "http://a:1", 0, 10),
        RouteHop("node-spare", "http://spare:9/", 10, 20),  # has just replaced the middle hop
        RouteHop("node-c", "http://c:3", 20, 30),
    ]
    token, previous = mint_replacement(key, b"s" * 16, SHA, route, 1)
    new, before = (TokenVerifier(key.public_key()).verify(t) for t in (token, previous))
    assert (new.node, new.layer_start, new.next_node, new.next_url) == (
        "node-spare",
        10,
        "node-c",
        "http://c:3",
    )
    assert (before.node, before.layer_start, before.next_node, before.next_url) == (
        "node-a",
        0,
        "node-spare",
        "http://spare:9",
    )

    # the same grants as a route minted whole (expiry aside: minted a moment apart); the first hop has
    # no hop before it to mint again
    def grant(t: bytes) -> RouteClaims:
        return replace(decode_unverified(t), expiry=0)

    assert [grant(previous), grant(token)] == [grant(t) for t in mint_route(key, b"s" * 16, SHA, route)[:2]]
    assert mint_replacement(key, b"s" * 16, SHA, route, 0)[1] == b""


def test_a_tampered_next_hop_breaks_the_signature_and_an_overlong_one_is_refused() -> None:
    key = generate_key()
    tok = bytearray(mint(key, b"s" * 16, SHA, 0, 10, "n", next_node="m", next_url="http://good:1"))
    i = tok.index(b"good")
    tok[i : i + 4] = b"evil"
    with pytest.raises(TokenError, match="signature"):
        TokenVerifier(key.public_key()).verify(bytes(tok))
    with pytest.raises(TokenError, match="255"):
        mint(key, b"s" * 16, SHA, 0, 10, "n", next_node="m", next_url="http://" + "a" * 300)
