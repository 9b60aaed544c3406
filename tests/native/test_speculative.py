"""Speculative decoding over 3 native hops of every architecture (every state kind): the tokens are the plain route's, token
for token, and a rejected draft leaves every hop's state as if it had never been sent: bit for bit the
plain route's state (a verification runs its rows as decode steps, agent/node/verify.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.artifacts import archtable
from agent.artifacts.tiny import write_suite_gguf, write_tiny_gguf
from agent.client.errors import RouteError
from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.wire.ids import SessionId
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams
from tests.native.routes import windows_on_one_node

pytestmark = pytest.mark.slow

# every row of agent/artifacts/archtable.py on its suite file, cut where the state kinds change hands
# (sliding-window and global layers, recurrent and full attention, deepseek4's hash-routed and
# compressing layers): (hops, the suite file's overrides, layers reading token ids)
CASES: dict[str, tuple[list[tuple[int, int]], dict[str, object], int]] = {
    a.name: (list(a.suite.splits), {}, 0) for a in archtable.ARCHITECTURES
}
# deepseek4's hash-routed layers reach into the second hop: the client sends it the token ids too
CASES["deepseek4"] = (CASES["deepseek4"][0], {"hash_layers": 3}, 3)
PROMPT = [(17 * i + 5) % 200 + 10 for i in range(40)]
N = 24


class OracleDrafter:
    """Drafts the plain answer's next tokens, every other draft with its last token wrong: verification
    steps that accept everything and steps that reject part of the draft, in turn."""

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer, self.calls = prompt_len, answer, 0

    def propose(self, context: list[int], k: int) -> list[int]:
        done = len(context) - self.prompt_len  # answer tokens decided so far
        draft = list(self.answer[done : done + k])
        self.calls += 1
        if draft and self.calls % 2 == 0:
            draft[-1] = (draft[-1] + 1) % 200 + 10
        return draft


@pytest.mark.parametrize("arch", list(CASES))
@pytest.mark.parametrize("mode", ["star", "chain"])
async def test_speculative_tokens_equal_plain_and_rejected_drafts_leave_no_trace(
    native_lib: None, signing_key, tmp_path: Path, arch: str, mode: str
) -> None:  # noqa: ANN001
    splits, extra, token_id_layers = CASES[arch]
    path = write_suite_gguf(arch, tmp_path, **extra)
    dp, manifest, runner, url = await windows_on_one_node(path, splits, signing_key.public_key(), "node-s")

    def client() -> RouteClient:
        session = os.urandom(16)
        # each token names the next hop: chain mode forwards only there
        hops = minted_hops(
            signing_key, session, manifest.sha256, [RouteHop("node-s", url, a, b) for a, b in splits]
        )
        return RouteClient(hops, session_id=session, capacity=512, mode=mode, token_id_layers=token_id_layers)

    def states(c: RouteClient) -> list[tuple[bytes, list[int] | None]]:
        """Every hop's KV snapshot, and the last hop's token history (for the repetition penalty) where
        no lane holds it (star mode: chain-mode decode steps travel the lane, which keeps its own)."""
        out = []
        for a, b in splits:
            s = dp.sessions.get((SessionId(c.session), (manifest.sha256, a, b)))
            assert s is not None
            out.append((s.backend.snapshot(s.sid), list(s.history) if mode == "star" else None))
        return out

    def checkpoints(c: RouteClient) -> list[list[int]]:
        """Every hop's checkpoint positions (recurrent windows keep some at prompt ends and intervals)."""
        out = []
        for a, b in splits:
            s = dp.sessions.get((SessionId(c.session), (manifest.sha256, a, b)))
            assert s is not None
            out.append(s.backend.model.checkpoints(s.backend._sid(s.sid)))
        return out

    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    plain, spec = client(), client()
    spec.spec_adaptive = False  # every step drafts what the drafter gives: both paths run on every arch
    try:
        for sampling in (SamplingParams(), sampled):
            want = [t async for t, _ in plain.generate(PROMPT, sampling, N)]
            drafter = OracleDrafter(len(PROMPT), want)
            got = [t async for t, _ in spec.generate(PROMPT, sampling, N, speculate=4, drafter=drafter)]
            assert got == want
            st = spec.last_spec.as_dict()
            assert st["accepted"] > 0 and st["accepted"] < st["drafted"]  # both paths ran
            assert st["tokens_per_round_trip"] > 1.5
            if archtable.family(arch) == archtable.DELTA_NET:
                # recurrent state went back to the step's checkpoint and ran what stood again
                assert dp.counters.get("verify_cut_replayed", 0) > 0
            else:
                assert dp.counters.get("verify_cut_exact", 0) > 0
            # the last decided token is not in the KV yet: bring both sessions to the same length
            await plain.forward([want[-1]], sampling)
            await spec.forward([got[-1]], sampling)
            assert states(spec) == states(plain)
            # verifications leave no checkpoint of their own behind (they would push out the turns')
            assert checkpoints(spec) == checkpoints(plain)
    finally:
        for c in (plain, spec):
            await c.close()
        await runner.cleanup()
    assert dp.stats()["sessions"] == 0


async def test_a_frame_may_start_behind_the_session_only_inside_its_latest_verification(
    native_lib: None, signing_key, tmp_path: Path
) -> None:  # noqa: ANN001
    path = write_tiny_gguf("llama", tmp_path / "llama.gguf")
    dp, manifest, runner, url = await windows_on_one_node(path, [(0, 4)], signing_key.public_key(), "node-s")
    session = os.urandom(16)
    hops = minted_hops(signing_key, session, manifest.sha256, [RouteHop("node-s", url, 0, 4)])
    c = RouteClient(hops, session_id=session, capacity=256, lane=False)
    greedy = SamplingParams()
    try:
        await c.forward(PROMPT, greedy)
        v = len(c.history)
        await c.forward([11, 12, 13, 14], greedy, sample_all=True)
        del c.history[v + 2 :]  # two of its positions stand: the next frame cuts the rest off
        await c.forward([15], greedy)
        assert dp.counters["verify_cut_exact"] == 1 and len(c.history) == v + 3
        del c.history[v + 1 :]  # inside the old verification, after a plain step: refused
        with pytest.raises(RouteError) as e:
            await c.forward([16], greedy)
        assert e.value.status == 409 and e.value.code == "bad_position"
        c.history[:] = c.history + [12, 15]
        w = len(c.history)
        await c.forward([17, 18], greedy, sample_all=True)
        del c.history[w:]  # at the verification's first position: its token always stands
        with pytest.raises(RouteError) as e:
            await c.forward([19], greedy)
        assert e.value.status == 409
    finally:
        await c.close()
        await runner.cleanup()
