"""glmkit rollout-data: the framework's --save-debug-rollout-data file, one bad sample traced to its side
(engine or trainer) and its tokens; files that need pickle refused."""

import sys
from pathlib import Path

sys.modules.setdefault("fla", None)

import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from glmkit.cli import main
from glmkit.model import RolloutEngine, SamplingParams, load_model
from glmkit.parity.rollout_data import attribute, load_rollout_data, load_trainer_logprobs
from tests.test_serve import CKPT

PROMPTS = [[5, 17, 300, 41, 9], [77, 3, 3, 12], [900, 14, 15, 16, 17, 18], [2 + 40, 60, 80]]
BROKEN_SAMPLE = 2  # its engine ran with a broken weight sync (lm_head x 1.5)


def _completions(model, prompts, seed):
    return RolloutEngine(model, "kda=torch").generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12),
                                                      seed=seed, record_routing=True)


def _sample(k, completion, layers):
    """A sample as miles' Sample.to_dict() saves it (all its fields; numpy routing as with R3)."""
    tokens = completion.prompt + completion.tokens
    routed = np.zeros((len(tokens) - 1, layers, 2), dtype=np.int32)
    return {"group_index": k // 2, "index": 100 + k, "rollout_id": 7, "prompt": [{"role": "user", "content": "q"}],
            "tokens": tokens, "multimodal_inputs": None, "multimodal_train_inputs": None, "response": "x",
            "response_length": len(completion.tokens), "label": "4", "reward": np.float64(1.0),
            "loss_mask": [1] * len(completion.tokens), "weight_versions": ["3"],
            "rollout_log_probs": [float(v) for v in completion.logprobs], "rollout_routed_experts": routed,
            "rollout_indexer_topk": None, "remove_sample": False, "teacher_log_probs": None, "opd_reverse_kl": None,
            "status": "completed", "metadata": {}, "generate_function_path": None, "train_metadata": None,
            "adapter": None, "reward_spec": None, "routing_key": None, "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": len(completion.tokens)},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(completion.prompt)}}


@pytest.fixture(scope="module")
def rollout_file(tmp_path_factory):
    """Rollout data whose sample 2 came from an engine with a broken weight sync."""
    model = load_model(CKPT)
    good = _completions(model, PROMPTS, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    broken = _completions(model, [PROMPTS[BROKEN_SAMPLE]], seed=12)[0]
    completions = [broken if k == BROKEN_SAMPLE else c for k, c in enumerate(good)]
    samples = [_sample(k, c, model.config.num_hidden_layers) for k, c in enumerate(completions)]
    path = tmp_path_factory.mktemp("dump") / "rollout_data" / "7.pt"
    path.parent.mkdir()
    torch.save({"rollout_id": 7, "metadata": {}, "samples": samples}, path)
    return path


def test_the_engine_side_of_a_bad_sample_is_named(rollout_file, tmp_path, capsys):
    out = tmp_path / "attribution.json"
    assert main(["rollout-data", str(rollout_file), "--checkpoint", str(CKPT), "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    departs = {s["index"]: s["departs"] for s in data["samples"]}
    assert departs == {100: "none", 101: "none", 102: "engine", 103: "none"}, departs
    bad = data["samples"][BROKEN_SAMPLE]
    # the healthy side agrees with the reference to fp32 rounding on CPU (1e-4: float32 log-softmax of two
    # different kernels over a 1024-token vocabulary); the broken engine is far off
    assert bad["trainer_vs_reference"] < 1e-4 and bad["engine_vs_reference"] > 0.02
    assert all(s["engine_vs_reference"] < 1e-4 for s in data["samples"] if s["index"] != 102)
    assert len(bad["worst_tokens"]) == 8 and bad["worst_tokens"][0]["engine_abs_diff"] >= bad["worst_tokens"][-1]["engine_abs_diff"]
    # the recipe's number, recomputed here from the file and an independent train-path run: per sample the
    # mean of |trainer - engine| over the response, then the mean over samples (fp32 log-probs: 1e-6 rel)
    from glmkit.model import TrainPath

    saved = torch.load(rollout_file, weights_only=False)["samples"]
    train = TrainPath(load_model(CKPT), "kda=torch")
    per_sample = []
    for s in saved:
        with torch.no_grad():
            lp = train.forward([s["tokens"]]).logprobs[len(s["tokens"]) - s["response_length"] - 1:-1]
        per_sample.append((lp.double() - torch.tensor(s["rollout_log_probs"], dtype=torch.float64)).abs().mean().item())
    assert data["logprob_abs_diff"] == pytest.approx(np.mean(per_sample), rel=1e-6)
    assert data["departs"] == {"engine": 1, "trainer": 0, "both": 0, "none": 3}
    assert len(data["position_profile"]["engine"]) == len(data["position_profile"]["bin_start"])
    assert "glmkit's train path" in data["trainer_source"]
    assert "verdict: fail" in capsys.readouterr().out


def test_the_trainer_side_and_its_tokens_from_the_framework_train_data(rollout_file, tmp_path):
    """The trainer's own log-probs (its train data file): a sample whose trainer log-probs are off at two
    tokens departs on the trainer side, those tokens first in its worst list."""
    raw = torch.load(rollout_file, weights_only=False)
    samples = [s for k, s in enumerate(raw["samples"]) if k != BROKEN_SAMPLE]
    raw["samples"] = samples
    healthy = tmp_path / "healthy.pt"
    torch.save(raw, healthy)
    data = load_rollout_data(healthy)
    logp = [torch.tensor(s.engine) for s in data.samples]
    logp[1][3] -= 0.9
    logp[1][1] -= 0.6
    train_file = tmp_path / "train_data" / "7_0.pt"
    train_file.parent.mkdir()
    torch.save({"rollout_id": 7, "rank": 0, "cp_rank": 0, "cp_size": 1, "qkv_format": "thd",
                "rollout_data": {"tokens": [torch.tensor(s.tokens) for s in data.samples], "log_probs": logp,
                                 "response_lengths": [s.response_length for s in data.samples]}}, train_file)
    result = attribute(data, CKPT, trainer_logprobs=load_trainer_logprobs(train_file), progress=False)
    assert [a.departs for a in result.samples] == ["none", "trainer", "none"]
    worst = result.samples[1].worst_tokens
    assert [w["position"] for w in worst[:2]] == [3, 1] and worst[0]["trainer_abs_diff"] > 0.8
    assert "train data" in result.trainer_source
    assert result.verdict == "fail"


def test_masked_tokens_do_not_count(rollout_file, tmp_path):
    raw = torch.load(rollout_file, weights_only=False)
    sample = raw["samples"][0]
    sample["rollout_log_probs"][-1] -= 5.0  # far off, but not trained on
    sample["loss_mask"][-1] = 0
    raw["samples"] = [sample]
    path = tmp_path / "masked.pt"
    torch.save(raw, path)
    result = attribute(load_rollout_data(path), CKPT, progress=False)
    assert result.verdict == "pass" and result.samples[0].engine_vs_reference < 1e-4
    assert all(w["position"] != sample["response_length"] - 1 for w in result.samples[0].worst_tokens)


def test_nonfinite_log_probs_are_shown_as_such_not_as_a_zero_difference(rollout_file, tmp_path):
    """The framework's metric zeroes NaN/inf differences; the table must not show such a side as agreeing."""
    raw = torch.load(rollout_file, weights_only=False)
    sample = raw["samples"][0]
    sample["rollout_log_probs"][2] = float("nan")
    sample["rollout_log_probs"][4] = float("-inf")
    sample["rollout_log_probs"][5] = 1e308  # hostile pass 10: past float32, it made the mean inf
    raw["samples"] = [sample]
    path = tmp_path / "nan.pt"
    torch.save(raw, path)
    result = attribute(load_rollout_data(path), CKPT, progress=False)
    a = result.samples[0]
    assert (a.engine_nonfinite, a.trainer_nonfinite, a.departs) == (3, 0, "engine")
    assert a.engine_vs_reference < 1e-4  # the framework's zeroing, kept for its number
    row = next(line for line in result.text().splitlines() if line.strip().startswith("100 "))
    assert row.split()[1] == "nonfinite:3" and row.split()[3] == "nonfinite:3" and row.split()[-1] == "engine"
    assert "3 counted log-probs are NaN or infinite" in result.text()
    assert result.to_json()["samples"][0]["engine_nonfinite_tokens"] == 3 and result.verdict == "fail"
    assert result.to_json()["logprob_abs_diff"] < 1  # the framework's metric zeroes what is not finite


@pytest.mark.parametrize("damage, message", [
    ("lengths", "4 token sequences but 3 log-prob lists"),
    ("nested", "log_probs[0]: expected a flat list"),
    ("cp", "cp_size: '2'; expected a positive integer"),
    ("tokens", "tokens[1]: expected a flat list of token ids"),
])
def test_bad_train_data_is_exit_2_with_the_reason(damage, message, rollout_file, tmp_path, capsys):
    data = load_rollout_data(rollout_file)
    dump = {"rollout_id": 7, "rank": 0, "cp_rank": 0, "cp_size": 1, "qkv_format": "thd",
            "rollout_data": {"tokens": [torch.tensor(s.tokens) for s in data.samples],
                             "log_probs": [torch.tensor(s.engine) for s in data.samples]}}
    if damage == "lengths":
        dump["rollout_data"]["log_probs"].pop()
    elif damage == "nested":
        dump["rollout_data"]["log_probs"][0] = torch.zeros(2, 3)
    elif damage == "cp":
        dump["cp_size"] = "2"
    elif damage == "tokens":
        dump["rollout_data"]["tokens"][1] = 5
    path = tmp_path / "train.pt"
    torch.save(dump, path)
    assert main(["rollout-data", str(rollout_file), "--checkpoint", str(CKPT), "--train-data", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@dataclass(frozen=True)
class AdapterRef:  # stands in for miles' multi-LoRA class: loading it would need pickle
    name: str
    slot: int


@pytest.mark.parametrize("damage, message", [
    ("pickle", "needs pickle to read (" + __name__ + ".AdapterRef)"),
    ("not-dict", "expected a dict with a 'samples' list"),
    ("short-logprobs", "samples[1].rollout_log_probs: 3 values for"),
    ("no-logprobs", "samples[0]: no 'rollout_log_probs'"),
    ("vocab", "outside the checkpoint's vocabulary of 1024"),
    ("length", "samples[0].response_length"),
    ("empty", "holds no samples"),
    ("garbage", "not a readable torch.save file"),
    # hostile pass 12: these were "expected 1 to -1", a pass over nothing compared, and True read as 1.0
    ("no-tokens", "samples[0].tokens: 0 token(s); a sample holds at least 2 (its prompt and its response)"),
    ("masked-out", "every sample's loss_mask is all zeros: no response token is counted"),
    ("bool-logprobs", "samples[0].rollout_log_probs: expected a list of"),
])
def test_bad_files_are_exit_2_with_the_reason(damage, message, rollout_file, tmp_path, capsys):
    raw = torch.load(rollout_file, weights_only=False)
    path = tmp_path / "bad.pt"
    if damage == "pickle":
        raw["samples"][0]["adapter"] = AdapterRef("math", 0)
    elif damage == "not-dict":
        raw = [1, 2]
    elif damage == "short-logprobs":
        raw["samples"][1]["rollout_log_probs"] = [0.0] * 3
    elif damage == "no-logprobs":
        raw["samples"][0]["rollout_log_probs"] = None
    elif damage == "vocab":
        raw["samples"][0]["tokens"][0] = 5000
    elif damage == "length":
        raw["samples"][0]["response_length"] = len(raw["samples"][0]["tokens"])
    elif damage == "empty":
        raw["samples"] = []
    elif damage == "no-tokens":
        raw["samples"][0]["tokens"] = []
    elif damage == "masked-out":
        for sample in raw["samples"]:
            sample["loss_mask"] = [False] * sample["response_length"]  # booleans are a mask's values
    elif damage == "bool-logprobs":
        raw["samples"][0]["rollout_log_probs"] = [True] * raw["samples"][0]["response_length"]
    if damage == "garbage":
        path.write_bytes(b"\x00not torch")
    else:
        torch.save(raw, path)
    assert main(["rollout-data", str(path), "--checkpoint", str(CKPT)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_pickle_payload_is_never_run(tmp_path, capsys, monkeypatch):
    import os

    class RunsCode:
        def __reduce__(self):
            return (os.system, ("touch pwned-by-rollout-data",))

    path = tmp_path / "evil.pt"
    torch.save({"rollout_id": 1, "samples": [RunsCode()]}, path)
    monkeypatch.chdir(tmp_path)
    assert main(["rollout-data", str(path), "--checkpoint", str(CKPT)]) == 2
    assert "needs pickle to read" in capsys.readouterr().err
    assert not (tmp_path / "pwned-by-rollout-data").exists()


def test_notebook_01_traces_the_rollout_data_and_its_report_says_which_side(rollout_file, tmp_path, capsys):
    from glmkit.notebook import main as report_main
    from tests.test_notebooks import INLINE_PNG, LAYER_PARITY, report_header
    from tests.test_report_offline import assert_offline

    out = tmp_path / "report"
    assert report_main(["report", str(LAYER_PARITY), "--out", str(out), "-p", "checkpoint", str(CKPT),
                        "-p", "rollout_data", str(rollout_file)]) == 1
    assert "verdict: fail" in capsys.readouterr().out
    data = json.loads((out / "parity.json").read_text())
    assert data["mode"] == "rollout data" and data["departs"]["engine"] == 1
    assert [s["departs"] for s in data["samples"]] == ["none", "none", "engine", "none"]
    text = (out / "01_layer_parity.html").read_text()
    header = report_header(text)
    assert "1 of 4 samples depart: 1 on the engine side" in header
    # the views: banner and table as HTML, per-token trace and position profile as PNG; no layer parity
    assert len(INLINE_PNG.findall(text)) == 2
    assert re.search(r"<tr style=\"color:#b3261e;font-weight:bold\"><td>102</td>.*?<td>engine</td></tr>", text)
    assert "first divergence" not in header
    assert_offline(text)


def test_the_reference_head_in_chunks_equals_one_pass(rollout_file, monkeypatch):
    """Chunking the reference's head (bounded memory at real lengths) changes nothing: the same rows
    through the same head; only the matmul's blocking over rows changes, so fp32 rounding: 1e-5 absolute
    on log-probs of magnitude ~7 (log of a 1024-token vocabulary) is about ten ulps."""
    from glmkit.parity import rollout_data as module

    data = load_rollout_data(rollout_file)
    whole = attribute(data, CKPT, progress=False)
    monkeypatch.setattr(module, "LOGIT_ROWS", 3)
    chunked = attribute(data, CKPT, progress=False)
    for a, b in zip(whole.samples, chunked.samples):
        assert len(a.reference) == len(b.reference) == a.sample.response_length
        assert max(abs(x - y) for x, y in zip(a.reference, b.reference)) < 1e-5


def nested_lists(depth: int) -> list:
    outer = inner = []
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return outer


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(rollout_id=torch.tensor([1, 2])), "rollout_id: a Tensor; expected a number or a string"),
    (lambda d: d.update(rollout_id=b"\xff"), "rollout_id: a bytes"),
    (lambda d: d["samples"][0].update(index=torch.tensor([1, 2])), r"samples\[0\].index: a Tensor"),
    (lambda d: d.update(metadata=torch.ones(3)), "metadata is a Tensor; the framework writes a dict"),
    (lambda d: d["samples"][0].update(rollout_log_probs=[10 ** 400, 0.0]), "a number too large for a float"),
    (lambda d: d["samples"][0].update(tokens=torch.empty(4, dtype=torch.long, device="meta")),
     r"tokens: a meta \(data-less\) tensor"),
    # Hostile pass 5: 2**31 elements over one stored element; reading them ran the machine out of memory.
    (lambda d: d["samples"][0].update(tokens=torch.ones(1, dtype=torch.long).expand(2 ** 31)),
     r"samples\[0\]\.tokens: an expanded view of 2147483648 elements over 1 stored"),
    (lambda d: d["samples"][0].update(rollout_log_probs=torch.zeros(1).expand(2 ** 30)),
     r"rollout_log_probs: an expanded view"),
    # Hostile pass 6: the bound counted bytes (an int8 view of 2**28 passed, then widened to int64) and
    # views one at a time (12 of 2**25 each passed); quantized tensors ended in exit 3
    (lambda d: d["samples"][0].update(tokens=torch.ones(1, dtype=torch.int8).expand(2 ** 28)),
     r"tokens: an expanded view of 268435456 elements"),
    (lambda d: d.update(samples=[dict(d["samples"][0], tokens=torch.ones(1, dtype=torch.long).expand(2 ** 23))
                                 for _ in range(12)]), r"in the file's expanded views so far"),
    (lambda d: d["samples"][0].update(tokens=torch.quantize_per_tensor(torch.ones(4), 1.0, 0, torch.quint8)),
     r"tokens: a quantized tensor; glmkit reads dense tensors"),
    # Hostile pass 12: a status nested 3000 lists deep ended in exit 3 (RecursionError in its repr)
    (lambda d: d["samples"][0].update(status=nested_lists(3000)), r"samples\[0\]\.status: a list; expected a number"),
])
def test_values_the_report_writes_are_plain_or_refused_before_any_model_runs(tmp_path, edit, message):
    """Hostile pass 4: these ended in exit 3 (a TypeError writing the JSON, after every sample was
    recomputed). They are refused when the file is read; a numpy scalar id is read as its number."""
    import numpy as np

    from glmkit.parity.rollout_data import load_rollout_data

    data = {"rollout_id": np.int64(3), "samples": [{"tokens": [1, 2, 3, 4], "response_length": 2,
                                                   "rollout_log_probs": [-1.0, -2.0], "index": np.int64(7)}]}
    torch.save(data, tmp_path / "ok.pt")
    read = load_rollout_data(tmp_path / "ok.pt", 64)
    assert (read.rollout_id, read.samples[0].index) == (3, 7) and type(read.rollout_id) is int
    edit(data)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # pickling a deeply nested value recurses (torch's safe reader does not)
    try:
        torch.save(data, tmp_path / "bad.pt")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ValueError, match=message):
        load_rollout_data(tmp_path / "bad.pt", 64)


def test_memory_the_machine_cannot_give_is_the_environments_error(capsys):
    """A sample long enough that the reference cannot allocate its activations ended in exit 3; torch's
    CPU allocator failure, its CUDA out-of-memory error and MemoryError are exit 4, one line."""
    from glmkit.cli import EXIT_ENVIRONMENT, _answer_failure

    for err in (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                             "you tried to allocate 6554648576 bytes. Error code 12 (Cannot allocate memory)"),
                torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB"), MemoryError()):
        assert _answer_failure("rollout-data", err) == EXIT_ENVIRONMENT
        assert capsys.readouterr().err.startswith("glmkit rollout-data: environment error: out of memory (")


@pytest.mark.parametrize("value, message", [
    (np.array([3, 4]), "response_length: a ndarray of shape [2] and dtype int64; expected an integer from 1 to"),
    (torch.tensor([3, 4]), "response_length: a Tensor of shape [2] and dtype int64; expected an integer from 1 to"),
    (torch.tensor(2.7), "response_length: a Tensor of shape [] and dtype float32; expected an integer from 1 to"),
    (2.7, "response_length: 2.7; expected an integer from 1 to"),
])
def test_response_lengths_that_are_not_one_integer_are_named(value, message, rollout_file, tmp_path, capsys):
    """Hostile pass 9: a numpy array was exit 3 (TypeError), a tensor of several values an unnamed
    message, and a float tensor 2.7 was read as 2. Each is named with the file, sample and field."""
    raw = torch.load(rollout_file, weights_only=False)
    raw["samples"][0]["response_length"] = value
    path = tmp_path / "odd.pt"
    torch.save(raw, path)
    assert main(["rollout-data", str(path), "--checkpoint", str(CKPT)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: samples[0].{message}" in err and err.count("\n") == 1, err
    raw["samples"][0]["response_length"] = np.int64(raw["samples"][1]["response_length"])  # a numpy scalar reads
    raw["samples"][0]["tokens"] = raw["samples"][1]["tokens"]
    raw["samples"][0]["rollout_log_probs"] = raw["samples"][1]["rollout_log_probs"]
    raw["samples"][0]["loss_mask"] = raw["samples"][1].get("loss_mask")
    torch.save(raw, path)
    assert load_rollout_data(path).samples[0].response_length == raw["samples"][1]["response_length"]


def test_a_sample_no_memory_here_can_hold_is_refused_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """Hostile pass 10: a 190 KB file holding one 24000-token sample took the reference to 24 GB (its
    eager attention holds every head's T x T scores). The longest sample is checked against the memory
    free first (here the machine is said to have 8 GiB free, as a CI runner might), exit 2 naming it."""
    import glmkit.bounds

    monkeypatch.setattr(glmkit.bounds, "free_bytes", lambda device: 8 * 2 ** 30)
    sample = {"tokens": list(range(1, 13)) * 2000, "response_length": 10, "rollout_log_probs": [-1.0] * 10,
              "loss_mask": [1] * 10, "reward": 0.0}
    path = tmp_path / "long.pt"
    short = {**sample, "tokens": list(range(5, 25)), "response_length": 2, "rollout_log_probs": [-1.0] * 2,
             "loss_mask": [1] * 2}
    torch.save({"rollout_id": 0, "samples": [short, sample]}, path)
    assert main(["rollout-data", str(path), "--checkpoint", str(CKPT)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"long\.pt: samples\[1\]: 24000 tokens through the reference need at least [0-9.]+ GiB "
                     r"\(attention scores grow with the square of the length\) and cpu has 8 GiB free", err), err


def test_a_raw_pickle_is_refused_in_one_line(tmp_path):
    """Hostile pass 10: a legacy (non-zip) pickle printed two lines of torch's UserWarning first (seen
    from the shell: run as its own process)."""
    import pickle
    import subprocess

    path = tmp_path / "raw.pt"
    path.write_bytes(pickle.dumps({"samples": [1, 2, 3]}))
    done = subprocess.run([sys.executable, "-m", "glmkit", "rollout-data", str(path), "--checkpoint", str(CKPT)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "raw.pt" in done.stderr, done.stderr


def test_one_sample_the_file_refers_to_many_times_is_read_once(tmp_path):
    """Hostile pass 12: a 500 KB file referring to one sample dict 250000 times (torch.save stores a
    shared object once) took 167 s and 2.9 GB to read: every place was walked and copied. Each stored
    object is now read once and shared; an expanded view inside it still counts at every place."""
    from glmkit.inputs import MAX_EXPANDED_ELEMENTS
    from glmkit.parity.rollout_data import load_rollout_data

    sample = {"tokens": list(range(3, 503)), "response_length": 400, "rollout_log_probs": [-1.0] * 400,
              "loss_mask": [1] * 400}
    torch.save({"samples": [sample] * 20000}, tmp_path / "shared.pt")
    data = load_rollout_data(tmp_path / "shared.pt", 1024)
    assert len(data.samples) == 20000 and data.samples[0].tokens == list(range(3, 503))
    assert data.samples[5].tokens is data.samples[19999].tokens and data.samples[5].engine is data.samples[7].engine
    view = torch.ones(1, dtype=torch.long).expand(MAX_EXPANDED_ELEMENTS // 4)  # a quarter of the bound
    torch.save({"samples": [dict(sample, tokens=view)] * 5}, tmp_path / "views.pt")
    with pytest.raises(ValueError, match=r"views\.pt: samples\[4\]: expanded views of 4194304 elements, met again"):
        load_rollout_data(tmp_path / "views.pt", 1024)


def test_keys_nested_too_deeply_to_print_are_named_by_type(tmp_path):
    """Hostile pass 12: a dict key that is a tuple 3000 levels deep ended in exit 3 (RecursionError
    printing it) where the file is refused; the message now names its type."""
    from glmkit.parity.rollout_data import load_rollout_data, load_trainer_logprobs

    key = ()
    for _ in range(3000):
        key = (key,)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # pickling the key recurses (torch's safe reader does not)
    try:
        torch.save({key: 1, "rollout_id": 0}, tmp_path / "top.pt")
        torch.save({"rollout_data": {key: 1}}, tmp_path / "train.pt")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(ValueError, match=r"got dict with keys \['<a tuple nested too deeply to show>', 'rollout_id'\]"):
        load_rollout_data(tmp_path / "top.pt")
    with pytest.raises(ValueError, match=r"\(keys: \['<a tuple nested too deeply to show>'\]\)"):
        load_trainer_logprobs(tmp_path / "train.pt")


def test_ids_from_the_file_cannot_write_to_the_terminal(rollout_file, tmp_path, capsys):
    """Hostile pass 12: a rollout_id of "\\x1b[31mX\\n\\nverdict: pass" reached the terminal raw: an escape
    sequence, and a forged verdict line above the real one (fail). Such text is shown as its repr."""
    from glmkit.cli import main
    from glmkit.parity.rollout_data import _load

    data = _load(Path(rollout_file), "rollout data")  # with the numpy arrays routing replay saves
    data["rollout_id"] = "\x1b[31mX\n\nverdict: pass"
    data["samples"][BROKEN_SAMPLE]["index"] = "\x1b[2Jwiped"
    torch.save(data, tmp_path / "forged.pt")
    assert main(["rollout-data", str(tmp_path / "forged.pt"), "--checkpoint", str(CKPT)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and [line for line in out.splitlines() if line.startswith("verdict:")] == ["verdict: fail"]
    assert "(rollout '\\x1b[31mX\\n\\nverdict: pass'" in out and "'\\x1b[2Jwiped'" in out


def test_a_checkpoint_whose_reference_log_probs_overflow_is_refused_naming_its_weight(rollout_file, tmp_path):
    """Hostile pass 15: with a final norm of 3e38 the reference's log-probs were all NaN, and the table
    said the engine agreed exactly and blamed the trainer. The yardstick itself failing is bad input
    (exit 2), naming the weight where the overflow most likely starts."""
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "ck"
    shutil.copytree(CKPT, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.language_model.norm.weight"][:] = 3e38
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"the reference's log-probs of samples\[0\] are NaN or infinite \(\d+ of \d+\): "
                                         r"the checkpoint's weights overflow the forward \(its largest \|weight\| is "
                                         r"3.0e\+38 in model.language_model.norm.weight\); neither side can be judged"):
        attribute(load_rollout_data(rollout_file), bad, progress=False)


@pytest.mark.parametrize("value", [float("nan"), 2, 0.5, -1])
def test_a_loss_mask_that_is_not_zero_or_one_is_named(rollout_file, tmp_path, capsys, value):
    """Hostile pass 15: a loss_mask of NaN or 2 was read as truthy, counted, and the sample passed."""
    raw = torch.load(rollout_file, weights_only=False)
    raw["samples"][1]["loss_mask"][3] = value
    path = tmp_path / "mask.pt"
    torch.save(raw, path)
    with pytest.raises(ValueError, match=rf"samples\[1\]\.loss_mask\[3\] is {re.escape(repr(float(value)))}; a loss "
                                         rf"mask holds 0 or 1 per response token"):
        load_rollout_data(path)
