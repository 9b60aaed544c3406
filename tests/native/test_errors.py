"""Bad input to libggswarm comes back as an error through the binding; the process never crashes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from agent.backends import ggswarm_lib
from agent.backends.libggswarm import NativeBudget, NativeError, NativeModel
from tests.native.tiny_gguf import VOCAB, D, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def tiny_4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 4,096-position context (KV: 128 bytes per position per layer)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny4k") / "tiny-llama.gguf", context=4096)


def test_a_layer_range_out_of_bounds_is_a_range_error(native_lib: None, tiny: Path) -> None:
    for a, b in [(0, 4), (-1, 2), (2, 2), (3, 1)]:
        with pytest.raises(NativeError, match="layer range") as e:
            NativeModel(tiny, a, b)
        assert e.value.status == ggswarm_lib.GGSWARM_E_RANGE


def test_zero_or_negative_threads_are_rejected(native_lib: None, tiny: Path) -> None:
    for n in (0, -3):
        with pytest.raises(NativeError, match="n_threads") as e:
            NativeModel(tiny, 0, 3, n_threads=n)
        assert e.value.status == ggswarm_lib.GGSWARM_E_INVALID_ARG
    with NativeModel(tiny, 0, 3, n_threads=1) as m, pytest.raises(NativeError, match="n_threads"):
        m.set_threads(0)


def test_an_unsupported_architecture_is_named_in_the_error(native_lib: None, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(NativeError, match="architecture 'mamba' is not supported") as e:
        NativeModel(path, 0, 1)
    assert e.value.status == ggswarm_lib.GGSWARM_E_UNSUPPORTED


def test_a_truncated_file_is_a_format_error(native_lib: None, tiny: Path, tmp_path: Path) -> None:
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 4096])
    with pytest.raises(NativeError) as e:
        NativeModel(cut, 0, 3)
    assert e.value.status == ggswarm_lib.GGSWARM_E_FORMAT
    # a window that does not need the missing tail still loads
    with NativeModel(cut, 0, 1) as m:
        assert m.is_first
    stub = tmp_path / "stub.gguf"
    stub.write_bytes(data[:100])
    with pytest.raises(NativeError) as e:
        NativeModel(stub, 0, 1)
    assert e.value.status == ggswarm_lib.GGSWARM_E_FORMAT


def test_corrupt_tensor_data_is_a_format_error_naming_the_tensor(native_lib: None, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "nan.gguf", corrupt="blk.1.attn_norm.weight")
    with pytest.raises(NativeError, match=r"blk\.1\.attn_norm\.weight: corrupt") as e:
        NativeModel(path, 1, 2)
    assert e.value.status == ggswarm_lib.GGSWARM_E_FORMAT


def test_a_missing_file_or_a_non_gguf_is_an_error(native_lib: None, tmp_path: Path) -> None:
    with pytest.raises(NativeError) as e:
        NativeModel(tmp_path / "absent.gguf", 0, 1)
    assert e.value.status == ggswarm_lib.GGSWARM_E_IO
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(NativeError, match="not a GGUF"):
        NativeModel(junk, 0, 1)


def test_forward_validates_its_batch(native_lib: None, tiny: Path) -> None:
    with NativeModel(tiny, 0, 2) as first, NativeModel(tiny, 2, 3) as last:
        s1 = first.open_session(16)
        s2 = last.open_session(16)
        with pytest.raises(NativeError, match="n_tokens"):
            first.forward(s1, 0, token_ids=[])
        with pytest.raises(NativeError, match="token id"):
            first.forward(s1, 0, token_ids=[VOCAB])
        with pytest.raises(NativeError, match="pos_start"):
            first.forward(s1, 3, token_ids=[1])
        with pytest.raises(NativeError, match="hidden size mismatch"):
            last.forward(s2, 0, hidden=np.zeros((2, D + 1), dtype=np.float32))
        with pytest.raises(NativeError, match="session cap"):
            first.forward(s1, 0, token_ids=list(range(17)))
        with pytest.raises(NativeError, match="unknown session"):
            first.forward(12345, 0, token_ids=[1])
        with pytest.raises(NativeError, match="capacity"):
            first.open_session(0)
        with pytest.raises(NativeError, match="capacity"):
            first.open_session(10**7)
        with pytest.raises(NativeError, match="truncate"):
            first.truncate(s1, 5)
        # the handle still works after all of that
        h = first.forward(s1, 0, token_ids=[1, 2, 3])["hidden"]
        out = last.forward(s2, 0, hidden=h.astype(np.float16))
        assert 0 <= out["token"] < VOCAB


def test_the_kv_budget_is_an_error_not_an_out_of_memory(native_lib: None, tiny: Path) -> None:
    per_token = NativeModel(tiny, 0, 3).kv_bytes_per_token
    budget = NativeBudget(per_token * 300)
    with NativeModel(tiny, 0, 3, budget=budget) as m:
        a = m.open_session(256)
        assert m.growth_bytes(a, 64) == 256 * per_token  # the cache holds whole 256-position blocks
        m.forward(a, 0, token_ids=list(range(64)))
        assert m.growth_bytes(a, 200) == 0 and budget.used == m.kv_bytes(a) == 256 * per_token
        b = m.open_session(256)
        with pytest.raises(NativeError, match="KV budget") as e:
            m.forward(b, 0, token_ids=list(range(64)))
        assert e.value.status == ggswarm_lib.GGSWARM_E_BUDGET
        m.close_session(a)
        assert budget.used == 0
        m.forward(b, 0, token_ids=list(range(64)))
        assert m.kv_bytes() == m.kv_bytes(b) == budget.used > 0
        with pytest.raises(NativeError, match="n_positions"):
            m.growth_bytes(b, 257)
    assert budget.used == 0  # freeing the model returned its sessions' bytes
    budget.close()


def test_two_models_sharing_one_budget_cannot_overrun_it(native_lib: None, tiny_4k: Path) -> None:
    budget = NativeBudget(150_000)
    first, last = NativeModel(tiny_4k, 0, 1, budget=budget), NativeModel(tiny_4k, 1, 3, budget=budget)
    budget.close()  # the models hold their own references: the budget outlives this one
    s1, s2 = first.open_session(512), last.open_session(512)
    h = first.forward(s1, 0, token_ids=[i % VOCAB for i in range(300)])["hidden"]  # 512 positions x 128 B
    assert first.kv_bytes() == 512 * first.kv_bytes_per_token == 65_536
    need = last.growth_bytes(s2, 300)
    assert need == 512 * last.kv_bytes_per_token == 131_072 > budget_left(first, 150_000)
    with pytest.raises(NativeError, match="KV budget") as e:
        last.forward(s2, 0, hidden=h)
    assert e.value.status == ggswarm_lib.GGSWARM_E_BUDGET and last.kv_bytes() == 0
    first.close()  # its 64 KiB go back to the shared budget
    out = last.forward(s2, 0, hidden=h)
    assert 0 <= out["token"] < VOCAB and last.kv_bytes() == need
    last.close()


def budget_left(m: NativeModel, total: int) -> int:
    return total - m.kv_bytes()


def test_a_doubling_capacity_falls_back_to_the_exact_need_when_the_budget_is_short(
    native_lib: None, tiny_4k: Path
) -> None:
    per_token = NativeModel(tiny_4k, 0, 3).kv_bytes_per_token
    roomy, tight = NativeBudget(per_token * 2048), NativeBudget(per_token * 768)
    for budget, cap in ((roomy, 1024), (tight, 768)):
        with NativeModel(tiny_4k, 0, 3, budget=budget) as m:
            s = m.open_session(2048)
            m.forward(s, 0, token_ids=[1] * 256)
            m.forward(s, 256, token_ids=[2] * 256)  # 256 -> 512 positions: double
            assert m.kv_bytes(s) == 512 * per_token
            assert m.growth_bytes(s, 513) == 256 * per_token  # what it needs at least
            m.forward(s, 512, token_ids=[3])  # takes 1024 when the budget has room, else 768
            assert m.kv_bytes(s) == budget.used == cap * per_token


def test_a_snapshot_from_another_window_or_a_corrupt_one_is_refused(native_lib: None, tiny: Path) -> None:
    with (
        NativeModel(tiny, 0, 2) as a,
        NativeModel(tiny, 2, 3) as b,
        NativeModel(tiny, 0, 2, model_id="other") as c,
    ):
        sa = a.open_session(32)
        a.forward(sa, 0, token_ids=[5, 6, 7])
        snap = a.snapshot(sa)
        sb = b.open_session(32)
        with pytest.raises(NativeError, match="layer range") as e:
            b.restore(sb, snap)
        assert e.value.status == ggswarm_lib.GGSWARM_E_MISMATCH
        sc = c.open_session(32)
        with pytest.raises(NativeError, match="model id"):
            c.restore(sc, snap)
        with pytest.raises(NativeError, match="truncated"):
            a.restore(sa, snap[:-10])
        bad = bytearray(snap)
        bad[-1] ^= 0xFF
        with pytest.raises(NativeError, match="checksum"):
            a.restore(sa, bytes(bad))
        with pytest.raises(NativeError, match="magic"):
            a.restore(sa, b"\0" * len(snap))
        assert a.session_len(sa) == 3
        small = a.open_session(2)
        with pytest.raises(NativeError, match="cap"):
            a.restore(small, snap)


def test_split_windows_equal_the_whole_model_on_a_tiny_qwen2(native_lib: None, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2", tied=False)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with NativeModel(path, 0, 3) as whole, NativeModel(path, 0, 1) as a, NativeModel(path, 1, 3) as b:
        assert whole.architecture == "qwen2"
        sw, sa, sb = whole.open_session(64), a.open_session(64), b.open_session(64)
        ref = whole.forward(sw, 0, token_ids=ids, want_logits=True)["logits"]
        h = a.forward(sa, 0, token_ids=ids)["hidden"]
        got = b.forward(sb, 0, hidden=h, want_logits=True)["logits"]
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4)


def test_the_snapshot_header_has_the_documented_layout(native_lib: None, tiny: Path) -> None:
    import struct

    with NativeModel(tiny, 1, 3, model_id="abc123") as m:
        sid = m.open_session(64)
        m.forward(sid, 0, hidden=np.ones((5, D), dtype=np.float32))
        snap = m.snapshot(sid)
    magic, version, header_size = struct.unpack_from("<8sII", snap, 0)
    assert (magic, version, header_size) == (b"GGSWKVSN", 3, 200)
    assert snap[16:88].rstrip(b"\0") == b"abc123"
    assert snap[88:120].rstrip(b"\0") == b"llama"
    start, end, total, n_kv, hd, kv_type, n_pos, _, payload, _ = struct.unpack_from("<8iQQ", snap, 120)
    assert (start, end, total, n_kv, hd, kv_type, n_pos) == (1, 3, 3, 2, 16, 1, 5)
    assert payload == 2 * 2 * n_kv * hd * 2 * n_pos == len(snap) - 200
    n_kv_layers, n_recurrent_layers = struct.unpack_from("<2i", snap, 168)
    assert (n_kv_layers, n_recurrent_layers) == (2, 0)
    assert struct.unpack_from("<QQ", snap, 184) == (0, 0)  # no nextn block: no trailer


def test_the_backend_turns_native_errors_into_backend_errors(native_lib: None, tiny: Path) -> None:
    from agent.artifacts.manifest import build_manifest
    from agent.backends.base import AdmissionError, BackendError, ShardSpec, StepInput
    from agent.backends.native import NativeBackend
    from agent.wire.ids import SessionId
    from agent.wire.sampling import SamplingParams

    manifest = build_manifest(tiny)
    with pytest.raises(BackendError, match="layer range"):
        NativeBackend(ShardSpec(str(tiny), 0, 4, manifest))
    with pytest.raises(BackendError, match="n_threads"):
        NativeBackend(ShardSpec(str(tiny), 0, 3, manifest, n_threads=0))
    first = NativeBackend(ShardSpec(str(tiny), 0, 1, manifest, n_threads=1))
    last = NativeBackend(ShardSpec(str(tiny), 1, 3, manifest, n_threads=1), kv_budget=NativeBudget(100_000))
    sid = SessionId(bytes(16))
    first.open_session(sid, 64)
    last.open_session(sid, 64)
    with pytest.raises(BackendError, match="hidden size mismatch"):
        last.forward(StepInput(sid, 0, hidden=np.zeros((3, D - 1), dtype=np.float32)))
    with pytest.raises(BackendError, match="takes token ids"):
        first.forward(StepInput(sid, 0, hidden=np.zeros((3, D), dtype=np.float32)))
    with pytest.raises(BackendError, match="unknown session"):
        first.forward(StepInput(SessionId(b"x" * 16), 0, token_ids=np.array([1])))
    h = first.forward(StepInput(sid, 0, token_ids=np.array([1, 2, 3]))).hidden
    res = last.forward(
        StepInput(sid, 0, hidden=h, sampling=SamplingParams(temperature=0.7, seed=1), history=[1, 2, 3])
    )
    assert 0 <= res.token < VOCAB and res.logprob <= 0.0
    assert last.session_len(sid) == 3 and last.kv_bytes(sid) == last.kv_bytes() > 0
    other = SessionId(b"y" * 16)
    last.open_session(other, 256)  # 256 positions x 256 B more than the 100 kB budget has left
    with pytest.raises(AdmissionError, match="KV budget"):
        last.forward(StepInput(other, 0, hidden=np.zeros((200, D), dtype=np.float32)))
    half = NativeBackend(ShardSpec(str(tiny), 0, 1, manifest, n_threads=1), n_batch=7)
    half.open_session(sid, 64)
    h16 = half.forward(StepInput(sid, 0, token_ids=np.array([1, 2, 3]), hidden_dtype="f16")).hidden
    assert h16.dtype == np.float16 and np.array_equal(h16, h.astype(np.float16))
    # f16 rows go into the library as they are, and give exactly what their f32 values give
    rest = NativeBackend(ShardSpec(str(tiny), 1, 3, manifest, n_threads=1))
    a16, a32 = SessionId(b"p" * 16), SessionId(b"q" * 16)
    rest.open_session(a16, 64)
    rest.open_session(a32, 64)
    got16 = rest.forward(StepInput(a16, 0, hidden=h16, want_logits=True)).logits
    got32 = rest.forward(StepInput(a32, 0, hidden=h16.astype(np.float32), want_logits=True)).logits
    assert np.array_equal(got16, got32)
    rest.close()
    for be in (first, last, half):
        be.close()
    last.close()
