"""DSA backend "auto" per call, for a caller that holds tensors rather than a model's kernel plan
(paths built from a model resolve "auto" once, see glmkit.kernels.registry): the operator registry's
rule applied to each call's tensors (device, dtype, heads, latent rank), each distinct target resolved
once. Decode rows over a cache never use TileLang (its module hands them to Triton)."""

from __future__ import annotations

import functools

import torch

from glmkit.kernels.registry import OpRegistry, Target


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


class PerCallAuto:
    """attend / attend_cache with the backend `registry` resolves for the call's tensors."""

    def __init__(self, registry: OpRegistry):
        self.registry = registry
        self._module = functools.lru_cache(maxsize=None)(lambda target: registry.resolve("auto", target).ops)

    def _ops(self, q: torch.Tensor, latent_rank: int):
        facts = (("heads", q.shape[1]), ("latent", latent_rank))
        return self._module(Target(q.device.type, q.dtype, _capability(q.device), facts))

    def attend(self, q, latent, kv_b_weight, idx, bounds, scale):
        return self._ops(q, latent.shape[-1]).attend(q, latent, kv_b_weight, idx, bounds, scale)

    def attend_cache(self, q, cache, kv_b_weight, idx, slots, scale):
        return self._ops(q, cache.shape[-1]).attend_cache(q, cache, kv_b_weight, idx, slots, scale)
