"""What one real layer window costs here: real-shaped sparse GGUFs of DeepSeek-V4-Flash, GLM-5.2 and
Qwen3.5-397B-A17B (agent/artifacts/realshape.py, Q4_K_M types), issue 31.

Per architecture the window's layers are written with data (the rest of the 176-455 GB file is holes),
then a fresh child process measures: open time; process RSS after open against the manifest's weight
bytes for the window (`bytes_for_range`); per-layer decode time of 1 position (f32 boundary rows,
median of 5 steps) at a few context lengths, reached by prefilling 512 positions per call (the first
call is the 512-position prefill figure); the session's state after 8K positions (`ggswarm_kv_bytes`,
checkpoints off) and at 32K/128K (that plus `ggswarm_session_growth_bytes`, the library's plan), next
to the manifest's `state_bytes`. Per-layer figures are the window's divided by its layers.

The manifest is built with `sha256_file` stubbed: build_manifest hashes the whole file even with
hash_tensors=False, which for these files is reading 176-455 GB of holes. A child that aborts with
the CPU's repacked weights (GGSWARM_REPACK) is rerun with GGSWARM_REPACK=0, and the reason printed.
Prints one line per architecture, then one JSON object as the last line. Usage:

    nice .venv/bin/python bench/realshape.py [--threads 2] [--fill 8192] [--archs dsv4,glm52,qwen35_397b]
        [--flash-attn auto|on|off]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts import manifest as manifest_mod  # noqa: E402
from agent.artifacts.realshape import type_summary, write_realshape_gguf  # noqa: E402
from bench._common import cpu_kind  # noqa: E402

# key prefix -> (architecture, window): middle windows past DeepSeek-V4's hash-routed layers, starting
# at a GLM-5.2 full-indexer layer, with Q4_K_M's common types (ffn_down_exps Q4_K, not the Q6_K layers)
ARCHS = {
    "dsv4": ("deepseek4", (8, 10)),  # ratio 4 (CSA + indexer), ratio 128 (HCA)
    "glm52": ("glm-dsa", (18, 19)),  # one MoE layer with its own indexer (about 5.5 GB)
    "qwen35_397b": ("qwen35moe", (10, 12)),  # a gated delta-net layer and a full-attention layer
}
CHUNK = 512
DECODE_STEPS = 5
CTXS = {"8k": 8192, "32k": 32768, "128k": 131072}


def _manifest(path: Path) -> Any:
    manifest_mod.sha256_file = lambda p: "not-hashed"  # type: ignore[assignment]
    return manifest_mod.build_manifest(path, hash_tensors=False)


def measure(
    path: Path, start: int, end: int, threads: int, fill: int, flash_attn: str = "auto"
) -> dict[str, Any]:
    """In this (fresh) process: open the window, time it, fill a session; the figures as a dict."""
    import psutil

    from agent.backends.libggswarm import NativeModel

    proc = psutil.Process()
    m = _manifest(path)
    weights = m.bytes_for_range(start, end)
    gc.collect()
    rss0 = proc.memory_info().rss
    t = time.perf_counter()
    model = NativeModel(str(path), start, end, n_threads=threads)
    open_s = time.perf_counter() - t
    if flash_attn != "auto":  # auto: the node's default (flash off on a CPU, as llama-cpp-python's default)
        model.set_flash_attention(flash_attn == "on")
    rss_open = proc.memory_info().rss
    n_layers = end - start
    model.set_checkpoints(0, 0)  # the state alone
    sid = model.open_session(CTXS["128k"])
    rng = np.random.default_rng(0)
    pos, filled, prefill_s, decode_ms, fill_s, state_8k = 0, 0, 0.0, {}, 0.0, 0
    marks = sorted({CHUNK, 2048, fill})
    while filled < fill:
        n = min(CHUNK, next(k for k in marks if k > filled) - filled)
        h = rng.standard_normal((n, model.d_model)).astype(np.float32)
        t = time.perf_counter()
        out = model.forward(sid, pos, hidden=h)
        dt = time.perf_counter() - t
        if not np.isfinite(out["hidden"]).all():
            raise SystemExit(f"non-finite hidden rows at positions {pos}..{pos + n}")
        prefill_s = prefill_s or dt
        fill_s += dt
        pos, filled = pos + n, filled + n
        if filled == fill:
            state_8k, state_pos = model.kv_bytes(sid), pos
        if filled in marks:  # decode steps at this context (they stay in the session: +5 positions)
            steps = []
            for _ in range(DECODE_STEPS):
                h1 = rng.standard_normal((1, model.d_model)).astype(np.float32)
                t = time.perf_counter()
                model.forward(sid, pos, hidden=h1)
                steps.append(time.perf_counter() - t)
                pos += 1
            decode_ms[str(pos - DECODE_STEPS)] = 1000 * float(np.median(steps)) / n_layers
    state_at = {"8k": state_8k}
    for k, n in CTXS.items():
        if n > fill:
            state_at[k] = state_8k + model.growth_bytes(sid, n)
    ns = {**CTXS, "8k": state_pos}
    est = {k: sum(m.layers[i].state_bytes(n) for i in range(start, end)) for k, n in ns.items()}
    rss_8k = proc.memory_info().rss
    model.close()
    return {
        "window": [start, end],
        "open_s": round(open_s, 3),
        "weights_bytes": weights,
        "rss_before_open": rss0,
        "rss_after_open": rss_open,
        "rss_after_fill": rss_8k,
        "window_rss_over_estimate": round(rss_open / weights, 4),
        "window_rss_delta_over_estimate": round((rss_open - rss0) / weights, 4),
        "layer_prefill_ms_512": round(1000 * prefill_s / n_layers, 1),
        "layer_decode_ms_by_ctx": {k: round(v, 2) for k, v in decode_ms.items()},
        "layer_decode_ms": round(next(iter(decode_ms.values())), 2),
        "fill_s": round(fill_s, 1),
        "state_bytes": state_at,
        "state_bytes_manifest": est,
        "state_source": f"8k: kv_bytes after {state_pos} positions; 32k/128k: that + growth_bytes",
    }


def run_child(arch_key: str, path: Path, start: int, end: int, args: Any, repack: bool) -> dict[str, Any]:
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", "PYTHONPATH": str(REPO)}
    if not repack:
        env["GGSWARM_REPACK"] = "0"
    cmd = [sys.executable, __file__, "--child", str(path), f"{start}:{end}", "--threads", str(args.threads)]
    cmd += ["--fill", str(args.fill), "--flash-attn", args.flash_attn]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        err = [ln for ln in r.stderr.splitlines() if "rope:" not in ln][-3:]
        return {"error": f"rc {r.returncode}: {' | '.join(err)}"}
    return dict(json.loads(lines[-1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fill", type=int, default=8192, help="positions to fill (a multiple of 512)")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--dir", default=None, help="where to write the sparse files (default: a temp dir)")
    ap.add_argument(
        "--flash-attn", choices=("auto", "on", "off"), default="auto", help="the window's attention"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("window", nargs="?", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        s, e = (int(x) for x in args.window.split(":"))
        print(json.dumps(measure(Path(args.child), s, e, args.threads, args.fill, args.flash_attn)))
        return 0
    logging.getLogger("gguf").setLevel(logging.WARNING)
    result: dict[str, Any] = {
        "cpu": cpu_kind(),
        "threads": args.threads,
        "fill": args.fill,
        "flash_attn": args.flash_attn,
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for key in args.archs.split(","):
            arch, (start, end) = ARCHS[key]
            path = Path(tmp) / f"{arch}.gguf"
            t = time.perf_counter()
            write_realshape_gguf(arch, path, layers_with_data=range(start, end))
            write_s = time.perf_counter() - t
            disk = os.stat(path).st_blocks * 512
            r = run_child(key, path, start, end, args, repack=True)
            if "error" in r:
                first = r["error"]
                r = run_child(key, path, start, end, args, repack=False)
                r["repack"] = f"off (with it: {first})"
            else:
                r["repack"] = "on"
            path.unlink()
            r.update(file_bytes=_file_size(arch), disk_bytes=disk)
            r["write_s"] = round(write_s, 1)
            r["types_gb"] = {q: round(b / 1e9, 1) for q, b in type_summary(arch).items()}
            for k in ("layer_decode_ms", "layer_prefill_ms_512", "window_rss_over_estimate", "open_s"):
                if k in r:
                    result[f"{key}_{k}"] = r[k]
            result[key] = r
            print(f"{key}: {json.dumps(r)}", flush=True)
    print(json.dumps(result))
    return 0


def _file_size(arch: str) -> int:
    from agent.artifacts.realshape import tensor_plan

    return sum(n for *_, n in tensor_plan(arch)[1])


if __name__ == "__main__":
    raise SystemExit(main())
