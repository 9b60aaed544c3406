#!/usr/bin/env bash
# Build native/build/libggswarm.so, the layer-window executor, on the ggml of llama-cpp-python 0.3.36.
#
# Default (GGSWARM_GGML=own): self-contained. ggml-base and ggml-cpu are compiled here from the matching
# llama-cpp-python sdist's sources (downloaded once into native/build/, git-ignored; cmake, about 1-2.5
# minutes on 2 cores, reused after) with OpenMP off and native/patches/*.patch applied, linked statically
# with their symbols hidden (the copy cannot clash with llama_cpp's ggml in the same process). Each model
# owns a ggml threadpool that does not poll between graphs (-DGGSWARM_OWN_THREADPOOL), and the patched
# barrier inside a graph spins 500 rounds, yields 20 times, then sleeps on a futex
# (GGSWARM_BARRIER_SPIN / GGSWARM_BARRIER_YIELD): an idle hop leaves the cores to the hop that computes,
# and hops computing at once on fewer cores than threads do not burn the core a preempted peer needs.
# Measured against the shared build in docs/benchmarks-log.md ("Own ggml with a sleeping barrier"). The CPU
# flags are those llama-cpp-python is built with, so the logits stay bit-exact with llama.cpp:
# GGML_NATIVE=ON (its default, -march=native), LLAMAFILE on, AMX off (scripts/setup.sh), then CMAKE_ARGS
# as pip got them.
#
# Opt-in GGSWARM_GGML=shared: link llama_cpp's own shared libggml*.so (built with OpenMP; GPU backends if
# llama-cpp-python was built with them) through an rpath; only the headers come from the sdist. Either
# build writes native/build/libggswarm.so.
#
# Environment: GGSWARM_GGML (own | shared), PYTHON (default: <repo>/.venv/bin/python, else python3), CXX
# (default: g++), JOBS (the ggml build's parallelism, default nproc), CMAKE_ARGS. Idempotent: re-running
# relinks the library and reuses the sdist (and the ggml build while the patches are unchanged).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
build="$here/build"
die() { echo "native/build.sh: error: $*" >&2; exit 1; }

PYTHON="${PYTHON:-}"
if [[ -z "$PYTHON" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON="$(command -v python3 || true)"; fi
fi
[[ -n "$PYTHON" && -x "$PYTHON" ]] || die "no Python interpreter found (set PYTHON=...)"
CXX="${CXX:-g++}"
command -v "$CXX" >/dev/null || die "C++ compiler '$CXX' not found (apt-get install g++)"

# 1. the installed llama-cpp-python and its ggml shared libraries. The own build needs neither (its ggml
# comes from the pinned sdist): scripts/setup.sh starts it while pip is still installing, and a
# llama-cpp-python already installed must be the pinned one.
GGSWARM_GGML="${GGSWARM_GGML:-own}"
[[ "$GGSWARM_GGML" == shared || "$GGSWARM_GGML" == own ]] || die "GGSWARM_GGML must be 'shared' or 'own', got '$GGSWARM_GGML'"
info="$("$PYTHON" - <<'PY'
import importlib.metadata as md, importlib.util, os, sys
spec = importlib.util.find_spec("llama_cpp")
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)  # not installed: the own build goes on with the pinned version, the shared one stops below
print(md.version("llama-cpp-python"))
print(os.path.join(list(spec.submodule_search_locations)[0], "lib"))
PY
)" || { [[ "$GGSWARM_GGML" == own ]] && info="$LLAMA_CPP_PYTHON_VERSION"; } \
   || die "cannot locate llama_cpp with $PYTHON: install llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION first"
version="$(sed -n 1p <<<"$info")"
libdir="$(sed -n 2p <<<"$info")"
[[ "$version" == "$LLAMA_CPP_PYTHON_VERSION" ]] || die "llama-cpp-python $version is installed; this build needs $LLAMA_CPP_PYTHON_VERSION"
if [[ "$GGSWARM_GGML" == shared ]]; then
    for lib in libggml.so libggml-base.so libggml-cpu.so; do
        [[ -e "$libdir/$lib" ]] || die "$libdir/$lib is missing (was llama-cpp-python built with shared ggml?)"
    done
fi

# 2. ggml headers from the matching sdist
mkdir -p "$build/sdist"
sdist="$build/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [[ ! -s "$sdist" ]]; then
    echo "native/build.sh: downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    # --no-binary for this package only: with :all: pip also builds the sdist's build backends from
    # source to read its metadata (setuptools, hatchling, scikit-build-core...: ~30 s on 2 cores)
    "$PYTHON" -m pip download --quiet --no-binary llama-cpp-python --no-deps \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$build/sdist" \
        || die "pip download of the llama-cpp-python sdist failed"
    [[ -s "$sdist" ]] || die "expected $sdist after pip download"
fi
# extract_sdist SUBDIR DEST: the sdist's vendor/llama.cpp/SUBDIR as DEST (replaced whole)
extract_sdist() {
    local tmp="$build/extract"
    rm -rf "$tmp" "$2"
    mkdir -p "$tmp"
    tar -xzf "$sdist" -C "$tmp" --wildcards "*/vendor/llama.cpp/$1/*" || die "cannot extract $1 from $sdist"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp/"$1" "$2"
    rm -rf "$tmp"
}
inc="$build/ggml-include"
[[ -f "$inc/ggml-backend.h" ]] || extract_sdist ggml/include "$inc"

# 3'. GGSWARM_GGML=own (default): our own static, OpenMP-free, patched ggml, then libggswarm with it
if [[ "$GGSWARM_GGML" == own ]]; then
    command -v cmake >/dev/null || die "cmake not found (apt-get install cmake)"
    command -v patch >/dev/null || die "patch not found (apt-get install patch)"
    own="$build/own"
    src="$own/ggml-src"
    # native/patches/*.patch change ggml-cpu's sources (the barrier's futex sleep, the one-thread kickoff,
    # the tiled copy of a transposed view); a changed patch set re-extracts and rebuilds from clean sources
    shopt -s nullglob
    patches=("$here"/patches/*.patch)
    shopt -u nullglob
    stamp="$(cat /dev/null ${patches[@]+"${patches[@]}"} | sha256sum | cut -d' ' -f1)"
    if [[ ! -f "$src/CMakeLists.txt" || "$(cat "$src/.ggswarm-patches" 2>/dev/null)" != "$stamp" ]]; then
        mkdir -p "$own"
        rm -rf "$own/ggml-build"
        extract_sdist ggml "$src"
        touch "$src/ggml.pc.in"  # not in the sdist; ggml's standalone configure wants it
        for p in ${patches[@]+"${patches[@]}"}; do
            patch -s -p1 -d "$src" < "$p" || die "patch $p does not apply to the sdist's ggml"
        done
        echo "$stamp" > "$src/.ggswarm-patches"
    fi
    # LLAMAFILE on: llama.cpp's CMakeLists makes that the default for the ggml it builds, the
    # standalone ggml does not. AMX off as scripts/setup.sh builds llama-cpp-python. CMAKE_ARGS last,
    # split as pip splits them (shell quoting: setup.sh's hold quoted flag lists).
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    # (less llama-cpp-python's own options, which ggml's CMakeLists does not know)
    mapfile -t extra < <("$PYTHON" -c 'import os, shlex; [print(a) for a in shlex.split(os.environ.get("CMAKE_ARGS", "")) if not a.startswith("-DLLAVA_")]')
    cmake -S "$src" -B "$own/ggml-build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DGGML_OPENMP=OFF -DGGML_CPU=ON -DGGML_NATIVE=ON \
        -DGGML_LLAMAFILE=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF \
        -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" ${extra[@]+"${extra[@]}"} >/dev/null \
        || die "cmake configure of ggml failed"
    # ggml's own compiler warnings (thousands of lines) go to a log, shown only when the build fails
    if ! cmake --build "$own/ggml-build" -j "${JOBS:-$(nproc)}" >"$own/ggml-build.log" 2>&1; then
        tail -n 40 "$own/ggml-build.log" >&2
        die "ggml build failed (whole log: $own/ggml-build.log)"
    fi
    a="$own/ggml-build/src"
    out="$build/libggswarm.so"
    tmp="$build/libggswarm.so.tmp.$$"
    cxxflags=(-std=c++17 -O3 -DNDEBUG -fPIC -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter
        -DGGSWARM_OWN_THREADPOOL -I"$here/include" -I"$here/src" -I"$src/include")
    # Rebuilt only when what it is made of changed (sources, headers, flags, compiler, the static
    # ggml): `make setup` runs twice in CI (setup, then test's own setup) and before every local test run.
    lib_stamp="$( { cat "$here"/include/*.h "$here"/src/*.h "$here"/src/*.cpp "$here"/src/archs/*.h "$here"/src/archs/*.cpp \
        "$a/libggml.a" "$a/libggml-cpu.a" "$a/libggml-base.a"; echo "${cxxflags[*]}"; "$CXX" --version; } | sha256sum | cut -d' ' -f1)"
    if [[ -f "$out" && "$(cat "$out.stamp" 2>/dev/null)" == "$lib_stamp" ]]; then
        echo "native/build.sh: $out is up to date"
        exit 0
    fi
    # one object per source, compiled in parallel (one g++ over all sources used a single core)
    objs="$build/obj"
    rm -rf "$objs" && mkdir -p "$objs"
    export CXX objs
    printf '%s\n' "$here"/src/*.cpp "$here"/src/archs/*.cpp \
        | xargs -P "${JOBS:-$(nproc)}" -I{} sh -c 'f=$1; shift; exec "$CXX" "$@" -c "$f" -o "$objs/$(basename "$(dirname "$f")")_$(basename "$f" .cpp).o"' sh {} "${cxxflags[@]}" \
        || die "compilation failed"
    "$CXX" -shared "$objs"/*.o \
        "$a/libggml.a" "$a/libggml-cpu.a" "$a/libggml-base.a" -Wl,--exclude-libs,ALL -Wl,--no-undefined \
        -lcrypto -lpthread -lm -ldl -o "$tmp" || { rm -f "$tmp"; die "linking failed"; }
    # self-contained: no ggml symbol exported, no libggml*.so or libgomp needed
    if nm -D --defined-only "$tmp" | awk '{print $3}' | grep -qE '^(ggml|gguf)_'; then
        rm -f "$tmp"; die "the library exports ggml symbols"
    fi
    if readelf -d "$tmp" | grep -E 'NEEDED' | grep -qE 'libggml|libgomp'; then
        rm -f "$tmp"; die "the library needs a shared ggml or libgomp"
    fi
    mv -f "$tmp" "$out"
    echo "$lib_stamp" > "$out.stamp"
    echo "native/build.sh: built $out (its own static ggml: OpenMP off, threadpool without polling, sleeping barrier)"
    exit 0
fi

# 3. GGSWARM_GGML=shared (opt-in): compile and link against llama_cpp's libggml*.so (to a temporary name, then move)
out="$build/libggswarm.so"
tmp="$build/libggswarm.so.tmp.$$"
"$CXX" -std=c++17 -O3 -DNDEBUG -fPIC -shared -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter \
    -I"$here/include" -I"$here/src" -I"$inc" \
    "$here"/src/*.cpp "$here"/src/archs/*.cpp \
    -L"$libdir" -l:libggml.so -l:libggml-base.so -l:libggml-cpu.so \
    -Wl,-rpath,"$libdir" -Wl,--no-undefined -lcrypto -lpthread \
    -o "$tmp" || { rm -f "$tmp"; die "compilation failed"; }
mv -f "$tmp" "$out"
echo "native/build.sh: built $out (ggml from $libdir)"
