"""GRPO loss math on known values (the recipe framework's definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from glmkit.rl import grpo


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0])
    adv = grpo.group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std(unbiased=True).item()
    assert adv[:4].tolist() == pytest.approx([0.5 / (std + 1e-6), -0.5 / (std + 1e-6)] * 1 + [-0.5 / (std + 1e-6),
                                              0.5 / (std + 1e-6)])
    assert adv[4:].abs().max() == 0  # equal rewards: no signal
    with pytest.raises(ValueError, match="groups of 3"):
        grpo.group_advantages(rewards, 3)


def test_ppo_clip_loss_matches_the_formula():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0, 1.4]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped, kl = grpo.ppo_clip_loss(logp, old, adv, 0.2, 0.28)
    # ratio 1.5, A>0: min(1.5, 1.28) -> loss -1.28, clipped; ratio 0.5, A>0: -0.5 (unclipped is larger)
    # ratio 1.0, A<0: 1.0; ratio 1.4, A<0: max(1.4, 1.28) = 1.4, not clipped
    assert loss.tolist() == pytest.approx([-1.28, -0.5, 1.0, 1.4])
    assert clipped.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert kl.tolist() == pytest.approx((-logp).tolist())


def test_kl_estimators():
    logp, ref = torch.tensor([0.0, math.log(2.0)]), torch.zeros(2)
    assert grpo.kl_estimate(logp, ref, "k1").tolist() == pytest.approx([0.0, math.log(2)])
    assert grpo.kl_estimate(logp, ref, "k2").tolist() == pytest.approx([0.0, math.log(2) ** 2 / 2])
    assert grpo.kl_estimate(logp, ref, "k3").tolist() == pytest.approx([0.0, 0.5 - 1 + math.log(2)])
    big = grpo.kl_estimate(torch.tensor([-50.0]), torch.zeros(1), "low_var_kl")
    assert big.item() == 10.0  # log r clamped to -20, result clamped to 10
    with pytest.raises(ValueError, match="allowed: k1, k2, k3, low_var_kl"):
        grpo.kl_estimate(logp, ref, "k4")


def test_sample_mean_is_mean_of_per_sample_means():
    values = torch.tensor([1.0, 3.0, 10.0, 0.0, 4.0])
    mask = torch.tensor([True, True, True, False, True])
    sample_of = torch.tensor([0, 0, 0, 1, 1])
    assert grpo.sample_mean(values, mask, sample_of, 2).item() == pytest.approx(((1 + 3 + 10) / 3 + 4) / 2)
