"""GRPO loss math, with the recipe framework's definitions (per response token; default reduction =
mean over samples of each sample's token mean)."""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per prompt group of `group_size` consecutive samples: (r - mean) / (unbiased std + 1e-6)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    std = groups.std(dim=1, unbiased=True, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
    return ((groups - groups.mean(dim=1, keepdim=True)) / (std + 1e-6)).flatten()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators on log r = logp - ref_logp."""
    log_ratio = logp.float() - ref_logp.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.square() / 2
    if kind in ("k3", "low_var_kl"):
        if kind == "low_var_kl":
            log_ratio = log_ratio.clamp(-20, 20)
        kl = torch.exp(-log_ratio) - 1 + log_ratio
        return kl.clamp(-10, 10) if kind == "low_var_kl" else kl
    raise ValueError(f"unknown KL type {kind!r}; allowed: {', '.join(KL_TYPES)}")


def sample_mean(values: torch.Tensor, mask: torch.Tensor, sample_of: torch.Tensor, num_samples: int):
    """Mean over samples of each sample's mean over its masked tokens (the recipe's reduction).
    values, mask, sample_of: [T] over packed tokens; samples without any masked token are skipped."""
    present = samples_present(mask, sample_of, num_samples)
    total = sample_total(values, mask, sample_of, num_samples)
    return total / present if present else total


def sample_total(values: torch.Tensor, mask: torch.Tensor, sample_of: torch.Tensor, num_samples: int):
    """Sum over samples of each sample's masked-token mean (a 0-d tensor; samples with no masked token
    add nothing): sample_mean's numerator, which data-parallel ranks add up before dividing."""
    mask = mask.float()
    sums = torch.zeros(num_samples, dtype=torch.float32, device=values.device).index_add(
        0, sample_of, values.float() * mask)
    counts = torch.zeros(num_samples, dtype=torch.float32, device=values.device).index_add(0, sample_of, mask)
    return (sums / counts.clamp(min=1)).sum()


def samples_present(mask: torch.Tensor, sample_of: torch.Tensor, num_samples: int) -> int:
    """How many of the samples have a masked token: sample_mean's denominator."""
    counts = torch.zeros(num_samples, dtype=torch.float32, device=mask.device).index_add(0, sample_of, mask.float())
    return int((counts > 0).sum())


def ppo_clip_loss(logp, old_logp, advantages, eps_clip: float = 0.2, eps_clip_high: float = 0.28):
    """Per-token PPO-clip loss, clipped indicator and log-ratio (for ppo_kl = mean(old - new)).
    ratio = exp(clamp(logp - old, -20, 20)); loss = max(-ratio A, -clamp(ratio, 1-eps, 1+eps_high) A)."""
    log_ratio = (logp - old_logp).clamp(-20, 20)
    ratio = log_ratio.exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    return loss, (clipped > unclipped).float(), old_logp - logp
