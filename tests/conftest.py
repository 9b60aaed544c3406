"""Shared fixtures: the packaged SmolLM2 model, its manifest, signing keys, real `agent serve` hops."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.dev.cluster import ServeHop, start_serve, wait_ready
from agent.procs import free_port, stop
from agent.wire.routetoken import generate_key, public_key_b64

__all__ = ["free_port"]  # test modules import agent.procs' free_port from here


@pytest.fixture(scope="session")
def model_path() -> str:
    try:
        return str(packaged_model_path("smollm2"))
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def manifest(model_path: str) -> Manifest:
    return build_manifest(model_path)


@pytest.fixture(scope="session")
def signing_key():  # noqa: ANN201
    return generate_key()


@pytest.fixture(scope="module")
def serve_factory(
    tmp_path_factory: pytest.TempPathFactory, signing_key, model_path: str
) -> Iterator[Callable[..., ServeHop]]:  # noqa: ANN001
    """Start real `agent serve` hops (agent/dev/cluster.py, the launcher the benchmarks use too), each
    waited for until `/v1/health` answers unless `wait=False`; every one is stopped after the module."""
    hops: list[ServeHop] = []
    logdir = tmp_path_factory.mktemp("serve-logs")
    pub = public_key_b64(signing_key.public_key())

    def start(
        layers: str, backend: str = "torch", extra: list[str] | None = None, wait: bool = True
    ) -> ServeHop:
        hop = start_serve(
            model_path,
            layers,
            public_key=pub,
            logdir=logdir,
            backend=backend,
            threads=1,
            extra=extra or (),
            wait=False,
        )
        hops.append(hop)
        if wait:
            wait_ready(hop)
        return hop

    yield start
    stop([h.proc for h in hops])
