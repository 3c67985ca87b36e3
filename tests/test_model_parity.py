"""glmkit's train and rollout paths against the transformers reference (fp32, CPU).

Tolerance: relative RMS ||ref - ours|| / ||ref|| < 5e-5 and max |diff| < 5e-4 * max|ref| on logits.
Both sides compute the same fp32 math in a different order (packed vs padded, chunk sizes, absorbed
vs expanded attention), so they agree to fp32 rounding amplified through the layers: typically
rel RMS ~3e-6. The delta rule's triangular solve amplifies rounding; the reference itself moves a
kpool-8 logit by 1.5e-4 (rel RMS ~1.5e-5) between a left-padded and an unpadded run of the same
sequence, so the bound sits just above that floor. A wrong formula or a dropped key moves logits by >1e-2.
"""

from __future__ import annotations

import pytest
import torch

from glmkit.model import RolloutEngine, SamplingParams, TrainPath, load_model
from glmkit.reference import load_reference, reference_decode_logits, reference_logits

REL_RMS = 5e-5
MAX_ABS_FRACTION = 5e-4


def assert_close(ref: torch.Tensor, ours: torch.Tensor, what: str):
    rel = ((ref - ours).norm() / ref.norm()).item()
    max_abs = (ref - ours).abs().max().item()
    assert rel < REL_RMS and max_abs < MAX_ABS_FRACTION * ref.abs().max().item(), \
        f"{what}: rel RMS {rel:.2e}, max |diff| {max_abs:.2e} (max |ref| {ref.abs().max().item():.2f})"


def prompts_for(config, seed=0):
    """Three prompts of different lengths, the longest well past index_topk + kpool so the sparse
    selection drops keys, the shortest below one pool so only the tail is visible at first."""
    g = torch.Generator().manual_seed(seed)
    span = config.index_topk + config.index_kpool
    lengths = [3 * span + 5, span + 1, config.index_kpool - 1 if config.index_kpool > 1 else 2]
    return [torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def paths(ref_ckpt):
    name, path = ref_ckpt
    ref = load_reference(path)
    model = load_model(path)
    return name, ref, model


def test_train_path_matches_reference_with_left_padding(paths):
    name, ref, model = paths
    prompts = prompts_for(model.config)
    expected = reference_logits(ref, prompts)  # left-padded batch
    dropped = []

    def record(layer, site, value):
        if site == "indexer_topk":
            dropped.append(value)

    out = TrainPath(model).forward(prompts, return_logits=True, record=record)
    for i, (start, end) in enumerate(out.packed.bounds()):
        assert_close(expected[i], out.logits[start:end], f"{name} train path, sequence {i}")
    # the longest prompt's last query sees more tokens than the selection holds: keys were dropped
    topk = dropped[0]
    last = out.packed.bounds()[0][1] - 1
    assert (topk[last] >= 0).sum().item() < len(prompts[0])


def test_rollout_prefill_and_decode_match_reference(paths):
    name, ref, model = paths
    prompts = prompts_for(model.config, seed=1)
    steps = 2 * model.config.index_kpool + 3  # crosses pool boundaries while decoding
    feed = torch.randint(3, model.config.vocab_size, (len(prompts), steps), generator=torch.Generator().manual_seed(2))
    ref_first, ref_steps = reference_decode_logits(ref, prompts, feed)
    ref_full = reference_logits(ref, prompts)

    engine = RolloutEngine(model)
    batch, prefill_all = engine.prefill(prompts, capacity=max(map(len, prompts)) + steps, all_logits=True)
    for i, (start, end) in enumerate(zip(batch.lengths.cumsum(0) - batch.lengths, batch.lengths.cumsum(0))):
        assert_close(ref_full[i], prefill_all[start:end], f"{name} rollout prefill, sequence {i}")
    assert_close(ref_first, prefill_all[batch.lengths.cumsum(0) - 1], f"{name} prefill last token")
    for s in range(steps):
        logits = engine.step(batch, feed[:, s])
        assert_close(ref_steps[:, s], logits, f"{name} decode step {s}")


def test_rollout_decode_never_calls_kv_b_proj(paths):
    _, _, model = paths
    calls = []
    hooks = [layer.self_attn.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
             for layer in model.layers if layer.kind == "dsa"]
    try:
        engine = RolloutEngine(model)
        engine.generate(prompts_for(model.config), SamplingParams(temperature=0, max_new_tokens=3))
        assert calls == []
        # neither does the train path: every DSA backend reads kv_b_proj.weight directly (absorbed,
        # or expanded by the reference), which is why an adapter on it could never run
        for dsa in ("absorbed", "naive"):
            TrainPath(model, f"dsa={dsa}").forward(prompts_for(model.config)[:1])
        assert calls == []
    finally:
        for h in hooks:
            h.remove()


def test_train_path_reproduces_rollout_logprobs(paths):
    name, _, model = paths
    prompts = prompts_for(model.config, seed=3)
    new = 12
    completions = RolloutEngine(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=new))
    full = [c.prompt + c.tokens for c in completions]
    out = TrainPath(model).forward(full)
    worst = 0.0
    for c, (start, end) in zip(completions, out.packed.bounds()):
        # logprob of generated token j sits at the position before it
        train_lp = out.logprobs[start + len(c.prompt) - 1:end - 1]
        diff = (train_lp - torch.tensor(c.logprobs)).abs().max().item()
        worst = max(worst, diff)
    print(f"{name}: train vs rollout log-prob max |diff| over {new} greedy tokens = {worst:.2e}")
    assert worst < 1e-4, f"{name}: train vs rollout log-prob max |diff| {worst:.2e}"
