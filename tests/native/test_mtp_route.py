"""Speculative decoding with the model's own MTP head over 3 native hops (deepseek4, glm-dsa): the last
hop drafts with its nextn block after every step and sends the drafts with its answer (Kind.TOKEN /
Kind.TOKENS `dim`), the client verifies them like any drafts; the tokens are the plain route's, and every
hop's state after (the last hop's MTP head included) is the plain route's, rejected drafts leaving no
trace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.artifacts.tiny import write_tiny_gguf
from agent.client.drafts import MtpDrafter
from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.wire.ids import SessionId
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow

SPLITS = [(0, 2), (2, 4), (4, 6)]
# per architecture: the tiny file's arguments, the hops, the caches, the layers reading token ids
CASES: dict[str, tuple[dict[str, object], list[tuple[int, int]], str, int]] = {
    "deepseek4": ({"indexer_key_length": 128}, SPLITS, "f32", 1),
    "glm-dsa": ({"n_layers": 9}, [(0, 3), (3, 6), (6, 9)], "f16", 0),
}
PROMPT = [(17 * i + 5) % 200 + 10 for i in range(40)]
N = 24
K = 4


async def mtp_node(  # noqa: ANN201 - (DataPlane, manifest, runner, url)
    path: Path,
    public_key,  # noqa: ANN001
    splits: list[tuple[int, int]] = SPLITS,
    cache: str = "f32",
    name: str = "node-m",
):
    """tests/native/routes.py's windows_on_one_node with the node's MTP option on."""
    from agent.artifacts.manifest import build_manifest
    from agent.node.dataplane import DataPlane, start_dataplane
    from tests.conftest import free_port

    manifest = build_manifest(str(path))
    dp = DataPlane(name, public_key, cache_type=cache, mtp=True)
    for a, b in splits:
        dp.load_shard(str(path), manifest, a, b, backend="native", n_threads=2)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    return dp, manifest, runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("arch", list(CASES))
@pytest.mark.parametrize("mode", ["star", "chain"])
async def test_mtp_drafts_give_the_plain_tokens_and_leave_no_trace(
    native_lib: None, signing_key, tmp_path: Path, arch: str, mode: str
) -> None:  # noqa: ANN001
    extra, splits, cache, id_layers = CASES[arch]
    path = write_tiny_gguf(arch, tmp_path / "mtp.gguf", mtp=True, **extra)
    dp, manifest, runner, url = await mtp_node(path, signing_key.public_key(), splits, cache)
    last = dp.shards[(manifest.sha256, *splits[-1])]
    assert last.backend.mtp and not dp.shards[(manifest.sha256, *splits[0])].backend.mtp

    def client() -> RouteClient:
        session = os.urandom(16)
        hops = minted_hops(
            signing_key, session, manifest.sha256, [RouteHop("node-m", url, a, b) for a, b in splits]
        )
        c = RouteClient(hops, session_id=session, capacity=512, mode=mode, token_id_layers=id_layers)
        c.mtp_draft = K  # both ask: the plain session's head follows its steps too, to compare states
        return c

    def state(c: RouteClient) -> list[bytes]:
        """Every hop's KV snapshot."""
        out = []
        for a, b in splits:
            s = dp.sessions.get((SessionId(c.session), (manifest.sha256, a, b)))
            assert s is not None
            out.append(s.backend.snapshot(s.sid))
        return out

    def head(c: RouteClient, token: int) -> list[int]:
        """The last hop's MTP drafts after the session's length: its head's state, compared."""
        s = dp.sessions.get((SessionId(c.session), (manifest.sha256, *splits[-1])))
        assert s is not None and s.mtp_draft == K
        return s.backend.mtp_draft(s.sid, s.backend.session_len(s.sid), token, K)

    plain, spec = client(), client()
    spec.spec_adaptive = False  # every step verifies what the head drafted
    try:
        sampling = SamplingParams()  # greedy
        want = [t async for t, _ in plain.generate(PROMPT, sampling, N)]
        drafter = MtpDrafter()
        got = [t async for t, _ in spec.generate(PROMPT, sampling, N, speculate=K, drafter=drafter)]
        assert got == want
        st = spec.last_spec.as_dict()
        print(f"{arch} {mode}: {st}, answers with drafts {drafter.offered}")
        assert drafter.offered >= st["verify_steps"] > 0
        assert st["drafted"] > st["accepted"]  # drafts were rejected (a random head): cut back
        assert dp.counters.get("verify_cut_exact", 0) > 0
        # the last decided token is not in the KV yet: bring both sessions to the same length
        await plain.forward([want[-1]], sampling)
        await spec.forward([got[-1]], sampling)
        assert state(spec) == state(plain)
        # the head follows the steps the native lanes ran too (chain mode: the plain session's decode
        # steps travel the lanes, which pass the token ids on to an MTP window)
        assert mode == "star" or plain.lane.steps > 0
        assert head(spec, 5) == head(plain, 5)
    finally:
        for c in (plain, spec):
            await c.close()
        await runner.cleanup()
    assert dp.stats()["sessions"] == 0


class OracleRecorder:
    """Drafts the plain answer's next tokens, every other draft with its last token wrong (verifications
    that stand whole and ones cut short, in turn, as tests/native/test_speculative.py's), and records the
    MTP drafts the last hop sends after each step, by the context length they follow."""

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer, self.calls = prompt_len, answer, 0
        self.heard: dict[int, list[int]] = {}

    def offer(self, context_len: int, drafts: list[int]) -> None:
        self.heard[context_len] = list(drafts)

    def propose(self, context: list[int], k: int) -> list[int]:
        done = len(context) - self.prompt_len
        draft = list(self.answer[done : done + k])
        self.calls += 1
        if draft and self.calls % 2 == 0:
            draft[-1] = (draft[-1] + 1) % 200 + 10
        return draft


async def test_the_head_drafts_after_the_verifications_drafts_that_stood(
    native_lib: None, signing_key, tmp_path: Path
) -> None:  # noqa: ANN001
    """After a verification the last hop drafts from where its drafts stopped standing: its drafts there
    are what the head drafts after the same tokens decoded one by one."""
    path = write_tiny_gguf("deepseek4", tmp_path / "ds4-mtp.gguf", mtp=True, indexer_key_length=128)
    dp, manifest, runner, url = await mtp_node(path, signing_key.public_key())

    def client() -> RouteClient:
        session = os.urandom(16)
        hops = minted_hops(
            signing_key, session, manifest.sha256, [RouteHop("node-m", url, a, b) for a, b in SPLITS]
        )
        c = RouteClient(hops, session_id=session, capacity=512, mode="star", token_id_layers=1)
        c.mtp_draft = K
        return c

    plain, spec = client(), client()
    spec.spec_adaptive = False
    try:
        sampling = SamplingParams()
        want: list[int] = []
        plain_drafts: dict[int, list[int]] = {}
        async for t, _ in plain.generate(PROMPT, sampling, N):
            want.append(t)
            assert plain.last_response is not None
            plain_drafts[len(PROMPT) + len(want)] = plain.last_response.drafts()
        rec = OracleRecorder(len(PROMPT), want)
        got = [t async for t, _ in spec.generate(PROMPT, sampling, N, speculate=K, drafter=rec)]
        assert got == want
        st = spec.last_spec.as_dict()
        assert 0 < st["accepted"] < st["drafted"]
        assert len(rec.heard) > 4 and all(len(d) == K for d in rec.heard.values())
        for n, drafts in rec.heard.items():
            assert drafts == plain_drafts[n], n
    finally:
        for c in (plain, spec):
            await c.close()
        await runner.cleanup()


async def test_a_session_handed_off_keeps_drafting_with_the_head(
    native_lib: None, signing_key, tmp_path: Path
) -> None:  # noqa: ANN001
    """The MTP head's state moves with the session's snapshot (API v16) and the drafts it was asked for
    with the hand-off body: after a hand-off to another node the head there drafts on at once (the
    answers carry its drafts, verified like any), and the tokens are the plain route's."""
    import base64

    from aiohttp import ClientSession

    from agent.wire.handofftoken import mint_handoff

    path = write_tiny_gguf("deepseek4", tmp_path / "ds4-mtp.gguf", mtp=True, indexer_key_length=128)
    nodes, runners = {}, []
    for name in ("node-a", "node-b"):  # each holds the whole model as one window
        dp, manifest, runner, url = await mtp_node(path, signing_key.public_key(), [(0, 6)], name=name)
        runners.append(runner)
        nodes[name] = (dp, url)

    def hops(name: str, session: bytes) -> list:  # noqa: ANN202
        return minted_hops(signing_key, session, manifest.sha256, [RouteHop(name, nodes[name][1], 0, 6)])

    session, other = os.urandom(16), os.urandom(16)
    plain = RouteClient(hops("node-a", other), session_id=other, capacity=512, token_id_layers=1)
    moved = RouteClient(hops("node-a", session), session_id=session, capacity=512, token_id_layers=1)
    moved.mtp_draft = K
    moved.spec_adaptive = False  # every step verifies what the head drafted
    sampling = SamplingParams()
    try:
        want = [t async for t, _ in plain.generate(PROMPT, sampling, N)]
        before = MtpDrafter()
        got = [t async for t, _ in moved.generate(PROMPT, sampling, 8, speculate=K, drafter=before)]
        assert before.offered > 0
        token = mint_handoff(signing_key, session, manifest.sha256, 0, 6, "node-a", "node-b")
        async with ClientSession() as http:
            body = {"token": base64.b64encode(token).decode(), "target": nodes["node-b"][1]}
            async with http.post(nodes["node-a"][1] + "/v1/handoff/export", json=body) as r:
                assert r.status == 200, await r.text()
        assert nodes["node-b"][0].stats()["sessions"] == 1
        moved.hops[0] = hops("node-b", session)[0]
        after = MtpDrafter()
        got += [
            t
            async for t, _ in moved.generate(PROMPT + got, sampling, N - len(got), speculate=K, drafter=after)
        ]
        assert got[: len(want)] == want
        assert moved.last_prefilled == 1  # the session went on from its moved state
        st = moved.last_spec.as_dict()
        print(f"after the hand-off: {st}, answers with drafts {after.offered}")
        assert after.offered >= st["verify_steps"] > 0
    finally:
        for c in (plain, moved):
            await c.close()
        for r in runners:
            await r.cleanup()
