"""Routing modes: layer windows across nodes, whole on one llamacpp node, or refused naming the fallback."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.artifacts import archs, routing
from agent.artifacts.routing import LAYERS, WHOLE, routing_mode


def test_an_architecture_with_layer_windows_routes_across_nodes() -> None:
    for arch in archs.SERVABLE_ARCHITECTURES:
        r = routing_mode(arch)
        assert (r.mode, r.servable) == (LAYERS, True)
        assert f"{arch!r} layer windows" in r.reason


def test_an_architecture_llama_cpp_runs_but_the_executor_does_not_runs_whole_on_one_llamacpp_node() -> None:
    r = routing_mode("phi3")
    assert (r.mode, r.servable) == (WHOLE, True)
    assert "'phi3' has no layer windows" in r.reason
    assert "whole model on one node with the llamacpp backend" in r.reason


def test_the_executor_refusing_the_file_itself_stays_a_refusal() -> None:
    r = routing_mode("qwen3", executor_problem="rope scaling type 'ntk' is unknown")
    assert not r.servable and r.mode == ""
    assert r.reason == (
        "not servable by this agent: the native executor refuses the file: rope scaling type 'ntk' is unknown"
    )


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("made-up-arch", "llama.cpp (llama-cpp-python 0.3.36) does not know 'made-up-arch' either"),
        ("bert", "llama.cpp knows 'bert' but does not decode text with it token by token"),
        ("t5", "llama.cpp knows 't5' but does not decode text"),
        ("clip", "llama.cpp knows 'clip' but does not decode text"),
    ],
)
def test_an_architecture_nothing_can_run_is_refused_naming_it_and_the_closed_fallback(
    arch: str, why: str
) -> None:
    r = routing_mode(arch)
    assert not r.servable and r.mode == ""
    assert r.reason.startswith(
        f"not servable by this agent: architecture {arch!r} has no layer-window executor"
    )
    assert "the fallback, a whole model on one node with the llamacpp backend, is closed too" in r.reason
    assert why in r.reason
    assert "qwen3moe" in r.reason  # and what does route across nodes


def test_the_issue_35_targets_are_known_to_llama_cpp_so_none_is_ever_refused_outright() -> None:
    for arch in ("deepseek2", "qwen3moe", "glm4moe", "gpt-oss", "minimax-m2", "deepseek4", "glm-dsa"):
        assert arch in routing.WHOLE_ARCHITECTURES


def test_the_whole_model_set_is_llama_cpp_s_names_less_the_ones_it_cannot_decode() -> None:
    assert len(routing.LLAMA_CPP_KNOWN) == 153
    assert routing.NOT_TEXT_DECODERS < routing.LLAMA_CPP_KNOWN
    assert routing.WHOLE_ARCHITECTURES == routing.LLAMA_CPP_KNOWN - routing.NOT_TEXT_DECODERS


def test_the_table_covers_every_architecture_the_installed_gguf_names() -> None:
    gguf = pytest.importorskip("gguf")
    # gguf 0.19.0 on PyPI lags the vendored llama.cpp (126 of 153 names): a newer gguf that names one
    # the table lacks means llama-cpp-python moved on and the table must be read again
    assert set(gguf.MODEL_ARCH_NAMES.values()) <= routing.LLAMA_CPP_KNOWN


def _libllama() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama-cpp-python is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    libs = sorted(root.glob("lib/libllama.*")) + sorted(root.glob("libllama.*"))
    if not libs:
        pytest.skip(f"no libllama next to {root}")
    return libs[0]


def test_every_name_of_the_table_is_in_the_installed_libllama() -> None:
    data = _libllama().read_bytes()
    # LLM_ARCH_NAMES is a table of C string literals, each stored NUL-terminated; the linker may keep
    # one as the tail of a longer one ("bert" inside "nomic-bert"), so only the end is certain
    missing = sorted(a for a in routing.LLAMA_CPP_KNOWN if a.encode() + b"\x00" not in data)
    assert not missing, f"the installed libllama lacks {missing}: read LLM_ARCH_NAMES again"


def test_a_manifest_says_how_its_model_routes(tiny_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.artifacts.manifest import build_manifest, format_manifest

    m = build_manifest(tiny_file, hash_tensors=False)
    assert m.routing.mode == LAYERS
    monkeypatch.setattr(archs, "SERVABLE_ARCHITECTURES", archs.SERVABLE_ARCHITECTURES - {"qwen3"})
    assert m.routing.mode == WHOLE and m.servable_problem  # no layer windows, yet servable whole
    assert "\nrouting     whole: architecture 'qwen3' has no layer windows" in format_manifest(m)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agent.artifacts.packaged import ModelNotFound, packaged_model_path
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny models carry SmolLM2's tokenizer: {e}")
    return write_tiny_gguf("qwen3", tmp_path_factory.mktemp("routing") / "qwen3.gguf")


def test_the_llamacpp_backend_runs_the_whole_file_and_counts_state_as_the_manifest_does(
    tiny_file: Path,
) -> None:
    pytest.importorskip("llama_cpp")
    import numpy as np

    from agent.artifacts.manifest import build_manifest
    from agent.backends import load_backend
    from agent.backends.base import BackendError, ShardSpec, StepInput
    from agent.wire.ids import SessionId
    from agent.wire.sampling import SamplingParams

    m = build_manifest(tiny_file, hash_tensors=False)
    with pytest.raises(BackendError, match="whole models only"):
        load_backend("llamacpp", ShardSpec(str(tiny_file), 0, m.n_layers - 1, m))
    b = load_backend("llamacpp", ShardSpec(str(tiny_file), 0, m.n_layers, m, n_threads=1))
    try:
        want = sum(layer.state_bytes(64) for layer in m.layers)
        assert b.kv_open_bytes(64) == want > 0
        sid = SessionId(bytes(16))
        b.open_session(sid, 64)
        assert b.kv_bytes(sid) == b.kv_bytes() == want
        out = b.forward(
            StepInput(
                sid, 0, token_ids=np.array([1, 2, 3], dtype=np.int32), sampling=SamplingParams(temperature=0)
            )
        )
        assert 0 <= out.token < b.n_vocab and b.session_len(sid) == 3
    finally:
        b.close()
