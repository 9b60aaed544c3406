"""The own ggml build's barrier (native/patches/ggml-barrier-futex.patch): waiters that sleep on the futex
are woken, and the numbers do not depend on how they wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.backends import libggswarm

REPO = Path(__file__).resolve().parents[2]

# One process per barrier setting (the library reads it when a model's threadpool is made): a 48-token
# prefill and 6 decode steps over two windows with 4 threads on this 2-core machine, so waiters often
# find their peers preempted. Prints the logits' bytes as hex, and every greedy token.
PROBE = """
import json, sys
import numpy as np
from agent.backends.libggswarm import NativeModel
from tests.native.routes import close_sessions, native_forward, open_sessions
path, ids = sys.argv[1], json.loads(sys.argv[2])
hops = [NativeModel(path, 0, 15, n_threads=4), NativeModel(path, 15, 30, n_threads=4)]
sids = open_sessions(hops)
rows, out, pos = [], [], 0
for _ in range(7):
    r = native_forward(hops, sids, pos, ids)
    logits = np.asarray(r["logits"], dtype=np.float32).reshape(len(ids), -1)[-1]
    rows.append(logits.tobytes().hex())
    out.append(int(np.argmax(logits)))
    pos += len(ids)
    ids = [out[-1]]
close_sessions(hops, sids)
print(json.dumps({"tokens": out, "logits": rows}))
"""


def own_build() -> bool:
    """Whether the built library carries the patched ggml (GGSWARM_GGML=own, the default build)."""
    path = libggswarm.library_path()
    return path.is_file() and b"GGSWARM_BARRIER_SPIN" in path.read_bytes()


def run_probe(model_path: str, env: dict[str, str]) -> dict:
    ids = list(range(200, 248))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, model_path, json.dumps(ids)],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,  # a lost wake-up hangs a worker forever: this turns it into a failure
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_barrier_waiters_that_always_sleep_get_the_same_logits_as_ones_that_never_sleep(
    native_lib: None, model_path: str
) -> None:
    if not own_build():
        pytest.skip("the library is the shared-ggml build (GGSWARM_GGML=shared): no patched barrier")
    sleeping = run_probe(model_path, {"GGSWARM_BARRIER_SPIN": "0", "GGSWARM_BARRIER_YIELD": "0"})
    # Never sleeping: spin, then yield for good. Spin alone (upstream ggml's wait) took ~28 s here: four
    # threads on two cores spin out whole time slices while the peer they wait for is preempted; the
    # yields hand the core over and leave the same wait-without-futex path to check, in ~2 s.
    awake = run_probe(model_path, {"GGSWARM_BARRIER_SPIN": "20000", "GGSWARM_BARRIER_YIELD": "100000000"})
    default = run_probe(model_path, {})
    assert len(sleeping["tokens"]) == 7
    assert sleeping == awake == default
