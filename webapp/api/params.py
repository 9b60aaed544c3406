"""Parsing and validating OpenAI request bodies into one request type, and OpenAI's error shape.

Pure functions (no Django, no I/O): the unit tests drive them directly. Sampling parameters and
lengths go through the validator the playground uses too (webapp/routing/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from agent.wire.jsonlimits import JsonLimitError, loads_bounded
from agent.wire.sampling import SamplingParams
from webapp.routing.sampling import LIMITS, Limit, ParamError, number, parse_sampling

MAX_STOP = 4
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: unseeded requests sample
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# Accepted and ignored: they change nothing a single-choice, tool-less generation does.
IGNORED = {
    "user",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class GenRequest:
    """One generation asked through /v1/chat/completions or /v1/completions."""

    kind: Literal["chat", "completion"]
    model: str
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | list[int] = ""
    max_tokens: int | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0


def parse_body(raw: bytes, max_bytes: int | None = None, max_containers: int | None = None) -> dict[str, Any]:
    """The body as a JSON object, nested at most 64 deep (100,000 levels were a RecursionError, a 500)
    and holding at most `max_containers` objects and arrays, counted before parsing (a body of 250,000
    messages held the web's GIL for its parse)."""
    try:
        body = loads_bounded(raw or b"null", max_bytes=max_bytes, max_containers=max_containers)
    except JsonLimitError as e:
        raise bad(f"the request body is refused: {e}", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", code="invalid_json")
    return body


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _number(body: dict[str, Any], name: str, limit: Limit | None = None) -> Any:
    """A numeric parameter within its limit (the shared one of that name unless given); None if absent."""
    try:
        return number(body, name, limit)
    except ParamError as e:
        raise bad(str(e), e.param, e.code) from None


def _flag(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name, "invalid_type")
    return v


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad(f"'stop' takes at most {MAX_STOP} sequences", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"each stop sequence must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad(
                    f"messages[{i}].content: only text parts are supported",
                    f"messages[{i}].content",
                    "unsupported",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(v: Any, most: int | None = None) -> list[dict[str, str]]:
    if not isinstance(v, list) or not v:
        raise bad("'messages' must be a non-empty list", "messages", "invalid_type")
    if most is not None and len(v) > most:  # before the loop: 250,000 messages were minutes of work
        raise bad(f"{len(v)} messages; at most {most} are accepted", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise bad(
                f"messages[{i}].role must be one of system, developer, user, assistant (not {role!r})",
                f"messages[{i}].role",
            )
        if m.get("tool_calls") or m.get("function_call"):
            raise bad("tool and function calls are not supported", f"messages[{i}]", "unsupported")
        out.append({"role": ROLES[role], "content": _message_text(m.get("content"), i)})
    return out


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("n", "best_of"):
        n = body.get(name)
        if n is not None and n != 1:
            raise bad(f"'{name}' must be 1: this server returns one choice per request", name, "unsupported")
    for name in ("tools", "functions", "tool_choice", "function_call", "suffix", "audio", "prediction"):
        if body.get(name) not in (None, [], "none"):
            raise bad(f"'{name}' is not supported by this server", name, "unsupported")
    if body.get("echo"):
        raise bad("'echo' is not supported by this server", "echo", "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad('only response_format {"type": "text"} is supported', "response_format", "unsupported")
    if body.get("logit_bias"):
        raise bad("'logit_bias' is not supported by this server", "logit_bias", "unsupported")
    for name in ("frequency_penalty", "presence_penalty"):
        v = body.get(name)
        if v is not None and (not _is_num(v) or v != 0):
            raise bad(f"'{name}' is not supported (use repeat_penalty)", name, "unsupported")


def _sampling(body: dict[str, Any]) -> SamplingParams:
    try:
        return parse_sampling(body, DEFAULT_TEMPERATURE)
    except ParamError as e:
        raise bad(str(e), e.param, e.code) from None


def _common(body: dict[str, Any], kind: Literal["chat", "completion"]) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model", "missing_required_parameter")
    _refuse_unsupported(body)
    max_tokens = _number(body, "max_tokens")
    if kind == "chat":
        mct = _number(body, "max_completion_tokens", LIMITS["max_tokens"])
        if mct is not None:
            max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options", "invalid_type")
        include_usage = bool(opts.get("include_usage", False))
    return {
        "kind": kind,
        "model": model,
        "max_tokens": max_tokens,
        "sampling": _sampling(body),
        "stop": _stop(body.get("stop")),
        "stream": stream,
        "include_usage": include_usage,
    }


def parse_chat(body: dict[str, Any], max_messages: int | None = None) -> GenRequest:
    """A /v1/chat/completions body; raises ApiError(400) with the offending parameter."""
    common = _common(body, "chat")
    messages = _messages(body.get("messages"), max_messages)
    logprobs = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", Limit(0, MAX_TOP_LOGPROBS_CHAT, integer=True))
    if top is not None and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return GenRequest(messages=messages, logprobs=logprobs, top_logprobs=top or 0, **common)


def parse_completion(body: dict[str, Any]) -> GenRequest:
    """A /v1/completions body: one prompt (a string, a list of one string, or token ids)."""
    common = _common(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string", "prompt", "missing_required_parameter")
    n = _number(body, "logprobs", Limit(0, MAX_LOGPROBS_COMPLETION, integer=True))
    return GenRequest(prompt=prompt, logprobs=n is not None, top_logprobs=n or 0, **common)
