"""Quantized attention caches (q8_0, q4_0), as llama.cpp's --cache-type-k/-v: every architecture's files
that carry the real models' key sets, 3 hops at seams that cross every state kind, against llama.cpp run
with the same cache type (and so with flash attention, which it requires for a quantized V); the bytes
held are the manifest's estimate in that type; snapshots carry the quantized rows to another process;
what llama.cpp refuses is refused too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from agent.artifacts.archs import CACHE_TYPE_BYTES
from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.tiny import write_tiny_gguf
from agent.backends.ggswarm_lib import GGSWARM_E_UNSUPPORTED
from agent.backends.libggswarm import NativeError, NativeModel
from tests.native.routes import (
    close_sessions,
    here_and_in_another_process,
    llama_greedy,
    llama_with_cache,
    logits_rows,
    native_forward,
    native_greedy,
    native_hops,
    open_sessions,
)
from tests.native.tiny_gguf import write_small_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = [REPO / "tests" / "data" / n for n in ("teacher_forcing_en.txt", "native_lighthouse.txt")]
N_POSITIONS = 600
FLASH = -2  # ggswarm_model_info.decode_kernels: flash attention on every step

# file, its writer's options, 3 uneven hops whose seams cross every state kind, and the cache type:
# deepseek4's raw ring | ratio-4 | ratio-128 layers (DeepSeek-V4-Flash's keys, YaRN included); glm-dsa's
# latents with full and shared indexers (GLM-5.2's keys); qwen35's recurrent and attention layers
# (Qwen3.5's M-RoPE sections); qwen35moe in q4_0
CASES = {
    "deepseek4-q8_0": ("deepseek4", {}, [(0, 2), (2, 4), (4, 6)], "q8_0"),
    "glm-dsa-q8_0": ("glm-dsa", {"wide_heads": True, "n_layers": 9}, [(0, 3), (3, 6), (6, 9)], "q8_0"),
    "qwen35-q8_0": ("qwen35", {"wide_heads": True}, [(0, 3), (3, 4), (4, 8)], "q8_0"),
    "qwen35moe-q4_0": ("qwen35moe", {"wide_heads": True}, [(0, 3), (3, 4), (4, 8)], "q4_0"),
    # mixtures of experts (heads of 64; deepseek2's latent row 64 + 32, not rotated, as llama.cpp's MLA)
    "qwen3moe-q8_0": ("qwen3moe", {}, [(0, 1), (1, 3), (3, 4)], "q8_0"),
    "glm4moe-q8_0": ("glm4moe", {}, [(0, 1), (1, 3), (3, 4)], "q8_0"),
    "deepseek2-q8_0": ("deepseek2", {}, [(0, 1), (1, 3), (3, 4)], "q8_0"),
    # attention sinks in flash attention over q8_0 caches, sliding-window rings outrun (window 128)
    "gpt-oss-q8_0": ("gpt-oss", {}, [(0, 1), (1, 3), (3, 4)], "q8_0"),
    # q and k normed across heads before the rotation, RoPE on half of each head
    "minimax-m2-q8_0": ("minimax-m2", {}, [(0, 1), (1, 3), (3, 4)], "q8_0"),
}


def _text_ids(llama, n: int) -> list[int]:  # noqa: ANN001
    ids = list(llama.tokenize(b"\n\n".join(t.read_bytes() for t in TEXTS), add_bos=False))
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, (arch, kwargs, _, _) in CASES.items():
        out[name] = str(write_tiny_gguf(arch, d / f"{name}.gguf", **kwargs))  # type: ignore[arg-type]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_three_hops_agree_with_llama_cpp_run_with_the_same_quantized_cache(
    native_lib: None, files: dict[str, str], case: str
) -> None:
    arch, _, splits, cache_type = CASES[case]
    path = files[case]
    ids_everywhere = arch == "deepseek4"  # its hash-routed layers read the token ids on every hop
    llm = llama_with_cache(path, cache_type)
    try:
        ids = _text_ids(llm, N_POSITIONS)
        llm.eval(ids)
        ref = np.array(llm.scores[:N_POSITIONS], dtype=np.float32)
        want_greedy = llama_greedy(llm, ids[:120], 32)
    finally:
        llm.close()
    hops = native_hops(path, splits, cache_type)
    try:
        assert [h.info.decode_kernels for h in hops] == [FLASH] * 3
        sids = open_sessions(hops)
        try:
            got = logits_rows(native_forward(hops, sids, 0, ids, ids_everywhere=ids_everywhere), N_POSITIONS)
        finally:
            close_sessions(hops, sids)
        greedy = native_greedy(hops, ids[:120], 32, ids_everywhere=ids_everywhere)
    finally:
        for h in hops:
            h.close()
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    print(f"\n{case}: flash attention, top-1 {agree:.4f}, max |logit diff| {np.abs(got - ref).max():.3g}")
    assert agree >= 0.995
    assert greedy == want_greedy


# gemma3 with Gemma 3 270M's heads (256 wide: 4 query heads, 1 kv head; the tiny file's 16 are no whole
# q8_0 block) and its 32-position sliding window, whose rings hold pad256(32 + n_ubatch 512) = 768 slots
# in llama.cpp's SWA cache and ours; seams after sliding layers 1 and 4, before the global layer 5
GEMMA3_SPLITS = [(0, 2), (2, 5), (5, 6)]
GEMMA3_RING = 768
GEMMA3_POSITIONS = 1600  # twice around the ring: wraps at 768 and 1536


@pytest.mark.slow
def test_gemma3s_quantized_sliding_window_rings_agree_with_llama_cpp_past_the_wrap(
    native_lib: None, tmp_path: Path
) -> None:
    """gemma3 (heads of 256) in q8_0 over 1,600 positions, twice around its sliding layers' 768-slot rings,
    is llama.cpp's bit for bit when llama.cpp keeps the same rings (swa_full off: its own SWA cache)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = str(write_tiny_gguf("gemma3", tmp_path / "gemma3.gguf", wide_heads=True))
    n = GEMMA3_POSITIONS
    assert n > 2 * GEMMA3_RING
    llm = llama_cpp.Llama(
        model_path=path,
        logits_all=True,
        n_ctx=2048,
        n_threads=2,
        flash_attn=True,
        type_k=8,  # GGML_TYPE_Q8_0
        type_v=8,
        swa_full=False,
        verbose=False,
    )
    try:
        ids = list(llm.tokenize(b"\n\n".join(t.read_bytes() for t in TEXTS * 2), add_bos=False))[:n]
        assert len(ids) == n
        llm.eval(ids)
        ref = np.array(llm.scores[:n], dtype=np.float32)
    finally:
        llm.close()
    hops = native_hops(path, GEMMA3_SPLITS, "q8_0")
    try:
        assert [h.info.decode_kernels for h in hops] == [FLASH] * 3
        sids = [h.open_session(2048) for h in hops]
        got = logits_rows(native_forward(hops, sids, 0, ids), n)
    finally:
        for h in hops:
            h.close()
    assert np.array_equal(got, ref), float(np.abs(got - ref).max())


@pytest.fixture(scope="module")
def state_files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Manifest]]:
    """arch -> its tiny file and manifest, written once for both cache types. No llama.cpp reads these:
    their tokenizer is a 256-token one (the state depends on no vocabulary; the figures are the same as
    with SmolLM2's): the files are a few KB and copy no 49,152-token vocabulary."""
    d = tmp_path_factory.mktemp("quantized-state")
    tokenizer = write_small_tokenizer(d / "tokenizer.gguf")
    built: dict[str, tuple[Path, Manifest]] = {}

    def get(arch: str) -> tuple[Path, Manifest]:
        if arch not in built:
            kwargs = {"wide_heads": True} if arch in ("glm-dsa", "qwen35") else {}
            path = write_tiny_gguf(arch, d / f"{arch}.gguf", tokenizer_from=tokenizer, **kwargs)  # type: ignore[arg-type]
            built[arch] = (path, build_manifest(str(path), hash_tensors=False))
        return built[arch]

    return get


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["deepseek4", "glm-dsa", "qwen35", "glm4moe", "deepseek2"])
def test_the_bytes_a_session_holds_are_the_manifests_estimate_in_that_type(
    native_lib: None, state_files: Callable[[str], tuple[Path, Manifest]], arch: str, cache_type: str
) -> None:
    path, manifest = state_files(arch)
    n = 1024
    with NativeModel(str(path), 0, manifest.n_layers, n_threads=2) as model:
        model.set_checkpoints(0, 0)  # the state alone
        f16 = _held(model, n)
        model.set_cache_type(cache_type)
        held = _held(model, n)
    estimate = sum(layer.state_bytes(n, CACHE_TYPE_BYTES[cache_type]) for layer in manifest.layers)
    assert abs(held - estimate) <= 0.05 * estimate, (held, estimate)
    assert held < f16


def _held(model: NativeModel, n: int) -> int:
    sid = model.open_session(n)
    try:
        model.forward(sid, 0, token_ids=np.random.default_rng(0).integers(1, 200, n, dtype=np.int32))
        return model.kv_bytes(sid)
    finally:
        model.close_session(sid)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek4-q8_0", "qwen35-q8_0"])
def test_a_quantized_snapshot_continues_identically_in_another_process(
    native_lib: None, files: dict[str, str], tmp_path: Path, case: str
) -> None:
    arch, _, splits, cache_type = CASES[case]
    path = files[case]
    prompt = [int(t) for t in np.random.default_rng(3).integers(1, 200, 300)]
    hops = native_hops(path, splits, cache_type)
    try:
        here, there = here_and_in_another_process(
            path, hops, splits, prompt, tmp_path, ids_everywhere=arch == "deepseek4", cache_type=cache_type
        )
    finally:
        for h in hops:
            h.close()
    assert here == there


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("qwen35", "does not divide the head size 16"),  # llama.cpp: "K cache type q8_0 ... does not divide"
        ("glm-dsa", "does not divide the head size 48"),  # a 32 + 16 latent row
    ],
)
def test_heads_a_quantized_block_does_not_divide_are_refused_as_llama_cpp_refuses_them(
    native_lib: None, tmp_path: Path, arch: str, why: str
) -> None:
    path = write_tiny_gguf(arch, tmp_path / f"{arch}.gguf")
    with NativeModel(str(path), 0, 1, n_threads=1) as model:
        at_open = (model.info.decode_kernels, model.info.kv_bytes_per_token)
        with pytest.raises(NativeError) as e:
            model.set_cache_type("q8_0")
        assert e.value.status == GGSWARM_E_UNSUPPORTED
        assert why in str(e.value)
        # and the handle keeps its f16 caches and its attention mode
        assert (model.info.decode_kernels, model.info.kv_bytes_per_token) == at_open


def test_a_quantized_cache_turns_flash_attention_on_and_f16_turns_it_back(
    native_lib: None, model_path: str
) -> None:
    with NativeModel(model_path, 0, 2, n_threads=1) as model:
        at_open = model.info.decode_kernels
        model.set_cache_type("q8_0")
        assert model.info.decode_kernels == FLASH
        model.set_cache_type("f16")
        assert model.info.decode_kernels == at_open


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_smollm2_in_quantized_caches_is_llama_cpps_bit_for_bit(
    native_lib: None, model_path: str, cache_type: str
) -> None:
    """A llama-family model (head 64: keys and values rotated by order 64) over 3 hops."""
    llm = llama_with_cache(model_path, cache_type)
    try:
        ids = list(llm.tokenize(TEXTS[1].read_bytes(), add_bos=False))
        llm.eval(ids)
        ref = np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    hops = native_hops(model_path, [(0, 10), (10, 20), (20, 30)], cache_type)
    try:
        sids = open_sessions(hops)
        got = logits_rows(native_forward(hops, sids, 0, ids), len(ids))
    finally:
        for h in hops:
            h.close()
    assert np.array_equal(got, ref), float(np.abs(got - ref).max())


def test_a_nodes_flash_attention_and_cache_type_reach_its_native_shards(
    native_lib: None, model_path: str
) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agent.artifacts.manifest import build_manifest
    from agent.backends.base import BackendError
    from agent.node.dataplane import DataPlane

    key = Ed25519PrivateKey.generate().public_key()
    manifest = build_manifest(model_path, hash_tensors=False)
    modes = {}
    for cache_type, flash in [("f16", "on"), ("f16", "off"), ("q8_0", "auto")]:
        dp = DataPlane("node-a", key, cache_type=cache_type, flash_attn=flash)
        shard = dp.load_shard(model_path, manifest, 0, 2, backend="native", n_threads=1)
        try:
            modes[(cache_type, flash)] = shard.backend.model.info.decode_kernels  # type: ignore[attr-defined]
        finally:
            shard.backend.close()
    assert modes[("f16", "on")] == FLASH
    assert modes[("f16", "off")] != FLASH
    assert modes[("q8_0", "auto")] == FLASH  # llama.cpp's auto turns it on for a quantized V
    dp = DataPlane("node-b", key, cache_type="q8_0", flash_attn="off")
    with pytest.raises(BackendError, match="requires flash attention"):
        dp.load_shard(model_path, manifest, 0, 2, backend="native", n_threads=1)
