"""Prompts checked for size before they cost anything, then rendered and tokenized off the event loop.

A chat template's rendering and llama.cpp's tokenizer are CPU work in the web process: done on the event
loop, one 9.9 MB prompt froze every page for 13.6 s (issue 33). Both the API (webapp/api/engine.py) and
the playground (webapp/playground/consumers.py) go through here:

* `check_messages` / `check_text` refuse, before anything is rendered, a prompt with more messages than
  `max_messages(capacity)` or more bytes than `max_prompt_bytes(capacity)`: every message costs at
  least one token, and a prompt of more than PROMPT_BYTES_PER_TOKEN bytes per token of the model's
  context cannot fit it (real text averages about 4);
* `encode_chat` (`encode_chat_shared` also counts the tokens of its system prompt other users may share)
  / `encode_text` then run the work on `pool`, a few threads (llama.cpp releases the GIL)
  with a bounded number of prompts admitted at once: past TOKENIZE_QUEUE the request is refused with
  `PromptBusy` (a 503) instead of queueing unbounded CPU work behind the others.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from django.conf import settings

from agent.client.tokenizer import ChatTokenizer
from webapp.routing.prefix import shared_prefix

T = TypeVar("T")


class PromptError(ValueError):
    """A prompt refused before tokenizing; the text is safe to show. `status` and `code` for the API."""

    status = 400
    code = "context_length_exceeded"


class TooManyMessages(PromptError):
    code = "invalid_value"


class PromptBusy(PromptError):
    """Too many prompts are being tokenized in this process; try again in a moment."""

    status = 503
    code = "overloaded"


def max_prompt_bytes(capacity: int) -> int:
    return int(capacity) * int(settings.PROMPT_BYTES_PER_TOKEN)


def max_messages(capacity: int) -> int:
    return min(int(settings.MAX_CHAT_MESSAGES), int(capacity))


def _utf8_size(texts: Sequence[str], limit: int) -> int:
    """The UTF-8 size of `texts` together, exact up to `limit` (a character is 1 to 4 bytes)."""
    chars = sum(len(t) for t in texts)
    if chars > limit or chars * 4 <= limit:
        return chars
    return sum(len(t.encode("utf-8", "replace")) for t in texts)


def _refuse_size(size: int, capacity: int, what: str) -> None:
    limit = max_prompt_bytes(capacity)
    if size > limit:
        raise PromptError(
            f"{what} is {size} bytes; this model's context of {capacity} tokens takes at most {limit} "
            "bytes of prompt. Please shorten it."
        )


def check_messages(messages: Sequence[dict[str, str]], capacity: int) -> None:
    """Refuse a chat that cannot fit `capacity` tokens, counting messages and bytes only."""
    most = max_messages(capacity)
    if len(messages) > most:
        raise TooManyMessages(f"{len(messages)} messages; at most {most} are accepted for this model")
    limit = max_prompt_bytes(capacity)
    texts = [m.get("content", "") for m in messages] + [m.get("role", "") for m in messages]
    _refuse_size(_utf8_size([t for t in texts if isinstance(t, str)], limit), capacity, "the conversation")


def check_text(text: str, capacity: int) -> None:
    _refuse_size(_utf8_size([text], max_prompt_bytes(capacity)), capacity, "the prompt")


class BoundedPool:
    """A few worker threads and at most `admitted` jobs in them or waiting; `run` refuses past that."""

    def __init__(self, threads: int, admitted: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="prompt")
        self._slots = threading.BoundedSemaphore(admitted)
        self.admitted = admitted

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        if not self._slots.acquire(blocking=False):
            raise PromptBusy(f"the server is tokenizing {self.admitted} prompts already; retry in a moment")
        try:
            job = self._executor.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        # released when the job ends, not when the caller stops waiting: a client that disconnects
        # does not free its slot while its prompt still burns a thread
        job.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(job)


_pool: BoundedPool | None = None
_pool_lock = threading.Lock()


def pool() -> BoundedPool:
    """The process's prompt pool, made on first use (TOKENIZE_THREADS threads, TOKENIZE_QUEUE admitted)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = BoundedPool(int(settings.TOKENIZE_THREADS), int(settings.TOKENIZE_QUEUE))
        return _pool


async def encode_chat(tok: ChatTokenizer, messages: list[dict[str, str]], capacity: int) -> list[int]:
    """The chat's prompt ids: sizes checked here, the template rendered and tokenized on `pool`."""
    check_messages(messages, capacity)
    return await pool().run(tok.encode_chat, messages)


def _ids_and_shared(tok: ChatTokenizer, messages: list[dict[str, str]]) -> tuple[list[int], int]:
    ids = tok.encode_chat(messages)
    return ids, shared_prefix(tok.encode_chat, messages, ids)


async def encode_chat_shared(
    tok: ChatTokenizer, messages: list[dict[str, str]], capacity: int
) -> tuple[list[int], int]:
    """The chat's prompt ids, and how many of them other users' sessions may share (its leading system
    messages, webapp/routing/prefix.py; 0 when ROUTE_PREFIX_SHARING is off). One job on `pool`: the
    system part is rendered and tokenized a second time there, never on the event loop."""
    check_messages(messages, capacity)
    if not settings.ROUTE_PREFIX_SHARING:
        return await pool().run(tok.encode_chat, messages), 0
    return await pool().run(_ids_and_shared, tok, messages)


async def encode_text(tok: ChatTokenizer, text: str, capacity: int) -> list[int]:
    check_text(text, capacity)
    return await pool().run(tok.encode, text)
