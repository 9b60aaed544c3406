"""The GGUF header as a manifest needs it: key/values and tensor infos, read with every count and length
bounded by the file before it is used (docs/security.md, "GGUF headers").

gguf's GGUFReader builds numpy views of every element of every array (SmolLM2's 49k tokens and 48k
merges: ~2 s of CPU per file, paid by every `agent serve`, registration and test that describes one);
a manifest needs the arrays' lengths only, so arrays longer than `max_array` are skipped, their length
kept. Values come out as GGUFReader's `contents()` gives them (tests/agent/test_gguf_meta.py compares
the two on real and tiny files)."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)  # what llama.cpp reads
GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

# value type -> (struct code, numpy dtype) of the fixed-size ones
_SCALARS: dict[int, tuple[str, str]] = {
    GGUFValueType.UINT8: ("B", "<u1"),
    GGUFValueType.INT8: ("b", "<i1"),
    GGUFValueType.UINT16: ("H", "<u2"),
    GGUFValueType.INT16: ("h", "<i2"),
    GGUFValueType.UINT32: ("I", "<u4"),
    GGUFValueType.INT32: ("i", "<i4"),
    GGUFValueType.FLOAT32: ("f", "<f4"),
    GGUFValueType.BOOL: ("?", "<u1"),
    GGUFValueType.UINT64: ("Q", "<u8"),
    GGUFValueType.INT64: ("q", "<i8"),
    GGUFValueType.FLOAT64: ("d", "<f8"),
}


class GgufMetaError(ValueError):
    """The header is malformed: a count, length or type the file cannot hold."""


@dataclass(frozen=True)
class TensorMeta:
    """One tensor info: its name, ggml shape (ne0 first), type, absolute data offset and size."""

    name: str
    shape: tuple[int, ...]
    tensor_type: GGMLQuantizationType
    data_offset: int
    n_bytes: int


@dataclass
class GgufMeta:
    """Key/values (arrays over max_array left out: `array_len` has every array's length), value types,
    tensor infos and where the tensor data starts."""

    version: int
    fields: dict[str, Any] = field(default_factory=dict)
    types: dict[str, GGUFValueType] = field(default_factory=dict)
    array_len: dict[str, int] = field(default_factory=dict)
    tensors: list[TensorMeta] = field(default_factory=list)
    data_offset: int = 0


class _Cursor:
    """Reads little-endian values from a buffer, refusing any read past its end."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GgufMetaError(
                f"{what} at byte {self.pos} runs past the end of the file ({self.size} bytes)"
            )

    def unpack(self, code: str, what: str) -> Any:
        n = struct.calcsize("<" + code)
        self.need(n, what)
        v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufMetaError(f"{what} at byte {self.pos - n} is not UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        buf, pos, size = self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                raise GgufMetaError(f"{what} runs past the end of the file")
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > size:
            raise GgufMetaError(f"{what} runs past the end of the file")
        self.pos = pos


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise GgufMetaError(f"{what} has unknown value type {raw}") from None


def _read_value(c: _Cursor, vtype: GGUFValueType, key: str, max_array: int) -> tuple[Any, int | None]:
    """(value, array length or None); arrays over max_array come back as None with their length."""
    if vtype == GGUFValueType.STRING:
        return c.string(key), None
    if vtype in _SCALARS:
        v = c.unpack(_SCALARS[vtype][0], key)
        return (bool(v) if vtype == GGUFValueType.BOOL else v), None
    if vtype != GGUFValueType.ARRAY:
        raise GgufMetaError(f"{key} has unknown value type {int(vtype)}")
    itype = _value_type(c.unpack("I", key), f"{key}'s elements")
    count = c.unpack("Q", key)
    if itype == GGUFValueType.STRING:
        c.need(8 * count, key)  # each element holds at least its length
        if count > max_array:
            c.skip_strings(count, key)
            return None, count
        return [c.string(key) for _ in range(count)], count
    if itype not in _SCALARS:  # nested arrays: llama.cpp writes none
        raise GgufMetaError(f"{key} is an array of {itype.name}, which GGUF metadata does not use")
    code, dtype = _SCALARS[itype]
    n = count * struct.calcsize("<" + code)
    c.need(n, key)
    values = None
    if count <= max_array:
        arr = np.frombuffer(c.buf, dtype=dtype, count=count, offset=c.pos)
        values = arr.astype(bool).tolist() if itype == GGUFValueType.BOOL else arr.tolist()
    c.pos += n
    return values, count


def read_gguf_meta(path: str | Path, max_array: int = 1024) -> GgufMeta:
    """The header of the GGUF at `path` (little-endian, version 2 or 3). Raises GgufMetaError."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GgufMetaError(f"{size} bytes cannot hold a GGUF header")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(mm, size, max_array)
    finally:
        mm.close()


def _parse(buf: Any, size: int, max_array: int) -> GgufMeta:
    c = _Cursor(buf, size)
    if bytes(buf[:4]) != GGUF_MAGIC:
        raise GgufMetaError("not a GGUF file")
    c.pos = 4
    version = c.unpack("I", "version")
    if version & 0xFFFF == 0:
        raise GgufMetaError("a big-endian GGUF (llama.cpp reads little-endian files only)")
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise GgufMetaError(f"GGUF version {version} is not supported")
    n_tensors = c.unpack("Q", "tensor count")
    n_kv = c.unpack("Q", "key/value count")
    # each key/value holds at least a key length, a type and a byte; each tensor info at least 28 bytes
    if n_kv * 13 > size or n_tensors * 28 > size:
        raise GgufMetaError(f"{n_kv} key/values and {n_tensors} tensors cannot fit in {size} bytes")
    meta = GgufMeta(version=version)
    for _ in range(n_kv):
        key = c.string("a key")
        if key in meta.types:
            raise GgufMetaError(f"duplicate key {key}")
        vtype = _value_type(c.unpack("I", key), key)
        value, count = _read_value(c, vtype, key, max_array)
        meta.types[key] = vtype
        if count is not None:
            meta.array_len[key] = count
        if value is not None:
            meta.fields[key] = value
    align = meta.fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in meta.types and meta.types["general.alignment"] != GGUFValueType.UINT32:
        raise GgufMetaError("general.alignment is not a UINT32")
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise GgufMetaError(f"general.alignment {align} is not a power of two")
    infos: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        if name in names:
            raise GgufMetaError(f"duplicate tensor {name}")
        names.add(name)
        n_dims = c.unpack("I", name)
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GgufMetaError(f"tensor {name} has {n_dims} dimensions (1 to {GGML_MAX_DIMS})")
        dims = tuple(c.unpack("Q", name) for _ in range(n_dims))
        raw_type = c.unpack("I", name)
        try:
            ttype = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GgufMetaError(f"tensor {name} has unknown type {raw_type}") from None
        infos.append((name, dims, ttype, c.unpack("Q", name)))
    data_offset = c.pos + (-c.pos % align)
    meta.data_offset = data_offset
    for name, dims, ttype, offset in infos:
        n_elems = int(np.prod(dims, dtype=object))
        block, type_size = GGML_QUANT_SIZES[ttype]
        if dims[0] % block:
            raise GgufMetaError(
                f"tensor {name}: {dims[0]} values per row is not a multiple of {ttype.name}'s {block}"
            )
        meta.tensors.append(TensorMeta(name, dims, ttype, data_offset + offset, n_elems * type_size // block))
    return meta
