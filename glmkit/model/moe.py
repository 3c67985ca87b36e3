"""Mixture of experts: sigmoid router with a bias used only for the choice, top-k routed experts
plus always-on shared experts. Tokens are grouped per expert; only chosen experts run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glmkit.model.mlp import MLP


@dataclass
class Routing:
    """experts [T, k] (int64) and weights [T, k] (fp32, renormalised and scaled)."""

    experts: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """`mlp.gate`: weight [E, D] and e_score_correction_bias [E], both fp32."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, scaling: float, norm_topk: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.top_k, self.scaling, self.norm_topk = top_k, scaling, norm_topk

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None = None) -> Routing:
        """x [T, D]. `experts` [T, k] replays a given choice (routing replay; a row of -1 lets this
        forward choose); weights are still computed from this forward's scores, so gradients flow
        through the router."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        if experts is None or (experts < 0).any():  # rows of -1 in a replay: this forward chooses
            own = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
            experts = own if experts is None else torch.where(experts >= 0, experts, own)
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(experts, weights * self.scaling)


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.n_group != 1 or config.topk_group != 1:
            raise ValueError(f"grouped routing is not implemented: n_group={config.n_group}, "
                             f"topk_group={config.topk_group}; allowed: 1 and 1 (GLM-5.3-Flash)")
        D, I = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(D, config.n_routed_experts, config.num_experts_per_tok,
                           config.routed_scaling_factor, config.norm_topk_prob)
        self.experts = nn.ModuleList(MLP(D, I, config.swiglu_limit) for _ in range(config.n_routed_experts))
        self.shared_experts = MLP(D, I * config.n_shared_experts, config.swiglu_limit)

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, Routing]:
        """x [T, D] -> ([T, D], Routing)."""
        routing = self.gate(x, experts)
        flat_expert = routing.experts.flatten()
        order = flat_expert.argsort(stable=True)
        token_of = order // routing.experts.shape[1]
        counts = torch.bincount(flat_expert, minlength=len(self.experts)).tolist()
        flat_weight = routing.weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = token_of[start:start + n]
                y = self.experts[e](x[rows]) * flat_weight[start:start + n, None]
                out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out + self.shared_experts(x), routing
