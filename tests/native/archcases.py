"""The conformance suite's cases, one per row of agent/artifacts/archtable.py (its tiny file and 3-hop
split), plus the real files a package ships and the variants a row's facts do not cover (qwen3 without
YaRN beside qwen3moe with it). test_archs.py (against llama.cpp) and test_archs_state.py (what a route
does with a session's state) run every case."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.artifacts import archtable
from agent.artifacts.manifest import build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.artifacts.tiny import write_suite_gguf
from agent.backends.base import Backend, ShardSpec
from agent.wire.ids import SessionId

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "tests" / "data" / "teacher_forcing_en.txt"
# Same ggml ops in the same order as llama.cpp, weights in the same buffer types (repacked where
# llama.cpp repacks them): the logits come out equal (max |diff| 0.0 in every run so far); the bound
# leaves room for a ggml build that reorders a reduction.
MAX_LOGIT_DIFF = 1e-3


@dataclass(frozen=True)
class Case:
    """One architecture's model file and its 3-hop split."""

    name: str
    arch: str
    model: Callable[[Path], str]
    splits: archtable.Splits
    chunk_exact: bool = True
    tiny: bool = True  # a tiny random-weight file (else a real one a package ships)


def _packaged(name: str) -> Callable[[Path], str]:
    def get(_: Path) -> str:
        try:
            return str(packaged_model_path(name))
        except ModelNotFound as e:
            pytest.skip(str(e))

    return get


def _suite_file(arch: str, **overrides: object) -> Callable[[Path], str]:
    return lambda d: str(write_suite_gguf(arch, d, **overrides))


def _cases() -> list[Case]:
    out = []
    for a in archtable.ARCHITECTURES:
        s = a.suite
        out.append(Case(a.name, a.name, _suite_file(a.name), s.splits, s.chunk_exact))
        if a.packaged is not None:
            name, splits = a.packaged
            real = _packaged(name)
            out.append(Case(f"{a.name}-{name}", a.name, real, splits, a.packaged_chunk_exact, tiny=False))
    # the row's qwen3moe declares YaRN (its 128K files); plain RoPE and YaRN on the dense qwen3 too
    yarn = archtable.BY_NAME["qwen3moe"].suite.tiny_options
    out.append(
        Case("qwen3-yarn", "qwen3", _suite_file("qwen3", **yarn), archtable.BY_NAME["qwen3"].suite.splits)
    )
    return out


CASES = _cases()


def backend_hops(gguf: str, splits: archtable.Splits, **options: object) -> list[Backend]:
    """A NativeBackend per window of `splits` (2 threads; `options`: the backend's, e.g. flash_attn)."""
    from agent.backends.native import NativeBackend

    manifest = build_manifest(gguf, hash_tensors=False)
    return [NativeBackend(ShardSpec(gguf, a, b, manifest, n_threads=2), **options) for a, b in splits]  # type: ignore[arg-type]


def sid_of(n: int) -> SessionId:
    return SessionId(n.to_bytes(16, "little"))


def open_route(hops: list[Backend], sid: SessionId, capacity: int = 512) -> None:
    for h in hops:
        h.open_session(sid, capacity)


def close_route(hops: list[Backend], sid: SessionId) -> None:
    for h in hops:
        h.close_session(sid)
