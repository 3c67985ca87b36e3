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

from glmkit.kernels.indexer import naive as indexer_naive
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

    def _compress(self, keys, gates, ops):
        """keys, gates [..., kpool, dI] -> pool keys [..., dI]: gated softmax average per channel."""
        return ops.compress(keys, gates, self.index_kpool_compress_ape)

    def _pool(self, keys, gates, ops=indexer_naive):
        """Complete pools: keys, gates [P*kpool, dI] -> pool keys [P, dI]."""
        return self._compress(keys.unflatten(0, (-1, self.kpool)), gates.unflatten(0, (-1, self.kpool)), ops)

    def _query(self, x, q_resid):
        q = self.wq_b(q_resid).unflatten(-1, (self.n_heads, self.head_dim)).float()
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        return q, w

    def _scores(self, q, w, pools, ops):
        """q [B, J, nI, dI], w [B, J, nI], pools [B, P, dI] -> [B, J, P] (fp32): J query rows of each
        batch entry against that entry's pools, one batched GEMM."""
        return ops.scores(q, w, pools, self.head_dim)

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
    def select_packed(self, x, q_resid, packed: Packed, state: IndexerState | None = None, on_scores=None,
                      ops=indexer_naive):
        """x [T, D], q_resid [T, q_lora] -> selected token ids [T, width] as packed (global) indices.
        With `state`, also fills the decode cache of every sequence (slot n = sequence n). With
        `on_scores`, calls it with every row's pool scores [T, max pools of a sequence] (fp32,
        -inf where a pool is not a candidate): what a tie judgement needs. `ops`: the indexer backend
        (a module of glmkit.kernels.indexer; every select_* takes one).

        All sequences go at once, a few kernels per query block rather than per sequence: pools of
        the whole batch in one gather, and per block the rows at positions [j0, j1) of every
        sequence still that long, scored against their own sequence's pools in one batched GEMM."""
        device, kp = x.device, self.kpool
        keys, gates = self._keys(x)
        q, w = self._query(x, q_resid)
        T = x.shape[0]
        lengths = packed.lengths()  # host ints; everything below stays on the device without a sync
        # one spare row T takes the writes of the padding rows of a block
        out = torch.full((T + 1, self.width), -1, dtype=torch.long, device=device)
        if not lengths:
            return out[:T]
        cu = packed.cu_seqlens
        starts, lengths_t = cu[:-1], cu[1:] - cu[:-1]
        pools_t = lengths_t // kp
        total_pools, widest = sum(L // kp for L in lengths), max(lengths) // kp
        # pools of every sequence: pool p of sequence n covers rows starts[n] + p*kp ... + kp-1
        pool_seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), pools_t, output_size=total_pools)
        pool_local = torch.arange(total_pools, device=device) - (pools_t.cumsum(0) - pools_t)[pool_seq]
        pool_rows = (starts[pool_seq] + pool_local * kp)[:, None] + torch.arange(kp, device=device)
        pools = self._compress(keys[pool_rows], gates[pool_rows], ops)  # [all pools, dI]
        if state is not None:
            state.keys[packed.seq_index, packed.positions] = keys
            state.gates[packed.seq_index, packed.positions] = gates
            state.pools[pool_seq, pool_local] = pools
        # per sequence, its pools padded to the widest: [N, widest, dI] (padding is never a candidate)
        pooled = pools.new_zeros(len(lengths), widest, pools.shape[-1])
        pooled[pool_seq, pool_local] = pools
        all_scores = torch.full((T + 1, widest), float("-inf"), device=device) if on_scores is not None else None
        # longest first: the sequences still running at position j are a prefix of this order
        order = sorted(range(len(lengths)), key=lambda n: -lengths[n])
        order_t = torch.argsort(-lengths_t, stable=True)  # the same order, on the device
        longest, j0 = max(lengths), 0
        while j0 < longest:
            A = sum(1 for n in order if lengths[n] > j0)
            seqs = order_t[:A]
            rows = max(1, _SCORE_BUDGET // max(1, A * self.n_heads * max(1, widest)))
            j1 = min(longest, j0 + rows)
            seen = min(widest, j1 // kp)  # pools that complete after the block's last row are candidates for none
            pos = torch.arange(j0, j1, device=device)
            valid = pos[None] < lengths_t[seqs][:, None]  # [A, J]: rows past a sequence's end are padding
            row = starts[seqs][:, None] + pos
            src = torch.where(valid, row, 0)
            scores = self._scores(q[src], w[src], pooled[seqs, :seen], ops).flatten(0, 1)  # [A*J, seen]
            visible = (pos + 1).expand(A, -1).flatten()
            sel = self._expand(scores, visible).view(A, len(pos), -1)
            dest = torch.where(valid, row, T).flatten()
            out[dest] = torch.where(sel >= 0, sel + starts[seqs][:, None, None], sel).flatten(0, 1)
            if all_scores is not None:
                all_scores[dest, :seen] = self._candidates_only(scores, visible)
            j0 = j1
        if on_scores is not None:
            on_scores(all_scores[:T])
        return out[:T]

    # ---- rollout: a prefill chunk that continues a cache ---------------------------------------
    @torch.no_grad()
    def select_cached(self, x, q_resid, slots, positions, state: IndexerState, on_scores=None, ops=indexer_naive):
        """x [T, D] rows at cache `positions` [T] of cache `slots` [T] (a prefill chunk that continues
        a cache; several rows per slot) -> cache positions [T, width], as select_step gives them.

        Every row's key and gate are written first, then each pool the chunk completes is compressed
        from the cache (it may start before the chunk), then every row scores all pool slots of its
        cache, where only complete pools at or before it are candidates: the pools and selections
        select_packed gives the same rows in one prefill."""
        keys, gates = self._keys(x)
        state.keys[slots, positions], state.gates[slots, positions] = keys, gates
        visible = positions + 1
        done = torch.nonzero(visible % self.kpool == 0).flatten()
        if done.numel():
            span = (visible[done] - self.kpool)[:, None] + torch.arange(self.kpool, device=x.device)
            at = slots[done, None]
            state.pools[slots[done], visible[done] // self.kpool - 1] = self._compress(state.keys[at, span],
                                                                                    state.gates[at, span], ops)
        q, w = self._query(x, q_resid)
        P = state.pools.shape[1]
        block = max(1, _SCORE_BUDGET // max(1, self.n_heads * P))
        scores = torch.cat([self._scores(q[r0:r0 + block, None], w[r0:r0 + block, None],
                                         state.pools[slots[r0:r0 + block]], ops)[:, 0]
                            for r0 in range(0, x.shape[0], block)])
        if on_scores is not None:
            on_scores(self._candidates_only(scores, visible)[:, :int(visible.max()) // self.kpool])
        return self._expand(scores, visible)

    # ---- rollout decode ----------------------------------------------------------------------
    @torch.no_grad()
    def select_step(self, x, q_resid, lengths, state: IndexerState, on_scores=None, ops=indexer_naive):
        """x [B, D] new tokens at cache positions `lengths` [B] -> cache positions [B, width]
        (`on_scores` as in select_packed, [B, cache pools]).

        Shapes depend only on the cache, never on its contents, and nothing is read back to the
        host: every row's latest pool is recompressed and written only where this token completed
        it, and the query scores every pool slot of the cache (the ones not yet complete are no
        candidates). A CUDA graph can capture the step."""
        B = x.shape[0]
        rows = torch.arange(B, device=x.device)
        keys, gates = self._keys(x)
        state.keys[rows, lengths], state.gates[rows, lengths] = keys, gates
        visible = lengths + 1
        completed = visible % self.kpool == 0
        span = (visible - self.kpool).clamp(min=0)[:, None] + torch.arange(self.kpool, device=x.device)
        # a row with fewer than kpool tokens reads (and then discards) a whole pool's span: kept inside a
        # cache shorter than one pool; the span of a completed pool ends at `lengths`, so it is unchanged
        span = span.clamp(max=state.keys.shape[1] - 1)
        pooled = self._compress(state.keys[rows[:, None], span], state.gates[rows[:, None], span], ops)
        slot = (visible // self.kpool - 1).clamp(min=0)
        state.pools[rows, slot] = torch.where(completed[:, None], pooled, state.pools[rows, slot])
        q, w = self._query(x, q_resid)
        scores = self._scores(q[:, None], w[:, None], state.pools, ops)[:, 0]
        if on_scores is not None:  # an observer (parity, debugging) reads back: the pools seen so far
            on_scores(self._candidates_only(scores, visible)[:, :int(visible.max()) // self.kpool])
        return self._expand(scores, visible)

    def empty_state(self, batch: int, capacity: int, dtype, device) -> IndexerState:
        z = lambda n: torch.zeros(batch, n, self.head_dim, dtype=dtype, device=device)  # noqa: E731
        return IndexerState(z(capacity), z(capacity), z(capacity // self.kpool + 1))
