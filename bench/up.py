"""The playground and the API of `make up`, as a new user gets them, against llama.cpp (prints JSON last).

    nice -n -10 .venv/bin/python bench/up.py [--rounds 5] [--tokens 128] [--agents 2]

Issue 32 measured a new user's playground at half llama.cpp's speed ("tried as a new user would: make
up, two agents"). This runs what `make up` runs (`manage.py swarm_up`: the embedded defaults, SQLite,
the in-memory channel layer, eager Celery, two local agents, SmolLM2 registered and placed), in a data
directory of its own and on a free port, and times per round, interleaved: llama-cpp-python decoding the
same chat prompt in this process, one greedy answer over the playground's websocket, one streamed chat
completion read with the standard library and one with the openai SDK (its per-chunk parsing runs on
the machine's cores too). Each is (tokens - 1) over the time from the first to the last token as the
reader sees it. DATABASE_URL and REDIS_URL are left out of the control plane's environment: these are
the defaults a fresh clone gets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.client.tokenizer import ChatTokenizer  # noqa: E402
from agent.procs import free_port  # noqa: E402
from bench._common import REPO, cpu_kind  # noqa: E402
from bench._llamacpp import LlamaCpp  # noqa: E402
from bench.api import STORY, api_stream, api_stream_raw, create_key, playground_stream  # noqa: E402

UP_S = 600.0  # setup is done (make up's first step); migrating, enrolling and placing on 2 cores
READY_LINE = "GGUF Swarm is up"


def start_up(data_dir: Path, port: int, password: str, agents: int, log: Path) -> subprocess.Popen[bytes]:
    """`manage.py swarm_up` in its own data directory and session, on the embedded defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(SWARM_DATA_DIR=str(data_dir), SWARM_ADMIN_PASSWORD=password, PYTHONPATH=str(REPO))
    cmd = [sys.executable, str(REPO / "manage.py"), "swarm_up", "--port", str(port), "--agents", str(agents)]
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_up(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Poll the command's output for its ready line; fail with its tail when it exits or takes too long."""
    deadline = time.monotonic() + UP_S
    while READY_LINE not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"make up's swarm_up did not come up (exit {proc.poll()}):\n{tail}")
        time.sleep(0.5)


def stop_up(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as `make up` stops on it (web, worker and agents with it); SIGKILL to the group after 60 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--agents", type=int, default=2, help="make up's default: 2")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (the agents': their default)")
    args = ap.parse_args()

    import openai

    from webapp.core.adminclient import AdminClient

    path = str(packaged_model_path("smollm2"))
    tok = ChatTokenizer(path)
    prompt = tok.encode_chat(STORY)
    out: dict[str, Any] = {
        "cpu": cpu_kind(),
        "agents": args.agents,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
    }
    t0 = time.perf_counter()
    password = secrets.token_urlsafe(12)
    with tempfile.TemporaryDirectory(prefix="bench-up-") as tmp:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = Path(tmp) / "swarm_up.log"
        proc = start_up(Path(tmp) / "var", port, password, args.agents, log)
        llama = None
        try:
            wait_up(proc, log)
            out["up_s"] = round(time.perf_counter() - t0, 1)
            admin = AdminClient(base)
            admin.login("admin", password)
            model = next(m for m in admin.status()["models"] if m["state"] == "ready")
            key = create_key(admin, "bench-up")
            api = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
            llama = LlamaCpp(path, args.threads)
            sessionid = admin.cookie("sessionid")

            def ws(n: int) -> tuple[float, int, list[dict[str, Any]]]:
                return asyncio.run(playground_stream(base, sessionid, model["id"], STORY[0]["content"], n))

            # warm-ups: graphs built, connections open, the route opened once
            llama.decode_tok_s(prompt, 8)
            _, _, route = ws(8)
            api_stream_raw(base, key, model["name"], STORY, 8)
            api_stream(api, model["name"], STORY, 8)
            rows: dict[str, list[float]] = {
                "llamacpp": [],
                "playground": [],
                "api_plain_http": [],
                "api_sdk": [],
            }
            for _ in range(args.rounds):
                rows["llamacpp"].append(llama.decode_tok_s(prompt, args.tokens))
                rows["playground"].append(ws(args.tokens)[0])
                rows["api_plain_http"].append(api_stream_raw(base, key, model["name"], STORY, args.tokens)[0])
                rows["api_sdk"].append(api_stream(api, model["name"], STORY, args.tokens)[1])
        finally:
            if llama is not None:
                llama.close()
            stop_up(proc)
    med = {k: statistics.median(v) for k, v in rows.items()}
    out.update(
        {
            "playground_hops": len(route),
            "decode_tok_s_llamacpp": round(med["llamacpp"], 2),
            "make_up_playground_tok_s": round(med["playground"], 2),
            "make_up_api_tok_s": round(med["api_sdk"], 2),
            "make_up_api_tok_s_plain_http": round(med["api_plain_http"], 2),
            # per round, each against llama.cpp's figure of the same round (the box's speed moves)
            "ratio_make_up_playground_vs_llamacpp": round(
                statistics.median(p / c for p, c in zip(rows["playground"], rows["llamacpp"], strict=True)), 3
            ),
            "ratio_make_up_api_vs_llamacpp": round(
                statistics.median(p / c for p, c in zip(rows["api_sdk"], rows["llamacpp"], strict=True)), 3
            ),
            "ratio_make_up_api_plain_http_vs_llamacpp": round(
                statistics.median(
                    p / c for p, c in zip(rows["api_plain_http"], rows["llamacpp"], strict=True)
                ),
                3,
            ),
            **{f"{k}_tok_s_rounds": [round(x, 2) for x in v] for k, v in rows.items()},
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
