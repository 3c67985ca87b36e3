"""Pure-torch sparse MLA, un-absorbed: the reference every fast DSA backend is tested against.

    k, v = split(latent kv_b^T) per head [T, H, dk], [T, H, dv]
    out_t = softmax(q_t k_sel^T * scale) v_sel          over the ids selected for row t

Query rows go in blocks so the gathered keys and values stay bounded (rows x width x heads x dim);
under autograd each block is recomputed in the backward rather than keeping its gathers alive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Gathered elements per query block (rows x width x heads x dim): bounds memory.
GATHER_BUDGET = 1 << 27


def compact_selection(idx: torch.Tensor) -> torch.Tensor:
    """idx [R, W] (-1 empty) -> [R, W'] with each row's ids first, in their order, and W' the
    largest count of any row. Each row attends over the same set; only the all-empty columns go."""
    empty = idx < 0
    order = empty.to(torch.uint8).argsort(dim=-1, stable=True)
    width = max(1, int((~empty).sum(-1).max())) if idx.numel() else 1
    return idx.gather(1, order[:, :width])


def _attend_block(q, k, v, idx, scale):
    """q [B, H, dk]; k, v [T, H, d] (all keys); idx [B, W] -> [B, H, dv]."""
    safe = idx.clamp(min=0)
    scores = torch.einsum("bhd,bwhd->bhw", q, k[safe]).float() * scale
    probs = scores.masked_fill((idx < 0)[:, None], float("-inf")).softmax(-1).to(q.dtype)
    return torch.einsum("bhw,bwhd->bhd", probs, v[safe])


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    H, dk = q.shape[1], q.shape[2]
    kv = F.linear(latent, kv_b_weight).unflatten(-1, (H, -1))
    k, v = kv[..., :dk], kv[..., dk:]
    selected = compact_selection(idx)
    T, W = selected.shape
    rows = max(1, GATHER_BUDGET // (W * H * kv.shape[-1]))
    outs = []
    for r0 in range(0, T, rows):
        sl = slice(r0, min(T, r0 + rows))
        if torch.is_grad_enabled():
            outs.append(checkpoint(_attend_block, q[sl], k, v, selected[sl], scale, use_reentrant=False))
        else:
            outs.append(_attend_block(q[sl], k, v, selected[sl], scale))
    return torch.cat(outs) if outs else q.new_zeros(0, H, kv.shape[-1] - dk)


def attend_cache(q, cache, kv_b_weight, idx, slots, scale):
    """Rows attending over a decode cache (decode steps, prefill chunks that continue a cache).

    q [rows, H, dk]; cache [S, cap, R] the latents of S requests; idx [rows, W] cache positions
    (-1 empty); slots [rows] the request (cache slot) of each row -> [rows, H, dv]. Keys and values
    expanded per head from the gathered latents, in row blocks within GATHER_BUDGET; fp32 math.
    The block count depends on shapes only (one CUDA graph can hold it)."""
    rows, H, dk = q.shape
    W = idx.shape[1]
    per_row = max(1, W * kv_b_weight.shape[0])
    block = max(1, GATHER_BUDGET // per_row)
    w = kv_b_weight.float()
    outs = []
    for r0 in range(0, rows, block):
        sl = slice(r0, min(rows, r0 + block))
        latents = cache[slots[sl, None], idx[sl].clamp(min=0)].float()  # [b, W, R]
        kv = F.linear(latents, w).unflatten(-1, (H, -1))  # [b, W, H, dk + dv]
        scores = torch.einsum("bhd,bwhd->bhw", q[sl].float(), kv[..., :dk]) * scale
        probs = scores.masked_fill((idx[sl] < 0)[:, None], float("-inf")).softmax(-1)
        outs.append(torch.einsum("bhw,bwhd->bhd", probs, kv[..., dk:]))
    return torch.cat(outs).to(q.dtype) if outs else q.new_zeros(0, H, kv_b_weight.shape[0] // H - dk)
