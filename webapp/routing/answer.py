"""One pass of an answer over a live route: tokens decoded to text, stop strings held back, logprobs,
and the answer's telemetry in the one shape the API, the playground and GenerationRecord share."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agent.client.failover import PREFILL_CHUNK
from agent.client.route import HopStats
from agent.client.tokenizer import ChatTokenizer, StreamDecoder
from agent.wire.sampling import SamplingParams


@dataclass
class LiveRoute:
    """A route session this process holds open: its client's history is what every hop's KV holds."""

    session_id: uuid.UUID
    artifact_id: int
    client: Any  # agent.client.route.RouteClient
    route: list[dict[str, Any]]
    capacity: int  # the context the hops were opened with
    # what drafts for the route's speculative steps (drafts.MtpDrafter where the model has a head); None:
    # prompt lookup, RouteClient.generate's default
    drafter: Any = None


@dataclass(frozen=True)
class AnswerSpec:
    """How to answer: sampling, length, stop strings, and whether (and how many) logprobs to return."""

    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # leading prompt tokens other users' sessions may share (a system prompt, webapp/routing/prefix.py):
    # the route client restores the hops' state there, or saves it for the next session that shares it
    shared_prefix: int = 0
    # most drafts per verification step (settings.ROUTE_SPECULATE; agent/client/spec.py sizes them)
    speculate: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token, its logprob, and the most likely alternatives at its position (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Piece:
    """A streamed part of the answer: new text, and the tokens it completes when logprobs were asked."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)


def top_logprobs(logits: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens of a logits row and their log-softmax, most likely first."""
    row = logits.astype(np.float64)
    k = min(k, row.size)  # a row shorter than k (a broken hop's) has only that many
    if k <= 0:
        return ()
    m = float(row.max())
    lse = m + math.log(float(np.exp(row - m).sum()))
    idx = np.argpartition(-row, k - 1)[:k]
    idx = idx[np.argsort(-row[idx])]
    return tuple((int(i), float(row[i] - lse)) for i in idx)


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Where the first stop string found in text[start:] begins; None when there is none."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


class Answer:
    """The answer to `prompt` on `live`: `pieces` streams it (raising the route client's errors), then
    `finish_reason` says how it ended; `telemetry` gives its figures at any time, so far or final."""

    def __init__(
        self, live: LiveRoute, tok: ChatTokenizer, prompt: list[int], spec: AnswerSpec, reused: bool
    ) -> None:
        self.live, self.tok, self.prompt, self.spec, self.reused = live, tok, prompt, spec, reused
        self.n_out = 0  # tokens generated so far, the end token not counted
        self.finish_reason: str | None = None
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.recoveries_before = len(live.client.recoveries)
        self.started = False  # generate was called: the client's last_prefix is this answer's
        # the prompt's steps, and what to await between two (webapp/routing/quota.py Turn.prefill_steps)
        self.prefill_chunk = PREFILL_CHUNK
        self.between_chunks: Callable[[], Awaitable[None]] | None = None

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The answer's text as the route samples it, held back while it could begin a stop string."""
        tok, spec, client = self.tok, self.spec, self.live.client
        client.hop_stats = [HopStats() for _ in client.hops]
        want_top = spec.logprobs and spec.top_logprobs > 0
        dec = StreamDecoder(tok)
        # Text that could still grow into a stop string is held back, so no part of one ever leaks.
        hold = max((len(s) for s in spec.stop), default=1) - 1
        text, emitted, search_from = "", 0, 0
        pending: list[TokenLogprob] = []
        finish = "length"
        self.t0 = time.perf_counter()
        gen = client.generate(
            self.prompt,
            spec.sampling,
            spec.max_tokens,
            tok.eot_ids,
            want_logits=want_top,
            shared_prefix=spec.shared_prefix,
            speculate=spec.speculate,
            drafter=self.live.drafter,
            prefill_chunk=self.prefill_chunk,
            between_chunks=self.between_chunks,
        )
        # nothing else runs before the generator's first step, which sets the client's last_prefix anew
        self.started = True
        try:
            async for token, logprob in gen:
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                if tok.is_end(token):
                    finish = "stop"
                    break
                self.n_out += 1
                if spec.logprobs:
                    resp = client.last_response
                    logits = resp.logits()[-1] if want_top and resp is not None and resp.n_tokens else None
                    if logits is not None:  # a row longer than the vocabulary has no tokens past it
                        logits = logits[: tok.n_vocab]
                    top = top_logprobs(logits, spec.top_logprobs) if logits is not None else ()
                    pending.append(TokenLogprob(token, float(logprob), top))
                text += dec.push(token)
                cut = find_stop(text, spec.stop, search_from)
                if cut is not None:
                    text, finish = text[:cut], "stop"
                    break
                search_from = max(0, len(text) - hold)
                safe = len(text) - hold if spec.stop else len(text)
                if safe > emitted:
                    yield Piece(text[emitted:safe], pending)
                    emitted, pending = safe, []
        finally:
            await gen.aclose()
        if finish == "length":
            text += dec.flush()
            cut = find_stop(text, spec.stop, search_from)
            if cut is not None:
                text, finish = text[:cut], "stop"
        if len(text) > emitted or pending:
            yield Piece(text[emitted:], pending)
        self.finish_reason, self.t_end = finish, time.perf_counter()

    def telemetry(self) -> dict[str, Any]:
        """The answer's figures: so far while it streams, final once `pieces` ended."""
        c, n_prompt = self.live.client, len(self.prompt)
        end = self.t_end or time.perf_counter()
        decode_s = end - self.t_first if self.t_first is not None else 0.0
        prefilled = c.last_prefilled
        # a reused client still holds its previous answer's until this answer's generate starts
        prefix = c.last_prefix if self.started else {}
        return {
            "session": str(self.live.session_id),
            "route": self.live.route,
            "reused_route": self.reused,
            "ttft_ms": round((self.t_first - self.t0) * 1e3, 2) if self.t_first is not None else None,
            "tok_s": round((self.n_out - 1) / decode_s, 2) if self.n_out > 1 and decode_s > 0 else 0.0,
            "total_ms": round((end - self.t0) * 1e3, 2),
            "n_prompt": n_prompt,
            "n_reused": n_prompt - prefilled,
            "n_prefilled": prefilled,
            # the shared prefix (system prompt) this answer asked the hops for, and whether they had it
            "prefix_shared_tokens": int(prefix.get("shared_tokens", 0)),
            "prefix_hit": bool(prefix.get("hit", False)),
            # Tokens this answer sent through the hops: the new prompt tokens, then one per decode step.
            "tokens_sent": len(c.history) - (n_prompt - prefilled),
            "n_generated": self.n_out,
            "mode": c.mode,
            "hops": c.hop_telemetry(),
            "wire_bytes": sum(s.bytes_out + s.bytes_in for s in c.hop_stats),
            "truncate": c.last_truncate,
            "recoveries": c.recoveries[self.recoveries_before :],
            # drafts verified per round trip of the route (agent/client/spec.py); zeros without any
            "speculation": c.last_spec.as_dict() if self.started else {},
        }
