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


def assert_each_as_alone(engine, prompts, limits, got):
    """Every completion is the one its prompt gets alone, with a recorded row per fed token."""
    for prompt, limit, c in zip(prompts, limits, got):
        alone = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=limit), record_routing=True,
                                record_topk=True)[0]
        assert_same(alone, c)
        fed = len(prompt) + len(c.tokens) - 1
        assert c.routing[3].shape[0] == fed and c.topk[3].shape[0] == fed


@pytest.mark.parametrize("slots", [1, 3, 8])
def test_every_request_gets_its_completion_alone(engine, slots):
    prompts, limits = workload(7)
    got = engine.generate_continuous(prompts, SamplingParams(temperature=0, max_new_tokens=99), slots,
                                     max_new_tokens=limits, record_routing=True, record_topk=True)
    assert [len(c.tokens) for c in got] == limits  # no stop tokens: each runs to its own limit
    assert_each_as_alone(engine, prompts, limits, got)


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


@pytest.mark.parametrize("chunk, slots", [(1, 3), (5, 2), (16, 8)])
def test_prompts_prefilled_in_chunks_get_their_completion_alone(engine, monkeypatch, chunk, slots):
    """Prompts prefilled `chunk` tokens a step between decode steps (a 1-token budget feeds one
    request's prompt a token at a time; 5 splits most prompts over several steps and several
    requests in one step): every request still gets its completion alone, with its prompt's routed
    experts and DSA selections (tolerances as the module's)."""
    prompts, limits = workload(7, seed=5)
    pieces = []
    real_extend = engine.extend
    monkeypatch.setattr(engine, "extend", lambda batch, chunks, **kw: pieces.append([len(c) for c in chunks])
                        or real_extend(batch, chunks, **kw))
    got = engine.generate_continuous(prompts, SamplingParams(temperature=0, max_new_tokens=99), slots,
                                     max_new_tokens=limits, record_routing=True, record_topk=True,
                                     prefill_chunk=chunk)
    monkeypatch.undo()
    assert all(sum(p) <= chunk for p in pieces) and sum(map(sum, pieces)) == sum(map(len, prompts))
    assert len(pieces) >= sum(map(len, prompts)) / chunk
    assert_each_as_alone(engine, prompts, limits, got)


def test_extend_continues_a_prefill_as_one_prefill(engine):
    """Prefilling prompts in pieces (several requests per call, out of slot order, a one-token piece,
    the first piece from empty caches) leaves the caches and last-token logits of one prefill of the
    whole prompts: fp32, 3e-5 absolute (values O(1); other summation orders: seen <= 6e-6 on one
    machine, 1.1e-5 on another CPU; one cache row missing moves that request's logits by 6.3)."""
    from glmkit.model.rollout import _cache_tensors

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (29, 7, 18)]
    whole, want = engine.prefill(prompts, 40)
    batch = type(whole)(engine._empty_states(3, 40), torch.zeros(3, dtype=torch.long))
    cuts = [(5, 13), (3, 4), (1, 17)]
    engine.extend(batch, [p[:a] for p, (a, _) in zip(prompts, cuts)])
    engine.extend(batch, [p[a:b] for p, (a, b) in zip(prompts, cuts)][::-1], slots=[2, 1, 0])
    got = engine.extend(batch, [p[b:] for p, (_, b) in zip(prompts, cuts)])
    assert batch.lengths.tolist() == [29, 7, 18]
    torch.testing.assert_close(got, want, rtol=0, atol=3e-5)
    for a, b in zip(whole.states, batch.states):
        for x, y in zip(_cache_tensors(a), _cache_tensors(b)):
            torch.testing.assert_close(y, x, rtol=0, atol=3e-5)
    with pytest.raises(ValueError, match="cache holds 40"):
        engine.extend(batch, [[5] * 12], slots=[0])
    with pytest.raises(ValueError, match="one distinct slot"):
        engine.extend(batch, [[5], [6]], slots=[1, 1])


def test_a_request_cancelled_while_its_prompt_is_prefilled_ends_as_abort(engine):
    """Chunked joins hold their slot from the join on (free counts them); one cancelled half-way
    through its prompt ends with no tokens and finish_reason abort, and its slot is free again."""
    from glmkit.model.rollout import SlotBatch

    prompts, _ = workload(3, seed=7)
    prompts[1] = list(range(3, 40))
    cancelled = set()
    slots = SlotBatch(engine, 3, 64, SamplingParams(temperature=0, max_new_tokens=4), prefill_chunk=8,
                      cancelled=cancelled.__contains__)
    slots.join(prompts, [4, 4, 4], ["a", "b", "c"])
    assert slots.free == 0 and slots.busy
    with pytest.raises(ValueError, match="only 0 slots are free"):
        slots.join([[5]], [1], ["d"])
    slots.step()
    cancelled.add("b")
    got = {}
    while slots.busy:
        slots.step()
        got.update(slots.finished())
    assert got["b"].tokens == [] and got["b"].finish_reason == "abort"
    for tag, prompt in (("a", prompts[0]), ("c", prompts[2])):
        alone = engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4))[0]
        assert got[tag].tokens == alone.tokens
    assert slots.free == 3


def test_a_row_the_model_made_nonfinite_is_sampled_without_raising_and_its_log_prob_says_so():
    """Hostile pass 14: NaN logits in one row made torch.multinomial raise for the whole batch (exit 3
    in train). That row draws from uniform weights and its log-prob is not finite, for the trainer to
    name; the other rows are untouched (greedy: the same log-prob as alone)."""
    from glmkit.model.rollout import sample

    logits = torch.randn(4, 50)
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    logits[3, 7] = float("-inf")  # an overflow too: the server's sampler answers such a row null
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                   SamplingParams(temperature=0.0)):
        tokens, logprobs = sample(logits, params, torch.Generator().manual_seed(0))
        assert logprobs[0].isfinite() and logprobs[1:].isnan().all()
        assert tokens.shape == (4,) and 0 <= int(tokens.min()) and int(tokens.max()) < 50
        if params.temperature == 0:  # (a draw's random stream is the batch's, so only greedy compares alone)
            assert torch.equal(sample(logits[:1], params, None)[1], logprobs[:1])
