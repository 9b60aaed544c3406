"""Typed identifiers so a node id can never be passed where a session id is expected."""

from __future__ import annotations

from typing import NewType

SessionId = NewType("SessionId", bytes)  # 16 raw bytes (a UUID) on the wire
NodeId = NewType("NodeId", str)
