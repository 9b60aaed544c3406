#!/usr/bin/env bash
# Build native/build/libggswarm.so against the ggml that the installed llama-cpp-python ships.
#
# Headers come from the matching llama-cpp-python sdist (downloaded once into native/build/, which is
# git-ignored); the shared libraries (libggml, libggml-base, libggml-cpu) are the ones inside the
# installed llama_cpp package, found at run time through an rpath. Idempotent: re-running rebuilds the
# library and reuses the downloaded sdist.
#
# Environment: PYTHON (default: <repo>/.venv/bin/python, else python3), CXX (default: g++).
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

# 1. the installed llama-cpp-python and its ggml shared libraries
info="$("$PYTHON" - <<'PY'
import importlib.metadata as md, importlib.util, os, sys
spec = importlib.util.find_spec("llama_cpp")
if spec is None or not spec.submodule_search_locations:
    sys.exit("llama-cpp-python is not installed in this interpreter")
print(md.version("llama-cpp-python"))
print(os.path.join(list(spec.submodule_search_locations)[0], "lib"))
PY
)" || die "cannot locate llama_cpp with $PYTHON: install llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION first"
version="$(sed -n 1p <<<"$info")"
libdir="$(sed -n 2p <<<"$info")"
[[ "$version" == "$LLAMA_CPP_PYTHON_VERSION" ]] || die "llama-cpp-python $version is installed; this build needs $LLAMA_CPP_PYTHON_VERSION"
for lib in libggml.so libggml-base.so libggml-cpu.so; do
    [[ -e "$libdir/$lib" ]] || die "$libdir/$lib is missing (was llama-cpp-python built with shared ggml?)"
done

# 2. ggml headers from the matching sdist
mkdir -p "$build/sdist"
sdist="$build/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [[ ! -s "$sdist" ]]; then
    echo "native/build.sh: downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (headers only are used)"
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$build/sdist" \
        || die "pip download of the llama-cpp-python sdist failed"
    [[ -s "$sdist" ]] || die "expected $sdist after pip download"
fi
inc="$build/ggml-include"
if [[ ! -f "$inc/ggml-backend.h" ]]; then
    rm -rf "$build/extract" "$inc"
    mkdir -p "$build/extract"
    tar -xzf "$sdist" -C "$build/extract" --wildcards "*/vendor/llama.cpp/ggml/include/*" \
        || die "cannot extract ggml headers from $sdist"
    mv "$build/extract"/llama_cpp_python-*/vendor/llama.cpp/ggml/include "$inc"
    rm -rf "$build/extract"
fi

# 3. compile and link (to a temporary name, then move into place)
out="$build/libggswarm.so"
tmp="$build/libggswarm.so.tmp.$$"
"$CXX" -std=c++17 -O3 -DNDEBUG -fPIC -shared -fvisibility=hidden -Wall -Wextra -Wno-unused-parameter \
    -I"$here/include" -I"$here/src" -I"$inc" \
    "$here"/src/*.cpp "$here"/src/archs/*.cpp \
    -L"$libdir" -l:libggml.so -l:libggml-base.so -l:libggml-cpu.so \
    -Wl,-rpath,"$libdir" -Wl,--no-undefined \
    -o "$tmp" || { rm -f "$tmp"; die "compilation failed"; }
mv -f "$tmp" "$out"
echo "native/build.sh: built $out (ggml from $libdir)"
