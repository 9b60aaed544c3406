"""The manifest's GGUF header reader gives what gguf's GGUFReader gives (values, array lengths, tensor
infos, the data offset), skips long arrays, and refuses a malformed header with the reason before
allocating for it."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from agent.artifacts.gguf_meta import GgufMetaError, read_gguf_meta
from agent.artifacts.tiny import write_tiny_gguf


def reader_view(path: str) -> tuple[dict, dict, list, int]:
    """(values of arrays up to 1024 and scalars, every array's length, tensors, data offset) by GGUFReader."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(path, "r")
    values, lengths = {}, {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            lengths[key] = len(f.data)
            if len(f.data) > 1024:
                continue
        values[key] = f.contents()
    tensors = [
        (t.name, tuple(int(x) for x in t.shape), t.tensor_type, int(t.data_offset), int(t.n_bytes))
        for t in r.tensors
    ]
    return values, lengths, tensors, int(r.data_offset)


@pytest.mark.parametrize("which", ["smollm2", "glm-dsa", "deepseek4"])
def test_the_header_reads_as_gguf_reads_it(which: str, model_path: str, tmp_path: Path) -> None:
    # SmolLM2: 49k tokens and merges, a chat template; glm-dsa: per-layer arrays and the MTP block;
    # deepseek4: per-layer arrays of ratios, bools
    path = model_path if which == "smollm2" else str(write_tiny_gguf(which, tmp_path / "m.gguf", mtp=True))
    values, lengths, tensors, data_offset = reader_view(path)
    meta = read_gguf_meta(path)
    assert meta.fields == values
    assert meta.array_len == lengths
    assert [(t.name, t.shape, t.tensor_type, t.data_offset, t.n_bytes) for t in meta.tensors] == tensors
    assert meta.data_offset == data_offset
    if which == "smollm2":
        assert "tokenizer.ggml.tokens" not in meta.fields and lengths["tokenizer.ggml.tokens"] == 49152


def header(n_tensors: int, kvs: bytes, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs


def s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def written(tmp_path: Path, data: bytes) -> Path:
    p = tmp_path / "bad.gguf"
    p.write_bytes(data + b"\0" * 32)
    return p


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (header(0, b"", 1 << 60), "cannot fit"),  # a count no file could hold: refused before any loop
        (
            header(0, s("k") + struct.pack("<IIQ", 9, 8, 1 << 40), 1),
            "runs past the end",
        ),  # a huge string array
        (header(0, s("k") + struct.pack("<IIQ", 9, 4, 1 << 40), 1), "runs past the end"),  # a huge u32 array
        (header(0, s("k") + struct.pack("<I", 99), 1), "unknown value type 99"),
        (header(0, s("k") + struct.pack("<IIQ", 9, 9, 1), 1), "array of ARRAY"),
        (header(0, struct.pack("<Q", 1 << 50), 1), "runs past the end"),  # a key longer than the file
        (
            header(0, s("k") + struct.pack("<IB", 0, 1) + s("k") + struct.pack("<IB", 0, 1), 2),
            "duplicate key k",
        ),
        (header(1, s("t") + struct.pack("<I", 9), 0), "9 dimensions"),
        (header(1, s("t") + struct.pack("<IQIQ", 1, 32, 12345, 0), 0), "unknown type 12345"),
        (header(1, s("t") + struct.pack("<IQIQ", 1, 31, 2, 0), 0), "not a multiple"),  # q4_0 rows of 31
        (header(0, s("general.alignment") + struct.pack("<II", 4, 48), 1), "power of two"),
        (header(0, b"", 0, version=7), "version 7"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    ],
)
def test_a_malformed_header_is_refused_with_the_reason(tmp_path: Path, data: bytes, reason: str) -> None:
    with pytest.raises(GgufMetaError, match=reason):
        read_gguf_meta(written(tmp_path, data))
