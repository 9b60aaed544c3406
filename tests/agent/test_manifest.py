"""The GGUF manifest: tensors, ranges, roles, hashes, and clear errors on malformed files."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import Manifest, ManifestError, build_manifest

REPO = Path(__file__).resolve().parents[2]


def write_tiny_gguf(path: Path, arch: str = "llama", n_layers: int = 2, d: int = 8) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(d)
    w.add_context_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_feed_forward_length(16)
    w.add_tensor("token_embd.weight", np.ones((32, d), dtype=np.float32))
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(d, i, dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_q.weight", np.ones((d, d), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_smollm2_manifest_describes_every_layer_and_role(manifest: Manifest) -> None:
    assert manifest.architecture == "llama"
    assert manifest.n_layers == 30
    assert manifest.boundary_dim == 576
    assert manifest.tied_embeddings
    assert manifest.roles["first"] == ["token_embd.weight"]
    assert manifest.roles["last"] == ["output_norm.weight", "token_embd.weight"]
    assert [layer.index for layer in manifest.layers] == list(range(30))
    assert all(layer.nbytes > 0 and layer.state_kind == "kv" for layer in manifest.layers)
    # Every byte of tensor data belongs to exactly one tensor and the ranges stay inside the file.
    spans = sorted((t.offset, t.end) for t in manifest.tensors)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= manifest.file_size


def test_tensor_hashes_match_the_bytes_on_disk(manifest: Manifest, model_path: str) -> None:
    t = manifest.tensor("blk.7.attn_v.weight")
    with open(model_path, "rb") as f:
        f.seek(t.offset)
        assert hashlib.sha256(f.read(t.nbytes)).hexdigest() == t.sha256
    assert t.layer == 7


def test_shard_ranges_include_the_role_tensors(manifest: Manifest) -> None:
    first = {t.name for t in manifest.tensors_for_range(0, 10)}
    middle = {t.name for t in manifest.tensors_for_range(10, 20)}
    last = {t.name for t in manifest.tensors_for_range(20, 30)}
    assert "token_embd.weight" in first and "output_norm.weight" not in first
    assert not any(n.startswith(("token_embd", "output")) for n in middle)
    assert {"token_embd.weight", "output_norm.weight"} <= last  # tied head reuses the embedding
    total = sum(manifest.bytes_for_range(a, b) for a, b in [(0, 10), (10, 20), (20, 30)])
    embd = manifest.tensor("token_embd.weight").nbytes
    assert total == manifest.file_size - manifest.tensor_data_offset + embd - _padding(manifest)


def _padding(m: Manifest) -> int:
    used = sum(t.nbytes for t in m.tensors)
    return (m.file_size - m.tensor_data_offset) - used


def test_manifest_round_trips_through_json(manifest: Manifest) -> None:
    again = Manifest.from_json(manifest.to_json())
    assert again.to_dict() == manifest.to_dict()
    assert again.tensor("output_norm.weight") == manifest.tensor("output_norm.weight")


def test_layer_range_out_of_bounds_is_a_clear_error(manifest: Manifest) -> None:
    with pytest.raises(ManifestError, match="outside 0:30"):
        manifest.tensors_for_range(20, 31)


def test_truncated_gguf_is_reported_not_crashed(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = good.read_bytes()
    for cut in (3, 20, len(data) // 3, len(data) - 5):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ManifestError):
            build_manifest(bad)


def test_wrong_magic_and_version_are_named(tmp_path: Path) -> None:
    data = bytearray(write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes())
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ManifestError, match="not a GGUF file"):
        build_manifest(tmp_path / "magic.gguf")
    data[4:8] = (99).to_bytes(4, "little")
    (tmp_path / "version.gguf").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="version 99"):
        build_manifest(tmp_path / "version.gguf")


def test_missing_file_and_directory_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read"):
        build_manifest(tmp_path / "nope.gguf")
    with pytest.raises(ManifestError, match="not a regular file"):
        build_manifest(tmp_path)


def test_tiny_gguf_layers_and_roles(tmp_path: Path) -> None:
    m = build_manifest(write_tiny_gguf(tmp_path / "tiny.gguf", n_layers=3))
    assert m.n_layers == 3 and m.boundary_dim == 8
    assert m.tied_embeddings
    assert [t.layer for t in m.tensors_for_range(1, 2)] == [1, 1]


def test_inspect_cli_prints_json_and_fails_cleanly(tmp_path: Path, model_path: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "agent", "inspect", model_path, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    d = json.loads(out.stdout)
    assert d["n_layers"] == 30 and len(d["tensors"]) == len(d["layers"]) * 9 + 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    out = subprocess.run(
        [sys.executable, "-m", "agent", "inspect", str(bad)], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and "Traceback" not in out.stderr
