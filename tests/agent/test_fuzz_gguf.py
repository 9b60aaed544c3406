"""Property tests of the manifest reader on GGUF headers: a mutated header gives a manifest or a
ManifestError, never another exception, a hang or an allocation sized by the file's own numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.artifacts import layouts
from agent.artifacts.manifest import ManifestError, build_manifest
from tests.agent._fuzz import FUZZ, mutated


def _small_gguf(path: Path) -> bytes:
    """A two-layer llama GGUF of a few kilobytes: header, metadata and tensors a manifest reads."""
    from gguf import GGUFWriter

    d, vocab = 8, 16
    w = GGUFWriter(str(path), "llama")
    w.add_name("fuzz-llama")
    w.add_block_count(2)
    w.add_embedding_length(d)
    w.add_context_length(64)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, d), dtype=np.float32))
    for i in range(2):
        for name, shape in (
            ("attn_norm", (d,)),
            ("attn_q", (d, d)),
            ("attn_k", (d // 2, d)),
            ("attn_v", (d // 2, d)),
            ("attn_output", (d, d)),
            ("ffn_norm", (d,)),
            ("ffn_gate", (16, d)),
            ("ffn_up", (16, d)),
            ("ffn_down", (d, 16)),
        ):
            w.add_tensor(f"blk.{i}.{name}.weight", rng.standard_normal(shape, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    layouts.write_file(w)
    return path.read_bytes()


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    data = _small_gguf(path)
    m = build_manifest(path)
    assert m.n_layers == 2 and m.boundary_dim == 8
    return data


@FUZZ
@given(st.data())
def test_a_mutated_gguf_header_gives_a_manifest_or_a_manifest_error(
    valid_gguf: bytes, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    # mutate the header and metadata (where the reader trusts counts and lengths), keep the rest
    head_len = min(len(valid_gguf), 1024)
    head = data.draw(mutated(valid_gguf[:head_len]))
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(head + valid_gguf[head_len:])
    try:
        m = build_manifest(path)
    except ManifestError:
        return
    assert m.n_layers > 0 and m.boundary_dim > 0
