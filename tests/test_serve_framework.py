"""`glmkit serve` driven the way the recipe's framework drives an SGLang engine.

`FrameworkClient` is written from the framework's call sequence (radixark/miles @ 31f1ca961:
`backends/sglang_utils/sglang_engine.py` startup probe, external-engine check and control calls,
`rollout/generate_utils/generate_endpoint_utils.py` payload and answer reading, `update_weight/
update_weight_from_distributed/{broadcast,mixin}.py` weight sync, `rollout/inference_rollout/
inference_rollout_train.py` abort at the end of a rollout, `generate_utils/prefill_logprobs.py`):
the same endpoints, methods, bodies and the same reading of the answers (tokens and log-probs from
`output_token_logprobs`, R3 reshaped to (len(tokens) - 1, num_layers, -1), the indexer's with
`indexer_topk_num_layers`). The server is the real process on 127.0.0.1, the process group real
(gloo on the CPU). What no test here can exercise: NCCL, a real SGLang or a real miles run.
"""

from __future__ import annotations

import base64
import json
import threading
import time

import numpy as np
import pytest
import requests
import torch
import torch.distributed as dist

from glmkit.launch.cluster import free_port
from glmkit.model.rollout import SamplingParams
from glmkit.serve.update_group import new_named_group

from tests.test_serve import CKPT, Server, local_engine, server, updates_root  # noqa: F401 (fixtures: a server of this module's own)

NUM_LAYERS = 4  # the tiny checkpoint: 3 dense layers, then one MoE + DSA layer
EOS = 2


class FrameworkClient:
    """The framework's side of the protocol, call for call."""

    def __init__(self, url: str):
        self.url = url
        self.headers = {"Content-Type": "application/json; charset=utf-8", "Authorization": "Bearer None"}

    # startup: GET /health_generate until 200, then GET /flush_cache until 200
    def wait_healthy(self, deadline_s: float = 60.0):
        end = time.time() + deadline_s
        for path in ("/health_generate", "/flush_cache"):
            while True:
                try:
                    if requests.get(self.url + path, headers=self.headers, timeout=30).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                assert time.time() < end, f"{path} never answered 200"
                time.sleep(0.2)

    def check_external(self, expected: dict):
        info = requests.get(self.url + "/get_server_info", timeout=30)
        info.raise_for_status()
        info = info.json()
        for key, value in expected.items():
            assert info.get(key) == value, (key, info.get(key), value)

    def control(self, path: str, payload=None):
        answer = requests.post(self.url + path, json=payload or {}, timeout=120)
        answer.raise_for_status()
        return answer.json()

    def generate(self, tokens: list, max_new_tokens: int, temperature: float = 1.0, r3: bool = True,
                 indexer: bool = True, seed: int | None = None):
        """The default rollout path's payload; the answer read as the framework reads it."""
        sampling = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "stop": None, "stop_token_ids": None,
                    "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False}
        if seed is not None:
            sampling["sampling_seed"] = seed
        sampling["max_new_tokens"] = max_new_tokens
        payload = {"input_ids": tokens, "sampling_params": sampling, "return_logprob": True,
                   "return_routed_experts": r3, "return_indexer_topk": indexer}
        answer = requests.post(self.url + "/generate", json=payload, headers={}, timeout=300)
        answer.raise_for_status()
        output = answer.json()
        sample = {"tokens": list(tokens), "response": output["text"], "logprobs": []}
        for item in output["meta_info"].get("output_token_logprobs") or []:
            sample["tokens"].append(item[1])
            sample["logprobs"].append(item[0])
        sample["status"] = {"length": "truncated", "abort": "aborted", "stop": "completed"}.get(
            output["meta_info"]["finish_reason"]["type"])
        sample["weight_version"] = str(output["meta_info"].get("weight_version"))
        num_tokens = len(sample["tokens"]) - 1
        if "routed_experts" in output["meta_info"]:
            flat = np.frombuffer(base64.b64decode(output["meta_info"]["routed_experts"].encode("ascii")),
                                 dtype=np.int32)
            sample["routed_experts"] = flat.reshape(num_tokens, NUM_LAYERS, len(flat) // (num_tokens * NUM_LAYERS))
        if "indexer_topk" in output["meta_info"]:
            layers = output["meta_info"]["indexer_topk_num_layers"]
            flat = np.frombuffer(base64.b64decode(output["meta_info"]["indexer_topk"].encode("ascii")), dtype=np.int32)
            sample["indexer_topk"] = flat.reshape(num_tokens, layers, len(flat) // (num_tokens * layers))
        sample["meta_info"] = output["meta_info"]
        return sample

    # weight sync, broadcast mode: the trainer (this process) is rank 0 of `miles-pp_0`
    def connect(self, port: int, group_name: str = "miles-pp_0"):
        try:  # stale groups are destroyed first; an error for an unknown one is swallowed
            self.control("/destroy_weights_update_group", {"group_name": group_name})
        except requests.RequestException:
            pass
        result = {}
        asking = threading.Thread(target=lambda: result.update(self.control("/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": "gloo"})))
        asking.start()
        group = new_named_group("gloo", "127.0.0.1", port, 2, 0, group_name, 120)
        asking.join(120)
        assert result.get("success") is True, result
        return group

    def flush_cache_retrying(self):
        for _ in range(60):
            if requests.get(self.url + "/flush_cache", timeout=30).status_code == 200:
                return
            time.sleep(1)
        raise TimeoutError("flush_cache")

    def update_weights(self, group, buckets: list[dict], version: str, group_name: str = "miles-pp_0"):
        self.control("/pause_generation", {"mode": "retract"})
        self.flush_cache_retrying()
        self.control("/begin_weight_update", {"selector": "all"})
        for bucket in buckets:
            payload = {"names": list(bucket), "dtypes": [str(t.dtype).replace("torch.", "") for t in bucket.values()],
                       "shapes": [list(t.shape) for t in bucket.values()], "group_name": group_name,
                       "flush_cache": False, "selector": "all", "weight_version": version}
            result = {}
            posting = threading.Thread(target=lambda: result.update(ok=requests.post(
                self.url + "/update_weights_from_distributed", json=payload, timeout=300)))
            posting.start()
            handles = [dist.broadcast(t.contiguous(), 0, group=group, async_op=True) for t in bucket.values()]
            for h in handles:
                h.wait()
            posting.join(300)
            result["ok"].raise_for_status()
        self.control("/update_weight_version", {"new_version": version, "abort_all_requests": False})
        self.control("/end_weight_update", {})
        answer = requests.post(self.url + "/continue_generation", json={}, timeout=60)
        answer.raise_for_status()


def test_startup_probe_and_the_external_engine_check(server):
    fw = FrameworkClient(server.url)
    fw.wait_healthy()
    fw.check_external({"host": "127.0.0.1", "port": server.port, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1,
                       "base_gpu_id": 0, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1,
                       "enable_memory_saver": False, "enable_return_routed_experts": True,
                       "enable_return_indexer_topk": True})
    assert requests.get(server.url + "/model_info", timeout=10).json()["weight_version"] == "default"
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 4096


def test_a_rollout_with_logprobs_and_r3_reads_as_the_framework_reads_it(server, local_engine):
    """Greedy, so the answer can be checked against the in-process engine stopping on EOS: the tokens
    the framework appends, its log-probs (5e-5: fp32 summation order over other batch shapes and thread
    counts; about 1e-6 typically, 1.06e-5 seen once on a loaded 2-core CI machine) and the routing it
    replays (exact; dense layers' rows 0)."""
    fw = FrameworkClient(server.url)
    prompts = [[1, 30 + i, 41, 42, 43 + i] for i in range(4)]
    samples = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: samples.__setitem__(i, fw.generate(prompts[i], 24, 0.0)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    want = local_engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(EOS,)),
                                 record_routing=True, record_topk=True)
    for prompt, sample, local in zip(prompts, samples, want):
        assert sample["tokens"] == prompt + local.tokens
        assert sample["status"] == ("completed" if local.tokens[-1] == EOS else "truncated")
        assert np.abs(np.array(sample["logprobs"]) - np.array(local.logprobs)).max() < 5e-5
        routed = sample["routed_experts"]
        assert routed.shape == (len(sample["tokens"]) - 1, NUM_LAYERS, 2) and not routed[:, :3].any()
        assert torch.equal(torch.from_numpy(routed[:, 3].astype("int64")), local.routing[3])
        topk = sample["indexer_topk"]
        assert topk.shape[:2] == (len(sample["tokens"]) - 1, 1)
        assert torch.equal(torch.from_numpy(topk[:, 0, :local.topk[3].shape[1]].astype("int64")), local.topk[3].long())
        assert sample["weight_version"] == "default"


def test_prefill_logprob_recompute_as_the_framework_asks_it(server):
    """--recompute-logprobs-via-prefill: a batched teacher-forced call; the framework takes the last
    response_len entries of input_token_logprobs, which must be the response's tokens, none null."""
    fw = FrameworkClient(server.url)
    sample = fw.generate([1, 20, 21, 22], 10, 1.0, r3=False, indexer=False, seed=3)
    prompt_len, response = 4, sample["tokens"][4:]
    requests.post(server.url + "/flush_cache", json={}, timeout=30)
    answer = requests.post(server.url + "/generate", json={
        "input_ids": [sample["tokens"], sample["tokens"]],
        "sampling_params": {"temperature": 0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 0,
                            "skip_special_tokens": False},
        "return_logprob": True, "logprob_start_len": prompt_len - 1}, timeout=120)
    answer.raise_for_status()
    for item in answer.json():
        tail = item["meta_info"]["input_token_logprobs"][-len(response):]
        assert [t for _, t, _ in tail] == response and all(lp is not None for lp, _, _ in tail)
    # the rollout sampled at temperature 1: the same log-probs (1e-5, fp32 summation order)
    assert np.abs(np.array([lp for lp, _, _ in tail]) - np.array(sample["logprobs"])).max() < 1e-5


def test_weight_sync_over_the_frameworks_group_with_a_retracted_request(server):
    """pause (retract) -> flush_cache -> begin -> two buckets over `miles-pp_0` (one broadcast per
    tensor, async, in the names' order; HF names as the framework converts them) -> weight version ->
    end -> continue. A request in flight when the pause came is retracted and goes on afterwards with
    the new weights; the next answers report the new version."""
    from safetensors.torch import load_file

    fw = FrameworkClient(server.url)
    group = fw.connect(free_port())
    before = fw.generate([1, 50, 51], 1, 0.0, r3=False, indexer=False)
    inflight = {}
    runner = threading.Thread(target=lambda: inflight.update(requests.post(server.url + "/generate", json={
        "input_ids": [1, 60, 61], "sampling_params": {"max_new_tokens": 1500, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True, "return_routed_experts": True}, timeout=300).json()))
    runner.start()
    time.sleep(0.5)
    weights = load_file(str(CKPT / "model.safetensors"))
    head = weights["lm_head.weight"]
    buckets = [{"model.layers.0.input_layernorm.weight": weights["model.language_model.layers.0.input_layernorm.weight"]},
               {"lm_head.weight": head * 1.5}]
    try:
        assert runner.is_alive()  # still decoding when the pause comes
        fw.update_weights(group, buckets, "1")
        runner.join(300)
        after = fw.generate([1, 50, 51], 1, 0.0, r3=False, indexer=False)
        assert after["weight_version"] == "1" and inflight["meta_info"]["weight_version"] == "1"
        assert abs(after["logprobs"][0] - before["logprobs"][0]) > 1e-3
        meta = inflight["meta_info"]
        assert meta["completion_tokens"] == 1500 and meta["num_retractions"] == 1
        rows = 3 + 1500 - 1  # the retracted request's routing covers every token it was fed
        assert len(base64.b64decode(meta["routed_experts"])) == rows * NUM_LAYERS * 2 * 4
        fw.update_weights(group, [{"lm_head.weight": head}], "2")
        restored = fw.generate([1, 50, 51], 1, 0.0, r3=False, indexer=False)
        assert abs(restored["logprobs"][0] - before["logprobs"][0]) < 1e-6 and restored["weight_version"] == "2"
    finally:
        fw.control("/destroy_weights_update_group", {"group_name": "miles-pp_0"})
        dist.destroy_process_group(group)


def test_retraction_regenerates_from_the_tokens_so_far(server):
    """A paused (retract) request is prefilled again from prompt + its tokens on continue: greedy, the
    whole answer equals an uninterrupted one (same weights), with num_retractions counted."""
    body = {"input_ids": [1, 70, 71], "sampling_params": {"max_new_tokens": 300, "temperature": 0,
                                                          "ignore_eos": True}, "return_logprob": True}
    straight = requests.post(server.url + "/generate", json=body, timeout=300).json()
    got = {}
    runner = threading.Thread(target=lambda: got.update(requests.post(server.url + "/generate", json=body,
                                                                      timeout=300).json()))
    runner.start()
    time.sleep(0.3)
    assert requests.post(server.url + "/pause_generation", json={"mode": "retract"}, timeout=60).status_code == 200
    assert requests.get(server.url + "/flush_cache", timeout=30).status_code == 200  # retracted: idle
    time.sleep(0.3)
    requests.post(server.url + "/continue_generation", json={}, timeout=60)
    runner.join(300)
    assert got["output_ids"] == straight["output_ids"]
    assert got["meta_info"]["num_retractions"] == 1
    a = np.array([lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]])
    b = np.array([lp for lp, _, _ in straight["meta_info"]["output_token_logprobs"]])
    assert np.abs(a - b).max() < 1e-4  # prefill vs decode of the same tokens: fp32 summation order


def test_disk_updates_succeed_and_fail_as_the_framework_reads_them(server, updates_root, tmp_path):
    from glmkit.serve.client import write_weights_dir
    from safetensors.torch import load_file

    fw = FrameworkClient(server.url)
    head = load_file(str(CKPT / "model.safetensors"))["lm_head.weight"]
    path = write_weights_dir({"lm_head.weight": head}, updates_root, "step-1")
    answer = fw.control("/update_weights_from_disk", {"model_path": str(path), "weight_version": "disk-1"})
    assert answer["success"] is True
    assert requests.get(server.url + "/get_weight_version", timeout=10).json()["weight_version"] == "disk-1"
    failed = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "none")},
                           timeout=60)
    assert failed.status_code == 400 and failed.json()["success"] is False and failed.json()["message"]


def test_abort_all_ends_every_request_with_its_partial_answer(server):
    fw = FrameworkClient(server.url)
    results = [None] * 3

    def ask(i):
        results[i] = requests.post(server.url + "/generate", json={
            "input_ids": [1, 80 + i], "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
            "return_logprob": True}, timeout=300)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    assert requests.post(server.url + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
    for t in threads:
        t.join(120)
    for answer in results:
        assert answer.status_code == 200
        meta = answer.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] < 3000
    fw.wait_healthy()


def test_offload_and_onload_calls_answer_null(server):
    for path, tags in (("/release_memory_occupation", None), ("/resume_memory_occupation", ["weights"]),
                       ("/resume_memory_occupation", ["kv_cache", "cuda_graph"]),
                       ("/release_memory_occupation", ["cuda_graph", "kv_cache", "weights"])):
        answer = requests.post(server.url + path, json={"tags": tags}, timeout=30)
        assert answer.status_code == 200 and answer.json() is None
    bad = requests.post(server.url + "/release_memory_occupation", json={"tags": ["gpu"]}, timeout=30)
    assert bad.status_code == 400 and "allowed: weights, kv_cache, cuda_graph" in bad.json()["error"]["message"]


def test_streaming_is_sglangs_cumulative_server_sent_events(server):
    body = {"input_ids": [1, 90, 91], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            "return_logprob": True}
    whole = requests.post(server.url + "/generate", json=body, timeout=60).json()
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert len(chunks) == 12  # stream_interval 1: a chunk a token
    for i, chunk in enumerate(chunks):  # cumulative: every chunk holds all tokens so far
        assert chunk["output_ids"] == whole["output_ids"][:i + 1]
        assert (chunk["meta_info"]["finish_reason"] is None) == (i < 11)
    assert chunks[-1]["text"] == whole["text"]
    batched = requests.post(server.url + "/generate", json={
        "input_ids": [[1, 5], [1, 6]], "sampling_params": {"max_new_tokens": 4, "stream_interval": 2,
                                                            "ignore_eos": True}, "stream": True}, timeout=60)
    data = [json.loads(x.removeprefix("data: ")) for x in batched.text.split("\n\n") if x and x != "data: [DONE]"]
    assert {c["index"] for c in data} == {0, 1} and all(len(c["output_ids"]) in (1, 3, 4) for c in data)
    bad = requests.post(server.url + "/generate", json={**body, "stream": True, "sampling_params": {"top_p": 2}},
                        timeout=60)
    assert bad.status_code == 200 and "top_p must be in (0, 1]" in bad.text and bad.text.endswith("data: [DONE]\n\n")


def test_a_short_request_is_answered_while_a_long_one_decodes(server):
    """Different sampling settings share the decode steps: a 4-token greedy request sent while a
    2,000-token sampled one runs comes back before it."""
    long_answer = {}
    runner = threading.Thread(target=lambda: long_answer.update(requests.post(server.url + "/generate", json={
        "input_ids": [1, 100], "sampling_params": {"max_new_tokens": 2000, "temperature": 0.9, "top_k": 50,
                                                   "ignore_eos": True}}, timeout=600).json()))
    runner.start()
    time.sleep(0.5)
    short = requests.post(server.url + "/generate", json={"input_ids": [1, 101], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "repetition_penalty": 1.2}}, timeout=60)
    assert short.status_code == 200 and len(short.json()["output_ids"]) == 4
    assert runner.is_alive() and not long_answer
    requests.post(server.url + "/abort_request", json={"abort_all": True}, timeout=30)
    runner.join(120)


def test_a_client_that_disconnects_frees_its_slot(server):
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(server.url + "/generate", json={"input_ids": [1, 110], "sampling_params": {
            "max_new_tokens": 3000, "ignore_eos": True}}, timeout=1.0)
    deadline = time.time() + 10
    while time.time() < deadline and requests.get(server.url + "/flush_cache", timeout=10).status_code != 200:
        time.sleep(0.1)
    assert requests.get(server.url + "/flush_cache", timeout=10).status_code == 200  # nothing left running


def test_a_rendezvous_nobody_joins_fails_bounded_while_the_engine_serves(server):
    failed = {}
    started = time.time()
    joining = threading.Thread(target=lambda: failed.update(answer=requests.post(
        server.url + "/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "nobody", "backend": "gloo", "timeout_s": 3}, timeout=120)))
    joining.start()
    served = requests.post(server.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
        "max_new_tokens": 2}}, timeout=30)
    assert served.status_code == 200 and joining.is_alive()  # answered while the rendezvous waits
    joining.join(120)
    answer = failed["answer"]
    assert answer.status_code == 400 and answer.json()["success"] is False
    assert "Failed to initialize custom process group" in answer.json()["message"]
    assert time.time() - started < 60


def test_bodies_and_batches_are_bounded_and_no_input_gets_a_500():
    s = Server("--max-body-bytes", "100000", "--max-batch-size", "4")
    try:
        big = requests.post(s.url + "/generate", json={"input_ids": [1] * 40000}, timeout=60)
        assert big.status_code == 413 and "limit of 100000 bytes" in big.json()["error"]["message"]
        hostile = [b"", b"null", b"[]", b"{}", b'"x"', b"1e999", b'{"input_ids": [1e999]}', b'{"input_ids": [[[]]]}',
                   b'{"input_ids": [true]}', b'{"input_ids": [1], "sampling_params": null}',
                   b'{"input_ids": [1], "sampling_params": [1]}', b'{"text": [1, 2]}', b'{"input_ids": {"a": 1}}',
                   b'{"input_ids": [1], "rid": 5}', b'{"input_ids": [1], "stream": "yes"}', b"\xff\xfe",
                   b'{"input_ids": [1], "sampling_params": {"logit_bias": {"x": 1}}}',
                   b'{"input_ids": [1], "sampling_params": {"stop": [""]}}',
                   b'{"input_ids": [1], "sampling_params": {"stop": "a"}, "return_logprob": "yes"}']
        for path in ("/generate", "/abort_request", "/update_weights_from_distributed", "/init_weights_update_group",
                     "/update_weights_from_disk", "/update_weights_from_tensor", "/get_weights_by_name",
                     "/pause_generation", "/update_weight_version", "/release_memory_occupation"):
            for body in hostile:
                answer = requests.post(s.url + path, data=body, headers={"content-type": "application/json"},
                                       timeout=60)
                assert answer.status_code < 500, (path, body, answer.status_code, answer.text)
        requests.post(s.url + "/continue_generation", json={}, timeout=30)
        assert requests.get(s.url + "/health_generate", timeout=60).status_code == 200
    finally:
        s.kill()


def test_n_samples_top_logprobs_and_stop_strings(server):
    answers = requests.post(server.url + "/generate", json={
        "text": "1+1=", "sampling_params": {"max_new_tokens": 6, "n": 3, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True, "top_logprobs_num": 3}, timeout=60).json()
    assert isinstance(answers, list) and len(answers) == 3 and len({a["meta_info"]["id"] for a in answers}) == 3
    for a in answers:
        tops = a["meta_info"]["output_top_logprobs"]
        assert len(tops) == 6 and all(len(row) == 3 and row[0][0] >= row[1][0] >= row[2][0] for row in tops)
    greedy = requests.post(server.url + "/generate", json={
        "text": "1+1=", "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}},
        timeout=60).json()
    text = greedy["text"]
    stop = text[3:5]  # a piece of what greedy decoding writes
    for keep in (False, True):
        cut = requests.post(server.url + "/generate", json={"text": "1+1=", "sampling_params": {
            "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop], "no_stop_trim": keep}},
            timeout=60).json()
        at = text.find(stop)
        assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert cut["text"] == (text[:at + len(stop)] if keep else text[:at])
        assert cut["output_ids"] == greedy["output_ids"][:len(cut["output_ids"])]  # output_ids keep the stop


def test_health_generate_is_200_only_when_a_token_comes():
    """Paused (so nothing generates), /health_generate answers 503 after SGLang's health timeout (here
    2 s through SGLang's own variable); after continue, 200 again. /health only says the server runs."""
    s = Server(env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    try:
        assert requests.get(s.url + "/health_generate", timeout=30).status_code == 200
        requests.post(s.url + "/pause_generation", json={"mode": "in_place"}, timeout=30)
        started = time.time()
        assert requests.get(s.url + "/health_generate", timeout=30).status_code == 503
        assert 1.5 < time.time() - started < 15
        assert requests.get(s.url + "/health", timeout=30).status_code == 200
        requests.post(s.url + "/continue_generation", json={}, timeout=30)
        assert requests.get(s.url + "/health_generate", timeout=30).status_code == 200
    finally:
        s.kill()


def test_an_id_in_flight_is_refused_and_an_unlimited_request_is_bounded_by_the_context(server):
    runner = threading.Thread(target=lambda: requests.post(server.url + "/generate", json={
        "input_ids": [1, 120], "rid": "busy-id", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}},
        timeout=300))
    runner.start()
    time.sleep(0.5)
    again = requests.post(server.url + "/generate", json={"input_ids": [1, 121], "rid": "busy-id"}, timeout=30)
    assert again.status_code == 400 and "Duplicate request ID detected: busy-id" in again.json()["error"]["message"]
    requests.post(server.url + "/abort_request", json={"rid": "busy-id"}, timeout=30)
    runner.join(120)
    # max_new_tokens null: no limit of its own, the server's --max-context (4096) bounds it
    unlimited = requests.post(server.url + "/generate", json={"input_ids": [1] * 4090, "sampling_params": {
        "max_new_tokens": None, "ignore_eos": True, "temperature": 0}}, timeout=300).json()
    assert unlimited["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_a_second_pause_with_another_mode_takes_effect(server):
    """in_place keeps the running request in its slot (flush_cache refuses); a following retract takes
    it out at once (flush_cache succeeds); continue lets it finish, retracted once."""
    got = {}
    runner = threading.Thread(target=lambda: got.update(requests.post(server.url + "/generate", json={
        "input_ids": [1, 130], "sampling_params": {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0}},
        timeout=300).json()))
    runner.start()
    time.sleep(0.5)
    started = time.time()
    assert requests.post(server.url + "/pause_generation", json={"mode": "in_place"}, timeout=60).status_code == 200
    assert requests.get(server.url + "/flush_cache", timeout=30).status_code == 400
    assert requests.post(server.url + "/pause_generation", json={"mode": "retract"}, timeout=60).status_code == 200
    assert time.time() - started < 20  # acknowledged, not the 60 s wait
    assert requests.get(server.url + "/flush_cache", timeout=30).status_code == 200
    requests.post(server.url + "/continue_generation", json={}, timeout=30)
    runner.join(300)
    assert got["meta_info"]["completion_tokens"] == 600 and got["meta_info"]["num_retractions"] == 1
