"""GRPO loss math, with the recipe framework's definitions (per response token; default reduction =
mean over samples of each sample's token mean)."""

from __future__ import annotations

import math

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


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


def ppo_clip_loss(logp, old_logp, advantages, eps_clip: float = 0.2, eps_clip_high: float = 0.28,
                  eps_clip_c: float | None = None):
    """Per-token PPO-clip loss, clipped indicator and log-ratio (for ppo_kl = mean(old - new)).
    ratio = exp(clamp(logp - old, -20, 20)); loss = max(-ratio A, -clamp(ratio, 1-eps, 1+eps_high) A).
    `eps_clip_c` (dual-clip PPO, > 1): where A < 0 the loss is at most -eps_clip_c A."""
    log_ratio = (logp - old_logp).clamp(-20, 20)
    ratio = log_ratio.exp()
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, (clipped > unclipped).float(), old_logp - logp


def tis_weights(old_logp, rollout_logp, clip: float, clip_low: float = 0.0):
    """Truncated importance sampling (the framework's `--use-tis`): per token the trainer/rollout ratio
    exp(old - rollout), its weight clamp(ratio, clip_low, clip), and whether the clamp moved it.
    -> (ratio, weight, clipped)."""
    ratio = torch.exp(old_logp.float() - rollout_logp.float())
    weight = ratio.clamp(min=clip_low, max=clip)
    return ratio, weight, (weight != ratio).float()


def ess_ratio_per_sample(log_ratio, mask, sample_of, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective sample size ratio of each sample's importance weights w = exp(logp - old) over its
    masked tokens: (sum w)^2 / (n sum w^2), 1 on policy; and each sample's token count n (at least 1).
    `log_ratio` = logp - old_logp (clamped to +-20 as the ratio is)."""
    w = log_ratio.detach().float().clamp(-20, 20).exp() * mask.float()
    zeros = torch.zeros(num_samples, dtype=torch.float32, device=w.device)
    sum_w, sum_w2 = zeros.index_add(0, sample_of, w), zeros.index_add(0, sample_of, w * w)
    n = zeros.index_add(0, sample_of, mask.float()).clamp(min=1)
    return sum_w * sum_w / (n * sum_w2.clamp(min=1e-8)), n


def scheduled_lr(step: int, lr: float, style: str, warmup: int = 0, decay_steps: int | None = None,
                 min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (0 = the first), as Megatron's scheduler gives it:
    a linear warmup from 0 over `warmup` steps (step 0 of a warmup runs at lr 0), then `constant`, or
    a `linear` / `cosine` decay to `min_lr` at `decay_steps` (min_lr after it)."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if style == "constant":
        return lr
    if decay_steps is None or step > decay_steps:
        return min_lr
    ratio = (step - warmup) / max(1, decay_steps - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown --lr-decay-style {style!r}; allowed: {', '.join(LR_DECAY_STYLES)}")
    return min_lr + coeff * (lr - min_lr)


def statistics(values: torch.Tensor) -> dict:
    """mean, median, max and min of a 1-D tensor (numpy's median: the mean of the middle two)."""
    import numpy as np

    array = values.double().numpy()
    return {"mean": float(array.mean()), "median": float(np.median(array)), "max": float(array.max()),
            "min": float(array.min())}


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> dict:
    """The framework's zero_std metrics: per reward value (rounded to 0.1), how many prompt groups gave
    every sample that same reward (no learning signal), `zero_std/count_<r>`; and those all 0 and all 1
    as fractions of the groups."""
    groups = rewards.float().view(-1, group_size)
    counts: dict[str, int] = {}
    for row in groups.tolist():
        if all(r == row[0] for r in row):
            key = str(round(row[0], 1))
            counts[key] = counts.get(key, 0) + 1
    out = {f"zero_std/count_{key}": count for key, count in counts.items()}
    out["zero_std/all_zero_percentage"] = counts.get("0.0", 0) / len(groups)
    out["zero_std/all_one_percentage"] = counts.get("1.0", 0) / len(groups)
    return out


REPETITION_WINDOW, REPETITION_RATIO = 10000, 10  # the last 10k characters compressing more than 10x


def has_repetition(text: str) -> bool:
    """A response whose last REPETITION_WINDOW characters zlib-compress more than REPETITION_RATIO
    times (the framework's repetition flag; shorter responses never count)."""
    import zlib

    if len(text) <= REPETITION_WINDOW:
        return False
    raw = text[-REPETITION_WINDOW:].encode("utf-8")
    return len(raw) / len(zlib.compress(raw, 9)) > REPETITION_RATIO


def pass_at_k(rewards: list, group_size: int) -> dict:
    """pass@k for k = 1, 2, 4, ... up to `group_size` over consecutive groups of `group_size` samples of
    one prompt, a sample passing when its reward is 1: the unbiased estimator 1 - C(n - c, k) / C(n, k)
    averaged over prompts (the framework's --log-passrate). Empty for groups of one."""
    if group_size <= 1:
        return {}
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    out = {}
    k = 1
    while k <= group_size:
        total = 0.0
        for g in groups:
            n, c = len(g), sum(1 for r in g if r == 1)
            total += 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
        out[f"pass@{k}"] = total / len(groups)
        k *= 2
    return out
