"""Whether the native executor opens a model file: the check behind "servable" in inspect and the catalog."""

from __future__ import annotations

import dataclasses
import os

from agent.artifacts.manifest import Manifest
from agent.backends import ggswarm_lib


def with_executor_check(manifest: Manifest, path: str | os.PathLike[str]) -> Manifest:
    """`manifest` with `executor_problem` set from libggswarm's own reading of `path` (hyper-parameters
    with llama.cpp's types and fallbacks, every layer's tensor table; no weight is read).

    A manifest whose architecture is not in the executor's table already says why; where the library
    is not built (a control plane without the native build) the architecture list is all there is to go
    by, and the manifest is returned unchanged.
    """
    if manifest.servable_problem or not ggswarm_lib.is_available():
        return manifest
    return dataclasses.replace(manifest, executor_problem=ggswarm_lib.check_file(path))
