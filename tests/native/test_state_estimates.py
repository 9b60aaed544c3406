"""The manifest's per-layer state estimate (placement, audits, the hand-off size bound) matches what the
native executor really keeps: a snapshot of n positions of a window is the manifest's figure, give or
take the snapshot's headers, for every state kind (f16 KV, gemma3's sliding layers, qwen35's recurrent
state, glm-dsa's and deepseek2's latents, the MoE families' KV); deepseek4's rings and per-block caches and gemma3's sliding-window rings are
what a session holds, of which a snapshot carries only what the next position reads."""

from __future__ import annotations

import numpy as np
import pytest

from agent.artifacts.manifest import build_manifest
from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.libggswarm import NativeModel
from agent.node.handoff import SNAPSHOT_HEADER_SLACK

N_POSITIONS = 300  # past gemma3's 32-token window and deepseek4's ratio-128 blocks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        "gemma3",
        "qwen35",
        "glm-dsa",
        "deepseek4",
        "qwen3moe",
        "glm4moe",
        "deepseek2",
        "gpt-oss",
        "minimax-m2",
    ],
)
def test_a_snapshot_of_n_positions_is_the_manifests_state_estimate_at_n(
    native_lib: None, tmp_path, arch: str
) -> None:  # noqa: ANN001
    path = write_tiny_gguf(arch, tmp_path / f"{arch}.gguf")
    manifest = build_manifest(str(path), hash_tensors=False)
    model = NativeModel(str(path), 0, manifest.n_layers, n_threads=2)
    try:
        sid = model.open_session(512)
        ids = np.random.default_rng(0).integers(1, 200, N_POSITIONS, dtype=np.int32)
        model.forward(sid, 0, token_ids=ids)
        snap = len(model.snapshot(sid))
    finally:
        model.close()
    estimate = sum(layer.state_bytes(N_POSITIONS) for layer in manifest.layers)
    # never more than the hand-off bound allows (a bigger snapshot would be refused as too large),
    # and not far below it either (placement would then reserve memory nobody uses); the snapshot of a
    # ring (deepseek4's, gemma3's sliding-window layers) is its window, the held state is checked below
    assert snap <= estimate + SNAPSHOT_HEADER_SLACK, (snap, estimate)
    if arch not in RINGS:
        assert snap >= 0.9 * estimate, (snap, estimate)


RINGS = ("deepseek4", "gemma3", "gpt-oss")


@pytest.mark.parametrize("arch", RINGS)
def test_a_rings_held_state_is_the_manifests_estimate(native_lib: None, tmp_path, arch: str) -> None:  # noqa: ANN001
    path = write_tiny_gguf(arch, tmp_path / f"{arch}.gguf")
    manifest = build_manifest(str(path), hash_tensors=False)
    n = 1024
    model = NativeModel(str(path), 0, manifest.n_layers, n_threads=2)
    try:
        model.set_checkpoints(0, 0)  # the state alone
        sid = model.open_session(n)
        ids = np.random.default_rng(0).integers(1, 200, n, dtype=np.int32)
        model.forward(sid, 0, token_ids=ids)
        held = model.kv_bytes(sid)
    finally:
        model.close()
    estimate = sum(layer.state_bytes(n) for layer in manifest.layers)
    assert abs(held - estimate) <= 0.05 * estimate, (held, estimate)
