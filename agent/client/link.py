"""One session's hops as its route client, lane and failover all see them: tokens, frames, round trips."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiohttp import ClientError, ClientSession, ClientTimeout

from agent.client.errors import RouteError
from agent.client.recovery import Hop
from agent.wire.frames import (
    ChainHop,
    FrameError,
    Kind,
    Op,
    Request,
    Response,
    decode_response,
    encode_request,
)
from agent.wire.ids import SessionId
from agent.wire.jsonlimits import loads_bounded
from agent.wire.sampling import SamplingParams
from agent.wire.stream import FrameStreams

ERROR_BODY_MAX = 4096  # a hop's error answer is a short JSON object; more is not one of ours


@dataclass
class Step:
    """One forward step as one hop took it: its input rows, kept so a replacement can take it again."""

    pos: int
    n: int
    kind: Kind
    dim: int
    payload: bytes  # b"" once the seam cache is dropped (hop 0's token ids are always kept)

    def cut(self, keep: int) -> Step:
        """The first `keep` positions of the step (a truncate inside it)."""
        per = len(self.payload) // self.n if self.n else 0
        return Step(self.pos, keep, self.kind, self.dim, self.payload[: per * keep])


@dataclass
class HopStats:
    compute_ms: float = 0.0  # as the hop reports it
    network_ms: float = 0.0  # round trip less the hop's reported handler time
    wall_ms: float = 0.0  # the round trips as this client timed them: nothing the hop says changes it
    bytes_out: int = 0
    bytes_in: int = 0


class RouteLink:
    """A session's ordered hops, what each has been told, and the one way frames reach them.

    The route client, its lane and its failover share one: a hop replaced by the failover is the hop
    the next step goes to, and the step numbers all of them send count up together."""

    def __init__(
        self,
        hops: list[Hop],
        session: SessionId,
        kind: Kind,
        token_id_layers: int,
        timeout_s: float,
        http: ClientSession,
        streams: FrameStreams,
    ) -> None:
        n = len(hops)
        self.hops = list(hops)
        self.session = session
        self.kind = kind  # the seams' hidden rows: f16 or f32
        # layers [0, token_id_layers) route experts by token id (the manifest's hash layers, deepseek4):
        # a later hop holding one gets the ids with the hidden states
        self.token_id_layers = token_id_layers
        self.timeout_s = timeout_s
        self.http = http
        self.streams = streams
        self.stats = [HopStats() for _ in range(n)]
        self.rtt: list[deque[float]] = [deque(maxlen=64) for _ in range(n)]  # recent small steps, s
        # the last step number sent: each numbered frame (open, forward, truncate, lane) takes the next
        self.step = 0
        self.opened = False
        self.chain_sent = False  # chain mode: the hops remember the chain from its first step
        self.resend_sampling = [False] * n  # a replacement has not seen the session's sampling options
        # MTP drafts the last hop sends after each step (its model's own head; drafts.MtpDrafter takes
        # them): asked for in its OPEN, the session's and a replacement's alike; 0: none
        self.mtp_draft = 0

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def frame(self, i: int, op: Op, **fields: Any) -> bytes:
        """Hop `i`'s request frame: `fields` are Request's other keyword fields."""
        return encode_request(Request(op=op, session=self.session, token=self.hops[i].token, **fields))

    def open_dim(self, i: int) -> int:
        """An OPEN's `dim` for hop `i`: the MTP drafts per step the last hop is asked for."""
        return self.mtp_draft if i == len(self.hops) - 1 else 0

    def plain_frame(self, i: int, op: Op, pos: int, dim: int = 0) -> bytes:
        """A numbered frame with no payload to hop `i` (open, truncate) at position `pos` (`dim`: an
        OPEN's MTP drafts per step)."""
        return self.frame(i, op, step=self.next_step(), pos_start=pos, dim=dim)

    def forward_frame(
        self,
        i: int,
        st: Step,
        ids: list[int],
        sampling: SamplingParams | None = None,
        send: bool = False,
        want_logits: bool = False,
        chained: bool = False,
        sample_all: bool = False,
    ) -> bytes:
        """Hop `i`'s FORWARD frame for `st`, whose token ids are `ids`. The hop that samples gets
        `sampling` (when `send`: it changed, or when it has not seen it yet) and `want_logits`: the last
        hop, or with `chained` hop 0 of a chain-mode route, which passes them on along the chain."""
        last = i == len(self.hops) - 1
        samples = chained or last
        resend = any(self.resend_sampling) if chained else self.resend_sampling[i]
        # Hops remember the chain: it travels with the session's first step (and after a recovery).
        chain = [ChainHop(h.url, h.token) for h in self.hops[1:]] if chained and not self.chain_sent else []
        return self.frame(
            i,
            Op.FORWARD,
            step=self.next_step(),
            pos_start=st.pos,
            n_tokens=st.n,
            kind=st.kind,
            dim=st.dim,
            f16_out=self.kind == Kind.F16,
            sampling=sampling if samples and (send or resend) else None,
            history=list(ids) if last else None,
            want_logits=want_logits and samples,
            sample_all=sample_all,  # every hop runs a verification one position at a time
            token_ids=np.asarray(ids, dtype="<i4")
            if st.kind != Kind.IDS and self.hops[i].layer_start < self.token_id_layers
            else None,
            chain=chain,
            chain_cached=chained and self.chain_sent and not last,
            payload=st.payload,
        )

    def replace(self, i: int, hop: Hop, previous_token: bytes = b"") -> None:
        """Hop `i` is `hop` from now on; `previous_token` (chain mode): the hop before's token minted
        again to name it, as the hop before forwards only to the hop its token names."""
        self.hops[i] = hop
        if previous_token and i > 0:
            prev = self.hops[i - 1]
            self.hops[i - 1] = Hop(prev.url, prev.layer_start, prev.layer_end, previous_token)
        self.rtt[i].clear()  # the old hop's step times say nothing of the new one
        self.resend_sampling[i] = True
        self.chain_sent = False

    async def post(
        self, i: int, body: bytes, timeout_s: float | None = None, bundle: bool = False
    ) -> Response:
        """Send hop `i` one frame and return its answer, or RouteError naming the hop. `bundle`: a small
        step that may share a message with other sessions' steps to the same hop."""
        hop = self.hops[i]
        try:
            # a pooled WebSocket per hop (agent/wire/stream.py); POST for big frames and older hops
            got = await self.streams.exchange(hop.url, body, timeout_s or self.timeout_s, bundle=bundle)
            if got is not None:
                status, data = got
            else:
                t = ClientTimeout(total=timeout_s or self.timeout_s)
                async with self.http.post(hop.url.rstrip("/") + "/v1/frame", data=body, timeout=t) as r:
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
                # a hop's error is a short JSON object: bounded, so a hostile hop's deep nesting is a
                # RouteError naming the hop, never a RecursionError
                err = loads_bounded(data, max_bytes=ERROR_BODY_MAX)
                code, msg = str(err.get("error", ""))[:64], str(err.get("message", ""))[:400]
            except (ValueError, AttributeError):
                code, msg = "", data[:200].decode("utf-8", "replace")
            raise RouteError(
                f"hop {i} ({hop.url}) answered {status} {code}: {msg}", status=status, code=code, hop=i
            )
        self.stats[i].bytes_out += len(body)
        self.stats[i].bytes_in += len(data)
        try:
            return decode_response(data)
        except FrameError as e:  # a hop answering garbage is as broken as one not answering
            raise RouteError(f"hop {i} ({hop.url}) answered a bad frame: {e}", 502, "bad_frame", i) from None
