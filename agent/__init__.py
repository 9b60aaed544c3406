"""GGUF Swarm node agent: runs layer ranges of GGUF models and serves them over the data plane."""

from __future__ import annotations

__version__ = "0.1.0"
