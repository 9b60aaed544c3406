"""The GGUF manifest: tensors, ranges, roles, hashes, and clear errors on malformed files."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts import layouts
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
    layouts.write_file(w)
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


# -- per-architecture structure, on the tiny generated models -----------------------------------------
@pytest.fixture(scope="module")
def tiny_manifest(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from agent.artifacts import tiny
    from agent.artifacts.packaged import ModelNotFound, packaged_model_path

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny models carry SmolLM2's tokenizer: {e}")
    root = tmp_path_factory.mktemp("tiny-manifests")
    cache: dict[tuple[str, bool], Manifest] = {}

    def get(arch: str, mtp: bool = False) -> Manifest:
        if (arch, mtp) not in cache:
            path = tiny.write_tiny_gguf(arch, root / f"{arch}-{mtp}.gguf", mtp=mtp)
            cache[arch, mtp] = build_manifest(path, hash_tensors=False)
        return cache[arch, mtp]

    return get


def test_attention_layers_keep_kv_and_gemma3_sliding_layers_are_counted_at_their_ring(
    tiny_manifest,
) -> None:  # noqa: ANN001
    llama = tiny_manifest("llama")
    assert [layer.state_kind for layer in llama.layers] == ["kv"] * 4
    assert [(p.name, p.elements, p.window) for p in llama.layers[0].state] == [("k", 32, 0), ("v", 32, 0)]
    gemma = tiny_manifest("gemma3")
    # five sliding-window layers keep a ring of pad256(32 + 512) = 768 positions, as llama.cpp's SWA
    # cache and the native executor keep them; the global sixth keeps every position
    assert [layer.state[0].window for layer in gemma.layers] == [768] * 5 + [0]
    assert gemma.layers[0].state_bytes(4096) == gemma.layers[0].state_bytes(768) == 768 * 2 * 16 * 2
    assert gemma.layers[5].state_bytes(4096) == 4096 * 2 * 16 * 2


def test_delta_net_layers_are_recurrent_with_fixed_conv_and_ssm_state(tiny_manifest) -> None:  # noqa: ANN001
    for arch in ("qwen35", "qwen35moe"):
        m = tiny_manifest(arch)
        kinds = [layer.state_kind for layer in m.layers]
        assert kinds == ["recurrent"] * 3 + ["kv"] + ["recurrent"] * 3 + ["kv"]
        parts = {p.name: p for p in m.layers[0].state}
        # conv: (kernel - 1) x (inner + 2 x groups x state); ssm: state x inner; both f32 per sequence
        assert parts["conv"].elements == 3 * (64 + 2 * 2 * 16) and parts["ssm"].elements == 16 * 64
        assert all(p.fixed and p.f32 for p in parts.values())
        assert m.layers[0].state_bytes(8) == m.layers[0].state_bytes(4096) == 4 * (384 + 1024)


def test_moe_expert_tensors_are_counted_with_their_layer(tiny_manifest) -> None:  # noqa: ANN001
    m = tiny_manifest("qwen35moe")
    for layer in m.layers:
        exps = [t for t in m.tensors if t.layer == layer.index and "_exps." in t.name]
        assert len(exps) == 3
        assert layer.expert_bytes == sum(t.nbytes for t in exps) == 3 * 4 * 64 * 32 * 4
        assert layer.nbytes > layer.expert_bytes
    assert m.bytes_for_range(1, 2) >= m.layers[1].nbytes
    assert tiny_manifest("llama").expert_bytes == 0


def test_deepseek4_seam_is_four_streams_wide_and_layers_follow_their_compress_ratio(tiny_manifest) -> None:  # noqa: ANN001
    m = tiny_manifest("deepseek4")
    assert m.boundary_dim == 4 * 64
    assert [layer.state_kind for layer in m.layers] == ["kv", "compressed_kv", "compressed_kv"] * 2
    assert [layer.needs_token_ids for layer in m.layers] == [True] + [False] * 5  # hash-routed layer 0
    assert m.token_id_layers == 1  # what the control plane hands the route client
    assert tiny_manifest("qwen3").token_id_layers == 0
    names = [[p.name for p in layer.state] for layer in m.layers[:3]]
    assert names[0] == ["raw_k"]
    assert names[1] == ["raw_k", "compressed_k", "indexer_k", "compressor", "indexer_compressor"]
    assert names[2] == ["raw_k", "compressed_k", "compressor"]
    # as native/src/archs/deepseek4.cpp (and llama.cpp) keeps them (hd 64, indexer 64 here): the raw K
    # in a ring of pad256(16 + 512) = 768 slots and the compressed entries per block, in the cache type
    # (f16: 2 bytes); the compressor rows in f32 rings of 8 (ratio 4) or 128 (ratio 128) slots
    n = 1024
    assert m.layers[0].state_bytes(n) == 2 * 768 * 64
    assert m.layers[1].state_bytes(n) == 2 * (768 * 64 + 64 * n // 4 + 64 * n // 4) + 4 * 8 * (
        4 * 64 + 4 * 64
    )
    assert m.layers[2].state_bytes(n) == 2 * (768 * 64 + 64 * n // 128) + 4 * 128 * 2 * 64
    assert m.layers[1].state_bytes(4 * n) - m.layers[1].state_bytes(n) == 2 * (64 + 64) * 3 * n // 4
    assert m.roles["last"][:2] == ["output_norm.weight", "output.weight"]
    assert {"output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight"} <= set(m.roles["last"])


def test_glm_dsa_indexer_groups_are_unsplittable_and_the_first_layer_is_dense(tiny_manifest) -> None:  # noqa: ANN001
    m = tiny_manifest("glm-dsa")
    assert {layer.state_kind for layer in m.layers} == {"latent_kv"}
    with_indexer = [i for i, layer in enumerate(m.layers) if any(p.name == "indexer_k" for p in layer.state)]
    assert with_indexer == [0, 3]
    assert m.layer_groups == [(0, 3), (3, 6)]
    assert [b for b in range(1, 6) if m.boundary_allowed(b)] == [3]
    assert m.leading_dense_layers == 1
    assert m.layers[0].expert_bytes == 0 and m.layers[1].expert_bytes > 0


def test_mtp_blocks_are_not_trunk_layers_and_travel_with_the_last_shard(tiny_manifest) -> None:  # noqa: ANN001
    m = tiny_manifest("glm-dsa", mtp=True)
    assert (m.n_layers, m.mtp_layers) == (6, 1)
    mtp = {t.name for t in m.tensors if t.layer == 6}
    assert mtp and mtp <= set(m.roles["last"])
    assert mtp <= {t.name for t in m.tensors_for_range(3, 6)}
    assert not mtp & {t.name for t in m.tensors_for_range(0, 3)}


def test_a_version_1_manifest_is_upgraded_from_its_hparams(tiny_manifest) -> None:  # noqa: ANN001
    m = tiny_manifest("qwen35moe")
    d = m.to_dict()
    d["manifest_version"] = 1
    for key in ("mtp_layers", "layer_groups", "leading_dense_layers"):
        d.pop(key)
    d["layers"] = [
        {"index": x["index"], "ranges": x["ranges"], "nbytes": x["nbytes"], "state_kind": "attention_kv"}
        for x in d["layers"]
    ]
    up = Manifest.from_dict(d)
    assert up.manifest_version == 2
    assert up.layers == m.layers
    assert Manifest.from_json(m.to_json()) == m


def test_unsupported_architectures_are_named_not_servable(
    tiny_manifest,  # noqa: ANN001
    manifest: Manifest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agent.artifacts import archs

    assert manifest.servable_problem == ""
    # every tiny architecture is servable now: take one away to see the refusal
    monkeypatch.setattr(archs, "SERVABLE_ARCHITECTURES", archs.SERVABLE_ARCHITECTURES - {"deepseek4"})
    problem = tiny_manifest("deepseek4").servable_problem
    assert problem.startswith("not servable by this agent: architecture 'deepseek4'")
    assert "llama" in problem
