"""The control websocket's JSON messages: strict parsing of what agents send, and the commands we send.

Pure functions only (no database). docs/control-plane.md documents every message. A message that fails
to parse raises ProtocolError; the consumer answers `{"type": "error"}` and stays up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CONTROL_PROTOCOL_VERSION = 1

# Close codes of the agent websocket (4000-4999 are application-defined).
CLOSE_UNAUTHORIZED = 4401  # missing, malformed or revoked node credentials
CLOSE_REMOVED = 4403  # an admin removed the node
CLOSE_REPLACED = 4409  # the same node connected again; this older socket is closed

AGENT_STATES = {"fetching", "loading", "ready", "failed", "unloaded"}
MAX_STR = 2000


class ProtocolError(ValueError):
    """A message from an agent is not valid JSON of a known shape."""


def _str(d: Mapping[str, Any], key: str, default: str | None = None, limit: int = MAX_STR) -> str:
    v = d.get(key, default)
    if not isinstance(v, str):
        raise ProtocolError(f"{key!r} must be a string")
    return v[:limit]


def _int(d: Mapping[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ProtocolError(f"{key!r} must be an integer")
    return v


def _num(d: Mapping[str, Any], key: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ProtocolError(f"{key!r} must be a number")
    return float(v)


@dataclass(frozen=True)
class ShardRef:
    """A shard an agent holds: model and layer range."""

    model_sha256: str
    layer_start: int
    layer_end: int


@dataclass(frozen=True)
class Hello:
    """First message after connecting: what the node is and what it already holds."""

    hardware: dict[str, Any]
    backends: list[str]
    version: str
    dataplane_url: str
    speed: float
    free_memory_bytes: int
    shards: list[ShardRef] = field(default_factory=list)


@dataclass(frozen=True)
class Telemetry:
    """A heartbeat's payload (data-plane stats plus host load)."""

    raw: dict[str, Any]
    sessions: int
    kv_bytes: int
    kv_budget_bytes: int
    tokens_served: int
    cpu_percent: float
    mem_used_bytes: int
    free_memory_bytes: int


@dataclass(frozen=True)
class Progress:
    """An agent's report on one assignment."""

    assignment_id: int
    state: str
    progress: float
    error: str
    transfer: dict[str, Any] = field(default_factory=dict)


# What a progress report's `transfer` may carry (SwarmClient's Progress.to_dict()); anything else is dropped.
TRANSFER_NUMBERS = (
    "done_bytes",
    "wanted_bytes",
    "downloaded_bytes",
    "rate_bytes_per_s",
    "peers",
    "peer_bytes",
    "web_seed_bytes",
    "hash_failures",
    "fraction",
)


def _transfer(v: Any) -> dict[str, Any]:
    """The numbers of a download report, validated; strings (source, infohash) are kept short."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ProtocolError("'transfer' must be an object")
    out: dict[str, Any] = {}
    for key in TRANSFER_NUMBERS:
        if key in v:
            n = _num(v, key)
            if n < 0:
                raise ProtocolError(f"'transfer.{key}' must not be negative")
            out[key] = n
    for key in ("source", "infohash"):
        if key in v:
            out[key] = _str(v, key, limit=40)
    return out


def _shards(v: Any) -> list[ShardRef]:
    if not isinstance(v, list) or len(v) > 1000:
        raise ProtocolError("'shards' must be a list")
    out = []
    for s in v:
        if not isinstance(s, dict):
            raise ProtocolError("each shard must be an object")
        out.append(ShardRef(_str(s, "model_sha256", limit=64), _int(s, "layer_start"), _int(s, "layer_end")))
    return out


def parse_agent_message(msg: Any) -> Hello | Telemetry | Progress:
    """Validate one decoded JSON message from an agent."""
    if not isinstance(msg, dict):
        raise ProtocolError("a message must be a JSON object")
    kind = msg.get("type")
    if kind == "hello":
        hw = msg.get("hardware", {})
        backends = msg.get("backends", [])
        if not isinstance(hw, dict) or len(str(hw)) > 20000:
            raise ProtocolError("'hardware' must be a (small) object")
        if not isinstance(backends, list) or not all(isinstance(b, str) for b in backends):
            raise ProtocolError("'backends' must be a list of strings")
        url = _str(msg, "dataplane_url", "", limit=300)
        if url and not url.startswith(("http://", "https://")):
            raise ProtocolError("'dataplane_url' must be an http(s) URL")
        return Hello(
            hw,
            backends[:20],
            _str(msg, "version", "", limit=40),
            url,
            _num(msg, "speed", 1.0),
            _int(msg, "free_memory_bytes", 0),
            _shards(msg.get("shards", [])),
        )
    if kind == "heartbeat":
        t = msg.get("telemetry", {})
        if not isinstance(t, dict) or len(str(t)) > 20000:
            raise ProtocolError("'telemetry' must be a (small) object")
        return Telemetry(
            raw=t,
            sessions=_int(t, "sessions", 0),
            kv_bytes=_int(t, "kv_bytes", 0),
            kv_budget_bytes=_int(t, "kv_budget_bytes", 0),
            tokens_served=_int(t, "tokens_served", 0),
            cpu_percent=_num(t, "cpu_percent", 0.0),
            mem_used_bytes=_int(t, "mem_used_bytes", 0),
            free_memory_bytes=_int(t, "free_memory_bytes", 0),
        )
    if kind == "progress":
        state = _str(msg, "state")
        if state not in AGENT_STATES:
            raise ProtocolError(f"'state' must be one of {sorted(AGENT_STATES)}")
        return Progress(
            _int(msg, "assignment_id"),
            state,
            _num(msg, "progress", 0.0),
            _str(msg, "error", ""),
            _transfer(msg.get("transfer")),
        )
    raise ProtocolError(f"unknown message type {kind!r}")


@dataclass(frozen=True)
class AssignmentView:
    """What reconciliation needs to know about one assignment."""

    id: int
    model_sha256: str
    layer_start: int
    layer_end: int
    state: str
    backend: str
    tracker_url: str = ""  # this node's passkey announce path; empty when the artifact has no .torrent
    web_seed_url: str = ""


def load_command(a: AssignmentView) -> dict[str, Any]:
    """The `load` command; with a .torrent it names the torrent, this node's tracker and web seed."""
    swarm = bool(a.tracker_url)
    return {
        "type": "load",
        "assignment_id": a.id,
        "model_sha256": a.model_sha256,
        "layer_start": a.layer_start,
        "layer_end": a.layer_end,
        "backend": a.backend,
        "manifest_url": f"/artifacts/{a.model_sha256}/manifest",
        "file_url": f"/artifacts/{a.model_sha256}/file",
        "torrent_url": f"/artifacts/{a.model_sha256}/torrent" if swarm else None,
        "trackers": [a.tracker_url] if swarm else [],
        "web_seeds": [a.web_seed_url] if swarm and a.web_seed_url else [],
    }


def unload_command(
    model_sha256: str, layer_start: int, layer_end: int, assignment_id: int | None = None
) -> dict[str, Any]:
    return {
        "type": "unload",
        "assignment_id": assignment_id,
        "model_sha256": model_sha256,
        "layer_start": layer_start,
        "layer_end": layer_end,
    }


def reconcile(
    assignments: Iterable[AssignmentView], held: Iterable[ShardRef]
) -> tuple[list[int], list[dict[str, Any]]]:
    """After a hello: (assignment ids now ready, commands to send) so the node matches its assignments.

    Held shards that match an assignment are ready; assignments the node lacks are (re)sent as load
    commands; held shards nobody assigned are unloaded. Failed and draining assignments are left alone.
    """
    held_set = {(s.model_sha256, s.layer_start, s.layer_end) for s in held}
    ready: list[int] = []
    commands: list[dict[str, Any]] = []
    wanted: set[tuple[str, int, int]] = set()
    for a in assignments:
        key = (a.model_sha256, a.layer_start, a.layer_end)
        if a.state in ("failed", "draining"):
            if a.state == "draining" and key in held_set:
                wanted.add(key)
                commands.append(unload_command(*key, assignment_id=a.id))
            continue
        wanted.add(key)
        if key in held_set:
            ready.append(a.id)
        else:
            commands.append(load_command(a))
    for key in sorted(held_set - wanted):
        commands.append(unload_command(*key))
    return ready, commands


def choose_backend(node_backends: list[str], full_model: bool, preferred: str = "") -> str:
    """The backend a node should use for a shard: the preferred one if it has it, else its first.

    llama.cpp's full-model backend can only run a shard that holds every layer.
    """
    usable = [b for b in node_backends if full_model or b != "llamacpp"]
    if preferred and preferred in usable:
        return preferred
    return usable[0] if usable else (preferred or "torch")
