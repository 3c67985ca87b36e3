"""mHC, manifold-constrained hyper-connections: n residual streams per token, mixed around every block.

Per block (attention or MLP), from the streams X [..., n, D]:
    y = unweighted_rms_norm(flatten(X)) @ fn^T, split into (pre n, post n, comb n*n)
    pre  = sigmoid(y_pre * s0 + b_pre) + eps                   block input = sum_i pre_i X_i
    post = 2 sigmoid(y_post * s1 + b_post)
    comb = Sinkhorn(softmax_rows(y_comb * s2 + b_comb) + eps)  doubly stochastic n x n
    new streams X'_j = post_j * block_out + sum_i comb_ij X_i
The parameters (`hc_attn_fn`, `hc_attn_base`, `hc_attn_scale`, same for `hc_ffn_*`) live on the block
under their checkpoint names; this module is the math.
"""

from __future__ import annotations

import torch

from glmkit.kernels.fuse import fusable
from glmkit.kernels.mhc import sinkhorn  # the torch loop; one Triton kernel in a fused region on CUDA
from glmkit.model.norms import rms_norm, unweighted_rms_norm


def mix_weights(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    """streams [..., n, D] -> pre [..., n], post [..., n], comb [..., n, n] (all fp32)."""
    n = streams.shape[-2]
    flat = unweighted_rms_norm(streams.flatten(-2).float(), norm_eps)
    y = flat @ fn.float().t()
    y_pre, y_post, y_comb = y.split([n, n, n * n], dim=-1)
    b_pre, b_post, b_comb = base.split([n, n, n * n])
    pre = torch.sigmoid(y_pre * scale[0] + b_pre) + hc_eps
    post = 2 * torch.sigmoid(y_post * scale[1] + b_post)
    comb = torch.softmax(y_comb.unflatten(-1, (n, n)) * scale[2] + b_comb.view(n, n), dim=-1) + hc_eps
    comb = sinkhorn(comb, sinkhorn_iters, hc_eps)
    return pre, post, comb


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[..., n, D] x [..., n] -> [..., D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(-2).to(streams.dtype)


def expand(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """X'_j = post_j * out + sum_i comb_ij X_i. block_out [..., D], streams [..., n, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + comb.to(dtype).transpose(-1, -2) @ streams


@fusable
def enter(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm_weight,
          block_norm_eps: float):
    """The way into a block: mix weights, collapse, and the block's input RMSNorm in one pass.
    -> (block input [..., D], pre, post, comb)."""
    pre, post, comb = mix_weights(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return rms_norm(collapse(streams, pre), norm_weight, block_norm_eps), pre, post, comb


def _leave_summed(block_out, streams, post, comb):
    # the per-token n x n mix as n broadcast products, one fused kernel, instead of T tiny GEMMs
    mixed = post.unsqueeze(-1) * block_out.unsqueeze(-2).float()
    for i in range(streams.shape[-2]):
        mixed = mixed + comb[..., i, :, None] * streams[..., i, None, :].float()
    return mixed.to(streams.dtype)


@fusable(fused_form=_leave_summed)
def leave(block_out, streams, post, comb):
    """The way out of a block: expand (see `expand`)."""
    return expand(block_out, streams, post, comb)


def doubly_stochastic_error(comb: torch.Tensor) -> float:
    """max |row sum - 1| and |column sum - 1| over all matrices in comb [..., n, n]."""
    return max((comb.sum(-1) - 1).abs().max().item(), (comb.sum(-2) - 1).abs().max().item())
