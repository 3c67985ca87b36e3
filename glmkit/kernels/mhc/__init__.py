"""mHC's Sinkhorn projection behind one entry point.

    sinkhorn(comb [..., n, n], iters, eps) -> doubly stochastic [..., n, n]

- `naive.sinkhorn`: the torch loop, the reference (eager runs, CPU, fuse mode "off").
- `sinkhorn_triton.sinkhorn`: all 2 * iters - 1 normalisations of a token's n x n matrix in registers,
  one launch forward and one backward (a custom op, so inductor calls it from a fused region).
  Inductor leaves the torch loop as one kernel per iteration (each normalisation reduces over the
  other axis of the tiny matrix): 20 launches per mHC site, 160 of a 4-layer prefill's 787.

The kernel is part of the fused form: `sinkhorn` picks it only while torch.compile traces (a fused
mHC site, see glmkit.kernels.fuse) on CUDA tensors with triton installed; eager calls keep the loop.
The registry states that rule for a run's plan (the choice follows the fuse choice: not a knob of
its own, since the call inside a compiled region cannot read a run's setting without breaking the graph).
"""

from __future__ import annotations

import importlib.util

import torch

from glmkit.kernels.mhc import naive
from glmkit.kernels.registry import KernelBackend, OpRegistry, Target, cuda_in


def in_fused_region(target: Target) -> str | None:
    return None if target.fused else "runs inside a fused (compiled) mHC site only: the run does not fuse"


REGISTRY = OpRegistry("mhc", auto_order=("triton", "torch"))
REGISTRY.register(KernelBackend("torch", "glmkit.kernels.mhc.naive", "Sinkhorn as a torch loop (the reference)",
                                reference=True))
REGISTRY.register(KernelBackend("triton", "glmkit.kernels.mhc.sinkhorn_triton",
                                "every Sinkhorn normalisation of a token in registers, one launch",
                                packages=("triton",), verify=cuda_in(), auto_when=in_fused_region))

# read once at import: dynamo traces `sinkhorn` below and reads module globals without a graph break
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    if _HAVE_TRITON and comb.is_cuda and torch.compiler.is_compiling():
        from glmkit.kernels.mhc import sinkhorn_triton

        return sinkhorn_triton.sinkhorn(comb, iters, eps)
    return naive.sinkhorn(comb, iters, eps)
