"""A sampled token outside the model's vocabulary (a lying or broken last hop) is refused at the route
client's boundary with an error naming that hop, and the tokenizer refuses it too, where llama.cpp's
detokenizer aborted the whole process (the web's, with every user's answer in it). docs/security.md,
"A token outside the vocabulary"."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from aiohttp import web

from agent.client.recovery import Hop
from agent.client.route import RouteClient, RouteError
from agent.client.spec import SpecStats
from agent.client.speculate import _send, in_vocabulary
from agent.client.tokenizer import ChatTokenizer, StreamDecoder, TokenizerError
from agent.wire.frames import Kind, Op, Response, decode_request, encode_response
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port

VOCAB = 100


async def _lying_hop(token: int) -> tuple[web.AppRunner, str]:
    """One hop holding the whole model that answers every forward with `token`."""

    async def frame(request: web.Request) -> web.Response:
        req = decode_request(await request.read())
        kind = Kind.TOKEN if req.op == Op.FORWARD else Kind.NONE
        n = req.pos_start + req.n_tokens
        return web.Response(
            body=encode_response(Response(step=req.step, kind=kind, token=token, session_len=n))
        )

    app = web.Application()
    app.router.add_post("/v1/frame", frame)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("token", [VOCAB, 10**6, 2**31 - 1])
async def test_a_sampled_token_outside_the_vocabulary_is_refused_naming_the_last_hop(token: int) -> None:
    runner, url = await _lying_hop(token)
    tok = SimpleNamespace(n_vocab=VOCAB)  # the route client reads only the vocabulary's size
    c = RouteClient([Hop(url, 0, 30, os.urandom(8))], tok, lane=False)  # type: ignore[arg-type]
    try:
        with pytest.raises(RouteError) as err:
            async for _ in c.generate([1, 2, 3], SamplingParams(), 4):
                pass
    finally:
        await c.close()
        await runner.cleanup()
    assert err.value.code == "bad_token" and err.value.hop == 0 and err.value.status == 502
    assert f"token {token}" in str(err.value) and url in str(err.value)


async def test_the_verification_path_checks_every_sampled_position() -> None:
    tok = SimpleNamespace(n_vocab=VOCAB)
    c = RouteClient([Hop("http://127.0.0.1:9", 0, 30, b"t")], tok)  # type: ignore[arg-type]
    try:
        c.check_sampled([0, 5, VOCAB - 1])
        with pytest.raises(RouteError, match=f"answered token {VOCAB}, outside"):
            c.check_sampled([5, VOCAB, 7])
    finally:
        await c.close()


def test_the_tokenizer_refuses_an_id_outside_its_vocabulary_instead_of_aborting(model_path: str) -> None:
    # in a process of its own: before the check, llama.cpp's std::out_of_range ended the process
    code = (
        "import sys\n"
        "from agent.client.tokenizer import ChatTokenizer, TokenizerError\n"
        "t = ChatTokenizer(sys.argv[1])\n"
        "for bad in (t.n_vocab, 10**6, -1):\n"
        "    try:\n"
        "        t.decode_bytes([bad])\n"
        "    except TokenizerError as e:\n"
        "        print('refused', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, model_path], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("refused") == 3 and "outside the vocabulary" in out.stdout


def test_a_stream_decoder_gives_the_texts_bytes_and_detokenizes_each_token_once(model_path: str) -> None:
    tok = ChatTokenizer(model_path)
    text = "héllo wörld, 日本語 and an emoji 👋 — héllo wörld again 👋"
    ids = tok.encode(text, add_bos=False)
    calls: list[list[int]] = []
    detokenize = tok._llm.detokenize

    def counted(ids_: list[int], *a: object, **kw: object) -> bytes:
        calls.append(list(ids_))
        return detokenize(ids_, *a, **kw)

    tok._llm.detokenize = counted  # type: ignore[method-assign]
    dec = StreamDecoder(tok)
    out = "".join(dec.push(t) for t in ids) + dec.flush()
    assert out.encode() == detokenize(ids)
    assert sorted(c[0] for c in calls) == sorted(set(ids))  # each distinct token once
    with pytest.raises(TokenizerError):
        tok.token_bytes(tok.n_vocab)


def test_drafts_end_at_the_first_id_outside_the_vocabulary() -> None:
    assert in_vocabulary([5, 7, 9], VOCAB) == [5, 7, 9]
    assert in_vocabulary([5, VOCAB, 7], VOCAB) == [5]
    assert in_vocabulary([-1, 5], VOCAB) == []
    assert in_vocabulary([5, 10**6], None) == [5, 10**6]  # no tokenizer: only negative ids are known bad


async def test_a_lying_heads_drafts_past_the_vocabulary_never_reach_hop_0() -> None:
    # a last hop's MTP head (MtpDrafter) or any drafter proposing an id past the vocabulary: hop 0 would
    # refuse the step and be blamed for it; the step goes with the drafts before that id only
    sent: list[list[int]] = []

    def send_ahead(
        ids: list[int], _sampling: SamplingParams, sample_all: bool = False
    ) -> asyncio.Future[Response]:
        sent.append(list(ids))
        return asyncio.get_running_loop().create_future()

    route = SimpleNamespace(
        last_spec=SpecStats(),
        spec_adaptive=False,
        off_lanes=False,
        hop_stats=[],
        history=[1, 2, 3],
        n_vocab=VOCAB,
        send_ahead=send_ahead,
    )
    drafter = SimpleNamespace(propose=lambda _context, _k: [5, 6, 10**6, 8])
    step = _send(route, [1, 2, 3, 4], SamplingParams(), 4, drafter)  # type: ignore[arg-type]
    assert sent == [[4, 5, 6]] and step.drafts == [5, 6]
