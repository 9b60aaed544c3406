"""The draft model on the client: its drafts are its own greedy continuation of whatever context it is
given, its KV following the context where it changes (cut back, not rebuilt)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.client.drafts import ModelDrafter
from agent.client.tokenizer import ChatTokenizer

pytestmark = pytest.mark.slow


def greedy(model_path: str, context: list[int], k: int) -> list[int]:
    """k greedy tokens after `context`, from a fresh llama.cpp context (the reference)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model_path, n_ctx=512, n_threads=1, verbose=False)
    llm.eval(context)
    out: list[int] = []
    for _ in range(k):
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        out.append(int(np.argmax(row)))
        llm.eval([out[-1]])
    return out


def test_drafts_are_the_draft_models_greedy_tokens_as_the_context_moves(model_path: str) -> None:
    prompt = ChatTokenizer(model_path).encode_chat([{"role": "user", "content": "Name three rivers."}])
    drafter = ModelDrafter(model_path, n_ctx=512)
    first = drafter.propose(prompt, 4)
    assert first == greedy(model_path, prompt, 4)
    # two drafts stood and the route sampled another token: the KV is cut back to the common part
    moved = [*prompt, *first[:2], 1234]
    assert drafter.propose(moved, 3) == greedy(model_path, moved, 3)
    assert drafter.held[: len(moved)] == moved
    assert drafter.propose(moved, 0) == []
    assert drafter.propose(list(range(500)), 20) == []  # past its context: no draft, no error
