"""Per-component checks: absorbed vs expanded DSA, mHC Sinkhorn, MoE grouping, autograd, sampling."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from glmkit.config import variant_config
from glmkit.model import RolloutEngine, SamplingParams, TrainPath, cast_model, load_model, pack, save_model
from glmkit.model import dsa, mhc
from glmkit.model.dsa import SparseMLA, compact_selection
from glmkit.model.moe import MoE
from glmkit.model.packed import Packed


def randomize(module, std=0.3, seed=0):
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=std)
    return module


def test_absorbed_dsa_equals_expanded():
    """Folding kv_b into the query and output is exact algebra: fp32 agreement to 1e-5 relative."""
    layer = randomize(SparseMLA(variant_config("tiny"), shared_indexer=False))
    x = torch.randn(70, 64)
    packed = Packed.from_lengths([40, 30])
    with torch.no_grad():
        expanded, topk_e = layer.forward_packed(x, packed, absorbed=False)
        absorbed, topk_a = layer.forward_packed(x, packed, absorbed=True)
    assert torch.equal(topk_e, topk_a)
    assert ((expanded - absorbed).norm() / expanded.norm()).item() < 1e-5
    # selection stays inside each sequence and is causal
    pos = packed.positions
    valid = topk_e >= 0
    assert (packed.seq_index[topk_e.clamp(min=0)] == packed.seq_index[:, None])[valid].all()
    assert (topk_e <= torch.arange(70)[:, None])[valid].all()
    # every query sees min(visible, topk + tail) keys
    width = (valid).sum(-1)
    assert (width <= pos + 1).all() and (width[pos + 1 > 12] < (pos + 1)[pos + 1 > 12]).all()


def test_compact_selection_keeps_each_rows_ids_in_order():
    idx = torch.tensor([[5, -1, 3, -1, -1, 7], [-1, -1, 2, -1, -1, -1], [0, 1, -1, -1, 4, -1]])
    assert compact_selection(idx).tolist() == [[5, 3, 7], [2, -1, -1], [0, 1, 4]]


def test_dsa_recomputed_blocks_give_the_plain_gradients(monkeypatch):
    """Training runs each query block under activation checkpointing (the gathered keys and values
    are rebuilt in the backward). One query row per block, checkpointed, must give the output and
    gradients of one plain block kept for the backward: fp32 agreement to 1e-6 relative (only the
    block boundaries change the matmul shapes)."""
    layer = randomize(SparseMLA(variant_config("tiny"), shared_indexer=False))
    x = torch.randn(70, 64)
    packed = Packed.from_lengths([40, 30])
    calls = []

    def run():
        layer.zero_grad(set_to_none=True)
        out, _ = layer.forward_packed(x, packed)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}

    with monkeypatch.context() as m:
        m.setattr(dsa, "checkpoint", lambda fn, *args, **kwargs: fn(*args))  # plain autograd
        plain, grads = run()
    monkeypatch.setattr(dsa, "_GATHER_BUDGET", 1)
    monkeypatch.setattr(dsa, "checkpoint", lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    blocks, block_grads = run()
    assert len(calls) == 70  # one checkpointed block per query row
    assert ((plain - blocks).norm() / plain.norm()).item() < 1e-6
    assert grads.keys() == block_grads.keys() and "kv_b_proj.weight" in grads
    for name, g in grads.items():
        assert ((g - block_grads[name]).norm() / g.norm()).item() < 1e-6, name


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


def test_moe_grouped_equals_per_token_loop():
    config = variant_config("tiny")
    moe = randomize(MoE(config))
    with torch.no_grad():
        moe.gate.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(33, config.hidden_size)
    with torch.no_grad():
        out, routing = moe(x)
        want = moe.shared_experts(x).clone()
        for t in range(len(x)):
            for e, w in zip(routing.experts[t].tolist(), routing.weights[t]):
                want[t] += w * moe.experts[e](x[t])
    assert ((out - want).norm() / want.norm()).item() < 1e-6
    assert routing.experts.shape == (33, config.num_experts_per_tok)
    # replaying a routing uses exactly those experts
    forced = torch.zeros_like(routing.experts)
    forced[:, 1] = 1
    _, replayed = moe(x, forced)
    assert torch.equal(replayed.experts, forced)


def test_train_path_backward_reaches_every_trained_weight(tiny_ckpt):
    model = load_model(tiny_ckpt)
    out = TrainPath(model).forward([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22]])
    (-out.logprobs.sum()).backward()
    routed = {f"layers.{layer}.mlp.experts.{e}." for layer, experts in out.routing.items()
              for e in experts.unique().tolist()}
    unrouted = lambda n: ".mlp.experts." in n and not any(n.startswith(r) for r in routed)  # noqa: E731
    missing = [n for n, p in model.named_parameters() if p.grad is None and ".indexer." not in n and not unrouted(n)]
    assert missing == [], f"no gradient reached: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # the indexer's discrete selection carries no gradient, as in the reference
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n or unrouted(n))


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
