"""Finding and loading libggswarm.so: its API version, status codes and limits, and the errors its calls raise."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from pathlib import Path

from agent.backends.ggswarm_abi import bind
from agent.defaults import env_int

GGSWARM_API_VERSION = 18

GGSWARM_OK = 0
GGSWARM_E_INVALID_ARG = -1
GGSWARM_E_IO = -2
GGSWARM_E_FORMAT = -3
GGSWARM_E_UNSUPPORTED = -4
GGSWARM_E_RANGE = -5
GGSWARM_E_BUDGET = -6
GGSWARM_E_NO_SESSION = -7
GGSWARM_E_COMPUTE = -8
GGSWARM_E_MISMATCH = -9
GGSWARM_E_NO_MEMORY = -10

STATUS_NAMES = {
    GGSWARM_E_INVALID_ARG: "invalid_arg",
    GGSWARM_E_IO: "io",
    GGSWARM_E_FORMAT: "format",
    GGSWARM_E_UNSUPPORTED: "unsupported",
    GGSWARM_E_RANGE: "range",
    GGSWARM_E_BUDGET: "budget",
    GGSWARM_E_NO_SESSION: "no_session",
    GGSWARM_E_COMPUTE: "compute",
    GGSWARM_E_MISMATCH: "mismatch",
    GGSWARM_E_NO_MEMORY: "no_memory",
}

GGSWARM_TYPE_F32 = 0
GGSWARM_TYPE_F16 = 1
GGSWARM_TYPE_Q8_0 = 2
GGSWARM_TYPE_Q4_0 = 3
GGSWARM_MAX_CONTEXT = 131072
GGSWARM_MAX_BATCH = 4096
GGSWARM_MAX_STEPS = 256  # steps (sessions) per ggswarm_forward_many call
# ggml's attention spans the cached positions rounded up to this (kKvPad in native/src/kv.cpp, as in
# llama.cpp); the CPU decode kernels read them rounded up to KERNEL_PAD only. For the work a step does
# (bench/native.py); KV bytes are the library's to say (NativeModel.growth_bytes, NativeBudget).
KV_PAD = 256
KERNEL_PAD = 64
# The own-ggml build's barrier (native/patches/ggml-barrier-futex.patch) reads these when a model's
# threadpool is made: relax rounds, then sched_yield rounds, before a waiter sleeps on a futex. ggml
# reads them with atoi, which takes garbage as 0, so serving commands check them first.
BARRIER_ENV = ("GGSWARM_BARRIER_SPIN", "GGSWARM_BARRIER_YIELD")
BARRIER_ENV_MAX = 100_000_000
# Windows whose weights are under this many bytes run one-row steps on one thread (graph.cpp
# compute_graph; 0: never); read with strtoull, which takes garbage as 0 and "-1" as 2**64 - 1.
ONE_THREAD_ENV = "GGSWARM_ONE_THREAD_BYTES"
ONE_THREAD_ENV_MAX = 1 << 40


def check_barrier_env(env: Mapping[str, str] | None = None) -> None:
    """ValueError unless each of BARRIER_ENV that is set is an integer in 0..BARRIER_ENV_MAX, and
    ONE_THREAD_ENV one in 0..ONE_THREAD_ENV_MAX."""
    for name in BARRIER_ENV:
        env_int(name, 0, BARRIER_ENV_MAX, env)
    env_int(ONE_THREAD_ENV, 0, ONE_THREAD_ENV_MAX, env)


def padded_kv(n_positions: int, pad: int = KV_PAD) -> int:
    """Positions ggml's attention reads for `n_positions` cached ones; with pad=KERNEL_PAD, those a
    decode step with the CPU kernels reads."""
    return -(-int(n_positions) // pad) * pad


DEFAULT_LIB = Path(__file__).resolve().parents[2] / "native" / "build" / "libggswarm.so"
# Where an installed wheel carries it (scripts/build_agent_wheel.py).
PACKAGED_LIB = Path(__file__).resolve().parents[1] / "_native" / "libggswarm.so"
# llama-cpp-python's ggml, in dependency order; libggswarm links them by soname.
GGML_LIBS = ("libggml-base.so.0", "libggml-cpu.so.0", "libggml.so.0")


# ggswarm_session_truncate_to's out_kind (GGSWARM_TRUNCATE_*)
TRUNCATE_KINDS = {0: "exact", 1: "checkpoint", 2: "from_zero"}


class NativeError(Exception):
    """A libggswarm call failed; `status` is the C return code, the message comes from the library."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def kind(self) -> str:
        return STATUS_NAMES.get(self.status, f"status {self.status}")


_lib: ctypes.CDLL | None = None
_load_error: str | None = None


def library_path() -> Path:
    """Where the shared library is looked for: env GGSWARM_NATIVE_LIB, else the checkout's build
    output, else the copy an installed wheel carries."""
    env = os.environ.get("GGSWARM_NATIVE_LIB")
    if env:
        return Path(env)
    return DEFAULT_LIB if DEFAULT_LIB.is_file() or not PACKAGED_LIB.is_file() else PACKAGED_LIB


def ggml_lib_dir() -> Path | None:
    """llama-cpp-python's lib/ directory (its ggml shared libraries), found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return d if d.is_dir() else None


def _preload_ggml() -> None:
    """Load llama-cpp-python's ggml by path before libggswarm, so its sonames resolve to them.

    native/build.sh links with an absolute rpath to the venv it was built in; an installed wheel
    lives in another venv, where that path does not exist (or holds another copy). A library
    already loaded under a soname satisfies a later NEEDED entry of that soname, so loading these
    first (RTLD_GLOBAL, so their symbols are shared) makes the rpath irrelevant.
    """
    d = ggml_lib_dir()
    if d is None:
        return  # the rpath may still find them; load_library reports what is missing
    for name in GGML_LIBS:
        if (d / name).exists():
            ctypes.CDLL(str(d / name), mode=ctypes.RTLD_GLOBAL)


def load_library() -> ctypes.CDLL:
    """Load and bind libggswarm once; raises OSError with the reason when it cannot be used."""
    global _lib, _load_error
    if _lib is not None:
        return _lib
    path = library_path()
    if not path.is_file():
        _load_error = f"{path} is not built (run `bash native/build.sh`)"
        raise OSError(_load_error)
    _preload_ggml()
    # a ggml assertion aborts the process; its default backtrace attaches gdb, which can hang the node
    # instead of letting it exit (and its supervisor restart it)
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    lib = ctypes.CDLL(str(path))
    bind(lib)
    version = lib.ggswarm_api_version()
    if version != GGSWARM_API_VERSION:
        _load_error = f"{path} has API version {version}; this binding speaks {GGSWARM_API_VERSION}"
        raise OSError(_load_error)
    _lib = lib
    return lib


def is_available() -> bool:
    """Whether the native library is built and loadable with a matching API version."""
    try:
        load_library()
    except OSError:
        return False
    return True


def check_file(path: str | os.PathLike[str]) -> str:
    """Why the executor would refuse to open `path` ("" when it opens it): its header, hyper-parameters
    and every layer's tensor table, checked from the metadata alone (ggswarm_check_file)."""
    lib = load_library()
    st = lib.ggswarm_check_file(os.fsencode(path))
    if st == GGSWARM_OK:
        return ""
    return (lib.ggswarm_last_error() or b"").decode("utf-8", "replace") or f"libggswarm status {st}"


def check_status(status: int, message: bytes | None) -> None:
    """NativeError unless `status` is GGSWARM_OK."""
    if status != GGSWARM_OK:
        raise NativeError(
            status, (message or b"").decode("utf-8", "replace") or f"libggswarm status {status}"
        )
