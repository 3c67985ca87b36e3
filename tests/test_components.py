"""Per-component checks: mHC Sinkhorn, autograd, sampling (DSA kernels: test_dsa.py, MoE: test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from glmkit.config import variant_config
from glmkit.model import RolloutEngine, SamplingParams, TrainPath, cast_model, load_model, pack, save_model
from glmkit.model import mhc


def randomize(module, std=0.3, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module


def test_mhc_comb_is_doubly_stochastic(tiny_ckpt):
    """After the 20 Sinkhorn iterations every comb matrix of every layer (attn and ffn) has rows and
    columns summing to 1 within 1e-5."""
    model = load_model(tiny_ckpt)
    combs = []
    TrainPath(model).forward([list(range(3, 60))], record=lambda layer, site, v: combs.append(v)
                             if site.endswith("hc.comb") else None)
    assert len(combs) == 2 * model.config.num_hidden_layers
    assert max(mhc.doubly_stochastic_error(c) for c in combs) < 1e-5
    # the check can fail: a single normalisation pass leaves the rows unbalanced
    config = model.config
    g = torch.Generator().manual_seed(0)
    n, D = config.hc_mult, config.hidden_size
    streams = torch.randn(50, n, D, generator=g)
    fn = torch.randn((2 + n) * n, n * D, generator=g) * (n * D) ** -0.5
    _, _, loose = mhc.mix_weights(streams, fn, torch.zeros((2 + n) * n), torch.ones(3), 1, config.hc_eps,
                                  config.rms_norm_eps)
    assert mhc.doubly_stochastic_error(loose) > 1e-3


def test_train_path_backward_reaches_every_trained_weight(tiny_ckpt):
    model = load_model(tiny_ckpt)
    sequences = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22]]
    # replay a routing over experts 0..4 only, so that experts 5.. are surely left unrouted
    tokens = torch.arange(sum(map(len, sequences)))
    replay = {layer: torch.stack([tokens % 3, 3 + tokens % 2], dim=1)
              for layer, block in enumerate(model.layers) if block.is_moe}
    out = TrainPath(model).forward(sequences, routing=replay)
    (-out.logprobs.sum()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None and ".indexer." not in n]
    assert missing == [], f"no gradient reached: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the indexer's discrete selection carries no gradient, as in the reference
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)
    # the routed experts' weights are stacked [E, ...]: every routed expert's slice gets gradient,
    # every other expert's slice exactly none
    for layer, experts in out.routing.items():
        assert torch.equal(experts, replay[layer])
        stacks = model.layers[layer].mlp.experts
        routed = torch.zeros(stacks.num_experts, dtype=torch.bool)
        routed[experts.unique()] = True
        for grad in (stacks.gate_up_proj.grad, stacks.down_proj.grad):
            per_expert = grad.flatten(1).abs().amax(1)
            assert (per_expert[routed] > 0).all() and (per_expert[~routed] == 0).all()


def test_generate_is_seeded_and_respects_sampling_params(tiny_ckpt):
    model = load_model(tiny_ckpt)
    engine = RolloutEngine(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [30, 31], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10)
    a = engine.generate(prompts, params, seed=3)
    b = engine.generate(prompts, params, seed=3)
    c = engine.generate(prompts, params, seed=4)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert [x.tokens for x in a] != [x.tokens for x in c]
    assert all(len(x.tokens) == 10 and x.finish_reason == "length" for x in a)
    # a stop token ends that request only, and is kept
    stop = a[0].tokens[2]
    d = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10,
                                                stop_token_ids=[stop]), seed=3)
    assert d[0].tokens == a[0].tokens[:a[0].tokens.index(stop) + 1] and d[0].finish_reason == "stop"
    # tiny top_p keeps only the most likely token: sampling becomes greedy
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=6))
    nucleus = engine.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6), seed=9)
    assert [x.tokens for x in greedy] == [x.tokens for x in nucleus]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_packing_rejects_empty_sequences():
    with pytest.raises(ValueError, match="at least one token"):
        pack([[1, 2], []])


def test_unknown_variant_lists_allowed():
    with pytest.raises(ValueError, match="allowed: GLM-5.3-Flash, GLM-5.3-Flash-4layer, tiny"):
        variant_config("GLM-6")


def test_save_model_roundtrip_and_bf16_keeps_reference_fp32_tensors(tiny_ckpt, tmp_path):
    from glmkit.checkpoint import open_checkpoint

    model = load_model(tiny_ckpt)
    save_model(model, tmp_path / "again")
    a, b = open_checkpoint(tiny_ckpt), open_checkpoint(tmp_path / "again")
    assert a.text_keys() == b.text_keys()
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.text_keys())
    half = cast_model(load_model(tiny_ckpt), torch.bfloat16)
    dtypes = {n: t.dtype for n, t in list(half.named_parameters()) + list(half.named_buffers())}
    assert dtypes["layers.0.self_attn.A_log"] == torch.float32
    assert dtypes["layers.3.mlp.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["layers.0.hc_attn_scale"] == torch.float32 and dtypes["layers.0.hc_attn_fn"] == torch.bfloat16
    assert dtypes["layers.0.self_attn.q_proj.weight"] == torch.bfloat16
