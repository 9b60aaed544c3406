"""Time to first token of a shared system prompt for a new user vs its first prefill (bench/served.py)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from agent.client.tokenizer import ChatTokenizer
from webapp.routing.prefix import shared_prefix

SHARED_PREFIX = 1500  # tokens of the system prompt user B shares with user A (issue 32)
PREFIX_QUESTIONS = ("Which rule of the handbook comes first? One sentence.", "Summarise rule 2 briefly.")
PREFIX_PASSWORD = "bench-served-prefix-1"  # the throwaway cluster's users A and B
# the handbook's words, drawn at random into numbered rules
_WORDS = (
    "keeper lamp tower harbour ship signal storm tide rock beacon lens oil shift log watch coast chart fog "
    "bell reef wind north south current boat crew light night dawn gale record inspection"
)


def system_document(tok: ChatTokenizer, n_tokens: int) -> str:
    """A made-up handbook of at least `n_tokens` tokens, new every call (random words, numbered rules),
    so no earlier round's or run's snapshot can answer for it."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    text = "You answer questions about this lighthouse service handbook.\n"
    rule = 0
    while len(tok.encode(text, add_bos=False)) < n_tokens:
        rule += 1
        words = " ".join(rng.choice(_WORDS.split(), size=int(rng.integers(8, 16))))
        text += f"Rule {rule}: the {words}.\n"
    return text


def api_user(s: Any, name: str) -> Any:
    """An OpenAI client with an API key of a new user of the cluster `name`, made as that user would."""
    import openai

    from bench.api import create_key
    from webapp.core.adminclient import AdminClient

    s.manage(
        "shell",
        "-c",
        f"from django.contrib.auth import get_user_model\n"
        f"get_user_model().objects.create_user({name!r}, password={PREFIX_PASSWORD!r})",
    )
    web = AdminClient(s.base)
    web.login(name, PREFIX_PASSWORD)
    # create_key posts the keys page with `.admin`'s session: here the new user's
    key = create_key(web, name)
    return openai.OpenAI(base_url=s.base + "/v1", api_key=key, max_retries=0, timeout=300)


def api_ttft(client: Any, model: str, messages: list[dict[str, str]], n: int) -> tuple[float, dict[str, Any]]:
    """(ms to the first content chunk, x_swarm) of one streamed chat completion, as its caller sees it."""
    t0 = time.perf_counter()
    first = 0.0
    x: dict[str, Any] = {}
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if not first and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        x = (chunk.model_extra or {}).get("x_swarm") or x
    if not first:
        raise RuntimeError(f"no content came back for {messages[-1]['content']!r}")
    return (first - t0) * 1e3, x


def shared_prefix_ttft(users: tuple[Any, Any], model: str, tok: ChatTokenizer) -> dict[str, Any]:
    """User A's TTFT for a chat whose ~1,500-token system prompt nobody sent before (prefilled, then
    kept by the hops), then user B's for the same system prompt and another question (restored); and
    as their reference user A's for another such document sent as the user's message (never shared:
    the same prefill without the snapshot's save)."""
    system = {"role": "system", "content": system_document(tok, SHARED_PREFIX)}
    a = [system, {"role": "user", "content": PREFIX_QUESTIONS[0]}]
    b = [system, {"role": "user", "content": PREFIX_QUESTIONS[1]}]
    plain = [{"role": "user", "content": system_document(tok, SHARED_PREFIX) + PREFIX_QUESTIONS[0]}]
    # what the control plane counts as shareable (webapp/routing/prompt.py), from the same tokenizer
    shared = shared_prefix(tok.encode_chat, a, tok.encode_chat(a))
    plain_ms, _ = api_ttft(users[0], model, plain, 8)
    miss_ms, xa = api_ttft(users[0], model, a, 8)
    hit_ms, xb = api_ttft(users[1], model, b, 8)
    return {
        "shared_prefix_tokens": shared,
        "no_sharing_ms": plain_ms,
        "no_reuse_ms": miss_ms,
        "new_user_ms": hit_ms,
        "hit_a": xa.get("prefix_hit"),
        "hit_b": xb.get("prefix_hit"),
        "told_a": xa.get("prefix_shared_tokens"),
    }
