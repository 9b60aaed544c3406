"""Reference backend: llama-family blocks in PyTorch, dequantizing only the shard's tensors.

Readable on purpose (nanoGPT style): it is the correctness oracle for the faster backends.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from agent import defaults
from agent.artifacts.tensors import read_tensor_f32
from agent.backends.base import (
    AdmissionError,
    Backend,
    BackendError,
    ForwardResult,
    ShardSpec,
    StepInput,
)
from agent.backends.sampling import sample
from agent.wire.frames import numpy_dtype
from agent.wire.ids import SessionId
from agent.wire.sampling import SamplingParams

SUPPORTED_ARCHS = {"llama", "mistral"}
_KV_CHUNK = 256  # positions added per growth step; growth doubles capacity so appends are amortised O(1)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    ffn_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


class SessionKV:
    """One session's keys/values for every layer of the shard, stored in capacity-doubling buffers."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.capacity = capacity
        self.length = 0
        self.allocated = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def bytes_for(self, positions: int) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * positions * 4

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.allocated)

    def next_allocation(self, needed: int) -> int:
        if needed <= self.allocated:
            return self.allocated
        cap = max(needed, 2 * self.allocated, _KV_CHUNK)
        cap = math.ceil(cap / _KV_CHUNK) * _KV_CHUNK
        return min(cap, max(self.capacity, needed))

    def grow(self, positions: int) -> None:
        shape = (self.n_kv_heads, positions, self.head_dim)
        new_k = [torch.empty(shape) for _ in range(self.n_layers)]
        new_v = [torch.empty(shape) for _ in range(self.n_layers)]
        if self.length:
            for i in range(self.n_layers):
                new_k[i][:, : self.length] = self.k[i][:, : self.length]
                new_v[i][:, : self.length] = self.v[i][:, : self.length]
        self.k, self.v, self.allocated = new_k, new_v, positions


def rope_tables(
    theta: float, head_dim: int, max_pos: int, freq_factors: np.ndarray | None
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if freq_factors is not None:
        inv = inv / torch.from_numpy(freq_factors.astype(np.float64))
    ang = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # GGUF llama Q/K rows are permuted at conversion so rotation acts on adjacent pairs (ggml NORM mode).
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


class TorchLlamaBackend(Backend):
    """Layers [a, b) of a llama-family GGUF in float32 PyTorch with a per-session KV cache."""

    def __init__(
        self, spec: ShardSpec, kv_budget_bytes: int = defaults.KV_BUDGET_BYTES, rope_table_len: int = 8192
    ) -> None:
        m = spec.manifest
        if m.architecture not in SUPPORTED_ARCHS:
            raise BackendError(
                f"torch backend does not support architecture {m.architecture!r} "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHS))})"
            )
        self.spec = spec
        torch.set_num_threads(max(1, spec.n_threads))
        hp = m.hparams
        self.d_model = int(hp["embedding_length"])
        self.n_heads = int(hp["attention.head_count"])
        self.n_kv_heads = int(hp.get("attention.head_count_kv", self.n_heads))
        self.head_dim = int(hp.get("attention.key_length", self.d_model // self.n_heads))
        self.eps = float(hp.get("attention.layer_norm_rms_epsilon", 1e-5))
        self.theta = float(hp.get("rope.freq_base", 10000.0))
        self.kv_budget_bytes = kv_budget_bytes
        self.max_ctx = m.context_length or rope_table_len
        path = spec.path
        ff = (
            read_tensor_f32(path, m.tensor("rope_freqs.weight"))
            if m.has_tensor("rope_freqs.weight")
            else None
        )
        self._rope_len = min(self.max_ctx, rope_table_len)
        self._ff = ff
        self.cos, self.sin = rope_tables(self.theta, self.head_dim, self._rope_len, ff)

        def w(name: str) -> torch.Tensor:
            return torch.from_numpy(read_tensor_f32(path, m.tensor(name)))

        self.layers: list[LayerWeights] = []
        for i in range(spec.layer_start, spec.layer_end):
            p = f"blk.{i}."
            self.layers.append(
                LayerWeights(
                    attn_norm=w(p + "attn_norm.weight"),
                    wq=w(p + "attn_q.weight"),
                    wk=w(p + "attn_k.weight"),
                    wv=w(p + "attn_v.weight"),
                    wo=w(p + "attn_output.weight"),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    w_gate=w(p + "ffn_gate.weight"),
                    w_up=w(p + "ffn_up.weight"),
                    w_down=w(p + "ffn_down.weight"),
                )
            )
        self.tok_embd = (
            w("token_embd.weight") if spec.is_first or (spec.is_last and m.tied_embeddings) else None
        )
        if spec.is_last:
            self.out_norm = w("output_norm.weight")
            self.head = self.tok_embd if m.tied_embeddings else w("output.weight")
        self.sessions: dict[SessionId, SessionKV] = {}

    # -- sessions ---------------------------------------------------------------------------------
    def open_session(self, sid: SessionId, capacity: int) -> None:
        if sid in self.sessions:
            raise BackendError("session already open")
        self.sessions[sid] = SessionKV(len(self.layers), self.n_kv_heads, self.head_dim, capacity)

    def close_session(self, sid: SessionId) -> None:
        self.sessions.pop(sid, None)

    def _kv(self, sid: SessionId) -> SessionKV:
        try:
            return self.sessions[sid]
        except KeyError:
            raise BackendError("unknown session") from None

    def session_len(self, sid: SessionId) -> int:
        return self._kv(sid).length

    def truncate(self, sid: SessionId, n_tokens: int) -> None:
        kv = self._kv(sid)
        if n_tokens < 0 or n_tokens > kv.length:
            raise BackendError(f"cannot truncate to {n_tokens}: session holds {kv.length} positions")
        kv.length = n_tokens

    def kv_bytes(self, sid: SessionId | None = None) -> int:
        if sid is not None:
            return self._kv(sid).nbytes
        return sum(s.nbytes for s in self.sessions.values())

    def kv_growth_bytes(self, sid: SessionId, new_len: int) -> int:
        kv = self._kv(sid)
        return kv.bytes_for(kv.next_allocation(new_len)) - kv.nbytes

    def _ensure_rope(self, n: int) -> None:
        if n > self._rope_len:
            self._rope_len = max(n, 2 * self._rope_len)
            self.cos, self.sin = rope_tables(self.theta, self.head_dim, self._rope_len, self._ff)

    # -- compute ----------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _block(self, lw: LayerWeights, layer: int, x: torch.Tensor, kv: SessionKV, pos: int) -> torch.Tensor:
        n = x.shape[0]
        h = self._rms(x, lw.attn_norm)
        q = (h @ lw.wq.T).view(n, self.n_heads, self.head_dim).transpose(0, 1)
        k = (h @ lw.wk.T).view(n, self.n_kv_heads, self.head_dim).transpose(0, 1)
        v = (h @ lw.wv.T).view(n, self.n_kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = self.cos[pos : pos + n], self.sin[pos : pos + n]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.k[layer][:, pos : pos + n] = k
        kv.v[layer][:, pos : pos + n] = v
        keys, vals = kv.k[layer][:, : pos + n], kv.v[layer][:, : pos + n]
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: each KV head serves `rep` query heads
            keys, vals = keys.repeat_interleave(rep, 0), vals.repeat_interleave(rep, 0)
        # Causal within the new block; every earlier position is visible.
        mask = None
        if n > 1:
            mask = torch.ones(n, pos + n, dtype=torch.bool).tril(diagonal=pos)
        att = F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0), vals.unsqueeze(0), attn_mask=mask
        )
        att = att.squeeze(0).transpose(0, 1).reshape(n, self.n_heads * self.head_dim)
        x = x + att @ lw.wo.T
        h = self._rms(x, lw.ffn_norm)
        x = x + (F.silu(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T
        return x

    @torch.inference_mode()
    def forward(self, step: StepInput) -> ForwardResult:
        t0 = time.perf_counter()
        kv = self._kv(step.sid)
        if step.pos_start != kv.length:
            raise BackendError(
                f"position {step.pos_start} does not follow the session's {kv.length} positions"
            )
        if self.spec.is_first:
            if step.token_ids is None:
                raise BackendError("first shard needs token ids")
            emb = self.tok_embd
            assert emb is not None  # loaded for every first shard (__init__)
            ids = torch.from_numpy(np.asarray(step.token_ids, dtype=np.int64))
            if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= emb.shape[0]:
                raise BackendError("token id out of vocabulary range")
            x = emb[ids]
        else:
            if step.hidden is None:
                raise BackendError("this shard needs hidden states")
            if step.hidden.ndim != 2 or step.hidden.shape[1] != self.d_model:
                raise BackendError(
                    f"hidden size mismatch: got {step.hidden.shape}, expected (n, {self.d_model})"
                )
            # a frame's rows are a read-only view of its buffer, which torch must not share: copied
            x = torch.tensor(step.hidden, dtype=torch.float32)
        n = x.shape[0]
        end = step.pos_start + n
        if end > kv.capacity:
            raise BackendError(f"position {end} exceeds the session's limit of {kv.capacity}")
        cap = kv.next_allocation(end)
        if cap != kv.allocated:
            others = self.kv_bytes() - kv.nbytes
            if others + kv.bytes_for(cap) > self.kv_budget_bytes:
                raise AdmissionError("KV budget exhausted on this node")
            kv.grow(cap)
        self._ensure_rope(end)
        for i, lw in enumerate(self.layers):
            x = self._block(lw, i, x, kv, step.pos_start)
        kv.length = end
        res = ForwardResult()
        if self.spec.is_last:
            h = self._rms(x if step.want_logits else x[-1:], self.out_norm)
            head = self.head
            assert head is not None  # loaded for every last shard (__init__)
            logits = h @ head.T
            last = logits[-1].numpy()
            res.token, res.logprob = sample(last, step.sampling or SamplingParams(), end - 1, step.history)
            if step.want_logits:
                res.logits = logits.numpy()
        else:
            res.hidden = x.numpy().astype(numpy_dtype(step.hidden_dtype), copy=False)
        res.compute_s = time.perf_counter() - t0
        return res
