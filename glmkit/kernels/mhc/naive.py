"""mHC's Sinkhorn projection in plain torch: the reference the Triton kernel is checked against."""

from __future__ import annotations

import torch


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] positive -> doubly stochastic, same shape and dtype.

    Column-normalise once, then (iters - 1) x (rows, columns): the reference's order, so the
    2 * iters - 1 normalisations alternate columns, rows, ..., columns."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb
