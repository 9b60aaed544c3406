"""The last hop's greedy pick and its logprob against what llama-cpp-python pays for the same per step.

libggswarm picks a greedy token with `argmax_first` (native/src/sampler.cpp: block maxima in vectorized
lanes, then the first index holding the largest), called here through `ggswarm_sample` without a
logprob; numpy's `argmax` is what bench/archs.py's llama.cpp loop runs on its logits. Vocabularies of
SmolLM2 (49,152) and Qwen (151,936), normal logits; medians of `--calls` calls, microseconds, and the
ratio. A build of another library (env GGSWARM_NATIVE_LIB) gives its own figure for an A/B. Prints one
JSON object:

    .venv/bin/python bench/sampler.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.backends.libggswarm import load_library, sampling_struct  # noqa: E402
from bench._common import cpu_kind  # noqa: E402

VOCABS = {"smollm2": 49152, "qwen": 151936}


def _median_us(fn, calls: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    from llama_cpp import Llama

    lib = load_library()
    greedy = sampling_struct(0.0, 0, 1.0, 0.0, 1.0, 64, 0)
    tok = ctypes.c_int32()
    lp = ctypes.c_double()
    out: dict[str, float | str] = {"cpu": cpu_kind()}
    for name, n in VOCABS.items():
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        ptr = x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

        def ours(ptr=ptr, n=n) -> None:  # noqa: ANN001
            lib.ggswarm_sample(ptr, n, ctypes.byref(greedy), 0, None, 0, ctypes.byref(tok), None)

        ours()
        assert tok.value == int(np.argmax(x))
        out[f"greedy_pick_us_{name}"] = round(_median_us(ours, args.calls), 2)
        out[f"numpy_argmax_us_{name}"] = round(_median_us(lambda x=x: np.argmax(x), args.calls), 2)
        out[f"ratio_greedy_vs_numpy_{name}"] = round(
            out[f"greedy_pick_us_{name}"] / out[f"numpy_argmax_us_{name}"], 3
        )

        def ours_lp(ptr=ptr, n=n) -> None:  # noqa: ANN001
            lib.ggswarm_sample(ptr, n, ctypes.byref(greedy), 0, None, 0, ctypes.byref(tok), ctypes.byref(lp))

        def theirs_lp(x=x) -> None:  # noqa: ANN001
            i = int(np.argmax(x))
            float(Llama.logits_to_logprobs(x)[i])

        ours_lp()
        assert abs(lp.value - float(Llama.logits_to_logprobs(x.astype(np.float64))[tok.value])) < 1e-6
        out[f"greedy_logprob_us_{name}"] = round(_median_us(ours_lp, args.calls), 2)
        out[f"llamacpp_logprob_us_{name}"] = round(_median_us(theirs_lp, args.calls), 2)
        out[f"ratio_logprob_vs_llamacpp_{name}"] = round(
            out[f"greedy_logprob_us_{name}"] / out[f"llamacpp_logprob_us_{name}"], 3
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
