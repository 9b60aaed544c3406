"""The manifest's per-layer state estimate (placement, audits, the hand-off size bound) matches what the
native executor really keeps: a snapshot of n positions of a window is the manifest's figure, give or
take the snapshot's headers, for every state kind (f16 KV, gemma3's sliding layers, qwen35's recurrent
state, glm-dsa's and deepseek2's latents, the MoE families' KV); deepseek4's rings and per-block caches and gemma3's sliding-window rings are
what a session holds, of which a snapshot carries only what the next position reads.

Each architecture's tiny file and manifest are written once for the module. Their tokenizer is a
256-token one: the state depends on no vocabulary (every figure here is the same with SmolLM2's 49,152
tokens), and the files are a few KB."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.libggswarm import NativeModel
from agent.node.handoff import SNAPSHOT_HEADER_SLACK, range_snapshot_bound
from tests.native.tiny_gguf import write_small_tokenizer

N_POSITIONS = 300  # past gemma3's 32-token window and deepseek4's ratio-128 blocks
TOKENIZER_SIZE = 256  # the forwards below feed ids 1..199

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Manifest]]:
    """arch -> its tiny file and manifest, each written once for the module."""
    d = tmp_path_factory.mktemp("state")
    tokenizer = write_small_tokenizer(d / "tokenizer.gguf", TOKENIZER_SIZE)
    built: dict[str, tuple[Path, Manifest]] = {}

    def get(arch: str) -> tuple[Path, Manifest]:
        if arch not in built:
            path = write_tiny_gguf(arch, d / f"{arch}.gguf", tokenizer_from=tokenizer)
            built[arch] = (path, build_manifest(str(path), hash_tensors=False))
        return built[arch]

    return get


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
    native_lib: None, tiny: Callable[[str], tuple[Path, Manifest]], arch: str
) -> None:
    path, manifest = tiny(arch)
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
def test_a_rings_held_state_is_the_manifests_estimate(
    native_lib: None, tiny: Callable[[str], tuple[Path, Manifest]], arch: str
) -> None:
    path, manifest = tiny(arch)
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


@pytest.mark.parametrize("arch", ["deepseek4", "glm-dsa"])
def test_a_last_window_snapshot_with_its_mtp_state_fits_the_hand_off_bound(
    native_lib: None, tmp_path: Path, arch: str
) -> None:
    """A last window drafting with its MTP head carries the block's state in its snapshots (the trailer);
    the hand-off's size bound for that range makes room for it."""
    extra = {"indexer_key_length": 128} if arch == "deepseek4" else {"n_layers": 9}
    path = write_tiny_gguf(arch, tmp_path / f"{arch}-mtp.gguf", mtp=True, **extra)
    manifest = build_manifest(str(path), hash_tensors=False)
    start = manifest.n_layers - 3  # glm-dsa: a full-indexer layer (0, 3, 6 of 9); deepseek4: 3 of 6
    model = NativeModel(str(path), start, manifest.n_layers, n_threads=2)
    try:
        model.mtp_open(str(path))
        sid = model.open_session(512)
        hidden = (
            np.random.default_rng(1).standard_normal((N_POSITIONS, manifest.boundary_dim)).astype(np.float32)
        )
        ids = np.random.default_rng(0).integers(1, 200, N_POSITIONS, dtype=np.int32)
        model.forward(sid, 0, hidden=hidden, token_ids=ids)
        snap = model.snapshot(sid)
    finally:
        model.close()
    (trailer,) = struct.unpack_from("<Q", snap, 184)  # the header's nextn trailer bytes
    bound = range_snapshot_bound(manifest, start, manifest.n_layers, True, N_POSITIONS)
    assert trailer > 0
    assert len(snap) <= bound, (len(snap), bound)
    assert len(snap) - trailer <= range_snapshot_bound(manifest, start, manifest.n_layers, False, N_POSITIONS)
