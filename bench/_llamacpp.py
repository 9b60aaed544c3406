"""llama-cpp-python in one process, as bench/served.py compares the served route with it: a Python
decode loop (one sequence), and BATCH sequences decoded together through the low-level llama_batch API."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

BATCH = 8  # sequences decoded together (bench/served.py's 8 sessions)


def open_llama(model: str, threads: int, n_ctx: int, flash: bool = False, **options: Any) -> Any:
    """llama_cpp.Llama as the benches run it: `threads` for decoding and prompts, 512-token batches,
    flash attention off (its default) unless asked; `options` go to Llama as they are."""
    import llama_cpp

    return llama_cpp.Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash,
        verbose=False,
        **options,
    )


class LlamaCpp:
    """llama-cpp-python in this process: a Python decode loop, and 8 sequences through llama_batch."""

    def __init__(self, model: str, threads: int) -> None:
        import llama_cpp

        self.lc = llama_cpp
        self.llm = open_llama(model, threads, 2048)
        self.n_vocab = self.llm.n_vocab()
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = BATCH * 512
        params.n_batch = 512
        params.n_ubatch = 512
        params.n_seq_max = BATCH
        params.n_threads = threads
        params.n_threads_batch = threads
        self.bctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not self.bctx:
            raise RuntimeError("llama.cpp could not create the 8-sequence context")
        self.batch = llama_cpp.llama_batch_init(512, 0, BATCH)

    def _argmax(self, ctx: Any, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def decode_tok_s(self, prompt: list[int], n: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        tok = self._argmax(llm._ctx.ctx, -1)
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = self._argmax(llm._ctx.ctx, -1)
        return n / (time.perf_counter() - t0)

    def _fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)
        if self.lc.llama_decode(self.bctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def batched_tok_s(self, prompt: list[int], n: int) -> float:
        """8 sequences, each prefilled with `prompt`, then decoded one token each per llama_decode."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.bctx), True)
        toks = []
        for s in range(BATCH):
            self._fill([(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)])
            toks.append(self._argmax(self.bctx, len(prompt) - 1))
        pos = len(prompt)
        t0 = time.perf_counter()
        for _ in range(n):
            self._fill([(toks[s], pos, s, True) for s in range(BATCH)])
            toks = [self._argmax(self.bctx, s) for s in range(BATCH)]
            pos += 1
        return BATCH * n / (time.perf_counter() - t0)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.bctx)
        self.llm.close()
