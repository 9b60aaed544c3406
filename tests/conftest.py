"""Shared fixtures: the packaged SmolLM2 model, its manifest, signing keys, real `agent serve` hops."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.dev.cluster import ServeHop, start_serve, wait_ready
from agent.procs import free_port, stop
from agent.wire.routetoken import generate_key, public_key_b64

__all__ = ["free_port"]  # test modules import agent.procs' free_port from here


def _redis_per_worker() -> None:
    """Under pytest-xdist (scripts/test.sh) each worker gets its own Redis database, before Django or a
    cluster reads REDIS_URL: two workers' control planes must not share Celery queues or channel groups."""
    worker, url = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("REDIS_URL", "")
    if worker.startswith("gw") and url.startswith("redis://"):
        base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
        os.environ["REDIS_URL"] = f"{base}/{1 + int(worker[2:])}"


_redis_per_worker()

# llama-cpp-python's ggml is built with OpenMP, whose barrier waits spin (GOMP's default: 300,000
# rounds) before sleeping; torch's OpenMP too. The suite runs three workers on two cores, where a
# spinning waiter burns the core its preempted peer needs: passive waits cut the llama.cpp-heavy native
# files' CPU time by 15% (wall 201 -> 174 s, AVX-512). Only the tests: the benches measure llama.cpp as
# it runs by default. Read by libgomp when it loads, so set before anything imports llama_cpp or torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
