"""The LM head's per-token log-prob (and entropy) as one autograd function.

Autograd through `log_softmax(h W^T / T).gather(target)` keeps the [rows, vocab] logits and their
fp32 log-softmax for the backward (~3.8 GB per 4096 rows at vocab 154880), or recomputes all of it
under checkpointing. Here the forward keeps only the per-row log-sum-exp (and entropy); the backward
rebuilds the softmax from the logits and writes the logits' gradient directly:

    d logp_t / d z = onehot(target) - p        d H / d z = -p (log p + H)        z = logits / T

The logits themselves are kept (bf16) when asked (one GEMM fewer in the backward, for a bounded
number of rows) or recomputed. The elementwise parts are `fusable` (one pass over the logits each).
"""

from __future__ import annotations

import torch

from glmkit.kernels.fuse import current_mode, fusable, fusing


@fusable
def head_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float, want_entropy: bool):
    """logits [n, V] -> (log-prob of target under softmax(logits / T), 0 where target < 0;
    log-sum-exp of logits / T; entropy or None), all fp32 [n]."""
    z = logits.float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    logp = (picked - lse).masked_fill(targets < 0, 0.0)
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if want_entropy else None
    return logp, lse, entropy


@fusable
def head_logits_grad(logits, targets, lse, entropy, grad_logp, grad_entropy, temperature: float):
    """d(sum grad_logp * logp + sum grad_entropy * entropy) / d logits, in the logits' dtype."""
    z = logits.float() / temperature
    logp_all = z - lse[:, None]
    p = torch.exp(logp_all)
    g = grad_logp.float().masked_fill(targets < 0, 0.0)[:, None]
    cols = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.where(cols[None, :] == targets[:, None], g, 0.0) - p * g
    if grad_entropy is not None:
        grad = grad - grad_entropy.float()[:, None] * p * (logp_all + entropy[:, None])
    return (grad / temperature).to(logits.dtype)


class LogprobHead(torch.autograd.Function):
    """(hidden [n, D], weight [V, D], targets [n]) -> (logp [n], entropy [n] or None)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, want_entropy, keep_logits):
        logits = hidden @ weight.t()
        logp, lse, entropy = head_stats(logits, targets, temperature, want_entropy)
        ctx.temperature, ctx.want_entropy, ctx.fuse = temperature, want_entropy, current_mode()
        ctx.kept = logits if keep_logits else None
        ctx.save_for_backward(hidden, weight, targets, lse, entropy if want_entropy else lse)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        logits = ctx.kept if ctx.kept is not None else hidden @ weight.t()
        ctx.kept = None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        grad_entropy = grad_entropy if ctx.want_entropy else None
        with fusing(ctx.fuse):  # the autograd engine runs this outside the forward's fuse mode
            grad = head_logits_grad(logits, targets, lse, entropy, grad_logp, grad_entropy, ctx.temperature)
        del logits
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None
