"""Lightning indexer with kpool compression: picks which keys a DSA layer attends.

    k_I   = LayerNorm(wk x) [dI]               q_I = wq_b(q_resid) [nI, dI]
    pool  = kpool consecutive tokens of a sequence; pool key = sum_j softmax_j(gate_j + ape_j) * k_I,j
            (per channel, gate = index_kpool_compress_gate x)
    score(t, pool) = sum_h w_th * ReLU(q_I,th . poolkey * dI^-0.5),  w = weights_proj(x) * nI^-0.5
A pool is a candidate for query t once complete and its last token <= t. The top index_topk / kpool
pools are expanded to their token ids and the incomplete tail (up to kpool-1 tokens, always visible)
is appended: width index_topk + kpool - 1, -1 marks an empty slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glmkit.model.packed import Packed

# Query rows scored at once against all pools: bounds the [rows, heads, pools] score tensor.
_SCORE_BUDGET = 1 << 26


@dataclass
class IndexerState:
    """Decode cache of one full indexer for B requests: keys, gates [B, cap, dI]; pool keys
    [B, cap // kpool, dI] filled as pools complete."""

    keys: torch.Tensor
    gates: torch.Tensor
    pools: torch.Tensor


def topk_lowest_index_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of scores [R, P] (fp32) per row, largest first, equal scores in
    increasing index order: the first k of a stable descending sort, without sorting all P.

    ReLU makes exact ties (often at 0) common, and torch.topk orders ties differently for other
    shapes and devices; one total order keeps every path (packed, decode, any batch) on the same
    pools. Each score becomes an order-preserving int32 (negative floats have their magnitude bits
    flipped; + 0.0 turns -0.0 into 0.0 first), joined with the reversed index into one int64 key."""
    bits = (scores.float() + 0.0).view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    reversed_index = scores.shape[-1] - 1 - torch.arange(scores.shape[-1], device=scores.device)
    return torch.topk(order * (1 << 32) + reversed_index, k, dim=-1, sorted=True).indices


class LightningIndexer(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, dI, nI = config.hidden_size, config.index_head_dim, config.index_n_heads
        self.n_heads, self.head_dim = nI, dI
        self.kpool, self.topk = config.index_kpool, config.index_topk
        self.select_tail = config.index_kpool_always_select_tail
        self.wq_b = nn.Linear(config.q_lora_rank, nI * dI, bias=False)
        self.wk = nn.Linear(D, dI, bias=False)
        self.k_norm = nn.LayerNorm(dI, eps=1e-6)
        self.weights_proj = nn.Linear(D, nI, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, dI))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(dI, D))

    @property
    def width(self) -> int:
        return self.topk + (self.kpool - 1 if self.select_tail else 0)

    # ---- pieces ------------------------------------------------------------------------
    def _keys(self, x):
        """x [..., D] -> (k_I [..., dI], gate logits [..., dI])."""
        return self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)

    def _compress(self, keys, gates):
        """keys, gates [..., kpool, dI] -> pool keys [..., dI]: gated softmax average per channel."""
        probs = (gates.float() + self.index_kpool_compress_ape.float()).softmax(dim=-2).to(keys.dtype)
        return (probs * keys).sum(-2)

    def _pool(self, keys, gates):
        """Complete pools: keys, gates [P*kpool, dI] -> pool keys [P, dI]."""
        return self._compress(keys.unflatten(0, (-1, self.kpool)), gates.unflatten(0, (-1, self.kpool)))

    def _query(self, x, q_resid):
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim)).float()
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        return q, w

    def _scores(self, q, w, pools):
        """q [..., nI, dI], w [..., nI], pools [..., P, dI] -> [..., P] (fp32)."""
        s = F.relu(q @ pools.float().transpose(-1, -2) * self.head_dim ** -0.5)
        return (w.unsqueeze(-2) @ s).squeeze(-2)

    def _candidates_only(self, scores, visible_count):
        """scores [R, P] with -inf where a pool is not complete and visible to the row."""
        pool_ids = torch.arange(scores.shape[1], device=scores.device)
        return scores.masked_fill(pool_ids[None] >= (visible_count // self.kpool)[:, None], float("-inf"))

    def _expand(self, scores, visible_count):
        """scores [R, P] over pools, visible_count [R] (tokens visible to each query, itself included)
        -> token positions [R, width] relative to the sequence start, -1 = empty. The layout does not
        depend on P (the pools scored): always topk // kpool pool slots, then the tail."""
        take = self.topk // self.kpool
        if scores.shape[1] < take:  # fewer pools than slots: the missing ones are never candidates
            scores = F.pad(scores, (0, take - scores.shape[1]), value=float("-inf"))
        R, P = scores.shape
        complete = visible_count // self.kpool
        pool_ids = torch.arange(P, device=scores.device)
        candidate = pool_ids[None] < complete[:, None]
        pieces = []
        if take:
            chosen = topk_lowest_index_first(self._candidates_only(scores, visible_count), take)
            ok = candidate.gather(1, chosen)
            tokens = chosen[..., None] * self.kpool + torch.arange(self.kpool, device=scores.device)
            pieces.append(tokens.masked_fill(~ok[..., None], -1).flatten(1))
        if self.select_tail and self.kpool > 1:
            tail_len = visible_count - complete * self.kpool
            offs = torch.arange(self.kpool - 1, device=scores.device)
            tail = (complete * self.kpool)[:, None] + offs
            pieces.append(tail.masked_fill(offs[None] >= tail_len[:, None], -1))
        out = torch.cat(pieces, dim=1) if pieces else scores.new_empty(R, 0, dtype=torch.long)
        return F.pad(out, (0, self.width - out.shape[1]), value=-1)

    # ---- train path and prefill -------------------------------------------------------------
    @torch.no_grad()
    def select_packed(self, x, q_resid, packed: Packed, state: IndexerState | None = None, on_scores=None):
        """x [T, D], q_resid [T, q_lora] -> selected token ids [T, width] as packed (global) indices.
        With `state`, also fills the decode cache of every sequence (slot n = sequence n). With
        `on_scores`, calls it with every row's pool scores [T, max pools of a sequence] (fp32,
        -inf where a pool is not a candidate): what a tie judgement needs."""
        keys, gates = self._keys(x)
        q, w = self._query(x, q_resid)
        out = torch.full((x.shape[0], self.width), -1, dtype=torch.long, device=x.device)
        all_scores = None
        if on_scores is not None:
            widest = max(end - start for start, end in packed.bounds()) // self.kpool
            all_scores = torch.full((x.shape[0], widest), float("-inf"), device=x.device)
        for n, (start, end) in enumerate(packed.bounds()):
            L = end - start
            n_pools = L // self.kpool
            pools = self._pool(keys[start:start + n_pools * self.kpool], gates[start:start + n_pools * self.kpool])
            if state is not None:
                state.keys[n, :L], state.gates[n, :L], state.pools[n, :n_pools] = keys[start:end], gates[start:end], pools
            rows = max(1, _SCORE_BUDGET // max(1, self.n_heads * n_pools))
            for r0 in range(0, L, rows):
                r1 = min(L, r0 + rows)
                # pools that complete after the block's last row are candidates for none of its rows
                seen = pools[:r1 // self.kpool]
                scores = self._scores(q[start + r0:start + r1], w[start + r0:start + r1], seen)
                visible = torch.arange(r0 + 1, r1 + 1, device=x.device)
                sel = self._expand(scores, visible)
                out[start + r0:start + r1] = torch.where(sel >= 0, sel + start, sel)
                if all_scores is not None:
                    all_scores[start + r0:start + r1, :scores.shape[1]] = self._candidates_only(scores, visible)
        if on_scores is not None:
            on_scores(all_scores)
        return out

    # ---- rollout decode ----------------------------------------------------------------------
    @torch.no_grad()
    def select_step(self, x, q_resid, lengths, state: IndexerState, on_scores=None):
        """x [B, D] new tokens at cache positions `lengths` [B] -> cache positions [B, width]
        (`on_scores` as in select_packed, [B, pools])."""
        B = x.shape[0]
        rows = torch.arange(B, device=x.device)
        keys, gates = self._keys(x)
        state.keys[rows, lengths], state.gates[rows, lengths] = keys, gates
        visible = lengths + 1
        done = (visible % self.kpool == 0).nonzero().flatten()
        if len(done):  # this token completed a pool: compress it once, keep it in the cache
            span = visible[done, None] - self.kpool + torch.arange(self.kpool, device=x.device)
            pooled = self._compress(state.keys[done[:, None], span], state.gates[done[:, None], span])
            state.pools[done, visible[done] // self.kpool - 1] = pooled
        q, w = self._query(x, q_resid)
        n_pools = int(visible.max()) // self.kpool
        scores = self._scores(q, w, state.pools[:, :n_pools])
        if on_scores is not None:
            on_scores(self._candidates_only(scores, visible))
        return self._expand(scores, visible)

    def empty_state(self, batch: int, capacity: int, dtype, device) -> IndexerState:
        z = lambda n: torch.zeros(batch, n, self.head_dim, dtype=dtype, device=device)  # noqa: E731
        return IndexerState(z(capacity), z(capacity), z(capacity // self.kpool + 1))
