"""The route client's speculative decode loop (docs/speculative.md): each step sends the newest token
and a draft, the hops sample every position in one pass of the route, the drafts equal to those samples
stand and the rest are cut back. The route is handed in (`SpecRoute`: what the loop needs of it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from agent.client.errors import ContextLimitError, RouteError
from agent.client.link import HopStats
from agent.client.spec import (
    MAX_DRAFT,
    Drafter,
    NgramDrafter,
    SpecStats,
    accepted,
    sized_draft,
)
from agent.wire.frames import Kind, Response
from agent.wire.sampling import SamplingParams

# a route this slow keeps a speculating answer off the lanes: an admission costs about a round trip
STICKY_ROUND_TRIP_MS = 5.0


class SpecRoute(Protocol):
    """What the loop reads and drives of a route client (agent/client/route.py RouteClient)."""

    history: list[int]
    capacity: int
    hop_stats: list[HopStats]
    last_spec: SpecStats
    spec_adaptive: bool
    off_lanes: bool
    last_response: Response | None

    @property
    def hops(self) -> Any: ...  # noqa: ANN401

    @property
    def n_vocab(self) -> int | None: ...

    def sampled(self, resp: Response) -> tuple[int, float]: ...

    def check_sampled(self, ids: list[int]) -> None: ...

    def last_hop_error(self, message: str, code: str) -> RouteError: ...

    def cut_back(self, keep: int) -> None: ...

    def send_ahead(
        self, ids: list[int], sampling: SamplingParams, sample_all: bool = False
    ) -> asyncio.Future[Response]: ...

    async def take_ahead(self, step: asyncio.Future[Response]) -> Response: ...

    async def drop_ahead(self, step: asyncio.Future[Response]) -> None: ...


def offer_drafts(drafter: Drafter | None, context_len: int, resp: Response) -> None:
    """Hand the last hop's MTP drafts (after the token ending a context of `context_len`) to a drafter
    that takes them (drafts.MtpDrafter)."""
    offer = getattr(drafter, "offer", None)
    if offer is not None:
        offer(context_len, resp.drafts())


@dataclass
class _Sent:
    """A step sent ahead of the consumer: its drafts, where the history stood, when it left, the hops'
    compute before it and when its answer arrived (not when the loop came back for it)."""

    future: asyncio.Future[Response]
    drafts: list[int]
    base: int
    t0: float
    c0: float
    arrived: float = 0.0

    def landed(self, _: asyncio.Future[Response]) -> None:
        self.arrived = time.perf_counter()


def _ends_at(
    ready: list[tuple[int, float]], produced: int, max_tokens: int, stop_ids: set[int] | None
) -> int:
    """The index in `ready` of the answer's last token (a stop token or the max_tokens-th), or -1."""
    for i, (tok, _) in enumerate(ready):
        if (stop_ids and tok in stop_ids) or produced + i + 1 >= max_tokens:
            return i
    return -1


def in_vocabulary(ids: list[int], n_vocab: int | None) -> list[int]:
    """The leading drafts that are tokens of the model: drafts are hints (a last hop's MTP head, a draft
    model), and one past the vocabulary's end (a lying hop's) ends the draft there, so that hop 0,
    which refuses such an id, is never blamed for another hop's lie."""
    for i, t in enumerate(ids):
        if t < 0 or (n_vocab is not None and t >= n_vocab):
            return ids[:i]
    return ids


def _send(
    route: SpecRoute,
    context: list[int],
    sampling: SamplingParams,
    k: int,
    drafter: Drafter,
) -> _Sent:
    """Draft (up to k, sized by the route's measured costs) after `context` and send the step."""
    stats = route.last_spec
    if route.spec_adaptive:
        k = sized_draft(stats, k)
    t_draft = time.perf_counter()
    drafts = in_vocabulary(drafter.propose(context, k)[:k], route.n_vocab) if k > 0 else []
    stats.drafting(len(drafts), (time.perf_counter() - t_draft) * 1e3)
    if drafts:
        route.off_lanes = route.off_lanes or stats.round_trip_ms >= STICKY_ROUND_TRIP_MS
    # the hops' own compute, as their timings report it; the rest of a step's wall time is the round
    # trip (links, relaying, queueing) that a longer draft spreads over more tokens
    c0, base = sum(h.compute_ms for h in route.hop_stats), len(route.history)
    sent = _Sent(
        route.send_ahead([context[-1], *drafts], sampling, sample_all=bool(drafts)),
        drafts,
        base,
        time.perf_counter(),
        c0,
    )
    sent.future.add_done_callback(sent.landed)
    return sent


async def _settle(
    route: SpecRoute, sent: _Sent, context: list[int], drafter: Drafter
) -> list[tuple[int, float]]:
    """The tokens a step decided: its sample, or the drafts that stood and the sample after them (the
    rest cut back); the step's costs and acceptance go to route.last_spec."""
    stats = route.last_spec
    resp = await route.take_ahead(sent.future)
    wall_ms = ((sent.arrived or time.perf_counter()) - sent.t0) * 1e3
    compute = sum(h.compute_ms for h in route.hop_stats) - sent.c0
    drafts = sent.drafts
    if not drafts:
        stats.plain()
        stats.timed(1, wall_ms, compute)
        ready = [route.sampled(resp)]
        context.append(ready[0][0])
        offer_drafts(drafter, len(context), resp)
        return ready
    stats.timed(len(drafts) + 1, wall_ms, compute, verify=True)
    if resp.kind != Kind.TOKENS or resp.n_tokens != len(drafts) + 1:
        raise route.last_hop_error(
            f"the last hop answered {resp.kind.name} x {resp.n_tokens} to a verification of "
            f"{len(drafts) + 1} positions",
            "bad_verification",
        )
    sampled, lps = resp.tokens()
    route.check_sampled(sampled)
    m = accepted(drafts, sampled)
    stats.record(len(drafts), m)
    context.extend(drafts[:m])
    keep = sent.base + 1 + m  # the token sent and the drafts that stood
    if keep < len(route.history):
        route.cut_back(keep)  # no round trip: each hop goes back when the next frame arrives
    context.append(sampled[m])
    offer_drafts(drafter, len(context), resp)
    return [*zip(drafts[:m], lps[:m], strict=True), (sampled[m], lps[m])]


async def speculative_steps(
    route: SpecRoute,
    token: int,
    logprob: float,
    sampling: SamplingParams,
    max_tokens: int,
    stop_ids: set[int] | None,
    speculate: int,
    drafter: Drafter | None,
) -> AsyncGenerator[tuple[int, float], None]:
    """RouteClient.generate's decode loop with drafts, from the prompt's sampled `token` on: yields
    (token, logprob) as they are decided; `route.last_spec` counts drafts and acceptance.

    As in plain decoding, each step (with its drafts) goes out before the consumer sees the tokens
    decided before it, so the consumer's work overlaps the route's; a consumer that stops leaves that
    step to finish (route.drop_ahead), and the hops' KV equals the history afterwards."""
    drafter = drafter or NgramDrafter()
    # a drafter fed by the hops' answers (MtpDrafter) needs every step's answer: none off the lanes
    route.off_lanes = route.off_lanes or getattr(drafter, "needs_python_path", False)
    context = [*route.history, token]  # every token decided so far; the KV holds all but the last
    ready = [(token, logprob)]  # decided, not yet yielded; only the last is not in the KV
    produced = 0
    sent: _Sent | None = None
    try:
        while True:
            end = _ends_at(ready, produced, max_tokens, stop_ids)
            room = route.capacity - len(context)
            if end >= 0:
                ready = ready[: end + 1]
            elif room >= 0:
                # drafts past the answer's end or the context's would be computed for nothing
                k = min(speculate, MAX_DRAFT, room, max_tokens - produced - len(ready) - 1)
                sent = _send(route, context, sampling, k, drafter)
            for item in ready:
                route.last_response = None
                yield item
            produced += len(ready)
            if end >= 0:
                return
            if sent is None:
                raise ContextLimitError(f"context limit of {route.capacity} tokens reached")
            step, sent = sent, None
            ready = await _settle(route, step, context, drafter)
    finally:
        if sent is not None:
            await route.drop_ahead(sent.future)
