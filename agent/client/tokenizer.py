"""Tokenizer and chat template of a GGUF, via llama-cpp-python with vocab_only (no weights loaded)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from llama_cpp.llama_types import ChatCompletionRequestMessage


class TokenizerError(Exception):
    """The GGUF has no usable tokenizer or chat template."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


# Kept alive here: llama.cpp holds only a raw pointer to the ctypes trampoline.
_LOG_CALLBACK: ctypes._CFunctionType | None = None


def _silence_llama_log() -> None:
    """llama.cpp logs context warnings to stderr even with verbose=False; keep the terminal clean."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return
    import llama_cpp

    def _noop(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        return None

    _LOG_CALLBACK = llama_cpp.llama_log_callback(_noop)
    llama_cpp.llama_log_set(_LOG_CALLBACK, None)


class ChatTokenizer:
    """Turns chat messages into prompt token ids and generated ids back into text."""

    def __init__(self, model_path: str) -> None:
        try:
            from llama_cpp import Llama
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter
        except ImportError as e:  # pragma: no cover - install problem
            raise TokenizerError(f"llama-cpp-python is required for tokenization: {e}") from None
        _silence_llama_log()
        try:
            self._llm = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        except (ValueError, RuntimeError) as e:
            raise TokenizerError(f"{model_path}: cannot load tokenizer ({e})") from None
        meta = self._llm.metadata
        self.eos_id = int(self._llm.token_eos())
        self.bos_id = int(self._llm.token_bos())
        self.eot_ids = {self.eos_id}
        eot = self._llm._model.token_eot()
        if eot >= 0:
            self.eot_ids.add(int(eot))
        self.add_bos = bool(self._llm._model.add_bos_token())
        template = meta.get("tokenizer.chat_template")
        self._formatter = None
        if template:
            bos = self._llm._model.token_get_text(self.bos_id) if self.bos_id >= 0 else ""
            eos = self._llm._model.token_get_text(self.eos_id) if self.eos_id >= 0 else ""
            self._formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
        self.n_vocab = int(self._llm.n_vocab())

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for `messages`, ending with the assistant turn's opening."""
        for m in messages:
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise TokenizerError("each message needs string 'role' and 'content'")
        if self._formatter is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        # Checked above to be role/content strings; the template renders whatever roles it knows.
        chat = cast("list[ChatCompletionRequestMessage]", messages)
        return self._formatter(messages=chat).prompt

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        bos = self.add_bos if add_bos is None else add_bos
        ids = self._llm.tokenize(text.encode(), add_bos=bos, special=True)
        return [int(i) for i in ids]

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self._llm.detokenize(ids)

    def is_end(self, token: int) -> bool:
        return token in self.eot_ids


class StreamDecoder:
    """Emits text deltas token by token without splitting multi-byte UTF-8 characters."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._tok = tok
        self._pending = b""

    def push(self, token: int) -> str:
        self._pending += self._tok.decode_bytes([token])
        try:
            text, self._pending = self._pending.decode("utf-8"), b""
        except UnicodeDecodeError as e:
            # Hold back an incomplete trailing character until the next token completes it.
            if len(self._pending) - e.start >= 4:
                text, self._pending = self._pending.decode("utf-8", "replace"), b""
            else:
                text, self._pending = self._pending[: e.start].decode("utf-8"), self._pending[e.start :]
        return text

    def flush(self) -> str:
        text, self._pending = self._pending.decode("utf-8", "replace"), b""
        return text
