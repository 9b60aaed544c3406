"""Property tests of route tokens and hand-off tokens: genuine ones verify, anything altered is refused
with the module's own error, never another exception."""

from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from agent.wire.handofftoken import HandoffTokenError, mint_handoff, verify_handoff
from agent.wire.ids import SessionId
from agent.wire.routetoken import TokenError, TokenVerifier, decode_unverified, generate_key, mint
from tests.agent._fuzz import FUZZ, mutated

KEY = generate_key()
OTHER = generate_key()
SHA = "ab" * 32
node_ids = st.text(st.characters(min_codepoint=33, max_codepoint=0x24F), min_size=1, max_size=40)
ranges = st.tuples(st.integers(0, 200), st.integers(1, 60)).map(lambda t: (t[0], t[0] + t[1]))


@FUZZ
@given(node_ids, ranges)
def test_a_minted_route_token_verifies_to_its_claims(node: str, rng: tuple[int, int]) -> None:
    session = SessionId(os.urandom(16))
    claims = TokenVerifier(KEY.public_key()).verify(mint(KEY, session, SHA, rng[0], rng[1], node))
    assert (claims.session, claims.model_sha256, claims.layer_start, claims.layer_end, claims.node) == (
        session,
        SHA,
        rng[0],
        rng[1],
        node,
    )


@FUZZ
@given(st.data())
def test_an_altered_route_token_is_refused_with_a_token_error(data: st.DataObject) -> None:
    token = mint(KEY, SessionId(b"s" * 16), SHA, 0, 10, data.draw(node_ids))
    bad = data.draw(mutated(token))
    verifier = TokenVerifier(KEY.public_key())
    try:
        decode_unverified(bad)
        verifier.verify(bad)
    except TokenError:
        return
    assert bad == token  # only the genuine bytes verify


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_are_never_a_route_token(raw: bytes) -> None:
    try:
        TokenVerifier(KEY.public_key()).verify(raw)
    except TokenError:
        return
    raise AssertionError("random bytes verified")


@FUZZ
@given(node_ids, node_ids, ranges)
def test_a_minted_handoff_token_names_both_nodes(src: str, dst: str, rng: tuple[int, int]) -> None:
    c = verify_handoff(KEY.public_key(), mint_handoff(KEY, b"s" * 16, SHA, rng[0], rng[1], src, dst))
    assert (c.src, c.dst, c.layer_start, c.layer_end, c.model_sha256) == (src, dst, rng[0], rng[1], SHA)


@FUZZ
@given(st.data())
def test_an_altered_or_foreign_handoff_token_is_refused_with_a_handoff_error(data: st.DataObject) -> None:
    token = mint_handoff(KEY, b"s" * 16, SHA, 0, 10, data.draw(node_ids), data.draw(node_ids))
    bad = data.draw(mutated(token))
    try:
        verify_handoff(KEY.public_key(), bad)
    except HandoffTokenError:
        pass
    else:
        assert bad == token
    try:
        verify_handoff(OTHER.public_key(), token)
    except HandoffTokenError:
        return
    raise AssertionError("a token signed by another key verified")
