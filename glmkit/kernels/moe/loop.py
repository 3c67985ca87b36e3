"""Routed experts one by one: a GEMM pair per expert that has tokens. The reference, any device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmkit.kernels.swiglu import clamped_swiglu


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float) -> torch.Tensor:
    """x [N, D], one expert's gate_up [2I, D] and down [D, I] -> [N, D]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(clamped_swiglu(gate, up, limit), down)


def experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    flat_expert = experts.flatten()
    order = flat_expert.argsort(stable=True)
    token_of = order // experts.shape[1]
    counts = torch.bincount(flat_expert, minlength=gate_up.shape[0]).tolist()
    flat_weight = weights.flatten()[order]
    # unbound once: the backward stacks all experts' gradients into one [E, ...] tensor, where
    # indexing per expert would add a full-size zero-padded gradient for every expert used
    gate_ups, downs = gate_up.unbind(0), down.unbind(0)
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = token_of[start:start + n]
            y = swiglu_expert(x[rows], gate_ups[e], downs[e], swiglu_limit) * flat_weight[start:start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
        start += n
    return out
