"""Elementwise chains fused into single kernels by torch.compile (inductor), behind one switch.

mHC mixing, the RMSNorms, KDA's short conv and gates, the SwiGLU clamp: each is a chain of small
elementwise ops and reductions over [T, n, D]- or [T, H, K]-sized tensors. Eager, every op is one
pass over HBM (at T = 8192 an mHC site alone made ~30 passes over 268 MB); fused, each chain is one
read of its inputs and one write of its outputs. The math stays in the concept modules as plain torch
(the reference, run eagerly); `@fusable` marks a top-level one, which then follows the mode a run
sets with `fusing(mode)` (`Backends.fuse`; every `DecoderBlock` call sets it):

    "off"   eager, always (the reference; also the mode outside any run)
    "auto"  fused when the first tensor argument is on CUDA and inductor can run there (triton
            installed, dynamo supported), eager elsewhere (the default of a run)
    "on"    fused on any device (CPU inductor needs a C++ compiler; tests use it there)

`fused_form` gives a fusable function a second, fusion-friendly spelling of the same math (e.g. a
per-token 4 x 4 mix as four broadcast products instead of T tiny GEMMs, which inductor would leave as
one extern batched GEMM). Functions called from inside a fusable one stay plain.

Fused code computes in fp32 and rounds once at the end where eager rounds after each op, so bf16
results differ from eager by about one bf16 ulp; fp32 results by fp32 rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

from glmkit.kernels.registry import KernelBackend, OpRegistry, Target

FUSE_MODES = ("auto", "on", "off")


def inductor_takes(target: Target) -> str | None:
    """Where "auto" fuses: CUDA tensors, with triton installed and dynamo supported (CPU inductor
    needs a C++ compiler and gains little there: "on" asks for it)."""
    if target.device != "cuda":
        return f"fused by auto on CUDA only (here: {target.device}; 'on' fuses anywhere)"
    if not _inductor_runs_on_cuda():
        return "inductor cannot run on CUDA here (triton missing or dynamo unsupported)"
    return None


# The modes as an operator registry, so a run's plan says whether it fuses and why. The mode a call
# follows is the run's resolved one, set with `fusing(mode)`.
REGISTRY = OpRegistry("fuse", auto_order=("on", "off"))
REGISTRY.register(KernelBackend("off", __name__, "eager torch, one kernel per op (the reference)", reference=True))
REGISTRY.register(KernelBackend("on", __name__, "elementwise chains compiled by torch.compile (inductor)",
                                auto_when=inductor_takes))

_MODE = contextvars.ContextVar("glmkit_fuse_mode", default="off")


@contextlib.contextmanager
def fusing(mode: str):
    """Fusable functions called inside follow `mode`."""
    if mode not in FUSE_MODES:
        raise ValueError(f"unknown fuse mode {mode!r}; allowed: {', '.join(FUSE_MODES)}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def current_mode() -> str:
    return _MODE.get()


def fusable(fn=None, *, fused_form=None):
    """Decorate a pure tensor function (see the module docstring); `.eager` is the plain function."""
    if fn is None:
        return functools.partial(fusable, fused_form=fused_form)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        mode = _MODE.get()
        if mode == "off" or (mode == "auto" and not (_on_cuda(args) and _inductor_runs_on_cuda())):
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fused_form or fn, fullgraph=True)
        return compiled(*args, **kwargs)

    call.eager = fn
    return call


@functools.cache
def _inductor_runs_on_cuda() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None and torch._dynamo.is_dynamo_supported()


def _on_cuda(args) -> bool:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first is not None and first.is_cuda
