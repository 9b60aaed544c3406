"""A route built with default options is exact enough: teacher-forced, it picks one process's top-1 token.

Three real native `serve` processes (SmolLM2 layers 0:10, 10:20, 20:30) against one in-process native
window 0:30, over tests/data/teacher_forcing_en.txt, with the same frame schedule on both sides.
bench/seam.py says why the default is f32: any rounding at a seam flips 2-4% of these positions.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from agent.backends import load_backend
from agent.backends.base import ShardSpec, StepInput
from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.client.tokenizer import ChatTokenizer
from agent.wire.frames import Kind
from agent.wire.ids import SessionId
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams

pytestmark = pytest.mark.slow
RANGES = [(0, 10), (10, 20), (20, 30)]
TEXT = Path(__file__).resolve().parents[1] / "data" / "teacher_forcing_en.txt"
PROMPT = 64  # the decode schedule's prefill, then one position per step


@pytest.fixture(scope="module")
def native_route(serve_factory):  # noqa: ANN001, ANN201
    from agent.backends import libggswarm as native

    if not native.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    return [serve_factory(f"{a}:{b}", backend="native", extra=["--threads", "2"]) for a, b in RANGES]


@pytest.fixture(scope="module")
def text_ids(model_path: str) -> list[int]:
    return ChatTokenizer(model_path).encode(TEXT.read_text(), add_bos=False)


def frames(n: int, schedule: str) -> list[tuple[int, int]]:
    """(start, length) of each frame: 128-position prefill frames, or a prompt then single steps."""
    if schedule == "prefill":
        return [(o, min(128, n - o)) for o in range(0, n, 128)]
    return [(0, PROMPT)] + [(p, 1) for p in range(PROMPT, n)]


def one_process_logits(model_path: str, manifest, ids: list[int], schedule: str) -> np.ndarray:  # noqa: ANN001
    backend = load_backend("native", ShardSpec(model_path, 0, 30, manifest, n_threads=2))
    sid = SessionId(b"o" * 16)
    backend.open_session(sid, len(ids) + 1)
    try:
        out = []
        for start, length in frames(len(ids), schedule):
            r = backend.forward(
                StepInput(
                    sid, start, token_ids=np.asarray(ids[start : start + length], np.int32), want_logits=True
                )
            )
            out.append(np.asarray(r.logits, np.float32).reshape(length, -1).copy())
        return np.concatenate(out)
    finally:
        backend.close()


def default_client(route, signing_key, manifest) -> RouteClient:  # noqa: ANN001
    session = os.urandom(16)
    plan = [RouteHop(s.node_id, s.url, a, b) for s, (a, b) in zip(route, RANGES, strict=True)]
    hops = minted_hops(signing_key, session, manifest.sha256, plan)
    return RouteClient(hops, session_id=session)  # every option left at its default


@pytest.mark.parametrize("schedule", ["prefill", "decode"])
async def test_a_default_route_agrees_with_one_process_on_the_top1_token_of_at_least_995_in_1000_positions(
    native_route, signing_key, manifest, model_path, text_ids, schedule: str
) -> None:  # noqa: ANN001
    want = one_process_logits(model_path, manifest, text_ids, schedule)
    client = default_client(native_route, signing_key, manifest)
    assert client.kind == Kind.F32  # the default this test is about: unrounded seams
    try:
        chunks = []
        for start, length in frames(len(text_ids), schedule):
            resp = await client.forward(text_ids[start : start + length], SamplingParams(), want_logits=True)
            chunks.append(resp.logits().copy())
    finally:
        await client.close()
    got = np.concatenate(chunks)
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    diff = float(np.abs(got - want).max())
    print(
        f"default seams, {schedule}: top-1 agreement {agree:.4f} over {len(text_ids)} positions, max |dlogit| {diff}"
    )
    assert agree >= 0.995
