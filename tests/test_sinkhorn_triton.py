"""The Triton Sinkhorn kernels (kernels/mhc/sinkhorn_triton.py) against the torch loop
(kernels/mhc/naive.py), run by Triton's CPU interpreter: values and gradients through the custom op.

Tolerance: both compute in fp32 and differ only in the order of each 4-term sum (a tree in the
kernel), i.e. fp32 rounding, compounded over up to 39 steps: 1e-6 absolute on values in [0, 1]
and 1e-5 relative on gradients (measured under the interpreter: values equal, gradients 3e-7). A wrong step order or a wrong VJP moves them by
~1e-2 or more (checked below: one iteration fewer is caught)."""

from __future__ import annotations

import os

# The interpreter is chosen when a kernel is decorated (on import): switch it on first, then put the
# previous value back so that other modules of a GPU session do not run interpreted.
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402
    from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
except ImportError:
    triton = None
# import the kernels only where triton itself runs interpreted: a GPU session that imported triton
# first would otherwise get (and cache) interpreter-decorated kernels for its CUDA tests
interpreted = triton is not None and isinstance(triton.language.zeros, InterpretedFunction)
if interpreted:
    from glmkit.kernels.mhc import sinkhorn_triton  # noqa: E402
if _PREVIOUS is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS
if triton is None:
    pytest.skip("triton is not installed (its interpreter runs these kernels on the CPU)", allow_module_level=True)
if not interpreted:
    pytest.skip("triton was imported before its interpreter was switched on (a CUDA machine): the GPU "
                "suite checks these kernels there", allow_module_level=True)

from glmkit.kernels.mhc import naive  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def mhc_like(tokens, n, seed=0, dtype=torch.float32):
    """What mix_weights hands Sinkhorn: softmax rows + eps, for a batch of shape tokens."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*tokens, n, n, generator=g) * 2
    return (torch.softmax(logits, -1) + 1e-6).to(dtype)


@pytest.mark.parametrize("n,tokens,iters", [(4, (3, 67), 20), (4, (130,), 1), (3, (70,), 5), (4, (5,), 2)])
def test_forward_and_backward_match_the_loop(n, tokens, iters):
    comb = mhc_like(tokens, n)
    grad = torch.randn(comb.shape, generator=torch.Generator().manual_seed(1))
    want_x = comb.clone().requires_grad_()
    want = naive.sinkhorn(want_x, iters, 1e-6)
    want.backward(grad)
    got_x = comb.clone().requires_grad_()
    got = sinkhorn_triton.sinkhorn(got_x, iters, 1e-6)
    got.backward(grad)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got - want).abs().max() < 1e-6
    assert ((got_x.grad - want_x.grad).norm() / want_x.grad.norm()) < 1e-5
    if iters > 1:  # the check can fail: one normalisation pair fewer is far off
        fewer = naive.sinkhorn(comb, iters - 1, 1e-6)
        assert (got - fewer).abs().max() > 1e-5


def test_columns_sum_to_one_and_rows_as_far_as_the_loop_gets():
    comb = mhc_like((200,), 4, seed=3)
    got = sinkhorn_triton.sinkhorn(comb, 20, 1e-6)
    want = naive.sinkhorn(comb, 20, 1e-6)
    assert (got.sum(-2) - 1).abs().max() < 1e-5  # the last step normalises columns
    # 20 iterations leave the most skewed matrices' rows a little off (1.4e-2 here), the loop's as well
    assert ((got.sum(-1) - 1).abs() - (want.sum(-1) - 1).abs()).abs().max() < 1e-6


def test_bf16_in_bf16_out_fp32_math():
    comb = mhc_like((64,), 4, seed=4, dtype=torch.bfloat16)
    got = sinkhorn_triton.sinkhorn(comb, 20, 1e-6)
    want = naive.sinkhorn(comb.float(), 20, 1e-6)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 2 ** -8  # one bf16 rounding of values < 1


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"square matrices \[\.\.\., n, n\], got shape \(5, 4, 3\)"):
        sinkhorn_triton.sinkhorn(torch.rand(5, 4, 3), 20, 1e-6)
    with pytest.raises(ValueError, match="iters >= 1, got 0"):
        sinkhorn_triton.sinkhorn(torch.rand(5, 4, 4), 0, 1e-6)

