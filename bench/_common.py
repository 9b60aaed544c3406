"""Helpers shared by the benchmarks: real serve processes on 127.0.0.1 and health polling."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/health", timeout=5) as r:
        return json.loads(r.read())


def start_serve(
    model: str,
    layers: str,
    backend: str,
    public_key_b64: str,
    threads: int,
    logdir: Path,
    extra_env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    node = f"bench-{port}"
    cmd = [
        sys.executable,
        "-m",
        "agent",
        "serve",
        "--model",
        model,
        "--layers",
        layers,
        "--backend",
        backend,
        "--port",
        str(port),
        "--public-key",
        public_key_b64,
        "--node-id",
        node,
        "--threads",
        str(threads),
        "--kv-budget-mb",
        "4096",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(extra_env or {})}
    log = (logdir / f"serve-{port}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve {layers} exited early; see {log.name}")
        try:
            health(url)
            return proc, url, node
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"serve {layers} did not come up") from None
            time.sleep(0.1)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
