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
- "auto":     per call, "tilelang" where installed and it takes the inputs, else "triton" for CUDA
              tensors when triton is installed, else "absorbed" (the default).
"""

from __future__ import annotations

import importlib

BACKENDS = ("auto", "naive", "absorbed", "triton", "tilelang")
MODULES = {"triton": "sparse_triton", "tilelang": "sparse_tilelang"}  # modules named triton.py / tilelang.py would read as the packages


def get_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown DSA backend {name!r}; allowed: {', '.join(BACKENDS)}")
    return importlib.import_module(f"glmkit.kernels.dsa.{MODULES.get(name, name)}")
