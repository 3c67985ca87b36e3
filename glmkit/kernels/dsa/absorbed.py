"""Sparse MLA in absorbed form: attention over the selected latents that all heads share (MQA).

    q_lat = q W_UK            [T, H, R]    kv_b's key rows folded into the query
    o_lat = softmax(q_lat c_sel^T * scale) c_sel      over the latents c [T, R] selected for row t
    out   = o_lat W_UV^T      [T, H, dv]   kv_b's value rows folded into the output

Traffic is O(T x W x R) instead of the expanded form's O(T x W x H x (dk + dv)). The core is one
autograd function that goes over query blocks of one sequence at a time and, per block, takes the
cheaper of two exact forms:
- dense: every key of the block's causal span [sequence start, last row] with the selection as a
  mask: plain GEMMs, chosen while the span is at most twice the selection width;
- gather: the selected latents gathered per row and batched matmuls, for long sequences.
Scores, the softmax statistics and the latent gradient are fp32; products take the inputs' dtype
(as flash-attention kernels do). The backward recomputes the scores from the saved log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmkit.kernels.fuse import current_mode, fusable, fusing

# Elements of one block's score tensor (rows x heads x keys) and of its gathered latents.
SCORE_BUDGET = 1 << 26
GATHER_BUDGET = 1 << 27
# A block goes dense while its causal span is at most this many times the selection width.
DENSE_SPAN_FACTOR = 2
# On CUDA, key counts (selection width, dense span) are padded to a multiple of this with masked,
# zero keys: GEMMs over bf16 rows of odd length fall back to unaligned kernels several times slower.
# Elsewhere nothing is padded (the CPU keeps the reference's exact arithmetic).
KEY_ALIGN = 8


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _span_keys(latent: torch.Tensor, s0: int, r1: int, span: int) -> torch.Tensor:
    """latent[s0:r1] padded with zero rows to `span`: never rows of later tokens or sequences, whose
    values (a NaN, say) would reach this block through 0 x NaN."""
    keys = latent[s0:r1]
    return keys if span == r1 - s0 else F.pad(keys, (0, 0, 0, span - (r1 - s0)))


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result; low-precision inputs keep their GEMM speed (fp32 accumulate)."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    try:
        return (torch.mm if a.dim() == 2 else torch.bmm)(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # no fp32-output GEMM for this device (the CPU) or torch
        return a.float() @ b.float()


def _stats_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def blocks(bounds, width: int, heads: int, rank: int):
    """Yield (sequence start, row start, row end, dense) covering every packed row once."""
    for s0, s1 in bounds:
        dense_rows = max(1, SCORE_BUDGET // (heads * max(1, min(s1 - s0, DENSE_SPAN_FACTOR * width))))
        gather_rows = max(1, min(SCORE_BUDGET // (heads * width), GATHER_BUDGET // (width * rank)))
        r0 = s0
        while r0 < s1:
            r1 = min(s1, r0 + dense_rows)
            dense = r1 - s0 <= DENSE_SPAN_FACTOR * width
            if not dense:
                r1 = min(s1, r0 + gather_rows)
            yield s0, r0, r1, dense
            r0 = r1


def _span_mask(idx: torch.Tensor, s0: int, span: int) -> torch.Tensor:
    """idx [B, W] global ids -> bool [B, span], True where key s0 + j is selected."""
    valid = idx >= 0
    cols = torch.where(valid, idx - s0, span)  # empty slots write into a spare column
    mask = torch.zeros(idx.shape[0], span + 1, dtype=torch.bool, device=idx.device)
    return mask.scatter_(1, cols, True)[:, :span]


def _probs(scores: torch.Tensor, keep: torch.Tensor, scale: float, lse: torch.Tensor | None = None):
    """fp32 scores [B, H, K], keep [B, 1, K] -> (fp32 probs, lse [B, H]); rows with no key give zeros."""
    scores = (scores * scale).masked_fill(~keep, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    finite = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (scores - finite[..., None]).exp(), lse


@fusable
def _forward_probs(scores, keep, scale: float, dtype: torch.dtype):
    """-> (probs in `dtype` for the product with the latents, lse fp32)."""
    probs, lse = _probs(scores, keep, scale)
    return probs.to(dtype), lse


@fusable
def _backward_scores(scores, dp, keep, lse, delta, scale: float, dtype: torch.dtype):
    """Recomputed probs and dS = P * (dP - delta) * scale, both in `dtype` for their GEMMs."""
    probs, _ = _probs(scores, keep, scale, lse)
    return probs.to(dtype), (probs * (dp - delta[..., None]) * scale).to(dtype)


class SparseMQA(torch.autograd.Function):
    """q_lat [T, H, R], latent [T, R], idx [T, W] -> o_lat [T, H, R] (see the module docstring)."""

    @staticmethod
    def forward(ctx, q_lat, latent, idx, bounds, scale):
        T, H, R = q_lat.shape
        W = idx.shape[1]  # the block plan uses the unpadded width on every device
        align = KEY_ALIGN if q_lat.is_cuda else 1
        idx = F.pad(idx, (0, _aligned(W, align) - W), value=-1)
        out = torch.empty_like(q_lat)
        lse = torch.empty(T, H, dtype=_stats_dtype(q_lat), device=q_lat.device)
        for s0, r0, r1, dense in blocks(bounds, W, H, R):
            q = q_lat[r0:r1]
            if dense:
                span = _aligned(r1 - s0, align)
                keys = _span_keys(latent, s0, r1, span)
                keep = _span_mask(idx[r0:r1], s0, span)[:, None]
                scores = _mm_f32(q.reshape(-1, R), keys.t()).view(r1 - r0, H, span)
                probs, lse[r0:r1] = _forward_probs(scores, keep, scale, q.dtype)
                out[r0:r1] = (probs.view(-1, span) @ keys).view(r1 - r0, H, R)
            else:
                keys = latent[idx[r0:r1].clamp(min=0)]  # [B, W, R]
                keep = (idx[r0:r1] >= 0)[:, None]
                probs, lse[r0:r1] = _forward_probs(_mm_f32(q, keys.transpose(1, 2)), keep, scale, q.dtype)
                out[r0:r1] = torch.bmm(probs, keys)
        ctx.save_for_backward(q_lat, latent, idx, out, lse)
        ctx.bounds, ctx.scale, ctx.fuse = bounds, scale, current_mode()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        with fusing(ctx.fuse):  # the autograd engine runs this outside the forward's fuse mode
            return SparseMQA._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        q_lat, latent, idx, out, lse = ctx.saved_tensors
        bounds, scale = ctx.bounds, ctx.scale
        T, H, R = q_lat.shape
        W = idx.shape[1]
        align = KEY_ALIGN if q_lat.is_cuda else 1
        idx = F.pad(idx, (0, _aligned(W, align) - W), value=-1)
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # [T, H]: rowsum(dO * O)
        grad_q = torch.empty_like(q_lat)
        grad_latent = torch.zeros(latent.shape, dtype=_stats_dtype(latent), device=latent.device)
        for s0, r0, r1, dense in blocks(bounds, W, H, R):
            q, do, B = q_lat[r0:r1], grad_out[r0:r1], r1 - r0
            if dense:
                span = _aligned(r1 - s0, align)
                keys = _span_keys(latent, s0, r1, span)
                keep = _span_mask(idx[r0:r1], s0, span)[:, None]
                scores = _mm_f32(q.reshape(-1, R), keys.t()).view(B, H, span)
                dp = _mm_f32(do.reshape(-1, R), keys.t()).view(B, H, span)
                probs, ds = _backward_scores(scores, dp, keep, lse[r0:r1], delta[r0:r1], scale, q.dtype)
                probs, ds = probs.view(-1, span), ds.view(-1, span)
                grad_q[r0:r1] = (ds @ keys).view(B, H, R)
                grad_latent[s0:r1] += _mm_f32(ds.t(), q.reshape(-1, R))[:r1 - s0]  # padded keys get none
                grad_latent[s0:r1] += _mm_f32(probs.t(), do.reshape(-1, R))[:r1 - s0]
            else:
                sel = idx[r0:r1]
                keys = latent[sel.clamp(min=0)]
                keep = (sel >= 0)[:, None]
                probs, ds = _backward_scores(_mm_f32(q, keys.transpose(1, 2)), _mm_f32(do, keys.transpose(1, 2)),
                                             keep, lse[r0:r1], delta[r0:r1], scale, q.dtype)
                grad_q[r0:r1] = torch.bmm(ds, keys)
                grad_keys = _mm_f32(ds.transpose(1, 2), q) + _mm_f32(probs.transpose(1, 2), do)
                grad_keys = grad_keys.masked_fill_(~keep.transpose(1, 2), 0.0)
                grad_latent.index_add_(0, sel.clamp(min=0).flatten(), grad_keys.flatten(0, 1))
        return grad_q, grad_latent.to(latent.dtype), None, None, None


def fold_weights(kv_b_weight: torch.Tensor, heads: int, dk: int):
    """kv_b_proj.weight [H * (dk + dv), R] -> W_UK [H, dk, R], W_UV [H, dv, R] (views)."""
    w = kv_b_weight.unflatten(0, (heads, -1))
    return w[:, :dk], w[:, dk:]


def through_latent(q, kv_b_weight, core):
    """q [T, H, dk] -> q_lat = q W_UK [T, H, R] -> core(q_lat) = o_lat [T, H, R] -> o_lat W_UV^T
    [T, H, dv]: kv_b folded into the query and the output, one GEMM per head on each side."""
    T, H, dk = q.shape
    w_uk, w_uv = fold_weights(kv_b_weight, H, dk)
    o_lat = core(torch.bmm(q.transpose(0, 1), w_uk).transpose(0, 1).contiguous())
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    return through_latent(q, kv_b_weight, lambda q_lat: SparseMQA.apply(
        q_lat, latent.contiguous(), idx, [tuple(b) for b in bounds], scale))


def attend_cache(q, cache, kv_b_weight, idx, slots, scale):
    """Rows over a decode cache, absorbed: same contract as naive.attend_cache (q [rows, H, dk],
    cache [S, cap, R], idx [rows, W] cache positions, -1 empty, slots [rows] -> [rows, H, dv]).

    fp32 throughout, as MLA decode kernels accumulate (the folded query q W_UK would otherwise be
    rounded once more than the expanded form's q and k); the selected latents are gathered in row
    blocks within GATHER_BUDGET. The block count depends on shapes only (one CUDA graph holds it)."""
    rows, H, dk = q.shape
    W, R = idx.shape[1], cache.shape[-1]
    w_uk, w_uv = (w.float() for w in fold_weights(kv_b_weight, H, dk))
    q_lat = torch.einsum("thd,hdr->thr", q.float(), w_uk)
    block = max(1, GATHER_BUDGET // max(1, W * R))
    outs = []
    for r0 in range(0, rows, block):
        sl = slice(r0, min(rows, r0 + block))
        latents = cache[slots[sl, None], idx[sl].clamp(min=0)].float()  # [b, W, R]
        scores = torch.einsum("thr,twr->thw", q_lat[sl], latents) * scale
        probs = scores.masked_fill((idx[sl] < 0)[:, None], float("-inf")).softmax(-1)
        outs.append(torch.einsum("thw,twr->thr", probs, latents))
    o_lat = torch.cat(outs) if outs else q_lat.new_zeros(0, H, R)
    return torch.einsum("hvr,thr->thv", w_uv, o_lat).to(q.dtype)
