"""Route client: drives a session through its ordered hops, keeps the token history, streams text."""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from agent import defaults
from agent.client.ahead import StepAhead
from agent.client.errors import ContextLimitError, RouteError, RouteFailed
from agent.client.failover import PREFILL_CHUNK, Failover
from agent.client.lane import LaneRoute, lanes_wanted
from agent.client.link import HopStats, RouteLink, Step
from agent.client.prefix import PrefixSharing, prefix_step, shareable
from agent.client.recovery import Hop, RecoveryPolicy, Replacement, ReplacementProvider
from agent.client.spec import Drafter, SpecStats
from agent.client.speculate import offer_drafts, speculative_steps
from agent.client.tokenizer import ChatTokenizer, StreamDecoder
from agent.client.transport import HopTransport
from agent.wire.bundle import BUNDLE_STEP_TOKENS
from agent.wire.frames import (
    CONTEXT_CAP,
    DEFAULT_HIDDEN_DTYPE,
    HiddenDtype,
    Kind,
    Op,
    Response,
    hidden_kind,
)
from agent.wire.ids import SessionId
from agent.wire.prefix import common_prefix
from agent.wire.sampling import SamplingParams

__all__ = [
    "ChatEvent",
    "ContextLimitError",
    "Hop",
    "HopStats",
    "RecoveryPolicy",
    "Replacement",
    "RouteClient",
    "RouteError",
    "RouteFailed",
]


@dataclass
class ChatEvent:
    """A streamed text delta, or (done=True) the end of the answer with its telemetry."""

    text: str = ""
    token: int | None = None
    done: bool = False
    # JSON for the playground and GenerationRecord: timings, token counts, per-hop stats.
    telemetry: dict[str, Any] = field(default_factory=dict)


class RouteClient:
    """A sticky session over `hops`; every hop keeps its KV for the session's whole life.

    With `replacements` it also recovers the route when a hop dies, hangs or restarts mid-answer
    (agent/client/recovery.py says when and how long, agent/client/failover.py how): the failed hop's
    layers move to a replacement, its KV is restored there (a snapshot hand-off, a warm spare's copy,
    else a re-prefill of exactly the steps it had taken) and the step goes on, so the text already
    streamed is never repeated or changed. Without it a failed hop ends the answer with RouteError.

    Its parts share one `link` to the hops (agent/client/link.py): the `failover` (recovery, warm
    spares), which every frame goes through, and the `lane` (decode steps over hop 0's native lane).
    """

    def __init__(
        self,
        hops: list[Hop],
        tokenizer: ChatTokenizer | None = None,
        session_id: bytes | None = None,
        mode: str = "star",
        hidden_dtype: HiddenDtype = DEFAULT_HIDDEN_DTYPE,
        capacity: int = defaults.SESSION_CAPACITY,
        timeout_s: float = 120.0,
        replacements: ReplacementProvider | None = None,
        recovery: RecoveryPolicy | None = None,
        ssl_context: ssl.SSLContext | None = None,
        token_id_layers: int = 0,
        transport: HopTransport | None = None,
        lane: bool | None = None,
    ) -> None:
        """lane: decode steps over the hops' native lanes where they admit the session (chain mode;
        agent/client/lane.py); None: unless GGSWARM_LANE=0."""
        if not hops:
            raise RouteError("a route needs at least one hop")
        for prev, nxt in zip(hops, hops[1:], strict=False):
            if prev.layer_end != nxt.layer_start:
                raise RouteError(
                    f"hops do not chain: {prev.layer_start}:{prev.layer_end} then "
                    f"{nxt.layer_start}:{nxt.layer_end}"
                )
        if hops[0].layer_start != 0:
            raise RouteError("the first hop must start at layer 0")
        if mode not in ("chain", "star"):
            raise RouteError(f"mode must be 'chain' or 'star', not {mode!r}")
        self.tokenizer = tokenizer
        self.mode = mode
        self.capacity = min(capacity, CONTEXT_CAP)
        self.history: list[int] = []  # token ids in every hop's KV, in order
        self.last_prefilled = 0
        self.last_truncate: dict[str, Any] = {}
        self.last_response: Response | None = None  # the step that sampled the token being yielded
        self.last_spec = SpecStats()  # the latest generate's speculation (agent/client/spec.py)
        self.spec_adaptive = True  # drafts sized by measured costs and acceptance; False: `speculate` each
        # hops hold a verification's rejected drafts past the history: the next frame cuts them off
        self._hops_ahead = False
        # this answer verified drafts over a slow route: its plain steps stay off the lanes too, since
        # every verification takes the session off them and coming back costs an admission round trip
        self.off_lanes = False
        self._sent_sampling: SamplingParams | None = None
        self.ahead = StepAhead()  # a decode step sent ahead of the consumer (generate)
        # A shared transport (agent/client/transport.py) bundles this session's small steps with other
        # sessions' for the same hop; without one the client has its own connections, nothing to bundle.
        self.transport = transport or HopTransport(
            ssl_context, timeout_s, bundling=False, close_when_unused=True
        )
        self.transport.acquire()
        self.link = RouteLink(
            hops,
            SessionId(session_id or os.urandom(16)),
            hidden_kind(hidden_dtype),
            token_id_layers,
            timeout_s,
            self.transport.http,
            self.transport.streams,
        )
        self.failover = Failover(
            self.link, self.history, mode, self.capacity, replacements, recovery or RecoveryPolicy()
        )
        self.lane = LaneRoute(
            lanes_wanted() if lane is None else lane,
            self.link,
            self.transport.lanes,
            self.failover.wait_lane,
            self.realign,
        )
        self.prefix = PrefixSharing(self.link)  # shared prompt prefixes restored or saved (prefix.py)

    # -- what the parts own, as the client's callers read it -------------------------------------------
    @property
    def last_prefix(self) -> dict[str, Any]:
        """What the latest generate did with its shared prefix: {shared_tokens, hit, saved}, or {}."""
        return self.prefix.last

    @property
    def hops(self) -> list[Hop]:
        return self.link.hops

    @property
    def mtp_draft(self) -> int:
        """MTP drafts the last hop sends after each step (drafts.MtpDrafter takes them); asked for when
        the session opens (and by a replacement of the last hop), so set before the first step; 0: none."""
        return self.link.mtp_draft

    @mtp_draft.setter
    def mtp_draft(self, n: int) -> None:
        self.link.mtp_draft = n

    @property
    def session(self) -> SessionId:
        return self.link.session

    @property
    def kind(self) -> Kind:
        return self.link.kind

    @property
    def hop_stats(self) -> list[HopStats]:
        return self.link.stats

    @hop_stats.setter
    def hop_stats(self, stats: list[HopStats]) -> None:  # a caller starting an answer's figures afresh
        self.link.stats = stats

    @property
    def policy(self) -> RecoveryPolicy:
        return self.failover.policy

    @policy.setter
    def policy(self, policy: RecoveryPolicy) -> None:
        self.failover.policy = policy

    @property
    def recoveries(self) -> list[dict[str, Any]]:
        """One entry per recovery: hops, reason, methods (snapshot / standby / reprefill...), ms."""
        return self.failover.recoveries

    @property
    def checkpoints(self) -> int:
        """KV copies taken to warm spares."""
        return self.failover.checkpoints

    # -- session ------------------------------------------------------------------------------------
    async def open(self) -> None:
        link = self.link
        if link.opened:
            return
        for i in range(len(link.hops)):
            await self.failover.call(
                i, partial(link.plain_frame, i, Op.OPEN, self.capacity, link.open_dim(i)), 0
            )
        link.opened = True

    async def close(self) -> None:
        """Free the session's KV on every hop (and its warm spares), then the HTTP connections."""
        link = self.link
        await self.ahead.settled(within=self.policy.deadline_floor_s * 2)
        await self.lane.drop()
        try:
            await self.failover.close()
            if link.opened:
                for i in range(len(link.hops)):
                    with contextlib.suppress(RouteError):  # a dead hop frees its KV by TTL
                        await link.post(i, link.frame(i, Op.CLOSE), self.policy.deadline_floor_s * 2)
                link.opened = False
        finally:
            await self.transport.release()  # the last of its clients closes a shared transport

    def send_ahead(
        self, ids: list[int], sampling: SamplingParams, sample_all: bool = False
    ) -> asyncio.Future[Response]:
        """Send a step before the consumer has the tokens it follows, so their work overlaps the
        route's; until it is done no other frame may go before it (settled() waits for it)."""
        return self.ahead.send(self.forward(ids, sampling, sample_all=sample_all))

    async def take_ahead(self, step: asyncio.Future[Response]) -> Response:
        """The answer of a step sent ahead (agent/client/ahead.py)."""
        return await self.ahead.take(step)

    async def drop_ahead(self, step: asyncio.Future[Response]) -> None:
        """A step sent ahead of a consumer that stopped: let it finish."""
        await self.ahead.drop(step)

    async def settled(self) -> None:
        """Let a decode step that generate sent ahead finish before any other frame reaches the hops."""
        await self.ahead.settled()

    async def truncate(self, n: int) -> int:
        """Bring every hop back to at most `n` positions; returns the length they all hold now. Hops
        keeping recurrent state go back to a checkpoint at or before `n` (or to 0), so it can be less:
        the caller re-prefills from there. `last_truncate` says what happened (for telemetry)."""
        await self.settled()
        self.last_truncate = {}
        if n >= len(self.history):
            return len(self.history)
        target = n
        await self.lane.drop()  # truncating takes the session off the lanes
        while True:
            held = target
            for i in range(len(self.hops)):
                frame = partial(self.link.plain_frame, i, Op.TRUNCATE, target)
                resp = await self.failover.call(i, frame, 0)
                held = min(held, resp.session_len)
                self.failover.cut(i, target)
            if held == target:
                break
            target = held  # a hop went back further: bring the others to the same length
        mode = "exact" if held == n else ("checkpoint" if held > 0 else "reprefill_from_0")
        self.last_truncate = {"requested": n, "held": held, "mode": mode}
        del self.history[held:]
        return held

    async def realign(self, pos: int) -> None:
        """Bring every hop back to `pos` positions (a lane step whose answer was lost may have run)."""
        link = self.link
        await self.lane.drop()
        for i in range(len(link.hops)):
            with contextlib.suppress(RouteError):
                await link.post(i, link.plain_frame(i, Op.TRUNCATE, pos), self.policy.deadline_floor_s * 2)

    async def forward(
        self, ids: list[int], sampling: SamplingParams, want_logits: bool = False, sample_all: bool = False
    ) -> Response:
        """Append `ids` to the session on every hop; returns the last hop's answer (sampled token; with
        `sample_all`, Kind.TOKENS: the token sampled at every position, a speculative verification)."""
        if not ids:
            raise RouteError("nothing to forward")
        if len(self.history) + len(ids) > self.capacity:
            raise ContextLimitError(
                f"context of {len(self.history) + len(ids)} tokens exceeds the limit of {self.capacity}"
            )
        await self.open()
        link, failover = self.link, self.failover
        pos = len(self.history)
        failover.pending_ids = list(ids)
        inp = Step(pos, len(ids), Kind.IDS, 0, np.asarray(ids, dtype="<i4").tobytes())
        # Hops remember the session's sampling options: send them only when they change.
        send = sampling != self._sent_sampling
        shared = self.transport.users > 1
        # a step this small may share a message with other sessions' (its answer waits for theirs);
        # with no other client on the transport there is nobody to share with: a lone session does
        # not wait the loop turn that would find that out, on every hop of every step
        bundle = inp.n <= BUNDLE_STEP_TOKENS and not want_logits and not sample_all and shared
        t0 = time.perf_counter()
        if self.mode == "chain" or len(link.hops) == 1:
            try:
                python_only = want_logits or sample_all or self._hops_ahead or self.off_lanes
                laned = await self.lane.step(inp, ids, send, python_only, shared)
            except RouteError as e:  # a lane step past its deadline: a hung hop, as on the Python path
                await failover.fail(e)  # replaced (the hops brought back to the history), or raised
                laned = None
            if laned is not None:
                resp = laned
            else:
                # a frame on the Python path takes the session off every lane it reaches (lanes.py)
                await self.lane.drop()
                frame = partial(
                    link.forward_frame,
                    0,
                    inp,
                    ids,
                    sampling,
                    send,
                    want_logits,
                    chained=True,
                    sample_all=sample_all,
                )
                resp = await failover.call(0, frame, inp.n, bundle)
            rtt_ms = (time.perf_counter() - t0) * 1e3
            net_ms = rtt_ms - sum(t.handler_us for t in resp.timings) / 1e3
            for st, t in zip(link.stats, resp.timings, strict=False):
                st.compute_ms += t.compute_us / 1e3
                st.network_ms += net_ms / len(link.hops)  # chain mode cannot split wire time per hop
            for st in link.stats:
                st.wall_ms += rtt_ms / len(link.hops)
            failover.record_chain(inp)
            link.resend_sampling = [False] * len(link.hops)
        else:
            for i in range(len(link.hops)):
                t1 = time.perf_counter()
                frame = partial(
                    link.forward_frame, i, inp, ids, sampling, send, want_logits, sample_all=sample_all
                )
                resp = await failover.call(i, frame, inp.n, bundle)
                self._account(i, resp, t1)
                failover.record(i, inp)
                link.resend_sampling[i] = False
                inp = Step(pos, resp.n_tokens, resp.kind, resp.dim, bytes(resp.payload))
        self.history.extend(ids)
        self._hops_ahead = False
        failover.pending_ids = []
        self._sent_sampling = sampling
        link.chain_sent = self.mode == "chain"
        failover.maybe_checkpoint(len(ids))
        return resp

    def _account(self, i: int, resp: Response, t0: float) -> None:
        rtt_ms = (time.perf_counter() - t0) * 1e3
        t = resp.timings[0] if resp.timings else None
        stats = self.link.stats[i]
        stats.compute_ms += t.compute_us / 1e3 if t else 0.0
        stats.network_ms += rtt_ms - (t.handler_us / 1e3 if t else 0.0)
        stats.wall_ms += rtt_ms

    def hop_telemetry(self) -> list[dict[str, Any]]:
        """Per-hop figures of the answer so far, as the playground, the API and telemetry record them."""
        return [
            {
                "url": h.url,
                "layers": [h.layer_start, h.layer_end],
                "compute_ms": round(s.compute_ms, 2),
                "network_ms": round(s.network_ms, 2),
                "wall_ms": round(s.wall_ms, 2),
                "bytes_out": s.bytes_out,
                "bytes_in": s.bytes_in,
            }
            for h, s in zip(self.hops, self.hop_stats, strict=True)
        ]

    # -- generation ---------------------------------------------------------------------------------
    def cut_back(self, keep: int) -> None:
        """Forget the history past `keep` (a verification's rejected drafts) without a round trip: each
        hop goes back when the next frame arrives there (agent/node/verify.py), so that frame must take
        the Python path, not a lane."""
        del self.history[keep:]
        for i in range(len(self.hops)):
            self.failover.cut(i, keep)
        self._hops_ahead = True

    def sampled(self, resp: Response) -> tuple[int, float]:
        """The token the last hop sampled; a route that stops short of the model's last layer answers
        hidden states instead, and feeding those on as a token would only fail later, less clearly."""
        if resp.kind not in (Kind.TOKEN, Kind.LOGITS) or resp.token < 0:
            last = self.hops[-1]
            raise self.last_hop_error(
                f"the last hop ({last.url}, layers {last.layer_start}:{last.layer_end}) answered "
                f"{resp.kind.name} rather than a sampled token: the route does not end at the model's "
                "last layer",
                "no_token",
            )
        self.check_sampled([resp.token])
        return resp.token, resp.logprob

    @property
    def n_vocab(self) -> int | None:
        """The model's vocabulary size, from its tokenizer (None without one)."""
        return self.tokenizer.n_vocab if self.tokenizer is not None else None

    def check_sampled(self, ids: list[int]) -> None:
        """The last hop's sampled ids are the model's tokens: one outside the vocabulary (a lying or broken
        node) is refused here, before a detokenizer meets it (llama.cpp's aborts the whole process)."""
        n_vocab = self.n_vocab
        for t in ids:  # every decode step: no list built
            if t < 0 or (n_vocab is not None and t >= n_vocab):
                raise self.last_hop_error(
                    f"the last hop ({self.hops[-1].url}) answered token {t}, outside the model's "
                    f"vocabulary of {n_vocab} tokens",
                    "bad_token",
                )

    def last_hop_error(self, message: str, code: str) -> RouteError:
        """A malformed answer of the route's last hop (502, naming it)."""
        return RouteError(message, status=502, code=code, hop=len(self.hops) - 1)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop_ids: set[int] | None = None,
        want_logits: bool = False,
        shared_prefix: int = 0,
        speculate: int = 0,
        drafter: Drafter | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        between_chunks: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncGenerator[tuple[int, float], None]:
        """Bring the KV to `prompt_ids` (reusing the common prefix), then yield sampled (token, logprob).

        With `between_chunks` the prompt goes in steps of `prefill_chunk` positions (twice the one before
        from the 8th on), awaiting it between two: a prompt waits there while another runs (quota.py).

        `shared_prefix`: how many leading ids other users' sessions may share (a system prompt): the
        hops' state there is restored from their prefix snapshots when they hold it, and kept for the
        next session when they do not (prefix.py); the tokens are the same either way.

        With `want_logits` the last hop also returns the raw logits of the position each token was
        sampled at: `self.last_response.logits()[-1]` while the token is being consumed.

        `speculate`: drafts of up to that many tokens (`drafter`, else prompt lookup) are verified in
        one step of the route each (spec.py); the tokens are the plain ones, `last_spec` says how many
        drafts each round trip accepted.

        Plain decoding sends each step before yielding the token it follows (not with `want_logits`):
        a consumer that stops then finds one step in flight, which `aclose` lets finish, so the hops'
        KV equals `history` afterwards either way."""
        await self.settled()
        common = common_prefix(self.history, prompt_ids)
        if common == len(prompt_ids):  # nothing new to prefill: recompute the last position
            common = max(0, len(prompt_ids) - 1)
        common = await self.truncate(common)
        self.lane.new_turn()
        self.prefix.last = {}
        if shared_prefix and shareable(prompt_ids, shared_prefix, self.history):
            common = await self._shared_prefix(prompt_ids[:shared_prefix], sampling, common)
        new = prompt_ids[common:]
        self.last_prefilled = len(new)
        chunks = prompt_steps(new, PREFILL_CHUNK if between_chunks is None else prefill_chunk)
        if want_logits and len(chunks[-1]) > 1:
            # Logits come back for every position of a step: the last position goes alone.
            chunks[-1:] = [chunks[-1][:-1], chunks[-1][-1:]]
        for i, chunk in enumerate(chunks):
            if i and between_chunks is not None:
                await between_chunks()
            resp = await self.forward(chunk, sampling, want_logits=want_logits and i == len(chunks) - 1)
        token, logprob = self.sampled(resp)
        self.last_spec = SpecStats()
        self.off_lanes = False
        if speculate > 0 and not want_logits:
            offer_drafts(drafter, len(self.history) + 1, resp)
            steps = speculative_steps(
                self, token, logprob, sampling, max_tokens, stop_ids, speculate, drafter
            )
            # closed with this generator: left to the garbage collector, its step in flight would
            # be settled by a task of its own, after the route's next answer had begun
            async with contextlib.aclosing(steps):
                async for item in steps:
                    yield item
            return
        # The next step goes out before the consumer sees this token: its detokenizing, stop strings
        # and socket writes then overlap the route's compute instead of adding to every token's time.
        # Not with logits: the consumer reads last_response's while it handles the token.
        ahead: asyncio.Future[Response] | None = None
        try:
            for n in range(max_tokens):
                self.last_response = resp
                last = bool(stop_ids and token in stop_ids) or n == max_tokens - 1
                if not (last or want_logits or len(self.history) + 1 > self.capacity):
                    ahead = self.send_ahead([token], sampling)
                yield token, logprob
                if last:
                    break
                if ahead is None:
                    if len(self.history) + 1 > self.capacity:
                        raise ContextLimitError(f"context limit of {self.capacity} tokens reached")
                    resp = await self.forward([token], sampling, want_logits=want_logits)
                else:
                    step, ahead = ahead, None
                    resp = await self.take_ahead(step)
                token, logprob = self.sampled(resp)
        finally:
            if ahead is not None:
                await self.drop_ahead(ahead)

    async def _shared_prefix(self, ids: list[int], sampling: SamplingParams, common: int) -> int:
        """Bring every hop to exactly `ids` from their prefix snapshots, or prefill them and ask the
        hops to keep them; returns the positions the route holds now."""
        n = len(ids)
        self.prefix.last = {"shared_tokens": n, "hit": False, "saved": False}
        if common:
            # the route holds another text: a restore goes into empty sessions only
            common = await self.truncate(0)
            if common:
                return common  # recurrent state that cannot go back to 0 here: prefill as always
        await self.open()
        await self.lane.drop()
        if await self.prefix.load(ids):
            self.history.extend(ids)
            self.failover.record_chain(prefix_step(ids))  # a recovery restores or re-prefills it
            self.failover.prefix_ids = list(ids)
            self.prefix.last["hit"] = True
            return n
        for off in range(0, n, PREFILL_CHUNK):
            await self.forward(ids[off : off + PREFILL_CHUNK], sampling)
        self.prefix.last["saved"] = await self.prefix.save(ids)
        self.failover.prefix_ids = list(ids)  # a recovery asks the hops for it before re-prefilling
        return n

    async def chat(
        self, messages: list[dict[str, str]], sampling: SamplingParams | None = None, max_tokens: int = 256
    ) -> AsyncIterator[ChatEvent]:
        """Stream the assistant's answer to `messages` as text deltas, then one event with telemetry."""
        if self.tokenizer is None:
            raise RouteError("chat needs a tokenizer")
        sampling = sampling or SamplingParams()
        prompt = self.tokenizer.encode_chat(messages)
        if len(prompt) >= self.capacity:
            raise ContextLimitError(
                f"prompt of {len(prompt)} tokens exceeds the context limit of {self.capacity}"
            )
        self.hop_stats = [HopStats() for _ in self.hops]
        n_recoveries = len(self.recoveries)
        t0 = time.perf_counter()
        ttft = 0.0
        dec = StreamDecoder(self.tokenizer)
        generated: list[int] = []
        # closed with this generator: a consumer that stops lets the step sent ahead finish at once
        tokens = self.generate(prompt, sampling, max_tokens, self.tokenizer.eot_ids)
        async with contextlib.aclosing(tokens):
            async for token, _lp in tokens:
                if not generated:
                    ttft = time.perf_counter() - t0
                generated.append(token)
                if self.tokenizer.is_end(token):
                    break
                text = dec.push(token)
                if text:
                    yield ChatEvent(text=text, token=token)
        tail = dec.flush()
        if tail:
            yield ChatEvent(text=tail)
        total = time.perf_counter() - t0
        decode_s = total - ttft
        yield ChatEvent(
            done=True,
            telemetry={
                "ttft_ms": round(ttft * 1e3, 2),
                "tok_s": round((len(generated) - 1) / decode_s, 2)
                if len(generated) > 1 and decode_s > 0
                else 0.0,
                "n_prompt": len(prompt),
                "n_prefilled": self.last_prefilled,
                "n_reused": len(prompt) - self.last_prefilled,
                "truncate": self.last_truncate,
                "n_generated": len(generated),
                "total_ms": round(total * 1e3, 2),
                "mode": self.mode,
                "hops": self.hop_telemetry(),
                "wire_bytes": sum(s.bytes_out + s.bytes_in for s in self.hop_stats),
                "recoveries": self.recoveries[n_recoveries:],
            },
        )


def prompt_steps(ids: list[int], first: int) -> list[list[int]]:
    """A prompt's steps: `first` positions each for eight steps, then each twice the one before, never
    more than PREFILL_CHUNK (with `first` = PREFILL_CHUNK: steps of PREFILL_CHUNK)."""
    size, steps, off = max(1, first), [], 0
    while off < len(ids):
        steps.append(ids[off : off + min(size, PREFILL_CHUNK)])
        off, size = off + len(steps[-1]), 2 * size if len(steps) >= 8 else size
    return steps
