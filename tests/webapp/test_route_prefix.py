"""The shareable prefix of a chat (its leading system messages' tokens) and its way to the route client."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from agent.client.route import HopStats
from agent.client.spec import SpecStats
from agent.client.tokenizer import ChatTokenizer
from agent.wire.sampling import SamplingParams
from webapp.routing import prompt
from webapp.routing.answer import Answer, AnswerSpec, LiveRoute
from webapp.routing.prefix import common_prefix, leading_system, shared_prefix


class WordTemplate:
    """A chat template and tokenizer in miniature: ChatML-like turns, one token per word or marker, and
    "ab" one token wherever it occurs (so a token can span the end of the system part)."""

    def __init__(self, separators: bool = True) -> None:
        self.separators = separators
        self.vocab: dict[str, int] = {}

    def render(self, messages: list[dict[str, str]]) -> str:
        if not self.separators:  # turns run together: the boundary falls inside a word
            return "".join(m["content"] for m in messages) + " |"
        return "".join(f"<{m['role']}> {m['content']} </> " for m in messages) + "<assistant>"

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        words = re.findall(r"ab|<[^>]*>|[^\sab]+|a|b", self.render(messages))
        return [self.vocab.setdefault(w, len(self.vocab)) for w in words]


SYSTEM = {"role": "system", "content": "You answer questions about lighthouses"}
USER = {"role": "user", "content": "How tall is the tallest"}


def test_common_prefix_counts_the_leading_tokens_both_share() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([9], [1]) == 0


def test_a_system_prompt_shares_its_rendered_tokens_and_nothing_of_the_user_turn() -> None:
    t = WordTemplate()
    ids = t.encode_chat([SYSTEM, USER])
    n = shared_prefix(t.encode_chat, [SYSTEM, USER], ids)
    # the whole system turn; the user turn's marker differs from the assistant opening the system part
    # alone ends with
    assert n == len(t.encode_chat([SYSTEM])) - 1
    assert ids[:n] == t.encode_chat([SYSTEM])[:n]
    assert ids[n] == t.vocab["<user>"]


def test_a_chat_without_a_system_message_shares_nothing() -> None:
    t = WordTemplate()
    ids = t.encode_chat([USER])
    assert shared_prefix(t.encode_chat, [USER], ids) == 0
    assert shared_prefix(t.encode_chat, [], []) == 0


def test_a_system_message_after_the_first_turn_is_not_shared() -> None:
    t = WordTemplate()
    chat = [USER, SYSTEM, {"role": "user", "content": "again"}]
    assert leading_system(chat) == []
    assert shared_prefix(t.encode_chat, chat, t.encode_chat(chat)) == 0


def test_several_leading_system_messages_are_shared_together_but_not_a_later_one() -> None:
    t = WordTemplate()
    second = {"role": "system", "content": "Be brief"}
    chat = [SYSTEM, second, USER, {"role": "system", "content": "late"}]
    assert leading_system(chat) == [SYSTEM, second]
    ids = t.encode_chat(chat)
    n = shared_prefix(t.encode_chat, chat, ids)
    assert n == len(t.encode_chat([SYSTEM, second])) - 1  # both system turns, up to the user's marker
    assert ids[:n] == t.encode_chat([SYSTEM, second])[:n]


def test_a_token_merged_across_the_boundary_is_left_out_of_the_shared_part() -> None:
    t = WordTemplate(separators=False)
    system = {"role": "system", "content": "keep a"}
    user = {"role": "user", "content": "b light"}
    ids = t.encode_chat([system, user])  # "keep ab light |": "ab" is one token
    alone = t.encode_chat([system])  # "keep a |"
    n = shared_prefix(t.encode_chat, [system, user], ids)
    assert n == 1 < len(alone) - 1  # "keep" only: the system's last token is not the prompt's
    assert ids[n] == t.vocab["ab"]


def test_a_template_that_refuses_a_system_only_chat_shares_nothing() -> None:
    def refuse(messages: list[dict[str, str]]) -> list[int]:
        if all(m["role"] == "system" for m in messages):
            raise ValueError("Conversation roles must alternate user/assistant")
        return [1, 2, 3]

    assert shared_prefix(refuse, [SYSTEM, USER], [1, 2, 3]) == 0


def test_smollm2s_template_shares_exactly_the_system_turn(model_path: str) -> None:
    tok = ChatTokenizer(model_path)
    system = {"role": "system", "content": "You are a lighthouse historian. " * 20}
    chat = [system, {"role": "user", "content": "Which was the first?"}]
    ids = tok.encode_chat(chat)
    n = shared_prefix(tok.encode_chat, chat, ids)
    alone = tok.encode_chat([system])  # ... <|im_end|> \n <|im_start|> assistant \n
    assert n > 64 and ids[:n] == alone[:n] and tok.decode_bytes(alone[n:]) == b"assistant\n"
    # (special tokens decode to nothing) the system turn up to <|im_start|>, then the user's turn
    assert tok.decode_bytes(ids[:n]).decode().rstrip("\n").endswith(system["content"])
    assert tok.decode_bytes(ids[n:]).decode().startswith("user\nWhich was the first?")


def test_the_setting_turns_sharing_off(settings: Any, model_path: str) -> None:
    tok = ChatTokenizer(model_path)
    chat = [{"role": "system", "content": "Keep it short. " * 30}, USER]
    ids, n = asyncio.run(prompt.encode_chat_shared(tok, chat, 8192))
    assert ids == tok.encode_chat(chat) and n > 64
    settings.ROUTE_PREFIX_SHARING = False
    assert asyncio.run(prompt.encode_chat_shared(tok, chat, 8192)) == (ids, 0)


class Tok:
    """The tokenizer's side an answer needs: token 2 is " x", token 0 ends the turn."""

    eot_ids = {0}

    def decode_bytes(self, ids: list[int]) -> bytes:
        return b" x" * len(ids)

    def token_bytes(self, token: int) -> bytes:
        return self.decode_bytes([token])

    def is_end(self, token: int) -> bool:
        return token == 0


class Client:
    """The route client at Answer's seam: records generate's arguments, reports a prefix hit."""

    def __init__(self) -> None:
        self.hops = [object(), object()]
        self.hop_stats = [HopStats(), HopStats()]
        self.recoveries: list[dict[str, Any]] = []
        self.history: list[int] = []
        self.last_prefilled, self.mode, self.last_truncate, self.last_response = 0, "chain", {}, None
        # the previous answer's, which a new answer must not report as its own before generate starts
        self.last_prefix: dict[str, Any] = {"shared_tokens": 99, "hit": True, "saved": False}
        self.last_spec = SpecStats()
        self.kwargs: dict[str, Any] = {}

    def hop_telemetry(self) -> list[dict[str, Any]]:
        return []

    async def generate(self, prompt: list[int], *args: Any, **kw: Any) -> AsyncIterator[tuple[int, float]]:
        self.kwargs = kw
        n = kw["shared_prefix"]
        self.last_prefix = {"shared_tokens": n, "hit": True, "saved": False} if n else {}
        self.last_prefilled = len(prompt) - n
        self.history = list(prompt)
        for t in (2, 2, 0):
            yield t, -0.5


def test_an_answer_passes_its_shared_prefix_to_the_client_and_reports_the_hit() -> None:
    client = Client()
    live = LiveRoute(uuid.uuid4(), 1, client, [], 8192)
    spec = AnswerSpec(SamplingParams(), 8, shared_prefix=70)
    answer = Answer(live, Tok(), list(range(1, 81)), spec, reused=False)
    before = answer.telemetry()
    assert before["prefix_shared_tokens"] == 0 and before["prefix_hit"] is False

    async def run() -> str:
        return "".join([p.text async for p in answer.pieces()])

    assert asyncio.run(run()) == " x x"
    assert client.kwargs["shared_prefix"] == 70
    t = answer.telemetry()
    assert t["prefix_shared_tokens"] == 70 and t["prefix_hit"] is True
    assert t["n_prefilled"] == 10 and t["n_reused"] == 70


def test_an_answer_without_a_shared_prefix_asks_for_none_and_reports_none() -> None:
    client = Client()
    live = LiveRoute(uuid.uuid4(), 1, client, [], 8192)
    answer = Answer(live, Tok(), [1, 2, 3], AnswerSpec(SamplingParams(), 4), reused=False)

    async def run() -> None:
        async for _ in answer.pieces():
            pass

    asyncio.run(run())
    assert client.kwargs["shared_prefix"] == 0
    t = answer.telemetry()
    assert t["prefix_shared_tokens"] == 0 and t["prefix_hit"] is False
