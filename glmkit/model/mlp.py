"""SwiGLU MLP with the GLM clamp (gate <= limit, |up| <= limit): dense layers and experts."""

from __future__ import annotations

import torch
from torch import nn

from glmkit.kernels.swiglu import clamped_swiglu


class MLP(nn.Module):
    """x [..., D] -> down(silu(clamp(gate x)) * clamp(up x)) [..., D]."""

    def __init__(self, hidden: int, intermediate: int, swiglu_limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
