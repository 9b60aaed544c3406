"""The own ggml build's copy of a transposed view (native/patches/ggml-dup-transposed.patch, the V of MLA's
latent cache on every non-flash step) puts every element where ggml's element-by-element copy put it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OWN = REPO / "native" / "build" / "own"
LIBS = [OWN / "ggml-build" / "src" / f"lib{name}.a" for name in ("ggml", "ggml-cpu", "ggml-base")]


@pytest.fixture(scope="module")
def checker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not all(p.is_file() for p in LIBS):
        pytest.skip("no own ggml build (GGSWARM_GGML=shared links llama_cpp's unpatched ggml)")
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("ggml-copy") / "ggml_copy_check"
    src = Path(__file__).with_name("ggml_copy_check.cpp")
    cmd = [cxx, "-O2", "-std=c++17", f"-I{OWN / 'ggml-src' / 'include'}", str(src), *map(str, LIBS)]
    subprocess.run([*cmd, "-lpthread", "-lm", "-ldl", "-o", str(exe)], check=True, timeout=300)
    return exe


def test_a_transposed_copy_puts_every_element_where_the_source_has_it(checker: Path) -> None:
    run = subprocess.run([str(checker)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("all equal"), run.stdout + run.stderr


def test_the_patch_is_applied_to_the_sources_the_library_is_built_from() -> None:
    ops = OWN / "ggml-src" / "src" / "ggml-cpu" / "ops.cpp"
    if not ops.is_file():
        pytest.skip("no own ggml build")
    assert "ggswarm_copy_strided_rows" in ops.read_text()
