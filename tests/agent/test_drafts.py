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


def test_the_head_drafts_stand_for_their_context_and_the_fallback_drafts_the_others() -> None:
    from agent.client.drafts import MtpDrafter
    from agent.client.spec import NgramDrafter

    d = MtpDrafter(fallback=NgramDrafter())
    context = [5, 6, 7, 8, 5, 6]
    d.offer(len(context), [9, 10, 11])
    assert d.propose(context, 2) == [9, 10]  # the head's, for the context it drafted after
    assert d.propose(context[:5], 2) == [6, 7]  # another context: lookup (5 was followed by 6 7)
    d.offer(len(context), [])  # an answer without drafts
    assert d.propose(context, 2) == [7, 8]  # lookup (5 6 was followed by 7 8)
    assert MtpDrafter().propose(context[:5], 2) == []  # no fallback: nothing


def test_a_route_whose_head_never_drafts_is_let_back_onto_the_lanes() -> None:
    from agent.client.drafts import MtpDrafter

    quiet, drafting = MtpDrafter(), MtpDrafter()
    drafting.offer(3, [1])
    for _ in range(MtpDrafter.NO_HEAD_AFTER):
        assert quiet.needs_python_path  # while the head may still send drafts, steps wait for answers
        quiet.propose([1, 2, 3], 2)
        drafting.propose([1, 2, 3], 2)
    assert not quiet.needs_python_path  # no head (a node without --mtp): the lanes' speed back
    assert drafting.needs_python_path
