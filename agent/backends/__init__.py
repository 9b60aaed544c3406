"""Backends: one interface to load a layer range, open/close sessions and forward batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package stays light: the ctypes binding alone must not pull in gguf and the manifest
    from agent.backends.base import Backend, ShardSpec

__all__ = ["available_backends", "load_backend"]


def available_backends() -> list[str]:
    """Names of the backends whose dependencies import on this host."""
    names: list[str] = []
    try:
        import torch  # noqa: F401

        names.append("torch")
    except ImportError:
        pass
    try:
        import llama_cpp  # noqa: F401

        names.append("llamacpp")
    except ImportError:
        pass
    try:
        from agent.backends import ggswarm_lib as native

        if native.is_available():
            names.insert(0, "native")
    except (ImportError, OSError):
        pass
    return names


def load_backend(name: str, spec: ShardSpec, **options: object) -> Backend:
    """Instantiate backend `name` for the shard described by `spec`."""
    if name == "torch":
        from agent.backends.torch_llama import TorchLlamaBackend

        return TorchLlamaBackend(spec, **options)  # type: ignore[arg-type]  # options are per backend; each checks its own
    if name == "llamacpp":
        from agent.backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend(spec, **options)  # type: ignore[arg-type]  # options are per backend; each checks its own
    if name == "native":
        from agent.backends.native import NativeBackend

        return NativeBackend(spec, **options)
    from agent.backends.base import BackendError

    raise BackendError(f"unknown backend {name!r}; available: {', '.join(available_backends()) or 'none'}")
