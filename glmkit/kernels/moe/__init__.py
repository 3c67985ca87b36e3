"""Routed experts behind one interface. A backend is a module with

    experts(x, experts, weights, gate_up, down, swiglu_limit) -> [T, D] in x.dtype

x [T, D] tokens; experts [T, k] (int64) the chosen experts and weights [T, k] (fp32) their weights;
gate_up [E, 2I, D] (rows [:I] gate, [I:] up) and down [E, D, I] the stacked expert weights. The result
is the sum over each token's k experts of weight * SwiGLU expert(x).

- "loop":    one GEMM pair per expert that has tokens (`loop.py`); the reference, any device.
- "grouped": two `torch._grouped_mm` calls over all experts at once (`grouped.py`); CUDA bf16, rows of
             16-byte multiples, no host sync.
- "auto":    grouped where it runs, else loop.
"""

from __future__ import annotations

import torch

from glmkit.kernels.registry import KernelBackend, OpRegistry, Target, all_of, cuda_in


def grouped_mm_takes(target: Target) -> str | None:
    """torch._grouped_mm in this torch, and rows of 16-byte multiples (8 bf16 values) in every operand."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch._grouped_mm is missing from torch {torch.__version__}"
    odd = [f"{name} {size}" for name in ("hidden", "expert_intermediate")
           if (size := target.fact(name)) is not None and size % 8]
    return f"sizes that are multiples of 8 only (got {', '.join(odd)})" if odd else None


REGISTRY = OpRegistry("moe", auto_order=("grouped", "loop"))
REGISTRY.register(KernelBackend("loop", "glmkit.kernels.moe.loop", "one GEMM pair per expert (the reference)",
                                reference=True))
REGISTRY.register(KernelBackend("grouped", "glmkit.kernels.moe.grouped", "two torch._grouped_mm over all experts",
                                verify=all_of(cuda_in(torch.bfloat16), grouped_mm_takes)))
BACKENDS = REGISTRY.names


def get_backend(name: str):
    return REGISTRY.get(name).load()
