"""DSA backend "auto" (the default): the Triton kernel for CUDA tensors when triton is installed,
the torch absorbed form otherwise (the CPU, or a CUDA machine without triton). Chosen per call, so
one Backends value serves a model on either device."""

from __future__ import annotations

import importlib.util

from glmkit.kernels.dsa import absorbed


def _triton():
    if importlib.util.find_spec("triton") is None:
        return None
    from glmkit.kernels.dsa import sparse_triton

    return sparse_triton


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    fast = _triton() if q.is_cuda else None
    return (fast or absorbed).attend(q, latent, kv_b_weight, idx, bounds, scale)
