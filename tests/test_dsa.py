"""DSA kernels against their reference, the indexer's selection, the backend seam and block recompute."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.conftest import CONFIGS, reference_checkpoint
from glmkit.comparison import rel_rms
from glmkit.config import variant_config
from glmkit.kernels.backends import Backends
from glmkit.kernels.dsa import BACKENDS, absorbed, get_backend, naive
from glmkit.model import TrainPath, load_model
from glmkit.model.dsa import SparseMLA
from glmkit.model.indexer import LightningIndexer, topk_lowest_index_first
from glmkit.model.packed import Packed


def randomize(module, std=0.3, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module


def run_layer(layer, x, packed, backend):
    """Output and every parameter's gradient under a fixed, non-uniform output weighting."""
    layer.zero_grad(set_to_none=True)
    out, topk, _ = layer.forward_packed(x, packed, get_backend(backend))
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), topk, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def rel(a, b):
    return rel_rms(b, a)  # b is the reference


# The block plans the absorbed kernel can take: its own choice, all dense, all gathered, and budgets
# small enough that blocks split every sequence (one row per block for the gather form).
PLANS = {
    "auto": {},
    "dense": dict(DENSE_SPAN_FACTOR=10**6),
    "gather": dict(DENSE_SPAN_FACTOR=0),
    "small-dense-blocks": dict(DENSE_SPAN_FACTOR=10**6, SCORE_BUDGET=300),
    "one-row-gather": dict(DENSE_SPAN_FACTOR=0, GATHER_BUDGET=1),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("config_name", ["tiny", "kpool8"])
def test_absorbed_matches_naive_forward_and_gradients(monkeypatch, plan, config_name):
    """Folding kv_b into the query and output is exact algebra and both block forms are exact: fp32
    agreement of the output and of every gradient to 1e-5 relative (only summation orders differ)."""
    layer = randomize(SparseMLA(variant_config("tiny", **CONFIGS[config_name]), shared_indexer=False))
    x = torch.randn(90, 64)
    packed = Packed.from_lengths([50, 3, 37])  # long enough that the indexer drops keys
    want, topk_n, grads_n = run_layer(layer, x, packed, "naive")
    for name, value in PLANS[plan].items():
        monkeypatch.setattr(absorbed, name, value)
    got, topk_a, grads_a = run_layer(layer, x, packed, "absorbed")
    assert torch.equal(topk_n, topk_a)
    assert rel(got, want) < 1e-5
    assert grads_n.keys() == grads_a.keys() and "kv_b_proj.weight" in grads_n and "q_b_proj.weight" in grads_n
    for name, g in grads_n.items():
        assert rel(grads_a[name], g) < 1e-5, name


def test_sparse_mqa_gradcheck_in_double():
    """The hand-written backward against finite differences, in float64, both block forms."""
    torch.manual_seed(0)
    T, H, R, W = 12, 2, 5, 4
    bounds = [(0, 7), (7, 12)]
    idx = torch.full((T, W), -1)
    for s0, s1 in bounds:
        for t in range(s0, s1):
            ids = torch.randperm(t - s0 + 1)[:W - 1] + s0
            idx[t, :len(ids)] = ids
    q = torch.randn(T, H, R, dtype=torch.float64, requires_grad=True)
    lat = torch.randn(T, R, dtype=torch.float64, requires_grad=True)
    for factor in (0, 10**6):
        absorbed.DENSE_SPAN_FACTOR, saved = factor, absorbed.DENSE_SPAN_FACTOR
        try:
            assert torch.autograd.gradcheck(lambda a, b: absorbed.SparseMQA.apply(a, b, idx, bounds, 0.7), (q, lat))
        finally:
            absorbed.DENSE_SPAN_FACTOR = saved


def test_selection_is_inside_each_sequence_and_causal():
    layer = randomize(SparseMLA(variant_config("tiny"), shared_indexer=False))
    packed = Packed.from_lengths([40, 30])
    with torch.no_grad():
        _, topk, _ = layer.forward_packed(torch.randn(70, 64), packed, get_backend("absorbed"))
    pos, valid = packed.positions, topk >= 0
    assert (packed.seq_index[topk.clamp(min=0)] == packed.seq_index[:, None])[valid].all()
    assert (topk <= torch.arange(70)[:, None])[valid].all()
    width = valid.sum(-1)  # every query sees min(visible, topk + tail) keys
    assert (width <= pos + 1).all() and (width[pos + 1 > 12] < (pos + 1)[pos + 1 > 12]).all()


def test_indexer_selection_does_not_depend_on_the_block_size(monkeypatch):
    """Scoring goes in query blocks against the pools visible to the block; a one-row block must
    select exactly what one large block selects."""
    from glmkit.model import indexer as indexer_module

    config = variant_config("tiny", index_kpool=2, index_topk=6)
    ind = randomize(LightningIndexer(config))
    x, q_resid = torch.randn(64, 64), torch.randn(64, config.q_lora_rank)
    packed = Packed.from_lengths([41, 23])
    want = ind.select_packed(x, q_resid, packed)
    monkeypatch.setattr(indexer_module, "_SCORE_BUDGET", 1)
    assert torch.equal(ind.select_packed(x, q_resid, packed), want)


@pytest.mark.parametrize("budget", [None, 1, 700])
def test_packed_selection_and_caches_equal_each_sequence_alone(monkeypatch, budget):
    """All sequences of a packed batch go through the indexer together (rows of unequal sequences
    batched per block). Each sequence's selection, scores and decode cache must be what it gets
    alone: lengths below, at and above the pool size, unequal, not sorted; budgets of one row per
    block and of blocks that cut the batch at odd positions. Selections exactly equal; scores and
    caches to 1e-6 (the projections and scores are fp32 GEMMs over other row counts, which block
    their sums differently: seen 1.2e-7)."""
    from glmkit.model import indexer as indexer_module

    if budget is not None:
        monkeypatch.setattr(indexer_module, "_SCORE_BUDGET", budget)
    config = variant_config("tiny", index_kpool=4, index_topk=8)
    ind = randomize(LightningIndexer(config))
    lengths = [23, 3, 41, 4, 1, 17]
    T = sum(lengths)
    g = torch.Generator().manual_seed(1)
    x, q_resid = torch.randn(T, 64, generator=g), torch.randn(T, config.q_lora_rank, generator=g)
    packed = Packed.from_lengths(lengths)
    state, got_scores = ind.empty_state(len(lengths), 48, torch.float32, "cpu"), []
    got = ind.select_packed(x, q_resid, packed, state, got_scores.append)
    (got_scores,) = got_scores
    assert got_scores.shape == (T, max(lengths) // 4)
    for n, (start, end) in enumerate(packed.bounds()):
        alone, alone_scores = ind.empty_state(1, 48, torch.float32, "cpu"), []
        want = ind.select_packed(x[start:end], q_resid[start:end], Packed.from_lengths([end - start]), alone,
                                 alone_scores.append)
        assert torch.equal(got[start:end], torch.where(want >= 0, want + start, want)), n
        width = alone_scores[0].shape[1]
        torch.testing.assert_close(got_scores[start:end, :width], alone_scores[0], rtol=1e-6, atol=1e-6)
        assert torch.isneginf(got_scores[start:end, width:]).all()
        for field in ("keys", "gates", "pools"):
            torch.testing.assert_close(getattr(state, field)[n], getattr(alone, field)[0], rtol=1e-6, atol=1e-6)


def test_topk_breaks_ties_by_lower_index_like_a_stable_sort():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (200, 37), generator=g).float() * 0.5  # many exact ties, negatives
    scores[:, 5] = -0.0  # -0.0 equals 0.0 and must tie with it
    scores[::3, ::4] = float("-inf")
    want = scores.sort(dim=-1, descending=True, stable=True).indices[:, :11]
    assert torch.equal(topk_lowest_index_first(scores, 11), want)


def test_compact_selection_keeps_each_rows_ids_in_order():
    idx = torch.tensor([[5, -1, 3, -1, -1, 7], [-1, -1, 2, -1, -1, -1], [0, 1, -1, -1, 4, -1]])
    assert naive.compact_selection(idx).tolist() == [[5, 3, 7], [2, -1, -1], [0, 1, 4]]


def test_naive_recomputes_each_block_in_the_backward(monkeypatch):
    """The reference runs each query block under activation checkpointing (gathered keys and values
    rebuilt in the backward). One row per block, checkpointed, gives plain autograd's output and
    gradients: fp32 agreement to 1e-6 relative (only the block boundaries change matmul shapes)."""
    layer = randomize(SparseMLA(variant_config("tiny"), shared_indexer=False))
    x, packed, calls = torch.randn(70, 64), Packed.from_lengths([40, 30]), []
    with monkeypatch.context() as m:
        m.setattr(naive, "checkpoint", lambda fn, *args, **kwargs: fn(*args))  # plain autograd
        plain, _, grads = run_layer(layer, x, packed, "naive")
    monkeypatch.setattr(naive, "GATHER_BUDGET", 1)
    monkeypatch.setattr(naive, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    blocks, _, block_grads = run_layer(layer, x, packed, "naive")
    assert len(calls) == 70
    assert rel(blocks, plain) < 1e-6
    for name, g in grads.items():
        assert rel(block_grads[name], g) < 1e-6, name


def test_backends_parse_and_errors():
    assert Backends.parse(None) == Backends()
    assert Backends.parse("fla") == Backends(kda="fla")
    assert Backends.parse("kda=fla, dsa=naive,moe=loop") == Backends("fla", "naive", "loop")
    assert Backends.parse(str(Backends("fla", "naive", "grouped"))) == Backends("fla", "naive", "grouped")
    with pytest.raises(ValueError, match="unknown DSA backend 'flash'; allowed: auto, naive, absorbed, triton, tilelang"):
        Backends(dsa="flash")
    with pytest.raises(ValueError, match="unknown operator 'attn'.*allowed: kda, dsa, moe, fuse"):
        Backends.parse("attn=fla")
    with pytest.raises(ValueError, match="unknown MOE backend"):
        Backends.parse("moe=fast")
    assert set(BACKENDS) == {"auto", "naive", "absorbed", "triton", "tilelang"}


def test_dense_span_padding_uses_zero_rows_only():
    """On CUDA dense spans are padded to a multiple of 8 keys: with zero rows, never the latents of
    later tokens or of the next sequence (a NaN there would reach this block through 0 x NaN)."""
    latent = torch.randn(20, 4)
    latent[13:] = float("nan")
    keys = absorbed._span_keys(latent, 5, 13, 16)
    assert keys.shape == (16, 4) and torch.equal(keys[:8], latent[5:13]) and torch.equal(keys[8:], torch.zeros(8, 4))
    assert absorbed._span_keys(latent, 0, 8, 8).data_ptr() == latent.data_ptr()  # aligned: no copy


def test_triton_backend_names_its_package_when_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    monkeypatch.delitem(sys.modules, "glmkit.kernels.dsa.sparse_triton", raising=False)
    with pytest.raises(ImportError, match="DSA backend 'triton' needs triton"):
        Backends(dsa="triton").dsa_ops()
    # "auto" never needs it off CUDA: it is the absorbed form there, to the bit
    layer = randomize(SparseMLA(variant_config("tiny"), shared_indexer=False))
    x, packed = torch.randn(50, 64), Packed.from_lengths([30, 20])
    want, _, _ = run_layer(layer, x, packed, "absorbed")
    got, _, _ = run_layer(layer, x, packed, "auto")
    assert torch.equal(want, got)


def test_tilelang_backend_names_its_package_when_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tilelang", None)
    monkeypatch.delitem(sys.modules, "glmkit.kernels.dsa.sparse_tilelang", raising=False)
    with pytest.raises(ImportError, match="DSA backend 'tilelang' needs tilelang"):
        Backends(dsa="tilelang").dsa_ops()


@pytest.mark.parametrize("block", [4, 64])
def test_key_blocks_plan_lists_every_block_that_holds_a_key_once(block):
    """The TileLang forward visits, per row, the first `blocks[t]` entries of `order`: every selected
    id must lie in exactly one of them, the count is even (whole stage pairs) and at most one listed
    block more than the filled ones (and then an empty one); ids keep their slots; rows with no key
    visit nothing. Rows: empty slots in runs and scattered, all empty, all full, W not a multiple."""
    from glmkit.kernels.dsa import key_blocks

    g = torch.Generator().manual_seed(0)
    T, W = 9, 2063 if block == 64 else 37
    idx = torch.randint(0, 10_000, (T, W), generator=g)
    idx[0] = -1  # no key
    idx[2, W // 3:] = -1  # one run of empty slots
    idx[3] = torch.where(torch.rand(W, generator=g) < 0.8, -1, idx[3])  # scattered
    idx[4, :-1] = -1  # the last slot only
    idx[5, 1::2] = -1
    ids, order, blocks = key_blocks.plan(idx, block)
    assert ids.dtype == order.dtype == blocks.dtype == torch.int32
    assert ids.shape[1] % (2 * block) == 0 and torch.equal(ids[:, :W], idx.int()) and bool((ids[:, W:] == -1).all())
    filled = (ids.view(T, -1, block) >= 0).any(-1)
    for t in range(T):
        n = int(blocks[t])
        visited = order[t, :n].long()
        assert n % 2 == 0 and n - int(filled[t].sum()) in (0, 1)
        assert len(set(visited.tolist())) == n and sorted(order[t].tolist()) == list(range(order.shape[1]))
        assert int(filled[t, visited].sum()) == int(filled[t].sum())  # every filled block is visited
        seen = ids[t].view(-1, block)[visited].flatten()
        assert torch.equal(seen[seen >= 0].sort().values, idx[t][idx[t] >= 0].int().sort().values)
    assert int(blocks[0]) == 0 and int(blocks[1]) == ids.shape[1] // block
    with pytest.raises(ValueError, match=r"idx must be \[T, W\], got shape \(5,\)"):
        key_blocks.plan(torch.zeros(5, dtype=torch.long), block)


@pytest.mark.parametrize("config_name", ["tiny", "shared-kpool2"])
def test_block_recompute_gives_the_same_logprobs_and_gradients(request, tmp_path, config_name):
    """Per-block activation checkpointing (the recipe's full recompute) changes memory, not math:
    the same log-probs and gradients to 1e-6 relative in fp32, shared-indexer layers included (the
    recomputed block must see the same top-k as the first run)."""


    path = reference_checkpoint(variant_config("tiny", **CONFIGS[config_name]), seed=3, path=tmp_path / "ck")
    seqs = [list(range(3, 60)), list(range(100, 131))]
    results = []
    for recompute in (False, True):
        model = load_model(path)
        out = TrainPath(model, recompute=recompute).forward(seqs)
        out.logprobs.sum().backward()
        results.append((out.logprobs.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                        {k: v.clone() for k, v in out.routing.items()}))
    (lp0, g0, r0), (lp1, g1, r1) = results
    assert rel(lp1, lp0) < 1e-6
    assert g0.keys() == g1.keys()
    for name, g in g0.items():
        assert rel(g1[name], g) < 1e-6 if g.norm() > 0 else g1[name].norm() == 0, name
    assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)
