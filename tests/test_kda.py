"""KDA kernels: chunked vs recurrent (ours) vs fla's naive_recurrent_kda, packed varlen, the layer's
packed conv vs its decode conv, and the backend registry.

Tolerance: all fp32 on CPU; the chunked form reorders sums and solves a triangular system, so it
agrees with the token loop to ~1e-6 absolute on outputs of magnitude ~1: we bound the relative RMS
||ref - x|| / ||ref|| (the ratio fla's own tests use) by 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from glmkit.comparison import rel_rms
from glmkit.kernels.kda import get_backend, naive
from tests import fla_naive

TOL = 1e-5



def inputs(B=2, T=150, H=3, K=16, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g))  # the lower-bounded decay
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, K, V, generator=g)
    return q, k, v, gate, beta, state


def test_chunked_matches_recurrent_and_fla_naive():
    fla = fla_naive.load()
    q, k, v, g, beta, s0 = inputs()
    o_rec, s_rec = naive.recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    o_chunk, s_chunk = naive.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    qn, kn = naive.l2norm(q), naive.l2norm(k)
    o_fla, s_fla = fla.naive_recurrent_kda(qn, kn, v, g, beta, initial_state=s0, output_final_state=True)
    assert rel_rms(o_fla, o_rec) < TOL and rel_rms(s_fla, s_rec) < TOL
    assert rel_rms(o_fla, o_chunk) < TOL and rel_rms(s_fla, s_chunk) < TOL
    # fla's own chunked reference agrees too (chunk 64 as ours; it needs T % 64 == 0)
    q, k, v, g, beta, s0 = inputs(T=128, seed=1)
    o_flac, s_flac = fla.naive_chunk_kda(naive.l2norm(q), naive.l2norm(k), v, g, beta, initial_state=s0,
                                         output_final_state=True)
    o_chunk, s_chunk = naive.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
    assert rel_rms(o_flac, o_chunk) < TOL and rel_rms(s_flac, s_chunk) < TOL


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_boundaries(T):
    q, k, v, g, beta, _ = inputs(B=1, T=T)
    o_rec, s_rec = naive.recurrent_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_chunk, s_chunk = naive.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o_rec, o_chunk) < TOL and rel_rms(s_rec, s_chunk) < TOL


def test_chunks_in_groups_equal_all_chunks_at_once(monkeypatch):
    """The chunked form holds the pairwise decays of a group of chunks at a time (DECAY_BUDGET): one
    chunk per group, three, or all of them give the same outputs and state to 1e-6 relative RMS (the
    same per-chunk math; only the batch of each einsum differs)."""
    q, k, v, g, beta, s0 = inputs(T=300)
    per_chunk = 2 * 3 * 64 * 64 * 16 * 4  # the sequences side by side as heads, C = 64, K = 16, fp32
    results = []
    for chunks in (1, 3, 10 ** 6):
        monkeypatch.setattr(naive, "DECAY_BUDGET", chunks * per_chunk)
        results.append(naive.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True))
    for o, s in results[:-1]:
        assert rel_rms(results[-1][0], o) < 1e-6 and rel_rms(results[-1][1], s) < 1e-6


def test_packed_varlen_equals_separate_sequences():
    lengths = [5, 70, 1, 33]
    q, k, v, g, beta, _ = inputs(B=1, T=sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    o, s = naive.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    for n in range(len(lengths)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        o_n, s_n = naive.recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)
        assert rel_rms(o_n, o[:, sl]) < TOL and rel_rms(s_n[0], s[n]) < TOL


def test_layer_packed_prefill_then_steps_equals_one_packed_pass():
    """The layer's packed conv + chunked KDA (prefill, with states out) followed by decode steps
    gives the same outputs as one packed pass over the whole sequence."""
    from glmkit.config import variant_config
    from glmkit.model.kda import KimiDeltaAttention
    from glmkit.model.packed import Packed

    torch.manual_seed(0)
    layer = KimiDeltaAttention(variant_config("tiny"))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    kda = get_backend("torch")
    lengths, extra = [9, 2], 5
    x = torch.randn(sum(lengths) + extra * len(lengths), 64)
    full = Packed.from_lengths([n + extra for n in lengths])
    want, _ = layer.forward_packed(x, full, kda)
    bounds = full.bounds()
    prompt_rows = torch.cat([torch.arange(s, s + n) for (s, _), n in zip(bounds, lengths)])
    _, state = layer.forward_packed(x[prompt_rows], Packed.from_lengths(lengths), kda, want_state=True)
    for j in range(extra):
        rows = torch.tensor([s + n + j for (s, _), n in zip(bounds, lengths)])
        got = layer.forward_step(x[rows], state, kda)
        assert rel_rms(want[rows], got) < TOL


def test_unknown_and_unavailable_backends():
    with pytest.raises(ValueError, match="allowed: torch, fla"):
        get_backend("triton")
    try:
        import fla  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="flash-linear-attention"):
            get_backend("fla")
    else:
        pytest.skip("fla is importable here; the missing-package message is not reachable")
