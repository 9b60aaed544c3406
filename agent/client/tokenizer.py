"""Tokenizer and chat template of a GGUF, via llama-cpp-python with vocab_only (no weights loaded).

llama.cpp's tokenizer splits the text at special tokens first, and each split walks the fragment list
from its head (`std::distance(buffer.begin(), it)` in `tokenizer_st_partition`), so one call costs the
square of the special tokens in its text: a chat of 8,000 short messages took 2 s, 250,000 minutes.
`encode` therefore cuts long texts just before a special token every `CHUNK_SPECIALS` of them and
tokenizes the pieces separately (`SpecialSplitter`); llama.cpp tokenizes each fragment between special
tokens on its own anyway, so the ids are the same (tests/agent/test_tokenizer_chunks.py checks it).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

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


# Special tokens per llama_tokenize call: the partition's cost grows with their square.
CHUNK_SPECIALS = 64
# Texts shorter than this hold too few special tokens to be worth scanning for cut points.
CHUNK_MIN_BYTES = 16 << 10
# llama_token_attr bits (llama.h): which tokens the partition splits at, and which eat the space before.
_ATTR_UNKNOWN, _ATTR_CONTROL, _ATTR_USER_DEFINED, _ATTR_LSTRIP = 1 << 0, 1 << 3, 1 << 4, 1 << 7
_PARTITIONING = _ATTR_UNKNOWN | _ATTR_CONTROL | _ATTR_USER_DEFINED
_VOCAB_SPM, _VOCAB_BPE = 1, 2  # llama_vocab_type: the two whose fragments are tokenized independently


def _trie_pattern(words: list[bytes]) -> bytes:
    """A regular expression matching the longest of `words` at a position, as a trie: one step per byte
    however many words share a prefix (a flat alternation tries them all at every '<')."""
    trie: dict[int, Any] = {}
    for w in words:
        node = trie
        for b in w:
            node = node.setdefault(b, {})
        node[-1] = {}  # a word ends here

    def walk(node: dict[int, Any]) -> bytes:
        branches = [re.escape(bytes([b])) + walk(child) for b, child in sorted(node.items()) if b != -1]
        if not branches:
            return b""
        body = b"(?:" + b"|".join(branches) + b")"
        return body + b"?" if -1 in node else body  # greedy: the longer word wins

    return walk(trie)


class SpecialSplitter:
    """Cuts a text just before special tokens, so no piece holds more than `per_piece` of them.

    A cut goes only before a token the partition matches there (the longest special token starting at
    that byte, found left to right) and that does not strip the whitespace before it (LSTRIP)."""

    def __init__(self, specials: dict[bytes, int], per_piece: int = CHUNK_SPECIALS) -> None:
        words = sorted(specials, key=len, reverse=True)
        self._pattern = re.compile(_trie_pattern(words), re.DOTALL) if words else None
        self._cuttable = {w for w, attr in specials.items() if not attr & _ATTR_LSTRIP}
        self.per_piece = per_piece

    def pieces(self, text: bytes) -> list[bytes]:
        if self._pattern is None:
            return [text]
        cuts, since_cut = [0], 0
        for m in self._pattern.finditer(text):
            since_cut += 1
            if since_cut > self.per_piece and m.group() in self._cuttable and m.start() > cuts[-1]:
                cuts.append(m.start())
                since_cut = 1
        cuts.append(len(text))
        return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


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
        self._splitter = self._make_splitter()
        self._pieces: dict[int, bytes] = {}  # token_bytes's, only ever of ids within the vocabulary

    def _make_splitter(self) -> SpecialSplitter | None:
        """Where long texts may be cut between tokenizer calls; None when this vocabulary cannot be."""
        import llama_cpp

        vocab = self._llm._model.vocab
        # SPM and BPE tokenize each fragment alone; an EOS appended per call would land mid-prompt.
        if llama_cpp.llama_vocab_type(vocab) not in (
            _VOCAB_SPM,
            _VOCAB_BPE,
        ) or llama_cpp.llama_vocab_get_add_eos(vocab):
            return None
        specials: dict[bytes, int] = {}
        for i in range(self.n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(vocab, i))
            if attr & _PARTITIONING:
                text = bytes(llama_cpp.llama_vocab_get_text(vocab, i) or b"")
                if text:
                    specials[text] = specials.get(text, 0) | attr
        return SpecialSplitter(specials)

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
        """The ids of `text`, special tokens parsed; long texts in pieces (see the module docstring).
        CPU-bound (seconds for megabytes): async callers run it off their event loop."""
        bos = self.add_bos if add_bos is None else add_bos
        raw = text.encode("utf-8", "replace")  # a lone surrogate (valid in JSON) becomes "?", never a 500
        pieces = [raw]
        if self._splitter is not None and len(raw) >= CHUNK_MIN_BYTES:
            pieces = self._splitter.pieces(raw)
        ids: list[int] = []
        for n, piece in enumerate(pieces):
            ids.extend(int(i) for i in self._llm.tokenize(piece, add_bos=bos and n == 0, special=True))
        return ids

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The ids' text as bytes; TokenizerError for an id outside the vocabulary (llama.cpp's
        detokenizer would abort the process on it)."""
        for t in ids:
            if not 0 <= t < self.n_vocab:
                raise TokenizerError(f"token {t} is outside the vocabulary of {self.n_vocab} tokens")
        return self._llm.detokenize(ids)

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes: detokenized alone they never change, so each is kept after its first
        use (at most the vocabulary's size; the answer's loop asks once a token)."""
        b = self._pieces.get(token)
        if b is None:
            b = self._pieces[token] = self.decode_bytes([token])
        return b

    def is_end(self, token: int) -> bool:
        return token in self.eot_ids


class StreamDecoder:
    """Emits text deltas token by token without splitting multi-byte UTF-8 characters."""

    def __init__(self, tok: ChatTokenizer) -> None:
        self._tok = tok
        self._pending = b""

    def push(self, token: int) -> str:
        self._pending += self._tok.token_bytes(token)
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
