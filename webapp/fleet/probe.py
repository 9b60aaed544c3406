"""Checking a node's reported data-plane URL before anything is routed to it (issue 17, lying nodes).

A node says where its data plane listens; the control plane believes it only when (1) the URL is a
plain http(s) origin, (2) its host is the address the node's control socket comes from (loopback
counts as one machine; DATAPLANE_ALLOWED_HOSTS lets an admin allow others, e.g. behind NAT), and
(3) a GET of `<url>/v1/health` from here answers 200 with this node's id within the probe timeout.
`check_dataplane` returns the problem ("" when there is none) and the probe's round trip.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

MAX_HEALTH_BYTES = 64 << 10


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def url_problem(url: str) -> str:
    """What is wrong with the URL's shape ("" if nothing)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "the data-plane URL is malformed"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "the data-plane URL must be http(s)://host:port"
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        return "the data-plane URL must be an origin only (no credentials, path, query or fragment)"
    if port == 0:
        return "the data-plane URL names port 0"
    return ""


async def _addresses(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(host.strip("[]")))}
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(loop.getaddrinfo(host, None), timeout=3.0)
    return {str(info[4][0]) for info in infos}


async def host_problem(url: str, peer: str | None, allowed: Iterable[str]) -> str:
    """ "" when the URL's host is the socket's peer (or allowed); else why not."""
    host = urlsplit(url).hostname or ""
    allowed = set(allowed)
    if "*" in allowed or host in allowed:
        return ""
    if not peer:
        return ""  # no peer address to compare with (an in-process test transport); the probe still runs
    try:
        addresses = await _addresses(host)
    except (OSError, TimeoutError):
        return f"the data-plane host {host!r} does not resolve from the control plane"
    if peer in addresses:
        return ""
    if _is_loopback(peer) and addresses and all(_is_loopback(a) for a in addresses):
        return ""
    return (
        f"the data-plane host {host!r} is not the address this node connects from ({peer}); "
        "an admin may allow it with DATAPLANE_ALLOWED_HOSTS"
    )


async def probe_health(url: str, node_id: str, timeout_s: float) -> tuple[str, float | None]:
    """GET <url>/v1/health: ("" and the round trip in ms) when it answers 200 with this node's id."""
    from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

    from agent.wire.tls import node_dns_name
    from webapp.core import dataplane_tls

    # An https data plane: mutual TLS with the web's certificate, and the node's certificate must
    # name this node id (docs/security.md, "Data plane: TLS").
    tls_ctx = dataplane_tls.context_for([url])
    t0 = time.perf_counter()
    try:
        async with (
            ClientSession(
                timeout=ClientTimeout(total=timeout_s), connector=TCPConnector(ssl=tls_ctx or True)
            ) as http,
            http.get(
                url.rstrip("/") + "/v1/health",
                allow_redirects=False,
                server_hostname=node_dns_name(node_id) if tls_ctx is not None else None,
            ) as r,
        ):
            body = await r.content.read(MAX_HEALTH_BYTES + 1)
            status = r.status
    except (ClientError, OSError, TimeoutError, ValueError) as e:
        return f"the data plane did not answer its health check ({type(e).__name__})", None
    rtt_ms = (time.perf_counter() - t0) * 1e3
    if status != 200:
        return f"the data plane's health check answered HTTP {status}", None
    try:
        health = json.loads(body[:MAX_HEALTH_BYTES])
    except ValueError:
        return "the data plane's health check did not answer JSON", None
    if not isinstance(health, dict) or health.get("node_id") != node_id:
        return "the data plane at that URL belongs to another node", None
    return "", rtt_ms


async def check_dataplane(
    url: str, node_id: str, peer: str | None, allowed: Iterable[str], timeout_s: float
) -> tuple[str, float | None]:
    """(problem, rtt_ms): the URL's shape, its host against the peer, then the health probe."""
    if not url:
        return "the node reported no data-plane URL", None
    problem = url_problem(url) or await host_problem(url, peer, allowed)
    if problem:
        return problem, None
    return await probe_health(url, node_id, timeout_s)
