"""Per-session state bytes against llama.cpp's for the same file and context, per architecture (issue 31).

SPEC P13: ours / llama.cpp's <= 1.05 at every context. The ratio keys (`<arch>_state_ratio_<ctx>`) are at
the real models' hyperparameters (webapp/fleet/specs/models/*.json; Gemma 3 270M's packaged file):
ours is what agent/artifacts/archs.py `describe` counts (the native executor's layout), the bytes a
session costs a node whose budget is full. A session also keeps checkpoints of the state its caches cannot
cut back (the latest multi-token call's start and end: `CHECKPOINTS_MAX`, 2), but only in budget room no
session needs: growth and admission take them back first (libggswarm v17, docs/native.md "Checkpoints");
`<arch>_state_ratio_with_checkpoints_<ctx>` counts them too, as a session holds them on a node with room
to spare. llama.cpp's comes from its cache layout
(`llama_formula`, checked against its own allocation log on tiny files and on Gemma 3's real file).
llama.cpp is taken with llama-server's default `swa_full = false` (sliding-window and DeepSeek-V4 raw
caches are rings); llama-cpp-python's `Llama()` defaults to `swa_full = true` (whole-context rings),
printed too as `*_swa_full`. `<arch>_state_ratio_vs_llama_server_<ctx>`: against llama-server as people
run it, which also keeps context checkpoints of the state its caches cannot cut back (2 per prompt, up
to 32 per slot: `llama_server_checkpoint`); counted for one prompt, 2 checkpoints.

Tiny files (agent.artifacts.tiny, their context_length raised to 131072 in a copy so that our executor
opens long sessions): llama.cpp's bytes are parsed from the "size = X MiB" lines it logs when
`llama_cpp.Llama(n_ctx=...)` allocates its caches (2-decimal MiB, so +-0.005 MiB per line); ours are
`ggswarm_kv_bytes` after feeding `--fill` positions once `ggswarm_reclaim_checkpoints` took its
checkpoints back (with them: `ours_bytes_with_checkpoints_<ctx>`), and at larger contexts that figure
plus `ggswarm_session_growth_bytes` (the library's own plan for the larger capacity, not filled).
`<arch>_tiny_sessions_in_llamacpp_budget`: how many sessions of `--fill` positions our executor fills, one
after another, on a node budget of 4 x llama.cpp's bytes for one (its formula, which matches its log
within the log's rounding; 4 where a session costs what llama.cpp's does, the checkpoints taking what
room is left). Prints one line per architecture, then one JSON object as the last line. Usage:

    .venv/bin/python bench/state.py [--threads 2] [--fill 8192] [--archs deepseek4,glm_dsa,qwen35,gemma3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts.archs import ArchDescription, describe  # noqa: E402
from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.artifacts.tiny import write_tiny_gguf  # noqa: E402
from agent.backends.native import CHECKPOINTS_MAX  # noqa: E402
from bench._common import cpu_kind  # noqa: E402

CTXS = {"8k": 8192, "32k": 32768, "128k": 131072}
MIB = 1 << 20
UBATCH = 512  # llama.cpp's default n_ubatch: the SWA ring holds n_swa + n_ubatch rows
PAD = 256  # llama.cpp pads cache sizes to 256 cells
SPECS = REPO / "webapp" / "fleet" / "specs" / "models"
# bench key -> (tiny arch, real-model spec file or "" for Gemma 3's packaged file, model name)
ARCHS = {
    "deepseek4": ("deepseek4", "deepseek-v4-flash.json", "DeepSeek-V4-Flash"),
    "glm_dsa": ("glm-dsa", "glm-5.2.json", "GLM-5.2"),
    "qwen35": ("qwen35moe", "ornith-1.0-397b-a17b.json", "Qwen3.5-397B-A17B (Ornith-1.0-397B)"),
    "gemma3": ("gemma3", "", "Gemma 3 270M"),
}
_SIZE_LINE = re.compile(  # "llama_kv_cache: size = ...", not its "CPU KV buffer size = ..." twin
    r"^(?:(?:llama_kv_cache|llama_memory_recurrent):\s+size =|llama_dsv4_comp_state: .*, size =)\s*([0-9.]+) MiB"
)


def tree_state() -> str:
    """The checkout measured: HEAD, whether the tree has changes, when libggswarm was built."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    lib = REPO / "native" / "build" / "libggswarm.so"
    built = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(lib.stat().st_mtime)) if lib.exists() else "?"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return f"{git('rev-parse', '--short', 'HEAD')}{dirty}; libggswarm.so built {built}"


def _pad(n: int, p: int = PAD) -> int:
    return -(-n // p) * p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- llama.cpp -------------------------------------------------------------------------------------


def llama_log(path: str, n_ctx: int, swa_full: bool, threads: int) -> tuple[int, list[str]]:
    """(bytes, lines): the cache/state sizes llama.cpp logs while it builds a context of n_ctx tokens.
    Its log goes to file descriptor 2 from C, so fd 2 is pointed at a temp file around construction."""
    import llama_cpp

    with tempfile.TemporaryFile(mode="w+") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            llm = llama_cpp.Llama(
                model_path=path,
                n_ctx=n_ctx,
                n_threads=threads,
                verbose=True,
                flash_attn=False,
                swa_full=swa_full,
            )
            llm.close()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        found = [(ln.strip(), m) for ln in log if (m := _SIZE_LINE.match(ln))]
    return sum(round(float(m.group(1)) * MIB) for _, m in found), [ln for ln, _ in found]


def _gemma_swa(i: int) -> bool:
    return (i + 1) % 6 != 0  # llama.cpp's gemma3: set_swa_pattern(6), every 6th layer global


def llama_formula(arch: str, hp: dict[str, Any], desc: ArchDescription, n_ctx: int, swa_full: bool) -> int:
    """llama.cpp's per-sequence cache bytes (f16 K/V, f32 recurrent/compressor state, n_ubatch 512) as
    its sources lay them out (llama-kv-cache-dsv4.cpp, -dsa.cpp, -iswa.cpp, llama-memory-recurrent.cpp)."""
    f16 = 2
    if arch == "deepseek4":
        head = int(hp["attention.key_length"])
        idx = int(hp["attention.indexer.key_length"])
        ring = n_ctx if swa_full else _pad(min(n_ctx, int(hp["attention.sliding_window"]) + UBATCH))
        ratios = [int(r) for r in hp["attention.compress_ratios"]][: desc.n_layers]
        n4, n128 = ratios.count(4), ratios.count(128)
        c4, c128 = _pad(_cdiv(n_ctx, 4)), _pad(_cdiv(n_ctx, 128))
        # the raw K ring covers the MTP block too (a tiny file with one shows it); K = V, no V cache
        raw = (desc.n_layers + desc.mtp_layers) * ring * head * f16
        comp = n4 * c4 * (head + idx) * f16 + n128 * c128 * head * f16
        # compressor states: kv and score planes, f32; csa 2*ratio x 2*head, hca ratio x head, lid 2*ratio x 2*idx
        states = 2 * 4 * (n4 * 8 * 2 * head + n128 * 128 * head + n4 * 8 * 2 * idx)
        return raw + comp + states
    total = 0
    for i, layer in enumerate(desc.layers):
        rows = n_ctx
        if arch == "gemma3" and _gemma_swa(i) and not swa_full:
            rows = _pad(min(n_ctx, int(hp["attention.sliding_window"]) + UBATCH))
        for p in layer.state:  # glm-dsa: latent+rope (+ indexer K in full layers); qwen35: K/V, r/s f32
            total += p.bytes_at(1, f16) if p.fixed else p.elements * rows * (4 if p.f32 else f16)
    return total


# --- ours ------------------------------------------------------------------------------------------


def ours_describe(desc: ArchDescription, n_ctx: int, hp: dict[str, Any]) -> tuple[int, int]:
    """(state, checkpoints): what describe() counts at n_ctx, and CHECKPOINTS_MAX checkpoints (the library's default), which a native
    session holds by default once it has had a multi-token call after its first (the start and end of
    the latest one). A checkpoint copies the state that cannot be cut back: a recurrent layer's whole
    state; deepseek4's rings (native/src/archs/deepseek4_state.cpp st_ckpt_bytes): the raw window's
    last n_swa rows and the compressors' f32 rows of the blocks not yet complete, counted here at their
    most (the whole compressor rings), as a session may hold them after a call that ends mid-block."""
    state = sum(p.bytes_at(n_ctx, 2.0) for layer in desc.layers for p in layer.state)
    ckpt = 0
    for ly in desc.layers:
        if ly.state_kind == "recurrent":
            ckpt += sum(p.bytes_at(n_ctx, 2.0) for p in ly.state)
            continue
        for p in ly.state:
            if p.name == "raw_k":  # deepseek4's window ring: a checkpoint holds the rows later positions read
                ckpt += int(hp["attention.sliding_window"]) * int(hp["attention.key_length"]) * 2
            elif p.fixed and p.name.endswith("compressor"):
                ckpt += p.bytes_at(n_ctx, 2.0)
    return state, CHECKPOINTS_MAX * ckpt


def _fill(m, sid: int, fill: int, rng: np.random.Generator) -> None:  # noqa: ANN001 - a NativeModel
    """Feed `fill` random positions in 512-position calls, as the route feeds a prompt (the whole model
    as one window: token ids on every call)."""
    for pos in range(0, fill, 512):
        m.forward(
            sid,
            pos,
            token_ids=rng.integers(3, 1000, min(512, fill - pos)).astype(np.int32),
            want_logits=False,
        )


def ours_measured(path: str, n_layers: int, fill: int, threads: int) -> tuple[dict[int, int], int, float]:
    """{n_ctx: bytes}: ggswarm_kv_bytes after `fill` positions, its checkpoints taken back; larger
    contexts up to the file's context: that plus ggswarm_session_growth_bytes. (And the checkpoints'
    bytes before they were taken back, and the seconds the fill took.)"""
    from agent.backends.libggswarm import NativeModel

    m = NativeModel(path, 0, n_layers, n_threads=threads)
    try:
        sid = m.open_session(min(max(CTXS.values()), m.n_ctx_max))
        t0 = time.perf_counter()
        _fill(m, sid, fill, np.random.default_rng(0))
        secs = time.perf_counter() - t0
        assert m.session_len(sid) == fill
        with_checkpoints = m.kv_bytes(sid)
        ckpts = m.reclaim_checkpoints(with_checkpoints)
        held = m.kv_bytes(sid)
        assert held == with_checkpoints - ckpts
        out = {fill: held}
        for n in CTXS.values():
            if fill < n <= m.n_ctx_max:
                out[n] = held + m.growth_bytes(sid, n)
        return out, ckpts, secs
    finally:
        m.close()


def sessions_in_budget(
    path: str, n_layers: int, fill: int, threads: int, budget_bytes: int, n: int
) -> dict[str, int]:
    """Open sessions of `fill` positions one after another (512-position calls, as the route feeds a
    prompt) on one handle whose node budget is `budget_bytes`, until one is refused or n are full:
    how many fit, and the checkpoint bytes still held at the end (those the budget had room for)."""
    from agent.backends.libggswarm import NativeBudget, NativeError, NativeModel

    budget = NativeBudget(budget_bytes)
    m = NativeModel(path, 0, n_layers, n_threads=threads, budget=budget)
    rng = np.random.default_rng(1)
    full = 0
    try:
        for _ in range(n):
            sid = m.open_session(fill)
            try:
                _fill(m, sid, fill, rng)
            except NativeError:
                break
            full += 1
        return {"sessions_full": full, "checkpoint_bytes_held": m.checkpoints_reclaimable()}
    finally:
        m.close()
        budget.close()


# llama-server's context checkpoints per prompt (tools/server/server-context.cpp: the prompt's last
# 4 + n_ubatch and last 4 positions go in batches of their own, a checkpoint before each), kept per slot up
# to n_ctx_checkpoints (32) across turns
SERVER_CHECKPOINTS_PER_PROMPT = 2


def llama_server_checkpoint(arch: str, hp: dict[str, Any], desc: ArchDescription, n_ctx: int) -> int:
    """Bytes of one of llama-server's context checkpoints after a prompt of n_ctx positions: the state it
    copies with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (what a cache cannot cut back): deepseek4's raw ring's
    cells in use and its compressor states (llama-kv-cache-dsv4.cpp state_write), the sliding-window
    layers' ring cells (llama-kv-cache-iswa.cpp), the recurrent states (llama-memory-hybrid.cpp); none
    for caches that cut back anywhere (glm-dsa: llama-server takes none)."""
    f16 = 2
    if arch == "deepseek4":
        head = int(hp["attention.key_length"])
        idx = int(hp["attention.indexer.key_length"])
        ring = _pad(min(n_ctx, int(hp["attention.sliding_window"]) + UBATCH))
        ratios = [int(r) for r in hp["attention.compress_ratios"]][: desc.n_layers]
        n4, n128 = ratios.count(4), ratios.count(128)
        raw = (desc.n_layers + desc.mtp_layers) * min(n_ctx, ring) * head * f16
        return raw + 2 * 4 * (n4 * 8 * 2 * head + n128 * 128 * head + n4 * 8 * 2 * idx)
    total = 0
    for i, layer in enumerate(desc.layers):
        for p in layer.state:
            if layer.state_kind == "recurrent" and p.fixed:
                total += p.bytes_at(1, f16)
            elif arch == "gemma3" and _gemma_swa(i) and not p.fixed:
                rows = _pad(min(n_ctx, int(hp["attention.sliding_window"]) + UBATCH))
                total += p.elements * min(n_ctx, rows) * (4 if p.f32 else f16)
    return total


# --- per architecture ------------------------------------------------------------------------------


def _long_copy(arch: str, tmp: Path) -> str:
    """A tiny file of `arch` with context_length 131072 (our executor caps sessions at the file's)."""
    from gguf import GGUFReader

    src = write_tiny_gguf(arch, tmp / f"{arch}-4k.gguf")
    dst = tmp / f"{arch}.gguf"
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    field = reader.fields[f"{arch}.context_length"]
    field.parts[field.data[0]][0] = max(CTXS.values())
    del reader  # flushes the memmap
    return str(dst)


# sessions the density check fills: a budget of this many times llama.cpp's bytes for one
SESSIONS_IN_BUDGET = 4


def _key_of(n_ctx: int) -> str:
    return next(k for k, v in CTXS.items() if v == n_ctx)


def _ratio(a: int, b: int) -> float:
    return round(a / b, 4) if b else float("inf")


def bench_file(path: str, arch: str, fill: int, threads: int) -> dict[str, Any]:
    """One real GGUF: ours measured (+ growth plan) and from the manifest, llama.cpp's log and formula."""
    man = build_manifest(path, hash_tensors=False)
    names = [t.name for t in man.tensors]
    desc = describe(arch, man.hparams, man.n_layers + man.mtp_layers, man.boundary_dim, names)
    measured, measured_ckpts, secs = ours_measured(path, man.n_layers, fill, threads)
    r: dict[str, Any] = {
        "fill_positions": fill,
        "fill_seconds": round(secs, 1),
        "n_ctx_file": man.context_length,
        "ours_measured_checkpoint_bytes": measured_ckpts,
    }
    for key, n in CTXS.items():
        state, ckpt = ours_describe(desc, n, man.hparams)
        r[f"manifest_bytes_{key}"] = sum(layer.state_bytes(n, 2.0) for layer in man.layers)
        if n in measured:
            r[f"ours_bytes_{key}"] = measured[n]
            r[f"ours_source_{key}"] = "measured" if n == fill else "measured + growth_bytes"
            r[f"ours_bytes_with_checkpoints_{key}"] = measured[n] + measured_ckpts
        else:
            r[f"ours_bytes_{key}"] = state
            r[f"ours_source_{key}"] = "describe() (not filled)"
            r[f"ours_bytes_with_checkpoints_{key}"] = state + ckpt
        r[f"ours_describe_bytes_{key}"] = state
        r[f"ours_checkpoint_bytes_{key}"] = ckpt
        if n == fill:  # the state the library holds against the manifest's estimate of it
            r[f"ours_measured_minus_manifest_{key}"] = measured[n] - r[f"manifest_bytes_{key}"]
        for full, tag in ((False, ""), (True, "_swa_full")):
            logged, lines = llama_log(path, n, full, threads)
            r[f"llamacpp_log_bytes{tag}_{key}"] = logged
            r[f"llamacpp_formula_bytes{tag}_{key}"] = llama_formula(arch, man.hparams, desc, n, full)
            if tag == "" and key == "8k":
                r["llamacpp_log_lines_8k"] = lines
        r[f"state_ratio_{key}"] = _ratio(r[f"ours_bytes_{key}"], r[f"llamacpp_log_bytes_{key}"])
        r[f"state_ratio_with_checkpoints_{key}"] = _ratio(
            r[f"ours_bytes_with_checkpoints_{key}"], r[f"llamacpp_log_bytes_{key}"]
        )
    # the density that follows: a node budget of SESSIONS_IN_BUDGET x llama.cpp's bytes per session at
    # `fill` positions (its formula: exact, where the log rounds each line to 0.01 MiB), filled with
    # sessions of `fill` positions on our executor
    fit = sessions_in_budget(
        path,
        man.n_layers,
        fill,
        threads,
        SESSIONS_IN_BUDGET * r[f"llamacpp_formula_bytes_{_key_of(fill)}"],
        SESSIONS_IN_BUDGET,
    )
    r["sessions_in_llamacpp_budget"] = fit["sessions_full"]
    r["sessions_in_llamacpp_budget_checkpoint_bytes"] = fit["checkpoint_bytes_held"]
    return r


def bench_real(key: str, arch: str, spec: str, gemma: dict[str, Any] | None) -> dict[str, Any]:
    """The real model at its hyperparameters: ours by describe(), llama.cpp's by formula (Gemma 3's
    llama.cpp figures: the log on its real file)."""
    if spec:
        d = json.loads((SPECS / spec).read_text())
        hp, n_layers, d_model = d["hparams"], d["n_layers"], d["d_model"]
        mtp = int(hp.get("nextn_predict_layers", 0))
        names = [f"blk.{n_layers}.nextn.eh_proj.weight"] if mtp else []
        desc = describe(arch, hp, n_layers + mtp, d_model, names)
    else:
        man = build_manifest(packaged_model_path("gemma3"), hash_tensors=False)
        hp = man.hparams
        desc = describe(arch, hp, man.n_layers, man.boundary_dim, [t.name for t in man.tensors])
    r: dict[str, Any] = {"llamacpp_source": "log (real file)" if gemma else "formula"}
    for ck, n in CTXS.items():
        state, ckpt = ours_describe(desc, n, hp)
        r[f"ours_bytes_{ck}"] = state
        r[f"ours_bytes_with_checkpoints_{ck}"] = state + ckpt
        r[f"ours_checkpoint_bytes_{ck}"] = ckpt
        for full, tag in ((False, ""), (True, "_swa_full")):
            formula = llama_formula(arch, hp, desc, n, full)
            r[f"llamacpp_formula_bytes{tag}_{ck}"] = formula
            r[f"llamacpp_bytes{tag}_{ck}"] = gemma[f"llamacpp_log_bytes{tag}_{ck}"] if gemma else formula
        if gemma and f"ours_bytes_{ck}" in gemma and gemma[f"ours_source_{ck}"].startswith("measured"):
            r[f"ours_measured_bytes_{ck}"] = gemma[f"ours_bytes_{ck}"]
        r[f"state_ratio_{ck}"] = _ratio(r[f"ours_bytes_{ck}"], r[f"llamacpp_bytes_{ck}"])
        r[f"state_ratio_swa_full_{ck}"] = _ratio(r[f"ours_bytes_{ck}"], r[f"llamacpp_bytes_swa_full_{ck}"])
        r[f"state_ratio_with_checkpoints_{ck}"] = _ratio(state + ckpt, r[f"llamacpp_bytes_{ck}"])
        # llama-server as people run it: its context plus the checkpoints it keeps after one prompt (not
        # given back under memory pressure), against ours with the checkpoints a session keeps when it can
        server = SERVER_CHECKPOINTS_PER_PROMPT * llama_server_checkpoint(arch, hp, desc, n)
        r[f"llama_server_checkpoint_bytes_{ck}"] = server
        r[f"state_ratio_vs_llama_server_{ck}"] = _ratio(state + ckpt, r[f"llamacpp_bytes_{ck}"] + server)
    return r


def _mib(b: int) -> str:
    return f"{b / MIB:,.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--fill", type=int, default=8192, help="positions fed through our executor: 8192, 32768 or 131072"
    )
    ap.add_argument("--archs", default="", help=f"comma-separated of {', '.join(ARCHS)} (default: all)")
    args = ap.parse_args()
    keys = [k for k in args.archs.split(",") if k] or list(ARCHS)
    if set(keys) - set(ARCHS):
        ap.error(f"unknown architectures {sorted(set(keys) - set(ARCHS))}; known: {list(ARCHS)}")
    if args.fill not in CTXS.values():
        ap.error(f"--fill must be one of {sorted(CTXS.values())}")
    result: dict[str, Any] = {"cpu": cpu_kind(), "threads": args.threads, "fill_positions": args.fill}
    result["tree"] = tree_state()
    result["llamacpp_settings"] = "f16 K/V, n_ubatch 512, flash_attn off, swa_full false (_swa_full: true)"
    with tempfile.TemporaryDirectory() as tmp:
        for key in keys:
            arch, spec, name = ARCHS[key]
            tiny = bench_file(_long_copy(arch, Path(tmp)), arch, args.fill, args.threads)
            gemma = None
            if not spec:  # Gemma 3 270M: its real file, measured like the tiny ones (context 32K)
                gemma = bench_file(str(packaged_model_path("gemma3")), arch, args.fill, args.threads)
                result[f"{key}_realfile"] = gemma
            real = bench_real(key, arch, spec, gemma)
            result[f"{key}_tiny"] = tiny
            result[f"{key}_tiny_sessions_in_llamacpp_budget"] = tiny["sessions_in_llamacpp_budget"]
            result[f"{key}_real"] = real
            for ck in CTXS:
                result[f"{key}_state_ratio_{ck}"] = real[f"state_ratio_{ck}"]
                result[f"{key}_state_ratio_with_checkpoints_{ck}"] = real[
                    f"state_ratio_with_checkpoints_{ck}"
                ]
                result[f"{key}_state_ratio_vs_llama_server_{ck}"] = real[f"state_ratio_vs_llama_server_{ck}"]
            print(
                f"{key} ({name}): ours / llama.cpp MiB at 8K {_mib(real['ours_bytes_8k'])} / "
                f"{_mib(real['llamacpp_bytes_8k'])}, 32K {_mib(real['ours_bytes_32k'])} / "
                f"{_mib(real['llamacpp_bytes_32k'])}, 128K {_mib(real['ours_bytes_128k'])} / "
                f"{_mib(real['llamacpp_bytes_128k'])} (ratios {real['state_ratio_8k']}, "
                f"{real['state_ratio_32k']}, {real['state_ratio_128k']}; with checkpoints "
                f"{real['state_ratio_with_checkpoints_8k']}, {real['state_ratio_with_checkpoints_32k']}, "
                f"{real['state_ratio_with_checkpoints_128k']}); tiny file ratios "
                f"{tiny['state_ratio_8k']}, {tiny['state_ratio_32k']}, {tiny['state_ratio_128k']}; "
                f"{tiny['sessions_in_llamacpp_budget']} of {SESSIONS_IN_BUDGET} sessions of {args.fill} positions "
                f"fit a budget of {SESSIONS_IN_BUDGET} x llama.cpp's",
                flush=True,
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
