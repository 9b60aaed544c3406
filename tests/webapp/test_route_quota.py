"""The route-session service's per-user accounting (webapp/routing/quota.py): the fair admission of
prefills, and the stream leases shared by web processes through Redis."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest

from webapp.routing.quota import FairGate, StreamLease, StreamSlots


async def _admission_order(gate: FairGate, queued: list[str]) -> list[str]:
    """Queue `queued` (user names, in arrival order) behind a held place; release one place at a time."""
    admitted: list[str] = []

    async def wait(name: str) -> None:
        await gate.acquire(name[0])
        admitted.append(name)

    await gate.acquire("x")  # someone is prefilling
    tasks = []
    for name in queued:
        tasks.append(asyncio.create_task(wait(name)))
        await asyncio.sleep(0)  # each is queued before the next arrives
    for _ in queued:
        gate.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return admitted


async def test_waiting_prefills_are_admitted_round_robin_by_user_not_in_arrival_order() -> None:
    gate = FairGate(lambda: 1)
    order = await _admission_order(gate, ["a1", "a2", "a3", "a4", "a5", "a6", "b1", "c1", "b2"])
    # user a queued six prompts first; b and c each wait behind at most one of them, not all six
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3", "a4", "a5", "a6"]


async def test_a_user_alone_is_admitted_at_once_up_to_the_capacity() -> None:
    gate = FairGate(lambda: 3)
    for _ in range(3):
        await asyncio.wait_for(gate.acquire("a"), 0.1)
    assert gate.active == 3
    waiting = asyncio.create_task(gate.acquire("b"))
    await asyncio.sleep(0)
    assert not waiting.done() and gate.waiting() == 1
    gate.release()
    await asyncio.wait_for(waiting, 0.1)
    assert gate.active == 3 and gate.waiting() == 0


async def test_a_cancelled_waiter_passes_its_place_on_and_a_block_gives_its_place_back() -> None:
    gate = FairGate(lambda: 1)
    await gate.acquire("a")
    b = asyncio.create_task(gate.acquire("b"))
    c = asyncio.create_task(gate.acquire("c"))
    await asyncio.sleep(0)
    b.cancel()
    await asyncio.gather(b, return_exceptions=True)
    gate.release()
    await asyncio.wait_for(c, 0.1)
    assert gate.active == 1 and gate.waiting() == 0
    gate.release()
    assert gate.active == 0
    async with gate.turn("d") as turn:
        assert gate.active == 1
        turn.prefilled()  # the first piece came: the place is free before the answer ends
        assert gate.active == 0
    assert gate.active == 0, "giving it back twice frees one place only"


async def test_a_heavy_users_decode_steps_give_way_to_a_lighter_users_prefill_for_a_bounded_time(
    settings: Any,
) -> None:
    gate = FairGate(lambda: 4)
    async with gate.turn("a") as a1, gate.turn("a") as a2:
        a1.prefilled()
        a2.prefilled()
        await asyncio.wait_for(a1.pace(), 0.1)  # nobody else prefills: no wait
        async with gate.turn("b") as b:
            stepped = asyncio.create_task(a1.pace())
            await asyncio.sleep(0.05)
            assert not stepped.done(), "user a (two answers) waits while user b (one) prefills"
            b.prefilled()
            await asyncio.wait_for(stepped, 0.1)
            async with gate.turn("c") as c:
                await asyncio.wait_for(b.pace(), 0.1)  # b and c run one answer each: neither waits
                settings.ROUTE_GIVE_WAY_MS = 50
                t0 = time.monotonic()
                await a1.pace()  # c never finishes its prefill: a's step goes on after 50 ms
                assert 0.04 <= time.monotonic() - t0 < 0.5
                c.prefilled()
    assert gate.running == {} and gate.prefilling == {} and gate.active == 0


def test_stream_leases_are_shared_by_processes_in_redis_and_lapse_unless_renewed(settings: Any) -> None:
    import redis

    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {url}")
    settings.REDIS_URL = url
    user = int.from_bytes(os.urandom(4), "big")
    web1, web2 = StreamSlots(), StreamSlots()  # two web processes
    first = web1.take(user, 2, 60)
    assert first is not None and web2.take(user, 2, 60) is not None
    assert web2.take(user, 2, 60) is None and web1.held(user) == 2
    web1.give_back(user, first)
    short = web2.take(user, 2, 0.2)
    assert short is not None and web1.take(user, 2, 60) is None
    time.sleep(0.3)
    assert web1.take(user, 2, 60) is not None, "an answer that never gave its lease back lapsed"
    renewed = web1.take(user, 3, 0.2)
    assert renewed is not None
    web1.renew(user, renewed, 60)
    time.sleep(0.3)
    assert web1.held(user) == 3


def _redis_url() -> str:
    import redis

    url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_timeout=2).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {url}")
    return url


async def test_an_answer_gives_its_place_back_without_waiting_on_redis_from_the_event_loop(
    settings: Any, hung_redis_url: str
) -> None:
    """release() ran its Redis call on the event loop: a Redis that hangs stalled the whole web process
    for the client's 2 s timeout at the end of every answer."""
    settings.REDIS_URL = hung_redis_url
    lease = StreamLease(7, "lease-of-an-answer-that-ended")
    t0 = time.monotonic()
    lease.release()
    assert time.monotonic() - t0 < 0.5 and lease.lease is None


async def test_a_place_given_back_is_free_for_the_users_next_answer_before_redis_hears_of_it(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next turn may start right after an answer's last message: this process's next take removes
    the returned lease itself, while the worker thread's removal is still on its way."""
    settings.REDIS_URL = _redis_url()
    slots, user, let_go = StreamSlots(), int.from_bytes(os.urandom(4), "big"), threading.Event()
    real = slots.give_back
    monkeypatch.setattr(slots, "give_back", lambda u, lease: (let_go.wait(10), real(u, lease)))
    first = slots.take(user, 1, 60)
    assert first is not None and slots.take(user, 1, 60) is None
    slots.give_back_soon(user, first)  # its removal from Redis waits in a worker thread
    second = slots.take(user, 1, 60)
    let_go.set()
    assert second is not None and slots.take(user, 1, 60) is None, "one place, held by the next answer"
    await asyncio.sleep(0.2)
    slots.give_back(user, second)
    assert slots.held(user) == 0


async def test_a_heavier_users_new_prompt_waits_for_a_lighter_users_prefill_holding_no_place(
    settings: Any,
) -> None:
    gate = FairGate(lambda: 2)
    async with gate.turn("a") as a1:
        a1.prefilled()  # user a decodes one answer
        async with gate.turn("b") as b:  # user b's first answer prefills
            admitted = asyncio.Event()

            async def a_second() -> None:
                async with gate.turn("a") as a2:
                    admitted.set()
                    a2.prefilled()

            second = asyncio.create_task(a_second())
            await asyncio.sleep(0.05)
            # a would run two answers against b's one: its prompt waits, and takes no place meanwhile
            assert not admitted.is_set() and gate.active == 1
            async with gate.turn("c") as c:  # another user's first answer is not held by b's
                assert gate.active == 2
                c.prefilled()
            b.prefilled()
            await asyncio.wait_for(second, 0.1)
        # b's next prompt prefills and never finishes: a's new prompt goes on after ROUTE_GIVE_WAY_MS
        async with gate.turn("b") as b2:
            settings.ROUTE_GIVE_WAY_MS = 50
            t0 = time.monotonic()
            async with gate.turn("a") as a3:
                assert 0.04 <= time.monotonic() - t0 < 0.5
                a3.prefilled()
            b2.prefilled()
    assert gate.running == {} and gate.prefilling == {} and gate.active == 0


async def test_a_user_running_other_answers_prefills_in_steps_that_wait_for_a_lighter_users_prefill(
    settings: Any,
) -> None:
    from agent.client.failover import PREFILL_CHUNK
    from webapp.routing.quota import YIELDING_PREFILL_TOKENS

    gate = FairGate(lambda: 4)
    async with gate.turn("a") as a1:
        assert a1.prefill_steps() == (PREFILL_CHUNK, None)  # a user's only answer: one step
        a1.prefilled()
        async with gate.turn("a") as a2:  # its second, beside the first: steps that give way
            size, between = a2.prefill_steps()
            assert size == YIELDING_PREFILL_TOKENS and between is not None
            await asyncio.wait_for(between(), 0.1)  # nobody lighter prefills: no wait
            async with gate.turn("b") as b:
                assert b.prefill_steps() == (PREFILL_CHUNK, None)
                step = asyncio.create_task(between())
                await asyncio.sleep(0.05)
                assert not step.done(), "a's next prompt step waits while b (one answer) prefills"
                b.prefilled()
                await asyncio.wait_for(step, 0.1)
            a2.prefilled()
    assert gate.running == {} and gate.prefilling == {} and gate.active == 0
