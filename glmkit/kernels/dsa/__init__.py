"""Sparse MLA (NoPE) behind one interface. `get_backend(name)` returns a module with

    attend(q, latent, kv_b_weight, idx, bounds, scale) -> [T, H, dv]

q [T, H, dk] packed queries; latent [T, R] the normalised kv latents of the same tokens;
kv_b_weight [H * (dk + dv), R] (kv_b_proj.weight: per head the key rows, then the value rows);
idx [T, W] selected key ids as packed (global) token indices, -1 = empty; bounds the host-side
(start, end) of every packed sequence (a row only ever selects keys of its own sequence);
scale the softmax scale (dk^-0.5 for GLM-5.3-Flash, passed explicitly). And, for the rollout side
(decode steps, prefill chunks that continue a cache; no autograd),

    attend_cache(q, cache, kv_b_weight, idx, slots, scale) -> [rows, H, dv]

cache [S, cap, R] the latents of S requests, idx [rows, W] positions in the row's own request,
slots [rows] which request each row belongs to.

- "naive":    keys and values expanded per head, gathered per query block; the reference.
- "absorbed": kv_b folded into the query and the output, MQA over the R-dim latent that all heads
              share; dense over a block's causal span when that is cheaper than gathering.
- "triton":   the absorbed form with its forward as one Triton kernel that gathers the selected
              latents itself (`sparse_triton.py`), from packed latents or from a decode cache;
              CUDA, needs triton.
- "tilelang": the forward as a warp-specialised TileLang kernel (`sparse_tilelang.py`: Hopper, bf16,
              heads a multiple of 64, latent 512), the Triton backward; decode rows go to Triton.
- "auto":     "tilelang" where it runs, else "triton" for bf16 / fp16 CUDA tensors (its tiles are
              sized for 2-byte inputs), else "absorbed" (the default); chosen once for a model's target,
              or per call by `auto.py` for a caller holding only tensors.
"""

from __future__ import annotations

import torch

from glmkit.kernels.dsa.auto import PerCallAuto
from glmkit.kernels.registry import KernelBackend, OpRegistry, Target, all_of, cuda_in

TILELANG_LATENT = 512          # kv_lora_rank the TileLang kernel is built for (NoPE: no RoPE tail)
TILELANG_HEADS_PER_PROGRAM = 64


def tilelang_takes(target: Target) -> str | None:
    """None when the TileLang forward takes the target's queries (heads x latent), else why not."""
    heads, latent = target.fact("heads"), target.fact("latent")
    if latent is not None and latent != TILELANG_LATENT:
        return f"latent rank {TILELANG_LATENT} only (got {latent})"
    if heads is not None and heads % TILELANG_HEADS_PER_PROGRAM:
        return f"heads a multiple of {TILELANG_HEADS_PER_PROGRAM} only (got {heads})"
    if target.capability is not None and target.capability[0] != 9:
        major, minor = target.capability
        return f"SM90 (Hopper) only (this GPU is SM{major}{minor})"
    return None


TWO_BYTE = (torch.bfloat16, torch.float16)
REGISTRY = OpRegistry("dsa", auto_order=("tilelang", "triton", "absorbed"))
REGISTRY.register(KernelBackend("naive", "glmkit.kernels.dsa.naive", "un-absorbed gather per head (the reference)",
                                reference=True))
REGISTRY.register(KernelBackend("absorbed", "glmkit.kernels.dsa.absorbed", "MQA over the shared latent, torch"))
REGISTRY.register(KernelBackend("triton", "glmkit.kernels.dsa.sparse_triton", "absorbed form, Triton forward",
                                packages=("triton",), verify=cuda_in(*TWO_BYTE, torch.float32),
                                auto_when=cuda_in(*TWO_BYTE)))
REGISTRY.register(KernelBackend("tilelang", "glmkit.kernels.dsa.sparse_tilelang",
                                "absorbed form, TileLang forward (Hopper), Triton backward",
                                packages=("tilelang", "triton"), verify=all_of(cuda_in(torch.bfloat16), tilelang_takes)))
BACKENDS = REGISTRY.names
PER_CALL_AUTO = PerCallAuto(REGISTRY)


def get_backend(name: str):
    """The module of backend `name`; "auto" gives the per-call resolver (`auto.py`, the same rule per tensor)."""
    if name == "auto":
        return PER_CALL_AUTO
    return REGISTRY.get(name).load()
