"""A hop the failover opens in place of a failed one is asked for what the session's own OPEN asked:
the last hop's replacement drafts with the model's MTP head as the hop it replaces did."""

from __future__ import annotations

import os
from typing import Any

from agent.client.recovery import Replacement, minted_hops
from agent.client.route import RouteClient
from agent.wire.frames import Kind, Op, Request, Response, decode_request
from agent.wire.routetoken import RouteHop

SPLITS = [(0, 2), (2, 4), (4, 6)]


def _client(signing_key: Any) -> tuple[RouteClient, list[tuple[int, Request]]]:
    session = os.urandom(16)
    plan = [RouteHop(f"node-{a}", f"http://127.0.0.1:9/{a}", a, b) for a, b in SPLITS]
    c = RouteClient(minted_hops(signing_key, session, "ab" * 32, plan), session_id=session, capacity=256)
    sent: list[tuple[int, Request]] = []

    async def post(i: int, body: bytes, timeout_s: float | None = None, bundle: bool = False) -> Response:
        sent.append((i, decode_request(body)))
        return Response(step=0, kind=Kind.NONE, session_len=0)

    c.link.post = post  # type: ignore[method-assign]  # the seam: frames go nowhere, their fields are read
    return c, sent


async def test_a_replacement_of_the_last_hop_is_asked_for_the_sessions_mtp_drafts(signing_key: Any) -> None:
    c, sent = _client(signing_key)
    c.mtp_draft = 4
    c.link.opened = True
    for i in range(len(SPLITS)):
        await c.failover._restore(i, c.hops[i], Replacement(c.hops[i]), alive=False)
    opens = {i: r.mtp_draft for i, r in sent if r.op == Op.OPEN}
    assert opens == {0: 0, 1: 0, 2: 4}


async def test_a_session_without_mtp_drafts_opens_replacements_without_them(signing_key: Any) -> None:
    c, sent = _client(signing_key)
    c.link.opened = True
    await c.failover._restore(2, c.hops[2], Replacement(c.hops[2]), alive=False)
    assert [r.mtp_draft for _, r in sent if r.op == Op.OPEN] == [0]
