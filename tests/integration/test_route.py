"""A sticky 3-hop route over real `serve` processes on 127.0.0.1: exactness, multi-turn, bad input, cleanup."""

from __future__ import annotations

import json
import os
import struct
import time
import urllib.request

import numpy as np
import pytest
from aiohttp import ClientSession

from agent.backends.base import ShardSpec
from agent.backends.torch_llama import TorchLlamaBackend
from agent.client.recovery import minted_hops
from agent.client.route import ContextLimitError, Hop, RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.wire.frames import (
    MAX_TOKENS_PER_FRAME,
    PROTOCOL_VERSION,
    REQ_HEADER,
    Kind,
    Op,
    Request,
    encode_request,
)
from agent.wire.routetoken import RouteHop, mint
from agent.wire.sampling import SamplingParams
from tests.helpers import greedy_through

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def route(serve_factory, manifest):  # noqa: ANN001, ANN201
    servers = [serve_factory(layers) for layers in ("0:10", "10:20", "20:30")]
    yield servers


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> ChatTokenizer:
    return ChatTokenizer(model_path)


def make_hops(route, signing_key, manifest, session: bytes, ttl_s: int = 600) -> list[Hop]:  # noqa: ANN001
    ranges = [(0, 10), (10, 20), (20, 30)]
    # each token names the next hop: chain mode forwards only there (issue 17)
    plan = [RouteHop(s.node_id, s.url, a, b) for s, (a, b) in zip(route, ranges, strict=True)]
    return minted_hops(signing_key, session, manifest.sha256, plan, ttl_s)


def reference_greedy(model_path: str, manifest, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """The torch backend holding all 30 layers in this process."""
    return greedy_through([TorchLlamaBackend(ShardSpec(model_path, 0, 30, manifest, n_threads=2))], prompt, n)


@pytest.fixture(scope="module")
def reference(model_path: str, manifest, tokenizer: ChatTokenizer) -> tuple[list[int], list[int]]:  # noqa: ANN001
    prompt = tokenizer.encode_chat(QUESTION)
    return prompt, reference_greedy(model_path, manifest, prompt, 64)


async def route_greedy(client: RouteClient, prompt: list[int], n: int) -> list[int]:
    return [t async for t, _ in client.generate(prompt, SamplingParams(), n)]


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/health", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.parametrize("mode", ["chain", "star"])
async def test_three_hops_produce_the_same_64_greedy_tokens_as_one_process(
    route, signing_key, manifest, tokenizer, reference, mode: str
) -> None:  # noqa: ANN001
    prompt, expected = reference
    session = os.urandom(16)
    client = RouteClient(
        make_hops(route, signing_key, manifest, session), tokenizer, session_id=session, mode=mode
    )
    try:
        got = await route_greedy(client, prompt, 64)
    finally:
        await client.close()
    assert got == expected


async def test_closing_a_session_frees_its_kv_on_every_hop(route, signing_key, manifest, tokenizer) -> None:  # noqa: ANN001
    base = [health(s.url)["kv_bytes"] for s in route]
    session = os.urandom(16)
    client = RouteClient(make_hops(route, signing_key, manifest, session), tokenizer, session_id=session)
    await route_greedy(client, tokenizer.encode_chat(QUESTION), 4)
    during = [health(s.url) for s in route]
    assert all(h["kv_bytes"] > b for h, b in zip(during, base, strict=True))
    await client.close()
    assert [health(s.url)["kv_bytes"] for s in route] == base


async def test_turn_two_prefills_only_its_new_tokens_and_an_edit_truncates(
    route, signing_key, manifest, tokenizer
) -> None:  # noqa: ANN001
    session = os.urandom(16)
    client = RouteClient(make_hops(route, signing_key, manifest, session), tokenizer, session_id=session)
    try:
        msgs = [{"role": "user", "content": "Name a colour."}]
        answer = ""
        async for ev in client.chat(msgs, max_tokens=12):
            answer += ev.text
            if ev.done:
                t1 = ev.telemetry
        assert t1["n_reused"] == 0 and t1["n_prefilled"] == t1["n_prompt"]
        in_kv = len(client.history)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And another one?"}]
        async for ev in client.chat(msgs, max_tokens=8):
            if ev.done:
                t2 = ev.telemetry
        # Turn 2 reuses everything turn 1 left in the KV except at most the unfed end-of-turn token.
        assert t2["n_reused"] >= in_kv - 1
        assert t2["n_prefilled"] == t2["n_prompt"] - t2["n_reused"] < t2["n_prompt"] // 2
        # Editing the first question invalidates everything after the edit point.
        edited = [{"role": "user", "content": "Name a fruit."}]
        async for ev in client.chat(edited, max_tokens=4):
            if ev.done:
                t3 = ev.telemetry
        prompt3 = tokenizer.encode_chat(edited)
        common = next(
            i for i, (a, b) in enumerate(zip(prompt3, tokenizer.encode_chat(msgs), strict=False)) if a != b
        )
        assert t3["n_reused"] == common and t3["n_prefilled"] == len(prompt3) - common
        lens = {s["sessions"] for s in (health(r.url) for r in route)}
        assert lens == {1}
    finally:
        await client.close()


async def test_prompts_beyond_the_context_limit_get_a_clear_error(
    route, signing_key, manifest, tokenizer
) -> None:  # noqa: ANN001
    session = os.urandom(16)
    client = RouteClient(
        make_hops(route, signing_key, manifest, session), tokenizer, session_id=session, capacity=32
    )
    try:
        with pytest.raises(ContextLimitError, match="exceeds the context limit of 32"):
            async for _ in client.chat(QUESTION):
                pass
    finally:
        await client.close()


class Raw:
    """Sends hand-made frames to one hop."""

    def __init__(self, http: ClientSession, url: str) -> None:
        self.http, self.url = http, url

    async def post(self, body: bytes) -> tuple[int, dict]:
        async with self.http.post(self.url + "/v1/frame", data=body) as r:
            data = await r.read()
            return r.status, (json.loads(data) if r.status != 200 else {})


async def test_bad_frames_get_clear_4xx_while_another_session_keeps_decoding(
    route, signing_key, manifest, tokenizer, reference
) -> None:  # noqa: ANN001
    prompt, expected = reference
    good_sid = os.urandom(16)
    good = RouteClient(make_hops(route, signing_key, manifest, good_sid), tokenizer, session_id=good_sid)
    mid = route[1]
    bad_sid = os.urandom(16)
    tok = mint(signing_key, bad_sid, manifest.sha256, 10, 20, mid.node_id, 600)
    hidden = np.zeros((1, 576), np.float16).tobytes()

    def frame(**kw: object) -> bytes:
        base = dict(
            op=Op.FORWARD,
            session=bad_sid,
            step=1,
            pos_start=0,
            n_tokens=1,
            kind=Kind.F16,
            dim=576,
            token=tok,
            payload=hidden,
        )
        base.update(kw)
        return encode_request(Request(**base))  # type: ignore[arg-type]

    async with ClientSession() as http:
        raw = Raw(http, mid.url)
        assert (
            await raw.post(frame(op=Op.OPEN, pos_start=64, n_tokens=0, kind=Kind.NONE, dim=0, payload=b""))
        )[0] == 200
        ok, _ = await raw.post(frame())
        assert ok == 200
        good_frame = frame(step=2, pos_start=1)
        v2 = bytearray(good_frame)
        v2[4:6] = struct.pack("<H", PROTOCOL_VERSION + 1)
        huge = REQ_HEADER.pack(
            b"GSWP",
            PROTOCOL_VERSION,
            int(Op.FORWARD),
            0,
            bad_sid,
            3,
            1,
            MAX_TOKENS_PER_FRAME + 1,
            int(Kind.F16),
            0,
            576,
            2 * 576 * (MAX_TOKENS_PER_FRAME + 1),
        )
        cases = {
            "truncated": (good_frame[:60], 400, "bad_frame"),
            "magic": (b"NOPE" + good_frame[4:], 400, "bad_frame"),
            "version": (bytes(v2), 400, "bad_frame"),
            "n_tokens": (huge, 413, "bad_frame"),
            "hidden_size": (frame(step=2, pos_start=1, dim=100, payload=b"\0" * 200), 400, "hidden_size"),
            "unknown_session": (
                encode_request(
                    Request(
                        op=Op.FORWARD,
                        session=b"u" * 16,
                        step=1,
                        n_tokens=1,
                        kind=Kind.F16,
                        dim=576,
                        payload=hidden,
                        token=mint(signing_key, b"u" * 16, manifest.sha256, 10, 20, mid.node_id),
                    )
                ),
                404,
                "unknown_session",
            ),
            "replayed": (
                frame(step=1, pos_start=0, payload=np.ones((1, 576), np.float16).tobytes()),
                409,
                "replayed_step",
            ),
            "no_token": (frame(step=2, pos_start=1, token=b""), 401, "bad_token"),
            "forged": (frame(step=2, pos_start=1, token=tok[:-1] + bytes([tok[-1] ^ 1])), 401, "bad_token"),
            "expired": (
                frame(
                    step=2,
                    pos_start=1,
                    token=mint(signing_key, bad_sid, manifest.sha256, 10, 20, mid.node_id, ttl_s=-5),
                ),
                401,
                "bad_token",
            ),
            "wrong_range": (
                frame(
                    step=2, pos_start=1, token=mint(signing_key, bad_sid, manifest.sha256, 0, 10, mid.node_id)
                ),
                403,
                "wrong_range",
            ),
            "no_chain": (frame(step=2, pos_start=1, chain_cached=True), 409, "no_chain"),
            "beyond_cap": (
                frame(step=2, pos_start=1, n_tokens=64, payload=np.zeros((64, 576), np.float16).tobytes()),
                400,
                "context_cap",
            ),
        }
        got_tokens: list[int] = []
        gen = good.generate(prompt, SamplingParams(), 24)
        names = list(cases)
        async for t, _ in gen:
            got_tokens.append(t)
            if names:
                name = names.pop()
                body, status, code = cases[name]
                st, err = await raw.post(body)
                assert (st, err.get("error")) == (status, code), (name, err)
                assert err["message"]
        await good.close()
        assert got_tokens == expected[:24]
        # A retried step is answered again without appending KV twice.
        st1 = health(mid.url)
        retry = frame(step=2, pos_start=1)
        assert (await raw.post(retry))[0] == 200
        assert (await raw.post(retry))[0] == 200
        assert (await raw.post(frame(step=3, pos_start=2)))[0] == 200
        assert health(mid.url)["frames"] >= st1["frames"] + 3
    assert all(s.proc.poll() is None for s in route)


async def test_unreachable_hop_is_reported_by_the_route_client(
    route, signing_key, manifest, tokenizer
) -> None:  # noqa: ANN001
    session = os.urandom(16)
    hops = make_hops(route, signing_key, manifest, session)
    hops[2] = Hop("http://127.0.0.1:9", 20, 30, hops[2].token)
    client = RouteClient(hops, tokenizer, session_id=session, mode="star", timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(Exception, match="unreachable"):
        await route_greedy(client, [1, 2, 3], 2)
    assert time.monotonic() - t0 < 10
    await client.close()


async def test_teacher_forced_route_agrees_with_llama_cpp_on_90_percent(
    route, signing_key, manifest, model_path
) -> None:  # noqa: ANN001
    llama_cpp = pytest.importorskip("llama_cpp")
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "data" / "teacher_forcing_en.txt").read_text()
    llm = llama_cpp.Llama(model_path, n_ctx=1024, n_threads=2, logits_all=True, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False)
    llm.eval(ids)
    ref = np.array(llm.scores[: len(ids)])
    del llm
    session = os.urandom(16)
    client = RouteClient(make_hops(route, signing_key, manifest, session), session_id=session)
    try:
        chunks = []
        for off in range(0, len(ids), 128):
            resp = await client.forward(ids[off : off + 128], SamplingParams(), want_logits=True)
            chunks.append(resp.logits().copy())
    finally:
        await client.close()
    got = np.concatenate(chunks)
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    print(
        f"teacher-forced top-1 agreement, 3-hop torch route (f16 seams) vs llama.cpp: {agree:.4f} "
        f"over {len(ids)} positions; max |logit diff| {np.abs(got - ref).max():.3f}"
    )
    assert agree >= 0.90
