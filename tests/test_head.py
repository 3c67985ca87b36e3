"""The LM head's log-prob/entropy function (glmkit.model.head) against plain autograd.

The reference is autograd through `log_softmax(h W^T / T)` gathered at the target and the entropy of
the same softmax, in float64 so that it is exact to ~1e-15. The function under test computes in the
dtype it is given: in fp32 its values and gradients agree to 1e-5 relative (fp32 sums over a
1000-wide vocabulary, ~1e-6 measured); in bf16 the logits and the logits' gradient are rounded to bf16
as the model's GEMMs round them, so 2e-2 relative (~4e-3 measured; a wrong formula is off by O(1)).
"""

from __future__ import annotations

import pytest
import torch

from glmkit.comparison import rel_rms
from glmkit.kernels.fuse import fusing
from glmkit.model.head import LogprobHead


def reference(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.t()) / temperature, -1)
    picked = logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0].masked_fill(targets < 0, 0.0)
    return picked, -(logp.exp() * logp).sum(-1)


def rel(a, b):
    return rel_rms(b, a)  # b is the reference


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("keep_logits", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_head_matches_autograd(dtype, bound, keep_logits, temperature):
    g = torch.Generator().manual_seed(0)
    n, D, V = 37, 24, 1000
    hidden64 = torch.randn(n, D, generator=g, dtype=torch.float64)
    weight64 = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.3
    targets = torch.randint(0, V, (n,), generator=g)
    targets[[3, 20]] = -100  # no target (each sequence's last token): log-prob 0, no gradient
    g_lp, g_ent = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)

    h_ref, w_ref = hidden64.clone().requires_grad_(), weight64.clone().requires_grad_()
    lp_ref, ent_ref = reference(h_ref, w_ref, targets, temperature)
    ((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum()).backward()

    h, w = hidden64.to(dtype).requires_grad_(), weight64.to(dtype).requires_grad_()
    with fusing("off"):
        lp, ent = LogprobHead.apply(h, w, targets, temperature, True, keep_logits)
    ((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum()).backward()

    assert lp.dtype == ent.dtype == torch.float32
    assert lp[3] == 0 and lp[20] == 0
    for name, got, want in (("logp", lp, lp_ref), ("entropy", ent, ent_ref), ("grad hidden", h.grad, h_ref.grad),
                            ("grad weight", w.grad, w_ref.grad)):
        assert rel(got, want) < bound, (name, rel(got, want))


def test_logprob_head_without_entropy_and_frozen_weight():
    """No entropy asked: None back, and only the log-prob's gradient; a frozen weight gets none."""
    g = torch.Generator().manual_seed(1)
    h64 = torch.randn(9, 8, generator=g, dtype=torch.float64)
    w64 = torch.randn(50, 8, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 50, (9,), generator=g)
    h_ref = h64.clone().requires_grad_()
    reference(h_ref, w64, targets, 1.0)[0].sum().backward()
    h, w = h64.float().requires_grad_(), w64.float()
    lp, ent = LogprobHead.apply(h, w, targets, 1.0, False, False)
    lp.sum().backward()
    assert ent is None and w.grad is None
    assert rel(h.grad, h_ref.grad) < 1e-5
