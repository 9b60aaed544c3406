"""Pure helpers of the playground chat: validating requests from the page and shaping telemetry bars."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agent.wire.frames import CONTEXT_CAP
from agent.wire.sampling import SamplingParams

MAX_MESSAGE_CHARS = 16000
MAX_SYSTEM_CHARS = 16000
DEFAULT_MAX_TOKENS = 512
TITLE_CHARS = 120
TITLE_FROM_MESSAGE_CHARS = 60


class ChatRequestError(ValueError):
    """A request from the browser is not valid; the text is shown to the user."""


@dataclass(frozen=True)
class ChatRequest:
    """One user turn: which model and conversation, the text, and how to sample the answer.

    `conversation_id` None starts a new conversation; `system` None keeps the conversation's prompt.
    """

    model_id: int
    message: str
    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingParams = field(default_factory=SamplingParams)
    conversation_id: int | None = None
    system: str | None = None

    def settings(self) -> dict[str, Any]:
        """What the conversation remembers so that reopening it restores the controls."""
        return {"max_tokens": self.max_tokens, **asdict(self.sampling)}


def _show(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _number(v: Any, name: str, cast: type, lo: float, hi: float) -> Any:
    if isinstance(v, bool):
        raise ChatRequestError(f"{name} must be a number")
    try:
        x = cast(v)
    except (TypeError, ValueError, OverflowError):
        raise ChatRequestError(f"{name} must be a number") from None
    if x != x or not (lo <= x <= hi):  # x != x: NaN
        raise ChatRequestError(f"{name} must be between {_show(lo)} and {_show(hi)}")
    return x


def parse_id(v: Any, name: str) -> int:
    return int(_number(v, name, int, 1, 2**62))


def parse_chat_request(content: Any) -> ChatRequest:
    """Validates a chat message; numbers may arrive as strings (form values). The model's own context
    limit is checked later by `check_context`, once the model is known."""
    if not isinstance(content, dict):
        raise ChatRequestError("a chat message must be a JSON object")
    message = content.get("message")
    if not isinstance(message, str) or not message.strip():
        raise ChatRequestError("type a message first")
    if len(message) > MAX_MESSAGE_CHARS:
        raise ChatRequestError(f"message longer than {MAX_MESSAGE_CHARS} characters")
    model_id = parse_id(content.get("model"), "model")
    conv = content.get("conversation")
    conversation_id = None if conv in (None, "") else parse_id(conv, "conversation")
    system = content.get("system")
    if system is not None and not isinstance(system, str):
        raise ChatRequestError("the system prompt must be text")
    if system is not None and len(system) > MAX_SYSTEM_CHARS:
        raise ChatRequestError(f"system prompt longer than {MAX_SYSTEM_CHARS} characters")

    def option(key: str, cast: type, lo: float, hi: float, default: float) -> Any:
        v = content.get(key)
        return default if v in (None, "") else _number(v, key, cast, lo, hi)

    max_tokens = option("max_tokens", int, 1, CONTEXT_CAP, DEFAULT_MAX_TOKENS)
    d = SamplingParams()
    sampling = SamplingParams(
        temperature=option("temperature", float, 0.0, 5.0, d.temperature),
        top_k=option("top_k", int, 0, 1000, d.top_k),
        top_p=option("top_p", float, 0.0, 1.0, d.top_p),
        min_p=option("min_p", float, 0.0, 1.0, d.min_p),
        repeat_penalty=option("repeat_penalty", float, 0.5, 2.0, d.repeat_penalty),
        seed=option("seed", int, 0, 2**31 - 1, d.seed),
    )
    return ChatRequest(model_id, message, max_tokens, sampling, conversation_id, system)


def model_context(manifest: dict[str, Any] | None) -> int:
    """The model's own context length from its manifest, capped at the product-wide 128K."""
    ctx = (manifest or {}).get("context_length") or 0
    return min(int(ctx), CONTEXT_CAP) if isinstance(ctx, int) and ctx > 0 else CONTEXT_CAP


def check_context(req: ChatRequest, context: int) -> None:
    if req.max_tokens > context:
        raise ChatRequestError(
            f"max_tokens {req.max_tokens} exceeds this model's context of {context} tokens"
        )


def parse_title(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ChatRequestError("a title must be non-empty text")
    title = " ".join(v.split())
    if len(title) > TITLE_CHARS:
        raise ChatRequestError(f"a title is at most {TITLE_CHARS} characters")
    return title


def title_from(message: str) -> str:
    """A new conversation's title: the first line of its first message, shortened."""
    line = " ".join(message.strip().splitlines()[0].split()) if message.strip() else "New chat"
    return line if len(line) <= TITLE_FROM_MESSAGE_CHARS else line[: TITLE_FROM_MESSAGE_CHARS - 1] + "…"


@dataclass(frozen=True)
class HopBar:
    """One hop's time split into compute and network, as percentages of the slowest hop."""

    url: str
    layers: str
    compute_ms: float
    network_ms: float
    compute_pct: float
    network_pct: float


def telemetry_bars(telemetry: dict[str, Any]) -> list[HopBar]:
    hops = telemetry.get("hops") or []
    rows = []
    for h in hops if isinstance(hops, list) else []:
        if not isinstance(h, dict):
            continue
        c, n = float(h.get("compute_ms", 0) or 0), float(h.get("network_ms", 0) or 0)
        layers = h.get("layers", "")
        if isinstance(layers, list | tuple) and len(layers) == 2:
            layers = f"{layers[0]}–{layers[1]}"
        rows.append((str(h.get("url", "")), str(layers), c, n))
    scale = max((c + n for _, _, c, n in rows), default=0.0) or 1.0
    return [HopBar(u, ly, c, n, 100 * c / scale, 100 * n / scale) for u, ly, c, n in rows]


def bars_json(telemetry: dict[str, Any]) -> list[dict[str, Any]]:
    """The bars as the page draws them (rounded so that a progress event stays small)."""
    return [
        {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(b).items()}
        for b in telemetry_bars(telemetry)
    ]
