"""DSA backend "auto" (the default), chosen per call so one Backends value serves a model on either
device: the TileLang forward where tilelang is installed and takes the inputs (Hopper, bf16, heads a
multiple of 64, latent 512), else the Triton kernel for bf16 / fp16 CUDA tensors when triton is
installed, else the torch absorbed form (the CPU, fp32 or fp64, a CUDA machine without triton: the
Triton kernel's tiles are sized for 2-byte inputs). Decode rows over a cache never use TileLang."""

from __future__ import annotations

import functools
import importlib.util

import torch

from glmkit.kernels.dsa import absorbed


FAST_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _module(name: str):
    """The kernel module `name` ("sparse_triton", "sparse_tilelang"), or None where its package is missing."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.import_module(f"glmkit.kernels.dsa.{name}")
    except ImportError:
        return None


def _triton(q):
    return _module("sparse_triton") if q.is_cuda and q.dtype in FAST_DTYPES else None


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    tilelang = _module("sparse_tilelang") if q.is_cuda and q.dtype == torch.bfloat16 else None
    if tilelang is not None and tilelang.supported_shapes(q.shape[1], latent.shape[-1], q.device) is None:
        return tilelang.attend(q, latent, kv_b_weight, idx, bounds, scale)
    return (_triton(q) or absorbed).attend(q, latent, kv_b_weight, idx, bounds, scale)


def attend_cache(q, cache, kv_b_weight, idx, slots, scale):
    return (_triton(q) or absorbed).attend_cache(q, cache, kv_b_weight, idx, slots, scale)
