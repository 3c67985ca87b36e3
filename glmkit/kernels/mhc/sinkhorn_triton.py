"""mHC's Sinkhorn projection as two Triton kernels (forward, backward), registered as custom ops.

    sinkhorn(comb [..., n, n], iters, eps) -> [..., n, n], as `naive.sinkhorn`

Each program takes BLOCK tokens' n x n matrices (n padded to a power of two, the padding masked to
zero, which every normalisation keeps at zero) and runs the S = 2 * iters - 1 normalisations in
registers: step s divides by column sums (+ eps) when s is even, by row sums when s is odd. Forward
reads comb once and writes the result once, in comb's dtype (math in fp32).

Backward: the VJP of one step y = x / (sum_a x + eps) is gx = (gy - sum_a(gy * y)) / (sum_a x + eps).
Walking the steps backwards needs each step's input x_s; instead of saving S of them (S x the
output's size) the kernel recomputes x_s from comb for every s, S (S - 1) / 2 steps in all (741 at
iters = 20, each a few flops on n^2 values, still one launch that costs little next to a GEMM).

`torch.library.triton_op` makes both kernels custom ops with autograd, so torch.compile keeps them
as calls inside a fused region and AOTAutograd puts the backward op into the backward graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

BLOCK = 64  # tokens per program: 64 x 16 fp32 values at n = 4, 8 a thread at 4 warps


@triton.jit
def _normalise_step(x, s, EPS: tl.constexpr):
    """Step s of the chain on x [BLOCK, NP, NP] (axis 1 = rows i, axis 2 = columns j of comb[i, j]):
    -> (y, denominator broadcast to x's shape)."""
    by_columns = s % 2 == 0
    column_sums = tl.sum(x, 1)[:, None, :] + EPS
    row_sums = tl.sum(x, 2)[:, :, None] + EPS
    denominator = tl.where(by_columns, column_sums, row_sums)
    return x / denominator, denominator


@triton.jit
def _offsets(N, N_MAT: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, NP)
    offsets = tokens[:, None, None] * (N_MAT * N_MAT) + i[None, :, None] * N_MAT + i[None, None, :]
    mask = (tokens[:, None, None] < N) & (i[None, :, None] < N_MAT) & (i[None, None, :] < N_MAT)
    return offsets, mask


@triton.jit
def _sinkhorn_fwd_kernel(x_ptr, y_ptr, N, EPS: tl.constexpr, STEPS: tl.constexpr, N_MAT: tl.constexpr, NP: tl.constexpr,
                         BLOCK: tl.constexpr):
    offsets, mask = _offsets(N, N_MAT, NP, BLOCK)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    for s in range(STEPS):
        x, _ = _normalise_step(x, s, EPS)
    tl.store(y_ptr + offsets, x.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(x_ptr, gy_ptr, gx_ptr, N, EPS: tl.constexpr, STEPS: tl.constexpr, N_MAT: tl.constexpr,
                         NP: tl.constexpr, BLOCK: tl.constexpr):
    offsets, mask = _offsets(N, N_MAT, NP, BLOCK)
    x0 = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    for back in range(STEPS):
        s = STEPS - 1 - back
        x = x0
        # recompute step s's input; a constant loop bound with a branch, because the CPU interpreter's
        # runtime ints (1-element arrays) cannot bound a `range` with NumPy >= 2.4
        for t in range(STEPS - 1):
            if t < s:
                x, _ = _normalise_step(x, t, EPS)
        y, denominator = _normalise_step(x, s, EPS)
        gy = g * y
        along = tl.where(s % 2 == 0, tl.sum(gy, 1)[:, None, :], tl.sum(gy, 2)[:, :, None])
        g = tl.where(mask, (g - along) / denominator, 0.0)
    tl.store(gx_ptr + offsets, g.to(gx_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, tensors, n: int, iters: int, eps: float):
    tokens = tensors[0].numel() // (n * n)
    grid = (triton.cdiv(tokens, BLOCK),)
    # eps a compile-time constant: a float argument would reach the kernel as fp64 from inductor's launcher
    wrap_triton(kernel)[grid](*tensors, tokens, EPS=eps, STEPS=2 * iters - 1, N_MAT=n,
                              NP=triton.next_power_of_2(n), BLOCK=BLOCK, num_warps=4)


@triton_op("glmkit::sinkhorn", mutates_args=())
def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb = comb.contiguous()
    out = torch.empty_like(comb)
    _launch(_sinkhorn_fwd_kernel, (comb, out), comb.shape[-1], iters, eps)
    return out


@triton_op("glmkit::sinkhorn_backward", mutates_args=())
def _sinkhorn_backward(comb: torch.Tensor, grad: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    comb, grad = comb.contiguous(), grad.contiguous()
    grad_comb = torch.empty_like(comb)
    _launch(_sinkhorn_bwd_kernel, (comb, grad, grad_comb), comb.shape[-1], iters, eps)
    return grad_comb


def _setup_context(ctx, inputs, output):
    comb, ctx.iters, ctx.eps = inputs
    ctx.save_for_backward(comb)


def _backward(ctx, grad):
    (comb,) = ctx.saved_tensors
    return _sinkhorn_backward(comb, grad, ctx.iters, ctx.eps), None, None


_sinkhorn.register_autograd(_backward, setup_context=_setup_context)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] (any float dtype; fp32 math) -> doubly stochastic, as `naive.sinkhorn`."""
    if comb.dim() < 2 or comb.shape[-1] != comb.shape[-2]:
        raise ValueError(f"sinkhorn needs square matrices [..., n, n], got shape {tuple(comb.shape)}")
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1, got {iters}")
    return _sinkhorn(comb, iters, eps)
