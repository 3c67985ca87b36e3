"""RMSNorm variants, computed in float32 as the reference does."""

from __future__ import annotations

import torch
from torch import nn

from glmkit.kernels.fuse import fusable


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)): normalised in fp32, cast back to x's dtype before the weight."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@fusable
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * sigmoid(gate), entirely in fp32 (weight included), cast back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


fused_rms_norm = fusable(rms_norm)


class RMSNorm(nn.Module):
    """weight * (x / rms(x)); the normalisation runs in fp32, the result is cast back before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """KDA output norm: RMSNorm(x) * sigmoid(gate), entirely in fp32 (weight included)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
