"""A model's kernel plan: which backend runs each operator for this model on its device, and why,
chosen once when a path (train, rollout, streaming parity) is built from the model.

    plan = plan_kernels(model, "dsa=auto,moe=auto")
    plan["dsa"].name        -> "triton"
    plan.explain()          -> one line per operator: asked, chosen, why
"""

from __future__ import annotations

import logging

from glmkit.kernels.backends import Backends
from glmkit.kernels.registry import KernelPlan, Target

log = logging.getLogger("glmkit.kernels")


def kernel_target(model) -> Target:
    """Where the model's operators run: its parameters' device and dtype, and the shape facts the
    backends' verifiers read (DSA heads and latent rank, hidden and expert sizes)."""
    return config_target(model.config, model.device, model.dtype)


def config_target(config, device, dtype) -> Target:
    """The target of a model of `config` on `device` in `dtype` (for code that holds layers, not a model)."""
    return Target.of(device, dtype, heads=config.num_attention_heads, latent=config.kv_lora_rank,
                     hidden=config.hidden_size, expert_intermediate=config.moe_intermediate_size)


def plan_kernels(model, backends=None) -> KernelPlan:
    """The plan of `backends` (a Backends, its spec string or dict, or None) for `model`; logged once."""
    plan = Backends.parse(backends).plan(kernel_target(model))
    if log.isEnabledFor(logging.INFO):
        log.info("kernels on %s:\n  %s", plan.target, "\n  ".join(plan.explain()))
    return plan


class ModelKernels:
    """A path's kernel plan for its model: chosen when the path is built (an unavailable backend fails
    there, named), and chosen again only if the model has since moved to another device or dtype."""

    def __init__(self, model, backends=None):
        self.model, self.backends = model, Backends.parse(backends)
        self._plan = plan_kernels(model, self.backends)

    @property
    def plan(self) -> KernelPlan:
        where = (self.model.device.type, self.model.dtype)
        if where != (self._plan.target.device, self._plan.target.dtype):
            self._plan = plan_kernels(self.model, self.backends)
        return self._plan
