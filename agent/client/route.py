"""Route client: drives a session through its ordered hops, keeps the token history, streams text.

It also recovers the route when a hop dies, hangs or restarts mid-answer (agent/client/recovery.py
says when and how long, agent/client/failover.py how): the failed hop's layers move to a replacement,
its KV is restored there (a snapshot hand-off, a warm spare's copy, else a re-prefill of exactly the
steps it had taken) and the step goes on, so the text already streamed is never repeated or changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout

from agent import defaults
from agent.client.failover import (
    PREFILL_CHUNK,
    ContextLimitError,
    Failover,
    RouteError,
    RouteFailed,
    Step,
    recoverable,
)
from agent.client.lane import LaneRoute, lanes_wanted
from agent.client.recovery import Hop, RecoveryPolicy, Replacement, ReplacementProvider
from agent.client.tokenizer import ChatTokenizer, StreamDecoder
from agent.client.transport import HopTransport
from agent.wire.bundle import BUNDLE_STEP_TOKENS
from agent.wire.frames import (
    CONTEXT_CAP,
    DEFAULT_HIDDEN_DTYPE,
    ChainHop,
    FrameError,
    HiddenDtype,
    Kind,
    Op,
    Request,
    Response,
    decode_response,
    encode_request,
    hidden_kind,
)
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams
from agent.wire.stream import FrameStreams

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
class HopStats:
    compute_ms: float = 0.0  # as the hop reports it
    network_ms: float = 0.0  # round trip less the hop's reported handler time
    wall_ms: float = 0.0  # the round trips as this client timed them: nothing the hop says changes it
    bytes_out: int = 0
    bytes_in: int = 0


@dataclass
class ChatEvent:
    """A streamed text delta, or (done=True) the end of the answer with its telemetry."""

    text: str = ""
    token: int | None = None
    done: bool = False
    # JSON for the playground and GenerationRecord: timings, token counts, per-hop stats.
    telemetry: dict[str, Any] = field(default_factory=dict)


class RouteClient(Failover):
    """A sticky session over `hops`; every hop keeps its KV for the session's whole life.

    With `replacements` the client survives failed hops (see the module docstring); without it a
    failed hop ends the answer with RouteError, as before.
    """

    def __init__(
        self,
        hops: list[Hop],
        tokenizer: ChatTokenizer | None = None,
        session_id: bytes | None = None,
        mode: str = "star",
        hidden_dtype: HiddenDtype = DEFAULT_HIDDEN_DTYPE,
        max_context: int = defaults.MAX_CONTEXT,
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
        self.hops = list(hops)
        # layers [0, token_id_layers) route experts by token id (the manifest's hash layers, deepseek4):
        # in star mode a later hop holding one gets the ids with the hidden states
        self.token_id_layers = token_id_layers
        self.tokenizer = tokenizer
        self.session = SessionId(session_id or os.urandom(16))
        self.mode = mode
        self.kind = hidden_kind(hidden_dtype)
        self.max_context = min(max_context, CONTEXT_CAP)
        self.timeout_s = timeout_s
        self.replacements = replacements
        self.policy = recovery or RecoveryPolicy()
        self.history: list[int] = []  # token ids in every hop's KV, in order
        self.step = 0
        self.opened = False
        self.hop_stats = [HopStats() for _ in hops]
        self.last_prefilled = 0
        self.last_truncate: dict[str, Any] = {}
        self.last_response: Response | None = None  # the step that sampled the token being yielded
        # one entry per recovery: hop, reason, method (snapshot / reprefill / reprefill_route), ms
        self.recoveries: list[dict[str, Any]] = []
        self._sent_sampling: SamplingParams | None = None
        self._chain_sent = False
        n = len(hops)
        self._len = [0] * n  # positions each hop holds
        self._steps: list[list[Step]] = [[] for _ in range(n)]  # what each hop was given, in order
        self._seam_bytes = 0
        self._seams_kept = True
        self._rtt: list[deque[float]] = [deque(maxlen=64) for _ in range(n)]
        self._resend_sampling = [False] * n
        self._pending_ids: list[int] = []  # the ids of the step in flight (not yet in history)
        # warm spares: a copy of hop i's KV at some positions on another node (RecoveryPolicy.checkpoint_tokens)
        self._standby: list[tuple[Replacement, int] | None] = [None] * n
        self._checkpointing: dict[int, asyncio.Task[None]] = {}
        self.checkpoints = 0
        # A shared transport (agent/client/transport.py) bundles this session's small steps with other
        # sessions' for the same hop; without one the client has its own connections, nothing to bundle.
        self.transport = transport or HopTransport(
            ssl_context, timeout_s, bundling=False, close_when_unused=True
        )
        self.transport.acquire()
        self._http: ClientSession = self.transport.http
        self._streams: FrameStreams = self.transport.streams
        self.lane = LaneRoute(lanes_wanted() if lane is None else lane)

    # -- low level ----------------------------------------------------------------------------------
    async def _post(
        self, i: int, body: bytes, timeout_s: float | None = None, bundle: bool = False
    ) -> Response:
        hop = self.hops[i]
        try:
            # a pooled WebSocket per hop (agent/wire/stream.py); POST for big frames and older hops
            got = await self._streams.exchange(hop.url, body, timeout_s or self.timeout_s, bundle=bundle)
            if got is not None:
                status, data = got
            else:
                t = ClientTimeout(total=timeout_s or self.timeout_s)
                async with self._http.post(hop.url.rstrip("/") + "/v1/frame", data=body, timeout=t) as r:
                    status, data = r.status, await r.read()
        except TimeoutError:
            late = f"{timeout_s:.2f} s" if timeout_s is not None else f"{self.timeout_s:.0f} s"
            raise RouteError(
                f"hop {i} ({hop.url}) did not answer within {late}", code="timeout", hop=i
            ) from None
        except (ClientError, OSError) as e:
            raise RouteError(f"hop {i} ({hop.url}) unreachable: {e}", hop=i) from None
        if status != 200:
            try:
                err = json.loads(data)
                code, msg = err.get("error", ""), err.get("message", "")
            except ValueError:
                code, msg = "", data[:200].decode("utf-8", "replace")
            raise RouteError(
                f"hop {i} ({hop.url}) answered {status} {code}: {msg}", status=status, code=code, hop=i
            )
        self.hop_stats[i].bytes_out += len(body)
        self.hop_stats[i].bytes_in += len(data)
        try:
            return decode_response(data)
        except FrameError as e:  # a hop answering garbage is as broken as one not answering
            raise RouteError(f"hop {i} ({hop.url}) answered a bad frame: {e}", 502, "bad_frame", i) from None

    def _frame(self, i: int, op: Op, **fields: Any) -> bytes:
        """Hop `i`'s request frame: `fields` are Request's other keyword fields."""
        return encode_request(Request(op=op, session=self.session, token=self.hops[i].token, **fields))

    def _deadline(self, i: int, n_tokens: int) -> float:
        """How long hop `i` gets for a step of `n_tokens`: derived from its own recent steps."""
        p = self.policy
        samples = self._rtt[i]
        if self.replacements is None or n_tokens > p.small_step_tokens or len(samples) < p.deadline_samples:
            return self.timeout_s
        ordered = sorted(samples)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return min(self.timeout_s, max(p.deadline_floor_s, p.deadline_factor * p95))

    async def _call(
        self, i: int, frame: Callable[[], bytes], n_tokens: int, bundle: bool = False
    ) -> Response:
        """Send hop `i` the frame `frame()` builds (rebuilt per attempt: a replacement changes the
        token and the step number), recovering failed hops until it answers or recovery gives up.
        `bundle`: a small step that may travel with other sessions' (a shared transport)."""
        began = time.monotonic()
        failures: list[str] = []
        while True:
            t0 = time.perf_counter()
            try:
                resp = await self._post(i, frame(), self._deadline(i, n_tokens), bundle)
            except RouteError as e:
                if self.replacements is None or not recoverable(e):
                    raise
                await self._recover_until_done(e, failures, began)
                continue
            if n_tokens <= self.policy.small_step_tokens:
                self._rtt[i].append(time.perf_counter() - t0)
            return resp

    # -- session ------------------------------------------------------------------------------------
    async def open(self) -> None:
        if self.opened:
            return
        for i in range(len(self.hops)):
            await self._call(i, partial(self._plain_frame, i, Op.OPEN, self.max_context), 0)
        self.opened = True

    def _plain_frame(self, i: int, op: Op, pos: int) -> bytes:
        self.step += 1
        return self._frame(i, op, step=self.step, pos_start=pos)

    async def close(self) -> None:
        """Free the session's KV on every hop (and its warm spares), then the HTTP connections."""
        await self.lane.drop()
        for task in self._checkpointing.values():
            task.cancel()
        await asyncio.gather(*self._checkpointing.values(), return_exceptions=True)
        try:
            for sb in self._standby:
                if sb is not None:
                    spare = sb[0].hop
                    body = encode_request(Request(op=Op.CLOSE, session=self.session, token=spare.token))
                    with contextlib.suppress(ClientError, OSError, TimeoutError):
                        async with self._http.post(
                            spare.url.rstrip("/") + "/v1/frame",
                            data=body,
                            timeout=ClientTimeout(total=self.policy.deadline_floor_s * 2),
                        ) as r:
                            await r.read()
            if self.opened:
                for i in range(len(self.hops)):
                    with contextlib.suppress(RouteError):  # a dead hop frees its KV by TTL
                        await self._post(i, self._frame(i, Op.CLOSE), self.policy.deadline_floor_s * 2)
                self.opened = False
        finally:
            await self.transport.release()  # the last of its clients closes a shared transport

    async def truncate(self, n: int) -> int:
        """Bring every hop back to at most `n` positions; returns the length they all hold now. Hops
        keeping recurrent state go back to a checkpoint at or before `n` (or to 0), so it can be less:
        the caller re-prefills from there. `last_truncate` says what happened (for telemetry)."""
        self.last_truncate = {}
        if n >= len(self.history):
            return len(self.history)
        target = n
        await self.lane.drop()  # truncating takes the session off the lanes
        while True:
            held = target
            for i in range(len(self.hops)):
                resp = await self._call(i, partial(self._plain_frame, i, Op.TRUNCATE, target), 0)
                held = min(held, resp.session_len)
                self._cut(i, target)
            if held == target:
                break
            target = held  # a hop went back further: bring the others to the same length
        mode = "exact" if held == n else ("checkpoint" if held > 0 else "reprefill_from_0")
        self.last_truncate = {"requested": n, "held": held, "mode": mode}
        del self.history[held:]
        return held

    def _lane_frame(self) -> bytes:
        """Op.LANE to hop 0: the hops admit the session to their lanes along the cached chain."""
        self.step += 1
        return self._frame(
            0, Op.LANE, step=self.step, chain_cached=len(self.hops) > 1, f16_out=self.kind == Kind.F16
        )

    async def realign(self, pos: int) -> None:
        """Bring every hop back to `pos` positions (a lane step whose answer was lost may have run)."""
        await self.lane.drop()
        for i in range(len(self.hops)):
            with contextlib.suppress(RouteError):
                await self._post(i, self._plain_frame(i, Op.TRUNCATE, pos), self.policy.deadline_floor_s * 2)

    def _star_frame(
        self, i: int, inp: Step, sampling: SamplingParams, send: bool, want_logits: bool, ids: list[int]
    ) -> bytes:
        last = i == len(self.hops) - 1
        self.step += 1
        return self._frame(
            i,
            Op.FORWARD,
            step=self.step,
            pos_start=inp.pos,
            n_tokens=inp.n,
            kind=inp.kind,
            dim=inp.dim,
            f16_out=self.kind == Kind.F16,
            sampling=sampling if last and (send or self._resend_sampling[i]) else None,
            history=list(ids) if last else None,
            want_logits=want_logits and last,
            token_ids=np.asarray(ids, dtype="<i4")
            if inp.kind != Kind.IDS and self.hops[i].layer_start < self.token_id_layers
            else None,
            payload=inp.payload,
        )

    def _chain_frame(
        self, inp: Step, sampling: SamplingParams, send: bool, want_logits: bool, ids: list[int]
    ) -> bytes:
        self.step += 1
        single = len(self.hops) == 1
        # Hops remember the chain: it travels with the session's first step (and after a recovery).
        chain = [] if self._chain_sent else [ChainHop(h.url, h.token) for h in self.hops[1:]]
        return self._frame(
            0,
            Op.FORWARD,
            step=self.step,
            pos_start=inp.pos,
            n_tokens=inp.n,
            kind=Kind.IDS,
            sampling=sampling if send or any(self._resend_sampling) else None,
            want_logits=want_logits,
            f16_out=self.kind == Kind.F16,
            chain=chain,
            chain_cached=self._chain_sent and not single,
            history=list(ids) if single else None,
            payload=inp.payload,
        )

    async def forward(self, ids: list[int], sampling: SamplingParams, want_logits: bool = False) -> Response:
        """Append `ids` to the session on every hop; returns the last hop's answer (sampled token)."""
        if not ids:
            raise RouteError("nothing to forward")
        if len(self.history) + len(ids) > self.max_context:
            raise ContextLimitError(
                f"context of {len(self.history) + len(ids)} tokens exceeds the limit of {self.max_context}"
            )
        await self.open()
        pos = len(self.history)
        self._pending_ids = list(ids)
        inp = Step(pos, len(ids), Kind.IDS, 0, np.asarray(ids, dtype="<i4").tobytes())
        # Hops remember the session's sampling options: send them only when they change.
        send = sampling != self._sent_sampling
        # a step this small may share a message with other sessions' (its answer waits for theirs);
        # with no other client on the transport there is nobody to share with: a lone session does
        # not wait the loop turn that would find that out, on every hop of every step
        bundle = inp.n <= BUNDLE_STEP_TOKENS and not want_logits and self.transport.users > 1
        t0 = time.perf_counter()
        if self.mode == "chain" or len(self.hops) == 1:
            laned = await self.lane.step(self, inp, ids, send, want_logits)
            if laned is not None:
                resp = laned
            else:
                # a frame on the Python path takes the session off every lane it reaches (lanes.py)
                await self.lane.drop()
                resp = await self._call(
                    0, partial(self._chain_frame, inp, sampling, send, want_logits, ids), inp.n, bundle
                )
            rtt_ms = (time.perf_counter() - t0) * 1e3
            net_ms = rtt_ms - sum(t.handler_us for t in resp.timings) / 1e3
            for st, t in zip(self.hop_stats, resp.timings, strict=False):
                st.compute_ms += t.compute_us / 1e3
                st.network_ms += net_ms / len(self.hops)  # chain mode cannot split wire time per hop
            for st in self.hop_stats:
                st.wall_ms += rtt_ms / len(self.hops)
            self._record(0, inp)
            for j in range(len(self.hops)):
                self._len[j] = pos + inp.n
            self._resend_sampling = [False] * len(self.hops)
        else:
            for i in range(len(self.hops)):
                t1 = time.perf_counter()
                resp = await self._call(
                    i, partial(self._star_frame, i, inp, sampling, send, want_logits, ids), inp.n, bundle
                )
                self._account(i, resp, t1)
                self._record(i, inp)
                self._resend_sampling[i] = False
                inp = Step(pos, resp.n_tokens, resp.kind, resp.dim, bytes(resp.payload))
        self.history.extend(ids)
        self._pending_ids = []
        self._sent_sampling = sampling
        self._chain_sent = self.mode == "chain"
        self._maybe_checkpoint(len(ids))
        return resp

    def _account(self, i: int, resp: Response, t0: float) -> None:
        rtt_ms = (time.perf_counter() - t0) * 1e3
        t = resp.timings[0] if resp.timings else None
        self.hop_stats[i].compute_ms += t.compute_us / 1e3 if t else 0.0
        self.hop_stats[i].network_ms += rtt_ms - (t.handler_us / 1e3 if t else 0.0)
        self.hop_stats[i].wall_ms += rtt_ms

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
    def _sampled(self, resp: Response) -> tuple[int, float]:
        """The token the last hop sampled; a route that stops short of the model's last layer answers
        hidden states instead, and feeding those on as a token would only fail later, less clearly."""
        if resp.kind not in (Kind.TOKEN, Kind.LOGITS) or resp.token < 0:
            last = self.hops[-1]
            raise RouteError(
                f"the last hop ({last.url}, layers {last.layer_start}:{last.layer_end}) answered "
                f"{resp.kind.name} rather than a sampled token: the route does not end at the model's "
                "last layer",
                status=502,
                code="no_token",
                hop=len(self.hops) - 1,
            )
        return resp.token, resp.logprob

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        stop_ids: set[int] | None = None,
        want_logits: bool = False,
    ) -> AsyncIterator[tuple[int, float]]:
        """Bring the KV to `prompt_ids` (reusing the common prefix), then yield sampled (token, logprob).

        With `want_logits` the last hop also returns the raw logits of the position each token was
        sampled at: `self.last_response.logits()[-1]` while the token is being consumed."""
        common = 0
        for a, b in zip(self.history, prompt_ids, strict=False):
            if a != b:
                break
            common += 1
        if common == len(prompt_ids):  # nothing new to prefill: recompute the last position
            common = max(0, len(prompt_ids) - 1)
        common = await self.truncate(common)
        self.lane.new_turn()
        new = prompt_ids[common:]
        self.last_prefilled = len(new)
        chunks = [new[off : off + PREFILL_CHUNK] for off in range(0, len(new), PREFILL_CHUNK)]
        if want_logits and len(chunks[-1]) > 1:
            # Logits come back for every position of a step: the last position goes alone.
            chunks[-1:] = [chunks[-1][:-1], chunks[-1][-1:]]
        for i, chunk in enumerate(chunks):
            resp = await self.forward(chunk, sampling, want_logits=want_logits and i == len(chunks) - 1)
        token, logprob = self._sampled(resp)
        for n in range(max_tokens):
            self.last_response = resp
            yield token, logprob
            if (stop_ids and token in stop_ids) or n == max_tokens - 1:
                break
            if len(self.history) + 1 > self.max_context:
                raise ContextLimitError(f"context limit of {self.max_context} tokens reached")
            resp = await self.forward([token], sampling, want_logits=want_logits)
            token, logprob = self._sampled(resp)

    async def chat(
        self, messages: list[dict[str, str]], sampling: SamplingParams | None = None, max_tokens: int = 256
    ) -> AsyncIterator[ChatEvent]:
        """Stream the assistant's answer to `messages` as text deltas, then one event with telemetry."""
        if self.tokenizer is None:
            raise RouteError("chat needs a tokenizer")
        sampling = sampling or SamplingParams()
        prompt = self.tokenizer.encode_chat(messages)
        if len(prompt) >= self.max_context:
            raise ContextLimitError(
                f"prompt of {len(prompt)} tokens exceeds the context limit of {self.max_context}"
            )
        self.hop_stats = [HopStats() for _ in self.hops]
        n_recoveries = len(self.recoveries)
        t0 = time.perf_counter()
        ttft = 0.0
        dec = StreamDecoder(self.tokenizer)
        generated: list[int] = []
        async for token, _lp in self.generate(prompt, sampling, max_tokens, self.tokenizer.eot_ids):
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
