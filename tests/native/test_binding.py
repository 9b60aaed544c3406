"""The ctypes binding hands the library each array's own memory, by the fast route or numpy's."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from agent.artifacts.manifest import build_manifest
from agent.artifacts.tiny import write_suite_gguf
from agent.backends.base import ShardSpec, StepInput
from agent.backends.libggswarm import _address, _i32
from agent.backends.native import NativeBackend
from agent.wire.ids import SessionId

pytestmark = pytest.mark.usefixtures("native_lib")


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((3, 64), dtype=np.float32),
        np.zeros((2, 8), dtype=np.float16),
        np.frombuffer(np.arange(4, dtype=np.int32).tobytes(), dtype=np.int32),  # read-only: numpy's route
        np.zeros(0, dtype=np.float32),  # no bytes to export: numpy's route
    ],
    ids=["f32 rows", "f16 rows", "read-only ids", "empty"],
)
def test_an_arrays_address_is_where_numpy_says_its_data_starts(array: np.ndarray) -> None:
    assert _address(array) == array.ctypes.data


def test_an_arrays_address_reads_back_its_values() -> None:
    a = np.arange(5, dtype=np.int32)
    assert list((ctypes.c_int32 * 5).from_address(_address(a))) == [0, 1, 2, 3, 4]


def test_int32_ids_pass_through_and_anything_else_is_converted() -> None:
    ids = np.arange(6, dtype=np.int32)
    assert _i32(ids) is ids
    strided = np.arange(12, dtype=np.int32)[::2]
    for given in (strided, np.arange(6, dtype=np.int64), [0, 2, 4, 6, 8, 10], ids.reshape(2, 3)):
        got = _i32(given)
        assert got.dtype == np.int32 and got.ndim == 1 and got.flags.c_contiguous
        assert got.tolist() == np.asarray(given).reshape(-1).tolist()


def test_read_only_and_writable_inputs_give_the_same_rows(tmp_path) -> None:  # noqa: ANN001
    path = write_suite_gguf("qwen3", tmp_path)
    manifest = build_manifest(str(path), hash_tensors=False)
    first = NativeBackend(ShardSpec(str(path), 0, 1, manifest, n_threads=1))
    middle = NativeBackend(ShardSpec(str(path), 1, 2, manifest, n_threads=1))
    ids = [3, 17, 5, 40]
    outs = []
    try:
        for k, wire in enumerate((False, True)):
            sid = SessionId(bytes([k + 1]) * 16)
            for hop in (first, middle):
                hop.open_session(sid, 64)
            # from the wire the step's ids and rows are read-only views of the frame's bytes
            tok = np.asarray(ids, dtype=np.int32)
            tok = np.frombuffer(tok.tobytes(), dtype=np.int32) if wire else tok
            h = first.forward(StepInput(sid, 0, token_ids=tok)).hidden
            assert h is not None
            rows = np.frombuffer(h.tobytes(), dtype=h.dtype).reshape(h.shape) if wire else h
            out = middle.forward(StepInput(sid, 0, token_ids=tok, hidden=rows)).hidden
            assert out is not None
            outs.append(out)
        assert outs[0].tobytes() == outs[1].tobytes()
        assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    finally:
        first.close()
        middle.close()
