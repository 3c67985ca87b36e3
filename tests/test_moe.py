"""Stacked routed experts: per-expert checkpoint names kept on save and load, the "loop" path against a
per-token reference, the "grouped" path (torch._grouped_mm) against "loop", and routing replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from glmkit.comparison import rel_rms
from glmkit.checkpoint import open_checkpoint
from glmkit.config import variant_config
from glmkit.model import Glm5Model, cast_model, load_model, save_model
from glmkit.model.mlp import MLP
from glmkit.model.moe import MoE, Router
from glmkit.parity.streaming import _glmkit_block

CONFIG = variant_config("tiny")
E, D, I = CONFIG.n_routed_experts, CONFIG.hidden_size, CONFIG.moe_intermediate_size
MOE_LAYER = CONFIG.mlp_layer_types.index("sparse")
GRAD_NAMES = ("x", "gate_up_proj", "down_proj", "router")

# torch 2.13 runs _grouped_mm eagerly on CPU too, in bf16 and fp32; its docs and meta kernel (torch.compile)
# accept bf16 only, the one dtype "auto" hands it on CUDA
GROUPED_CASES = [pytest.param("cpu", torch.float32, id="cpu-fp32"), pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
                 pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=pytest.mark.skipif(
                     not torch.cuda.is_available(), reason="needs a CUDA device"))]


def random_moe(seed=0, std=0.3):
    torch.manual_seed(seed)
    moe = MoE(CONFIG)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(std=std)
        moe.gate.e_score_correction_bias.normal_(std=0.1)
    return moe


def in_dtype(moe, dtype):
    """The experts in `dtype`, the router in fp32: as cast_model leaves an MoE layer of a model."""
    moe.experts.to(dtype), moe.shared_experts.to(dtype)
    return moe


def per_expert_layout():
    """The module tree MoE had before the experts were stacked: one MLP per expert."""
    old = nn.Module()
    old.gate = Router(D, E, CONFIG.num_experts_per_tok, CONFIG.routed_scaling_factor, CONFIG.norm_topk_prob)
    old.experts = nn.ModuleList(MLP(D, I, CONFIG.swiglu_limit) for _ in range(E))
    old.shared_experts = MLP(D, I * CONFIG.n_shared_experts, CONFIG.swiglu_limit)
    return old


def run(moe, x, impl, experts=None):
    """-> (out, routing, {name: grad}) of one forward and a backward of a fixed random projection."""
    moe.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, routing = moe(x, experts, impl=impl)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    (out.float() * probe.float()).sum().backward()
    grads = dict(zip(GRAD_NAMES, (x.grad, moe.experts.gate_up_proj.grad, moe.experts.down_proj.grad,
                                  moe.gate.weight.grad)))
    return out.detach(), routing, grads


def rel(a, b):
    return rel_rms(b, a)  # b is the reference


def test_state_dict_names_and_order_are_the_per_expert_layout():
    moe = random_moe()
    state = moe.state_dict()
    assert list(state) == list(per_expert_layout().state_dict())
    assert [n for n, _ in moe.experts.named_parameters()] == ["gate_up_proj", "down_proj"]
    assert moe.experts.gate_up_proj.shape == (E, 2 * I, D) and moe.experts.down_proj.shape == (E, D, I)
    for e in (0, E - 1):
        assert torch.equal(state[f"experts.{e}.gate_proj.weight"], moe.experts.gate_up_proj[e, :I])
        assert torch.equal(state[f"experts.{e}.up_proj.weight"], moe.experts.gate_up_proj[e, I:])
        assert torch.equal(state[f"experts.{e}.down_proj.weight"], moe.experts.down_proj[e])
    # saved as views of the stacks: no copy of the experts, and detached like any state dict
    assert state["experts.1.up_proj.weight"].untyped_storage().data_ptr() == \
        moe.experts.gate_up_proj.untyped_storage().data_ptr()
    assert not state["experts.1.up_proj.weight"].requires_grad


def test_loads_the_per_expert_layout():
    old = per_expert_layout()
    torch.manual_seed(3)
    for p in old.parameters():
        nn.init.normal_(p)
    moe = MoE(CONFIG)
    moe.load_state_dict(old.state_dict(), strict=True)
    x = torch.randn(5, D)
    for e in range(E):
        assert torch.equal(moe.experts.expert(e, x), old.experts[e](x))


def test_model_round_trip_and_meta_loading(tmp_path):
    torch.manual_seed(0)
    model = Glm5Model(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)
    save_model(model, tmp_path / "ckpt")
    ckpt = open_checkpoint(tmp_path / "ckpt")
    assert f"model.language_model.layers.{MOE_LAYER}.mlp.experts.{E - 1}.down_proj.weight" in ckpt.text_keys()
    loaded = load_model(tmp_path / "ckpt")  # meta device, to_empty, load_state_dict
    want, got = model.state_dict(), loaded.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    # bf16: the stacks are cast like the per-expert weights were; the router stays fp32
    half = load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    mlp = half.layers[MOE_LAYER].mlp
    assert mlp.experts.gate_up_proj.dtype == torch.bfloat16 and mlp.gate.weight.dtype == torch.float32
    assert torch.equal(mlp.experts.down_proj, model.layers[MOE_LAYER].mlp.experts.down_proj.bfloat16())
    assert cast_model(loaded, torch.bfloat16).layers[MOE_LAYER].mlp.experts.down_proj.dtype == torch.bfloat16
    # streaming parity builds one block from one layer's on-disk tensors (strict)
    block = _glmkit_block(ckpt.config, MOE_LAYER, ckpt.layer(MOE_LAYER), torch.float32, "cpu")
    assert torch.equal(block.mlp.experts.gate_up_proj, model.layers[MOE_LAYER].mlp.experts.gate_up_proj)


def test_wrong_shape_names_the_key_and_both_shapes():
    moe = MoE(CONFIG)
    state = moe.state_dict()
    state["experts.2.up_proj.weight"] = torch.zeros(I + 1, D)
    with pytest.raises(RuntimeError) as err:
        moe.load_state_dict(state)
    message = str(err.value)
    assert "experts.2.up_proj.weight" in message
    assert str((I + 1, D)) in message and str((I, D)) in message


def test_missing_and_unexpected_expert_keys_are_reported():
    moe = MoE(CONFIG)
    state = dict(random_moe().state_dict())
    del state["experts.5.down_proj.weight"]
    state[f"experts.{E}.gate_proj.weight"] = torch.zeros(I, D)
    state["experts.gate_up_proj"] = torch.zeros(E, 2 * I, D)  # transformers' in-memory name is not ours
    result = moe.load_state_dict(state, strict=False)
    assert result.missing_keys == ["experts.5.down_proj.weight"]
    assert sorted(result.unexpected_keys) == ["experts.8.gate_proj.weight", "experts.gate_up_proj"]
    # everything present was still loaded
    assert torch.equal(moe.experts.gate_up_proj[5, I:], state["experts.5.up_proj.weight"])
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "experts.5.down_proj.weight"'):
        moe.load_state_dict(state)


def test_assign_loading_is_refused():
    moe = MoE(CONFIG)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) is not supported"):
        moe.load_state_dict(moe.state_dict(), assign=True)


def test_loop_equals_per_token_reference():
    """The loop path against the per-expert MLPs loaded from the same state dict, token by token."""
    moe = random_moe()
    reference = per_expert_layout()
    reference.load_state_dict(moe.state_dict())
    x = torch.randn(33, D)
    with torch.no_grad():
        out, routing = moe(x, impl="loop")
        want = moe.shared_experts(x).clone()
        for t in range(len(x)):
            for e, w in zip(routing.experts[t].tolist(), routing.weights[t]):
                want[t] += w * reference.experts[e](x[t])
    assert rel(out, want) < 1e-6
    assert routing.experts.shape == (33, CONFIG.num_experts_per_tok)
    # "auto" on CPU is the loop, bit for bit
    assert torch.equal(moe(x)[0], out)


@pytest.mark.parametrize("device, dtype", GROUPED_CASES)
@pytest.mark.parametrize("tokens", [1, 33, 300])
def test_grouped_equals_loop(device, dtype, tokens):
    """Forward and gradients (x, both stacks, router). fp32: 1e-5 relative (same products, only the
    blocking of the GEMMs and the order of the k-sum differ). bf16: 2e-2 (the loop rounds every
    expert's weighted output to bf16 and accumulates in bf16, the grouped path sums the k outputs in
    fp32 and rounds once: a few bf16 ulps of 2^-8)."""
    moe = in_dtype(random_moe(), dtype).to(device)
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    out_loop, routing_loop, grads_loop = run(moe, x, "loop")
    out_grouped, routing_grouped, grads_grouped = run(moe, x, "grouped")
    assert torch.equal(routing_loop.experts, routing_grouped.experts)
    assert out_grouped.dtype == dtype and rel(out_grouped, out_loop) < tol
    for name in GRAD_NAMES:
        assert torch.isfinite(grads_grouped[name]).all(), name
        assert rel(grads_grouped[name], grads_loop[name]) < tol, name
    # experts no token chose get exactly zero gradient (padding rows and unused rows contribute nothing)
    unrouted = torch.ones(E, dtype=torch.bool, device=device)
    unrouted[routing_grouped.experts.unique()] = False
    for name in ("gate_up_proj", "down_proj"):
        assert (grads_grouped[name][unrouted] == 0).all()
    # no atomics anywhere: a second run is bitwise identical
    out_again, _, grads_again = run(moe, x, "grouped")
    assert torch.equal(out_again, out_grouped)
    assert all(torch.equal(grads_again[n], grads_grouped[n]) for n in GRAD_NAMES)


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_replay_uses_the_given_experts(impl):
    moe = random_moe()
    x = torch.randn(20, D)
    forced = torch.zeros(20, CONFIG.num_experts_per_tok, dtype=torch.long)
    forced[:, 1] = 1
    forced[3] = -1  # this row is left to the router
    with torch.no_grad():
        out, routing = moe(x, forced, impl=impl)
        _, chosen = moe(x[3:4])
    assert torch.equal(routing.experts[forced[:, 0] >= 0], forced[forced[:, 0] >= 0])
    assert torch.equal(routing.experts[3], chosen.experts[0])
    with torch.no_grad():
        other, _ = moe(x, routing.experts, impl="grouped" if impl == "loop" else "loop")
    assert rel(out, other) < 1e-6


def test_auto_never_picks_grouped_on_cpu(monkeypatch):
    moe = in_dtype(random_moe(), torch.bfloat16)

    def refuse(*args, **kwargs):
        raise AssertionError("auto chose _grouped_mm on CPU")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    out, _ = moe(torch.randn(9, D, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl='fast'; allowed: auto, loop, grouped"):
        MoE(CONFIG)(torch.randn(3, D), impl="fast")
