"""Continuous batching (RolloutEngine.generate_continuous) on the shipped tiny checkpoint, fp32 CPU.

Each request must get the completion it gets alone: greedy tokens, routed experts and DSA selections
equal; log-probs to 1e-4 (the same math over a batch of other rows: fp32 summation order differs,
measured <= 1.1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from glmkit.model import RolloutEngine, load_model
from glmkit.model.rollout import SamplingParams

CKPT = Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start"


@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(load_model(CKPT), "kda=torch")


def workload(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 1000, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (n,), generator=g)]
    limits = [int(k) for k in torch.randint(1, 14, (n,), generator=g)]
    return prompts, limits


def assert_same(alone, got):
    assert got.tokens == alone.tokens
    assert got.finish_reason == alone.finish_reason
    assert max(abs(a - b) for a, b in zip(alone.logprobs, got.logprobs)) < 1e-4
    for layer in alone.routing or {}:
        assert torch.equal(got.routing[layer], alone.routing[layer])
    for layer in alone.topk or {}:
        assert torch.equal(got.topk[layer], alone.topk[layer])


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_every_request_gets_its_completion_alone(engine, slots):
    prompts, limits = workload(7)
    got = engine.generate_continuous(prompts, SamplingParams(temperature=0, max_new_tokens=99), slots,
                                     max_new_tokens=limits, record_routing=True, record_topk=True)
    assert [len(c.tokens) for c in got] == limits  # no stop tokens: each runs to its own limit
    for prompt, limit, c in zip(prompts, limits, got):
        alone = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=limit), record_routing=True,
                                record_topk=True)[0]
        assert_same(alone, c)
        fed = len(prompt) + len(c.tokens) - 1
        assert c.routing[3].shape[0] == fed and c.topk[3].shape[0] == fed


def test_a_draining_batch_moves_to_a_smaller_bucket_and_keeps_every_completion(engine, monkeypatch):
    """Five slots, two long requests (slots 0 and 4) and three short ones: once two short ones leave,
    three requests fit the 4-slot bucket, so the one in slot 4 moves to slot 1 (its caches copied);
    then the steps run over 2 slots, and over 1 for the longest request's tail. Every request still
    gets its completion alone (see the module)."""
    from glmkit.model.rollout import SlotBatch

    prompts, _ = workload(5, seed=3)
    limits = [12, 2, 3, 2, 10]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    slots = SlotBatch(engine, 5, max(map(len, prompts)) + 12, params, record_routing=True, record_topk=True)
    sizes = []
    real_step = engine.step
    monkeypatch.setattr(engine, "step", lambda batch, tokens, **kw: sizes.append(len(tokens)) or real_step(batch, tokens, **kw))
    slots.join(prompts, limits, list(range(5)))
    got = {}
    while slots.busy:
        slots.step()
        got.update(slots.finished())
    assert sizes == [5, 4] + [2] * 7 + [1] * 2  # a token a step after the first (sampled at the join)
    assert slots.owner == [None] * 5 and not slots.occupied.any() and not slots.lengths.any()
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        alone = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=limit), record_routing=True,
                                record_topk=True)[0]
        assert_same(alone, got[i])


def test_graphs_asked_for_on_the_cpu_fail_clearly_and_a_failed_capture_falls_back_to_eager(engine, monkeypatch):
    """graphs=True on a CPU engine is refused with the reason; a capture that fails (e.g. a module
    reading a value back mid-step) leaves a one-line warning and the eager steps' completions."""
    from glmkit.model import rollout

    prompts, limits = workload(3, seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert not engine.can_graph()
    with pytest.raises(ValueError, match="CUDA graphs need the caches on a CUDA device"):
        engine.generate(prompts, params, graphs=True)
    want = engine.generate(prompts, params)
    want_slots = engine.generate_continuous(prompts, params, 2, max_new_tokens=limits)

    def capture_fails(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(rollout, "GraphedStep", capture_fails)
    with pytest.warns(UserWarning, match="running it eagerly: operation not permitted when stream is capturing$"):
        got = engine.generate(prompts, params, graphs=True)
    with pytest.warns(UserWarning, match="running it eagerly"):
        got_slots = engine.generate_continuous(prompts, params, 2, max_new_tokens=limits, graphs=True)
    for a, b in zip(want + want_slots, got + got_slots):
        assert a.tokens == b.tokens and a.logprobs == b.logprobs


def test_stop_tokens_free_slots_for_waiting_requests(engine):
    prompts, _ = workload(6, seed=1)
    free_run = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    stop = free_run[0].tokens[2]  # a token the first request emits third: it stops there
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,))
    got = engine.generate_continuous(prompts, params, max_batch=2)
    assert got[0].finish_reason == "stop" and got[0].tokens[-1] == stop and len(got[0].tokens) <= 3
    for prompt, c in zip(prompts, got):
        assert_same(engine.generate([prompt], params)[0], c)


def test_sampled_run_is_seeded(engine):
    prompts, limits = workload(5, seed=2)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20)
    a = engine.generate_continuous(prompts, params, 2, seed=5, max_new_tokens=limits)
    b = engine.generate_continuous(prompts, params, 2, seed=5, max_new_tokens=limits)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert all(lp <= 0 for c in a for lp in c.logprobs)


def test_bad_arguments(engine):
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        engine.generate_continuous([[5, 6]], params, 0)
    with pytest.raises(ValueError, match="one limit >= 1 per prompt"):
        engine.generate_continuous([[5, 6], [7]], params, 2, max_new_tokens=[3])
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        engine.generate_continuous([[5, 6], []], params, 2)
