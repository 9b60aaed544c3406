#!/usr/bin/env bash
# GPU check of the CUDA libggswarm (issue 30): on a host with an NVIDIA GPU, its driver, a CUDA toolkit
# (nvcc >= 12; cuBLAS from the toolkit or the nvidia-cublas wheel native/build_cuda.sh fetches) and this
# checkout set up (make setup: .venv with llama-cpp-python 0.3.36, SmolLM2 packaged), it
#   (a) builds the CUDA libggswarm (make native-cuda -> native/build-cuda/libggswarm.so) and a CUDA build
#       of llama-cpp-python 0.3.36 from the same sdist, pip-installed with --target into
#       native/build-cuda/llama-cpp-python (the .venv's CPU build is left alone; PYTHONPATH puts the CUDA
#       one first for this script only; pip's build isolation fetches scikit-build-core from PyPI);
#   (b) runs bench/native.py (SmolLM2: greedy decode 1 and 3 hops, teacher-forced 3-hop parity, tok/s and
#       prefill against llama.cpp) with GGSWARM_NATIVE_LIB=the CUDA library and llama.cpp fully offloaded
#       (every llama_cpp.Llama gets n_gpu_layers=-1 unless GPU_CHECK_NGL says otherwise), then
#       tests/native/test_parity.py the same way (informative: its tolerances were set on the CPU build);
#   (c) prints one JSON object as its last line: the GPU, the devices both sides ran on, the parity
#       booleans and top-1 agreement, the tok/s and their ratios, the pytest tally.
# Environment: GGSWARM_CUDA_ARCHS (default: 89;90 plus the GPU's own when not covered), JOBS,
# GPU_CHECK_NGL (-1), GPU_CHECK_ROUNDS (5), GPU_CHECK_DECODE_TOKENS (64), GPU_CHECK_PYTEST (1; 0 skips it).
# Run: bash scripts/gpu_check.sh   (docs/native.md, "The CUDA build (make native-cuda)")
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
die() { echo "scripts/gpu_check.sh: error: $*" >&2; exit 2; }
say() { echo "scripts/gpu_check.sh: $*" >&2; }

command -v nvidia-smi >/dev/null \
    || die "nvidia-smi not found: this check needs a host with an NVIDIA GPU and its driver (this machine has none)"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi finds no usable GPU: $(nvidia-smi -L 2>&1 | head -1)"
PY="$repo/.venv/bin/python"
[[ -x "$PY" ]] || die "$PY is missing: run make setup first"
gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
say "GPU: $gpu_name (sm_${cc:-?}, driver $driver)"

# (a) the CUDA libggswarm; the GPU's own architecture is added when 89;90 do not cover it (newer than 90
# runs the PTX of 90, so only older ones need it)
archs="${GGSWARM_CUDA_ARCHS:-89;90}"
if [[ -z "${GGSWARM_CUDA_ARCHS:-}" && -n "$cc" ]] && (( cc < 89 )); then archs="$cc;$archs"; fi
GGSWARM_CUDA_ARCHS="$archs" JOBS="${JOBS:-$(nproc)}" make native-cuda >&2
lib="$repo/native/build-cuda/libggswarm.so"
[[ -f "$lib" ]] || die "make native-cuda did not produce $lib"
# what native/build_cuda.sh found: toolkit root, cuBLAS and the CMake arguments for the same toolkit
# shellcheck source=/dev/null
source "$repo/native/build-cuda/cuda-env.sh"

# (a') llama-cpp-python 0.3.36 with CUDA, from the sdist native/build.sh / build_cuda.sh keep
lcp="$repo/native/build-cuda/llama-cpp-python"
sdist="$repo/native/build/sdist/llama_cpp_python-0.3.36.tar.gz"
if ! compgen -G "$lcp/llama_cpp/lib/libggml-cuda.so*" >/dev/null; then
    [[ -s "$sdist" ]] || die "$sdist is missing (make native-cuda downloads it)"
    say "building llama-cpp-python 0.3.36 with CUDA into $lcp (several minutes)"
    rm -rf "$lcp"
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${cc:-$archs} -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx' $GGSWARM_CUDA_CMAKE_ARGS" \
        "$PY" -m pip install --no-deps --no-cache-dir --target "$lcp" "$sdist" >&2 \
        || die "pip install of llama-cpp-python with CUDA failed"
fi
export PYTHONPATH="$lcp:$repo" GGSWARM_NATIVE_LIB="$lib"
export LD_LIBRARY_PATH="$GGSWARM_CUDA_LIBDIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export GPU_CHECK_NGL="${GPU_CHECK_NGL:--1}"
# a plugin (pytest -p) / import that makes every llama_cpp.Llama offload GPU_CHECK_NGL layers by default
plug="$repo/native/build-cuda/check-py"
mkdir -p "$plug"
cat > "$plug/gpu_check_ngl.py" <<'PY'
import functools, os
import llama_cpp
_init = llama_cpp.Llama.__init__
@functools.wraps(_init)
def _offloaded(self, *a, **kw):
    kw.setdefault("n_gpu_layers", int(os.environ.get("GPU_CHECK_NGL", "-1")))
    _init(self, *a, **kw)
llama_cpp.Llama.__init__ = _offloaded
PY
export PYTHONPATH="$plug:$PYTHONPATH"

# (b) bench/native.py on the GPU: native CUDA (1 and 3 hops) against llama.cpp CUDA
bench_log="$repo/native/build-cuda/gpu-check-bench.log"
say "bench/native.py with GGSWARM_NATIVE_LIB=$lib (log: $bench_log)"
"$PY" -c 'import sys, runpy, gpu_check_ngl; sys.argv = ["bench/native.py"] + sys.argv[1:]; runpy.run_path("bench/native.py", run_name="__main__")' \
    --rounds "${GPU_CHECK_ROUNDS:-5}" --decode-tokens "${GPU_CHECK_DECODE_TOKENS:-64}" 2>&1 | tee "$bench_log" >&2 \
    || die "bench/native.py failed (log: $bench_log)"
pytest_log="$repo/native/build-cuda/gpu-check-pytest.log"
if [[ "${GPU_CHECK_PYTEST:-1}" != 0 ]]; then
    say "tests/native/test_parity.py on the CUDA library (log: $pytest_log)"
    "$PY" -m pytest -q -p gpu_check_ngl tests/native/test_parity.py >"$pytest_log" 2>&1 || true
fi

# (c) one JSON object
GPU_NAME="$gpu_name" GPU_DRIVER="$driver" GPU_CC="$cc" ARCHS="$archs" BENCH_LOG="$bench_log" PYTEST_LOG="$pytest_log" \
"$PY" - <<'PY'
import json, os, re
import llama_cpp
from agent.artifacts.packaged import packaged_model_path
from agent.backends.libggswarm import NativeModel

bench = {}
for line in open(os.environ["BENCH_LOG"]):
    line = line.strip()
    if line.startswith("{"):
        bench = json.loads(line)
m = NativeModel(str(packaged_model_path()), 10, 20, n_threads=2)
native_device = m.device
lib = os.environ["GGSWARM_NATIVE_LIB"]
tally = None
if os.path.exists(os.environ["PYTEST_LOG"]) and os.environ.get("GPU_CHECK_PYTEST", "1") != "0":
    text = open(os.environ["PYTEST_LOG"]).read()
    tally = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text.splitlines()[-1] if text else "")}
ratio = lambda a, b: round(bench[a] / bench[b], 3) if bench.get(a) and bench.get(b) else None
print(json.dumps({
    "gpu": os.environ["GPU_NAME"], "compute_cap": os.environ["GPU_CC"], "driver": os.environ["GPU_DRIVER"],
    "cuda_archs_built": os.environ["ARCHS"], "native_lib": lib, "native_lib_mb": round(os.path.getsize(lib) / 2**20, 1),
    "native_device": native_device, "native_on_gpu": native_device.upper().startswith("CUDA"),
    "llama_cpp_from": os.path.dirname(llama_cpp.__file__),
    "llama_cpp_gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
    "llama_cpp_n_gpu_layers": int(os.environ["GPU_CHECK_NGL"]),
    "parity": {
        "greedy_tokens_equal_llamacpp": bench.get("greedy_tokens_equal_llamacpp"),
        "teacher_forcing_tokens": bench.get("teacher_forcing_tokens"),
        "teacher_forcing_top1_agreement": bench.get("teacher_forcing_top1_agreement"),
        "teacher_forcing_max_abs_logit_diff": bench.get("teacher_forcing_max_abs_logit_diff"),
    },
    "tok_s": {k: bench.get(k) for k in ("decode_tok_s_llamacpp", "decode_tok_s_native_1hop", "decode_tok_s_native_3hop")},
    "ratio_1hop_vs_llamacpp": ratio("decode_tok_s_native_1hop", "decode_tok_s_llamacpp"),
    "ratio_3hop_vs_llamacpp": bench.get("ratio_3hop_vs_llamacpp"),
    "prefill_ms_512": {k: bench.get(k) for k in ("prefill_ms_512_llamacpp", "prefill_ms_512_native_1hop", "prefill_ms_512_native_3hop")},
    "prefill_ratio_3hop": bench.get("prefill_ratio"),
    "step_ms_ctx64": [bench.get("step_ms_ctx64"), bench.get("step_ms_ctx64_llamacpp")],
    "step_ms_ctx2048": [bench.get("step_ms_ctx2048"), bench.get("step_ms_ctx2048_llamacpp")],
    "test_parity": tally,
    "bench": bench,
}))
PY
