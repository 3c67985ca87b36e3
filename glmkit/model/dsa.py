"""DSA layer: NoPE multi-latent attention over the keys the lightning indexer selects.

    q_resid = RMSNorm(q_a x) [q_lora];  q = q_b q_resid  [H, dk]          (no RoPE half: NoPE)
    c       = RMSNorm(kv_a x) [R=kv_lora_rank]                          the latent a cache holds
    k, v    = split(kv_b c) [H, dk], [H, dv]
    out     = o_proj(softmax(q k_sel^T * dk^-0.5) v_sel)   over the selected keys only

Two forms over the same weights:
- un-absorbed (train path): k, v expanded per head, then gathered per query;
- absorbed (rollout): kv_b's key half folded into the query (q' = q W_UK, [H, R]) and its value half
  into the output, so attention is MQA over the R-dim latent and the kv_b_proj module is never called.
Memory is O(T x width) per query block, never a T x T mask: the selected ids are compacted to the
longest row's count (a 60-token sequence attends over 60 columns, not index_topk), and with autograd
each query block is recomputed in the backward instead of keeping its gathered keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from glmkit.model.indexer import IndexerState, LightningIndexer
from glmkit.model.norms import RMSNorm
from glmkit.model.packed import Packed

# Gathered elements per query block (rows x width x heads x dim): bounds train-path memory.
_GATHER_BUDGET = 1 << 27


def compact_selection(idx: torch.Tensor) -> torch.Tensor:
    """idx [R, W] (-1 empty) -> [R, W'] with each row's ids first, in their order, and W' the
    largest count of any row. Each row attends over the same set; only the all-empty columns go."""
    empty = idx < 0
    order = empty.to(torch.uint8).argsort(dim=-1, stable=True)
    width = max(1, int((~empty).sum(-1).max())) if idx.numel() else 1
    return idx.gather(1, order[:, :width])


@dataclass
class DSAState:
    """Decode cache of one DSA layer: latent [B, cap, R]; indexer state when this layer runs its own."""

    latent: torch.Tensor
    indexer: IndexerState | None


class SparseMLA(nn.Module):
    def __init__(self, config, shared_indexer: bool):
        super().__init__()
        if config.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim={config.qk_rope_head_dim}; GLM-5.3-Flash DSA is NoPE (allowed: 0)")
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads, self.dk, self.dv, self.rank = H, config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.scale = self.dk ** -0.5
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=config.attention_bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.dk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.rank, bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.dk + self.dv), bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=config.attention_bias)
        self.indexer = None if shared_indexer else LightningIndexer(config)

    def _project(self, x):
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).unflatten(-1, (self.num_heads, self.dk))
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        return q_resid, q, latent

    def _absorbed_weights(self):
        """kv_b_proj.weight [H*(dk+dv), R] as W_UK [H, dk, R] and W_UV [H, dv, R]."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.dk + self.dv))
        return w[:, :self.dk], w[:, self.dk:]

    def _attend_absorbed(self, q, latents, idx):
        """q [R', H, dk], latents gathered [R', W, R], idx [R', W] (-1 empty) -> [R', H, dv]."""
        # fp32 throughout, as MLA decode kernels accumulate: the folded query q W_UK would otherwise
        # be rounded to bf16 once more than the expanded form's q and k are
        w_uk, w_uv = (w.float() for w in self._absorbed_weights())
        latents = latents.float()
        q_lat = torch.einsum("thd,hdr->thr", q.float(), w_uk)
        scores = torch.einsum("thr,twr->thw", q_lat, latents) * self.scale
        probs = scores.masked_fill((idx < 0)[:, None], float("-inf")).softmax(-1)
        return torch.einsum("hvr,thr->thv", w_uv, torch.einsum("thw,twr->thr", probs, latents)).to(q.dtype)

    def _attend_expanded(self, q, k, v, idx):
        """q [R', H, dk], k/v gathered [R', W, H, d], idx [R', W] -> [R', H, dv]."""
        scores = torch.einsum("thd,twhd->thw", q, k).float() * self.scale
        probs = scores.masked_fill((idx < 0)[:, None], float("-inf")).softmax(-1).to(q.dtype)
        return torch.einsum("thw,twhd->thd", probs, v)

    def forward_packed(self, x, packed: Packed, shared_topk=None, absorbed=False, state: DSAState | None = None):
        """x [T, D] packed -> (out [T, D], selected ids [T, width]). `state` receives the latents (and
        indexer cache) of every sequence, for decoding after a prefill."""
        q_resid, q, latent = self._project(x)
        if state is not None:
            for n, (start, end) in enumerate(packed.bounds()):
                state.latent[n, :end - start] = latent[start:end]
        if self.indexer is not None:
            topk = self.indexer.select_packed(x, q_resid, packed, state.indexer if state is not None else None)
        elif shared_topk is None:
            raise ValueError("a DSA layer with a shared indexer needs the top-k of the layer before it")
        else:
            topk = shared_topk
        selected = compact_selection(topk)
        T, W = selected.shape
        if absorbed:
            per_row = W * self.rank
        else:
            kv = self.kv_b_proj(latent).unflatten(-1, (self.num_heads, self.dk + self.dv))
            k, v = kv.split([self.dk, self.dv], dim=-1)
            per_row = W * self.num_heads * (self.dk + self.dv)
        rows = max(1, _GATHER_BUDGET // per_row)
        outs = []
        for r0 in range(0, T, rows):
            sl = slice(r0, min(T, r0 + rows))
            if absorbed:
                outs.append(self._attend_absorbed(q[sl], latent[selected[sl].clamp(min=0)], selected[sl]))
            elif torch.is_grad_enabled():
                # the gathered k/v of every block would stay alive for the backward (T x W x H x d
                # in all); recomputing one block at a time keeps the bound in training too
                outs.append(checkpoint(self._gather_attend, q[sl], k, v, selected[sl], use_reentrant=False))
            else:
                outs.append(self._gather_attend(q[sl], k, v, selected[sl]))
        return self.o_proj(torch.cat(outs).flatten(-2)), topk

    def _gather_attend(self, q, k, v, idx):
        safe = idx.clamp(min=0)
        return self._attend_expanded(q, k[safe], v[safe], idx)

    def forward_step(self, x, lengths, state: DSAState, shared_topk=None):
        """x [B, D] new tokens at cache positions `lengths` [B] -> (out [B, D], selected positions)."""
        q_resid, q, latent = self._project(x)
        rows = torch.arange(x.shape[0], device=x.device)
        state.latent[rows, lengths] = latent
        if self.indexer is not None:
            topk = self.indexer.select_step(x, q_resid, lengths, state.indexer)
        else:
            topk = shared_topk
        selected = compact_selection(topk)
        gathered = state.latent[rows[:, None], selected.clamp(min=0)]
        return self.o_proj(self._attend_absorbed(q, gathered, selected).flatten(-2)), topk

    def empty_state(self, batch: int, capacity: int, dtype, device) -> DSAState:
        latent = torch.zeros(batch, capacity, self.rank, dtype=dtype, device=device)
        ind = self.indexer.empty_state(batch, capacity, dtype, device) if self.indexer is not None else None
        return DSAState(latent, ind)
