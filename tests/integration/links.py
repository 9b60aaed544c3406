"""The integration tests' link harness: agent/dev/links.py's labs (hops in network namespaces behind
delaying, rate-limited links) as a fixture, and a greedy decode over a lab's route that times each step.

    from tests.integration.links import decode, lab_pool, link_labs  # noqa: F401 (a fixture)

`link_labs` is module-scoped: `link_labs(n)` opens a lab of `n` namespaces (skipping the test, with the
reason, where namespaces are unusable: not root, no `ip`, refused); every lab it opened is closed after
the module, namespaces and veths deleted, whatever the tests did (`lab_pool`, the context manager
underneath, is what closes them). `fresh_labs` is the same, closed after each test.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.dev.links import LinkLab, unusable
from agent.wire.ids import SessionId
from agent.wire.routetoken import RouteHop
from agent.wire.sampling import SamplingParams


@contextlib.contextmanager
def lab_pool(workdir: Callable[[], Path]) -> Iterator[Callable[..., LinkLab]]:
    """`open_lab(n, tls=True)` opens a lab of `n` namespaces in a fresh `workdir()`; every lab opened
    is closed on the way out, whatever happened inside."""
    labs: list[LinkLab] = []

    def open_lab(n: int, tls: bool = True) -> LinkLab:
        lab = LinkLab(n, workdir(), tls=tls)
        labs.append(lab)
        lab.open()
        return lab

    try:
        yield open_lab
    finally:
        for lab in labs:
            lab.close()


def _labs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LinkLab]]:
    if reason := unusable():
        pytest.skip(f"the link harness needs network namespaces: {reason}")
    with lab_pool(lambda: tmp_path_factory.mktemp("links")) as open_lab:
        yield open_lab


@pytest.fixture(scope="module")
def link_labs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LinkLab]]:
    yield from _labs(tmp_path_factory)


@pytest.fixture
def fresh_labs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LinkLab]]:
    """`link_labs` closed after each test rather than the module: a test's hops and peers stop (and
    free the CPU) before the next test starts its own."""
    yield from _labs(tmp_path_factory)


@pytest.fixture
def native_labs(fresh_labs: Callable[..., LinkLab]) -> Callable[..., LinkLab]:
    """`fresh_labs` for hops on the native backend: skips the test where libggswarm is not built."""
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh)")
    return fresh_labs


@dataclass
class Decoded:
    """Greedy tokens after the prompt, and each decode step's wall time (ms) as the client saw it."""

    tokens: list[int]
    step_ms: list[float]


async def decode(
    plan: list[tuple[str, str, int, int]],
    key: Any,  # noqa: ANN401 - the route-token signing key
    sha256: str,
    prompt: list[int],
    n: int,
    mode: str = "star",
    ssl_context: Any = None,  # noqa: ANN401
) -> Decoded:
    """Prefill `prompt` over the route `plan` ((node, url, start, end) per hop), then `n` greedy steps."""
    session = os.urandom(16)
    hops = minted_hops(key, SessionId(session), sha256, [RouteHop(*h) for h in plan])
    client = RouteClient(hops, session_id=session, mode=mode, ssl_context=ssl_context)
    out = Decoded([], [])
    try:
        tok = (await client.forward(prompt, SamplingParams())).token
        out.tokens.append(tok)
        for _ in range(n - 1):
            t0 = time.perf_counter()
            tok = (await client.forward([tok], SamplingParams())).token
            out.step_ms.append((time.perf_counter() - t0) * 1e3)
            out.tokens.append(tok)
    finally:
        await client.close()
    return out
