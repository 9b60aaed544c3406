"""Route client: drives a session through its ordered hops, keeps the token history, streams text.

It also recovers the route when a hop dies, hangs or restarts mid-answer (agent/client/recovery.py
says when and how long): the failed hop's layers move to a replacement, its KV is restored there (a
snapshot hand-off, else a re-prefill of exactly the steps it had taken) and the step goes on, so the
text already streamed is never repeated or changed.
"""

from __future__ import annotations

import asyncio
import base64
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
from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from agent import defaults
from agent.client.recovery import STANDBY, Hop, RecoveryPolicy, Replacement, ReplacementProvider
from agent.client.tokenizer import ChatTokenizer, StreamDecoder
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

PREFILL_CHUNK = 512


class RouteError(Exception):
    """A hop refused or failed a request; `status` and `code` come from the hop when it answered."""

    def __init__(self, message: str, status: int = 0, code: str = "", hop: int = -1) -> None:
        super().__init__(message)
        self.status, self.code, self.hop = status, code, hop


class ContextLimitError(RouteError):
    """The conversation no longer fits the context cap (128K or the model's own limit)."""


class RouteFailed(RouteError):
    """Recovery gave up: no replacement for a range, or too many failures in a row (never retried)."""


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


@dataclass
class _Step:
    """One forward step as one hop took it: its input rows, kept so a replacement can take it again."""

    pos: int
    n: int
    kind: Kind
    dim: int
    payload: bytes  # b"" once the seam cache is dropped (hop 0's token ids are always kept)

    def cut(self, keep: int) -> _Step:
        """The first `keep` positions of the step (a truncate inside it)."""
        per = len(self.payload) // self.n if self.n else 0
        return _Step(self.pos, keep, self.kind, self.dim, self.payload[: per * keep])


def _recoverable(e: RouteError) -> bool:
    """Failures a replacement can cure: unreachable, late, 5xx, or a hop that lost the session."""
    if isinstance(e, RouteFailed | ContextLimitError):
        return False
    return e.status == 0 or e.status >= 500 or e.code == "unknown_session"


class RouteClient:
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
        self.hops = list(hops)
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
        self._steps: list[list[_Step]] = [[] for _ in range(n)]  # what each hop was given, in order
        self._seam_bytes = 0
        self._seams_kept = True
        self._rtt: list[deque[float]] = [deque(maxlen=64) for _ in range(n)]
        self._resend_sampling = [False] * n
        self._pending_ids: list[int] = []  # the ids of the step in flight (not yet in history)
        # warm spares: a copy of hop i's KV at some positions on another node (RecoveryPolicy.checkpoint_tokens)
        self._standby: list[tuple[Hop, int] | None] = [None] * n
        self._checkpointing: dict[int, asyncio.Task[None]] = {}
        self.checkpoints = 0
        self._http = ClientSession(
            # https hops: mutual TLS with the swarm CA only (agent.wire.tls.client_context)
            connector=TCPConnector(limit=16, ssl=ssl_context if ssl_context is not None else True),
            timeout=ClientTimeout(total=timeout_s),
            skip_auto_headers=("User-Agent",),
        )

    # -- low level ----------------------------------------------------------------------------------
    async def _post(self, i: int, body: bytes, timeout_s: float | None = None) -> Response:
        hop = self.hops[i]
        t = ClientTimeout(total=timeout_s) if timeout_s is not None else None
        try:
            async with self._http.post(hop.url.rstrip("/") + "/v1/frame", data=body, timeout=t) as r:
                data = await r.read()
        except TimeoutError:
            late = f"{timeout_s:.2f} s" if timeout_s is not None else f"{self.timeout_s:.0f} s"
            raise RouteError(
                f"hop {i} ({hop.url}) did not answer within {late}", code="timeout", hop=i
            ) from None
        except (ClientError, OSError) as e:
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

    async def _call(self, i: int, frame: Callable[[], bytes], n_tokens: int) -> Response:
        """Send hop `i` the frame `frame()` builds (rebuilt per attempt: a replacement changes the
        token and the step number), recovering failed hops until it answers or recovery gives up."""
        began = time.monotonic()
        failures: list[str] = []
        while True:
            t0 = time.perf_counter()
            try:
                resp = await self._post(i, frame(), self._deadline(i, n_tokens))
            except RouteError as e:
                if self.replacements is None or not _recoverable(e):
                    raise
                await self._recover_until_done(e, failures, began)
                continue
            if n_tokens <= self.policy.small_step_tokens:
                self._rtt[i].append(time.perf_counter() - t0)
            return resp

    async def _recover_until_done(self, err: RouteError, failures: list[str], began: float) -> None:
        """Replace the hop `err` names (and whatever fails while doing so) or raise RouteFailed."""
        p = self.policy
        while True:
            failures.append(str(err))
            elapsed = time.monotonic() - began
            if len(failures) > p.attempts or elapsed > p.give_up_s:
                raise RouteFailed(
                    f"the route failed {len(failures)} times in a row in {elapsed:.1f} s, giving up: "
                    + "; ".join(failures),
                    status=503,
                    code="route_failed",
                    hop=err.hop,
                )
            try:
                await self._recover(err)
                return
            except RouteError as e:
                if not _recoverable(e):
                    raise
                err = e

    # -- recovery -----------------------------------------------------------------------------------
    async def _recover(self, err: RouteError) -> None:
        """Give the failed hop's layers to a replacement holding what the failed hop held."""
        assert self.replacements is not None
        t0 = time.perf_counter()
        started = time.monotonic()
        if self.mode == "chain" and len(self.hops) > 1:
            bad, alive = await self._chain_culprits(err)
        else:
            bad, alive = [err.hop if err.hop >= 0 else 0], err.status != 0
        methods: list[str] = []
        replay = False
        provider_s = 0.0
        for i in bad:
            old = self.hops[i]
            t1 = time.perf_counter()
            sb, self._standby[i] = self._standby[i], None
            task = self._checkpointing.pop(i, None)
            if task is not None:
                task.cancel()
            rep: Replacement | None
            if sb is not None and sb[0].url != old.url and not (alive and err.code == "draining"):
                rep, standby_n = Replacement(sb[0]), sb[1]
            else:
                rep, standby_n = await self.replacements(i, old, str(err)), -1
            provider_s += time.perf_counter() - t1
            if rep is None:
                raise RouteFailed(
                    f"no replacement for layers {old.layer_start}:{old.layer_end} after: {err}",
                    status=503,
                    code="no_replacement",
                    hop=i,
                )
            if (rep.hop.layer_start, rep.hop.layer_end) != (old.layer_start, old.layer_end):
                raise RouteFailed(
                    f"replacement for layers {old.layer_start}:{old.layer_end} covers "
                    f"{rep.hop.layer_start}:{rep.hop.layer_end}",
                    code="bad_replacement",
                    hop=i,
                )
            self.hops[i] = rep.hop
            self._rtt[i].clear()
            self._resend_sampling[i] = True
            self._chain_sent = False
            method = await self._restore(i, old, rep, alive, standby_n)
            replay = replay or method == "reprefill_route"
            methods.append(method)
        if replay:
            await self._replay_route()
        elif self.mode == "chain" and len(self.hops) > 1:
            # hops that took the failed step before the failure give it back: it is sent again
            for j in range(len(self.hops)):
                if j not in bad:
                    await self._truncate_hop(j, len(self.history))
        self.recoveries.append(
            {
                "hops": bad,
                "reason": str(err),
                "methods": methods,
                "positions": len(self.history),
                "started": started,  # time.monotonic() when the failure was noticed
                "ms": round((time.perf_counter() - t0) * 1e3, 2),
                "provider_ms": round(provider_s * 1e3, 2),  # asking for the replacement, of "ms"
            }
        )

    async def _chain_culprits(self, err: RouteError) -> tuple[list[int], bool]:
        """Chain mode: the hops that do not answer their health check (dead), else the one the error
        names (alive: it may hand its KV off)."""
        t = ClientTimeout(total=self.policy.probe_timeout_s)

        async def alive(hop: Hop) -> bool:
            try:
                async with self._http.get(hop.url.rstrip("/") + "/v1/health", timeout=t) as r:
                    return r.status == 200
            except (ClientError, OSError, TimeoutError):
                return False

        ok = await asyncio.gather(*(alive(h) for h in self.hops))
        dead = [j for j, up in enumerate(ok) if not up]
        if dead:
            return dead, False
        named = [j for j, h in enumerate(self.hops) if j > 0 and h.url.rstrip("/") in str(err)]
        return named[-1:] or [max(err.hop, 0)], err.status != 0

    async def _restore(self, i: int, old: Hop, rep: Replacement, alive: bool, standby_n: int = -1) -> str:
        """Bring the new hop `i` to the positions the old one held: snapshot hand-off, else the warm
        spare's copy plus a re-prefill of the steps after it (`standby_n` positions), else re-prefill."""
        want = self._len[i]
        if not self.opened:
            return "none"
        if want and alive and rep.handoff_token:
            n = await self._handoff(old, rep)
            if n is not None and n >= want:
                if n > want:  # the old hop took the failed step before failing: drop it
                    await self._truncate_hop(i, want)
                return "snapshot"
            if n is not None:  # fewer positions than the client counted: start that hop over
                with contextlib.suppress(RouteError):
                    await self._post(i, self._frame(i, Op.CLOSE), self.timeout_s)
        resp = await self._post(i, self._frame(i, Op.OPEN, pos_start=self.max_context), self.timeout_s)
        replayable = not (self.mode == "chain" and len(self.hops) > 1) and (i == 0 or self._seams_kept)
        keep = 0  # positions the new hop already holds and keeps
        on_boundary = not any(st.pos < standby_n < st.pos + st.n for st in self._steps[i])
        if replayable and on_boundary and 0 < standby_n <= min(want, resp.session_len):
            keep = standby_n
        if resp.session_len > keep:  # a spare's copy past what is ours, or a node that was late: cut it
            self.step += 1
            await self._post(i, self._frame(i, Op.TRUNCATE, step=self.step, pos_start=keep), self.timeout_s)
        if not want:
            return "none"
        if not replayable:
            return "reprefill_route"  # _replay_route brings every hop back from position 0
        kept = [st for st in self._steps[i] if st.pos + st.n <= keep]
        steps = [st for st in self._steps[i] if st.pos >= keep]
        self._steps[i], self._len[i] = kept, keep
        if i > 0:
            self._seam_bytes -= sum(len(st.payload) for st in steps)
        for st in self._batches(steps):
            await self._give(i, st, self.timeout_s)
        return "standby" if keep else "reprefill"

    def _batches(self, steps: list[_Step]) -> list[_Step]:
        """The steps to replay: as they were taken (RecoveryPolicy.exact_replay), else consecutive ones
        merged up to PREFILL_CHUNK positions (one batch instead of one step per decoded token)."""
        if self.policy.exact_replay:
            return steps
        out: list[_Step] = []
        for st in steps:
            last = out[-1] if out else None
            if (
                last is not None
                and (last.kind, last.dim) == (st.kind, st.dim)
                and last.pos + last.n == st.pos
                and last.n + st.n <= PREFILL_CHUNK
            ):
                out[-1] = _Step(last.pos, last.n + st.n, st.kind, st.dim, last.payload + st.payload)
            else:
                out.append(st)
        return out

    async def _handoff(self, old: Hop, rep: Replacement, keep: bool = False) -> int | None:
        """Ask the old hop to export the session to the new one (`keep`: a copy, the old hop keeps
        serving it); the positions moved, or None."""
        body = {"token": base64.b64encode(rep.handoff_token).decode(), "target": rep.hop.url, "keep": keep}
        try:
            async with self._http.post(
                old.url.rstrip("/") + "/v1/handoff/export",
                json=body,
                timeout=ClientTimeout(total=self.policy.handoff_timeout_s),
            ) as r:
                if r.status != 200:
                    return None
                out = await r.json()
        except (ClientError, OSError, TimeoutError, ValueError):
            return None
        n = out.get("session_len") if isinstance(out, dict) else None
        return n if isinstance(n, int) else None

    async def _truncate_hop(self, i: int, n: int) -> None:
        self.step += 1
        await self._post(i, self._frame(i, Op.TRUNCATE, step=self.step, pos_start=n), self.timeout_s)
        self._cut(i, n)

    def _cut(self, i: int, n: int) -> None:
        """Forget hop `i`'s steps past position `n`."""
        kept: list[_Step] = []
        for st in self._steps[i]:
            if st.pos + st.n <= n:
                kept.append(st)
            elif st.pos < n:
                kept.append(st.cut(n - st.pos))
        if i > 0:
            self._seam_bytes -= sum(len(s.payload) for s in self._steps[i]) - sum(
                len(s.payload) for s in kept
            )
        self._steps[i] = kept
        self._len[i] = min(self._len[i], n)
        sb = self._standby[i]
        if sb is not None and sb[1] > n:  # the spare's positions past the cut are no longer ours
            self._standby[i] = (sb[0], n)

    def _ids(self, pos: int, n: int) -> list[int]:
        known = self.history + self._pending_ids
        return known[pos : pos + n]

    async def _give(self, i: int, st: _Step, timeout_s: float) -> Response:
        """Send hop `i` one recorded step again (re-prefill; the last hop's token is not used)."""
        if st.kind != Kind.IDS and not st.payload:
            raise RouteFailed("the seam cache was dropped: cannot re-prefill one hop", hop=i)
        last = i == len(self.hops) - 1
        self.step += 1
        resp = await self._post(
            i,
            self._frame(
                i,
                Op.FORWARD,
                step=self.step,
                pos_start=st.pos,
                n_tokens=st.n,
                kind=st.kind,
                dim=st.dim,
                f16_out=self.kind == Kind.F16,
                history=self._ids(st.pos, st.n) if last else None,
                payload=st.payload,
            ),
            timeout_s,
        )
        self._record(i, st)
        return resp

    def _record(self, i: int, st: _Step) -> None:
        if i > 0 and self._seams_kept:
            self._seam_bytes += len(st.payload)
            if self._seam_bytes > self.policy.seam_cache_bytes:
                # too much to keep: from now on a recovery re-prefills the whole route
                self._seams_kept = False
                for j in range(1, len(self.hops)):
                    self._steps[j] = [_Step(s.pos, s.n, s.kind, s.dim, b"") for s in self._steps[j]]
                self._seam_bytes = 0
        keep = i == 0 or self._seams_kept
        self._steps[i].append(st if keep else _Step(st.pos, st.n, st.kind, st.dim, b""))
        self._len[i] = st.pos + st.n

    async def _replay_route(self) -> None:
        """Re-prefill every hop from position 0 with the steps hop 0 took (chain mode, or no seams)."""
        want = list(self._len)
        if self.mode == "chain":
            want = [len(self.history)] * len(self.hops)
        steps0 = self._batches([st for st in self._steps[0] if st.pos + st.n <= want[0]])
        for j in range(len(self.hops)):
            if self._len[j]:
                await self._truncate_hop(j, 0)
            self._steps[j], self._len[j] = [], 0
        self._seam_bytes = 0
        for st in steps0:
            cur = st
            for j in range(len(self.hops)):
                if cur.pos + cur.n > want[j]:
                    break
                resp = await self._give(j, cur, self.timeout_s)
                cur = _Step(st.pos, resp.n_tokens, resp.kind, resp.dim, bytes(resp.payload))

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
        for task in self._checkpointing.values():
            task.cancel()
        await asyncio.gather(*self._checkpointing.values(), return_exceptions=True)
        try:
            for sb in self._standby:
                if sb is not None:
                    body = encode_request(Request(op=Op.CLOSE, session=self.session, token=sb[0].token))
                    with contextlib.suppress(ClientError, OSError, TimeoutError):
                        async with self._http.post(
                            sb[0].url.rstrip("/") + "/v1/frame",
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
            await self._http.close()

    async def truncate(self, n: int) -> int:
        """Bring every hop back to at most `n` positions; returns the length they all hold now. Hops
        keeping recurrent state go back to a checkpoint at or before `n` (or to 0), so it can be less:
        the caller re-prefills from there. `last_truncate` says what happened (for telemetry)."""
        self.last_truncate = {}
        if n >= len(self.history):
            return len(self.history)
        target = n
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

    def _star_frame(
        self, i: int, inp: _Step, sampling: SamplingParams, send: bool, want_logits: bool, ids: list[int]
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
            payload=inp.payload,
        )

    def _chain_frame(
        self, inp: _Step, sampling: SamplingParams, send: bool, want_logits: bool, ids: list[int]
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
        inp = _Step(pos, len(ids), Kind.IDS, 0, np.asarray(ids, dtype="<i4").tobytes())
        # Hops remember the session's sampling options: send them only when they change.
        send = sampling != self._sent_sampling
        t0 = time.perf_counter()
        if self.mode == "chain" or len(self.hops) == 1:
            resp = await self._call(
                0, partial(self._chain_frame, inp, sampling, send, want_logits, ids), inp.n
            )
            rtt_ms = (time.perf_counter() - t0) * 1e3
            net_ms = rtt_ms - sum(t.handler_us for t in resp.timings) / 1e3
            for st, t in zip(self.hop_stats, resp.timings, strict=False):
                st.compute_ms += t.compute_us / 1e3
                st.network_ms += net_ms / len(self.hops)  # chain mode cannot split wire time per hop
            self._record(0, inp)
            for j in range(len(self.hops)):
                self._len[j] = pos + inp.n
            self._resend_sampling = [False] * len(self.hops)
        else:
            for i in range(len(self.hops)):
                t1 = time.perf_counter()
                resp = await self._call(
                    i, partial(self._star_frame, i, inp, sampling, send, want_logits, ids), inp.n
                )
                self._account(i, resp, t1)
                self._record(i, inp)
                self._resend_sampling[i] = False
                inp = _Step(pos, resp.n_tokens, resp.kind, resp.dim, bytes(resp.payload))
        self.history.extend(ids)
        self._pending_ids = []
        self._sent_sampling = sampling
        self._chain_sent = self.mode == "chain"
        self._maybe_checkpoint(len(ids))
        return resp

    # -- warm spares ------------------------------------------------------------------------------------
    def _maybe_checkpoint(self, n_tokens: int) -> None:
        """Copy a hop's KV to a spare (in the background) once it has grown by checkpoint_tokens since
        the last copy: a hop that dies later then costs a re-prefill of only the steps after it. Only
        after a decode step, so a long prompt is copied once, when all of it is in."""
        every = self.policy.checkpoint_tokens
        if not every or self.replacements is None or (self.mode == "chain" and len(self.hops) > 1):
            return
        if n_tokens > self.policy.small_step_tokens:
            return
        for i in range(len(self.hops)):
            sb = self._standby[i]
            if i not in self._checkpointing and self._len[i] - (sb[1] if sb else 0) >= every:
                self._checkpointing[i] = asyncio.get_running_loop().create_task(self._checkpoint(i))

    async def _checkpoint(self, i: int) -> None:
        assert self.replacements is not None
        hop = self.hops[i]
        try:
            rep = await self.replacements(i, hop, STANDBY)
            if rep is None or not rep.handoff_token or rep.hop.url == hop.url:
                return
            n = await self._handoff(hop, rep, keep=True)
            if n is not None and self.hops[i] is hop:
                self._standby[i] = (rep.hop, min(n, self._len[i]))
                self.checkpoints += 1
        except (RouteError, ClientError, OSError, TimeoutError):
            pass  # a spare is an optimisation: recovery falls back to a re-prefill
        finally:
            self._checkpointing.pop(i, None)

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
        common = await self.truncate(common)
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
                "recoveries": self.recoveries[n_recoveries:],
            },
        )
