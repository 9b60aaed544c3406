"""Pure helpers of the playground chat: parsing requests from the page and shaping telemetry bars."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.wire.sampling import SamplingParams

MAX_MESSAGE_CHARS = 16000
MAX_NEW_TOKENS = 1024


class ChatRequestError(ValueError):
    """The chat message from the browser is not valid; the text is shown to the user."""


@dataclass(frozen=True)
class ChatRequest:
    """One user turn: which model, the text, and how to sample the answer."""

    model_id: int
    message: str
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)


def _number(v: Any, name: str, cast: type, lo: float, hi: float) -> Any:
    try:
        x = cast(v)
    except (TypeError, ValueError):
        raise ChatRequestError(f"{name} must be a number") from None
    if not (lo <= x <= hi):
        raise ChatRequestError(f"{name} must be between {lo} and {hi}")
    return x


def parse_chat_request(content: Any) -> ChatRequest:
    """Accepts both the JSON protocol and htmx-ws form posts (where every value is a string)."""
    if not isinstance(content, dict):
        raise ChatRequestError("a chat message must be a JSON object")
    message = content.get("message")
    if not isinstance(message, str) or not message.strip():
        raise ChatRequestError("type a message first")
    if len(message) > MAX_MESSAGE_CHARS:
        raise ChatRequestError(f"message longer than {MAX_MESSAGE_CHARS} characters")
    model_id = _number(content.get("model"), "model", int, 1, 2**62)
    max_tokens = _number(content.get("max_tokens", 128) or 128, "max_tokens", int, 1, MAX_NEW_TOKENS)

    def option(key: str, cast: type, lo: float, hi: float, default: float) -> Any:
        v = content.get(key)
        return default if v in (None, "") else _number(v, key, cast, lo, hi)

    d = SamplingParams()
    sampling = SamplingParams(
        temperature=option("temperature", float, 0.0, 5.0, d.temperature),
        top_k=option("top_k", int, 0, 1000, d.top_k),
        top_p=option("top_p", float, 0.0, 1.0, d.top_p),
        min_p=option("min_p", float, 0.0, 1.0, d.min_p),
        repeat_penalty=option("repeat_penalty", float, 0.5, 2.0, d.repeat_penalty),
        seed=option("seed", int, 0, 2**31 - 1, d.seed),
    )
    return ChatRequest(model_id, message, max_tokens, sampling)


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
