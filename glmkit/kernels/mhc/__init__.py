"""mHC's Sinkhorn projection behind one entry point.

    sinkhorn(comb [..., n, n], iters, eps) -> doubly stochastic [..., n, n]

- `naive.sinkhorn`: the torch loop, the reference (eager runs, CPU, fuse mode "off").
- `sinkhorn_triton.sinkhorn`: all 2 * iters - 1 normalisations of a token's n x n matrix in registers,
  one launch forward and one backward (a custom op, so inductor calls it from a fused region).
  Inductor leaves the torch loop as one kernel per iteration (each normalisation reduces over the
  other axis of the tiny matrix): 20 launches per mHC site, 160 of a 4-layer prefill's 787.

The kernel is part of the fused form: `sinkhorn` picks it only while torch.compile traces (a fused
mHC site, see glmkit.kernels.fuse) on CUDA tensors with triton installed; eager calls keep the loop.
"""

from __future__ import annotations

import importlib.util

import torch

from glmkit.kernels.mhc import naive

# read once at import: dynamo traces `sinkhorn` below and reads module globals without a graph break
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if _HAVE_TRITON and comb.is_cuda and torch.compiler.is_compiling():
        from glmkit.kernels.mhc import sinkhorn_triton

        return sinkhorn_triton.sinkhorn(comb, iters, eps)
    return naive.sinkhorn(comb, iters, eps)
