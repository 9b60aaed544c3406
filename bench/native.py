"""Benchmark of the native (ggml) backend against llama-cpp-python, same model, threads and run.

Prints human-readable lines, then one JSON object as the last line. Usage:

    .venv/bin/python bench/native.py [--threads 2] [--decode-tokens 128] [--flash-attn off|on] [--long-ctx 8192]

--flash-attn sets both sides alike (llama.cpp's -fa, the node's --flash-attn; off is both defaults on a
CPU). --long-ctx adds a decode step after that many positions to the 64 and 2,048 of `ctx_ratio`, both
sides: `step_ms_ctx<N>`, `step_ms_ctx<N>_llamacpp` and `ctx<N>_step_ratio_vs_llamacpp`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.artifacts.manifest import Manifest, build_manifest  # noqa: E402
from agent.artifacts.packaged import packaged_model_path  # noqa: E402
from agent.backends.base import ShardSpec  # noqa: E402
from agent.backends.libggswarm import KERNEL_PAD, KV_PAD, padded_kv  # noqa: E402
from agent.dev.chain import route_forward  # noqa: E402
from agent.wire.ids import SessionId  # noqa: E402
from bench._common import cpu_kind  # noqa: E402
from bench._llamacpp import open_llama  # noqa: E402

TEXT = REPO / "tests" / "data" / "native_lighthouse.txt"
SPLITS = [(0, 10), (10, 20), (20, 30)]
CTX_WARMUP_STEPS = 4

_RSS_CHILD = r"""
import gc, json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
from agent.backends.libggswarm import NativeModel
import numpy
before = rss()
m = NativeModel(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), n_threads=2)
gc.collect()
print(json.dumps({"rss_mb": rss(), "rss_mb_before_load": before, "weight_mb": m.info.weight_bytes / 2**20}))
"""


def wait_for_quiet(limit_s: float, load: float = 1.0) -> float:
    """On a shared machine, wait (at most limit_s) for the 1-minute load to fall below `load`."""
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def bytes_per_step(hops: list, manifest: Manifest, ctx: int) -> float:
    """Bytes one decode step must read at context `ctx`: every hop's weights (the first hop's token
    embedding only by row, unless it is also the output head) plus the K/V of the attended span:
    the cached positions rounded up to KV_PAD as in llama.cpp, or to KERNEL_PAD with the decode
    kernels."""
    emb = next(t.nbytes for t in manifest.tensors if t.name == "token_embd.weight")
    total = 0.0
    for h in hops:
        info = h.model.info
        n_kv = padded_kv(ctx + 1, KERNEL_PAD if info.decode_kernels == 1 else KV_PAD)
        total += info.weight_bytes + n_kv * info.kv_bytes_per_token
        if info.is_first and not info.is_last:
            total -= emb
    return total


def _sid(n: int) -> SessionId:
    return SessionId(n.to_bytes(16, "little"))


def rss_of_window(model: str, a: int, b: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, model, str(a), str(b)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


class LlamaCppRef:
    """llama-cpp-python driven from a Python loop (the single-process reference)."""

    def __init__(self, model: str, threads: int, n_ctx: int = 2304, flash: bool = False) -> None:
        self.llm = open_llama(model, threads, n_ctx, flash)
        self.n_vocab = self.llm.n_vocab()

    def prefill_ms(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return (time.perf_counter() - t0) * 1e3

    def step_ms(self, ids: list[int], ctx: int, steps: int) -> float:
        """Mean decode step time after a `ctx`-token context."""
        llm = self.llm
        llm.reset()
        for off in range(0, ctx, 512):
            llm.eval(ids[off : min(ctx, off + 512)])
        t0 = time.perf_counter()
        for i in range(steps):
            llm.eval([ids[ctx + i]])
        return (time.perf_counter() - t0) / steps * 1e3

    def _argmax_last(self) -> int:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        tok = self._argmax_last()
        toks = [tok]
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = self._argmax_last()
            toks.append(tok)
        return time.perf_counter() - t0, toks


def decode_native(hops: list, sid: SessionId, pos: int, first: int, n: int) -> tuple[float, list[int]]:
    """Greedy decode `n` steps starting with token `first` at `pos`; returns (seconds, tokens)."""
    history: list[int] = []
    tok = first
    toks = [tok]
    t0 = time.perf_counter()
    for i in range(n):
        res = route_forward(hops, sid, pos + i, [tok], None, history)
        tok = int(res.token)
        toks.append(tok)
    return time.perf_counter() - t0, toks


def open_all(hops: list, sid: SessionId, n: int) -> None:
    for h in hops:
        h.open_session(sid, n)


def close_all(hops: list, sid: SessionId) -> None:
    for h in hops:
        h.close_session(sid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--ctx-steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--flash-attn", choices=("off", "on"), default="off", help="both sides alike")
    ap.add_argument("--long-ctx", type=int, default=0, help="also time a step after this many positions")
    ap.add_argument("--wait-quiet-s", type=float, default=0.0, help="wait up to this long for load < 1 first")
    args = ap.parse_args()
    load_at_start = wait_for_quiet(args.wait_quiet_s) if args.wait_quiet_s > 0 else os.getloadavg()[0]
    from agent.backends.native import NativeBackend

    model = str(packaged_model_path())
    manifest = build_manifest(model)
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
    text_ids = vocab.tokenize(TEXT.read_bytes(), add_bos=False)
    ctxs = (64, 2048, args.long_ctx) if args.long_ctx > 2048 else (64, 2048)
    # the positions the longest context's session takes: its prompt and every round's steps
    span = max(ctxs) + args.rounds * (CTX_WARMUP_STEPS + args.ctx_steps) + 1
    if span > manifest.context_length:
        ap.error(
            f"--long-ctx {args.long_ctx}: with the rounds' steps it needs {span} positions; the model has {manifest.context_length}"
        )
    long_ids = (text_ids * (span // len(text_ids) + 1))[:span]
    prompt = text_ids[:32]
    prefill = long_ids[:512]
    n = args.decode_tokens
    res: dict[str, float | int | str] = {"cpu": cpu_kind()}

    flash = args.flash_attn == "on"
    ref = LlamaCppRef(model, args.threads, span, flash)

    def backend(a: int, b: int) -> NativeBackend:
        return NativeBackend(
            ShardSpec(model, a, b, manifest, n_threads=args.threads), flash_attn=args.flash_attn
        )

    one = [backend(0, 30)]
    three = [backend(a, b) for a, b in SPLITS]
    routes = {"1hop": one, "3hop": three}
    bytes_ratio = bytes_per_step(three, manifest, 2048) / bytes_per_step(three, manifest, 64)

    def native_prefill_ms(hops: list) -> float:
        sid = _sid(1)
        open_all(hops, sid, 2304)
        t0 = time.perf_counter()
        route_forward(hops, sid, 0, prefill)
        ms = (time.perf_counter() - t0) * 1e3
        close_all(hops, sid)
        return ms

    def native_decode(hops: list) -> tuple[float, list[int]]:
        sid = _sid(1)
        open_all(hops, sid, 2304)
        first = int(route_forward(hops, sid, 0, prompt).token)
        secs, toks = decode_native(hops, sid, len(prompt), first, n)
        close_all(hops, sid)
        return secs, toks

    # interleaved rounds, best of each: the CPU is shared, so contention hits every side alike
    best: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    ref.prefill_ms(prefill)  # warm-up
    for hops in routes.values():
        native_prefill_ms(hops)
    for _ in range(args.rounds):
        best["prefill_llamacpp"] = min(best.get("prefill_llamacpp", 1e18), ref.prefill_ms(prefill))
        for name, hops in routes.items():
            best[f"prefill_{name}"] = min(best.get(f"prefill_{name}", 1e18), native_prefill_ms(hops))
        secs, tokens["llamacpp"] = ref.decode(prompt, n)
        best["decode_llamacpp"] = max(best.get("decode_llamacpp", 0.0), n / secs)
        for name, hops in routes.items():
            secs, tokens[name] = native_decode(hops)
            best[f"decode_{name}"] = max(best.get(f"decode_{name}", 0.0), n / secs)
    lc = {"decode_tok_s": best["decode_llamacpp"], "prefill_ms_512": best["prefill_llamacpp"]}
    out: dict[str, float] = {}
    for name in routes:
        out[f"decode_tok_s_{name}"] = best[f"decode_{name}"]
        out[f"prefill_ms_512_{name}"] = best[f"prefill_{name}"]
        out[f"same_tokens_as_llamacpp_{name}"] = tokens[name] == tokens["llamacpp"]
    print(
        f"llama-cpp-python: decode {lc['decode_tok_s']:.1f} tok/s, prefill 512 in {lc['prefill_ms_512']:.1f} ms"
    )
    for name in routes:
        print(
            f"native {name}: decode {out[f'decode_tok_s_{name}']:.1f} tok/s, prefill 512 in "
            f"{out[f'prefill_ms_512_{name}']:.1f} ms, tokens equal llama.cpp: {out[f'same_tokens_as_llamacpp_{name}']}"
        )

    # decode step time at context 64 vs 2048 (3 hops, KV cache working); interleaved, best of rounds
    steps: dict[int, float] = {}
    pos: dict[int, int] = {}
    for ctx in ctxs:
        sid = _sid(ctx)
        open_all(three, sid, span)
        for off in range(0, ctx, 512):
            route_forward(three, sid, off, long_ids[off : min(ctx, off + 512)])
        pos[ctx] = ctx
    for _ in range(args.rounds):
        for ctx in ctxs:
            # untimed steps first: after the other session ran, caches hold its K/V, not the weights
            # (llama.cpp's figure below is taken right after a prefill, which warms them too)
            decode_native(three, _sid(ctx), pos[ctx], long_ids[pos[ctx]], CTX_WARMUP_STEPS)
            pos[ctx] += CTX_WARMUP_STEPS
            secs, _ = decode_native(three, _sid(ctx), pos[ctx], long_ids[pos[ctx]], args.ctx_steps)
            pos[ctx] += args.ctx_steps
            steps[ctx] = min(steps.get(ctx, 1e18), secs / args.ctx_steps * 1e3)
    for ctx in ctxs:
        close_all(three, _sid(ctx))
        print(f"native 3hop decode step at context {ctx}: {steps[ctx]:.2f} ms")
    ref_steps = {ctx: min(ref.step_ms(long_ids, ctx, args.ctx_steps) for _ in range(2)) for ctx in ctxs}
    print("llama-cpp-python decode step at context " + ", ".join(f"{c}: {ref_steps[c]:.2f} ms" for c in ctxs))
    ref.llm.close()

    # teacher-forced parity on the test text
    tf = llama_cpp.Llama(model_path=model, logits_all=True, n_ctx=1024, n_threads=args.threads, verbose=False)
    tf.eval(text_ids)
    ref = np.asarray(tf.scores[: len(text_ids)], dtype=np.float32)
    tf.close()
    sid = _sid(3)
    open_all(three, sid, 1024)
    got = route_forward(three, sid, 0, text_ids, want_logits=True).logits
    close_all(three, sid)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    max_diff = float(np.abs(got - ref).max())
    print(
        f"teacher forcing {len(text_ids)} tokens: top-1 agreement {agree:.4f}, max |logit diff| {max_diff:.4f}"
    )
    for h in one + three:
        h.close()

    full = rss_of_window(model, 0, 30)
    thirds = {f"{a}:{b}": rss_of_window(model, a, b) for a, b in SPLITS}
    mid = thirds["10:20"]
    print(
        f"RSS whole model {full['rss_mb']:.1f} MB; "
        + ", ".join(f"{k} {v['rss_mb']:.1f} MB" for k, v in thirds.items())
        + f" (process before load {full['rss_mb_before_load']:.1f} MB)"
    )

    res.update(
        {
            "threads": args.threads,
            "flash_attn": args.flash_attn,
            "load_avg_1m_at_start": round(load_at_start, 2),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "decode_tokens": n,
            "decode_tok_s_llamacpp": round(lc["decode_tok_s"], 2),
            "decode_tok_s_native_1hop": round(out["decode_tok_s_1hop"], 2),
            "decode_tok_s_native_3hop": round(out["decode_tok_s_3hop"], 2),
            "ratio_3hop_vs_llamacpp": round(out["decode_tok_s_3hop"] / lc["decode_tok_s"], 3),
            "prefill_ms_512_llamacpp": round(lc["prefill_ms_512"], 1),
            "prefill_ms_512_native_1hop": round(out["prefill_ms_512_1hop"], 1),
            "prefill_ms_512_native_3hop": round(out["prefill_ms_512_3hop"], 1),
            "prefill_ratio": round(out["prefill_ms_512_3hop"] / lc["prefill_ms_512"], 3),
            "step_ms_ctx64": round(steps[64], 3),
            "step_ms_ctx2048": round(steps[2048], 3),
            "ctx_ratio": round(steps[2048] / steps[64], 3),
            "step_ms_ctx64_llamacpp": round(ref_steps[64], 3),
            "step_ms_ctx2048_llamacpp": round(ref_steps[2048], 3),
            "ctx_ratio_llamacpp": round(ref_steps[2048] / ref_steps[64], 3),
            # extra time a step costs at 2048 over 64 positions: the attention's own cost
            "ctx_extra_ms": round(steps[2048] - steps[64], 3),
            "ctx_extra_ms_llamacpp": round(ref_steps[2048] - ref_steps[64], 3),
            # how much more a step reads at 2048 than at 64 (weights + f16 K/V): the ratio a step bound
            # purely by memory traffic would have
            "ctx_bytes_ratio": round(bytes_ratio, 3),
            # decode steps ran libggswarm's CPU attention kernels (docs/native.md, Decode kernels)
            "decode_kernels": all(h.model.decode_kernels for h in three),
            "rss_mb_full": round(full["rss_mb"], 1),
            "rss_mb_one_third": round(mid["rss_mb"], 1),
            "rss_ratio_one_third": round(mid["rss_mb"] / full["rss_mb"], 3),
            "rss_mb_thirds": {k: round(v["rss_mb"], 1) for k, v in thirds.items()},
            "rss_mb_process_before_load": round(full["rss_mb_before_load"], 1),
            "rss_ratio_one_third_over_baseline": round(
                (mid["rss_mb"] - mid["rss_mb_before_load"]) / (full["rss_mb"] - full["rss_mb_before_load"]), 3
            ),
            "greedy_tokens_equal_llamacpp": bool(
                out["same_tokens_as_llamacpp_1hop"] and out["same_tokens_as_llamacpp_3hop"]
            ),
            "teacher_forcing_tokens": len(text_ids),
            "teacher_forcing_top1_agreement": round(agree, 4),
            "teacher_forcing_max_abs_logit_diff": round(max_diff, 5),
        }
    )
    if args.long_ctx > 2048:
        n_long = args.long_ctx
        res[f"step_ms_ctx{n_long}"] = round(steps[n_long], 3)
        res[f"step_ms_ctx{n_long}_llamacpp"] = round(ref_steps[n_long], 3)
        res[f"ctx{n_long}_step_ratio_vs_llamacpp"] = round(steps[n_long] / ref_steps[n_long], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
