"""Per-architecture benchmark of the native backend against llama-cpp-python, same model, threads and run.

For every architecture in ARCHS (a row per row of agent/artifacts/archtable.py): teacher-forced top-1
agreement and max |logit diff| of the model split into 3 native hops against llama-cpp-python's full
model, and greedy decode speed of those 3 hops relative to llama-cpp-python (interleaved rounds, best of
each), with flash attention off and on (both sides alike: llama.cpp's -fa and the node's --flash-attn)
and both sides' caches in one type. Prints human-readable lines, then one JSON object as the last line
with `<arch>_top1_agreement`, `<arch>_max_abs_logit_diff`, `<arch>_decode_ratio_3hop_vs_llamacpp` (and
the tok/s behind the ratio) per architecture for flash attention off, the same keys with a `_flash`
suffix for on; `<arch>` is the row's name with '-' as '_' (glm_dsa, gpt_oss, minimax_m2). Usage:

    .venv/bin/python bench/archs.py [--threads 2] [--decode-tokens 64] [--rounds 2] [--archs llama,gemma3]
        [--flash-attn off,on] [--cache-type f16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts import archtable  # noqa: E402
from agent.artifacts.manifest import build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.artifacts.tiny import write_suite_gguf  # noqa: E402
from agent.backends.base import ShardSpec  # noqa: E402
from agent.dev.chain import route_forward  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from bench._common import cpu_kind  # noqa: E402
from bench._llamacpp import open_llama  # noqa: E402

TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
N_TEACHER = 256
N_PROMPT = 40


@dataclass(frozen=True)
class BenchArch:
    """One row of the table: the JSON key prefix, where its GGUF comes from, and its 3-hop split."""

    key: str
    model: Callable[[Path], Path]
    splits: tuple[tuple[int, int], ...]
    cache_type: str = "f16"  # both sides' attention caches: llama.cpp's default, and the node's


def _packaged(name: str) -> Callable[[Path], Path]:
    return lambda _: packaged_model_path(name)


def _row(a: archtable.ArchFacts) -> BenchArch:
    """Real weights where a package ships them (SmolLM2 for llama, Gemma 3 270M), split as the suite
    splits them, else the suite's tiny random-weight file and split (llama.cpp is the oracle either way;
    tiny files' speed says little)."""
    key = a.name.replace("-", "_")
    if a.packaged is not None:
        name, splits = a.packaged
        return BenchArch(key, _packaged(name), splits)
    return BenchArch(key, partial(write_suite_gguf, a.name), a.suite.splits)


# One row per architecture of agent/artifacts/archtable.py (its seams are explained there).
ARCHS = [_row(a) for a in archtable.ARCHITECTURES]


def _sid(n: int) -> SessionId:
    return SessionId(n.to_bytes(16, "little"))


def llama_decode(llm, prompt: list[int], n: int, steps: list[float] | None = None) -> tuple[float, list[int]]:  # noqa: ANN001
    """Greedy decode n steps after prompt on llama-cpp-python; (seconds, tokens). Each step's seconds
    go to `steps` when given."""
    import llama_cpp

    def argmax_last() -> int:
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))

    llm.reset()
    llm.eval(prompt)
    tok = argmax_last()
    toks = [tok]
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        llm.eval([tok])
        tok = argmax_last()
        toks.append(tok)
        if steps is not None:
            steps.append(time.perf_counter() - t)
    return time.perf_counter() - t0, toks


def divergence(llm, prompt: list[int], ref: list[int], got: list[int]) -> tuple[int, float]:  # noqa: ANN001
    """Where `got` first leaves llama.cpp's greedy tokens `ref`, and by how much llama.cpp's own decode
    logits preferred its token there (a near tie: both sides rounded within it)."""
    import llama_cpp

    i = next(k for k in range(min(len(ref), len(got))) if ref[k] != got[k])
    llm.reset()
    llm.eval(prompt)
    for t in ref[:i]:  # one token per call, as its greedy decode ran
        llm.eval([t])
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))
    return i, float(logits[ref[i]] - logits[got[i]])


class _TimedHop:
    """A hop whose forward calls are timed (seconds per call, its Python included)."""

    def __init__(self, hop) -> None:  # noqa: ANN001
        self.hop = hop
        self.secs: list[float] = []

    def forward(self, step):  # noqa: ANN001, ANN201
        t = time.perf_counter()
        res = self.hop.forward(step)
        self.secs.append(time.perf_counter() - t)
        return res


def native_decode(
    hops: list, prompt: list[int], n: int, sid: SessionId, hop_steps: list[list[float]] | None = None
) -> tuple[float, list[int]]:
    """Prefill then greedy decode n steps through the hops (sampling on the last hop); (seconds, tokens).
    Each decode step's seconds per hop go to `hop_steps` when given."""
    for h in hops:
        h.open_session(sid, len(prompt) + n + 8)
    try:
        tok = int(route_forward(hops, sid, 0, prompt).token)
        toks = [tok]
        timed = [_TimedHop(h) for h in hops]
        t0 = time.perf_counter()
        for i in range(n):
            tok = int(route_forward(timed, sid, len(prompt) + i, [tok]).token)  # type: ignore[arg-type]
            toks.append(tok)
        secs = time.perf_counter() - t0
        if hop_steps is not None:
            for k, th in enumerate(timed):
                hop_steps[k].extend(th.secs)
        return secs, toks
    finally:
        for h in hops:
            h.close_session(sid)


# ggml type ids, as llama.cpp's type_k / type_v take them
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def bench_arch(
    row: BenchArch, workdir: Path, threads: int, n_decode: int, rounds: int, flash_attn: str, cache_type: str
) -> dict[str, float]:
    from agent.backends.native import NativeBackend

    path = str(row.model(workdir))
    manifest = build_manifest(path, hash_tensors=False)
    hops = [
        NativeBackend(
            ShardSpec(path, a, b, manifest, n_threads=threads), cache_type=cache_type, flash_attn=flash_attn
        )
        for a, b in row.splits
    ]
    flash = hops[0].model.info.decode_kernels == -2
    kv = GGML_TYPES[cache_type]
    cache = {"type_k": kv, "type_v": kv}
    out: dict[str, float] = {}
    try:
        ref = open_llama(path, threads, 512, flash, logits_all=True, **cache)
        ids = list(ref.tokenize(TEXT.read_bytes(), add_bos=True))[:N_TEACHER]
        ref.reset()
        ref.eval(ids)
        want = np.asarray(ref.scores[: len(ids)], dtype=np.float32)
        ref.close()
        sid = _sid(1)
        for h in hops:
            h.open_session(sid, 512)
        got = route_forward(hops, sid, 0, ids, want_logits=True).logits
        for h in hops:
            h.close_session(sid)
        out["top1_agreement"] = float((got.argmax(1) == want.argmax(1)).mean())
        out["max_abs_logit_diff"] = float(np.abs(got - want).max())
        del got, want

        llm = open_llama(path, threads, 512, flash, **cache)
        prompt = ids[:N_PROMPT]
        best_ref = best_nat = 0.0
        same = True
        ref_steps: list[float] = []
        hop_steps: list[list[float]] = [[] for _ in hops]
        for r in range(rounds):  # interleaved, so both see the same machine load
            secs, ref_toks = llama_decode(llm, prompt, n_decode, ref_steps)
            best_ref = max(best_ref, n_decode / secs)
            secs, nat_toks = native_decode(hops, prompt, n_decode, _sid(2 + r), hop_steps)
            best_nat = max(best_nat, n_decode / secs)
            if same and ref_toks != nat_toks:
                out["greedy_first_diff"], out["greedy_diff_margin"] = divergence(
                    llm, prompt, ref_toks, nat_toks
                )
            same = same and ref_toks == nat_toks
        llm.close()
        out["decode_tok_s_llamacpp"] = best_ref
        out["decode_tok_s_native_3hop"] = best_nat
        out["decode_ratio_3hop_vs_llamacpp"] = best_nat / best_ref
        # medians over every round's steps (steadier than the best round's throughput): llama.cpp's step,
        # each hop's (wall, its Python included) and their sum
        out["step_ms_llamacpp"] = 1e3 * float(np.median(ref_steps))
        for k, secs_k in enumerate(hop_steps):
            out[f"hop{k}_step_ms"] = 1e3 * float(np.median(secs_k))
        out["step_ms_native_3hop"] = sum(out[f"hop{k}_step_ms"] for k in range(len(hops)))
        out["greedy_equal"] = float(same)
        out["decode_kernels"] = float(hops[0].model.info.decode_kernels)
    finally:
        for h in hops:
            h.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--archs", default="", help="comma-separated keys of ARCHS (default: all)")
    ap.add_argument("--flash-attn", default="off,on", help="comma-separated: off, on (default both)")
    ap.add_argument("--cache-type", default="", help="both sides' caches (default: each row's, f16)")
    args = ap.parse_args()
    modes = [m for m in args.flash_attn.split(",") if m]
    if not modes or set(modes) - {"off", "on"}:
        ap.error("--flash-attn takes off, on or off,on")
    if args.cache_type and args.cache_type not in GGML_TYPES:
        ap.error(f"--cache-type is one of {sorted(GGML_TYPES)}")
    keys = [k for k in args.archs.split(",") if k]
    unknown = set(keys) - {r.key for r in ARCHS}
    if unknown:
        ap.error(f"unknown architectures {sorted(unknown)}; known: {[r.key for r in ARCHS]}")
    result: dict[str, float | int | str] = {
        "cpu": cpu_kind(),
        "threads": args.threads,
        "decode_tokens": args.decode_tokens,
    }
    with tempfile.TemporaryDirectory() as tmp:
        for row in ARCHS:
            if keys and row.key not in keys:
                continue
            for mode in modes:
                cache_type = args.cache_type or row.cache_type
                r = bench_arch(
                    row, Path(tmp), args.threads, args.decode_tokens, args.rounds, mode, cache_type
                )
                print(
                    f"{row.key} (flash attention {mode}, {cache_type}): top-1 {r['top1_agreement']:.4f}, "
                    f"max |logit diff| {r['max_abs_logit_diff']:.3g}, decode 3 hops "
                    f"{r['decode_tok_s_native_3hop']:.1f} tok/s vs llama-cpp-python "
                    f"{r['decode_tok_s_llamacpp']:.1f} (ratio {r['decode_ratio_3hop_vs_llamacpp']:.3f}), "
                    f"greedy equal {bool(r['greedy_equal'])}"
                    + (
                        f" (first differs at token {int(r['greedy_first_diff'])}, where llama.cpp's "
                        f"logits preferred its token by {r['greedy_diff_margin']:.3g})"
                        if "greedy_first_diff" in r
                        else ""
                    ),
                    flush=True,
                )
                suffix = "_flash" if mode == "on" else ""
                for k, v in r.items():
                    result[f"{row.key}_{k}{suffix}"] = (
                        int(v) if k in ("greedy_equal", "greedy_first_diff") else round(v, 6)
                    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
