"""Per-request sampling (glmkit/serve/sampling.py) on hand-made logits, each rule against a hand
computation of SGLang's definition; and the request parser's normalisation (protocol.py)."""

from __future__ import annotations

import math

import pytest
import torch

from glmkit.serve import protocol
from glmkit.serve.protocol import RequestError, parse_generate, parse_sampling
from glmkit.serve.sampling import RequestSampler, RequestState

V = 8


def state(seed=0, eos=(), **params) -> RequestState:
    return RequestState(parse_sampling(params, V), seed, eos)


def test_greedy_takes_the_argmax_and_reports_the_plain_log_softmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = RequestSampler().choose(logits, [state(temperature=0)], [[]])
    assert tokens == [1]
    assert logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]), abs=1e-6)


def test_penalties_follow_sglangs_formulas():
    """frequency: logit - f * count; presence: - p * (count > 0); repetition: positive logits / r,
    negative ones * r, on tokens already generated. Checked through the greedy choice and the
    reported log-prob (softmax of the penalised logits)."""
    base = torch.tensor([[2.0, 1.9, -1.0, -1.2, 0.0, 0.0, 0.0, 0.0]])
    sampler = RequestSampler()
    st = state(temperature=0, frequency_penalty=0.5, presence_penalty=0.2)
    assert sampler.choose(base, [st], [[]])[0] == [0]  # nothing generated yet: no penalty
    tokens, logprobs = sampler.choose(base, [st], [[0]])  # token 0 once: 2.0 - 0.5 - 0.2 = 1.3 < 1.9
    expected = base[0].clone()
    expected[0] -= 0.7
    assert tokens == [1] and logprobs[0] == pytest.approx(float(torch.log_softmax(expected, -1)[1]), abs=1e-6)

    st = state(temperature=0, repetition_penalty=2.0)
    st.counts = torch.zeros(V)
    st.counts[[0, 2]] = 1  # tokens 0 (logit 2.0 -> 1.0) and 2 (-1.0 -> -2.0) were generated
    expected = base[0].clone()
    expected[0], expected[2] = 1.0, -2.0
    tokens, logprobs = sampler.choose(base, [st], [[0, 2]])
    assert tokens == [1] and logprobs[0] == pytest.approx(float(torch.log_softmax(expected, -1)[1]), abs=1e-6)


def test_min_new_tokens_masks_every_stop_id_and_eos_until_reached():
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 8.0, 0.0, 0.0, 0.0]])  # 2 is EOS, 4 a stop id
    sampler = RequestSampler()
    st = state(eos=(2,), temperature=0, min_new_tokens=2, stop_token_ids=[4])
    assert sampler.choose(logits, [st], [[]])[0] == [0]  # 2 and 4 masked: the best left is 0
    assert sampler.choose(logits, [st], [[0, 0]])[0] == [2]
    assert sampler.finish(st, [0, 0, 2]) and st.matched == 2
    ignoring = state(eos=(2,), temperature=0, ignore_eos=True, stop_token_ids=[4])
    assert not sampler.finish(ignoring, [2]) and not sampler.finish(ignoring, [4])  # SGLang: ignores both


def test_top_k_top_p_min_p_cut_the_sorted_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]]))
    sampler = RequestSampler()

    def drawn(n=400, **params):
        st = state(seed=11, **params)
        return {sampler.choose(logits, [st], [[]])[0][0] for _ in range(n)}

    assert drawn(top_k=2) == {0, 1}
    assert drawn(top_p=0.65) == {0, 1}  # 0.4 + 0.3 covers 0.65; the first token is always kept
    assert drawn(top_p=0.05) == {0}
    assert drawn(min_p=0.4) == {0, 1, 2}  # p >= 0.4 * 0.4
    assert drawn(min_p=0.9) == {0}


def test_the_draw_follows_the_distribution_and_a_seed_replays_alone_or_batched():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125, 0, 0, 0, 0])
    logits = torch.log(probs.clamp_min(1e-30))[None]
    sampler = RequestSampler()
    st = state(seed=5)
    counts = torch.zeros(V)
    for _ in range(4000):
        counts[sampler.choose(logits, [st], [[]])[0][0]] += 1
    # 4000 draws: each frequency within 4 standard deviations of its probability
    sd = torch.sqrt(probs * (1 - probs) / 4000)
    assert ((counts / 4000 - probs).abs() <= 4 * sd + 1e-9).all(), counts
    alone = [sampler.choose(logits, [state(seed=9)], [[]])[0][0] for _ in range(1)]
    a, b = state(seed=9), state(seed=1)
    together = sampler.choose(logits.repeat(2, 1), [b, a], [[], []])[0]
    assert together[1] == alone[0]


def test_logit_bias_and_temperature():
    logits = torch.zeros(1, V)
    st = state(temperature=0, logit_bias={"6": 5.0})
    assert RequestSampler().choose(logits, [st], [[]])[0] == [6]
    st = state(temperature=0.5, top_k=1, logit_bias={"3": 1.0})
    tokens, logprobs = RequestSampler().choose(logits, [st], [[]])
    # top_k 1 is greedy: temperature 1, as SGLang sets it
    assert tokens == [3] and logprobs[0] == pytest.approx(1.0 - math.log(math.e + 7), abs=1e-6)


def test_sampling_params_normalisation():
    s = parse_sampling({"temperature": 1e-9, "top_k": -1, "stop": "x", "stop_token_ids": [3, 3]}, V)
    assert s.greedy and s.temperature == 1.0 and s.stop == ("x",) and s.stop_token_ids == {3}
    assert parse_sampling({"top_k": -1}, V).top_k == protocol.TOP_K_ALL
    assert parse_sampling({"max_new_tokens": None}, V).max_new_tokens is None  # SGLang: null = no limit
    assert parse_sampling({"min_p": None}, V).min_p == 0.0  # null: the default
    assert parse_sampling({"temperature": 1}, V).temperature == 1.0  # an integer is a number
    with pytest.raises(RequestError, match="at most 32 stop strings"):
        parse_sampling({"stop": ["a"] * 33}, V)


def test_batches_n_and_rids_expand_as_sglang():
    ids = iter(f"u{i}" for i in range(100))
    gen = parse_generate({"input_ids": [[1, 2], [3]], "sampling_params": {"n": 2}}, V, None, lambda: next(ids))
    assert gen.batched and [it.prompt for it in gen.inputs] == [[1, 2], [1, 2], [3], [3]]  # prompt-major
    assert len({it.rid for it in gen.inputs}) == 4
    gen = parse_generate({"input_ids": [[1], [2]], "rid": "job"}, V, None, lambda: next(ids))
    assert [it.rid for it in gen.inputs] == ["job_0", "job_1"]
    single = parse_generate({"input_ids": [4, 5], "sampling_params": {"n": 3}}, V, None, lambda: next(ids))
    assert single.batched and len(single.inputs) == 3  # n > 1 answers a list even for one prompt
    with pytest.raises(RequestError, match="Cannot use list return_logprob with parallel_sample_num > 1"):
        parse_generate({"input_ids": [[1]], "return_logprob": [True], "sampling_params": {"n": 2}}, V, None,
                       lambda: next(ids))
    with pytest.raises(RequestError, match="parallel_sample_num should be the same"):
        parse_generate({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, V, None, lambda: next(ids))


def test_an_overflowing_bias_or_penalty_gives_a_token_not_nan():
    logits = torch.zeros(2, V)
    huge = state(seed=1, logit_bias={"3": 1e39})
    tiny_penalty = state(seed=2, repetition_penalty=1e-300)
    tiny_penalty.counts = torch.ones(V)
    tokens, logprobs = RequestSampler().choose(logits + 1.0, [huge, tiny_penalty], [[], [1]])
    assert tokens[0] == 3 and all(0 <= t < V for t in tokens) and all(not math.isnan(lp) for lp in logprobs)


def test_teacher_forced_logprobs_in_pieces_equal_the_whole_logits(monkeypatch):
    """The server's teacher-forced pass reduces the prefill's hidden states a few rows at a time
    (never [T, V] logits at once): with one-row pieces, two-row pieces or all rows in one, the
    log-probs equal log_softmax over the whole logits to 1e-5 (fp32 at values up to ~15 nats: the
    head's GEMM over fewer rows sums in another order; 2.9e-6 measured) and the top entries name the
    same tokens."""
    from pathlib import Path

    from glmkit.model import RolloutEngine, load_model
    from glmkit.serve import server

    model = load_model(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start")
    engine = RolloutEngine(model, "kda=torch")
    prompts, temperatures, tops = [list(range(3, 20)), [5, 9, 2], [7]], [1.0, 0.7, 1.0], [3, 0, 2]
    hidden = []
    _, logits = engine.prefill(prompts, 32, all_logits=True, rows=hidden.append)
    row_bytes = 4 * model.config.vocab_size
    answers = {}
    for rows in (1, 2, 10 ** 6):
        monkeypatch.setattr(server, "PROMPT_LOGITS_BYTES", rows * row_bytes)
        answers[rows] = server.prompt_logprobs(model.lm_head, hidden[0], prompts, temperatures, tops)
    start = 0
    for i, (prompt, temperature, k) in enumerate(zip(prompts, temperatures, tops)):
        logp = torch.log_softmax(logits[start:start + len(prompt)] / temperature, -1)
        want = logp[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        for rows, answer in answers.items():
            got = answer[i]["input_logprobs"]
            assert got[0] is None and len(got) == len(prompt)
            assert torch.allclose(torch.tensor(got[1:], dtype=torch.float32), want, rtol=0, atol=1e-5), \
                (rows, (torch.tensor(got[1:]) - want).abs().max())
            if k:
                assert [[t for _, t in row] for row in answer[i]["input_top"][1:]] == \
                    logp[:-1].topk(k).indices.tolist()
            else:
                assert "input_top" not in answer[i]
        start += len(prompt)


def test_a_batch_that_runs_out_of_memory_is_answered_503_and_the_server_goes_on(monkeypatch):
    """The app in process (FastAPI's test client, the real Batcher and EngineService on the tiny
    model): an out-of-memory error in a batch is a capacity limit, answered 503 with what to change
    (not a 500), and the next request is served."""
    from pathlib import Path

    from fastapi.testclient import TestClient

    from glmkit.model import load_model
    from glmkit.serve.server import EngineService, build_app

    model = load_model(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start")
    service = EngineService(model, "kda=torch", max_batch=4, max_context=256)
    real = service.run_prompt_only

    def out_of_memory(items):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB")

    body = {"input_ids": [3, 4, 5, 6], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0}
    with TestClient(build_app(service)) as client:
        monkeypatch.setattr(service, "run_prompt_only", out_of_memory)
        failed = client.post("/generate", json=body)
        assert failed.status_code == 503
        assert "did not fit the device's memory" in failed.json()["error"]["message"]
        assert "--max-prefill-tokens" in failed.json()["error"]["message"]
        monkeypatch.setattr(service, "run_prompt_only", real)
        served = client.post("/generate", json=body)
        assert served.status_code == 200 and len(served.json()["meta_info"]["input_token_logprobs"]) == 4


def test_a_model_row_past_the_clamp_answers_null_not_a_made_up_log_prob():
    """Hostile pass 15: a finite model logit of -6.6e37 (weights that overflow, short of inf) was clamped
    with its neighbours to one value: greedy took the lowest id of the tie and answered log(1/#ties).
    Such a row is broken as a non-finite one is: its log-prob is NaN (null in the answer); a bias past the
    clamp stays the request's own and is sampled as before."""
    logits = torch.zeros(2, V)
    logits[0, :V // 2] = -6.6e37
    logits[0, V // 2:] = -4.8e37
    tokens, logprobs = RequestSampler().choose(logits, [state(seed=1), state(seed=2)], [[], []])
    assert math.isnan(logprobs[0]) and not math.isnan(logprobs[1]) and all(0 <= t < V for t in tokens)
