"""Helpers that drive chains of backends in-process like a route client would, for the native tests
(`route_forward` is agent/dev/chain.py's, which the benchmarks use too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.backends.base import Backend
from agent.dev.chain import route_forward
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]


def generate(
    hops: list[Backend],
    sid: SessionId,
    prompt: list[int],
    n_new: int,
    sampling: SamplingParams | None = None,
    pos: int = 0,
) -> list[int]:
    """Prefill `prompt` at `pos` then decode `n_new` tokens one step at a time."""
    history = list(prompt)
    res = route_forward(hops, sid, pos, prompt, sampling, history)
    out = [int(res.token)]
    pos += len(prompt)
    while len(out) < n_new:
        history.append(out[-1])
        res = route_forward(hops, sid, pos, [out[-1]], sampling, history)
        pos += 1
        out.append(int(res.token))
    return out


def truncate_route(hops_and_sids: list, n: int) -> tuple[int, list[str]]:  # noqa: ANN001 - (hop, sid) pairs
    """What the route client does with an edit at `n`: every hop goes back to at most n (truncate_to),
    then all to the smallest. `hops_and_sids`: a list (read more than once). Returns the position they
    all hold and what each hop did with the first request."""
    target, kinds = n, []
    while True:
        res = [h.truncate_to(s, target) for h, s in hops_and_sids]
        kinds = kinds or [k for _, k in res]
        held = min(p for p, _ in res)
        if held == target:
            return held, kinds
        target = held


def open_sessions(hops: list, capacity: int = 1024) -> list[int]:  # noqa: ANN001 - NativeModel hops
    """One session per NativeModel hop; their ids in hop order."""
    return [h.open_session(capacity) for h in hops]


def close_sessions(hops: list, sids: list[int]) -> None:  # noqa: ANN001
    for h, s in zip(hops, sids, strict=True):
        h.close_session(s)


def native_forward(
    hops: list,  # noqa: ANN001 - NativeModel hops
    sids: list[int],
    pos: int,
    ids: list[int],
    logits: bool = True,
    ids_everywhere: bool = False,
) -> dict:
    """`ids` at `pos` through NativeModel hops (hidden rows passed on); the last hop's result dict.
    `ids_everywhere`: every hop gets the token ids too (deepseek4's hash-routed layers read them)."""
    x = None
    r: dict = {}
    tok = np.asarray(ids, dtype=np.int32)
    for h, sid in zip(hops, sids, strict=True):
        r = h.forward(
            sid,
            pos,
            token_ids=tok if h.is_first or ids_everywhere else None,
            hidden=x,
            want_logits=logits and h.is_last,
        )
        x = r.get("hidden")
    return r


def logits_rows(r: dict, n: int) -> np.ndarray:
    """The last hop's logits as n rows."""
    return np.asarray(r["logits"], dtype=np.float32).reshape(n, -1)


def llama_with_cache(  # noqa: ANN201 - llama_cpp.Llama
    path: str, cache_type: str = "f32", n_ctx: int = 1024, swa_full: bool | None = None
):
    """llama-cpp-python on `path` with every logit kept and its attention caches in `cache_type` ("f16",
    its default, "f32", or quantized "q8_0" / "q4_0"), flash attention off, or on for a quantized cache
    (llama.cpp refuses a quantized V without it): the oracle of windows run with the same cache type.
    `swa_full` False gives sliding-window layers llama.cpp's ring instead of llama-cpp-python's default
    full-size cache."""
    import pytest

    llama_cpp = pytest.importorskip("llama_cpp")
    # ggml type ids, as llama.cpp's type_k / type_v take them
    kv = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}[cache_type]
    return llama_cpp.Llama(
        model_path=path,
        logits_all=True,
        n_ctx=n_ctx,
        n_threads=2,
        flash_attn=cache_type.startswith("q"),
        type_k=kv,
        type_v=kv,
        verbose=False,
        **({} if swa_full is None else {"swa_full": swa_full}),
    )


def native_hops(path: str, splits: list[tuple[int, int]], cache_type: str = "f16") -> list:  # noqa: ANN001
    """NativeModel windows of `path` at `splits` (2 threads), their caches in `cache_type`."""
    from agent.backends.libggswarm import NativeModel

    hops = [NativeModel(path, a, b, n_threads=2) for a, b in splits]
    for h in hops:
        h.set_cache_type(cache_type)
    return hops


def llama_greedy(llama, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001 - llama_cpp.Llama
    """n greedy tokens of llama-cpp-python after `prompt` (argmax of its scores)."""
    llama.reset()
    llama.eval(prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(llama.scores[llama.n_tokens - 1])))
        llama.eval([out[-1]])
    return out


def native_greedy(hops: list, prompt: list[int], n: int, ids_everywhere: bool = False) -> list[int]:  # noqa: ANN001
    """n greedy tokens (the last hop's sampler) of NativeModel hops after `prompt`, in fresh sessions."""
    sids = open_sessions(hops)
    try:
        got = [int(native_forward(hops, sids, 0, prompt, False, ids_everywhere)["token"])]
        while len(got) < n:
            pos = len(prompt) + len(got) - 1
            got.append(int(native_forward(hops, sids, pos, [got[-1]], False, ids_everywhere)["token"]))
    finally:
        close_sessions(hops, sids)
    return got


_CONTINUE_CHILD = """
import json, sys
import numpy as np
from agent.backends.libggswarm import NativeModel
path, splits, files = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
start, n, tok, ids_everywhere = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1"
hops = [NativeModel(path, a, b, n_threads=2) for a, b in splits]
for h in hops:
    h.set_cache_type(sys.argv[8])
sids = [h.open_session(1024) for h in hops]
for h, s, f in zip(hops, sids, files):
    h.restore(s, open(f, "rb").read())
pos, out = start, []
for _ in range(n):
    x = None
    for h, s in zip(hops, sids):
        ids = np.asarray([tok], dtype=np.int32) if h.is_first or ids_everywhere else None
        r = h.forward(s, pos, token_ids=ids, hidden=x, want_logits=h.is_last)
        x = r.get("hidden")
    out.append([int(r["token"]), np.asarray(r["logits"], dtype=np.float32).ravel().tolist()[:64]])
    tok, pos = out[-1][0], pos + 1
print(json.dumps(out))
"""


def continue_in_another_process(
    gguf: str,
    splits: list[tuple[int, int]],
    files: list[str],
    start: int,
    n: int,
    tok: int,
    ids_everywhere: bool = False,
    cache_type: str = "f16",
) -> list[list[object]]:
    """Restore each hop's snapshot file in a fresh process and decode `n` greedy steps from `tok` at
    `start`: [[token, first 64 logits], ...]. ids_everywhere: every hop also takes the token ids
    (deepseek4's hash-routed layers); cache_type: the hops' (as the snapshots' were taken)."""
    import json
    import subprocess
    import sys

    args = [
        gguf,
        json.dumps(splits),
        json.dumps(files),
        str(start),
        str(n),
        str(tok),
        "1" if ids_everywhere else "0",
        cache_type,
    ]
    out = subprocess.run(
        [sys.executable, "-c", _CONTINUE_CHILD, *args], capture_output=True, text=True, cwd=REPO, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def here_and_in_another_process(
    gguf: str,
    hops: list,  # noqa: ANN001 - NativeModel hops
    splits: list[tuple[int, int]],
    prompt: list[int],
    tmp_path: Path,
    ids_everywhere: bool = False,
    cache_type: str = "f16",
) -> tuple[list[list[object]], list[list[object]]]:
    """Prefill `prompt`, snapshot every hop to a file, decode 8 greedy steps here; then restore the files
    in a fresh process and decode the same 8 there: ([[token, first 64 logits], ...] here, there)."""
    sids = open_sessions(hops)
    try:
        tok = int(native_forward(hops, sids, 0, prompt, False, ids_everywhere)["token"])
        files = []
        for i, (h, s) in enumerate(zip(hops, sids, strict=True)):
            f = tmp_path / f"hop{i}.snap"
            f.write_bytes(h.snapshot(s))
            files.append(str(f))
        here: list[list[object]] = []
        t, pos = tok, len(prompt)
        for _ in range(8):
            r = native_forward(hops, sids, pos, [t], True, ids_everywhere)
            here.append([int(r["token"]), logits_rows(r, 1)[0, :64].tolist()])
            t, pos = int(r["token"]), pos + 1
    finally:
        close_sessions(hops, sids)
    there = continue_in_another_process(gguf, splits, files, len(prompt), 8, tok, ids_everywhere, cache_type)
    return here, there


def lane_refusal(conn) -> str:  # noqa: ANN001 - a socket to a lane
    """The message of the refusal a lane sent on `conn` (it closes the connection after one)."""
    from agent.wire.lane import FRAME_HEAD, KIND_REFUSAL

    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    assert len(data) >= FRAME_HEAD and data[4] == KIND_REFUSAL, data[:8]
    return data[FRAME_HEAD:].decode()


async def windows_on_one_node(
    path: Path,
    splits: list[tuple[int, int]],
    public_key,
    node: str = "node-t",  # noqa: ANN001
) -> tuple:  # noqa: ANN401 - (DataPlane, manifest, aiohttp runner, url)
    """One in-process data plane holding every window of `splits` of the GGUF at `path` (native, 2
    threads), listening on a free loopback port: (dataplane, manifest, runner, url). The caller cleans
    the runner up."""
    from agent.artifacts.manifest import build_manifest
    from agent.node.dataplane import DataPlane, start_dataplane
    from tests.conftest import free_port

    manifest = build_manifest(str(path))
    dp = DataPlane(node, public_key)
    for a, b in splits:
        dp.load_shard(str(path), manifest, a, b, backend="native", n_threads=2)
    port = free_port()
    runner = await start_dataplane(dp, "127.0.0.1", port)
    return dp, manifest, runner, f"http://127.0.0.1:{port}"
