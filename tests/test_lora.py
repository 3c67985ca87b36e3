"""Native LoRA: the recipe's table exactly, frozen projections refused with the reason, only adapters train."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from glmkit.config import variant_config
from glmkit.model import Glm5Model, TrainPath
from glmkit.rl import lora


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = Glm5Model(variant_config("tiny"))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m


def test_selection_is_exactly_the_recipe_table(model):
    names = lora.select(model, "attn,mlp")
    kda = {n.split(".", 2)[2] for n in names if n.startswith("layers.0.")}
    assert kda == {f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj",
                                              "f_b_proj", "g_a_proj", "g_b_proj")} | \
        {f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    dsa = {n.split(".", 2)[2] for n in names if n.startswith("layers.3.")}
    assert dsa == {f"self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")} | \
        {f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")}


@pytest.mark.parametrize("targets, excludes, why", [
    ("attn,mlp", "*.mlp.experts.*", "kv_b_proj is absorbed"),
    ("attn,mlp", "*.self_attn.kv_b_proj", "no per-expert adapter"),
    ("kv_b_proj", "", "never runs as a module"),
    ("wq_b", "", "indexer is not a LoRA target"),
    ("q_conv1d", "", "short convolutions are not LoRA targets"),
    ("*.self_attn.forget_gate.f_a_proj,*.mlp.gate", "", "router"),
])
def test_frozen_projections_fail_validation(model, targets, excludes, why):
    with pytest.raises(ValueError, match=why):
        lora.select(model, targets, excludes)


def test_recipe_alias_names_select_the_forget_gate(model):
    assert lora.select(model, "*.self_attn.forget_gate.f_a_proj", "") == [f"layers.{i}.self_attn.f_a_proj"
                                                                         for i in range(3)]


def test_only_adapters_train_and_start_as_identity(model):
    seqs = [list(range(3, 30))]
    before = TrainPath(model).forward(seqs).logprobs.detach()
    names = lora.apply_lora(model, lora.select(model, "attn,mlp"), rank=4, alpha=8)
    after = TrainPath(model).forward(seqs)
    assert torch.equal(before, after.logprobs.detach())  # lora_B starts at zero
    after.logprobs.sum().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{ab}" for n in names for ab in ("lora_A", "lora_B")}
    assert all(p.grad is not None for n, p in model.named_parameters() if n.endswith("lora_B"))
    # base names are unchanged, so checkpoints and weight syncs of the base are unaffected
    assert "layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())


def test_cli_prepare_lists_targets_and_refuses_frozen():
    ok = subprocess.run([sys.executable, "-m", "glmkit", "lora", "prepare", "--model-name", "GLM-5.3-Flash-4layer"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "43 projections adapted" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "glmkit", "lora", "prepare", "--model-name", "GLM-5.3-Flash-4layer",
                          "--exclude-modules", "*.mlp.experts.*"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "kv_b_proj is absorbed" in bad.stderr


def test_a_rank_no_adapted_projection_can_use_is_refused(model):
    """Hostile pass 12: --lora-rank 65536 on tiny (projections at most 64 wide on their smaller side)
    made 336M trainable parameters and took 7.7 GB. A rank up to the widest smaller side is taken."""
    names = lora.select(model, "attn,mlp")
    widest = max(min(m.in_features, m.out_features) for n, m in model.named_modules() if n in names)
    with pytest.raises(ValueError, match=rf"--lora-rank 65536: above every adapted projection's smaller side "
                                         rf"\(the largest is {widest}\); use a rank of at most {widest}"):
        lora.apply_lora(model, names, 65536, 32.0)
    assert all(p.requires_grad for p in model.parameters())  # refused before anything was frozen
    assert lora.apply_lora(model, names, widest, 32.0) == names
    bad = subprocess.run([sys.executable, "-m", "glmkit", "lora", "prepare", "--model-name", "GLM-5.3-Flash-4layer",
                          "--lora-rank", "65536"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--lora-rank 65536: above every adapted projection's smaller side" in bad.stderr
