"""RoPE scaling and the other keys the real files carry, read as llama.cpp reads them: DeepSeek-V4-Flash's
YaRN (with and without rope.scaling.original_context_length), its per-layer SwiGLU clamps written as an
array, and the errors for what llama.cpp would not run; `ggswarm_check_file` says so before any weight
is read, and the manifest's "servable" follows it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.manifest import build_manifest
from agent.artifacts.tiny import DEEPSEEK4_FLASH_ROPE_SCALING, write_tiny_gguf
from agent.backends import libggswarm
from agent.backends.check import with_executor_check
from agent.backends.libggswarm import NativeError, NativeModel
from tests.native.routes import (
    close_sessions,
    llama_greedy,
    llama_with_cache,
    logits_rows,
    native_forward,
    native_greedy,
    open_sessions,
)

REPO = Path(__file__).resolve().parents[2]
# both held-out texts, one after the other: about 880 tokens
TEXTS = [REPO / "tests" / "data" / n for n in ("teacher_forcing_en.txt", "native_lighthouse.txt")]
SPLITS = [(0, 2), (2, 4), (4, 6)]  # ratios 0, 4 | 128, 0 | 4, 128: every state kind on both sides of a seam
N_POSITIONS = 600  # past the 16-position raw window, many ratio-4 blocks and four ratio-128 blocks
MAX_LOGIT_DIFF = 1e-3  # the other architectures' YaRN check, f32 caches on both sides
NO_ORIG_CTX = {k: v for k, v in DEEPSEEK4_FLASH_ROPE_SCALING.items() if k != "original_context_length"}
# alternating limits, one per layer of the file: 0.5 clamps most gate and up values of the tiny model
BITING_CLAMPS = [10.0, 0.5, 10.0, 0.5, 10.0, 0.5]


def _text_ids(llama, n: int) -> list[int]:  # noqa: ANN001
    ids = list(llama.tokenize(b"\n\n".join(t.read_bytes() for t in TEXTS), add_bos=False))
    assert len(ids) >= n
    return ids[:n]


VARIANTS = {
    "yarn-without-original-context": {"rope_scaling": NO_ORIG_CTX},
    "per-layer-clamps-that-bite": {"swiglu_clamp": BITING_CLAMPS},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp(request.param)
    return str(write_tiny_gguf("deepseek4", d / "deepseek4.gguf", **VARIANTS[request.param]))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["f16", "f32"])
def test_three_hops_agree_with_llama_cpp_over_six_hundred_positions(
    native_lib: None, variant: str, cache_type: str
) -> None:
    """Both with the same cache type: f16 (llama.cpp's default and the node's) or f32. The graph follows
    llama.cpp's op sequence, so in either the logits are llama.cpp's bit for bit (before, ~5e-5 apart in
    f32, and in f16 a value that rounded differently now and then flipped an expert or a top-k choice)."""
    llm = llama_with_cache(variant, cache_type)
    try:
        ids = _text_ids(llm, N_POSITIONS)
        llm.eval(ids)
        ref = np.array(llm.scores[:N_POSITIONS], dtype=np.float32)  # a copy: greedy reuses the buffer
        want_greedy = llama_greedy(llm, ids[:120], 32)
    finally:
        llm.close()
    hops = [NativeModel(variant, a, b, n_threads=2) for a, b in SPLITS]
    try:
        for h in hops:
            h.set_cache_type(cache_type)
        sids = open_sessions(hops)
        try:
            got = logits_rows(native_forward(hops, sids, 0, ids, ids_everywhere=True), N_POSITIONS)
        finally:
            close_sessions(hops, sids)
        greedy = native_greedy(hops, ids[:120], 32, ids_everywhere=True)
    finally:
        for h in hops:
            h.close()
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    diff = float(np.abs(got - ref).max())
    print(f"\n{Path(variant).parent.name} {cache_type}: top-1 {agree:.4f}, max |logit diff| {diff:.3g}")
    assert agree >= 0.995
    assert greedy == want_greedy
    assert diff == 0.0


@pytest.mark.slow
def test_the_keys_change_what_llama_cpp_computes(tmp_path: Path) -> None:
    """The parity above means something only if YaRN, its fallback and the clamps move the logits."""
    files = {
        "yarn": write_tiny_gguf("deepseek4", tmp_path / "yarn.gguf"),
        "none": write_tiny_gguf("deepseek4", tmp_path / "none.gguf", rope_scaling={}),
        "no-orig": write_tiny_gguf("deepseek4", tmp_path / "noorig.gguf", rope_scaling=NO_ORIG_CTX),
        "clamped": write_tiny_gguf("deepseek4", tmp_path / "clamp.gguf", swiglu_clamp=BITING_CLAMPS),
    }
    logits = {}
    for name, path in files.items():
        llm = llama_with_cache(str(path))
        try:
            ids = _text_ids(llm, 300)
            llm.eval(ids)
            logits[name] = np.asarray(llm.scores[:300], dtype=np.float32)
        finally:
            llm.close()
    for other in ("none", "no-orig", "clamped"):
        assert float(np.abs(logits["yarn"] - logits[other]).max()) > 0.1, other


def _problem(path: Path) -> str:
    return libggswarm.check_file(path)


def test_the_flash_files_keys_open(native_lib: None, tmp_path: Path) -> None:
    path = write_tiny_gguf("deepseek4", tmp_path / "ds4.gguf")
    assert _problem(path) == ""
    with NativeModel(str(path), 0, 2, n_threads=1) as m:
        assert m.info.architecture == b"deepseek4"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rope_scaling": {"type": "ntk"}}, "rope.scaling.type 'ntk' is unknown"),
        (
            {"rope_scaling": {**DEEPSEEK4_FLASH_ROPE_SCALING, "yarn_beta_fast": 16.0}},
            "yarn_beta_fast must be 32",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": -2.0}},
            "rope.scaling.factor is not a non-negative number",
        ),
        ({"swiglu_clamp": [10.0, 10.0]}, "swiglu_clamp_exp is malformed"),
    ],
    ids=["unknown-type", "beta-llama-cpp-ignores", "negative-factor", "clamp-array-too-short"],
)
def test_a_key_the_executor_cannot_read_as_llama_cpp_does_is_refused_at_open_and_by_the_check(
    native_lib: None, tmp_path: Path, kwargs: dict, message: str
) -> None:
    path = write_tiny_gguf("deepseek4", tmp_path / "bad.gguf", **kwargs)
    assert message in _problem(path)
    with pytest.raises(NativeError, match=message.split(" ")[0]):
        NativeModel(str(path), 0, 6, n_threads=1)


def test_a_missing_layer_tensor_is_found_by_the_check_without_reading_weights(
    native_lib: None, tmp_path: Path
) -> None:
    good = write_tiny_gguf("qwen3", tmp_path / "good.gguf")
    # the same file with one late layer's tensor renamed in the table: only a full window check sees it
    data = bytearray(good.read_bytes())
    name = b"blk.3.ffn_down.weight"
    at = data.index(name)
    data[at : at + len(name)] = b"blk.3.ffn_dowX.weight"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert _problem(good) == ""
    assert "blk.3.ffn_down.weight is missing" in _problem(bad)


def test_inspect_calls_a_file_the_executor_refuses_not_servable(native_lib: None, tmp_path: Path) -> None:
    path = write_tiny_gguf("deepseek4", tmp_path / "bad.gguf", rope_scaling={"type": "ntk"})
    plain = build_manifest(path, hash_tensors=False)
    assert plain.servable_problem == ""  # the architecture alone says yes
    checked = with_executor_check(plain, path)
    assert "native executor refuses the file" in checked.servable_problem
    assert "'ntk' is unknown" in checked.servable_problem
    again = type(checked).from_json(checked.to_json())
    assert again.servable_problem == checked.servable_problem
    ok = write_tiny_gguf("deepseek4", tmp_path / "ok.gguf")
    assert with_executor_check(build_manifest(ok, hash_tensors=False), ok).servable_problem == ""


# The generic path: every architecture whose real files may declare YaRN (Qwen3's long-context files do;
# GLM's pre-scale its attention by YaRN's magnitude) rotates as llama.cpp does. Scaled down: factor 4
# over an original context of 256, so the 300 positions sit in the ramp between extrapolated and
# interpolated frequencies.
SMALL_YARN = {"type": "yarn", "factor": 4.0, "original_context_length": 256}
GENERIC = {
    # (layers, windows: glm-dsa's start at full-indexer layers; qwen35's cross recurrent and attention)
    "glm-dsa": (9, [(0, 3), (3, 6), (6, 9)]),
    "qwen35": (8, [(0, 3), (3, 4), (4, 8)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(GENERIC))
def test_yarn_in_other_architectures_agrees_with_llama_cpp_over_three_hops(
    native_lib: None, arch: str, tmp_path: Path
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    n_layers, splits = GENERIC[arch]
    path = str(write_tiny_gguf(arch, tmp_path / f"{arch}.gguf", n_layers=n_layers, rope_scaling=SMALL_YARN))
    plain = str(write_tiny_gguf(arch, tmp_path / "plain.gguf", n_layers=n_layers))
    hops = [NativeModel(path, a, b, n_threads=2) for a, b in splits]
    try:
        flash = hops[0].info.decode_kernels == -2  # its attention mode decides llama.cpp's, as in test_archs
        refs = []
        for p in (path, plain):
            llm = llama_cpp.Llama(
                model_path=p, logits_all=True, n_ctx=1024, n_threads=2, flash_attn=flash, verbose=False
            )
            try:
                ids = _text_ids(llm, 300)
                llm.eval(ids)
                refs.append(np.asarray(llm.scores[:300], dtype=np.float32))
            finally:
                llm.close()
        sids = open_sessions(hops)
        try:
            got = logits_rows(native_forward(hops, sids, 0, ids), 300)
        finally:
            close_sessions(hops, sids)
    finally:
        for h in hops:
            h.close()
    ref, unscaled = refs
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    diff = float(np.abs(got - ref).max())
    print(f"\n{arch} yarn: top-1 {agree:.4f}, max |logit diff| {diff:.3g}")
    assert float(np.abs(ref - unscaled).max()) > 0.1  # YaRN moves llama.cpp's logits here
    assert agree >= 0.995
    assert diff <= MAX_LOGIT_DIFF
