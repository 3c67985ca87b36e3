"""DSA layer: NoPE multi-latent attention over the keys the lightning indexer selects.

    q_resid = RMSNorm(q_a x) [q_lora];  q = q_b q_resid  [H, dk]          (no RoPE half: NoPE)
    c       = RMSNorm(kv_a x) [R=kv_lora_rank]                          the latent a cache holds
    k, v    = split(kv_b c) [H, dk], [H, dv]
    out     = o_proj(softmax(q k_sel^T * dk^-0.5) v_sel)   over the selected keys only

Full sequences (train path, prefill) go through the DSA kernel backend the run chose
(`glmkit.kernels.dsa`: the un-absorbed reference, or the absorbed form that attends over the R-dim
latent all heads share). Decode is always absorbed: kv_b's key half folded into the query
(q' = q W_UK, [H, R]) and its value half into the output, so kv_b_proj never runs as a module there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glmkit.kernels.indexer import naive as indexer_naive
from glmkit.model.indexer import IndexerState, LightningIndexer
from glmkit.model.norms import RMSNorm
from glmkit.model.packed import Packed


def replayed(own: torch.Tensor | None, replay: torch.Tensor | None) -> torch.Tensor:
    """Top-k replay: rows of `replay` [R, W'] that hold an id replace `own` [R, W]; all-empty rows
    (-1 throughout) keep this forward's own choice. The result is as wide as the wider of the two."""
    if replay is None:
        return own
    replay = replay.to(device=own.device if own is not None else replay.device, dtype=torch.long)
    if own is None:
        return replay
    width = max(own.shape[1], replay.shape[1])
    own, replay = (torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) for t in (own, replay))
    return torch.where((replay >= 0).any(-1, keepdim=True), replay, own)


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

    def forward_packed(self, x, packed: Packed, dsa, shared_topk=None, state: DSAState | None = None,
                       replay=None, on_scores=None, indexer_ops=indexer_naive):
        """x [T, D] packed -> (out [T, D], selection used [T, W], own selection [T, width] or None for
        a shared indexer) through the DSA kernel backend `dsa`. `state` receives the latents (and
        indexer cache) of every sequence, for decoding after a prefill. `replay` [T, W'] (packed ids,
        -1 empty) replaces the selection of every row that has an id (top-k replay; the indexer still
        runs, to fill caches, report its own choice and its scores to `on_scores`). `indexer_ops`: the
        indexer backend (glmkit.kernels.indexer); every forward_* takes one."""
        q_resid, q, latent = self._project(x)
        if state is not None:
            state.latent[packed.seq_index, packed.positions] = latent
        if self.indexer is not None:
            topk = self.indexer.select_packed(x, q_resid, packed, state.indexer if state is not None else None,
                                              on_scores, indexer_ops)
        elif shared_topk is None and replay is None:
            raise ValueError("a DSA layer with a shared indexer needs the top-k of the layer before it")
        else:
            topk = shared_topk
        used = replayed(topk, replay)
        out = dsa.attend(q, latent, self.kv_b_proj.weight, used, packed.bounds(), self.scale)
        return self.o_proj(out.flatten(-2)), used, topk if self.indexer is not None else None

    def forward_chunk(self, x, packed: Packed, slots, offsets, state: DSAState, dsa, shared_topk=None,
                      replay=None, on_scores=None, indexer_ops=indexer_naive):
        """x [T, D]: the next tokens of N requests, packed; request n continues cache slot slots[n]
        after its offsets[n] cached tokens -> (out [T, D], positions used, own positions or None), as
        forward_step: selections are cache positions, the latents are written into the cache first."""
        q_resid, q, latent = self._project(x)
        row_slots = slots[packed.seq_index]
        positions = offsets[packed.seq_index] + packed.positions
        state.latent[row_slots, positions] = latent
        if self.indexer is not None:
            topk = self.indexer.select_cached(x, q_resid, row_slots, positions, state.indexer, on_scores, indexer_ops)
        elif shared_topk is None and replay is None:
            raise ValueError("a DSA layer with a shared indexer needs the top-k of the layer before it")
        else:
            topk = shared_topk
        used = replayed(topk, replay)
        out = dsa.attend_cache(q, state.latent, self.kv_b_proj.weight, used, row_slots, self.scale)
        return self.o_proj(out.flatten(-2)), used, topk if self.indexer is not None else None

    def forward_step(self, x, lengths, state: DSAState, dsa, shared_topk=None, replay=None, on_scores=None,
                     indexer_ops=indexer_naive):
        """x [B, D] new tokens at cache positions `lengths` [B] -> (out [B, D], positions used, own
        positions or None), as forward_packed; `replay` [B, W'] holds cache positions."""
        q_resid, q, latent = self._project(x)
        rows = torch.arange(x.shape[0], device=x.device)
        state.latent[rows, lengths] = latent
        if self.indexer is not None:
            topk = self.indexer.select_step(x, q_resid, lengths, state.indexer, on_scores, indexer_ops)
        else:
            topk = shared_topk
        used = replayed(topk, replay)
        # every slot, empty ones masked: a width fixed by the config, not by the selection (no
        # read-back, one shape for a CUDA graph)
        out = dsa.attend_cache(q, state.latent, self.kv_b_proj.weight, used, rows, self.scale)
        return self.o_proj(out.flatten(-2)), used, topk if self.indexer is not None else None

    def empty_state(self, batch: int, capacity: int, dtype, device) -> DSAState:
        latent = torch.zeros(batch, capacity, self.rank, dtype=dtype, device=device)
        ind = self.indexer.empty_state(batch, capacity, dtype, device) if self.indexer is not None else None
        return DSAState(latent, ind)
