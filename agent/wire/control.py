"""The control channel's messages (agent <-> control plane websocket), its version and its close codes.

The one schema both ends use: the agent builds what it sends from these models and validates every
command it receives; the control plane does the same the other way. docs/control-plane.md describes the
flow. Rules of the wire:

* every message is a JSON object whose `type` names one of the models below; `parse_agent_message`
  and `parse_server_message` raise `ControlError` (text safe to send back) for anything else;
* fields are strictly typed (no "1" for 1, no true for 1) and every string and list is bounded;
* unknown fields are dropped, so adding an optional field is compatible; any other change bumps
  `PROTOCOL_VERSION`;
* optional fields left at None are omitted on the wire (`to_wire`).

Imports nothing of ours outside `agent.wire`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, model_validator

from agent.wire.jsonlimits import JsonLimitError, loads_bounded

# 1: hello/heartbeat/progress/error from agents; welcome/load/unload/drain/resync/removed/error to them.
PROTOCOL_VERSION = 1

# Close codes of the agent websocket (4000-4999 are application-defined).
CLOSE_UNAUTHORIZED = 4401  # missing, malformed or revoked node credentials
CLOSE_REMOVED = 4403  # an admin removed the node
CLOSE_REPLACED = 4409  # the same node connected again; this older socket is closed
FINAL_CLOSE_CODES = frozenset({CLOSE_UNAUTHORIZED, CLOSE_REMOVED})  # the agent stops instead of reconnecting

MAX_MESSAGE_BYTES = 256 << 10  # a whole message, as JSON text
MAX_STR = 2000  # free text (errors)
MAX_NAME = 100  # short names: versions, backends, hostnames, node ids
MAX_URL = 300
MAX_SHARDS = 1000
MAX_LAYER = 1 << 20

ShortStr = Annotated[str, Field(max_length=MAX_NAME)]
Text = Annotated[str, Field(max_length=MAX_STR)]
PlanePath = Annotated[str, Field(max_length=MAX_URL, pattern=r"^/")]  # a path on the control plane
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
MAX_COUNT = 1 << 62  # fits a signed 64-bit column with room to add
MAX_SPEED = 1e7  # GFLOP/s; more is a lie (issue 17: speed 1e300 once attracted every route)
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Layer = Annotated[int, Field(ge=0, le=MAX_LAYER)]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]  # finite: no inf, no NaN
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
AssignmentId = Annotated[int, Field(ge=0)]


def _check_range(layer_start: int, layer_end: int) -> None:
    if layer_end <= layer_start:
        raise ValueError("layer_end must be greater than layer_start")


class ControlError(ValueError):
    """A control message that is not valid JSON of a known shape; the text is safe to send back.

    `kind` is the `type` the message claimed, when it had one: a refused `error` is only logged, never
    answered (two ends that disagree would otherwise trade errors forever).
    """

    def __init__(self, text: str, kind: str | None = None) -> None:
        super().__init__(text[:MAX_STR])
        self.kind = kind


class _Wire(BaseModel):
    """Base of every wire model: strict types, bounded, immutable, unknown fields dropped."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready dict to send (optional fields left at None are omitted)."""
        return self.model_dump(mode="json", exclude_none=True)


class ShardRef(_Wire):
    """A shard an agent holds: model and layer range [layer_start, layer_end)."""

    model_sha256: Sha256
    layer_start: Layer
    layer_end: Layer

    @model_validator(mode="after")
    def _range(self) -> ShardRef:
        _check_range(self.layer_start, self.layer_end)
        return self

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.model_sha256, self.layer_start, self.layer_end)


class Gpu(_Wire):
    """One GPU of a node (NVML): its size in `hello`, also its live use in heartbeats (agent/node/gpu.py)."""

    name: ShortStr = ""
    memory_bytes: Count = 0
    index: Count | None = None  # NVML index
    memory_used_bytes: Count | None = None
    memory_free_bytes: Count | None = None
    utilization_percent: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    temperature_c: NonNegative | None = None
    power_w: NonNegative | None = None


class Hardware(_Wire):
    """What a node is made of, shown on the fleet page."""

    hostname: ShortStr = ""
    platform: Annotated[str, Field(max_length=MAX_URL)] = ""
    python: ShortStr = ""
    cpu_count: Count | None = None
    cpu_physical: Count | None = None  # psutil cannot always tell
    memory_bytes: Count = 0
    gpus: Annotated[list[Gpu], Field(max_length=64)] = []
    # the ggml device the native backend runs on ("CPU", "CUDA0"; "" without it) and, for a GPU, its
    # NVML index: placement then budgets shards by that GPU's free memory
    compute_device: ShortStr = ""
    compute_gpu: Count | None = None


# --- agent -> control plane ---------------------------------------------------------------------------


class Hello(_Wire):
    """First message after connecting (and again on `resync`): what the node is and already holds."""

    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    version: ShortStr = ""
    hardware: Hardware = Hardware()
    backends: Annotated[list[ShortStr], Field(max_length=20)] = []
    dataplane_url: Annotated[str, Field(max_length=MAX_URL)] = ""
    speed: Annotated[float, Field(ge=0.0, le=MAX_SPEED, allow_inf_nan=False)] = 1.0  # GFLOP/s, placement only
    free_memory_bytes: Count = 0
    shards: Annotated[list[ShardRef], Field(max_length=MAX_SHARDS)] = []

    @model_validator(mode="after")
    def _check(self) -> Hello:
        if self.protocol != PROTOCOL_VERSION:
            raise ValueError(
                f"protocol {self.protocol} is not supported (this end speaks {PROTOCOL_VERSION})"
            )
        if self.dataplane_url and not self.dataplane_url.startswith(("http://", "https://")):
            raise ValueError("dataplane_url must be an http(s) URL")
        return self


MAX_PREFILLS = 16  # prompts one heartbeat lists as being prefilled; the rest are left out
MAX_WINDOW_S = 3600.0  # a heartbeat's batch window (BatchWindow.seconds) at most
SessionTag = Annotated[str, Field(pattern=r"^[0-9a-f]{8}$")]


class BatchWindow(_Wire):
    """A hop's backend calls since the agent's previous heartbeat: the fleet page's per-hop plots."""

    seconds: Annotated[float, Field(ge=0.0, le=MAX_WINDOW_S, allow_inf_nan=False)] = 0.0
    batches: Count = 0
    steps: NonNegative = 0.0  # sessions' steps per backend call (average)
    tokens: NonNegative = 0.0  # positions per backend call (average)
    wait_p50_ms: NonNegative = 0.0  # a step's wait for its batch: median and 95th percentile
    wait_p95_ms: NonNegative = 0.0


class Prefill(_Wire):
    """A prompt being prefilled on one of the node's shards now (shown on the fleet page, nothing more)."""

    session: SessionTag  # a hash of the session id (agent/node/hop_telemetry.py), not the id
    layer_start: Layer
    layer_end: Layer
    done: Count  # the session's positions computed on this shard so far
    total: Count  # its positions once the queued step is done

    @model_validator(mode="after")
    def _check(self) -> Prefill:
        _check_range(self.layer_start, self.layer_end)
        if self.done > self.total:
            raise ValueError("done must not exceed total")
        return self


class Telemetry(_Wire):
    """A heartbeat's payload: data-plane stats plus host load."""

    sessions: Count = 0
    kv_bytes: Count = 0
    kv_budget_bytes: Count = 0
    tokens_served: Count = 0
    tok_s: NonNegative = 0.0
    cpu_percent: NonNegative = 0.0
    mem_used_bytes: Count = 0
    free_memory_bytes: Count = 0
    shards: Count = 0
    gpus: Annotated[list[Gpu], Field(max_length=64)] = []  # live NVML figures, when the host has them
    # per-hop batching over the last minute (agent/node/scheduler.py): steps per backend call, the
    # wait for a batch, and compute per call; 0 when idle
    batch_steps: NonNegative = 0.0
    queue_wait_ms: NonNegative = 0.0
    batch_compute_ms: NonNegative = 0.0
    # since the previous heartbeat (None from agents that predate it), and the prompts prefilling now
    window: BatchWindow | None = None
    prefills: Annotated[list[Prefill], Field(max_length=MAX_PREFILLS)] = []

    @property
    def raw(self) -> dict[str, Any]:
        """Every figure as a JSON-ready dict (what the control plane stores on the node)."""
        return self.model_dump(mode="json")


class Heartbeat(_Wire):
    """Sent every `heartbeat_interval_s` (from `welcome`)."""

    type: Literal["heartbeat"] = "heartbeat"
    telemetry: Telemetry = Telemetry()


class Transfer(_Wire):
    """How a shard's bytes are arriving (the torrent client's progress, or the HTTP fallback's totals)."""

    done_bytes: Count | None = None
    wanted_bytes: Count | None = None
    downloaded_bytes: Count | None = None
    rate_bytes_per_s: NonNegative | None = None
    peers: Count | None = None
    peer_bytes: Count | None = None
    web_seed_bytes: Count | None = None
    hash_failures: Count | None = None
    fraction: Fraction | None = None
    source: Literal["swarm", "http"] | None = None
    infohash: Annotated[str, Field(max_length=64)] | None = None


AgentState = Literal["fetching", "loading", "ready", "failed", "unloaded"]


class Progress(_Wire):
    """An agent's report on one assignment."""

    type: Literal["progress"] = "progress"
    assignment_id: AssignmentId
    state: AgentState
    progress: Fraction = 0.0
    error: Text = ""
    transfer: Transfer | None = None


UpdateState = Literal[
    "downloading", "installing", "draining", "restarting", "updated", "refused", "failed", "rolled_back"
]
Version = Annotated[str, Field(pattern=r"^[0-9][0-9A-Za-z.+!_-]{0,39}$")]


class UpdateStatus(_Wire):
    """An agent's report on one `update` (agent/node/update.py): its steps, a refusal or a rollback."""

    type: Literal["update_status"] = "update_status"
    rollout_id: Annotated[int, Field(ge=0)]
    version: Version
    state: UpdateState
    error: Text = ""


class ErrorMessage(_Wire):
    """Either end: the last message was refused (and ignored); never answered with another error."""

    type: Literal["error"] = "error"
    error: Text

    @classmethod
    def about(cls, text: str) -> ErrorMessage:
        """An error message carrying `text`, cut to the size the wire allows."""
        return cls(error=text[:MAX_STR])


# --- control plane -> agent ---------------------------------------------------------------------------


class Welcome(_Wire):
    """First message on an accepted socket."""

    type: Literal["welcome"] = "welcome"
    node_id: ShortStr
    protocol: int = PROTOCOL_VERSION
    heartbeat_interval_s: Annotated[float, Field(gt=0.0, le=3600.0)]


class Load(_Wire):
    """Fetch and load a layer range. All URLs are paths on the control plane.

    With a .torrent the command names it, this node's tracker and its web seed; else the agent fetches
    `file_url` with HTTP range requests.
    """

    type: Literal["load"] = "load"
    assignment_id: AssignmentId
    model_sha256: Sha256
    layer_start: Layer
    layer_end: Layer
    backend: ShortStr
    manifest_url: PlanePath
    file_url: PlanePath
    torrent_url: PlanePath | None = None
    trackers: Annotated[list[PlanePath], Field(max_length=8)] = []
    web_seeds: Annotated[list[PlanePath], Field(max_length=8)] = []

    @property
    def shard(self) -> ShardRef:
        return ShardRef(
            model_sha256=self.model_sha256, layer_start=self.layer_start, layer_end=self.layer_end
        )

    @model_validator(mode="after")
    def _range(self) -> Load:
        _check_range(self.layer_start, self.layer_end)
        return self


class Unload(_Wire):
    """Drop a layer range; `assignment_id` is None for a shard nobody assigned."""

    type: Literal["unload"] = "unload"
    assignment_id: AssignmentId | None = None
    model_sha256: Sha256
    layer_start: Layer
    layer_end: Layer

    @property
    def shard(self) -> ShardRef:
        return ShardRef(
            model_sha256=self.model_sha256, layer_start=self.layer_start, layer_end=self.layer_end
        )

    @model_validator(mode="after")
    def _range(self) -> Unload:
        _check_range(self.layer_start, self.layer_end)
        return self


class Drain(_Wire):
    """Stop admitting sessions."""

    type: Literal["drain"] = "drain"


class Resync(_Wire):
    """Send `hello` again (a heartbeat revived a node marked offline; its shards may have moved)."""

    type: Literal["resync"] = "resync"


class Update(_Wire):
    """Install a signed release (a wheel of the agent) and restart into it; see docs/control-plane.md.

    The agent checks `sha256` and `signature` (agent.wire.release) against the release key it pinned
    at enrollment before installing anything.
    """

    type: Literal["update"] = "update"
    rollout_id: Annotated[int, Field(ge=0)]
    version: Version
    filename: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.+!-]{1,150}\.whl$")]
    wheel_url: PlanePath
    sha256: Sha256
    size: Annotated[int, Field(gt=0, le=2 << 30)]
    signature: Annotated[str, Field(max_length=120)]


class Removed(_Wire):
    """An admin removed this node; the socket closes with CLOSE_REMOVED next."""

    type: Literal["removed"] = "removed"


AgentMessage = Hello | Heartbeat | Progress | UpdateStatus | ErrorMessage
ServerMessage = Welcome | Load | Unload | Drain | Resync | Update | Removed | ErrorMessage


class _AgentRoot(RootModel[Annotated[AgentMessage, Field(discriminator="type")]]):
    """Any message an agent may send, dispatched on `type`."""


class _ServerRoot(RootModel[Annotated[ServerMessage, Field(discriminator="type")]]):
    """Any message the control plane may send, dispatched on `type`."""


_AGENT_TYPES = tuple(m.model_fields["type"].default for m in get_args(AgentMessage))
_SERVER_TYPES = tuple(m.model_fields["type"].default for m in get_args(ServerMessage))


def _explain(e: ValidationError, kind: str) -> str:
    """A short account of what is wrong, naming fields but never echoing the input back."""
    parts = []
    for err in e.errors(include_url=False, include_input=False, include_context=False)[:5]:
        loc = ".".join(str(x) for x in err["loc"][1:])  # [0] is the union tag
        text = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {text}" if loc else text)
    return f"bad {kind!r} message: " + "; ".join(parts)


def _parse(raw: object, root: type[RootModel[Any]], types: tuple[str, ...]) -> Any:
    if isinstance(raw, str | bytes | bytearray):
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ControlError(f"message larger than {MAX_MESSAGE_BYTES} bytes")
        try:
            # bounded: 100,000 nested brackets are refused before parsing, never a RecursionError
            raw = loads_bounded(raw, max_bytes=MAX_MESSAGE_BYTES)
        except JsonLimitError as e:
            raise ControlError(str(e)) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ControlError(f"malformed JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ControlError("a message must be a JSON object")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise ControlError(f"a message needs a string 'type', one of {', '.join(types)}")
    if kind not in types:
        raise ControlError(f"unknown message type {kind[:40]!r}; expected one of {', '.join(types)}", kind)
    try:
        return root.model_validate(raw).root
    except ValidationError as e:
        raise ControlError(_explain(e, kind), kind) from None


def parse_agent_message(raw: object) -> AgentMessage:
    """Validate one message from an agent (decoded JSON, or its text); raises ControlError."""
    msg: AgentMessage = _parse(raw, _AgentRoot, _AGENT_TYPES)
    return msg


def parse_server_message(raw: object) -> ServerMessage:
    """Validate one message from the control plane (decoded JSON, or its text); raises ControlError."""
    msg: ServerMessage = _parse(raw, _ServerRoot, _SERVER_TYPES)
    return msg
