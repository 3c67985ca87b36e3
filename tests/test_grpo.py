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


# ---------------------------------------------------------------- the launchers' settings (issue 35)
# Each against a hand computation from the framework's formula (miles 31f1ca961: loss_hub/math_utils.py
# compute_policy_loss and compute_ess_ratio_contribution, loss_hub/corrections.py vanilla_tis_function,
# cp_utils.get_sum_of_sample_mean; Megatron's OptimizerParamScheduler and param groups).

def test_dual_clip_bounds_the_loss_of_negative_advantages():
    logp = torch.log(torch.tensor([5.0, 5.0, 1.1, 0.5]))
    old = torch.zeros(4)
    adv = torch.tensor([-1.0, 1.0, -2.0, -1.0])
    loss, _, _ = grpo.ppo_clip_loss(logp, old, adv, 0.2, 0.28, eps_clip_c=3.0)
    # ratio 5, A=-1: PPO max(5, 1.28) = 5, dual clip min(5, 3) = 3; A>0 untouched: -min(5, 1.28) = -1.28
    # ratio 1.1, A=-2: max(2.2, 2.2) = 2.2 < 3 * 2 = 6 stays; ratio 0.5, A=-1: max(0.5, 0.8) = 0.8
    assert loss.tolist() == pytest.approx([3.0, -1.28, 2.2, 0.8], abs=1e-6)
    plain, _, _ = grpo.ppo_clip_loss(logp, old, adv, 0.2, 0.28)
    assert plain[0].item() == pytest.approx(5.0)


def test_tis_weights_clamp_the_trainer_rollout_ratio():
    old = torch.log(torch.tensor([1.0, 3.0, 0.5, 1.5]))
    rollout = torch.zeros(4)
    ratio, weight, clipped = grpo.tis_weights(old, rollout, clip=2.0, clip_low=0.6)
    assert ratio.tolist() == pytest.approx([1.0, 3.0, 0.5, 1.5])
    assert weight.tolist() == pytest.approx([1.0, 2.0, 0.6, 1.5])
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_ess_ratio_of_each_sample():
    # sample 0: weights 1, 1 -> (2)^2 / (2 * 2) = 1; sample 1: weights 2, 0.5, 1 (masked last) over 2 tokens:
    # (2.5)^2 / (2 * 4.25) = 0.7353
    log_ratio = torch.log(torch.tensor([1.0, 1.0, 2.0, 0.5, 1.0]))
    mask = torch.tensor([1, 1, 1, 1, 0])
    sample_of = torch.tensor([0, 0, 1, 1, 1])
    ess, n = grpo.ess_ratio_per_sample(log_ratio, mask, sample_of, 2)
    assert ess.tolist() == pytest.approx([1.0, 2.5 ** 2 / (2 * 4.25)]) and n.tolist() == [2.0, 2.0]


def test_megatron_schedule_with_warmup_and_each_decay_style():
    lr, min_lr = 1e-3, 1e-4
    assert grpo.scheduled_lr(0, lr, "constant") == lr and grpo.scheduled_lr(99, lr, "constant") == lr
    # warmup over 4 steps from 0: step 0 runs at 0, step 2 at half, step 4 at the full lr
    assert [grpo.scheduled_lr(s, lr, "constant", warmup=4) for s in (0, 2, 4, 5)] == pytest.approx([0, 5e-4, lr, lr])
    # linear from step 4 to 14: at step 9 half way between lr and min_lr; past 14: min_lr
    assert grpo.scheduled_lr(9, lr, "linear", 4, 14, min_lr) == pytest.approx(min_lr + 0.5 * (lr - min_lr))
    assert grpo.scheduled_lr(15, lr, "linear", 4, 14, min_lr) == min_lr
    # cosine: 0.5 (cos(pi r) + 1); at r = 1/4 that is 0.8536
    coeff = 0.5 * (math.cos(math.pi * 0.25) + 1)
    assert grpo.scheduled_lr(6, lr, "cosine", 4, 12, min_lr) == pytest.approx(min_lr + coeff * (lr - min_lr))
    with pytest.raises(ValueError, match="allowed: constant, linear, cosine"):
        grpo.scheduled_lr(1, lr, "step", 0, 10)


def test_adam_with_decoupled_weight_decay_on_matrices_only():
    """One step of the trainer's optimizer against AdamW written out: m = (1-b1) g, v = (1-b2) g^2,
    p -= lr (m / (1-b1)) / (sqrt(v / (1-b2)) + eps) + lr wd p on matrices; biases and 1-D parameters
    get no weight decay (Megatron's rule)."""
    from glmkit.rl.loop import TrainConfig, build_optimizer

    model = torch.nn.Linear(3, 2)
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(2)))
    cfg = TrainConfig(lr=0.1, adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-8, weight_decay=0.1)
    opt = build_optimizer(cfg, model)
    assert [len(g["params"]) for g in opt.param_groups] == [1, 2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    for n, p in model.named_parameters():
        g, w = grads[n], before[n]
        m_hat, v_hat = (0.1 * g) / 0.1, (0.02 * g * g) / 0.02
        wd = 0.1 if n == "weight" else 0.0
        want = w * (1 - 0.1 * wd) - 0.1 * m_hat / (v_hat.sqrt() + 1e-8)
        assert torch.allclose(p.detach(), want, atol=1e-6), n


def test_the_frameworks_rollout_statistics():
    """zero_std, response_len and repetition as the framework's rollout manager defines them
    (miles/ray/rollout/metrics.py, utils/metric_utils.py at 31f1ca961)."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    assert grpo.zero_std_groups(rewards, 4) == {"zero_std/count_1.0": 1, "zero_std/count_0.0": 1,
                                                "zero_std/count_0.5": 1, "zero_std/all_zero_percentage": 0.25,
                                                "zero_std/all_one_percentage": 0.25}
    assert grpo.statistics(torch.tensor([3.0, 1.0, 4.0, 10.0])) == {"mean": 4.5, "median": 3.5, "max": 10.0,
                                                                     "min": 1.0}
    assert grpo.has_repetition("ab" * 6000) and not grpo.has_repetition("ab" * 4000)  # 12k vs 8k characters
    varied = "".join(chr(0x4e00 + (i * 7919) % 20000) for i in range(12000))
    assert not grpo.has_repetition(varied)


def test_the_models_flop_count_by_hand():
    """glmkit.model.flops on the tiny variant, position by position: per token 2 x the weight products
    (routed experts at top-k / n), plus DSA's 4 H R per selected key (min(topk, p + 1) keys), its
    indexer's 2 heads x dim per pool (ceil((p + 1) / kpool) pools) and KDA's per-token state terms."""
    from glmkit.config import variant_config
    from glmkit.model.flops import KDA_CHUNK, matmul_params_per_token, forward_flops, peak_bf16_tflops
    from glmkit.model.model import Glm5Model

    c = variant_config("tiny")
    with torch.device("meta"):
        params = dict(Glm5Model(c).named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    matrices = sum(p.numel() for n, p in params.items() if p.dim() >= 2 and not n.startswith("embed_tokens."))
    assert matmul_params_per_token(c) == matrices - experts + experts * c.num_experts_per_tok / c.n_routed_experts
    L = 10
    selected = sum(min(c.index_topk, p + 1) for p in range(L))
    pools = sum(math.ceil((p + 1) / c.index_kpool) for p in range(L))
    kda = c.layer_types.count("linear_attention")
    dsa = len(c.layer_types) - kda  # tiny: 3 KDA layers and one DSA layer with its own (full) indexer
    d = c.linear_head_dim
    want = (2 * matmul_params_per_token(c) * L + dsa * 4 * c.num_attention_heads * c.kv_lora_rank * selected
            + dsa * 2 * c.index_n_heads * c.index_head_dim * pools
            + kda * L * c.linear_num_heads * (4 * d * d + 2 * KDA_CHUNK * 2 * d))
    assert forward_flops(c, [L]) == pytest.approx(want)
    assert forward_flops(c, [L, L]) == pytest.approx(2 * want)  # sequences are causal on their own
    assert (peak_bf16_tflops("NVIDIA H100 80GB HBM3"), peak_bf16_tflops("NVIDIA H100 PCIe"),
            peak_bf16_tflops("NVIDIA H200"), peak_bf16_tflops("cpu")) == (989.0, 756.0, 989.0, None)


def test_pass_at_k_is_the_unbiased_estimator():
    # one prompt 4 samples, 1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2, pass@4 = 1
    # another all wrong: 0, 0, 0 -> means 1/8, 1/4, 1/2
    assert grpo.pass_at_k([1, 0, 0, 0, 0, 0, 0, 0], 4) == pytest.approx({"pass@1": 0.125, "pass@2": 0.25, "pass@4": 0.5})
    assert grpo.pass_at_k([1, 0], 1) == {}
