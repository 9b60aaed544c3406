"""Shared fixtures: the packaged SmolLM2 model, its manifest, signing keys, real `serve` processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.procs import Process, free_port, spawn, stop, wait_http
from agent.wire.routetoken import generate_key, public_key_b64

REPO = Path(__file__).resolve().parent.parent


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


class ServeProcess:
    """A real `python -m agent serve` process on 127.0.0.1."""

    def __init__(self, proc: Process, url: str, node_id: str, log: Path) -> None:
        self.proc, self.url, self.node_id, self.log = proc, url, node_id, log

    def stop(self) -> None:
        stop([self.proc])


@pytest.fixture(scope="module")
def serve_factory(
    tmp_path_factory: pytest.TempPathFactory, signing_key, model_path: str
) -> Iterator[Callable[..., ServeProcess]]:  # noqa: ANN001
    procs: list[ServeProcess] = []
    logdir = tmp_path_factory.mktemp("serve-logs")
    pub = public_key_b64(signing_key.public_key())

    def start(
        layers: str, backend: str = "torch", extra: list[str] | None = None, wait: bool = True
    ) -> ServeProcess:
        port = free_port()
        node_id = f"node-{port}"
        log = logdir / f"serve-{port}.log"
        cmd = [
            sys.executable,
            "-m",
            "agent",
            "serve",
            "--model",
            model_path,
            "--layers",
            layers,
            "--backend",
            backend,
            "--port",
            str(port),
            "--public-key",
            pub,
            "--node-id",
            node_id,
            "--threads",
            "1",
            *(extra or []),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = spawn(cmd, log, env=env, cwd=REPO)
        sp = ServeProcess(proc, f"http://127.0.0.1:{port}", node_id, log)
        procs.append(sp)
        if wait:
            wait_http(sp.url + "/v1/health", procs=[proc])
        return sp

    yield start
    stop([p.proc for p in procs])
