"""Pure helpers of the playground chat: validating requests from the page and shaping telemetry bars."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agent.wire.sampling import SamplingParams
from webapp.routing.sampling import Limit, ParamError, number, parse_sampling

MAX_MESSAGE_CHARS = 16000
MAX_SYSTEM_CHARS = 16000
DEFAULT_MAX_TOKENS = 512
TITLE_CHARS = 120
TITLE_FROM_MESSAGE_CHARS = 60
ID = Limit(1, 2**62, integer=True)  # a model's or a conversation's primary key


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
    seed: int | None = None  # as asked; None draws a fresh one for each answer at a temperature

    def settings(self) -> dict[str, Any]:
        """What the conversation remembers so that reopening it restores the controls as they were."""
        return {"max_tokens": self.max_tokens, **asdict(self.sampling), "seed": self.seed}


def parse_id(v: Any, name: str) -> int:
    try:
        n = number({name: v}, name, ID, form=True)
    except ParamError as e:
        raise ChatRequestError(str(e)) from None
    if n is None:
        raise ChatRequestError(f"'{name}' is required")
    return int(n)


def parse_chat_request(content: Any) -> ChatRequest:
    """Validates a chat message; numbers may arrive as strings (form values). Sampling controls and
    max_tokens have the API's ranges and messages (webapp/routing/sampling.py); the model's own context
    is checked later by `check_context`, once the model is known."""
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
    try:
        max_tokens = number(content, "max_tokens", form=True)
        seed = number(content, "seed", form=True)
        sampling = parse_sampling(content, form=True)
    except ParamError as e:
        raise ChatRequestError(str(e)) from None
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens)
    seed = None if seed is None else int(seed)
    return ChatRequest(model_id, message, max_tokens, sampling, conversation_id, system, seed)


def check_context(req: ChatRequest, capacity: int) -> None:
    if req.max_tokens > capacity:
        raise ChatRequestError(
            f"max_tokens {req.max_tokens} exceeds this model's context of {capacity} tokens"
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
