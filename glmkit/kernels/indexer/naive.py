"""The lightning indexer's pool compression and scores in plain torch: the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compress(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """keys, gates [..., kpool, dI], ape [kpool, dI] -> pool keys [..., dI]: a gated softmax average
    per channel over the pool's kpool keys (softmax in fp32)."""
    probs = (gates.float() + ape.float()).softmax(dim=-2).to(keys.dtype)
    return (probs * keys).sum(-2)


def scores(q: torch.Tensor, w: torch.Tensor, pools: torch.Tensor, head_dim: int) -> torch.Tensor:
    """q [B, J, nI, dI], w [B, J, nI], pools [B, P, dI] -> [B, J, P] (fp32): J query rows of each batch
    entry against that entry's pools, sum over heads of w * relu(q . pool / sqrt(dI)), one batched GEMM."""
    B, J, nI, dI = q.shape
    s = torch.bmm(q.reshape(B, J * nI, dI), pools.float().transpose(1, 2)) * head_dim ** -0.5
    return (w.unsqueeze(-2) @ F.relu(s).view(B, J, nI, -1)).squeeze(-2)
