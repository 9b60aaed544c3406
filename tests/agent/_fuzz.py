"""Shared hypothesis settings and mutation strategies for tests/agent/test_fuzz_*.py (bounded for CI)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Bounded: a fixed example count, a per-example deadline, and the same examples every run (CI).
FUZZ = settings(
    max_examples=300,
    deadline=500,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """`valid` with a few byte flips, a truncation, an insertion or a splice: close enough to get
    past the first checks, which is where decoders go wrong."""
    buf = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "dup"]))
        if not buf:
            buf += draw(st.binary(min_size=1, max_size=8))
            continue
        at = draw(st.integers(0, len(buf) - 1))
        if how == "flip":
            buf[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "set":
            buf[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
        elif how == "truncate":
            del buf[at:]
        elif how == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif how == "delete":
            del buf[at : at + draw(st.integers(1, 16))]
        else:
            buf += buf[at : at + draw(st.integers(1, 64))]
    return bytes(buf)
