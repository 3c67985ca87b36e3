"""Mixture of experts: sigmoid router with a bias used only for the choice, top-k routed experts
plus always-on shared experts. The routed experts' weights are stacked ([E, 2I, D] and [E, D, I],
as transformers holds them) and run either expert by expert ("loop", the CPU path and reference)
or as two grouped GEMMs over all experts at once ("grouped", CUDA bf16)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glmkit.kernels.moe import BACKENDS as IMPLS, REGISTRY, get_backend
from glmkit.kernels.moe.loop import swiglu_expert
from glmkit.kernels.registry import Target
from glmkit.model.mlp import MLP


@dataclass
class Routing:
    """experts [T, k] (int64) and weights [T, k] (fp32, renormalised and scaled); choice_scores
    [T, E] the scores the choice ranks (sigmoid + correction bias, fp32), for tie judgements."""

    experts: torch.Tensor
    weights: torch.Tensor
    choice_scores: torch.Tensor | None = None


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
        choice = (scores + self.e_score_correction_bias).detach()
        own = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        # rows of -1 in a replay: this forward chooses (a where, not a host-side test for them,
        # which would stall the stream on every replayed layer)
        experts = own if experts is None else torch.where(experts >= 0, experts, own)
        weights = scores.gather(1, experts)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(experts, weights * self.scaling, choice)


def expert_target(x: torch.Tensor, hidden: int, intermediate: int) -> Target:
    """Where routed experts run on x: its device and dtype, and the experts' sizes."""
    return Target.of(x.device, x.dtype, hidden=hidden, expert_intermediate=intermediate)


class GroupedExperts(nn.Module):
    """The routed experts' SwiGLU weights, stacked as transformers' glm5_next holds them in memory:
    gate_up_proj [E, 2I, D] (rows [:I] are expert e's gate_proj.weight, rows [I:] its up_proj.weight)
    and down_proj [E, D, I] (expert e's down_proj.weight).

    State dicts keep the checkpoint's per-expert names, `{e}.gate_proj.weight` [I, D],
    `{e}.up_proj.weight` [I, D] and `{e}.down_proj.weight` [D, I], saved as views of the stacks and
    loaded by copying into their slices."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, swiglu_limit: float):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.reset_parameters()

    def reset_parameters(self):
        # nn.Linear's default, per expert: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        nn.init.uniform_(self.gate_up_proj, -self.hidden ** -0.5, self.hidden ** -0.5)
        nn.init.uniform_(self.down_proj, -self.intermediate ** -0.5, self.intermediate ** -0.5)

    def per_expert(self, gate_up: torch.Tensor, down: torch.Tensor):
        """(per-expert state-dict name, view of its slice) of the given stacks, in checkpoint order:
        expert 0..E-1, and gate, up, down within each expert."""
        I = self.intermediate
        for e in range(self.num_experts):
            yield f"{e}.gate_proj.weight", gate_up[e, :I]
            yield f"{e}.up_proj.weight", gate_up[e, I:]
            yield f"{e}.down_proj.weight", down[e]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        stacks = (self.gate_up_proj, self.down_proj) if keep_vars else \
            (self.gate_up_proj.detach(), self.down_proj.detach())
        for name, view in self.per_expert(*stacks):
            destination[prefix + name] = view

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if local_metadata.get("assign_to_params_buffers", False):
            # assigning per-expert tensors would leave nothing stacked to assign them to
            error_msgs.append(f"{prefix}*: load_state_dict(assign=True) is not supported for the stacked routed "
                              f"experts; load with assign=False (the default) into allocated weights")
            return
        expected = set()
        with torch.no_grad():
            for name, view in self.per_expert(self.gate_up_proj, self.down_proj):
                key = prefix + name
                expected.add(key)
                if key not in state_dict:
                    if strict:
                        missing_keys.append(key)
                    continue
                value = state_dict[key]
                if value.shape != view.shape:
                    error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                                      f"from checkpoint, the shape in current model is {tuple(view.shape)}.")
                    continue
                view.copy_(value)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU: x [N, D] -> [N, D]."""
        return swiglu_expert(x, self.gate_up_proj[e], self.down_proj[e], self.swiglu_limit)

    def forward(self, x: torch.Tensor, routing: Routing, impl) -> torch.Tensor:
        """x [T, D] -> sum over the k chosen experts of weight * expert(x), [T, D] in x.dtype.
        impl: a backend module of glmkit.kernels.moe, or its name ("loop", "grouped")."""
        ops = get_backend(impl) if isinstance(impl, str) else impl
        return ops.experts(x, routing.experts, routing.weights, self.gate_up_proj, self.down_proj, self.swiglu_limit)


class MoE(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.n_group != 1 or config.topk_group != 1:
            raise ValueError(f"grouped routing is not implemented: n_group={config.n_group}, "
                             f"topk_group={config.topk_group}; allowed: 1 and 1 (GLM-5.3-Flash)")
        D, I = config.hidden_size, config.moe_intermediate_size
        self.gate = Router(D, config.n_routed_experts, config.num_experts_per_tok,
                           config.routed_scaling_factor, config.norm_topk_prob)
        self.experts = GroupedExperts(config.n_routed_experts, D, I, config.swiglu_limit)
        self.shared_experts = MLP(D, I * config.n_shared_experts, config.swiglu_limit)

    def forward(self, x: torch.Tensor, experts: torch.Tensor | None = None,
                impl="auto") -> tuple[torch.Tensor, Routing]:
        """x [T, D] -> ([T, D], Routing). `experts` [T, k] replays a routing (see Router.forward).
        impl: a backend module of glmkit.kernels.moe (a path's kernel plan passes its choice), or a
        name: "loop" (expert by expert), "grouped" (torch._grouped_mm; CUDA bf16) or "auto" (the
        registry's rule for x: grouped where it can run, else loop)."""
        if isinstance(impl, str):
            if impl not in IMPLS:
                raise ValueError(f"impl={impl!r}; allowed: {', '.join(IMPLS)}")
            if impl == "auto":
                impl = REGISTRY.resolve("auto", expert_target(x, self.experts.hidden, self.experts.intermediate)).ops
        routing = self.gate(x, experts)
        return self.experts(x, routing, impl) + self.shared_experts(x), routing
