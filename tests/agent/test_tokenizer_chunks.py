"""The tokenizer's cost is linear in the number of special tokens (llama.cpp's own partition is
quadratic in them), and cutting a text into pieces never changes its ids (issue 33, item 1;
docs/security.md, "One request freezes the web")."""

from __future__ import annotations

import random
import time

import pytest

from agent.client import tokenizer as tokenizer_module
from agent.client.tokenizer import ChatTokenizer, SpecialSplitter


@pytest.fixture(scope="module")
def tok(model_path: str) -> ChatTokenizer:
    return ChatTokenizer(model_path)


def whole(tok: ChatTokenizer, text: str) -> list[int]:
    """llama.cpp's ids for the text in one call, as encode gave them before."""
    return [int(i) for i in tok._llm.tokenize(text.encode(), add_bos=tok.add_bos, special=True)]


def test_pieces_cut_before_special_tokens_give_the_ids_of_the_whole_text(
    tok: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_module, "CHUNK_MIN_BYTES", 0)
    assert tok._splitter is not None
    rng = random.Random(33)
    parts = ["<|im_start|>", "<|im_end|>", "<|im_", "_end|>", "<|endoftext|>", "<repo_name>", "<reponame>"]
    parts += [" ", "\n", "  \t", "hello", "é", "<", "|>", "x" * 40, "日本"]
    for _ in range(200):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 300)))
        tok._splitter.per_piece = rng.randint(1, 6)
        assert tok.encode(text) == whole(tok, text), text
    tok._splitter.per_piece = tokenizer_module.CHUNK_SPECIALS


def test_a_chat_of_8000_messages_tokenizes_in_linear_time_with_the_same_ids(tok: ChatTokenizer) -> None:
    def chat(n: int) -> str:
        return tok.apply_chat_template([{"role": "user", "content": "x"} for _ in range(n)])

    small, big = chat(1000), chat(8000)

    def fastest(text: str) -> tuple[float, list[int]]:  # the least disturbed of three (the CPU is shared)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            ids = tok.encode(text)
            times.append(time.perf_counter() - t)
        return min(times), ids

    t_small, ids_small = fastest(small)
    t_big, ids_big = fastest(big)
    # 8x the messages: about 8x the time, far from the ~64x of llama.cpp's quadratic partition (whose
    # 2,000 -> 8,000 messages took 8x, 2 s)
    assert t_big < 16 * t_small + 0.05, (t_small, t_big)
    assert ids_small == whole(tok, small) and ids_big == whole(tok, big)


def test_cuts_go_only_before_a_whole_special_token_that_does_not_strip_the_space_before_it() -> None:
    lstrip = 1 << 7
    s = SpecialSplitter({b"<a>": 8, b"<a><b>": 8, b"<s>": 8 | lstrip}, per_piece=1)
    # one special token a piece: "<a><b>" is one token, never cut inside; "<s>" eats the space before it
    assert s.pieces(b"x<a>y<a><b>z <s>w<a>") == [b"x<a>y", b"<a><b>z <s>w", b"<a>"]
    assert SpecialSplitter({}).pieces(b"abc") == [b"abc"]
