#!/usr/bin/env bash
# Build native/build-cuda/libggswarm.so: the layer-window executor on a CUDA-enabled ggml from the same
# pinned llama-cpp-python 0.3.36 sdist as native/build.sh (`make native-cuda`). The CPU build
# (native/build/, native/build.sh) is not touched; only the sdist tarball is shared (native/build/sdist/).
#
# ggml-base, ggml-cpu and ggml-cuda are compiled here (cmake, static, symbols hidden, as native/build.sh's
# own build: OpenMP off, native/patches/*.patch applied, GGML_NATIVE/LLAMAFILE on, AMX off), ggml's
# backend registry (libggml.a, built with GGML_USE_CUDA) registers the CUDA backend statically, so no
# ggml_backend_load_all / GGML_BACKEND_DL is needed: native/src/loader.cpp's init_backends takes ggml's
# first GPU device (CUDA0) when the driver reports one (GGSWARM_DEVICE=CUDA1 or CPU overrides), the CPU
# device stays the scheduler's fallback. The CUDA runtime and cuBLAS are linked shared (libcudart.so.13,
# libcublas.so.13, libcublasLt.so.13; libcuda.so.1 from the driver for VMM), found through an rpath.
#
# Architectures: GGSWARM_CUDA_ARCHS (default "89;90": sm_89 consumer Ada, sm_90 H100/H200, each as
# SASS plus PTX; the PTX of 90 JITs on newer GPUs). FlashAttention kernels stay on (libggswarm's attention
# runs ggml_flash_attn_ext), FA_ALL_QUANTS off (ggml's default K/V type set), NCCL off, CUDA graphs on
# (as llama.cpp builds ggml), no tests or examples.
#
# The toolkit: nvcc from NVCC, else CUDA_HOME/CUDA_PATH/bin, else PATH, else /usr/local/cuda/bin. When
# the toolkit has no cuBLAS (cublas_v2.h + libcublas.so), the matching nvidia-cublas wheel (PyPI:
# nvidia-cublas==<major>.<minor>.* for CUDA >= 13, nvidia-cublas-cu12 for 12) is downloaded once into
# native/build-cuda/deps/ and used from there (GGSWARM_CUDA_FETCH_CUBLAS=0 forbids that). Without a
# libcuda.so (driver, or the toolkit's stubs/) the build sets GGML_CUDA_NO_VMM=ON (ggml's pool then
# grows with cudaMalloc instead of virtual memory; the only use of the driver API).
#
# Environment: PYTHON, CXX, JOBS (ggml build parallelism, default nproc), CMAKE_ARGS (appended, split as
# pip splits them), GGSWARM_CUDA_ARCHS, GGSWARM_CUDA_FETCH_CUBLAS, NVCC. Idempotent: re-running relinks
# and reuses the ggml build while the patches and the configuration are unchanged.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
build="$here/build-cuda"
die() { echo "native/build_cuda.sh: error: $*" >&2; exit 1; }
say() { echo "native/build_cuda.sh: $*"; }

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi
[[ -n "$PYTHON" && -x "$PYTHON" ]] || die "no Python interpreter found (set PYTHON=...)"
CXX="${CXX:-g++}"
command -v "$CXX" >/dev/null || die "C++ compiler '$CXX' not found (apt-get install g++)"
command -v cmake >/dev/null || die "cmake not found (apt-get install cmake)"
command -v patch >/dev/null || die "patch not found (apt-get install patch)"
ARCHS="${GGSWARM_CUDA_ARCHS:-89;90}"

# 1. the CUDA toolkit: nvcc, its version, its root
nvcc="${NVCC:-}"
if [[ -z "$nvcc" ]]; then
    for c in "${CUDA_HOME:-}/bin/nvcc" "${CUDA_PATH:-}/bin/nvcc" "$(command -v nvcc || true)" /usr/local/cuda/bin/nvcc; do
        if [[ -n "$c" && "$c" != /bin/nvcc && -x "$c" ]]; then nvcc="$c"; break; fi
    done
fi
[[ -n "$nvcc" && -x "$nvcc" ]] || die "nvcc not found (install the CUDA toolkit, or set NVCC=/path/to/nvcc or CUDA_HOME)"
cuda_version="$("$nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1)"
[[ -n "$cuda_version" ]] || die "cannot read the CUDA version from '$nvcc --version'"
# the toolkit root: nvcc's own TOP (it sees through wrapper scripts such as /usr/local/bin/nvcc)
cuda_root="$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=\(.*\)$/\1/p' | head -1)"
[[ -n "$cuda_root" && -d "$cuda_root" ]] || cuda_root="$(cd "$(dirname "$(readlink -f "$nvcc")")/.." && pwd)"
cuda_root="$(cd "$cuda_root" && pwd -P)"
nvcc_real="$cuda_root/bin/nvcc"
[[ -x "$nvcc_real" ]] || nvcc_real="$nvcc"
say "CUDA $cuda_version at $cuda_root (nvcc $nvcc_real), architectures $ARCHS"
cuda_major="${cuda_version%%.*}"
(( cuda_major >= 12 )) || die "CUDA $cuda_version is too old for this ggml's sm_89/sm_90 build (need >= 12)"

# find_in NAME DIR...: the first DIR/NAME (or DIR/*/NAME one level down) that exists
find_in() {
    local name="$1" d f; shift
    for d in "$@"; do
        [[ -d "$d" ]] || continue
        for f in "$d/$name" "$d"/*/"$name"; do
            [[ -e "$f" ]] && { echo "$f"; return 0; }
        done
    done
    return 1
}
libdirs=("$cuda_root/lib64" "$cuda_root/lib" "$cuda_root/targets/x86_64-linux/lib")
incdirs=("$cuda_root/include" "$cuda_root/targets/x86_64-linux/include")
cudart="$(find_in libcudart.so "${libdirs[@]}" || find_in libcudart.so.$cuda_major "${libdirs[@]}" || true)"
[[ -n "$cudart" ]] || die "libcudart.so is not in $cuda_root (install the CUDA runtime: nvidia-cuda-runtime or cuda-cudart-dev)"
find_in cuda_runtime.h "${incdirs[@]}" >/dev/null || die "cuda_runtime.h is not in $cuda_root/include"

# 2. cuBLAS: the toolkit's, else the nvidia-cublas wheel's (downloaded once into build-cuda/deps)
cublas_h="$(find_in cublas_v2.h "${incdirs[@]}" || true)"
cublas_so="$(find_in libcublas.so "${libdirs[@]}" || find_in libcublas.so.$cuda_major "${libdirs[@]}" || true)"
cublaslt_so="$(find_in libcublasLt.so "${libdirs[@]}" || find_in libcublasLt.so.$cuda_major "${libdirs[@]}" || true)"
if [[ -z "$cublas_h" || -z "$cublas_so" || -z "$cublaslt_so" ]]; then
    deps="$build/deps"
    if (( cuda_major >= 13 )); then pkg="nvidia-cublas==${cuda_version}.*"; else pkg="nvidia-cublas-cu${cuda_major}==${cuda_version}.*"; fi
    if ! compgen -G "$deps/unpacked/nvidia/*/include/cublas_v2.h" >/dev/null; then
        [[ "${GGSWARM_CUDA_FETCH_CUBLAS:-1}" != 0 ]] \
            || die "cuBLAS (cublas_v2.h, libcublas.so) is not in $cuda_root and GGSWARM_CUDA_FETCH_CUBLAS=0"
        mkdir -p "$deps"
        if ! compgen -G "$deps/nvidia_cublas*.whl" >/dev/null; then
            say "cuBLAS is not in $cuda_root: downloading the $pkg wheel into $deps"
            "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: "$pkg" -d "$deps" \
                || die "pip download $pkg failed (install cuBLAS with the toolkit, e.g. apt-get install libcublas-dev-${cuda_major}-*)"
        fi
        rm -rf "$deps/unpacked"
        "$PYTHON" -m zipfile -e "$(compgen -G "$deps/nvidia_cublas*.whl" | head -1)" "$deps/unpacked" \
            || die "cannot unpack the cuBLAS wheel in $deps"
    fi
    cublas_h="$(compgen -G "$deps/unpacked/nvidia/*/include/cublas_v2.h" | head -1)"
    cublas_so="$(compgen -G "$deps/unpacked/nvidia/*/lib/libcublas.so.*" | head -1)"
    cublaslt_so="$(compgen -G "$deps/unpacked/nvidia/*/lib/libcublasLt.so.*" | head -1)"
    [[ -n "$cublas_h" && -n "$cublas_so" && -n "$cublaslt_so" ]] || die "the cuBLAS wheel in $deps has no cublas_v2.h / libcublas.so / libcublasLt.so"
fi
cublas_inc="$(dirname "$cublas_h")"
say "cuBLAS: $cublas_so ($cublas_inc)"

# 3. the driver library for ggml's VMM pool: libcuda.so (or .so.1) of the driver, else the toolkit's stub
libcuda="${GGSWARM_LIBCUDA:-}"
if [[ -z "$libcuda" ]]; then
    libcuda="$(find_in libcuda.so "${libdirs[@]/%//stubs}" /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib/wsl/lib || true)"
    [[ -n "$libcuda" ]] || libcuda="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF; exit}')"
    [[ -n "$libcuda" ]] || libcuda="$(find_in libcuda.so.1 /usr/lib/x86_64-linux-gnu /usr/lib64 || true)"
fi
if [[ -n "$libcuda" ]]; then
    vmm=(-DGGML_CUDA_NO_VMM=OFF -DCUDA_cuda_driver_LIBRARY="$libcuda")
    say "driver library: $libcuda (VMM pool on)"
else
    vmm=(-DGGML_CUDA_NO_VMM=ON)
    say "no libcuda.so here (no driver, no stubs/): building with GGML_CUDA_NO_VMM=ON"
fi

# what was found, for scripts/gpu_check.sh (a CUDA llama-cpp-python on the same toolkit and cuBLAS)
mkdir -p "$build"
cmake_cuda=(-DCMAKE_CUDA_COMPILER="$nvcc_real" -DCUDAToolkit_ROOT="$cuda_root" -DCMAKE_CUDA_FLAGS="-I$cublas_inc"
    -DCUDA_cublas_LIBRARY="$cublas_so" -DCUDA_cublasLt_LIBRARY="$cublaslt_so" "${vmm[@]}")
{
    echo "# written by native/build_cuda.sh; sourced by scripts/gpu_check.sh"
    echo "GGSWARM_CUDA_ROOT=$(printf '%q' "$cuda_root")"
    echo "GGSWARM_CUDA_LIBDIRS=$(printf '%q' "$(dirname "$cudart"):$(dirname "$cublas_so")")"
    echo "GGSWARM_CUDA_CMAKE_ARGS=$(printf '%q' "${cmake_cuda[*]}")"
} > "$build/cuda-env.sh"

# 4. ggml's sources from the shared sdist (native/build/sdist, downloaded by native/build.sh or here)
sdist_dir="$here/build/sdist"
sdist="$sdist_dir/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [[ ! -s "$sdist" ]]; then
    mkdir -p "$sdist_dir"
    say "downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$sdist_dir" \
        || die "pip download of the llama-cpp-python sdist failed"
    [[ -s "$sdist" ]] || die "expected $sdist after pip download"
fi
src="$build/ggml-src"
shopt -s nullglob
patches=("$here"/patches/*.patch)
shopt -u nullglob
# the patches change ggml-cpu only (barrier, kickoff, transposed copies): the CUDA build keeps ggml-cpu as the
# scheduler's fallback device and for CPU-only hosts (GGSWARM_DEVICE=CPU), so they apply here as well
stamp="$(cat /dev/null ${patches[@]+"${patches[@]}"} | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$src/CMakeLists.txt" || "$(cat "$src/.ggswarm-patches" 2>/dev/null)" != "$stamp" ]]; then
    mkdir -p "$build"
    rm -rf "$build/ggml-build" "$build/extract" "$src"
    mkdir -p "$build/extract"
    tar -xzf "$sdist" -C "$build/extract" --wildcards "*/vendor/llama.cpp/ggml/*" || die "cannot extract ggml from $sdist"
    mv "$build/extract"/llama_cpp_python-*/vendor/llama.cpp/ggml "$src"
    rm -rf "$build/extract"
    touch "$src/ggml.pc.in"  # not in the sdist; ggml's standalone configure wants it
    for p in ${patches[@]+"${patches[@]}"}; do
        patch -s -p1 -d "$src" < "$p" || die "patch $p does not apply to the sdist's ggml"
    done
    echo "$stamp" > "$src/.ggswarm-patches"
fi

# 5. configure and build ggml (CPU flags as native/build.sh: the CPU fallback stays bit-exact with it)
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
mapfile -t extra < <("$PYTHON" -c 'import os, shlex; [print(a) for a in shlex.split(os.environ.get("CMAKE_ARGS", ""))]')
cmake -S "$src" -B "$build/ggml-build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DGGML_OPENMP=OFF -DGGML_CPU=ON -DGGML_NATIVE=ON \
    -DGGML_LLAMAFILE=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx -I$cublas_inc" \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" "${cmake_cuda[@]}" \
    -DGGML_CUDA_FA=ON -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_GRAPHS=ON \
    ${extra[@]+"${extra[@]}"} >"$build/ggml-configure.log" 2>&1 \
    || { tail -n 40 "$build/ggml-configure.log" >&2; die "cmake configure of the CUDA ggml failed (log: $build/ggml-configure.log)"; }
say "building ggml with CUDA (-j ${JOBS:-$(nproc)}; log: $build/ggml-build.log)"
if ! cmake --build "$build/ggml-build" -j "${JOBS:-$(nproc)}" >"$build/ggml-build.log" 2>&1; then
    tail -n 40 "$build/ggml-build.log" >&2
    die "ggml build failed (whole log: $build/ggml-build.log)"
fi

# 6. libggswarm on it: the same sources and flags as the CPU build, plus libggml-cuda.a and the runtime
a="$build/ggml-build/src"
cuda_a="$(find_in libggml-cuda.a "$a" || true)"
[[ -n "$cuda_a" ]] || die "libggml-cuda.a is missing under $a"
rt=(-L"$(dirname "$cudart")" -lcudart -Wl,-rpath,"$(dirname "$cudart")"
    "$cublas_so" "$cublaslt_so" -Wl,-rpath,"$(dirname "$cublas_so")")
[[ -n "$libcuda" ]] && rt+=("$libcuda")
out="$build/libggswarm.so"
tmp="$build/libggswarm.so.tmp.$$"
"$CXX" -std=c++17 -O3 -DNDEBUG -fPIC -shared -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter \
    -DGGSWARM_OWN_THREADPOOL -I"$here/include" -I"$here/src" -I"$src/include" \
    "$here"/src/*.cpp "$here"/src/archs/*.cpp \
    "$a/libggml.a" "$a/libggml-cpu.a" "$cuda_a" "$a/libggml-base.a" -Wl,--exclude-libs,ALL -Wl,--no-undefined \
    "${rt[@]}" -lcrypto -lpthread -lm -ldl -lrt -o "$tmp" || { rm -f "$tmp"; die "compilation failed"; }
if nm -D --defined-only "$tmp" | awk '{print $3}' | grep -qE '^(ggml|gguf)_'; then
    rm -f "$tmp"; die "the library exports ggml symbols"
fi
if readelf -d "$tmp" | grep -E 'NEEDED' | grep -qE 'libggml|libgomp'; then
    rm -f "$tmp"; die "the library needs a shared ggml or libgomp"
fi
readelf -d "$tmp" | grep -q 'libcudart' || { rm -f "$tmp"; die "the library does not link the CUDA runtime"; }
mv -f "$tmp" "$out"
say "built $out ($(du -h "$out" | cut -f1); ggml-cuda archive $(du -h "$cuda_a" | cut -f1); CUDA $cuda_version, sm $ARCHS)"
