"""Fused elementwise chains (glmkit.kernels.fuse) compute what the eager reference computes.

Compiled on the CPU with inductor (what CUDA runs by default, there as Triton kernels). In fp32 the
fused and eager forms differ by summation order and by where intermediate roundings fall (fused code
keeps fp32 where eager rounds to the tensor dtype once more): log-probs agree to 1e-4 (measured 6e-6),
most gradients to 1e-4 relative, and all to 2e-3: the worst are sums with heavy cancellation (the mHC
scale of the first block, whose four streams start equal: 3.7e-4 measured). A wrong formula moves
them by O(1). (float64 does not tighten this: the model keeps its fp32 parts, as the reference does.)
"""

from __future__ import annotations

import pytest
import torch

from glmkit.model.synth import synth_model
from glmkit.kernels import fuse
from glmkit.kernels.backends import Backends
from glmkit.model import TrainPath


def train_step(model, backends, seqs):
    model.zero_grad(set_to_none=True)
    out = TrainPath(model, backends).forward(seqs, return_entropy=True)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    return out.logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_train_step_equals_eager():
    model = synth_model("tiny", 0, dtype=torch.float32, device="cpu", progress=False)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (40, 23, 64)]
    eager_lp, eager_grads = train_step(model, "kda=torch,fuse=off", seqs)
    fused_lp, fused_grads = train_step(model, "kda=torch,fuse=on", seqs)
    assert eager_grads.keys() == fused_grads.keys() and len(eager_grads) > 50
    assert (fused_lp - eager_lp).abs().max() < 1e-4
    errors = {name: ((fused_grads[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
              for name, want in eager_grads.items()}
    assert max(errors.values()) < 2e-3, max(errors.items(), key=lambda kv: kv[1])
    assert sum(err < 1e-4 for err in errors.values()) >= 0.9 * len(errors), sorted(errors.values())[-10:]


def test_auto_stays_eager_off_cuda(monkeypatch):
    """The default mode compiles nothing on the CPU (CI and laptops run the reference as it is)."""
    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile called under fuse=auto on the CPU")

    monkeypatch.setattr(torch, "compile", no_compile)
    model = synth_model("tiny", 0, dtype=torch.float32, device="cpu", progress=False)
    lp, grads = train_step(model, Backends(), [[5, 6, 7, 8, 9, 10, 11, 12]])
    assert torch.isfinite(lp).all() and grads


def test_fuse_modes_are_checked():
    with pytest.raises(ValueError, match="unknown fuse mode 'fast'; allowed: auto, on, off"):
        Backends.parse("fuse=fast")
    with pytest.raises(ValueError, match="unknown fuse mode 'yes'; allowed: auto, on, off"):
        with fuse.fusing("yes"):
            pass
    assert fuse.current_mode() == "off"  # outside any run: the reference
    with fuse.fusing("on"):
        assert fuse.current_mode() == "on"
    assert fuse.current_mode() == "off"
