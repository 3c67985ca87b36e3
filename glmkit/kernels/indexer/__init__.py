"""The lightning indexer's scoring behind one interface. A backend is a module with

    compress(keys, gates, ape) -> pool keys       keys, gates [..., kpool, dI], ape [kpool, dI] -> [..., dI]
    scores(q, w, pools, head_dim) -> [B, J, P]    q [B, J, nI, dI], w [B, J, nI], pools [B, P, dI] (fp32)

- "torch": `naive.py`, the gated softmax pool and the ReLU-weighted multi-head score as torch ops
           (one batched GEMM per block of rows); the reference, any device.

The selection around them (candidates, top-k with the lowest index first on ties, the tail) is part
of the model (glmkit.model.indexer): it decides which keys attention sees and stays one definition.
"""

from __future__ import annotations

from glmkit.kernels.registry import KernelBackend, OpRegistry

REGISTRY = OpRegistry("indexer", auto_order=("torch",))
REGISTRY.register(KernelBackend("torch", "glmkit.kernels.indexer.naive", "pool compression and scoring in torch "
                                "(the reference)", reference=True))
BACKENDS = REGISTRY.names


def get_backend(name: str):
    return REGISTRY.get("torch" if name == "auto" else name).load()
