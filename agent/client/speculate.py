"""The route client's speculative decode loop (docs/speculative.md): each step sends the newest token
and a draft, the hops sample every position in one pass of the route, the drafts equal to those samples
stand and the rest are cut back. The route is handed in (`SpecRoute`: what the loop needs of it)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from agent.client.errors import ContextLimitError, RouteError
from agent.client.link import HopStats
from agent.client.spec import (
    MAX_DRAFT,
    MEASURE_STEPS,
    Drafter,
    NgramDrafter,
    SpecStats,
    accepted,
    draft_length,
)
from agent.wire.frames import Kind, Response
from agent.wire.sampling import SamplingParams

PROBE_EVERY = 8  # plain steps between single-draft probes when drafts have not been paying
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

    async def forward(
        self, ids: list[int], sampling: SamplingParams, want_logits: bool = False, sample_all: bool = False
    ) -> Response: ...

    def sampled(self, resp: Response) -> tuple[int, float]: ...

    def cut_back(self, keep: int) -> None: ...


def offer_drafts(drafter: Drafter | None, context_len: int, resp: Response) -> None:
    """Hand the last hop's MTP drafts (after the token ending a context of `context_len`) to a drafter
    that takes them (drafts.MtpDrafter)."""
    offer = getattr(drafter, "offer", None)
    if offer is not None:
        offer(context_len, resp.drafts())


async def speculative_steps(
    route: SpecRoute,
    token: int,
    logprob: float,
    sampling: SamplingParams,
    max_tokens: int,
    stop_ids: set[int] | None,
    speculate: int,
    drafter: Drafter | None,
) -> AsyncIterator[tuple[int, float]]:
    """RouteClient.generate's decode loop with drafts, from the prompt's sampled `token` on: yields
    (token, logprob) as they are decided; `route.last_spec` counts drafts and acceptance."""
    drafter = drafter or NgramDrafter()
    stats = route.last_spec
    # a drafter fed by the hops' answers (MtpDrafter) needs every step's answer: none off the lanes
    route.off_lanes = route.off_lanes or getattr(drafter, "needs_python_path", False)
    context = [*route.history, token]  # every token decided so far; the KV holds all but the last
    ready = [(token, logprob)]  # decided, not yet yielded; only the last is not in the KV
    produced = 0
    while True:
        for item in ready:
            route.last_response = None
            yield item
            produced += 1
            if (stop_ids and item[0] in stop_ids) or produced == max_tokens:
                return
        token = ready[-1][0]
        room = route.capacity - len(context)
        if room < 0:
            raise ContextLimitError(f"context limit of {route.capacity} tokens reached")
        # drafts past the answer's end or the context's would be computed for nothing; within
        # them, as long as this route's costs and the drafts' record say pays (spec.draft_length)
        k = min(speculate, MAX_DRAFT, room, max_tokens - produced - 1)
        if route.spec_adaptive:
            # the first steps go plain: their round trips and compute size the drafts after them
            first = stats.steps + stats.plain_steps < MEASURE_STEPS
            rt, row, per = stats.round_trip_ms, stats.row_ms, stats.draft_ms
            vrt = stats.verify_round_trip_ms
            cap, k = k, 0 if first else draft_length(stats.acceptance_rate(), rt, row, k, per, vrt)
            # now and then one draft anyway, so the acceptance estimate keeps learning, where drafts
            # that always stood would pay on this route at all
            probe = stats.plain_steps % PROBE_EVERY == PROBE_EVERY - 1
            if not first and k == 0 and probe and draft_length(1.0, rt, row, cap, per, vrt):
                k = 1
        t_draft = time.perf_counter()
        drafts = drafter.propose(context, k)[:k] if k > 0 else []
        stats.drafting(len(drafts), (time.perf_counter() - t_draft) * 1e3)
        # the hops' own compute, as their timings report it; the rest of a step's wall time is
        # the round trip (links, relaying, queueing) that a longer draft spreads over more tokens
        c0, t0 = sum(h.compute_ms for h in route.hop_stats), time.perf_counter()
        if not drafts:
            stats.plain_steps += 1
            resp = await route.forward([token], sampling)
            compute = sum(h.compute_ms for h in route.hop_stats) - c0
            stats.timed(1, (time.perf_counter() - t0) * 1e3, compute)
            ready = [route.sampled(resp)]
            context.append(ready[0][0])
            offer_drafts(drafter, len(context), resp)
            continue
        base = len(route.history)
        route.off_lanes = route.off_lanes or stats.round_trip_ms >= STICKY_ROUND_TRIP_MS
        resp = await route.forward([token, *drafts], sampling, sample_all=True)
        compute = sum(h.compute_ms for h in route.hop_stats) - c0
        stats.timed(len(drafts) + 1, (time.perf_counter() - t0) * 1e3, compute, verify=True)
        if resp.kind != Kind.TOKENS or resp.n_tokens != len(drafts) + 1:
            raise RouteError(
                f"the last hop answered {resp.kind.name} x {resp.n_tokens} to a verification of "
                f"{len(drafts) + 1} positions",
                status=502,
                code="bad_verification",
                hop=len(route.hops) - 1,
            )
        sampled, lps = resp.tokens()
        m = accepted(drafts, sampled)
        stats.record(len(drafts), m)
        context.extend(drafts[:m])
        keep = base + 1 + m  # the token sent and the drafts that stood
        if keep < len(route.history):
            route.cut_back(keep)  # no round trip: each hop goes back when the next frame arrives
        ready = [*zip(drafts[:m], lps[:m], strict=True), (sampled[m], lps[m])]
        context.append(sampled[m])
        offer_drafts(drafter, len(context), resp)
