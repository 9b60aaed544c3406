"""Data-plane certificates: the control plane's CA certifies an enrolled node's own key for its https
URL, and the web's route client then reaches that node over mutual TLS (issue 17)."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientError, ClientSession, TCPConnector
from cryptography import x509

from agent.node.certs import NodeTLS
from agent.node.dataplane import DataPlane, start_dataplane
from agent.procs import free_port
from agent.wire import tls
from agent.wire.routetoken import generate_key
from webapp.core import dataplane_tls
from webapp.fleet import probe
from webapp.fleet.services import create_enrollment_token, redeem_enrollment_token

pytestmark = pytest.mark.django_db


def _enrolled() -> tuple[str, str]:
    token, _ = create_enrollment_token(None)
    e = redeem_enrollment_token(token, "n1")
    return e.node_id, e.secret


def _ask(client: Any, auth: str, body: dict[str, Any]) -> Any:
    return client.post(
        "/api/agent/certificate",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=auth,
    )


def test_an_enrolled_node_gets_a_certificate_for_its_own_key_and_https_host(
    client: Any, tmp_path: Path
) -> None:
    node_id, secret = _enrolled()
    key = tls.make_key()
    csr = tls.make_csr(key, "whatever-the-node-asks").decode()
    r = _ask(client, f"Node {node_id}:{secret}", {"csr": csr, "dataplane_url": "https://127.0.0.1:7001"})
    assert r.status_code == 201, r.content
    cert = x509.load_pem_x509_certificate(r.json()["certificate"].encode())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [tls.node_identity(node_id)]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.public_key().public_numbers() == key.public_key().public_numbers()  # type: ignore[union-attr]
    assert (dataplane_tls.ca_dir() / "ca.key").stat().st_mode & 0o777 == 0o600

    # The node serves with it; the web's client context (its own certificate, same CA) gets through,
    # and a client without a certificate does not.
    paths = NodeTLS(tmp_path / "node.key", tmp_path / "node.crt", tmp_path / "ca.crt")
    tls.write_private(paths.key, tls.key_pem(key))
    paths.cert.write_text(r.json()["certificate"])
    paths.ca.write_text(r.json()["ca"])

    async def roundtrip() -> tuple[int, bool, str, str]:
        dp = DataPlane(node_id, generate_key().public_key(), client_ssl=paths.client())
        port = free_port()
        runner = await start_dataplane(dp, "127.0.0.1", port, ssl_context=paths.server())
        url = f"https://127.0.0.1:{port}/v1/health"
        try:
            web_ctx = dataplane_tls.client_context()
            async with ClientSession(connector=TCPConnector(ssl=web_ctx)) as http, http.get(url) as resp:
                status = resp.status
            refused = False
            bare = ssl.create_default_context(cafile=str(paths.ca))
            try:
                async with ClientSession(connector=TCPConnector(ssl=bare)) as http, http.get(url) as resp:
                    await resp.read()
            except (ClientError, OSError):
                refused = True
            # the control plane's probe of a reported https URL: mutual TLS, pinned to the node id
            ok, _ = await probe.probe_health(f"https://127.0.0.1:{port}", node_id, 5.0)
            other, _ = await probe.probe_health(f"https://127.0.0.1:{port}", "node-other", 5.0)
            return status, refused, ok, other
        finally:
            await runner.cleanup()

    status, refused, ok, other = asyncio.run(roundtrip())
    assert (status, refused, ok) == (200, True, "")
    assert "did not answer its health check" in other


@pytest.mark.parametrize(
    ("auth", "body", "status"),
    [
        ("Node nobody:sec_x", {"csr": "x", "dataplane_url": "https://h:1"}, 401),
        ("", {"csr": "x", "dataplane_url": "https://h:1"}, 401),
        (None, {"csr": "not a csr", "dataplane_url": "https://h:1"}, 400),
        (None, {"csr": None, "dataplane_url": "http://h:1"}, 400),
        (None, {"dataplane_url": "https://h:1"}, 400),
    ],
)
def test_certificate_requests_without_credentials_or_with_bad_input_are_refused(
    client: Any, auth: str | None, body: dict[str, Any], status: int
) -> None:
    node_id, secret = _enrolled()
    if body.get("csr") is None and "csr" in body:
        body = {**body, "csr": tls.make_csr(tls.make_key(), "n").decode()}  # a good CSR, a plain-http URL
    r = _ask(client, auth if auth is not None else f"Node {node_id}:{secret}", body)
    assert r.status_code == status and r.json()["error"]


@pytest.mark.django_db(transaction=True)
def test_a_node_fetches_its_certificate_over_http_and_keeps_its_key_to_itself(
    live_server: Any, tmp_path: Path
) -> None:
    from agent.node.certs import obtain_certificate
    from agent.node.config import NodeConfig

    node_id, secret = _enrolled()
    cfg = NodeConfig(server=live_server.url, node_id=node_id, secret=secret, public_key="unused")
    config_path = tmp_path / "cfg" / "node.json"
    port = free_port()
    paths = obtain_certificate(cfg, config_path, f"https://127.0.0.1:{port}")
    assert paths.key.parent == config_path.parent and paths.key.stat().st_mode & 0o777 == 0o600
    cert = x509.load_pem_x509_certificate(paths.cert.read_bytes())
    assert cert.public_key().public_numbers() == tls.load_private_key(paths.key).public_key().public_numbers()  # type: ignore[union-attr]
    # the same key again at the next start, a fresh certificate for it
    again = obtain_certificate(cfg, config_path, f"https://127.0.0.1:{port}")
    assert again.key.read_bytes() == paths.key.read_bytes()

    async def health() -> int:
        dp = DataPlane(node_id, generate_key().public_key(), client_ssl=paths.client())
        runner = await start_dataplane(dp, "127.0.0.1", port, ssl_context=paths.server())
        try:
            ctx = dataplane_tls.client_context()
            async with (
                ClientSession(connector=TCPConnector(ssl=ctx)) as http,
                http.get(f"https://127.0.0.1:{port}/v1/health") as resp,
            ):
                return resp.status
        finally:
            await runner.cleanup()

    assert asyncio.run(health()) == 200
    bad = NodeConfig(server=live_server.url, node_id=node_id, secret="sec_wrong", public_key="unused")
    with pytest.raises(Exception, match="401"):
        obtain_certificate(bad, config_path, f"https://127.0.0.1:{port}")


def test_a_certificate_names_only_the_host_the_node_connects_from_unless_an_admin_allows_it(
    client: Any, settings: Any
) -> None:
    node_id, secret = _enrolled()
    body = {"csr": tls.make_csr(tls.make_key(), "n").decode(), "dataplane_url": "https://10.9.8.7:7001"}
    r = _ask(client, f"Node {node_id}:{secret}", body)  # the test client connects from 127.0.0.1
    assert r.status_code == 400 and "10.9.8.7" in r.json()["error"]
    settings.DATAPLANE_ALLOWED_HOSTS = ["10.9.8.7"]
    assert _ask(client, f"Node {node_id}:{secret}", body).status_code == 201
