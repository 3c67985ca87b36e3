"""`glmkit serve` (a real uvicorn server process on 127.0.0.1) and the real client against it.

The checkpoint is the shipped tiny starting checkpoint (fp32, CPU, with its tokenizer). Equality with
the in-process engine: the server runs the same code over its cache slots (8 rows, 256 positions)
where the in-process call has 3 rows: tokens, routed experts and DSA selections equal exactly,
log-probs to 1e-5 (fp32 summation order over other batch shapes; 1.2e-6 measured).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch

from glmkit.launch.cluster import free_port
from glmkit.model import RolloutEngine, load_model
from glmkit.model.rollout import SamplingParams
from glmkit.serve.client import (SGLangClient, SGLangError, SGLangRollout, decode_indexer_topk, decode_routed_experts,
                                 write_weights_dir)

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "glmkit" / "assets" / "tiny_start"


class Server:
    """`python -m glmkit serve` in its own process; .url once it listens."""

    def __init__(self, *extra, port=0, checkpoint=CKPT, env=None, preexec_fn=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "glmkit", "serve", "--checkpoint", str(checkpoint),
                                      "--port", str(port), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     preexec_fn=preexec_fn)
        line = ""
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if "on http://" in line or not line:
                break
        assert "on http://127.0.0.1:" in line, f"server did not start: {line!r}"
        self.url = line.split(" on ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.output = []  # what it prints after the start line
        threading.Thread(target=lambda: self.output.extend(self.proc.stdout), daemon=True).start()  # drain
        for _ in range(100):
            try:
                requests.get(self.url + "/health", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(0.1)

    def kill(self):
        self.proc.kill()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def updates_root(tmp_path_factory):
    return tmp_path_factory.mktemp("updates")


@pytest.fixture(scope="module")
def server(updates_root):
    s = Server("--max-batch-size", "8", "--max-context", "4096", "--allow-updates-from", str(updates_root))
    yield s
    s.kill()


@pytest.fixture(scope="module")
def local_engine():
    return RolloutEngine(load_model(CKPT), "kda=torch")


def post(server, path, body):
    return requests.post(server.url + path, json=body, timeout=60)


def teacher_logprobs(client, seq=tuple(range(10, 30))):
    """The server's teacher-forced log-probs of tokens 1.. of `seq`, and its weight_version."""
    meta = client.generate(input_ids=list(seq), sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=0)["meta_info"]
    return torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"][1:]]), meta["weight_version"]


def stable(params: dict) -> dict:
    """Sampling that runs to max_new_tokens, as the in-process engine does without stop ids."""
    return {**params, "ignore_eos": True}


def push_scaled_head(client, push, version):
    """Push lm_head x 1.5 with `push` (an update method of the client); the teacher-forced log-probs
    must move and report `version`. -> (log-probs before, the checkpoint's lm_head)."""
    from safetensors.torch import load_file

    base, _ = teacher_logprobs(client)
    head = load_file(str(CKPT / "model.safetensors"))["lm_head.weight"]
    moved = push({"lm_head.weight": head * 1.5}, weight_version=version)
    assert moved["success"] and f"Weight version updated to {version}." in moved["message"]
    scaled, reported = teacher_logprobs(client)
    assert reported == version and (scaled - base).abs().max() > 1e-2
    return base, head


def test_generate_answers_in_sglang_shapes(server):
    client = SGLangClient(server.url)
    assert client.health() and client.health_generate()
    info = client.model_info()
    assert info["is_generation"] is True and info["weight_version"] == "default" and "model_path" in info
    answer = client.generate(text="12+3=", sampling_params={"max_new_tokens": 6, "temperature": 0},
                             return_logprob=True, logprob_start_len=0, return_routed_experts=True,
                             return_indexer_topk=True, rid="first")
    meta = answer["meta_info"]
    assert list(meta)[:5] == ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"]
    assert isinstance(answer["text"], str) and len(answer["output_ids"]) == meta["completion_tokens"] <= 6
    assert meta["id"] == "first" and meta["weight_version"] == "default" and meta["cached_tokens"] == 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 6
    out = meta["output_token_logprobs"]
    assert [t for _, t, _ in out] == answer["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in out)
    given = meta["input_token_logprobs"]
    assert len(given) == meta["prompt_tokens"] and given[0][0] is None and all(lp < 0 for lp, _, _ in given[1:])
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    # SGLang's layout: int32 [rows, num_hidden_layers (4), top_k (2)], the dense layers' rows 0
    raw = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4").reshape(rows, 4, -1)
    assert raw.shape[2] == 2 and not raw[:, :3].any() and int(raw[:, 3].max()) < 8
    assert torch.equal(decode_routed_experts(meta, rows, 4, [3])[3], torch.from_numpy(raw[:, 3].astype("int64")))
    topk = decode_indexer_topk(meta, rows, [3])
    assert list(topk) == [3] and topk[3].shape[0] == rows and meta["indexer_topk_num_layers"] == 1


def test_batched_request_equals_the_in_process_engine(server, local_engine):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 9)]
    answers = SGLangClient(server.url).generate(
        input_ids=prompts, sampling_params=stable({"max_new_tokens": 8, "temperature": 0}), return_logprob=True,
        return_routed_experts=True, return_indexer_topk=True)
    assert isinstance(answers, list) and len(answers) == 3
    local = local_engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8), record_routing=True,
                                  record_topk=True)
    for answer, want, prompt in zip(answers, local, prompts):
        meta = answer["meta_info"]
        assert answer["output_ids"] == want.tokens
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        assert (got - torch.tensor(want.logprobs)).abs().max() < 1e-5
        rows = len(prompt) + len(want.tokens) - 1
        assert torch.equal(decode_routed_experts(meta, rows, 4, [3])[3], want.routing[3])
        topk = decode_indexer_topk(meta, rows, [3])[3]
        assert torch.equal(topk[:, :want.topk[3].shape[1]], want.topk[3].long())


def test_teacher_forced_input_logprobs_equal_the_train_path(server):
    from glmkit.model import TrainPath

    seq = list(range(3, 40))
    answer = SGLangClient(server.url).generate(input_ids=seq, sampling_params={"max_new_tokens": 0},
                                               return_logprob=True, logprob_start_len=5)
    meta = answer["meta_info"]
    assert answer["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    given = meta["input_token_logprobs"]
    assert [t for _, t, _ in given] == seq[5:] and given[0][0] is None  # SGLang: the first entry has none
    train = TrainPath(load_model(CKPT), "kda=torch").forward([seq]).logprobs  # row t: log-prob of token t+1
    got = torch.tensor([lp for lp, _, _ in given[1:]])
    assert (got - train[5:-1]).abs().max() < 1e-5  # prefill vs train path: fp32 summation order only
    # with generation, the input log-probs come from the same prefill that fills the decode caches
    generating = SGLangClient(server.url).generate(input_ids=seq, sampling_params={"max_new_tokens": 2},
                                                   return_logprob=True, logprob_start_len=5)["meta_info"]
    got = torch.tensor([lp for lp, _, _ in generating["input_token_logprobs"][1:]])
    assert len(got) == len(seq) - 6 and (got - train[5:-1]).abs().max() < 1e-5


def engine_counters(client) -> dict:
    return client.server_info()["internal_states"][0]


def test_concurrent_requests_are_batched_and_answered_alike(server, local_engine):
    client = SGLangClient(server.url)
    prompts = [[7 + i, 40, 41, 42 + i] for i in range(8)]
    before = engine_counters(client)
    answers = [None] * len(prompts)

    def ask(i):  # every request its own sampling settings: they still share the decode steps
        answers[i] = client.generate(input_ids=prompts[i], return_logprob=True, sampling_params=stable(
            {"max_new_tokens": 12, "temperature": 0, "top_p": 0.5 + i / 20, "sampling_seed": i}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    after = engine_counters(client)
    assert after["engine_requests"] - before["engine_requests"] == len(prompts)
    assert after["engine_batches"] - before["engine_batches"] < len(prompts)  # at least two shared a batch
    for prompt, answer in zip(prompts, answers):
        alone = local_engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12))[0]
        assert answer["output_ids"] == alone.tokens
        got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
        assert (got - torch.tensor(alone.logprobs)).abs().max() < 1e-4  # batched vs alone: fp32 order


def test_prompts_prefilled_in_chunks_by_the_server_answer_as_alone(server, local_engine):
    """`glmkit serve --prefill-chunk 3 --max-batch-size 4 --max-prefill-tokens 16`: 8 concurrent
    requests with prompts of 2-21 tokens, so prompts join a running batch 3 tokens a step: each answer
    is the in-process engine's completion of that prompt alone (greedy tokens equal, log-probs to 1e-4:
    fp32 summation order). Three teacher-forced prompts of 10 tokens sent together run as three
    forwards (16 prompt tokens at most per forward) and answer as one batch of them on a server
    without that bound (to 1e-4: one prompt's forward vs three packed, 1.4e-5 measured)."""
    s = Server("--prefill-chunk", "3", "--max-batch-size", "4", "--max-prefill-tokens", "16")
    try:
        client = SGLangClient(s.url)
        prompts = [list(range(5 + i, 5 + i + 2 + (7 * i) % 20)) for i in range(8)]
        answers = [None] * len(prompts)

        def ask(i):
            answers[i] = client.generate(input_ids=prompts[i], return_logprob=True,
                                         sampling_params=stable({"max_new_tokens": 4 + i, "temperature": 0}))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for i, (prompt, answer) in enumerate(zip(prompts, answers)):
            alone = local_engine.generate([prompt], SamplingParams(temperature=0, max_new_tokens=4 + i))[0]
            assert answer["output_ids"] == alone.tokens
            got = torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])
            assert (got - torch.tensor(alone.logprobs)).abs().max() < 1e-4
        teacher = [list(range(20 + 3 * i, 30 + 3 * i)) for i in range(3)]
        before = engine_counters(client)
        bounded = client.generate(input_ids=teacher, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                  logprob_start_len=0)
        assert engine_counters(client)["engine_batches"] - before["engine_batches"] == 3
        whole = SGLangClient(server.url).generate(input_ids=teacher, sampling_params={"max_new_tokens": 0},
                                                  return_logprob=True, logprob_start_len=0)
        for one, other in zip(bounded, whole):
            got, want = ([lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]] for a in (one, other))
            assert len(got) == 9 and (torch.tensor(got) - torch.tensor(want)).abs().max() < 1e-4
    finally:
        s.kill()


# (body, the error body's layout, a piece of its message): SGLang's three layouts, see protocol.py
BAD_REQUESTS = [
    ({"input_ids": "abc"}, "contract", "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "contract",
     'temperature: invalid type: string "hot", expected f64'),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "8"}}, "contract", "expected i64"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8.0}}, "contract", "expected i64"),
    ({"input_ids": [1, 2], "sampling_params": {"ignore_eos": 1}}, "contract", "expected a boolean"),
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 1}}, "contract", "unknown field `temprature`"),
    ({"input_ids": []}, "message", "input_ids cannot be empty."),
    ({"input_ids": [[1], []]}, "message", "input 1 is empty"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "message", "max_new_tokens must be at least 0"),
    ({"input_ids": [[1, 2]] * 9}, "message", "larger than this server's --max-batch-size 8"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 5}, "rid": "x"}, "message", None),  # 5 fit: control row
    ({"input_ids": [1, 2], "sampling_params": {"n": 9}}, "message", "larger than this server's --max-batch-size 8"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "message", "top_k must be -1 (disable) or at least 1"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "message", "top_p must be in (0, 1]"),
    ({"input_ids": [1, 2], "sampling_params": {"min_p": 2}}, "message", "min_p must be in [0, 1]"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 0}}, "message", "repetition_penalty"),
    ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 3}}, "message", "frequency_penalty"),
    ({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "message",
     "min_new_tokens must be in [0, max_new_tokens(4)]"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "message", "temperature must be a non-negative"),
    ({"input_ids": [1, 5000]}, "message", "token id 5000 outside the vocabulary"),
    ({"input_ids": [1, -3]}, "message", "token id -3 outside the vocabulary"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]}, "message", "sampling_params has 3 entries for 2"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4095}}, "message",
     "exceeds the model's maximum context length of 4096 tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 2 ** 70}}, "message", "sampling_seed must be in"),
    ({"input_ids": [1, 2], "sampling_params": {"regex": "a+"}}, "message", "sampling_params.regex is not supported"),
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}, "message", "json_schema is not supported"),
    ({"input_ids": [1, 2], "lora_path": "adapter"}, "message", "LoRA adapter 'adapter' was requested"),
    ({"input_ids": [1, 2], "custom_logit_processor": "x"}, "message", "custom logit processor"),
    ({"input_ids": [1, 2], "input_embeds": [[0.5]]}, "message", "input_embeds is not supported"),
    ({"input_ids": [1, 2], "return_hidden_states": True}, "message", "return_hidden_states is not supported"),
    ({"input_ids": [1, 2], "routed_dp_rank": 1}, "message", "routed_dp_rank=1 out of range [0, 1)"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "message",
     "logprob_start_len=3 is higher than the number of input tokens"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "message", "rids length mismatch"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "message", "Duplicate request IDs"),
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"99999": 1.0}}}, "message", "logit_bias must has keys"),
    ([1, 2], "bad_request", "must be a JSON object"),
    ({}, "message", "Either text, input_ids or input_embeds should be provided."),
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 5000}, "message",
     "top_logprobs_num must be in [0, 1000]"),
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 1000, "sampling_params": {"max_new_tokens": 4000}},
     "message", "this server answers at most 2097152 per request"),
    # hostile pass 9: texts and stop strings were tokenized whole on the event loop, before any bound
    ({"text": "7" * (64 * 4096 + 1)}, "message",
     "text of 262145 characters: longer than any input of --max-context 4096 tokens (262144 characters at 64 a token)"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": ["x" * 40000, "y" * 30000]}}, "message",
     "stop strings of 70000 characters in all; at most 65536"),
]


@pytest.mark.parametrize("body,layout,needle", BAD_REQUESTS)
def test_bad_requests_get_400_in_sglangs_layout_and_the_server_keeps_serving(server, body, layout, needle):
    answer = post(server, "/generate", body)
    if needle is None:
        assert answer.status_code == 200 and len(answer.json()) == 5, answer.text
        return
    assert answer.status_code == 400, answer.text
    got = answer.json()
    message = {"contract": lambda: got["error"], "message": lambda: got["error"]["message"],
               "bad_request": lambda: got["message"]}[layout]()
    assert isinstance(message, str) and needle in message, got
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_the_frameworks_sampling_keys_are_accepted_null_or_set(server):
    """Every key of SGLang's SamplingParams, null (its default) or at a value glmkit honours; unknown
    top-level keys are ignored as SGLang ignores them."""
    from glmkit.serve.protocol import SAMPLING_KEYS, UNSUPPORTED_SAMPLING

    nulls = {key: None for key in SAMPLING_KEYS}
    answer = post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": {**nulls, "max_new_tokens": 3},
                                        "some_future_field": {"x": 1}, "return_routed_experts": False,
                                        "return_indexer_topk": False, "log_metrics": True, "priority": 3})
    assert answer.status_code == 200, answer.text
    assert "routed_experts" not in answer.json()["meta_info"]
    honoured = {"max_new_tokens": 4, "stop": ["zz"], "stop_token_ids": [7], "temperature": 0.7, "top_p": 0.9,
                "top_k": 20, "min_p": 0.01, "frequency_penalty": 0.1, "presence_penalty": 0.1, "repetition_penalty": 1.1,
                "min_new_tokens": 1, "n": 1, "ignore_eos": False, "skip_special_tokens": False,
                "spaces_between_special_tokens": False, "no_stop_trim": True, "stream_interval": 2,
                "logit_bias": {"5": 0.5}, "sampling_seed": 7}
    assert set(honoured) | set(UNSUPPORTED_SAMPLING) == set(SAMPLING_KEYS)
    answer = post(server, "/generate", {"input_ids": [5, 6, 7], "sampling_params": honoured})
    assert answer.status_code == 200, answer.text


def test_a_temperature_too_small_to_divide_by_samples_greedily(server):
    """SGLang's rule: below 1e-6 the temperature means greedy (1 / T would overflow the logits)."""
    tiny_t = post(server, "/generate", {"input_ids": [1, 5, 11], "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 1e-300}})
    greedy = post(server, "/generate", {"input_ids": [1, 5, 11], "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert tiny_t.status_code == greedy.status_code == 200, tiny_t.text
    assert tiny_t.json()["output_ids"] == greedy.json()["output_ids"]


def test_malformed_json_and_control_endpoints(server):
    answer = requests.post(server.url + "/generate", data=b"{not json", headers={"content-type": "application/json"},
                           timeout=10)
    assert answer.status_code == 400 and answer.json()["type"] == "Bad Request"
    assert post(server, "/abort_request", {"rid": "nobody"}).status_code == 200
    for method in ("GET", "POST"):  # the framework's startup loop GETs it; SGLang answers text
        flushed = requests.request(method, server.url + "/flush_cache", timeout=10)
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    client = SGLangClient(server.url)
    with pytest.raises(SGLangError, match=r"/generate: HTTP 400: input_ids cannot be empty."):
        client.generate(input_ids=[])


def test_abort_ends_a_running_request(server):
    client = SGLangClient(server.url)
    result = {}
    worker = threading.Thread(target=lambda: result.update(client.generate(
        input_ids=[5, 6, 7], sampling_params=stable({"max_new_tokens": 3000, "temperature": 1.0}), rid="long")))
    worker.start()
    deadline = time.time() + 60
    while time.time() < deadline and worker.is_alive():
        client.abort(rid="lon")  # SGLang matches ids by prefix
        time.sleep(0.05)
    worker.join(120)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["finish_reason"]["message"] in ("Aborted", "Abort in waiting queue")
    assert result["meta_info"]["completion_tokens"] < 3000


def test_weight_updates_change_the_logprobs(server, updates_root, tmp_path):
    client = SGLangClient(server.url)

    def logprobs():
        return teacher_logprobs(client)

    base, head = push_scaled_head(client, client.update_weights_from_tensor, "tensor-1")

    path = write_weights_dir({"lm_head.weight": head}, updates_root, "restore")
    answer = client.update_weights_from_disk(path, weight_version="disk-1")
    assert answer["success"] is True and answer["num_paused_requests"] == 0
    assert client.model_info()["model_path"] == str(path)  # SGLang reports the path it loaded last
    restored, version = logprobs()
    assert version == "disk-1" and (restored - base).abs().max() < 1e-6
    assert not [p for p in updates_root.iterdir() if ".tmp-" in p.name]  # staging renamed away

    outside = write_weights_dir({"lm_head.weight": head}, tmp_path, "elsewhere")
    refused = post(server, "/update_weights_from_disk", {"model_path": str(outside)})
    assert refused.status_code == 400 and refused.json()["success"] is False  # what the framework reads
    assert "is not under a directory this server may read" in refused.json()["message"]
    with pytest.raises(SGLangError, match=r"HTTP 400: tensor 'nope' is not a parameter of this model"):
        client.update_weights_from_tensor({"nope": torch.zeros(2)})
    broken = updates_root / "broken"
    broken.mkdir()
    (broken / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SGLangError, match="HTTP 400: .*broken"):
        client.update_weights_from_disk(broken)
    with pytest.raises(SGLangError, match=r"'lm_head.weight' has shape \[2, 2\]; the model's is \[1024, 64\]"):
        client.update_weights_from_tensor({"lm_head.weight": torch.zeros(2, 2)})
    pickled = base64.b64encode(b"\x80\x04K\x01.").decode()
    for fmt in ("direct", "flattened_bucket", None):  # SGLang's formats carry pickle: refused by name
        bad = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [pickled], "load_format": fmt})
        assert bad.status_code == 400 and bad.json()["success"] is False and "load_format" in bad.json()["message"]
    bad = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": [pickled],
                                                        "load_format": "safetensors"})
    assert bad.status_code == 400 and "not base64 of a safetensors blob" in bad.json()["message"]
    poisoned = head.clone()
    poisoned[3, 5] = float("nan")
    with pytest.raises(SGLangError, match=r"hold NaN or Inf in the model's dtype .*, e.g. 'lm_head.weight': update refused"):
        client.update_weights_from_tensor({"model.norm.weight": torch.ones(64) * 3, "lm_head.weight": poisoned})
    # hostile pass 9: float64 values past float32's range are finite as sent and Inf once held: refused too
    with pytest.raises(SGLangError, match=r"e.g. 'model.norm.weight': update refused, the weights are unchanged"):
        client.update_weights_from_tensor({"model.norm.weight": torch.full((64,), 1e300, dtype=torch.float64)})
    assert torch.equal(logprobs()[0], restored)  # nothing of the refused update was written
    assert logprobs()[1] == "disk-1"  # refused updates changed nothing


def test_a_whole_checkpoint_updates_from_disk_and_a_link_out_of_the_root_is_refused(server, updates_root, tmp_path):
    """A checkpoint folder (config.json + safetensors, the routed experts under their per-expert
    names) loads as an update; the same folder with its weights file a link to a file outside the
    allowed root is refused, unread."""
    client = SGLangClient(server.url)
    whole = updates_root / "whole"
    shutil.copytree(CKPT, whole)
    expected = len(load_model(CKPT).state_dict())
    answer = client.update_weights_from_disk(whole, weight_version="whole-1")
    assert answer["message"] == "Succeeded to update model weights. Weight version updated to whole-1."
    assert engine_counters(client) and expected > 100
    linked = updates_root / "linked"
    linked.mkdir()
    shutil.copy(whole / "config.json", linked / "config.json")
    shutil.copy(whole / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (linked / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(SGLangError, match="HTTP 400: model.safetensors points outside"):
        client.update_weights_from_disk(linked)
    # hostile pass 8: a FIFO named *.safetensors blocked safetensors' open holding the GIL, and the whole
    # server stopped (/health too, SIGTERM ignored); refused by what it is, as a folder or in a checkpoint
    for name, with_config in (("fifo_dir", False), ("fifo_ckpt", True)):
        folder = updates_root / name
        folder.mkdir()
        if with_config:
            shutil.copy(whole / "config.json", folder / "config.json")
        os.mkfifo(folder / "model.safetensors")
        with pytest.raises(SGLangError, match=r"HTTP 400: .*model.safetensors.* named pipe \(FIFO\)"):
            client.update_weights_from_disk(folder)
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert teacher_logprobs(client)[1] == "whole-1"


def test_killed_server_gives_a_clear_error_and_a_retry_after_restart_works():
    first = Server()
    client = SGLangClient(first.url, retries=0)
    errors = []

    def ask():
        try:
            client.generate(input_ids=[5, 6], sampling_params=stable({"max_new_tokens": 5000, "temperature": 1.0}))
        except SGLangError as err:
            errors.append(str(err))

    worker = threading.Thread(target=ask)
    worker.start()
    time.sleep(1.0)
    first.kill()
    worker.join(60)
    assert errors and "connection failed or was lost after 1 attempt(s)" in errors[0], errors
    assert first.url in errors[0]
    second = Server(port=first.port)
    try:
        answer = SGLangClient(first.url, retries=3, backoff_s=0.2).generate(
            input_ids=[5, 6], sampling_params={"max_new_tokens": 3, "temperature": 0})
        assert len(answer["output_ids"]) == 3
    finally:
        second.kill()


def test_client_refuses_bad_settings():
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        SGLangClient("127.0.0.1:30000")
    for url, reason in (("http://127.0.0.1:99999", "Port out of range"), ("http://[::1", "Invalid IPv6 URL"),
                        ("http://", "names no host"),
                        # hostile pass 14: a line break made a two-line error that blamed the server
                        ("http://127.0.0.1:30000\n", "holds a space or a control character"),
                        ("http://127.0.0.1:30000\u2028x", "holds a space or a control character")):
        with pytest.raises(ValueError, match=re.escape(reason)):
            SGLangClient(url)
    with pytest.raises(ValueError, match="weight update mode 'ipc'; allowed: tensor, disk, distributed"):
        SGLangRollout("http://127.0.0.1:1", mode="ipc")
    with pytest.raises(ValueError, match="needs --weight-update-master HOST:PORT, got 'nowhere'"):
        SGLangRollout("http://127.0.0.1:1", mode="distributed", master="nowhere")


def test_parity_against_the_server_path(server, tmp_path):
    out = tmp_path / "parity.json"
    run = subprocess.run([sys.executable, "-m", "glmkit", "parity", "--checkpoint", str(CKPT), "--paths",
                          f"train,sglang:{server.url}", "--json", str(out)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["verdict"] == "pass"
    sites = {(s["layer"], s["site"]) for s in result["sites"]}
    assert sites == {(None, "logprobs"), (3, "router_experts"), (3, "indexer_topk")}  # no hidden states
    assert result["logprob_abs_diff"] < 1e-5  # fp32 train path vs the server's prefill: summation order


def test_parity_against_the_server_fails_on_other_weights(server, tmp_path):
    """A server whose weights differ is judged on its log-probs (it reports no hidden states)."""
    from safetensors.torch import load_file

    client = SGLangClient(server.url)
    head = load_file(str(CKPT / "model.safetensors"))["lm_head.weight"]
    client.update_weights_from_tensor({"lm_head.weight": head * 1.1})
    try:
        run = subprocess.run([sys.executable, "-m", "glmkit", "parity", "--checkpoint", str(CKPT), "--paths",
                              f"train,sglang:{server.url}"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    finally:
        client.update_weights_from_tensor({"lm_head.weight": head})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "verdict: fail, first divergence at layer None, site logprobs" in run.stdout, run.stdout


def test_log_probs_that_overflow_are_null_as_sglang_writes_them(server):
    """Hostile pass 13 (G02): a finite weight update (lm_head 3e38) made teacher-forced log-probs
    non-finite, and the answer was a 500 (JSON has no NaN). SGLang writes them with orjson, as null:
    so does glmkit, in whole answers and in streamed chunks."""
    from safetensors.torch import load_file

    client = SGLangClient(server.url)
    head = load_file(str(CKPT / "model.safetensors"))["lm_head.weight"]
    client.update_weights_from_tensor({"lm_head.weight": torch.full_like(head, 3e38)})
    try:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0}
        answer = post(server, "/generate", body)
        assert answer.status_code == 200, answer.text[:300]
        logprobs = [lp for lp, _, _ in answer.json()["meta_info"]["input_token_logprobs"]]
        assert logprobs[0] is None and None in logprobs[1:], logprobs  # NaN or -inf: null, strict JSON
        # pass 14: sampled tokens' log-probs were log(1/V), made up from the clamped row: null too
        sampled = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 2}, "top_logprobs_num": 2})
        meta = sampled.json()["meta_info"]
        assert [lp for lp, _, _ in meta["output_token_logprobs"]] == [None, None], meta["output_token_logprobs"]
        assert all(lp is None for step in meta["output_top_logprobs"] for lp, _, _ in step), meta["output_top_logprobs"]
        streamed = requests.post(server.url + "/generate", json={**body, "stream": True,
                                                                 "sampling_params": {"max_new_tokens": 1}}, timeout=60)
        chunks = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert streamed.status_code == 200 and chunks and all(json.loads(c, parse_constant=pytest.fail) for c in chunks)
        assert [lp for lp, _, _ in json.loads(chunks[-1])["meta_info"]["output_token_logprobs"]] == [None]
    finally:
        client.update_weights_from_tensor({"lm_head.weight": head})


def test_a_surrogates_utf8_bytes_in_a_body_are_400_not_500(server):
    """Hostile pass 13 (G01): the UTF-8 bytes of a surrogate (ED A0 80, which is not UTF-8) in `text`,
    `rid`, `stop` or a key were read by Python's json as a lone surrogate and answered 500."""
    for body in (b'{"text": "\xed\xa0\x80", "sampling_params": {"max_new_tokens": 1}}',
                 b'{"input_ids": [1, 2], "rid": "\xed\xa0\x80", "sampling_params": {"max_new_tokens": 1}}',
                 b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "stop": ["\xed\xb0\x80"]}}'):
        answer = requests.post(server.url + "/generate", data=body, timeout=60,
                               headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and "the body is not UTF-8 text (byte " in answer.text, answer.text[:300]
    # escaped, or in a UTF-16 body (which Python's json reads, and SGLang's orjson does not)
    for body, reason in (('{"text": "\\ud800", "sampling_params": {"max_new_tokens": 1}}'.encode(), "lone UTF-16 surrogate"),
                         ('{"text": "ok", "sampling_params": {"max_new_tokens": 1}}'.encode("utf-16-le"),
                          "the body is not valid JSON"),  # ASCII in UTF-16-LE is UTF-8 with NULs between
                         ('{"text": "\\ud800"}'.encode("utf-16"), "the body is not UTF-8 text (byte 0")):
        answer = requests.post(server.url + "/generate", data=body, timeout=60,
                               headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and reason in answer.text, answer.text[:300]
    assert post(server, "/generate", {"text": "caf\u00e9 \U0001f600", "sampling_params": {"max_new_tokens": 1}}).ok


def test_a_non_finite_logit_bias_is_named_as_a_value(server):
    """Hostile pass 13: a NaN or infinite bias (JSON's NaN / Infinity, which Python reads) was refused as
    a bad key ("must has keys in [0, 1023], got 5")."""
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        answer = requests.post(server.url + "/generate", timeout=60, headers={"Content-Type": "application/json"},
                               data=b'{"input_ids": [1, 2], "sampling_params": {"logit_bias": {"5": ' + value + b"}}}")
        assert answer.status_code == 400, answer.text[:300]
        assert "logit_bias['5']:" in answer.text and "a bias must be a finite number" in answer.text, answer.text[:300]


def test_grpo_with_the_server_as_rollout_backend(server, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    before = SGLangClient(server.url).model_info()["weight_version"]
    run = subprocess.run([sys.executable, "-m", "glmkit", "train", "--model-name", "tiny", "--num-rollout", "2",
                          "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
                          "--rollout-max-response-len", "16", "--rollout-url", server.url, "--enable-r3",
                          "--metrics-out", str(metrics)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_rows = [r for r in rows if "train/step" in r]
    assert len(train_rows) == 2
    for r in train_rows:  # fp32, same code on both sides, routing replayed
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4
        assert r["train/routing_mismatch_frac"] == 0
    after = SGLangClient(server.url).model_info()["weight_version"]
    assert after != before  # every optimizer step pushed the weights


def test_lora_grpo_pushes_merged_weights_through_a_directory(tmp_path):
    """LoRA adapters merged into their projections (W + B A alpha / r) and written as an atomically
    renamed directory the server reads: the rollout then samples from what the trainer scores. A
    server of its own: the other tests' full-weight updates would leave it on other base weights."""
    updates_root = tmp_path / "updates"
    updates_root.mkdir()
    server = Server("--allow-updates-from", str(updates_root))
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run([sys.executable, "-m", "glmkit", "lora", "train", "--model-name", "tiny", "--num-rollout",
                          "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
                          "--rollout-max-response-len", "16", "--lr", "1e-2", "--rollout-url", server.url,
                          "--weight-update", "disk", "--weight-update-dir", str(updates_root), "--enable-r3",
                          "--metrics-out", str(metrics)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    server.kill()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train_rows = [r for r in rows if "train/step" in r]
    assert len(train_rows) == 4
    # rollout 1 sampled from weights the adapters moved (lr 1e-2, two steps); merged or not, the same model
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in train_rows)
    assert any(r["train/grad_norm"] > 0 for r in train_rows[:2])  # the adapters moved before rollout 1
    assert (updates_root / "glmkit-update" / "weights.safetensors").is_file()
    assert not [p for p in updates_root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_weights_update_group_broadcasts_new_weights():
    """The framework's NCCL path with gloo on the CPU: this test process is the trainer (rank 0, the
    rendezvous host), the server joins the named group (rank 1) and receives the broadcast; the
    log-probs follow the new weights exactly as they follow an HTTP tensor update."""
    server = Server()
    try:
        client = SGLangClient(server.url)
        missing = post(server, "/update_weights_from_distributed",
                       {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1024, 64]]})
        assert missing.status_code == 400 and "no weights-update group 'weight_update_group'" in missing.json()["message"]
        port = free_port()
        joined = client.init_weights_update_group("127.0.0.1", port, world_size=2, rank_offset=1, backend="gloo",
                                                  timeout_s=60)
        assert joined == {"success": True, "message": "Succeeded to initialize custom process group."}

        base, head = push_scaled_head(client, client.update_weights_from_distributed, "nccl-1")
        client.update_weights_from_distributed({"lm_head.weight": head})
        assert (teacher_logprobs(client)[0] - base).abs().max() < 1e-6  # the broadcast carries the exact bits
        again = post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"})
        assert again.status_code == 400 and "exists (destroy it first)" in again.json()["message"]
        assert client.destroy_weights_update_group()["success"] is True
    finally:
        server.kill()


def test_grpo_syncs_weights_over_the_update_group(tmp_path):
    """`glmkit train --weight-update distributed`: the trainer broadcasts every step's weights to the
    server over gloo; the rollouts then score like the trainer (fp32, same code both sides)."""
    server = Server()
    port = free_port()
    metrics = tmp_path / "metrics.jsonl"
    try:
        run = subprocess.run([sys.executable, "-m", "glmkit", "train", "--model-name", "tiny", "--num-rollout", "2",
                              "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
                              "--rollout-max-response-len", "16", "--rollout-url", server.url, "--enable-r3",
                              "--weight-update", "distributed", "--weight-update-master", f"127.0.0.1:{port}",
                              "--metrics-out", str(metrics)], capture_output=True, text=True, cwd=ROOT, timeout=600)
        version = SGLangClient(server.url).model_info()["weight_version"]
    finally:
        server.kill()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    train_rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "train/step" in r]
    assert len(train_rows) == 4 and all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in train_rows)
    assert any(r["train/grad_norm"] > 0 for r in train_rows[:2])
    assert version == "2"  # one sync after each rollout's optimizer steps


def test_a_lone_surrogate_in_a_body_is_a_400_and_never_stored(server):
    """JSON may escape half of a UTF-16 pair; such a str reaches no tokenizer (hostile pass: 500s, and a
    weight version stored that broke /generate for everyone). A complete pair (an emoji) is fine."""
    headers = {"content-type": "application/json"}
    for path, raw in (("/generate", rb'{"text": "\ud800", "sampling_params": {"max_new_tokens": 2}}'),
                      ("/generate", rb'{"input_ids": [1, 2], "rid": "\udfff"}'),
                      ("/update_weight_version", rb'{"new_version": "\ud800"}')):
        answer = requests.post(server.url + path, data=raw, headers=headers, timeout=10)
        assert answer.status_code == 400, (path, answer.text)
        assert "lone UTF-16 surrogate" in answer.text, answer.text
    assert requests.get(server.url + "/get_weight_version", timeout=10).status_code == 200
    paired = requests.post(server.url + "/generate", headers=headers, timeout=30,
                           data=rb'{"input_ids": [1, 2], "rid": "\ud83d\ude00", "sampling_params": {"max_new_tokens": 1}}')
    assert paired.status_code == 200, paired.text


def test_a_client_leaving_mid_body_is_not_a_fault_and_no_page_loads_a_cdn(server):
    """Hostile pass 4: each client that closed mid-body logged a full ASGI traceback; FastAPI's /docs
    page loaded its scripts from a CDN. Now: nothing logged as a fault, no /docs or /redoc."""
    import socket

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    before = len(server.output)
    for _ in range(5):
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"text\": ")
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    time.sleep(1)
    logged = "".join(server.output[before:])
    assert "Traceback" not in logged and "Exception in ASGI application" not in logged, logged[-2000:]
    assert requests.get(server.url + "/docs", timeout=10).status_code == 404
    assert requests.get(server.url + "/redoc", timeout=10).status_code == 404
    assert requests.get(server.url + "/openapi.json", timeout=10).status_code == 200


def test_a_stalled_body_is_answered_408_and_weights_have_their_own_body_limit():
    """Hostile pass 4: 1500 connections that sent headers and 8 bytes of a 100 KB body were all still held
    60 s later (no body read timeout); one JSON body could be 1 GiB. Now a body that sends nothing for
    --body-timeout-s gets 408 and its connection is closed; /generate bodies are bounded by
    --max-body-bytes and tensor weight updates by --max-weights-body-bytes."""
    import socket

    s = Server("--body-timeout-s", "1", "--max-body-bytes", "100000", "--max-weights-body-bytes", "400000")
    try:
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        started = time.time()
        with socket.create_connection((host, int(port)), timeout=20) as conn:
            conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"text\": ")
            answer = b""
            while piece := conn.recv(65536):  # ends when the server closes the connection
                answer += piece
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"no part of the request body arrived for 1 s" in answer and b"9 bytes had arrived" in answer
        assert time.time() - started < 15
        blob = {"serialized_named_tensors": ["A" * 200000], "load_format": "safetensors"}
        weights = requests.post(s.url + "/update_weights_from_tensor", json=blob, timeout=30)
        assert weights.status_code == 400 and "safetensors" in weights.text, weights.text  # read, then refused
        generate = requests.post(s.url + "/generate", json={"text": "A" * 200000}, timeout=30)
        assert generate.status_code == 413 and "(--max-body-bytes)" in generate.text
        too_big = requests.post(s.url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["A" * 500000]},
                                timeout=30)
        assert too_big.status_code == 413 and "limit of 400000 bytes (--max-weights-body-bytes)" in too_big.text
        assert requests.get(s.url + "/health", timeout=10).status_code == 200
    finally:
        s.kill()


def test_over_long_headers_are_answered_431_even_while_the_client_still_sends(server):
    """Hostile pass 12: headers of megabytes got the connection reset (uvicorn answered 400 and closed
    with the rest unread), so the client saw no answer. Now 431 naming the limit, and the rest of the
    request is read and dropped before the connection closes; a request h11 cannot parse is 400."""
    import socket

    from glmkit.serve.connections import MAX_HEADER_BYTES

    answer = requests.get(server.url + "/health", headers={"X-Big": "a" * (20 << 20)}, timeout=60)
    assert answer.status_code == 431 and answer.text == f"the request line and headers exceed {MAX_HEADER_BYTES} bytes\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert conn.recv(200).startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def _whole_answer(port: int, raw: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(raw)
        answer = b""
        while piece := conn.recv(65536):  # until the server closes
            answer += piece
    return answer


@pytest.mark.parametrize("raw, status, text", [
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", b"400 Bad Request",
     b"a malformed HTTP/1.1 request: bad Content-Length"),
    (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n{}",
     b"400 Bad Request", b"a malformed HTTP/1.1 request: conflicting Content-Length headers"),
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"505 HTTP Version Not Supported",
     b"HTTP/2.0 is not served here: this server speaks HTTP/1.1"),
    (b"GET /health HTTP/3.0\r\nHost: x\r\n\r\n", b"505 HTTP Version Not Supported", b"HTTP/3.0 is not served here"),
])
def test_a_request_h11_cannot_serve_gets_one_answer_saying_what_is_wrong(server, raw, status, text):
    """Hostile pass 14: a negative or doubled Content-Length was answered "(not HTTP/1.1 that h11 can
    parse)", which blamed the protocol; an HTTP/2 preface got 404 (h11 reads `PRI *` as a request) and
    then 400. Each now gets one answer on a closing connection: 400 naming the fault, 505 naming the
    version. HTTP/1.0 is still served."""
    answer = _whole_answer(server.port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status + b"\r\n") and b"connection: close" in head, answer
    assert body.startswith(text) and not re.search(rb"HTTP/1\.1 \d{3} ", body), answer  # one answer, not two
    old = _whole_answer(server.port, b"GET /health HTTP/1.0\r\n\r\n")
    assert old.startswith(b"HTTP/1.1 200"), old


def test_headers_that_never_end_are_answered_408_and_connections_are_capped():
    """Hostile pass 6: connections that never finished their headers were held with no timeout (uvicorn has
    none), and 20k of them exhausted the descriptors. Now headers must arrive within --header-timeout-s of
    the connection's opening (408, closed), connections beyond --max-connections get 503 at once, and a
    keep-alive client that sends whole requests is unaffected."""
    import socket

    def answer_of(conn):
        answer = b""
        while piece := conn.recv(65536):  # ends when the server closes the connection
            answer += piece
        return answer

    s = Server("--header-timeout-s", "2", "--max-connections", "3")
    try:
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=20) for _ in range(3)]
        time.sleep(0.5)  # accepted by the server
        with socket.create_connection((host, int(port)), timeout=20) as fourth:
            refused = answer_of(fourth)
        assert refused.startswith(b"HTTP/1.1 503") and b"limit of 3 open connections" in refused, refused
        started = time.time()
        for conn in silent:
            late = answer_of(conn)
            conn.close()
            assert late.startswith(b"HTTP/1.1 408") and b"(--header-timeout-s)" in late, late
        assert time.time() - started < 10
        started = time.time()
        with socket.create_connection((host, int(port)), timeout=20) as trickle:  # a header line a second
            trickle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            for _ in range(6):
                time.sleep(0.7)
                try:
                    trickle.sendall(b"X-Slow: 1\r\n")
                except OSError:  # closed by the server: the test reads its answer below
                    break
            late = answer_of(trickle)
        assert late.startswith(b"HTTP/1.1 408"), late
        assert time.time() - started < 8
        with requests.Session() as session:  # keep-alive across requests slower than nothing: untouched
            for _ in range(3):
                assert session.get(s.url + "/health", timeout=10).status_code == 200
                time.sleep(0.5)
    finally:
        s.kill()


def test_a_low_descriptor_limit_leaves_the_connections_it_can_and_none_is_refused_by_name():
    """Hostile pass 7: under `ulimit -n 100` a fixed 128-descriptor margin left one connection, and the
    framework's keep-alive pool got 503s. The margin is now what the process holds plus a reserve of
    32, so 100 leaves dozens; a limit that leaves none refuses to start (exit 4, naming ulimit -n)."""
    import subprocess
    import sys

    probe = ("import resource, sys; from glmkit.serve.connections import connection_cap, open_descriptors, FD_RESERVE;"
             "limit = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit));"
             "print(connection_cap(2048), open_descriptors(), FD_RESERVE)")
    def cap_under(limit):
        out = subprocess.run([sys.executable, "-c", probe, str(limit)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return [int(v) for v in out.stdout.split()]

    cap, held, reserve = cap_under(100)
    assert cap == 100 - held - reserve and cap >= 30, (cap, held)
    assert cap_under(held + reserve)[0] == 0
    limit = 36  # the server holds about 7 descriptors here: 36 - 7 < the reserve of 32
    run = subprocess.run(["sh", "-c", f'ulimit -n {limit} && exec "$0" -m glmkit serve --checkpoint {CKPT} --port 0',
                          sys.executable], capture_output=True, text=True, timeout=120)
    assert run.returncode == 4, run.stderr
    assert f"ulimit -n {limit}) leaves no room for a connection" in run.stderr and "Traceback" not in run.stderr


def test_a_connection_answered_before_its_body_ended_is_closed(server):
    """Hostile pass 7: `GET /health` declaring a 1 MB body got its 200, then one more byte every so often
    held the connection with no timer armed (the body timeout belongs to the app, which had answered);
    20 such connections filled the cap and the server answered 503 to everyone. Such a connection is now
    closed once its answer is sent."""
    import socket

    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    started = time.time()
    with socket.create_connection((host, int(port)), timeout=20) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\nx")
        answer = b""
        while piece := conn.recv(65536):  # ends when the server closes the connection
            answer += piece
    assert answer.startswith(b"HTTP/1.1 200") and time.time() - started < 10, answer[:200]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_an_ipv6_address_is_printed_in_brackets():
    """Hostile pass 6: `serve --host ::1` printed http://::1:PORT, which no client parses."""
    from glmkit.serve.server import http_url

    assert http_url("::1", 30000) == "http://[::1]:30000"
    assert http_url("127.0.0.1", 30000) == "http://127.0.0.1:30000"
    assert requests.utils.urlparse(http_url("fe80::1", 8)).port == 8


def test_a_weight_version_is_a_short_printable_label(server):
    """Hostile pass 4: any string was stored (NUL, 90 KB) and echoed in every answer."""
    for version in ("x" * 257, "a\x00b", "line\nbreak"):
        answer = requests.post(server.url + "/update_weight_version", json={"new_version": version}, timeout=10)
        assert answer.status_code == 400 and "printable characters" in answer.text, answer.text
    ok = requests.post(server.url + "/update_weight_version", json={"new_version": "step-12"}, timeout=10)
    assert ok.status_code == 200 and requests.get(server.url + "/get_weight_version").json() == {"weight_version": "step-12"}
    requests.post(server.url + "/update_weight_version", json={"new_version": "default"}, timeout=10)


def test_joins_whose_trainer_never_comes_leave_the_server_serving_and_stoppable():
    """Weights-update group joins wait (up to their timeout_s, here a day) for a trainer that never
    hosts the rendezvous: they run on threads of their own, at most MAX_GROUP_OPERATIONS at once (one
    more is refused by name), generation and pausing still answer, and SIGTERM stops the server within
    its shutdown grace (5 s) plus a margin for the interpreter's exit."""
    from glmkit.serve.server import MAX_GROUP_OPERATIONS

    server = Server()
    try:
        port = free_port()  # nobody listens there
        join = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo", "timeout_s": 86400}
        huge = post(server, "/init_weights_update_group", {**join, "world_size": 10 ** 30})  # pass 9: a pybind error
        assert huge.status_code == 400 and huge.json()["message"] == (
            "world_size 1000000000000000000000000000000 must be in 2..2147483647 (the trainer and at least this engine)")

        def wait_in_group(name):  # until it holds a place (an answer means it was refused: try again)
            while "at once" in requests.post(server.url + "/init_weights_update_group",
                                             json={**join, "group_name": name}, timeout=120).json()["message"]:
                time.sleep(0.05)

        for i in range(MAX_GROUP_OPERATIONS):
            threading.Thread(target=wait_in_group, args=(f"g{i}",), daemon=True).start()
        deadline = time.time() + 60
        while time.time() < deadline:
            # a probe that gets a place (the others not all waiting yet) gives up after 1 s
            extra = post(server, "/init_weights_update_group", {**join, "group_name": "one-more", "timeout_s": 1})
            if "at once" in extra.json()["message"]:
                break
            time.sleep(0.5)
        assert extra.status_code == 400 and extra.json() == {
            "success": False, "message": f"{MAX_GROUP_OPERATIONS} weights-update group operations are waiting "
                                         f"(at most {MAX_GROUP_OPERATIONS} at once); retry when one has ended"}
        answer = post(server, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
        assert post(server, "/pause_generation", {}).status_code == 200
        assert post(server, "/continue_generation", {}).status_code == 200
        started = time.time()
        server.proc.terminate()
        server.proc.wait(30)
        assert time.time() - started < 20, f"SIGTERM took {time.time() - started:.1f} s"
    finally:
        if server.proc.poll() is None:
            server.kill()


def terminate_during(server: Server, body: dict, after_s: float, path: str = "/generate"):
    """SIGTERM `server` `after_s` seconds into a POST of `body` -> (exit code, the answer or None, what
    the server printed)."""
    answers = []
    client = threading.Thread(target=lambda: answers.append(requests.post(server.url + path, json=body, timeout=120)),
                              daemon=True)
    client.start()
    time.sleep(after_s)
    try:
        server.proc.terminate()
        code = server.proc.wait(60)
        client.join(30)
    finally:
        if server.proc.poll() is None:
            server.kill()
    return code, (answers[0] if answers else None), "".join(server.output)


def test_sigterm_during_generation_answers_503_and_exits_143_with_one_line():
    """Hostile pass 10: SIGTERM while a request generates ended the process with SIGABRT (134; the
    worker thread was still inside the model at the interpreter's exit), the client got a bare 500 and
    stderr a traceback per request. Now the running requests end at their next step and are answered
    503 naming the shutdown, the worker leaves before the process exits, and the exit is SIGTERM's 143."""
    body = {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 30000, "ignore_eos": True}}
    # generating by then (30000 tokens take minutes on the tiny model)
    code, answer, output = terminate_during(Server(), body, after_s=2.0)
    assert code == 143, output[-3000:]
    assert answer is not None and answer.status_code == 503, answer and answer.text
    assert "the server is shutting down" in answer.json()["error"]["message"]
    assert "Traceback" not in output and "terminate called" not in output, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("glmkit serve: terminated"), output[-500:]


def test_sigterm_names_the_shutdown_to_streams_waiting_updates_and_a_step_past_the_grace():
    """Hostile pass 11: a stream ended like an ordinary abort, a weight update waiting behind the batch
    got a 500 and a traceback, and a teacher-forced prompt whose one forward outlasted the 5 s grace
    got a 500 and the process a SIGABRT (134). Now: the stream's last event names the shutdown, the
    update answers 503 with success false, the long step's request answers 503 and the process exits
    143 with one line."""
    server = Server("--allow-updates-from", str(CKPT.parent), "--max-context", "40000")
    answers = {}

    def ask(name, path, body, **kw):
        answers[name] = requests.post(server.url + path, json=body, timeout=120, **kw)

    try:
        stream = threading.Thread(target=ask, args=("stream", "/generate", {
            "input_ids": [1, 2, 3], "stream": True, "sampling_params": {"max_new_tokens": 30000, "ignore_eos": True}}),
            daemon=True)
        stream.start()
        time.sleep(1.0)
        update = threading.Thread(target=ask, args=("update", "/update_weights_from_disk", {"model_path": str(CKPT)}),
                                  daemon=True)
        update.start()
        time.sleep(1.5)
        server.proc.terminate()
        code = server.proc.wait(30)
        stream.join(30)
        update.join(30)
    finally:
        if server.proc.poll() is None:
            server.kill()
    output = "".join(server.output)
    assert code == 143 and "Traceback" not in output, output[-3000:]
    events = [line for line in answers["stream"].text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "the server is shutting down" in events[-2], events[-3:]
    assert answers["update"].status_code == 503 and answers["update"].json()["success"] is False

    prompt = {"input_ids": list(range(3, 900)) * 33, "sampling_params": {"max_new_tokens": 0},
              "return_logprob": True, "logprob_start_len": 0}
    # inside its one forward of 29601 tokens by then (over 10 s on two cores)
    code, answer, output = terminate_during(Server("--max-context", "40000"), prompt, after_s=2.0)
    assert code == 143, output[-3000:]
    assert answer is not None and answer.status_code == 503, answer and answer.text[:300]
    assert "Traceback" not in output and "terminate called" not in output and "ERROR" not in output, output[-3000:]


def test_sigterm_while_a_group_join_waits_for_its_trainer_answers_503():
    """Hostile pass 12: a /init_weights_update_group waiting for a trainer that never comes got a 500
    on SIGTERM (its wait was cancelled past the endpoint's answers). Now 503 naming the shutdown."""
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo", "timeout_s": 60}
    code, answer, output = terminate_during(Server(), body, after_s=2.0, path="/init_weights_update_group")
    assert code == 143 and "Traceback" not in output, output[-3000:]
    assert answer is not None and answer.status_code == 503, answer and answer.text[:300]
    assert answer.json()["success"] is False and "the server is shutting down" in answer.json()["message"]


def test_a_join_whose_trainer_never_comes_is_400_and_one_line_per_message_in_the_log():
    """Hostile pass 12 (F09): the client got 400 JSON, but torch's c10d wrote ~39 lines of C++ frames
    to the server's log. Each of its messages is one line now, the frames summed up in one more."""
    server = Server()
    try:
        answer = post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "backend": "gloo", "timeout_s": 1})
        assert answer.status_code == 400 and answer.json()["success"] is False, answer.text[:300]
        assert "timed out" in answer.json()["message"]
        assert post(server, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).ok
        server.proc.terminate()
        server.proc.wait(30)
    finally:
        if server.proc.poll() is None:
            server.kill()
    deadline = time.time() + 10  # the filter process passes the lines on a moment later
    while "(torch's C++ stack trace, " not in "".join(server.output) and time.time() < deadline:
        time.sleep(0.1)
    output = "".join(server.output)
    assert "[c10d]" in output and "(torch's C++ stack trace, " in output, output[-3000:]
    assert "frame #" not in output and "Traceback" not in output, output[-3000:]


def test_a_sigint_the_server_was_started_to_ignore_is_ignored():
    """Hostile pass 11: started in the background of a script (SIGINT ignored, as bash does), the
    server stopped on SIGINT with exit 0 and no line: uvicorn took the signal over."""
    import signal

    server = Server(preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert server.proc.poll() is None and requests.get(server.url + "/health", timeout=5).status_code == 200
        server.proc.terminate()
        assert server.proc.wait(30) == 143
    finally:
        if server.proc.poll() is None:
            server.kill()


@pytest.mark.parametrize("flag, value, needle", [
    ("--max-batch-size", "100000000", "--max-batch-size 100000000: that many requests of 256 tokens need"),
    ("--max-context", "1000000000000", "--max-context 1000000000000: one request's decode cache at that length needs")])
def test_decode_caches_that_cannot_fit_are_refused_at_start(flag, value, needle):
    run = subprocess.run([sys.executable, "-m", "glmkit", "serve", "--checkpoint", str(CKPT), "--port", "0", flag, value],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2, run.stderr
    assert needle in run.stderr and "Traceback" not in run.stderr


def test_a_batch_opens_the_slots_free_memory_holds_and_refuses_a_request_none_holds(monkeypatch):
    """open_slots sizes its SlotBatch by the memory free when it opens: fewer slots than
    --max-batch-size when that is all that fits, and a 503 naming the sizes when not even one does."""
    from glmkit.serve import server as srv

    service = srv.EngineService(load_model(CKPT), "kda=torch", max_batch=8, max_context=4096)
    service.check_cache_fits()
    per_slot = service.engine.cache_bytes(1, 256)
    _, waiting = service.requests({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}})
    monkeypatch.setattr(srv, "cache_room", lambda device: 3.5 * per_slot)
    assert service.open_slots(waiting, lambda it: False).lengths.numel() == 3
    monkeypatch.setattr(srv, "cache_room", lambda device: 0.5 * per_slot)
    with pytest.raises(srv.RequestError, match=r"a request of 7 tokens needs .* GiB of decode cache") as refused:
        service.open_slots(waiting, lambda it: False)
    assert refused.value.status == 503


def test_keep_alive_requests_each_have_their_version_checked(server):
    """The 505 check looks at each request's first line once it is whole (not at every packet): a
    second request on the same connection is checked too, and a line sent a byte at a time as well."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = conn.recv(65536)
        for byte in b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n":
            conn.sendall(bytes([byte]))
        second = b""
        while piece := conn.recv(65536):
            second += piece
    assert first.startswith(b"HTTP/1.1 200"), first
    assert second.startswith(b"HTTP/1.1 505 HTTP Version Not Supported"), second
