"""The window graph is cached by shape, not by session: sessions taking turns share it, tokens unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import Manifest
from agent.backends.base import ShardSpec, StepInput
from agent.backends.libggswarm import KERNEL_PAD, KV_PAD, NativeModel, padded_kv
from agent.backends.native import NativeBackend
from agent.wire.ids import SessionId
from tests.native.tiny_gguf import write_tiny_gguf

# two prompts of one length (so one prefill shape), different tokens (so a mixed-up KV would show)
PROMPTS = (
    ([1, 9690, 198, 2683, 359, 253, 5356, 5646, 504, 3575, 282, 4649, 314] * 5)[:58],
    list(range(400, 458)),
)
STEPS = 12  # decode positions 58..69: the kernels' span crosses 64, ggml's stays within 256


def _sid(n: int) -> SessionId:
    return SessionId(bytes([n]) * 16)


@pytest.fixture
def shard(native_lib: None, model_path: str, manifest: Manifest) -> Iterator[NativeBackend]:
    be = NativeBackend(ShardSpec(model_path, 0, 30, manifest, n_threads=2))
    yield be
    be.close()


def _spans(shard: NativeBackend, start: int, steps: int) -> set[int]:
    """The attended spans of decode steps at positions start .. start + steps - 1 (cache of 256)."""
    pad = KERNEL_PAD if shard.model.decode_kernels else KV_PAD
    return {min(padded_kv(start + i + 1, pad), 256) for i in range(steps)}


def _alone(model_path: str, manifest: Manifest, prompt: list[int]) -> list[int]:
    be = NativeBackend(ShardSpec(model_path, 0, 30, manifest, n_threads=2))
    sid = _sid(99)
    be.open_session(sid, 256)
    out = [be.forward(StepInput(sid, 0, token_ids=np.asarray(prompt))).token]
    for i in range(STEPS):
        out.append(be.forward(StepInput(sid, len(prompt) + i, token_ids=np.asarray(out[-1:]))).token)
    be.close()
    return out


def test_two_sessions_alternating_decode_steps_build_each_shape_once_and_keep_their_tokens(
    shard: NativeBackend, model_path: str, manifest: Manifest
) -> None:
    want = [_alone(model_path, manifest, p) for p in PROMPTS]
    a, b = _sid(1), _sid(2)
    for sid in (a, b):
        shard.open_session(sid, 256)
    before = shard.graph_builds
    got = [
        [shard.forward(StepInput(sid, 0, token_ids=np.asarray(p))).token]
        for sid, p in zip((a, b), PROMPTS, strict=True)
    ]
    assert shard.graph_builds == before + 1  # one prefill shape, both sessions
    for i in range(STEPS):
        for out, sid in zip(got, (a, b), strict=True):
            out.append(
                shard.forward(StepInput(sid, len(PROMPTS[0]) + i, token_ids=np.asarray(out[-1:]))).token
            )
    assert got == want
    # one graph per attended span the steps went through (the cache holds 256 positions throughout)
    assert shard.graph_builds == before + 1 + len(_spans(shard, len(PROMPTS[0]), STEPS))
    for sid in (a, b):
        shard.close_session(sid)


def test_sessions_of_different_lengths_taking_turns_build_each_of_their_shapes_once(
    shard: NativeBackend, model_path: str, manifest: Manifest
) -> None:
    prompts = PROMPTS[0], PROMPTS[1][:40]  # their decode steps attend different spans with the kernels
    want = [_alone(model_path, manifest, p) for p in prompts]
    a, b = _sid(3), _sid(4)
    for sid in (a, b):
        shard.open_session(sid, 256)
    before = shard.graph_builds
    got = [
        [shard.forward(StepInput(sid, 0, token_ids=np.asarray(p))).token]
        for sid, p in zip((a, b), prompts, strict=True)
    ]
    assert shard.graph_builds == before + 2  # two prefill shapes
    for i in range(STEPS):
        for out, sid, p in zip(got, (a, b), prompts, strict=True):
            out.append(shard.forward(StepInput(sid, len(p) + i, token_ids=np.asarray(out[-1:]))).token)
    assert got == want
    shapes = _spans(shard, len(prompts[0]), STEPS) | _spans(shard, len(prompts[1]), STEPS)
    assert shard.graph_builds == before + 2 + len(shapes)
    for sid in (a, b):
        shard.close_session(sid)


def test_sessions_of_different_capacities_get_their_own_graphs_and_their_own_cache(
    native_lib: None, tmp_path: Path
) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", context=4096)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with NativeModel(path, 0, 3, n_threads=1) as ref, NativeModel(path, 0, 3, n_threads=1) as m:
        r = ref.open_session(64)
        want = [ref.forward(r, 0, token_ids=ids)["token"]]
        small, large = m.open_session(64), m.open_session(1024)
        m.forward(large, 0, token_ids=[7] * 300)  # grows its cache to 512 positions
        m.truncate(large, 0)  # (the capacity stays)
        got = {
            small: [m.forward(small, 0, token_ids=ids)["token"]],
            large: [m.forward(large, 0, token_ids=ids)["token"]],
        }
        builds = m.graph_builds
        for i in range(6):
            want.append(ref.forward(r, 8 + i, token_ids=want[-1:])["token"])
            for sid in (small, large):
                got[sid].append(m.forward(sid, 8 + i, token_ids=got[sid][-1:])["token"])
        assert m.graph_builds == builds + 2  # one decode graph per cache size, each built once
    assert got[small] == got[large] == want  # each read and wrote its own cache
