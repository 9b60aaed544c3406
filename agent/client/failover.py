"""How a route client survives a failed hop: replacement, KV restore, warm spares (docs/failover.md)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import ClientError, ClientTimeout

from agent.client.errors import ContextLimitError, RouteError, RouteFailed
from agent.client.link import RouteLink, Step
from agent.client.prefix import PrefixSharing, prefix_step
from agent.client.recovery import STANDBY, Hop, RecoveryPolicy, Replacement, ReplacementProvider
from agent.wire.frames import Kind, Op, Request, Response, encode_request
from agent.wire.httpjson import read_json
from agent.wire.routetoken import TokenError, decode_unverified

PREFILL_CHUNK = 512
# The code of a RouteError naming a hop that does not answer its health check (stopped, hung or gone).
STOPPED = "hop_stopped"
T = TypeVar("T")


def recoverable(e: RouteError) -> bool:
    """Failures a replacement can cure: unreachable, late, 5xx, or a hop that lost the session."""
    if isinstance(e, RouteFailed | ContextLimitError):
        return False
    return e.status == 0 or e.status >= 500 or e.code == "unknown_session"


class Failover:
    """Recovery and warm spares of one route client's session (agent/client/route.py).

    When a hop fails it asks the caller's ReplacementProvider for a hop covering the failed hop's
    layers, brings it to the positions the old hop held (a snapshot hand-off when the old hop still
    answers, else the copy a warm spare took plus the steps since, else a re-prefill of exactly the
    steps the hop took, from the inputs kept for every seam) and lets the step go on. It also keeps
    those warm spares up to date.

    It is handed the session's `link` (hops, frames, round trips) and its token `history` (the
    client's list, read here: the client appends and cuts it), and keeps what a recovery needs: the
    steps each hop took, in order, and the positions each holds. The client tells it about each step
    (`record`, `cut`, `pending_ids`) and sends its frames through `call`."""

    def __init__(
        self,
        link: RouteLink,
        history: list[int],
        mode: str,
        capacity: int,
        replacements: ReplacementProvider | None,
        policy: RecoveryPolicy,
    ) -> None:
        n = len(link.hops)
        self.link = link
        self.history = history
        self.mode = mode
        self.capacity = capacity
        self.replacements = replacements
        self.policy = policy
        self.pending_ids: list[int] = []  # the ids of the step in flight (not yet in history)
        # the session's shared prefix (a system prompt the hops keep snapshots of): a route re-prefilled
        # after a failure restores it on every hop, the replacement included, where they hold it
        self.prefix_ids: list[int] = []
        # one entry per recovery: hop, reason, method (snapshot / reprefill / reprefill_route), ms
        self.recoveries: list[dict[str, Any]] = []
        self.checkpoints = 0
        self._len = [0] * n  # positions each hop holds
        self._steps: list[list[Step]] = [[] for _ in range(n)]  # what each hop was given, in order
        self._seam_bytes = 0
        self._seams_kept = True
        # warm spares: a copy of hop i's KV at some positions on another node (RecoveryPolicy.checkpoint_tokens)
        self._standby: list[tuple[Replacement, int] | None] = [None] * n
        self._checkpointing: dict[int, asyncio.Task[None]] = {}

    def deadline(self, i: int, n_tokens: int) -> float:
        """How long hop `i` gets for a step of `n_tokens`: derived from its own recent steps (with or
        without a replacement provider: a hung hop is reported as soon as it is noticed)."""
        p = self.policy
        samples = self.link.rtt[i]
        if n_tokens > p.small_step_tokens or len(samples) < p.deadline_samples:
            return self.link.timeout_s
        ordered = sorted(samples)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return min(self.link.timeout_s, max(p.deadline_floor_s, p.deadline_factor * p95))

    async def call(self, i: int, frame: Callable[[], bytes], n_tokens: int, bundle: bool = False) -> Response:
        """Send hop `i` the frame `frame()` builds (rebuilt per attempt: a replacement changes the
        token and the step number), recovering failed hops until it answers or recovery gives up.
        `bundle`: a small step that may travel with other sessions' (a shared transport)."""
        began = time.monotonic()
        failures: list[str] = []
        while True:
            t0 = time.perf_counter()
            deadline = self.deadline(i, n_tokens)
            try:
                if self.replacements is None and deadline < self.link.timeout_s:
                    resp = await self.watch(i, self.link.post(i, frame(), None, bundle), deadline)
                else:
                    resp = await self.link.post(i, frame(), deadline, bundle)
            except RouteError as e:
                await self.fail(e, failures, began)
                continue
            if n_tokens <= self.policy.small_step_tokens:
                self.link.rtt[i].append(time.perf_counter() - t0)
            return resp

    async def close(self) -> None:
        """Stop the copies in flight and free the session's KV on its warm spares."""
        for task in self._checkpointing.values():
            task.cancel()
        await asyncio.gather(*self._checkpointing.values(), return_exceptions=True)
        for sb in self._standby:
            if sb is not None:
                spare = sb[0].hop
                body = encode_request(Request(op=Op.CLOSE, session=self.link.session, token=spare.token))
                with contextlib.suppress(ClientError, OSError, TimeoutError):
                    async with self.link.http.post(
                        spare.url.rstrip("/") + "/v1/frame",
                        data=body,
                        timeout=ClientTimeout(total=self.policy.deadline_floor_s * 2),
                    ) as r:
                        await r.read()

    async def fail(self, err: RouteError, failures: list[str] | None = None, began: float = 0.0) -> None:
        """Hop `err.hop` failed a step: replace it (returns once the route can take the step again),
        else raise the failure naming the hop that failed (in chain mode found by `named`)."""
        if self.replacements is None or not recoverable(err):
            raise await self.named(err)
        await self._recover_until_done(err, [] if failures is None else failures, began or time.monotonic())

    async def watch(self, i: int, step: Awaitable[T], deadline: float, what: str = "a step") -> T:
        """Await `step` (sent to hop `i`) for a client without a replacement provider: past `deadline`
        the hops it waits on (hop `i`; in chain mode the ones after it too) are asked for their health,
        again every `deadline`; a hop that does not answer ends the step at once with an error naming it
        (stopped, hung or gone), while hops that answer are waited for up to the client's `timeout_s`
        (a slow hop, behind another session's long prompt say, is no failure without a replacement)."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(step)
        end = loop.time() + self.link.timeout_s
        hop = self.link.hops[i]
        among = range(i, len(self.link.hops)) if self.mode == "chain" else range(i, i + 1)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=max(0.0, min(deadline, end - loop.time())))
                if done:
                    return task.result()
                late = RouteError(
                    f"hop {i} ({hop.url}) did not answer {what} within {deadline:.2f} s",
                    code="timeout",
                    hop=i,
                )
                if loop.time() >= end:
                    raise RouteError(
                        f"hop {i} ({hop.url}) did not answer {what} within {self.link.timeout_s:.0f} s",
                        code="timeout",
                        hop=i,
                    )
                dead = await self._unanswered(among)
                if dead:
                    raise self._stopped(dead[0], late, always=True)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def wait_lane(self, step: Awaitable[T], n_tokens: int) -> T:
        """A decode step on hop 0's lane, against hop 0's deadline (`watch` without a provider); a late
        one is a RouteError (code "timeout") naming hop 0, for `fail` to recover or name the culprit."""
        deadline = self.deadline(0, n_tokens)
        if self.replacements is None and deadline < self.link.timeout_s:
            return await self.watch(0, step, deadline, "a lane step")
        try:
            # awaited in this task: wait_for would start a task of its own for every decode step (the
            # web's event loop runs one a token for every answer it streams)
            async with asyncio.timeout(deadline):
                return await step
        except TimeoutError:
            url = self.link.hops[0].url
            raise RouteError(
                f"hop 0 ({url}) did not answer a lane step within {deadline:.2f} s", code="timeout", hop=0
            ) from None

    async def named(self, err: RouteError) -> RouteError:
        """The failure as its reader should see it. In chain mode hop 0 answers for the whole route, so
        its timeout or 5xx may be any later hop's: the first hop that does not answer its health check
        is named instead (a stopped or dead hop; docs/failover.md)."""
        if self.mode != "chain" or len(self.link.hops) < 2 or not recoverable(err) or err.hop < 0:
            return err
        if err.code == STOPPED:  # named already (watch)
            return err
        dead = await self._unanswered()
        return self._stopped(dead[0], err) if dead else err

    def _stopped(self, j: int, err: RouteError, always: bool = False) -> RouteError:
        """`err` (noticed at hop `err.hop`) told as what it is: hop `j` stopped answering (`err` as it
        is when it names hop `j` already, unless `always`)."""
        if j == err.hop and not always:
            return err
        hop = self.link.hops[j]
        try:
            node = f", node {decode_unverified(hop.token).node}"
        except TokenError:
            node = ""
        return RouteError(
            f"hop {j} ({hop.url}{node}) stopped answering: no answer to its health check within "
            f"{self.policy.probe_timeout_s:g} s ({err})",
            code=STOPPED,
            hop=j,
        )

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
                if not recoverable(e):
                    raise
                err = e

    # -- recovery -----------------------------------------------------------------------------------
    async def _recover(self, err: RouteError) -> None:
        """Give the failed hop's layers to a replacement holding what the failed hop held."""
        assert self.replacements is not None
        t0 = time.perf_counter()
        started = time.monotonic()
        if self.mode == "chain" and len(self.link.hops) > 1:
            bad, alive = await self._chain_culprits(err)
            if not alive:  # the failure is told as the first dead hop's, not hop 0's that noticed it
                err = self._stopped(bad[0], err)
        else:
            bad, alive = [err.hop if err.hop >= 0 else 0], err.status != 0
        methods: list[str] = []
        replay = False
        provider_s = 0.0
        for i in bad:
            old = self.link.hops[i]
            t1 = time.perf_counter()
            sb, self._standby[i] = self._standby[i], None
            task = self._checkpointing.pop(i, None)
            if task is not None:
                task.cancel()
            rep: Replacement | None
            if (
                sb is not None
                and sb[0].hop.url != old.url
                and not (alive and err.code == "draining")
                and self._spare_fits(i, sb[0])
            ):
                rep, standby_n = Replacement(sb[0].hop, previous_token=sb[0].previous_token), sb[1]
            else:
                rep, standby_n = await self.replacements(i, list(self.link.hops), str(err)), -1
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
            self.link.replace(i, rep.hop, rep.previous_token)
            method = await self._restore(i, old, rep, alive, standby_n, len(bad) == 1)
            replay = replay or method == "reprefill_route"
            methods.append(method)
        if replay:
            how = await self._replay_route()
            methods = [how if m == "reprefill_route" else m for m in methods]  # from the prefix or 0
        elif self.mode == "chain" and len(self.link.hops) > 1:
            # hops that took the failed step before the failure give it back: it is sent again
            for j in range(len(self.link.hops)):
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

    async def _unanswered(self, among: range | None = None) -> list[int]:
        """The hops (of `among`, default all) that do not answer their health check within
        probe_timeout_s (asked together)."""
        t = ClientTimeout(total=self.policy.probe_timeout_s)

        async def alive(hop: Hop) -> bool:
            try:
                async with self.link.http.get(hop.url.rstrip("/") + "/v1/health", timeout=t) as r:
                    return r.status == 200
            except (ClientError, OSError, TimeoutError):
                return False

        which = list(among if among is not None else range(len(self.link.hops)))
        ok = await asyncio.gather(*(alive(self.link.hops[j]) for j in which))
        return [j for j, up in zip(which, ok, strict=True) if not up]

    async def _chain_culprits(self, err: RouteError) -> tuple[list[int], bool]:
        """Chain mode: the hops that do not answer their health check (dead), else the one the error
        names (alive: it may hand its KV off)."""
        dead = await self._unanswered()
        if dead:
            return dead, False
        named = [j for j, h in enumerate(self.link.hops) if j > 0 and h.url.rstrip("/") in str(err)]
        return named[-1:] or [max(err.hop, 0)], err.status != 0

    def _spare_fits(self, i: int, spare: Replacement) -> bool:
        """A warm spare can take hop `i`'s place: in chain mode only with the previous hop's token minted
        to name it, for the node that is the previous hop now (it may have been replaced since the copy)."""
        if self.mode != "chain" or i == 0:
            return True
        try:
            return bool(spare.previous_token) and (
                decode_unverified(spare.previous_token).node
                == decode_unverified(self.link.hops[i - 1].token).node
            )
        except TokenError:
            return False

    async def _restore(
        self, i: int, old: Hop, rep: Replacement, alive: bool, standby_n: int = -1, alone: bool = True
    ) -> str:
        """Bring the new hop `i` to the positions the old one held: snapshot hand-off, else the warm
        spare's copy plus a re-prefill of the steps after it (`standby_n` positions), else re-prefill.
        `alone`: no other hop failed with it (a chain route's spare needs its upstream hops alive)."""
        link = self.link
        want = self._len[i]
        if not link.opened:
            return "none"
        if want and alive and rep.handoff_token:
            n = await self._handoff(old, rep)
            if n is not None and n >= want:
                if n > want:  # the old hop took the failed step before failing: drop it
                    await self._truncate_hop(i, want)
                return "snapshot"
            if n is not None:  # fewer positions than the client counted: start that hop over
                with contextlib.suppress(RouteError):
                    await link.post(i, link.frame(i, Op.CLOSE), link.timeout_s)
        # the replacement of the last hop drafts with the MTP head as the hop it replaces did
        resp = await link.post(
            i, link.frame(i, Op.OPEN, pos_start=self.capacity, dim=link.open_dim(i)), link.timeout_s
        )
        chain = self.mode == "chain" and len(link.hops) > 1
        replayable = not chain and (i == 0 or self._seams_kept)
        keep = 0  # positions the new hop already holds and keeps
        # a chain client holds no seams: the steps since the copy are hop 0's, replayed through the route
        steps = self._steps[0] if chain else self._steps[i]
        on_boundary = not any(st.pos < standby_n < st.pos + st.n for st in steps)
        if (replayable or (chain and alone)) and on_boundary and 0 < standby_n <= min(want, resp.session_len):
            keep = standby_n
        if resp.session_len > keep:  # a spare's copy past what is ours, or a node that was late: cut it
            await link.post(i, link.plain_frame(i, Op.TRUNCATE, keep), link.timeout_s)
        if not want:
            return "none"
        if chain and keep:
            try:
                await self._replay_through(i, keep)
                return "standby"
            except RouteError:  # an upstream hop refused the cut or a step: start the route over
                return "reprefill_route"
        if not replayable:
            return "reprefill_route"  # _replay_route brings every hop back from position 0
        kept = [st for st in self._steps[i] if st.pos + st.n <= keep]
        steps = [st for st in self._steps[i] if st.pos >= keep]
        self._steps[i], self._len[i] = kept, keep
        if i > 0:
            self._seam_bytes -= sum(len(st.payload) for st in steps)
        for st in self._batches(steps):
            await self._give(i, st, link.timeout_s)
        return "standby" if keep else "reprefill"

    def _batches(self, steps: list[Step]) -> list[Step]:
        """The steps to replay: as they were taken (RecoveryPolicy.exact_replay), else consecutive ones
        merged up to PREFILL_CHUNK positions (one batch instead of one step per decoded token)."""
        if self.policy.exact_replay:
            return steps
        out: list[Step] = []
        for st in steps:
            last = out[-1] if out else None
            if (
                last is not None
                and (last.kind, last.dim) == (st.kind, st.dim)
                and last.pos + last.n == st.pos
                and last.n + st.n <= PREFILL_CHUNK
            ):
                out[-1] = Step(last.pos, last.n + st.n, st.kind, st.dim, last.payload + st.payload)
            else:
                out.append(st)
        return out

    async def _handoff(self, old: Hop, rep: Replacement, keep: bool = False) -> int | None:
        """Ask the old hop to export the session to the new one (`keep`: a copy, the old hop keeps
        serving it); the positions moved, or None."""
        body = {"token": base64.b64encode(rep.handoff_token).decode(), "target": rep.hop.url, "keep": keep}
        try:
            async with self.link.http.post(
                old.url.rstrip("/") + "/v1/handoff/export",
                json=body,
                timeout=ClientTimeout(total=self.policy.handoff_timeout_s),
            ) as r:
                if r.status != 200:
                    return None
                out = await read_json(r)  # bounded: a hostile hop's answer is a None, not a crash
        except (ClientError, OSError, TimeoutError, ValueError):
            return None
        n = out.get("session_len") if isinstance(out, dict) else None
        return n if isinstance(n, int) else None

    async def _truncate_hop(self, i: int, n: int) -> int:
        """Hop `i` back to at most `n` positions; what it holds now (less where recurrent state only
        goes back to a checkpoint)."""
        resp = await self.link.post(i, self.link.plain_frame(i, Op.TRUNCATE, n), self.link.timeout_s)
        self.cut(i, n)
        return min(n, resp.session_len)

    def cut(self, i: int, n: int) -> None:
        """Forget hop `i`'s steps past position `n`."""
        kept: list[Step] = []
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
        """The token ids at positions [pos, pos + n): the history's, then the step in flight's. Sliced
        apart, as a replay asks for them once per step: joining the lists would cost the whole context."""
        h = len(self.history)
        return self.history[pos : pos + n] + self.pending_ids[max(0, pos - h) : max(0, pos + n - h)]

    async def _give(self, i: int, st: Step, timeout_s: float) -> Response:
        """Send hop `i` one recorded step again (re-prefill; the last hop's token is not used)."""
        if st.kind != Kind.IDS and not st.payload:
            raise RouteFailed("the seam cache was dropped: cannot re-prefill one hop", hop=i)
        # the same frame as the first pass: the last hop's history, and the ids with the hidden rows to
        # a hop whose layers route experts by token id (deepseek4's hash layers)
        resp = await self.link.post(i, self.link.forward_frame(i, st, self._ids(st.pos, st.n)), timeout_s)
        self.record(i, st)
        return resp

    def record(self, i: int, st: Step) -> None:
        """Hop `i` took `st` (kept so that a replacement can take it again)."""
        if i > 0 and self._seams_kept:
            self._seam_bytes += len(st.payload)
            if self._seam_bytes > self.policy.seam_cache_bytes:
                # too much to keep: from now on a recovery re-prefills the whole route
                self._seams_kept = False
                for j in range(1, len(self.link.hops)):
                    self._steps[j] = [Step(s.pos, s.n, s.kind, s.dim, b"") for s in self._steps[j]]
                self._seam_bytes = 0
        keep = i == 0 or self._seams_kept
        self._steps[i].append(st if keep else Step(st.pos, st.n, st.kind, st.dim, b""))
        self._len[i] = st.pos + st.n

    def record_chain(self, st: Step) -> None:
        """Chain mode: hop 0 took `st` and passed it on, so every hop holds its positions now; the seams
        went from hop to hop, never through the client, so only hop 0's step is kept."""
        self.record(0, st)
        for j in range(len(self._len)):
            self._len[j] = st.pos + st.n

    async def _replay_through(self, i: int, m: int) -> None:
        """Chain mode: hop `i` holds a spare's copy of the first `m` positions. The hops before it give
        back every position from `m` on and take hop 0's steps since again, as they were taken, each
        feeding the next up to hop `i` (the client relays the seams for these steps only): the same
        inputs in the same chunks give the same KV bit for bit. The hops after it keep theirs."""
        n = len(self.history)
        taken = list(self._steps[0])  # hop 0's record: what _replay_route starts over from if this fails
        steps0 = self._batches([st for st in taken if st.pos >= m and st.pos + st.n <= n])
        try:
            for j in range(i):
                if self._len[j] > m and await self._truncate_hop(j, m) != m:
                    # recurrent state went back to an earlier checkpoint: the steps since m cannot be replayed
                    raise RouteError(f"hop {j} cannot go back to position {m} exactly", hop=j)
            self._steps[i], self._len[i] = [], m
            for st in steps0:
                cur = st
                for j in range(i + 1):
                    resp = await self._give(j, cur, self.link.timeout_s)
                    cur = Step(st.pos, resp.n_tokens, resp.kind, resp.dim, bytes(resp.payload))
        except RouteError:
            self._steps[0] = taken
            raise

    async def _replay_route(self) -> str:
        """Re-prefill every hop from position 0 with the steps hop 0 took (chain mode, or no seams), or
        from the session's shared prefix where every hop, the replacement too, restores it from its
        prefix snapshots (agent/client/prefix.py). Returns how: "prefix" or "reprefill_route"."""
        want = list(self._len)
        if self.mode == "chain":
            want = [len(self.history)] * len(self.link.hops)
        taken = [st for st in self._steps[0] if st.pos + st.n <= want[0]]
        for j in range(len(self.link.hops)):
            if self._len[j]:
                await self._truncate_hop(j, 0)
            self._steps[j], self._len[j] = [], 0
        self._seam_bytes = 0
        start = await self._restore_prefix(taken, min(want))
        steps0 = self._batches([st for st in taken if st.pos >= start])
        for st in steps0:
            cur = st
            for j in range(len(self.link.hops)):
                if cur.pos + cur.n > want[j]:
                    break
                resp = await self._give(j, cur, self.link.timeout_s)
                cur = Step(st.pos, resp.n_tokens, resp.kind, resp.dim, bytes(resp.payload))
        return "prefix" if start else "reprefill_route"

    async def _restore_prefix(self, taken: list[Step], most: int) -> int:
        """Every (empty) hop restores the session's shared prefix from its prefix snapshots; the
        positions they now hold (0: some hop lacks it, or the steps do not start anew at its end)."""
        ids = self.prefix_ids
        n = len(ids)
        if not n or n > most or self.history[:n] != ids or not any(st.pos == n for st in taken):
            return 0
        if any(st.pos < n < st.pos + st.n for st in taken):
            return 0
        if not await PrefixSharing(self.link).load(ids):
            return 0
        self.record(0, prefix_step(ids))
        for j in range(len(self._len)):
            self._len[j] = n
        return n

    # -- warm spares ------------------------------------------------------------------------------------
    def maybe_checkpoint(self, n_tokens: int) -> None:
        """Copy a hop's KV to a spare (in the background) once it has grown by checkpoint_tokens since
        the last copy: a hop that dies later then costs a re-prefill of only the steps after it. Only
        after a decode step, so a long prompt is copied once, when all of it is in."""
        every = self.policy.checkpoint_tokens
        if not every or self.replacements is None:
            return
        if n_tokens > self.policy.small_step_tokens:
            return
        for i in range(len(self.link.hops)):
            sb = self._standby[i]
            if i not in self._checkpointing and self._len[i] - (sb[1] if sb else 0) >= every:
                self._checkpointing[i] = asyncio.get_running_loop().create_task(self._checkpoint(i))

    async def _checkpoint(self, i: int) -> None:
        assert self.replacements is not None
        hop = self.link.hops[i]
        try:
            rep = await self.replacements(i, list(self.link.hops), STANDBY)
            if rep is None or not rep.handoff_token or rep.hop.url == hop.url:
                return
            n = await self._handoff(hop, rep, keep=True)
            if n is not None and self.link.hops[i] is hop:
                self._standby[i] = (rep, min(n, self._len[i]))
                self.checkpoints += 1
        except (RouteError, ClientError, OSError, TimeoutError):
            pass  # a spare is an optimisation: recovery falls back to a re-prefill
        finally:
            self._checkpointing.pop(i, None)
