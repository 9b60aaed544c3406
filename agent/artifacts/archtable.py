"""The architectures the native executor runs, each declared once as data (issue 35's conformance kit).

One `ArchFacts` row per architecture says how its layers keep state (the family `archs.describe`
dispatches on, which also gives the manifest's state accounting and the placement planner's
unsplittable groups), what crosses a seam, how its tiny test file is shaped, and how the shared parity
suite (tests/native/test_archs.py) and bench/archs.py split it into 3 uneven hops. Everything else an
architecture needs is code in one place each: its graph (native/src/archs/<name>.cpp, which registers
itself with the C table) and its tiny file's tensors (agent/artifacts/layouts*.py, chosen by tiny.py).
docs/native.md's checklist walks a newcomer through adding a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# How an architecture's layers keep per-session state (archs.describe):
KV = "kv"  # K and V rows per token, the whole context (or a sliding window's ring: swa_pattern)
DELTA_NET = "delta_net"  # gated delta-net recurrent layers with full attention every N-th layer
MLA = "mla"  # multi-head latent attention: one latent row and a rope row per token
MLA_INDEXED = "mla_indexed"  # MLA plus a sparse-attention indexer whose shared layers stay with their group
DSV4 = "dsv4"  # DeepSeek-V4: a raw window, ratio-4 and ratio-128 compressed K, hyper-connection streams
FAMILIES = (KV, DELTA_NET, MLA, MLA_INDEXED, DSV4)

Splits = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Suite:
    """How the shared parity suite and bench/archs.py run the architecture's tiny file."""

    splits: Splits  # 3 uneven hops; seams where the architecture's state kinds change hands
    n_layers: int = 0  # the tiny file's layers for the suite (0: ArchFacts.tiny_layers)
    # whether a prompt's chunking leaves the logits unchanged: not behind routers (a one-position chunk's
    # single-column products round differently and expert choices amplify it, in llama.cpp alike)
    chunk_exact: bool = True
    tiny_options: dict[str, Any] = field(default_factory=dict)  # write_tiny_gguf keywords (rope_scaling)


@dataclass(frozen=True)
class ArchFacts:
    """One architecture's declared facts."""

    name: str  # general.architecture, as llama.cpp spells it
    family: str  # one of FAMILIES
    tiny_layers: int  # trunk layers of the default tiny file (agent/artifacts/tiny.py)
    suite: Suite
    batches: bool  # whether the executor runs several sessions' steps in one graph (else one by one)
    swa_pattern: int = 0  # llama.cpp's default sliding_window_pattern: every N-th layer global (0: none)
    seam_streams_key: str = ""  # metadata key of the residual streams crossing a seam (1 stream if "")
    seam_streams_default: int = 1
    wide_heads: bool = False  # the tiny file can take heads wide enough for quantized caches
    aliases: tuple[str, ...] = ()  # other general.architecture names the same graph runs
    # a real file a pip package ships (agent/artifacts/packaged.py) and its 3-hop split, run by the suite
    packaged: tuple[str, Splits] | None = None
    # Suite.chunk_exact for the real file: not with repacked weights (gemma3's Q4_K: ggml multiplies row
    # groups of 4 with one kernel and the rest with another, so chunking moves the logits)
    packaged_chunk_exact: bool = True


_TINY4: Splits = ((0, 1), (1, 3), (3, 4))
_QWEN3_YARN = {"type": "yarn", "factor": 4.0, "original_context_length": 256}

ARCHITECTURES: tuple[ArchFacts, ...] = (
    ArchFacts(
        "llama",
        KV,
        4,
        Suite(_TINY4),
        batches=True,
        aliases=("mistral", "qwen2"),
        packaged=("smollm2", ((0, 7), (7, 19), (19, 30))),
    ),
    ArchFacts("qwen3", KV, 4, Suite(_TINY4), batches=True),
    # five sliding-window layers, then a global one; seams around the global layer 5 of the tiny file
    # and before (5) and after (12) the real 270M's global layers 5, 11, 17 (its Q4_K weights are
    # repacked: ggml multiplies row groups of 4 with one kernel and the rest with another)
    ArchFacts(
        "gemma3",
        KV,
        6,
        Suite(((0, 2), (2, 5), (5, 6))),
        batches=True,
        swa_pattern=6,
        wide_heads=True,
        packaged=("gemma3", ((0, 5), (5, 12), (12, 18))),
        packaged_chunk_exact=False,
    ),
    # seams right before and right after the full-attention layer 3 of 8 (delta-net layers elsewhere)
    ArchFacts("qwen35", DELTA_NET, 8, Suite(((0, 3), (3, 4), (4, 8))), batches=False, wide_heads=True),
    ArchFacts("qwen35moe", DELTA_NET, 8, Suite(((0, 3), (3, 4), (4, 8))), batches=False, wide_heads=True),
    # ratios 0, 4, 128, 0, 4, 128: each hop holds a different mix of raw, compressed and indexer state
    ArchFacts(
        "deepseek4",
        DSV4,
        6,
        Suite(((0, 2), (2, 4), (4, 6)), chunk_exact=False),
        batches=False,
        seam_streams_key="hyper_connection.count",
        seam_streams_default=4,
    ),
    # 9 layers, full indexers at 0, 3 and 6: every seam sits right before one (the planner's groups)
    ArchFacts(
        "glm-dsa",
        MLA_INDEXED,
        6,
        Suite(((0, 3), (3, 6), (6, 9)), n_layers=9, chunk_exact=False),
        batches=False,
        wide_heads=True,
    ),
    # mixtures of experts with the real models' key sets; seams right after a dense layer 0 and between
    # expert layers. Qwen3-235B's 128K files declare YaRN (factor 4 over 32K): scaled so the text's
    # positions sit in the ramp between extrapolated and interpolated frequencies
    ArchFacts(
        "qwen3moe",
        KV,
        4,
        Suite(_TINY4, chunk_exact=False, tiny_options={"rope_scaling": _QWEN3_YARN}),
        batches=True,
    ),
    ArchFacts("glm4moe", KV, 4, Suite(_TINY4, chunk_exact=False), batches=True),
    ArchFacts("deepseek2", MLA, 4, Suite(_TINY4, chunk_exact=False), batches=False),
    # sinks, sliding-window layers 0 and 2 (window 128, outrun by the text), YaRN, MXFP4 experts
    ArchFacts("gpt-oss", KV, 4, Suite(_TINY4, chunk_exact=False), batches=True, swa_pattern=2),
    ArchFacts("minimax-m2", KV, 4, Suite(_TINY4, chunk_exact=False), batches=True),
)

BY_NAME: dict[str, ArchFacts] = {a.name: a for a in ARCHITECTURES}

# Families of architectures the manifest describes (audits, the whole-model fallback's memory) but the
# executor does not run.
DESCRIBED_ONLY: dict[str, str] = {"qwen3next": DELTA_NET, "deepseek32": MLA}


def facts(arch: str) -> ArchFacts | None:
    """The row of `arch` (an alias finds its graph's row); None when the executor does not run it."""
    if arch in BY_NAME:
        return BY_NAME[arch]
    return next((a for a in ARCHITECTURES if arch in a.aliases), None)


def family(arch: str) -> str:
    """How `arch`'s layers keep state; plain K/V for an architecture nothing here declares."""
    row = facts(arch)
    return row.family if row is not None else DESCRIBED_ONLY.get(arch, KV)


def suite_layers(a: ArchFacts) -> int:
    return a.suite.n_layers or a.tiny_layers
