"""Route client: drives a session through its ordered hops, keeps the token history, streams text."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from agent import defaults
from agent.client.tokenizer import ChatTokenizer, StreamDecoder
from agent.wire.frames import (
    CONTEXT_CAP,
    DEFAULT_HIDDEN_DTYPE,
    ChainHop,
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

PREFILL_CHUNK = 512


class RouteError(Exception):
    """A hop refused or failed a request; `status` and `code` come from the hop when it answered."""

    def __init__(self, message: str, status: int = 0, code: str = "", hop: int = -1) -> None:
        super().__init__(message)
        self.status, self.code, self.hop = status, code, hop


class ContextLimitError(RouteError):
    """The conversation no longer fits the context cap (128K or the model's own limit)."""


@dataclass(frozen=True)
class Hop:
    """One hop of a route: the node's data-plane URL, its layer range and its route token."""

    url: str
    layer_start: int
    layer_end: int
    token: bytes


@dataclass
class HopStats:
    compute_ms: float = 0.0
    network_ms: float = 0.0
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


class RouteClient:
    """A sticky session over `hops`; every hop keeps its KV for the session's whole life."""

    def __init__(
        self,
        hops: list[Hop],
        tokenizer: ChatTokenizer | None = None,
        session_id: bytes | None = None,
        mode: str = "star",
        hidden_dtype: HiddenDtype = DEFAULT_HIDDEN_DTYPE,
        max_context: int = defaults.MAX_CONTEXT,
        timeout_s: float = 120.0,
    ) -> None:
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
        self.hops = hops
        self.tokenizer = tokenizer
        self.session = SessionId(session_id or os.urandom(16))
        self.mode = mode
        self.kind = hidden_kind(hidden_dtype)
        self.max_context = min(max_context, CONTEXT_CAP)
        self.history: list[int] = []  # token ids in every hop's KV, in order
        self.step = 0
        self.opened = False
        self.hop_stats = [HopStats() for _ in hops]
        self.last_prefilled = 0
        self.last_response: Response | None = None  # the step that sampled the token being yielded
        self._sent_sampling: SamplingParams | None = None
        self._chain_sent = False
        self._http = ClientSession(
            connector=TCPConnector(limit=16),
            timeout=ClientTimeout(total=timeout_s),
            skip_auto_headers=("User-Agent",),
        )

    # -- low level ----------------------------------------------------------------------------------
    async def _post(self, i: int, body: bytes) -> Response:
        hop = self.hops[i]
        try:
            async with self._http.post(hop.url.rstrip("/") + "/v1/frame", data=body) as r:
                data = await r.read()
        except (ClientError, OSError, TimeoutError) as e:
            raise RouteError(f"hop {i} ({hop.url}) unreachable: {e}", hop=i) from None
        if r.status != 200:
            try:
                err = json.loads(data)
                code, msg = err.get("error", ""), err.get("message", "")
            except ValueError:
                code, msg = "", data[:200].decode("utf-8", "replace")
            raise RouteError(
                f"hop {i} ({hop.url}) answered {r.status} {code}: {msg}", status=r.status, code=code, hop=i
            )
        self.hop_stats[i].bytes_out += len(body)
        self.hop_stats[i].bytes_in += len(data)
        return decode_response(data)

    def _frame(self, i: int, op: Op, **fields: Any) -> bytes:
        """Hop `i`'s request frame: `fields` are Request's other keyword fields."""
        return encode_request(Request(op=op, session=self.session, token=self.hops[i].token, **fields))

    async def open(self) -> None:
        if self.opened:
            return
        for i in range(len(self.hops)):
            await self._post(i, self._frame(i, Op.OPEN, pos_start=self.max_context))
        self.opened = True

    async def close(self) -> None:
        """Free the session's KV on every hop, then the HTTP connections."""
        try:
            if self.opened:
                for i in range(len(self.hops)):
                    with contextlib.suppress(RouteError):  # a dead hop frees its KV by TTL
                        await self._post(i, self._frame(i, Op.CLOSE))
                self.opened = False
        finally:
            await self._http.close()

    async def truncate(self, n: int) -> None:
        if n >= len(self.history):
            return
        self.step += 1
        for i in range(len(self.hops)):
            await self._post(i, self._frame(i, Op.TRUNCATE, step=self.step, pos_start=n))
        del self.history[n:]

    async def forward(self, ids: list[int], sampling: SamplingParams, want_logits: bool = False) -> Response:
        """Append `ids` to the session on every hop; returns the last hop's answer (sampled token)."""
        if not ids:
            raise RouteError("nothing to forward")
        if len(self.history) + len(ids) > self.max_context:
            raise ContextLimitError(
                f"context of {len(self.history) + len(ids)} tokens exceeds the limit of {self.max_context}"
            )
        await self.open()
        self.step += 1
        pos = len(self.history)
        arr = np.asarray(ids, dtype="<i4")
        # Hops remember the session's sampling options: send them only when they change.
        send_sampling = sampling if sampling != self._sent_sampling else None
        t0 = time.perf_counter()
        if self.mode == "chain" or len(self.hops) == 1:
            # Hops remember the chain: it travels with the session's first step only.
            chain = [] if self._chain_sent else [ChainHop(h.url, h.token) for h in self.hops[1:]]
            body = self._frame(
                0,
                Op.FORWARD,
                step=self.step,
                pos_start=pos,
                n_tokens=len(ids),
                kind=Kind.IDS,
                sampling=send_sampling,
                want_logits=want_logits,
                f16_out=self.kind == Kind.F16,
                chain=chain,
                chain_cached=self._chain_sent and len(self.hops) > 1,
                history=list(ids) if len(self.hops) == 1 else None,
                payload=arr.tobytes(),
            )
            resp = await self._post(0, body)
            rtt_ms = (time.perf_counter() - t0) * 1e3
            net_ms = rtt_ms - sum(t.handler_us for t in resp.timings) / 1e3
            for st, t in zip(self.hop_stats, resp.timings, strict=False):
                st.compute_ms += t.compute_us / 1e3
                st.network_ms += net_ms / len(self.hops)  # chain mode cannot split wire time per hop
        else:
            resp = await self._post(
                0,
                self._frame(
                    0,
                    Op.FORWARD,
                    step=self.step,
                    pos_start=pos,
                    n_tokens=len(ids),
                    kind=Kind.IDS,
                    f16_out=self.kind == Kind.F16,
                    payload=arr.tobytes(),
                ),
            )
            self._account(0, resp, t0)
            for i in range(1, len(self.hops)):
                last = i == len(self.hops) - 1
                t1 = time.perf_counter()
                resp = await self._post(
                    i,
                    self._frame(
                        i,
                        Op.FORWARD,
                        step=self.step,
                        pos_start=pos,
                        n_tokens=resp.n_tokens,
                        kind=resp.kind,
                        dim=resp.dim,
                        f16_out=self.kind == Kind.F16,
                        sampling=send_sampling if last else None,
                        history=list(ids) if last else None,
                        want_logits=want_logits and last,
                        payload=resp.payload,
                    ),
                )
                self._account(i, resp, t1)
        self.history.extend(ids)
        self._sent_sampling = sampling
        self._chain_sent = self.mode == "chain"
        return resp

    def _account(self, i: int, resp: Response, t0: float) -> None:
        rtt_ms = (time.perf_counter() - t0) * 1e3
        t = resp.timings[0] if resp.timings else None
        self.hop_stats[i].compute_ms += t.compute_us / 1e3 if t else 0.0
        self.hop_stats[i].network_ms += rtt_ms - (t.handler_us / 1e3 if t else 0.0)

    # -- generation ---------------------------------------------------------------------------------
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
        await self.truncate(common)
        new = prompt_ids[common:]
        self.last_prefilled = len(new)
        chunks = [new[off : off + PREFILL_CHUNK] for off in range(0, len(new), PREFILL_CHUNK)]
        if want_logits and len(chunks[-1]) > 1:
            # Logits come back for every position of a step: the last position goes alone.
            chunks[-1:] = [chunks[-1][:-1], chunks[-1][-1:]]
        for i, chunk in enumerate(chunks):
            resp = await self.forward(chunk, sampling, want_logits=want_logits and i == len(chunks) - 1)
        token, logprob = resp.token, resp.logprob
        for n in range(max_tokens):
            self.last_response = resp
            yield token, logprob
            if (stop_ids and token in stop_ids) or n == max_tokens - 1:
                break
            if len(self.history) + 1 > self.max_context:
                raise ContextLimitError(f"context limit of {self.max_context} tokens reached")
            resp = await self.forward([token], sampling, want_logits=want_logits)
            token, logprob = resp.token, resp.logprob

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
                "n_generated": len(generated),
                "total_ms": round(total * 1e3, 2),
                "mode": self.mode,
                "hops": [
                    {
                        "url": h.url,
                        "layers": [h.layer_start, h.layer_end],
                        "compute_ms": round(s.compute_ms, 2),
                        "network_ms": round(s.network_ms, 2),
                        "bytes_out": s.bytes_out,
                        "bytes_in": s.bytes_in,
                    }
                    for h, s in zip(self.hops, self.hop_stats, strict=True)
                ],
                "wire_bytes": sum(s.bytes_out + s.bytes_in for s in self.hop_stats),
            },
        )
