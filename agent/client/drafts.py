"""Drafts from a small model of the route's vocabulary, run in the client's own process by llama.cpp."""

from __future__ import annotations

from typing import Any

import numpy as np

from agent.wire.prefix import common_prefix


class ModelDrafter:
    """Greedy drafts of a draft model sharing the route model's tokenizer (SmolLM2-135M for a larger
    SmolLM2): its KV follows the answer's context, kept where it agrees and cut back where it does
    not, so each step evaluates only the tokens new to it plus the draft."""

    def __init__(self, path: str, threads: int = 1, n_ctx: int = 4096) -> None:
        import llama_cpp  # the client's only native dependency, loaded when a draft model is asked for

        self._lc = llama_cpp
        self.llm: Any = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.n_ctx = n_ctx
        self.n_vocab = int(self.llm.n_vocab())
        self.held: list[int] = []  # the tokens in its KV, in order

    def _argmax(self) -> int:
        ptr = self._lc.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def _follow(self, context: list[int]) -> None:
        """Bring the KV to `context`, re-evaluating from the first token where they differ (at least
        the last one: its logits are what the next draft starts from)."""
        common = min(common_prefix(self.held, context), len(context) - 1)
        self.llm.n_tokens = common  # eval cuts the KV from here
        del self.held[common:]
        self.llm.eval(context[common:])
        self.held.extend(context[common:])

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0 or not context or len(context) + k >= self.n_ctx:
            return []
        self._follow(context)
        out = [self._argmax()]
        while len(out) < k:
            self.llm.eval([out[-1]])
            self.held.append(out[-1])
            out.append(self._argmax())
        return out


class MtpDrafter:
    """Drafts from the model's own MTP head, run by the route's last hop after each step (a DeepSeek-V4
    file's nextn block, docs/speculative.md): the hop sends them with its answer (Response.drafts),
    the route client offers them here, and they stand for the step after. Free on the client; a
    session asks the last hop for them at OPEN (RouteClient.mtp_draft). Where the head sent none for
    this context (a hop started without it, a restored session), the fallback drafter drafts."""

    # proposals without one offer after which a route is taken to have no head (its node runs without
    # `--mtp`): the drafter stops holding the answers' steps on the Python path, where drafts come
    NO_HEAD_AFTER = 16

    def __init__(self, fallback: Any = None) -> None:
        self.at = -1  # the context length the drafts follow (they continue its last token)
        self.drafts: list[int] = []
        self.offered = 0  # answers that carried drafts
        self.asked = 0  # proposals asked for
        self.fallback = fallback  # a Drafter (spec.NgramDrafter) for contexts the head sent nothing for

    @property
    def needs_python_path(self) -> bool:
        """The drafts come only with answers on the Python path (the native lanes answer without
        them): held there while a head sends drafts or may still turn out to."""
        return self.offered > 0 or self.asked < self.NO_HEAD_AFTER

    def offer(self, context_len: int, drafts: list[int]) -> None:
        """The last hop's drafts after the token that ends a context of `context_len` tokens."""
        self.at, self.drafts = context_len, list(drafts)
        self.offered += bool(drafts)

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        self.asked += 1
        if len(context) == self.at and self.drafts:
            return self.drafts[:k]
        return self.fallback.propose(context, k) if self.fallback is not None else []
