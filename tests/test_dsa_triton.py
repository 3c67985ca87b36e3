"""The Triton sparse-MQA kernels (dsa/sparse_triton.py) against absorbed.SparseMQA, run by Triton's
CPU interpreter in fp32 on small shapes: output, lse, and the gradients through the autograd function
(torch backward and the Triton backward)."""

from __future__ import annotations

import importlib.util
import os
import sys

# The interpreter is chosen when a kernel is decorated, i.e. when sparse_triton is imported: set the
# switch first, and put the previous value back once imported so other test modules of the session
# (Triton kernels on a GPU) are not interpreted; the fixture below sets it again around each test here.
_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"


def _restore_interpret_switch():
    if _PREVIOUS is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS


import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import triton  # noqa: E402
except ImportError:
    _restore_interpret_switch()
    pytest.skip("triton is not installed (its interpreter runs these kernels on the CPU)", allow_module_level=True)

from glmkit.comparison import rel_rms  # noqa: E402
from glmkit.kernels.dsa import absorbed, sparse_triton  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

_restore_interpret_switch()
if not isinstance(triton.language.zeros, InterpretedFunction):  # a GPU session imported triton first
    pytest.skip("triton was imported before its interpreter was switched on (a CUDA machine): these CPU "
                "interpreter tests run where tests/conftest.py switches it on, i.e. without CUDA",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(a, b):
    return rel_rms(b, a)  # b is the reference


def make_case(lengths, H, R, W, seed=0, dtype=torch.float32):
    """Packed sequences and a selection like the indexer's: each row picks distinct keys of its own
    sequence at or before itself, in random slots, the rest -1. Special rows: one with every slot
    empty, one whose first 16 slots are empty (a leading key block with no key), one whose keys all
    sit in the first slots (trailing blocks with no key)."""
    g = torch.Generator().manual_seed(seed)
    bounds, s0 = [], 0
    for n in lengths:
        bounds.append((s0, s0 + n))
        s0 += n
    T = s0
    idx = torch.full((T, W), -1, dtype=torch.long)
    for a, b in bounds:
        for t in range(a, b):
            visible = t - a + 1
            count = min(visible, W, int(torch.randint(1, W + 1, (1,), generator=g)))
            ids = torch.randperm(visible, generator=g)[:count] + a
            slots = torch.randperm(W, generator=g)[:count]
            idx[t, slots] = ids
    a, b = bounds[0]
    idx[a + 3] = -1  # no key at all: output 0, lse -inf
    last = b - 1
    keys = torch.randperm(b - a, generator=g)[:W - 16] + a
    idx[last] = -1
    idx[last, 16:16 + len(keys)] = keys  # the first 16-slot block is empty
    a, b = bounds[-1]
    idx[b - 1] = -1
    idx[b - 1, :3] = torch.tensor([b - 1, a, a + 1])  # keys only at the start
    q = torch.randn(T, H, R, generator=g).to(dtype)
    latent = torch.randn(T, R, generator=g).to(dtype)
    return q, latent, idx, bounds


# (lengths, H, R, W, BLOCK_N, BLOCK_RO): W never a multiple of BLOCK_N; R = 48 is not a power of
# two (padded columns); BLOCK_RO < R splits the output dims over a second grid axis; W = 20 < 32 is
# a single partial block.
CASES = {
    "h4-r32": ([40, 3, 37], 4, 32, 21, 16, None),
    "h16-r64": ([70, 50, 80], 16, 64, 37, 16, None),
    "h16-r64-n32": ([70, 50, 80], 16, 64, 37, 32, None),
    "h16-r64-split": ([70, 50, 80], 16, 64, 37, 16, 32),
    "h4-r48-split": ([30, 25], 4, 48, 20, 32, 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_absorbed(case):
    """fp32: output and lse to 1e-5 (abs and rel). The scores and the softmax are fp32 in both; only
    the summation order (online softmax over key blocks vs one logsumexp) and exp2 vs exp differ,
    which moves results by a few fp32 ulps of O(1) values (seen: ~1e-6)."""
    lengths, H, R, W, block_n, block_ro = CASES[case]
    q, latent, idx, bounds = make_case(lengths, H, R, W)
    scale = 0.3
    out, lse = sparse_triton.forward(q, latent, idx, scale, BLOCK_N=block_n, BLOCK_RO=block_ro)
    want = absorbed.SparseMQA.apply(q, latent, idx, bounds, scale)
    scores = torch.einsum("thr,twr->thw", q, latent[idx.clamp(min=0)]) * scale
    want_lse = scores.masked_fill((idx < 0)[:, None], float("-inf")).logsumexp(-1)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)  # -inf where want_lse is -inf
    empty = (idx < 0).all(-1)
    assert empty.sum() == 1 and (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


@pytest.mark.parametrize("triton_backward", [False, True], ids=["torch-bwd", "triton-bwd"])
@pytest.mark.parametrize("case", ["h4-r32", "h4-r48-split", "h16-r64-n32"])
def test_gradients_match_absorbed(monkeypatch, case, triton_backward):
    """Gradients of q_lat and latent through SparseMQATriton under a random output weighting: 1e-5
    relative in fp32 (the torch backward is absorbed's own, fed our out and lse; the Triton one sums
    the latent gradient in another order, by fp32 atomics)."""
    lengths, H, R, W, block_n, block_ro = CASES[case]
    monkeypatch.setattr(sparse_triton, "TRITON_BACKWARD", triton_backward)
    monkeypatch.setitem(sparse_triton.FWD_CONFIG, "BLOCK_N", block_n)
    monkeypatch.setitem(sparse_triton.FWD_CONFIG, "BLOCK_RO", block_ro)
    monkeypatch.setitem(sparse_triton.BWD_CONFIG, "BLOCK_N", block_n)
    q, latent, idx, bounds = make_case(lengths, H, R, W, seed=1)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (absorbed.SparseMQA, sparse_triton.SparseMQATriton):
        qg, lg = q.clone().requires_grad_(), latent.clone().requires_grad_()
        (fn.apply(qg, lg, idx, bounds, 0.3) * weight).sum().backward()
        grads.append((qg.grad, lg.grad))
    (want_q, want_l), (got_q, got_l) = grads
    assert rel(got_q, want_q) < 1e-5 and rel(got_l, want_l) < 1e-5
    empty = (idx < 0).all(-1)
    assert (got_q[empty] == 0).all() and torch.isfinite(got_q).all() and torch.isfinite(got_l).all()


def test_triton_backward_in_row_chunks_gives_the_one_chunk_gradients():
    """The backward's scratch bound splits the rows into chunks (7 rows here, the last one short):
    dq is per row and the latent gradient a sum, so the gradients are those of one chunk (1e-6
    relative: fp32 atomics may add in another order) and of absorbed's torch backward (1e-5)."""
    lengths, H, R, W, block_n, _ = CASES["h4-r32"]
    q, latent, idx, bounds = make_case(lengths, H, R, W, seed=8)
    out, lse = sparse_triton.forward(q, latent, idx, 0.3, BLOCK_N=block_n)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    whole = sparse_triton.backward(q, latent, idx, out, lse, grad, 0.3, BLOCK_N=block_n)
    chunked = sparse_triton.backward(q, latent, idx, out, lse, grad, 0.3, BLOCK_N=block_n,
                                     scratch_elements=7 * H * W)
    qg, lg = q.clone().requires_grad_(), latent.clone().requires_grad_()
    absorbed.SparseMQA.apply(qg, lg, idx, bounds, 0.3).backward(grad)
    for got, one, want in zip(chunked, whole, (qg.grad, lg.grad)):
        assert rel(got, one) < 1e-6 and rel(got, want) < 1e-5


def test_attend_matches_absorbed_with_weight_gradients():
    """attend folds kv_b exactly as absorbed.attend: output and the gradients of q, latent and the
    kv_b weight to 1e-5 relative in fp32."""
    T, H, dk, dv, R = 90, 4, 16, 24, 32
    _, _, idx, bounds = make_case([50, 3, 37], H, R, 19, seed=3)
    g = torch.Generator().manual_seed(4)
    q, latent = torch.randn(T, H, dk, generator=g), torch.randn(T, R, generator=g)
    weight = torch.randn(H * (dk + dv), R, generator=g) * R ** -0.5
    results = []
    for module in (absorbed, sparse_triton):
        leaves = [x.clone().requires_grad_() for x in (q, latent, weight)]
        out = module.attend(leaves[0], leaves[1], leaves[2], idx, bounds, dk ** -0.5)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), [x.grad for x in leaves]))
    (want, want_grads), (got, got_grads) = results
    assert got.shape == (T, H, dv)
    assert rel(got, want) < 1e-5
    for name, a, b in zip(("q", "latent", "kv_b"), got_grads, want_grads):
        assert rel(a, b) < 1e-5, name


def test_half_precision_forward_close_to_absorbed():
    """Low-precision inputs (fp16 here: the interpreter's tl.dot reads bf16, stored as uint16, as
    integers, so bf16 cannot run on the CPU; fp16 takes the same path): fp32 scores and accumulation,
    p rounded to the input dtype before p @ v in both, so outputs agree to about an fp16 rounding of
    p (2^-11 relative, seen ~3e-4); lse (fp32 from exact fp16 products) to 1e-4."""
    q, latent, idx, bounds = make_case([40, 30], 16, 32, 21, seed=5, dtype=torch.float16)
    out, lse = sparse_triton.forward(q, latent, idx, 0.3, BLOCK_N=16)
    want = absorbed.SparseMQA.apply(q, latent, idx, bounds, 0.3)
    assert out.dtype == torch.float16
    assert rel(out.float(), want.float()) < 2e-3
    scores = torch.einsum("thr,twr->thw", q.float(), latent.float()[idx.clamp(min=0)]) * 0.3
    want_lse = scores.masked_fill((idx < 0)[:, None], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_order_of_slots_does_not_matter():
    """Permuting each row's slots (ids and empties together) changes only the summation order."""
    q, latent, idx, bounds = make_case([40, 30], 4, 32, 21, seed=6)
    perm = torch.argsort(torch.rand(idx.shape, generator=torch.Generator().manual_seed(7)), dim=-1)
    out, lse = sparse_triton.forward(q, latent, idx, 0.3, BLOCK_N=16)
    out_p, lse_p = sparse_triton.forward(q, latent, idx.gather(1, perm), 0.3, BLOCK_N=16)
    torch.testing.assert_close(out_p, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_p, lse, rtol=1e-5, atol=1e-5)


def test_useful_flops_counts_selected_pairs():
    idx = torch.tensor([[0, -1, -1], [0, 1, -1], [-1, -1, -1]])
    assert sparse_triton.useful_flops(idx, heads=64, rank=512) == 4 * 64 * 512 * 3


def test_missing_triton_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.find_spec("glmkit.kernels.dsa.sparse_triton")
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(ImportError, match="DSA backend 'triton' needs triton"):
        spec.loader.exec_module(module)


def cache_case(S, cap, H, dk, dv, R, W, rows, seed=0):
    """A decode cache of S requests and `rows` query rows, each of a random request but the last (no
    row reads slot S-1): ids are distinct positions of that request, in random slots, the rest -1;
    the first row's slots all empty but one."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(S, cap, R, generator=g)
    slots = torch.randint(0, S - 1, (rows,), generator=g)
    idx = torch.full((rows, W), -1, dtype=torch.long)
    for r in range(rows):
        count = int(torch.randint(1, W + 1, (1,), generator=g))
        idx[r, torch.randperm(W, generator=g)[:count]] = torch.randperm(cap, generator=g)[:count]
    idx[0] = -1
    idx[0, W - 1] = cap - 1
    q = torch.randn(rows, H, dk, generator=g)
    weight = torch.randn(H * (dk + dv), R, generator=g) * R ** -0.5
    return q, cache, weight, idx, slots


@pytest.mark.parametrize("W, block_n", [(21, 16), (37, 32)])
def test_attend_cache_matches_the_torch_forms(monkeypatch, W, block_n):
    """Rows over a decode cache (decode steps, prefill chunks): the slotted Triton kernel, the
    absorbed torch form and the un-absorbed reference agree to 1e-5 relative in fp32 (the same math
    in other orders). A row reads only its own slot: moving another request's latents changes nothing."""
    from glmkit.kernels.dsa import naive

    monkeypatch.setitem(sparse_triton.FWD_CONFIG, "BLOCK_N", block_n)
    q, cache, weight, idx, slots = cache_case(S=5, cap=40, H=4, dk=16, dv=24, R=32, W=W, rows=9)
    want = naive.attend_cache(q, cache, weight, idx, slots, 0.25)
    assert want.shape == (9, 4, 24)
    for module in (absorbed, sparse_triton):
        assert rel(module.attend_cache(q, cache, weight, idx, slots, 0.25), want) < 1e-5, module.__name__
    cache[-1] = float("nan")
    assert rel(sparse_triton.attend_cache(q, cache, weight, idx, slots, 0.25), want) < 1e-5
