"""The part of a chat's prompt other users' sessions may share: its leading system messages' tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from agent.wire.prefix import common_prefix

__all__ = ["common_prefix", "leading_system", "shared_prefix"]


def leading_system(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The system messages the chat starts with (none when it starts with another role)."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m.get("role") != "system":
            break
        out.append(m)
    return out


def shared_prefix(
    encode_chat: Callable[[list[dict[str, str]]], list[int]],
    messages: Sequence[dict[str, str]],
    prompt_ids: Sequence[int],
) -> int:
    """How many leading tokens of `prompt_ids` (the chat's tokens) other users' sessions may share: the
    tokens of its leading system messages as the template renders them alone, as far as they are the
    prompt's own tokens too; 0 without a leading system message.

    Only the common prefix counts: rendered alone, the system part ends with the assistant turn's
    opening where the full chat goes on with the first user turn, and a template may tokenize across
    that boundary differently; so no token of the shared part ever depends on a user's own messages."""
    system = leading_system(messages)
    if not system or not prompt_ids:
        return 0
    try:
        system_ids = encode_chat(system)
    except Exception:  # noqa: BLE001 - a template that refuses a system-only chat just shares nothing
        return 0
    return common_prefix(system_ids, prompt_ids)
