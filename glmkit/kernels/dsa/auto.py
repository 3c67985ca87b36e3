"""DSA backend "auto" (the default): the Triton kernel for bf16 / fp16 CUDA tensors when triton is
installed, the torch absorbed form otherwise (the CPU, fp32 or fp64, a CUDA machine without
triton: the kernel's tiles are sized for 2-byte inputs). Chosen per call, so one Backends value
serves a model on either device."""

from __future__ import annotations

import importlib.util

import torch

from glmkit.kernels.dsa import absorbed


FAST_DTYPES = (torch.bfloat16, torch.float16)


def _triton():
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        from glmkit.kernels.dsa import sparse_triton
    except ImportError:
        return None
    return sparse_triton


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    fast = _triton() if q.is_cuda and q.dtype in FAST_DTYPES else None
    return (fast or absorbed).attend(q, latent, kv_b_weight, idx, bounds, scale)


def attend_cache(q, cache, kv_b_weight, idx, slots, scale):
    fast = _triton() if q.is_cuda and q.dtype in FAST_DTYPES else None
    return (fast or absorbed).attend_cache(q, cache, kv_b_weight, idx, slots, scale)
