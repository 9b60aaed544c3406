"""Real-shaped windows (agent/artifacts/realshape.py) of DeepSeek-V4-Flash, GLM-5.2 and Qwen3.5-397B-A17B:
the executor accepts the whole file, opens one real layer, and the session state it holds after n
positions is the manifest's estimate for that layer (placement and the node budget charge that figure).

The files are all holes (a few MB on disk); a zero-filled window is valid and costs its real size in
memory (3.7-5.5 GB), so a machine without that much free memory skips with the figures. They go to a
tmpfs where there is one: reading a hole there zeroes the reader's buffer, while on a disk file system
(ext4) every hole read first allocates and zeroes a page-cache page, which more than doubled the open's
CPU time and left GBs of cached zero pages behind; the bytes the executor reads are the same.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts import manifest as manifest_mod
from agent.artifacts.realshape import write_realshape_gguf
from agent.backends.libggswarm import NativeModel, check_file

pytestmark = pytest.mark.slow

N = 256  # a multiple of 256: deepseek4's padded session capacity is then n itself
# (architecture, layer): deepseek4's ratio-4 layer (raw ring, compressed and indexer K, compressor
# rings) past the hash-routed layers; glm-dsa's first MoE layer with its own indexer; qwen35moe's
# first full-attention layer (its KV grows with n; the delta-net layers' state is fixed)
WINDOWS = [("deepseek4", 8), ("glm-dsa", 6), ("qwen35moe", 3)]
SHM = Path("/dev/shm")


def _tmpfs(d: Path, need: int = 256 << 20) -> bool:
    """Whether `d` is a writable tmpfs mount point with `need` bytes free (the files' data is a few MB)."""
    try:
        with open("/proc/mounts") as f:
            mounts = {fields[1]: fields[2] for fields in (line.split() for line in f) if len(fields) > 2}
        st = os.statvfs(d)
    except OSError:
        return False
    return mounts.get(str(d)) == "tmpfs" and os.access(d, os.W_OK) and st.f_bavail * st.f_frsize >= need


@pytest.fixture
def holes_dir(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs folder for the sparse file where there is one (see the module's docstring), else tmp_path."""
    if not _tmpfs(SHM):
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(dir=SHM, prefix="ggswarm-realshape-") as d:
        yield Path(d)


@pytest.mark.parametrize(("arch", "layer"), WINDOWS)
def test_a_real_layer_opens_and_holds_the_manifests_state(
    native_lib: None, holes_dir: Path, monkeypatch, arch: str, layer: int
) -> None:  # noqa: ANN001
    import psutil

    path = write_realshape_gguf(arch, holes_dir / f"{arch}.gguf")
    assert path.stat().st_blocks * 512 < 64 << 20, "the file should be holes, not data"
    assert check_file(path) == ""
    # build_manifest hashes the whole file (hundreds of GB of holes here); the layer figures don't need it
    monkeypatch.setattr(manifest_mod, "sha256_file", lambda p: "not-hashed")
    manifest = manifest_mod.build_manifest(path, hash_tensors=False)
    weights = manifest.bytes_for_range(layer, layer + 1)
    free = psutil.virtual_memory().available
    if free < weights + (1 << 30):
        pytest.skip(f"{arch} layer {layer} needs {weights / 1e9:.1f} GB + 1 GB; {free / 1e9:.1f} GB free")
    # with the CPU's repacked weights on (the default): deepseek4's grouped output LoRA (attn_output_a,
    # Q4_K here) is viewed 3-D, which a repacked matrix cannot be; the loader keeps it unrepacked
    model = NativeModel(str(path), layer, layer + 1, n_threads=2)
    try:
        assert model.d_model == manifest.boundary_dim
        model.set_checkpoints(0, 0)  # the state alone
        sid = model.open_session(N)
        hidden = np.random.default_rng(0).standard_normal((N, model.d_model)).astype(np.float32)
        out = model.forward(sid, 0, hidden=hidden)
        assert np.isfinite(out["hidden"]).all()
        held = model.kv_bytes(sid)
    finally:
        model.close()
    estimate = manifest.layers[layer].state_bytes(N)
    assert abs(held - estimate) <= 0.05 * estimate, (held, estimate)
