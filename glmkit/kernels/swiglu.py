"""The GLM clamped SwiGLU, shared by the dense MLP and every routed-expert backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmkit.kernels.fuse import fusable


@fusable
def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), elementwise."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
