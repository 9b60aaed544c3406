"""Parsing the credentials agents send: `Authorization: Node <node_id>:<secret>`."""

from __future__ import annotations

from collections.abc import Iterable

from agent.wire.ids import NodeId

AUTH_SCHEME = "Node"


def parse_node_authorization(value: str | None) -> tuple[NodeId, str] | None:
    """(node_id, secret) from an Authorization header value, or None when absent or malformed."""
    if not value:
        return None
    scheme, _, rest = value.strip().partition(" ")
    if scheme != AUTH_SCHEME:
        return None
    node_id, sep, secret = rest.strip().partition(":")
    if not sep or not node_id or not secret or len(node_id) > 40 or len(secret) > 200:
        return None
    return NodeId(node_id), secret


def authorization_from_scope_headers(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            try:
                return value.decode("latin-1")
            except UnicodeDecodeError:
                return None
    return None
