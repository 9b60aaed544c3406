"""Prefix snapshots: a new session that starts with a shared prefix restores every hop's state there and
gets the tokens a full prefill gives; a route with a hop that lacks it prefills and every hop holds one
length again; saves keep only the prefix itself, checked against the ids where a hop holds them; the
store stays within its bytes and never mixes windows."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agent.client.errors import RouteError
from agent.client.prefix import PREFIX_MIN_TOKENS
from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.node.dataplane import DataPlane, start_dataplane
from agent.node.prefixes import PrefixEntry, PrefixStore
from agent.wire.frames import Op
from agent.wire.ids import SessionId
from agent.wire.prefix import prefix_digest
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port

SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314] * 6  # 78 ids
QUESTIONS = ([28, 1201, 253, 1, 4237, 30], [504, 3458, 282, 4237, 314, 2, 378])
SPLITS = ((0, 15, "node-a"), (15, 30, "node-b"))


@pytest.fixture
async def route_nodes(
    model_path: str, manifest: Any, signing_key: Any
) -> AsyncIterator[list[tuple[DataPlane, str]]]:
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    out, runners = [], []
    for a, b, name in SPLITS:
        dp = DataPlane(name, signing_key.public_key())
        dp.load_shard(model_path, manifest, a, b, backend="native", n_threads=1)
        port = free_port()
        runners.append(await start_dataplane(dp, "127.0.0.1", port))
        out.append((dp, f"http://127.0.0.1:{port}"))
    yield out
    for r in runners:
        await r.cleanup()


def _client(nodes: list[tuple[DataPlane, str]], manifest: Any, key: Any) -> RouteClient:
    session = SessionId(os.urandom(16))
    plan = [RouteHop(name, url, a, b) for (_, url), (a, b, name) in zip(nodes, SPLITS, strict=True)]
    return RouteClient(minted_hops(key, session, manifest.sha256, plan), session_id=session, mode="chain")


async def _answer(c: RouteClient, prompt: list[int], shared: int = 0, n: int = 8) -> list[int]:
    try:
        return [t async for t, _ in c.generate(prompt, SamplingParams(), n, shared_prefix=shared)]
    finally:
        await c.close()


async def test_a_new_session_restores_a_shared_prefix_and_gets_the_tokens_of_a_full_prefill(
    route_nodes: list[tuple[DataPlane, str]], manifest: Any, signing_key: Any
) -> None:
    assert len(SYSTEM) >= PREFIX_MIN_TOKENS
    first_prompt, second_prompt = (SYSTEM + q for q in QUESTIONS)
    want = await _answer(_client(route_nodes, manifest, signing_key), second_prompt)

    first = _client(route_nodes, manifest, signing_key)
    await _answer(first, first_prompt, shared=len(SYSTEM))
    assert first.last_prefix == {"shared_tokens": len(SYSTEM), "hit": False, "saved": True}
    assert [dp.stats()["prefix_entries"] for dp, _ in route_nodes] == [1, 1]

    # another session (another user) with the same system prompt: only its question is prefilled
    second = _client(route_nodes, manifest, signing_key)
    got = await _answer(second, second_prompt, shared=len(SYSTEM))
    assert second.last_prefix["hit"] is True and second.last_prefilled == len(QUESTIONS[1])
    assert got == want
    assert [dp.stats()["prefix_hits"] for dp, _ in route_nodes] == [1, 1]
    # the first session's question and answer were never kept: one entry per hop, the prefix's length
    assert all(k[3] == len(SYSTEM) for dp, _ in route_nodes for k in dp.prefixes._entries)


async def test_a_hop_without_the_prefix_makes_the_route_prefill_and_the_others_give_theirs_back(
    route_nodes: list[tuple[DataPlane, str]], manifest: Any, signing_key: Any
) -> None:
    prompt = SYSTEM + QUESTIONS[0]
    want = await _answer(_client(route_nodes, manifest, signing_key), prompt)
    await _answer(_client(route_nodes, manifest, signing_key), prompt, shared=len(SYSTEM))
    (_, _), (b, _) = route_nodes
    b.prefixes.drop_range(manifest.sha256, 15, 30)  # evicted on the last hop only

    c = _client(route_nodes, manifest, signing_key)
    got = await _answer(c, prompt, shared=len(SYSTEM))
    assert got == want and c.last_prefix == {"shared_tokens": len(SYSTEM), "hit": False, "saved": True}
    assert [dp.stats()["prefix_entries"] for dp, _ in route_nodes] == [1, 1]


async def test_a_save_keeps_only_a_session_at_exactly_the_prefix_checked_against_its_ids(
    route_nodes: list[tuple[DataPlane, str]], manifest: Any, signing_key: Any
) -> None:
    c = _client(route_nodes, manifest, signing_key)
    try:
        await c.forward(SYSTEM + QUESTIONS[0], SamplingParams())
        link = c.link
        n = len(SYSTEM)
        # the session went past the prefix: its continuation is never kept under the prefix's name
        for i in range(2):
            frame = c.prefix.frame(i, Op.PREFIX_SAVE, n, prefix_digest(SYSTEM))
            with pytest.raises(RouteError, match="bad_position|holds"):
                await link.post(i, frame)
        await c.truncate(n)
        # the last hop holds the ids: another text's digest at the right length is refused there
        wrong = c.prefix.frame(1, Op.PREFIX_SAVE, n, prefix_digest(list(reversed(SYSTEM))))
        with pytest.raises(RouteError, match="prefix_mismatch|digest"):
            await link.post(1, wrong)
        # and a restore goes into an empty session only
        load = c.prefix.frame(0, Op.PREFIX_LOAD, n, prefix_digest(SYSTEM))
        with pytest.raises(RouteError, match="bad_position|empty"):
            await link.post(0, load)
    finally:
        await c.close()
    assert all(dp.stats()["prefix_entries"] == 0 for dp, _ in route_nodes)


def _entry(size: int) -> PrefixEntry:
    return PrefixEntry(b"x" * size)


def test_the_store_evicts_the_least_recently_used_within_its_bytes_and_never_overwrites() -> None:
    store = PrefixStore(300)
    keys = [("m", 0, 10, 64, bytes([i]) * 32) for i in range(4)]
    assert store.put(keys[0], _entry(100)) and store.put(keys[1], _entry(100))
    assert store.get(keys[0]) is not None  # used: keys[1] is now the oldest
    assert store.put(keys[2], _entry(100)) and store.put(keys[3], _entry(100))
    assert keys[1] not in store and keys[0] in store and store.used_bytes <= 300
    assert not store.put(keys[0], PrefixEntry(b"y" * 10))  # the first save stands
    assert store.get(keys[0]).data == b"x" * 100  # type: ignore[union-attr]
    assert not store.put(("m", 0, 10, 64, b"z" * 32), _entry(301))  # bigger than the whole store
    assert store.stats()["prefix_evictions"] == 1


def test_entries_are_per_window_and_go_with_it() -> None:
    store = PrefixStore(1000)
    digest = prefix_digest(SYSTEM)
    store.put(("m", 0, 15, 78, digest), _entry(10))
    assert store.get(("m", 0, 10, 78, digest)) is None  # another range
    assert store.get(("other", 0, 15, 78, digest)) is None  # another model
    store.drop_range("m", 0, 15)
    assert len(store) == 0 and store.used_bytes == 0
