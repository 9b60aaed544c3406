"""A prompt's chunk in one graph with the decoders' rows, against the two run one after the other.

Issue 32's mixed step runs a prompt's chunk just before the lane's decode step on each hop (the gate,
docs/lane.md): two computes. A chunked-prefill scheduler would put both in one batch, where the decoders'
rows ride on weight reads the chunk makes anyway. Whether that saves anything depends on the CPU and the
weights' type: where a matrix product costs the same per row whatever the batch (compute-bound dot
products), one graph saves nothing. This measures it, for our executor on one hop's window and for
llama.cpp on the whole model in the same run:

- native: `--decoders` sessions decoding on the window (their one-row steps in one forward_batch), a
  prompt session whose chunks of k positions go alone (forward) or in the same forward_batch;
- llama.cpp (llama-cpp-python's low-level batch API, whole model): the decoders' sequences in one
  llama_batch, a prompt sequence's k tokens alone, and both in one llama_batch.

Per chunk size: ms of the decoders' step, the chunk, their sum and the one batch, and `fused_over_seq`
(below 1: one graph is cheaper). Hidden rows for a window that is not the first are the first window's
real output, so the numbers are those of a real prompt. Medians over `--rounds`, interleaved. Prints
human-readable lines, then one JSON object as the last line. Usage:

    .venv/bin/python bench/mixed_batch.py [--threads 2] [--layers 10:20] [--decoders 4] [--chunks 8,16,32,64]
        [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.backends.base import ForwardResult, ShardSpec, StepInput  # noqa: E402
from agent.backends.native import NativeBackend  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from bench._common import cpu_kind  # noqa: E402
from bench.batching import LlamaBatch  # noqa: E402

CONTEXT = 64  # the decoders' prompt, and where the prompt session's chunks start
CAPACITY = 4096
T = TypeVar("T")


def _ids(n: int, salt: int) -> list[int]:
    return [(131 * salt + 17 * k) % 40000 + 300 for k in range(n)]


def _timed(fn: Callable[[T], object], arg: T) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


class NativeWindow:
    """The window under test, fed hidden rows that the model's layers before it computed."""

    def __init__(self, model: str, start: int, end: int, threads: int) -> None:
        manifest = build_manifest(model)
        self.win = NativeBackend(ShardSpec(model, start, end, manifest, n_threads=threads))
        self.head = NativeBackend(ShardSpec(model, 0, start, manifest, n_threads=threads)) if start else None
        self.pos: dict[SessionId, int] = {}
        self._n = 0

    def open(self) -> SessionId:
        self._n += 1
        sid = SessionId(self._n.to_bytes(16, "little"))
        for be in (self.head, self.win):
            if be is not None:
                be.open_session(sid, CAPACITY)
        self.pos[sid] = 0
        return sid

    def step(self, sid: SessionId, ids: list[int]) -> StepInput:
        """The window's input for `ids` at the session's next positions (the head window runs now)."""
        pos = self.pos[sid]
        self.pos[sid] = pos + len(ids)
        tokens = np.asarray(ids, dtype=np.int32)
        if self.head is None:
            return StepInput(sid, pos, token_ids=tokens)
        r = self.head.forward(StepInput(sid, pos, token_ids=tokens))
        return StepInput(sid, pos, hidden=r.hidden)

    def run(self, steps: list[StepInput]) -> None:
        for r in self.win.forward_batch(steps):
            if not isinstance(r, ForwardResult):
                raise RuntimeError(f"native step failed: {r}")

    def close(self) -> None:
        for be in (self.head, self.win):
            if be is not None:
                be.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="10:20", help="the native window start:end (SmolLM2 has 30)")
    ap.add_argument("--decoders", type=int, default=4)
    ap.add_argument("--chunks", default="8,16,32,64")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    start, end = (int(x) for x in args.layers.split(":"))
    model = str(packaged_model_path("smollm2"))
    nat = NativeWindow(model, start, end, args.threads)
    dec = [nat.open() for _ in range(args.decoders)]
    for i, s in enumerate(dec):
        nat.run([nat.step(s, _ids(CONTEXT, i))])
    n_prompt = sum(chunks) * 3 * args.rounds + CONTEXT
    llama = LlamaBatch(model, args.threads, args.decoders + 1, CONTEXT + n_prompt + 8, 0)
    llama.reset()
    for s in range(args.decoders):
        llama.step([(t, k, s, False) for k, t in enumerate(_ids(CONTEXT, s))])
    lpos = dict.fromkeys(range(args.decoders), CONTEXT)
    P = args.decoders  # llama.cpp's prompt sequence
    lprompt = 0

    def ldec() -> list[tuple[int, int, int, bool]]:
        items = []
        for s in range(args.decoders):
            items.append((300 + lpos[s], lpos[s], s, True))
            lpos[s] += 1
        return items

    def lchunk(k: int) -> list[tuple[int, int, int, bool]]:
        nonlocal lprompt
        items = [(300 + (lprompt + j) % 40000, lprompt + j, P, j == k - 1) for j in range(k)]
        lprompt += k
        return items

    out: dict[str, object] = {"cpu": cpu_kind(), "threads": args.threads, "layers": args.layers}
    out["decoders"] = args.decoders
    for k in chunks:
        m: dict[str, list[float]] = {n: [] for n in ("dec", "chunk", "fused", "l_dec", "l_chunk", "l_fused")}
        p = nat.open()
        for _ in range(args.rounds):
            # each input is made (the windows before this one run) before its timing starts
            steps = [nat.step(s, [400]) for s in dec]
            m["dec"].append(_timed(nat.run, steps))
            piece = [nat.step(p, _ids(k, 7))]
            m["chunk"].append(_timed(nat.run, piece))
            both = [nat.step(s, [400]) for s in dec] + [nat.step(p, _ids(k, 7))]
            m["fused"].append(_timed(nat.run, both))
            m["l_dec"].append(_timed(llama.step, ldec()))
            m["l_chunk"].append(_timed(llama.step, lchunk(k)))
            m["l_fused"].append(_timed(llama.step, ldec() + lchunk(k)))
        med = {n: statistics.median(v) * 1e3 for n, v in m.items()}
        for side, pre in (("native", ""), ("llamacpp", "l_")):
            seq = med[pre + "dec"] + med[pre + "chunk"]
            row = {
                "decoders_ms": round(med[pre + "dec"], 2),
                "chunk_ms": round(med[pre + "chunk"], 2),
                "sequential_ms": round(seq, 2),
                "fused_ms": round(med[pre + "fused"], 2),
                "fused_over_seq": round(med[pre + "fused"] / seq, 3),
            }
            out[f"{side}_chunk{k}"] = row
            print(f"{side} chunk {k}: {row}")
    nat.close()
    llama.close()
    out["loadavg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
