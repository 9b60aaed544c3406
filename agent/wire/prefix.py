"""Shared prompt prefixes: how long two token sequences agree, and a prefix's name, a digest of its ids
(prefix snapshots, docs/protocol.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 32
_DOMAIN = b"ggswarm-prefix-v1\0"  # so no other sha256 the swarm computes can name a prefix


def prefix_digest(ids: Sequence[int] | np.ndarray) -> bytes:
    """sha256 of the ids as little-endian int32, domain-separated; the hop adds model and range."""
    return hashlib.sha256(_DOMAIN + np.asarray(ids, dtype="<i4").tobytes()).digest()


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
