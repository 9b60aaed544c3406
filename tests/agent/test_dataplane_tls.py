"""Mutual TLS on the data plane, on 127.0.0.1: pinned to the swarm CA and to the node the token names."""

from __future__ import annotations

import base64
import os
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import ClientError, ClientSession, TCPConnector, web

from agent.artifacts.manifest import Manifest, build_manifest
from agent.artifacts.packaged import ModelNotFound, packaged_model_path
from agent.client.recovery import minted_hops
from agent.client.route import RouteClient
from agent.node.dataplane import DataPlane, start_dataplane
from agent.wire import tls
from agent.wire.frames import ChainHop, Kind, Op, Request, encode_request
from agent.wire.handofftoken import mint_handoff
from agent.wire.routetoken import RouteHop, mint_route
from agent.wire.sampling import SamplingParams
from tests.conftest import free_port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Manifest]:
    from agent.artifacts.tiny import write_tiny_gguf

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(f"the tiny model's tokenizer comes from SmolLM2: {e}")
    path = write_tiny_gguf("llama", tmp_path_factory.mktemp("tiny") / "llama.gguf")
    return str(path), build_manifest(path)


class Pki:
    """A CA in a directory, issuing certificates the way enrollment does (node key + CSR)."""

    def __init__(self, root: Path, name: str = "swarm") -> None:
        self.dir = root / name
        self.ca_key, self.ca_cert = tls.load_or_create_ca(self.dir)

    def issue(self, identity: str, hosts: list[str] | None = None) -> tuple[Path, Path]:
        key = tls.make_key()
        stem = identity.rsplit(":", 1)[-1]
        key_path, cert_path = self.dir / f"{stem}.key", self.dir / f"{stem}.crt"
        tls.write_private(key_path, tls.key_pem(key))
        csr = tls.make_csr(key, stem)
        cert_path.write_bytes(
            tls.issue_cert(self.ca_key, self.ca_cert, csr, identity, hosts or ["127.0.0.1"])
        )
        return cert_path, key_path

    @property
    def ca_path(self) -> Path:
        return self.dir / "ca.crt"

    def server(self, node_id: str) -> ssl.SSLContext:
        cert, key = self.issue(tls.node_identity(node_id))
        return tls.server_context(cert, key, self.ca_path)

    def client(self, identity: str) -> ssl.SSLContext:
        cert, key = self.issue(identity)
        return tls.client_context(cert, key, self.ca_path)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
async def https_nodes(tiny, signing_key) -> AsyncIterator[Callable[..., Any]]:  # noqa: ANN001
    started: list[web.AppRunner] = []

    async def start(
        node_id: str,
        a: int,
        b: int,
        server: ssl.SSLContext,
        client: ssl.SSLContext | None,
        backend: str = "torch",
    ) -> str:
        path, manifest = tiny
        dp = DataPlane(node_id, signing_key.public_key(), client_ssl=client)
        dp.load_shard(path, manifest, a, b, backend=backend, n_threads=1)
        port = free_port()
        started.append(await start_dataplane(dp, "127.0.0.1", port, ssl_context=server))
        return f"https://127.0.0.1:{port}"

    yield start
    for r in started:
        await r.cleanup()


def _ids_frame(tok: bytes, session: bytes, chain: list[ChainHop]) -> bytes:
    ids = np.asarray([1, 2, 3], dtype="<i4")
    return encode_request(
        Request(
            op=Op.FORWARD,
            session=session,
            token=tok,
            step=1,
            n_tokens=3,
            kind=Kind.IDS,
            chain=chain,
            payload=ids.tobytes(),
        )
    )


async def _post(url: str, body: bytes, ctx: ssl.SSLContext | bool) -> tuple[int, bytes]:
    async with (
        ClientSession(connector=TCPConnector(ssl=ctx)) as http,
        http.post(url + "/v1/frame", data=body) as r,
    ):
        return r.status, await r.read()


async def test_a_chain_over_mutual_tls_works_and_a_client_without_a_swarm_certificate_is_refused(
    https_nodes,
    pki: Pki,
    tmp_path: Path,
    signing_key,
    tiny,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    b = await https_nodes("node-b", 2, 4, pki.server("node-b"), pki.client(tls.node_identity("node-b")))
    a = await https_nodes("node-a", 0, 2, pki.server("node-a"), pki.client(tls.node_identity("node-a")))
    session = os.urandom(16)
    plan = [RouteHop("node-a", a, 0, 2), RouteHop("node-b", b, 2, 4)]
    hops = minted_hops(signing_key, session, manifest.sha256, plan)
    client = RouteClient(
        hops,
        session_id=session,
        mode="chain",
        capacity=512,
        ssl_context=pki.client(tls.client_identity("web")),
    )
    try:
        resp = await client.forward([1, 2, 3], SamplingParams())
        assert resp.kind == Kind.TOKEN and len(resp.timings) == 2
    finally:
        await client.close()
    # No client certificate (the CA trusted, but nothing presented): the handshake is refused.
    bare = ssl.create_default_context(cafile=str(pki.ca_path))
    with pytest.raises((ClientError, OSError)):
        await _post(b, _ids_frame(hops[1].token, session, []), bare)
    # A certificate from another CA: refused the same way.
    other = Pki(tmp_path, "elsewhere")
    with pytest.raises((ClientError, OSError)):
        await _post(b, _ids_frame(hops[1].token, session, []), other.client(tls.client_identity("web")))
    # The system trust store does not know the swarm CA: a client cannot be fooled the other way either.
    with pytest.raises((ClientError, OSError)):
        await _post(b, _ids_frame(hops[1].token, session, []), True)


@pytest.mark.parametrize("impostor", ["another CA", "another node"])
async def test_a_hop_refuses_a_next_hop_whose_certificate_is_not_pinned(
    https_nodes,
    pki: Pki,
    tmp_path: Path,
    signing_key,
    tiny,
    impostor: str,  # noqa: ANN001
) -> None:
    _, manifest = tiny
    if impostor == "another CA":
        fake = Pki(tmp_path, "elsewhere")  # names node-b, but the swarm CA never signed it
        b = await https_nodes("node-b", 2, 4, fake.server("node-b"), None)
    else:
        b = await https_nodes("node-b", 2, 4, pki.server("node-c"), None)  # the swarm's, for node-c
    a = await https_nodes("node-a", 0, 2, pki.server("node-a"), pki.client(tls.node_identity("node-a")))
    session = os.urandom(16)
    plan = [RouteHop("node-a", a, 0, 2), RouteHop("node-b", b, 2, 4)]
    tok_a, tok_b = mint_route(signing_key, session, manifest.sha256, plan)
    web_ctx = pki.client(tls.client_identity("web"))
    opened = encode_request(Request(op=Op.OPEN, session=session, token=tok_a))
    assert (await _post(a, opened, web_ctx))[0] == 200
    status, data = await _post(a, _ids_frame(tok_a, session, [ChainHop(b, tok_b)]), web_ctx)
    assert status == 502, data
    assert b"downstream" in data
    assert b"certificate" in data.lower() or b"hostname" in data.lower()


@pytest.mark.parametrize("target", ["the node the token names", "another node of the swarm"])
async def test_a_hand_off_over_mutual_tls_reaches_only_the_node_its_token_names(
    https_nodes,
    pki: Pki,
    signing_key,
    tiny,
    target: str,  # noqa: ANN001
) -> None:
    from agent.backends import libggswarm

    if not libggswarm.is_available():
        pytest.skip("native library not built (bash native/build.sh): the snapshot is the native backend's")
    _, manifest = tiny

    async def node(name: str) -> str:
        server, client = pki.server(name), pki.client(tls.node_identity(name))
        return str(await https_nodes(name, 0, 4, server, client, "native"))

    a = await node("node-a")
    b = await node("node-b" if target == "the node the token names" else "node-c")  # both the swarm CA's
    session = os.urandom(16)
    web_ctx = pki.client(tls.client_identity("web"))
    hop = minted_hops(signing_key, session, manifest.sha256, [RouteHop("node-a", a, 0, 4)])
    client = RouteClient(hop, session_id=session, capacity=512, ssl_context=web_ctx)
    token = mint_handoff(signing_key, session, manifest.sha256, 0, 4, "node-a", "node-b")
    body = {"token": base64.b64encode(token).decode(), "target": b}
    try:
        await client.forward([1, 2, 3], SamplingParams())  # the session, on node a
        async with (
            ClientSession(connector=TCPConnector(ssl=web_ctx)) as http,
            http.post(a + "/v1/handoff/export", json=body) as r,
        ):
            status, answer = r.status, await r.json()
    finally:
        await client.close()
    if target == "the node the token names":
        assert status == 200 and answer["session_len"] == 3, answer
    else:  # the snapshot never leaves for a certificate naming another node
        assert status == 502 and answer["error"] == "target_unreachable", answer
        assert "certificate" in answer["message"].lower() or "hostname" in answer["message"].lower()


def test_the_ca_signs_only_what_it_chooses_and_keeps_its_key_private(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    assert (pki.dir / "ca.key").stat().st_mode & 0o777 == 0o600
    key = tls.make_key()
    csr = tls.make_csr(key, "i-am-the-control-plane")
    pem = tls.issue_cert(pki.ca_key, pki.ca_cert, csr, tls.node_identity("node-7"), ["10.0.0.7"])
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["urn:ggswarm:node:node-7"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    with pytest.raises(tls.TLSError):
        tls.issue_cert(pki.ca_key, pki.ca_cert, b"not a csr", tls.node_identity("x"), [])


def test_serve_takes_its_tls_files_together_or_not_at_all(tmp_path: Path, signing_key, capsys) -> None:  # noqa: ANN001
    from agent.cli import main
    from agent.wire.routetoken import public_key_b64

    try:
        packaged_model_path("smollm2")
    except ModelNotFound as e:
        pytest.skip(str(e))
    base = [
        "serve",
        "--model",
        "pkg:smollm2",
        "--port",
        "1",
        "--public-key",
        public_key_b64(signing_key.public_key()),
    ]
    assert main([*base, "--tls-cert", str(tmp_path / "c.crt")]) == 2
    assert "--tls-cert, --tls-key and --tls-ca go together" in capsys.readouterr().err
    missing = [str(tmp_path / n) for n in ("c.crt", "c.key", "ca.crt")]
    assert main([*base, "--tls-cert", missing[0], "--tls-key", missing[1], "--tls-ca", missing[2]]) == 2
    assert "TLS files:" in capsys.readouterr().err
