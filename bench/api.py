"""Benchmark of the OpenAI-compatible API against the route client on the same route (prints JSON last).

    python bench/api.py [--tokens 64] [--rounds 3] [--backend native]

A live control plane (daphne) and two agents on 127.0.0.1 serve SmolLM2 split in two hops. Decode speed:
the `openai` client streaming /v1/chat/completions vs agent.client.route.RouteClient driving the same
hops directly, interleaved, same prompt, greedy, so both generate the same tokens; each is (tokens - 1)
over the time from the first to the last token as the caller sees it. Turn-2 time to first token: a
conversation's second turn on the key that holds turn 1 in the prefix cache, vs the same messages on a
fresh key (a new route: route opening plus the whole prompt's prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.client.recovery import minted_hops  # noqa: E402
from agent.client.route import RouteClient  # noqa: E402
from agent.client.tokenizer import ChatTokenizer  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from agent.wire.routetoken import RouteHop, load_private_key  # noqa: E402
from agent.wire.sampling import SamplingParams  # noqa: E402

STORY = [
    {"role": "user", "content": "Write a long story about a lighthouse keeper who kept a log of every ship."}
]
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Name three planets of the solar system.",
    "What does a baker make? Answer briefly.",
    "Why is the sky blue? One sentence.",
    "What is two plus two?",
]


def create_key(admin: Any, name: str) -> str:
    """A new API key of the logged-in `admin` client's user (the page shows its secret once)."""
    code, html = admin.post("/api-keys/new", {"name": name})
    m = re.search(r'id="new-key-secret">(sk-swarm-[^<]+)<', html)
    if code != 200 or not m:
        raise RuntimeError(f"creating an API key failed (HTTP {code})")
    return m.group(1)


def api_stream(client: Any, model: str, messages: list[dict[str, str]], n: int) -> tuple[float, float, int]:
    """(TTFT s, decode tok/s, completion tokens) of one streamed chat completion, seen by the caller."""
    t0 = time.perf_counter()
    first = last = 0.0
    usage = 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return first - t0, (usage - 1) / (last - first) if last > first else 0.0, usage


def api_stream_raw(
    base: str, key: str, model: str, messages: list[dict[str, str]], n: int
) -> tuple[float, int]:
    """(decode tok/s, completion tokens) of the same streamed chat completion read with the standard
    library's HTTP client, timed as api_stream times it: the server's side without the SDK's per-chunk
    parsing, which shares the machine's cores with the route in these benches."""
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(base)
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=300)
    first = last = 0.0
    usage = 0
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"streamed completion failed (HTTP {r.status}): {r.read(500)!r}")
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
            if ev.get("usage"):
                usage = int(ev["usage"]["completion_tokens"])
    finally:
        conn.close()
    return (usage - 1) / (last - first) if last > first else 0.0, usage


async def playground_stream(
    base: str, sessionid: str, model_id: int, message: str, n: int
) -> tuple[float, int, list[dict[str, Any]]]:
    """(decode tok/s, tokens, the route's hops) of one greedy answer over the playground's websocket as
    the browser gets it (a new conversation), timed from the first to the last delta."""
    from aiohttp import ClientSession

    headers = {"Origin": base, "Cookie": f"sessionid={sessionid}"}
    first = last = 0.0
    route: list[dict[str, Any]] = []
    async with (
        ClientSession() as http,
        http.ws_connect(base + "/ws/chat/?format=json", headers=headers) as ws,
    ):
        await ws.send_json(
            {"type": "chat", "model": model_id, "message": message, "max_tokens": n, "temperature": 0}
        )
        while True:
            ev = await ws.receive_json(timeout=300)
            if ev["type"] == "start":
                route = ev["route"]
            elif ev["type"] == "delta":
                last = time.perf_counter()
                first = first or last
            elif ev["type"] == "error":
                raise RuntimeError(ev["error"])
            elif ev["type"] == "done":
                count = int(ev["telemetry"]["n_generated"])
                return ((count - 1) / (last - first) if last > first else 0.0), count, route


async def route_stream(
    route: list[dict[str, Any]], sha256: str, key_path: Path, tok: ChatTokenizer, n: int
) -> tuple[float, int]:
    """(decode tok/s, tokens) of RouteClient.chat on `route`, timed as api_stream times the API."""
    session = SessionId(os.urandom(16))
    plan = [RouteHop(h["node"], h["url"], h["layer_start"], h["layer_end"]) for h in route]
    hops = minted_hops(load_private_key(key_path), session, sha256, plan, 600)
    client = RouteClient(hops, tok, session_id=session)
    first = last = 0.0
    count = 0
    try:
        async for ev in client.chat(STORY, SamplingParams(), n):
            if ev.text:
                last = time.perf_counter()
                first = first or last
            if ev.done:
                count = int(ev.telemetry["n_generated"])
    finally:
        await client.close()
    return (count - 1) / (last - first) if last > first else 0.0, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    ap.add_argument("--backend", default="native", help="the agents' backend (native, torch, llamacpp)")
    args = ap.parse_args()

    import openai

    from webapp.devcluster import control_plane

    model_path = str(packaged_model_path("smollm2"))
    tok = ChatTokenizer(model_path)
    with (
        tempfile.TemporaryDirectory(prefix="bench-api-") as tmp,
        control_plane(Path(tmp), DEFAULT_BACKEND=args.backend) as s,
    ):
        s.serve_smollm2(2)
        name = s.model["name"]

        def client(key: str) -> Any:
            return openai.OpenAI(base_url=s.base + "/v1", api_key=key, max_retries=0, timeout=300)

        main_client = client(create_key(s.admin, "bench"))
        warm = main_client.chat.completions.create(model=name, messages=STORY, max_tokens=4, temperature=0)
        route = (warm.model_extra or {})["x_swarm"]["route"]
        asyncio.run(route_stream(route, s.model["sha256"], s.data_dir / "route_key.pem", tok, 4))

        api_tok_s, route_tok_s, api_n, route_n = [], [], 0, 0
        for _ in range(args.rounds):
            _, rate, api_n = api_stream(main_client, name, STORY, args.tokens)
            api_tok_s.append(rate)
            rate, route_n = asyncio.run(
                route_stream(route, s.model["sha256"], s.data_dir / "route_key.pem", tok, args.tokens)
            )
            route_tok_s.append(rate)

        reuse_ms, no_reuse_ms = [], []
        for q in QUESTIONS[: max(args.rounds, 1)]:
            conv = client(create_key(s.admin, "conversation"))
            turn1 = [{"role": "user", "content": q}]
            one = conv.chat.completions.create(model=name, messages=turn1, max_tokens=32, temperature=0)
            turn2 = [
                *turn1,
                {"role": "assistant", "content": one.choices[0].message.content or ""},
                {"role": "user", "content": "Explain that in more detail, please."},
            ]
            ttft, _, _ = api_stream(conv, name, turn2, 4)
            reuse_ms.append(ttft * 1e3)
            ttft, _, _ = api_stream(client(create_key(s.admin, "fresh")), name, turn2, 4)
            no_reuse_ms.append(ttft * 1e3)

    api = statistics.median(api_tok_s)
    rc = statistics.median(route_tok_s)
    print(
        json.dumps(
            {
                "backend": args.backend,
                "hops": len(route),
                "tokens": args.tokens,
                "rounds": args.rounds,
                "api_tokens_generated": api_n,
                "route_client_tokens_generated": route_n,
                "api_tok_s": round(api, 2),
                "route_client_tok_s": round(rc, 2),
                "api_over_route_client": round(api / rc, 3) if rc else None,
                "api_tok_s_rounds": [round(x, 2) for x in api_tok_s],
                "route_client_tok_s_rounds": [round(x, 2) for x in route_tok_s],
                "ttft_ms_turn2_reuse": round(statistics.median(reuse_ms), 1),
                "ttft_ms_turn2_no_reuse": round(statistics.median(no_reuse_ms), 1),
                "ttft_ms_turn2_reuse_rounds": [round(x, 1) for x in reuse_ms],
                "ttft_ms_turn2_no_reuse_rounds": [round(x, 1) for x in no_reuse_ms],
            }
        )
    )


if __name__ == "__main__":
    main()
