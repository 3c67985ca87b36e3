"""Bad input and unsafe requests, as a user meets them: `glmkit ...` in a subprocess, its exit code and its
message. Every case here used to end in a traceback, an unclear or truncated message, or a silent accident.

Each case is a `@case` function that sets up its files (with glmkit's own writers, in this process) and
names the `glmkit` runs it makes, and a test that asserts on those runs. A CLI start costs seconds of
imports (torch, transformers), so the `runs` fixture starts every case's runs at once, one per CPU core,
and each test waits only for its own."""

from __future__ import annotations

import errno
import json
import os
import shutil
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import glmkit
from glmkit.checkpoint import TEXT_PREFIX, open_checkpoint, save_checkpoint, synth_checkpoint, synth_tensor
from glmkit.outputs import MARKER

UP_PROJ = TEXT_PREFIX + "layers.0.mlp.up_proj.weight"  # [128, 64] in the tiny variant
DOWN_PROJ = TEXT_PREFIX + "layers.1.mlp.down_proj.weight"  # [64, 128]
CASES = {}


PACKAGE = Path(glmkit.__file__).resolve().parent


def case(setup):
    """Register `setup(folder, tiny, sharded) -> [argv or (argv, cwd), ...]`."""
    CASES[setup.__name__] = setup
    return setup


def glmkit(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "glmkit", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def sharded(tiny_ckpt, tmp_path_factory):
    """tiny_ckpt as 5 shards and an index."""
    ckpt = open_checkpoint(tiny_ckpt)
    path = tmp_path_factory.mktemp("sharded") / "ck"
    save_checkpoint(path, ckpt.config, ((k, ckpt.get(k)) for k in ckpt.text_keys()), max_shard_bytes=400_000)
    return path


@pytest.fixture(scope="module")
def runs(tiny_ckpt, sharded, tmp_path_factory):
    """runs(name) -> (the case's folder, its runs' CompletedProcess in order)."""
    pool = ThreadPoolExecutor(os.cpu_count() or 2)
    started = {}
    for name, setup in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        calls = [c if isinstance(c, tuple) else (c, None) for c in setup(folder, tiny_ckpt, sharded)]
        started[name] = folder, [pool.submit(glmkit, *argv, cwd=cwd) for argv, cwd in calls]
    yield lambda name: (started[name][0], [f.result() for f in started[name][1]])
    pool.shutdown()


def error(out) -> str:
    """The error a run ended with: exit 2, no traceback, the text from its `glmkit CMD: error:` line on."""
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if ": error: " in line)
    return "\n".join(lines[start:])


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(ckpt_dir, edit):
    file = ckpt_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return ckpt_dir


def edit_index(folder, entry):
    """Point UP_PROJ's weight_map entry at `entry`."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][UP_PROJ] = entry
    index_file.write_text(json.dumps(index))
    return folder


def capture_dir(folder):
    """A real capture directory written by glmkit's own writer (two sites of a 6-token input)."""
    from glmkit.parity.dump import Capture, save_capture

    cap = Capture(torch.arange(3, 9), torch.tensor([0, 4, 6]), manifest={"path": "train"})
    cap.put(0, "attn_out", torch.randn(6, 64))
    cap.put(None, "final_hidden", torch.randn(6, 64))
    return save_capture(cap, folder / "cap")


# ----------------------------------------------------------------------------- clear errors


@case
def mismatch(folder, tiny, sharded):
    def break_three(t):  # a wrong shape, an extra tensor and a missing one
        t[UP_PROJ] = t[UP_PROJ][:-1].clone()
        t[TEXT_PREFIX + "layers.0.bogus.weight"] = torch.zeros(3)
        t.pop(DOWN_PROJ)

    three = rewrite_weights(copy_ckpt(tiny, folder / "three"), break_three)
    many = rewrite_weights(copy_ckpt(tiny, folder / "many"), lambda t: [
        t.pop(k) for k in [k for k in t if k.startswith(TEXT_PREFIX + "layers.0.")]])
    layers = copy_ckpt(tiny, folder / "layers")
    config = json.loads((layers / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 3
    (layers / "config.json").write_text(json.dumps(config))
    return [["ckpt", "info", p] for p in (three, many, layers)]


def test_checkpoint_mismatch_shows_the_whole_reason(runs):
    """Wrong shape, extra tensor, missing tensor, many missing (bounded: 10 and a count), a bad
    num_hidden_layers: the tensor names and shapes reach the user, not only the header line."""
    folder, outs = runs("mismatch")
    three, many, layers = map(error, outs)
    header, *details = three.splitlines()
    assert header == f"glmkit ckpt: error: {folder}/three: checkpoint does not match its config.json (3 problems):"
    assert sorted(details) == [
        f"  missing tensor {DOWN_PROJ} [64, 128]: not in model.safetensors",
        f"  tensor {UP_PROJ} in model.safetensors has shape [127, 64], expected [128, 64] from config.json",
        f"  unexpected tensor {TEXT_PREFIX}layers.0.bogus.weight in model.safetensors"]
    listed = [line for line in many.splitlines() if line.startswith("  missing tensor")]
    total = int(many.split(" (")[1].split(" problems")[0])
    assert len(listed) == 10 and total > 10 and many.endswith(f"... and {total - 10} more")
    assert f"{folder}/layers/config.json" in layers and "`num_hidden_layers` (3) must be equal" in layers


@case
def cuda(folder, tiny, sharded):
    if torch.cuda.is_available():
        return []
    return [["parity", "--checkpoint", tiny, "--device", "cuda"],
            ["check", "--checkpoint", tiny, "--device", "cuda", "--out", folder / "report"],
            ["train", "--device", "cuda", "--metrics-out", folder / "m.jsonl"],
            ["ckpt", "synth", "--variant", "tiny", "--device", "cuda", "--out", folder / "ck"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(runs):
    folder, outs = runs("cuda")
    for out in outs:
        assert error(out).endswith(": error: --device cuda: this torch is built without CUDA "
                                   f"(torch {torch.__version__}); use --device cpu")
    assert os.listdir(folder) == []  # refused before anything was written


@case
def lr_inf(folder, tiny, sharded):
    return [["train", "--lr", "inf", "--metrics-out", folder / "m.jsonl"]]


def test_lr_inf_is_refused_before_training(runs):
    folder, (out,) = runs("lr_inf")
    assert error(out) == "glmkit train: error: argument --lr: must be a finite number, got 'inf' (usage: glmkit train --help)"
    assert os.listdir(folder) == []


@case
def train_values(folder, tiny, sharded):
    def train(*extra):
        return ["train", "--metrics-out", folder / "m.jsonl", *extra]
    return [train("--rollout-temperature", "1e-300"), train("--eps-clip", "-1"), train("--kl-loss-coef", "-1"),
            train("--save-interval", "-3", "--save", folder / "ck"), train("--lr", "3e38"),
            train("--lr", "1e37", "--adam-beta1", "0.999")]


def test_train_values_out_of_range_name_the_allowed_range(runs):
    folder, (temperature, clip, kl, interval, huge_lr, huge_step) = runs("train_values")
    # Adam's step size lr / (1 - beta1) is a float32 scalar inside torch: past its range, refused
    assert error(huge_lr) == ("glmkit train: error: --lr 3e+38: Adam's first step size lr / (1 - adam_beta1) = "
                              "3e+39 and its decay lr x weight_decay = 3e+37 must stay within float32 (3.4e+38); "
                              "use a smaller --lr")
    assert "lr / (1 - adam_beta1) = 1e+40" in error(huge_step)
    assert error(temperature) == ("glmkit train: error: --rollout-temperature 1e-300: GRPO needs >= 1e-06 (log-probs "
                                  "are those of softmax(logits / T); below it sampling is greedy)")
    assert error(clip) == "glmkit train: error: --eps-clip must be >= 0, got -1.0"
    assert error(kl) == "glmkit train: error: --kl-loss-coef must be >= 0, got -1.0"
    assert error(interval) == "glmkit train: error: --save-interval must be >= 0, got -3"
    assert os.listdir(folder) == []


@case
def overwrite_bad_inputs(folder, tiny, sharded):
    """An earlier run's metrics (rows glmkit writes) and --overwrite with an input that cannot work."""
    for name in ("data", "tokenizer", "checkpoint"):
        (folder / name).mkdir()
        (folder / name / "m.jsonl").write_text('{"train/step": 0, "train/grad_norm": 1.0}\n')
    common = ["train", "--model-name", "tiny", "--overwrite"]
    return [[*common, "--metrics-out", folder / "data" / "m.jsonl", "--prompt-data", folder / "missing.jsonl"],
            [*common, "--metrics-out", folder / "tokenizer" / "m.jsonl", "--tokenizer", folder],
            [*common, "--metrics-out", folder / "checkpoint" / "m.jsonl", "--checkpoint", folder]]


def test_overwrite_removes_nothing_when_an_input_is_bad(runs):
    """--overwrite clears an earlier run only once this run's inputs are known good: a missing prompt
    file, a folder without a tokenizer, a folder without a checkpoint each leave the metrics in place."""
    folder, (data, tokenizer, checkpoint) = runs("overwrite_bad_inputs")
    assert "missing.jsonl: no such file" in error(data)
    assert "no tokenizer in" in error(tokenizer)
    assert error(checkpoint).startswith("glmkit train: error: ")
    for name in ("data", "tokenizer", "checkpoint"):
        assert (folder / name / "m.jsonl").read_text() == '{"train/step": 0, "train/grad_norm": 1.0}\n', name


def safetensors_with_header(path, header: bytes):
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)
    return path


@case
def hostile_json(folder, tiny, sharded):
    deep = copy_ckpt(tiny, folder / "deep_config")
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    latin = copy_ckpt(tiny, folder / "latin_config")
    (latin / "config.json").write_bytes(b"\xff\xfe{}")
    safetensors_with_header(copy_ckpt(tiny, folder / "deep_header") / "model.safetensors",
                            b"[" * 100_000 + b"]" * 100_000)
    safetensors_with_header(copy_ckpt(tiny, folder / "string_offsets") / "model.safetensors",
                            json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}}).encode())
    return [["ckpt", "info", deep], ["ckpt", "info", latin], ["ckpt", "info", folder / "deep_header"],
            ["ckpt", "info", folder / "string_offsets"]]


def test_hostile_json_is_refused_with_the_file_named(runs):
    """Nesting deeper than Python's parser goes, a config that is not UTF-8, header offsets that are
    strings: exit 2 with the file named, no traceback."""
    folder, (deep, latin, deep_header, offsets) = runs("hostile_json")
    assert f"{folder}/deep_config/config.json: unreadable JSON: maximum recursion depth" in error(deep)
    assert f"{folder}/latin_config/config.json: not UTF-8 text" in error(latin)
    assert f"{folder}/deep_header/model.safetensors: corrupt safetensors header" in error(deep_header)
    assert "corrupt header entry for tensor w" in error(offsets) and "data_offsets ['0', '16']" in error(offsets)


@case
def checkpoint_b(folder, tiny, sharded):
    pickled = folder / "pickled"
    pickled.mkdir()
    shutil.copy(tiny / "config.json", pickled / "config.json")
    torch.save({"lm_head.weight": torch.zeros(1)}, pickled / "pytorch_model.bin")
    parity = ["parity", "--checkpoint", tiny, "--paths", "train,reference", "--seq-len", "8", "--checkpoint-b"]
    return [[*parity, pickled], [*parity, "org/some-model"]]


def test_checkpoint_b_is_checked_before_either_path_runs(runs):
    """The reference path reads --checkpoint-b through glmkit's reader first: a pickle-only folder
    and a hub name are refused (never unpickled, never downloaded), before path A runs."""
    folder, (pickled, hub) = runs("checkpoint_b")
    assert error(pickled) == (f"glmkit parity: error: {folder}/pickled: neither model.safetensors nor "
                              f"model.safetensors.index.json found")
    assert error(hub) == "glmkit parity: error: org/some-model: not a checkpoint directory"
    assert pickled.stdout == hub.stdout == ""


@case
def index_entry(folder, tiny, sharded):
    return [["ckpt", "info", edit_index(copy_ckpt(sharded, folder / "ck"), 5)]]


def test_index_entry_that_is_not_a_string(runs):
    folder, (out,) = runs("index_entry")
    assert error(out) == (f"glmkit ckpt: error: {folder}/ck/model.safetensors.index.json: weight_map entry for "
                          f"tensor {UP_PROJ} is 5, expected a shard file name")


@case
def capture_out(folder, tiny, sharded):
    (folder / "file").write_text("mine")
    return [["capture", "--checkpoint", tiny, "--path", "train", "--out", folder / "file"]]


def test_capture_out_is_checked_before_the_run(runs):
    folder, (out,) = runs("capture_out")
    assert error(out) == f"glmkit capture: error: --out {folder}/file: exists and is not a directory"
    assert (folder / "file").read_text() == "mine" and out.stdout == ""


@case
def parity_json(folder, tiny, sharded):
    (folder / "out").mkdir()
    return [["parity", "--checkpoint", tiny, "--json", folder / "out"]]


def test_parity_json_directory_is_refused_before_the_comparison(runs):
    folder, (out,) = runs("parity_json")
    assert error(out) == f"glmkit parity: error: --json {folder}/out: is a directory; give a file path"
    assert out.stdout == ""  # nothing was compared


@case
def prompt_dir(folder, tiny, sharded):
    return [["train", "--prompt-data", folder, "--metrics-out", folder / "m.jsonl"]]


def test_prompt_data_directory(runs):
    folder, (out,) = runs("prompt_dir")
    assert error(out) == f"glmkit train: error: --prompt-data {folder}: is a directory; give a jsonl file"


@case
def truncated_capture(folder, tiny, sharded):
    tensors = capture_dir(folder) / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])
    return [["parity", "--checkpoint", tiny, "--paths", f"{folder}/cap,train"]]


def test_truncated_capture(runs):
    folder, (out,) = runs("truncated_capture")
    assert error(out).startswith(f"glmkit parity: error: {folder}/cap/tensors.safetensors: not a readable "
                                 f"safetensors file (truncated or corrupt)")


@case
def manifest_list(folder, tiny, sharded):
    (capture_dir(folder) / "manifest.json").write_text("[1, 2]")
    return [["parity", "--checkpoint", tiny, "--paths", f"{folder}/cap,train"]]


def test_capture_manifest_not_an_object(runs):
    folder, (out,) = runs("manifest_list")
    assert error(out) == f"glmkit parity: error: {folder}/cap/manifest.json: expected a JSON object, found list"


@case
def capture_cu_seqlens(folder, tiny, sharded):
    """Captures whose cu_seqlens cannot cut their 6 tokens: decreasing, not ending at 6, 2-D, float."""
    runs = []
    for name, cu in {"down": [0, 4, 2, 6], "short": [0, 4], "flat": [[0, 4, 6]], "float": [0.0, 4.0, 6.0]}.items():
        cap = capture_dir(folder / name)
        tensors = load_file(str(cap / "tensors.safetensors"))
        tensors["input/cu_seqlens"] = torch.tensor(cu)
        save_file(tensors, str(cap / "tensors.safetensors"))
        runs.append(["parity", "--checkpoint", tiny, "--paths", f"{cap},train"])
    return runs


def test_capture_cu_seqlens_that_cannot_cut_the_tokens(runs):
    folder, outs = runs("capture_cu_seqlens")
    lead = "glmkit parity: error: {}/cap/tensors.safetensors: tensor 'input/cu_seqlens'"
    assert error(outs[0]) == (lead.format(folder / "down") + " [0, 4, 2, 6]: must start at 0, increase strictly "
                              "and end at the 6 tokens")
    assert error(outs[1]) == (lead.format(folder / "short") + " [0, 4]: must start at 0, increase strictly and "
                              "end at the 6 tokens")
    assert error(outs[2]) == (lead.format(folder / "flat") + ": expected 1-D integers [N+1] with N >= 1, got "
                              "torch.int64 [1, 3]")
    assert error(outs[3]) == (lead.format(folder / "float") + ": expected 1-D integers [N+1] with N >= 1, got "
                              "torch.float32 [3]")


@case
def seed_out_of_range(folder, tiny, sharded):
    return [["check", "--seed", 10 ** 23], ["ckpt", "synth", "--seed", -1, "--out", folder / "ck"]]


def test_seeds_outside_a_64_bit_int_are_refused_by_flag(runs):
    _, (big, negative) = runs("seed_out_of_range")
    assert error(big).startswith(f"glmkit check: error: argument --seed: must be in 0..{(1 << 63) - 1}, got {10 ** 23}")
    assert error(negative).startswith(f"glmkit ckpt synth: error: argument --seed: must be in 0..{(1 << 63) - 1}, "
                                      f"got -1")


@case
def synth_dot(folder, tiny, sharded):
    (folder / "mine.txt").write_text("mine")
    return [(["ckpt", "synth", "--variant", "tiny", "--out", ".", "--overwrite"], folder)]


def test_synth_out_dot_overwrite(runs):
    folder, (out,) = runs("synth_dot")
    assert error(out) == ("glmkit ckpt: error: --out .: is the current directory or contains it; name a new "
                          "directory")
    assert os.listdir(folder) == ["mine.txt"]


# ----------------------------------------------------------------------------- unclear messages


@case
def binary_prompts(folder, tiny, sharded):
    (folder / "data.jsonl").write_bytes(b'\x8f\x00\xff binary\n\x01\x02{"prompt"\n')
    return [["train", "--prompt-data", folder / "data.jsonl", "--metrics-out", folder / "m.jsonl"]]


def test_binary_prompt_data_names_the_file_and_line(runs):
    folder, (out,) = runs("binary_prompts")
    assert error(out) == (f"glmkit train: error: --prompt-data {folder}/data.jsonl: no usable prompts (2 malformed "
                          f"rows; first: line 1: not UTF-8 text (invalid byte 0x8f at position 1))")


@case
def resume_marker(folder, tiny, sharded):
    (folder / "save").mkdir()
    (folder / "save" / "latest_checkpointed_iteration.txt").write_text("latest\n")
    return [["train", "--resume", "--save", folder / "save", "--metrics-out", folder / "m.jsonl"]]


def test_resume_marker_that_is_not_a_number(runs):
    folder, (out,) = runs("resume_marker")
    assert error(out).startswith(f"glmkit train: error: {folder}/save/latest_checkpointed_iteration.txt: expected "
                                 f"the latest iteration number, found 'latest'")


@case
def threshold(folder, tiny, sharded):
    return [["parity", "--checkpoint", tiny, "--threshold", "rel_rms=abc"],
            ["parity", "--checkpoint", tiny, "--threshold", "rel_rms=\u0661e-4"],  # an Arabic-Indic one
            ["parity", "--checkpoint", tiny, "--threshold", "identical=inf"]]


def test_threshold_that_is_not_a_number(runs):
    """Hostile pass 6: float() read non-ASCII digits, so `rel_rms=١e-4` was taken as 1e-4."""
    _, (letters, digits, infinite) = runs("threshold")
    assert error(letters) == "glmkit parity: error: --threshold 'rel_rms=abc': 'abc' is not a finite decimal number"
    assert error(digits) == ("glmkit parity: error: --threshold 'rel_rms=\u0661e-4': '\u0661e-4' is not a finite "
                             "decimal number")
    assert error(infinite).endswith("'inf' is not a finite decimal number") and infinite.returncode == 2


@case
def rollout_sizes(folder, tiny, sharded):
    return [["train", "--rollout-batch-size", "0", "--metrics-out", folder / "a.jsonl"],
            ["train", "--rollout-max-response-len", "0", "--metrics-out", folder / "b.jsonl"]]


def test_rollout_sizes_are_refused_before_the_model_loads(runs):
    folder, (batch, response) = runs("rollout_sizes")
    assert error(batch) == ("glmkit train: error: argument --rollout-batch-size: must be >= 1, got 0 "
                            "(usage: glmkit train --help)")
    assert error(response) == "glmkit train: error: --rollout-max-response-len must be >= 1, got 0"
    assert "GRPO" not in batch.stderr + response.stderr and os.listdir(folder) == []  # no rollout started


@case
def flag_names(folder, tiny, sharded):
    synth_checkpoint("tiny", 0, folder / "ck", progress=False)
    return [["ckpt", "synth", "--variant", "tiny", "--out", folder / "ck"],
            ["parity", "--checkpoint", tiny, "--seq-len", "1"],
            ["check", "--checkpoint", tiny, "--decode-steps", "0", "--out", folder / "report"]]


def test_messages_name_flags_not_python_arguments(runs):
    folder, (exists, seq_len, steps) = runs("flag_names")
    assert error(exists) == (f"glmkit ckpt: error: --out {folder}/ck: already exists and is not empty; pass "
                             f"--overwrite to replace it")
    assert error(seq_len) == ("glmkit parity: error: --batch must be >= 1 and --seq-len >= 2, got --batch 2, "
                              "--seq-len 1")
    assert error(steps) == ("glmkit check: error: argument --decode-steps: must be in 2..65536, got 0 "
                            "(usage: glmkit check --help)")


# ----------------------------------------------------------------------------- safety


@case
def shard_paths(folder, tiny, sharded):
    shutil.copy(sharded / "model-00001-of-00005.safetensors", folder / "outside.safetensors")
    return [["ckpt", "info", edit_index(copy_ckpt(sharded, folder / "relative"), "../outside.safetensors")],
            ["ckpt", "info", edit_index(copy_ckpt(sharded, folder / "absolute"), "/etc/passwd")]]


def test_shard_paths_outside_the_checkpoint_are_refused_unopened(runs):
    folder, outs = runs("shard_paths")
    size = str(os.path.getsize(folder / "outside.safetensors"))
    for out, name, shard in zip(outs, ("relative", "absolute"), ("../outside.safetensors", "/etc/passwd")):
        assert error(out) == (f"glmkit ckpt: error: {folder}/{name}/model.safetensors.index.json: shard path "
                              f"{shard!r} for tensor {UP_PROJ} is not a file name inside the checkpoint directory; "
                              f"refused without opening it")
        assert size not in out.stderr


@case
def overwrite_own(folder, tiny, sharded):
    synth_checkpoint("tiny", 0, folder / "ck", progress=False)
    return [["ckpt", "synth", "--variant", "tiny", "--seed", "1", "--out", folder / "ck", "--overwrite"]]


def test_overwrite_replaces_a_directory_glmkit_wrote(runs):
    folder, (out,) = runs("overwrite_own")
    assert out.returncode == 0, out.stderr
    now = open_checkpoint(folder / "ck").get(UP_PROJ)
    assert torch.equal(now, synth_tensor(UP_PROJ, (128, 64), seed=1))
    assert not torch.equal(now, synth_tensor(UP_PROJ, (128, 64), seed=0))
    assert (folder / "ck" / MARKER).is_file() and os.listdir(folder) == ["ck"]  # marked again, nothing beside


@case
def overwrite_foreign(folder, tiny, sharded):
    (folder / "mine").mkdir()
    (folder / "mine" / "notes.txt").write_text("precious")
    copy_ckpt(tiny, folder / "theirs")
    return [["ckpt", "synth", "--variant", "tiny", "--out", folder / "mine", "--overwrite"],
            ["ckpt", "slice", "--src", tiny, "--layers", "2", "--out", folder / "theirs", "--overwrite"]]


def test_overwrite_keeps_a_directory_of_user_files(runs, tiny_ckpt):
    """--overwrite on the user's own folder, or on a checkpoint glmkit did not mark (here one transformers
    wrote): refused, every file still there."""
    folder, outs = runs("overwrite_foreign")
    for out, name in zip(outs, ("mine", "theirs")):
        assert error(out).startswith(f"glmkit ckpt: error: --out {folder}/{name}: --overwrite replaces only a "
                                     f"directory glmkit wrote (one with a {MARKER} file)")
        assert error(out).endswith("remove it yourself or choose another directory")
    assert os.listdir(folder / "mine") == ["notes.txt"] and (folder / "mine" / "notes.txt").read_text() == "precious"
    assert sorted(os.listdir(folder / "theirs")) == sorted(os.listdir(tiny_ckpt))
    assert len(open_checkpoint(folder / "theirs").text_keys()) == 132


@case
def overwrite_added(folder, tiny, sharded):
    synth_checkpoint("tiny", 0, folder / "ck", progress=False)
    (folder / "ck" / "NOTES.md").write_text("my notes")  # the user's file, put into glmkit's checkpoint later
    return [["ckpt", "synth", "--variant", "tiny", "--seed", "1", "--out", folder / "ck", "--overwrite"],
            ["ckpt", "synth", "--variant", "tiny", "--out", PACKAGE / "assets" / "not_an_output"]]


def test_overwrite_keeps_what_a_user_added_and_never_touches_the_package(runs):
    """A checkpoint glmkit wrote lists what it held in its marker: a file added since is named and the
    --overwrite refused (nothing deleted); glmkit's own shipped checkpoint is never an output."""
    folder, (added, package) = runs("overwrite_added")
    assert added.returncode == 2 and "holds NOTES.md that glmkit did not write there" in error(added)
    assert (folder / "ck" / "NOTES.md").read_text() == "my notes"
    assert torch.equal(open_checkpoint(folder / "ck").get(UP_PROJ), synth_tensor(UP_PROJ, (128, 64), seed=0))
    assert package.returncode == 2 and "inside glmkit's own package" in error(package)
    assert not (PACKAGE / "assets" / "not_an_output").exists()


@case
def dtypes(folder, tiny, sharded):
    ints = rewrite_weights(copy_ckpt(tiny, folder / "ints"),
                           lambda t: t.update({UP_PROJ: (t[UP_PROJ] * 10).to(torch.int64)}))
    halves = rewrite_weights(copy_ckpt(tiny, folder / "halves"),
                             lambda t: t.update({UP_PROJ: t[UP_PROJ].to(torch.float16)}))
    return [["parity", "--checkpoint", ints, "--seq-len", "8", "--batch", "1"], ["ckpt", "info", halves]]


def test_tensors_of_the_wrong_dtype(runs):
    """Rule: integer / bool / float8 tensors are refused, naming them (parity no longer passes on them);
    a float tensor in another dtype than the checkpoint's is cast on load with one warning naming it."""
    folder, (refused, warned) = runs("dtypes")
    assert error(refused) == (f"glmkit parity: error: {folder}/ints: 1 tensor not stored as bfloat16, float16 or "
                              f"float32 (a cast would load wrong weights):\n  tensor {UP_PROJ} in model.safetensors "
                              f"is int64")
    assert warned.returncode == 0 and warned.stderr.count("warning") == 1, warned.stderr
    assert warned.stderr == (f"glmkit ckpt: warning: {folder}/halves: 1 tensor stored in another dtype than the "
                             f"checkpoint's float32, cast when loaded:\n  {UP_PROJ} (float16)\n")


NORM = TEXT_PREFIX + "layers.0.input_layernorm.weight"


@case
def huge_weight(folder, tiny, sharded):
    def overflow(t):  # finite, loads, and overflows every forward (bf16 and fp32 end at ~3.4e38)
        t[NORM][0] = 3e38

    huge = rewrite_weights(copy_ckpt(tiny, folder / "huge"), overflow)
    return [["train", "--checkpoint", huge, "--num-rollout", "1", "--metrics-out", folder / "m.jsonl"],
            ["check", "--checkpoint", huge, "--decode-steps", "2", "--out", folder / "check"]]


def test_weights_that_overflow_the_forward_are_named_not_crashed_on(runs):
    """Hostile pass 14: a finite 3e38 in a norm made every logit NaN; train died in the sampler
    (exit 3) and check in its plots (exit 3, after matplotlib's All-NaN warnings). train refuses the
    rollout it cannot score (exit 2, naming the largest weight: nothing was trained yet); check fails
    (exit 1) with its report written, saying which logits are NaN and where the largest weight is, and
    its JSON strict (no NaN token)."""
    folder, (train, check) = runs("huge_weight")
    assert re.fullmatch(rf"glmkit train: error: rollout 0: \d+ sampled log-probs are NaN or infinite, in \d+ of \d+ "
                        rf"samples \(first: sample 0, token 0\): the rollout's forward overflows; the policy's largest "
                        rf"\|weight\| is 3.0e\+38 in {re.escape(NORM)}", error(train)), train.stderr
    assert check.returncode == 1, check.stderr[-2000:]
    assert "Traceback" not in check.stderr and "Warning" not in check.stderr, check.stderr
    assert "FAIL NaN or infinite logits (reference " in check.stdout
    assert f"the model's largest |weight| is 3.0e+38 in {NORM}" in check.stdout, check.stdout
    text = (folder / "check" / "check.json").read_text()
    report = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in check.json"))
    assert report["verdict"] == "fail" and "3.0e+38" in report["nonfinite"]
    assert report["checks"][0]["rel_rms"] is None
    assert "3.0e+38" in (folder / "check" / "check.html").read_text()


@case
def staging(folder, tiny, sharded):
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    host = socket.gethostname()
    for name in (f".ck.tmp-{host}-{finished.pid}-abcdefgh",  # stale: its process is gone
                 f".ck.tmp-{host}-{os.getpid()}-abcdefgh",  # live: this test process is running
                 f".ck.tmp-{host}-{finished.pid}-unmarked",  # no marker: not known to be glmkit's
                 f".other.tmp-{host}-{finished.pid}-abcdefgh"):  # another target's
        (folder / name).mkdir()
        (folder / name / "part-00000.safetensors").write_bytes(b"half written")
        if not name.endswith("unmarked"):
            (folder / name / MARKER).write_text("kind: checkpoint\n")
    return [["ckpt", "synth", "--variant", "tiny", "--out", folder / "ck"]]


def test_stale_staging_directories_are_cleaned(runs):
    """A killed write's staging directory (this host, its process gone) is removed by the next write to
    the same place; a live writer's, an unmarked one and another target's are left alone."""
    folder, (out,) = runs("staging")
    assert out.returncode == 0, out.stderr
    left = set(os.listdir(folder)) - {"ck"}
    assert f".ck.tmp-{socket.gethostname()}-{os.getpid()}-abcdefgh" in left  # the live one stays
    assert sorted(n.rsplit("-", 1)[1] for n in left if n.startswith(".ck.tmp-")) == ["abcdefgh", "unmarked"]
    assert len([n for n in left if n.startswith(".other.tmp-")]) == 1 and len(left) == 3
    assert len(open_checkpoint(folder / "ck").text_keys()) == 132


def test_tokenizer_folder_naming_custom_code_never_runs_it(tmp_path, monkeypatch):
    """A tokenizer_config.json whose class exists only in a module of the folder (auto_map):
    transformers would ask to run that module, and run it on "y"; glmkit refuses the folder, naming
    it, with the code never imported, even with a "y" waiting on standard input."""
    import io

    from glmkit.tokenizer import TINY_TOKENIZER, load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["tokenizer_class"], config["auto_map"] = "Evil", {"AutoTokenizer": ["evil.Evil", "evil.Evil"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ran = tmp_path / "ran"
    (folder / "evil.py").write_text(f"open({str(ran)!r}, 'w').close()\n"
                                    "from transformers import PreTrainedTokenizerFast as Evil\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    with pytest.raises(ValueError, match=f"tokenizer in {folder} cannot be read: "):
        load_tokenizer(folder)
    assert not ran.exists()


def test_corrupt_tokenizer_file_names_its_folder(tmp_path):
    from glmkit.tokenizer import TINY_TOKENIZER, load_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER, folder)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"tokenizer in {folder} cannot be read: "):
        load_tokenizer(folder)


def test_prompt_rows_too_deep_or_too_long_are_skipped_by_line(tmp_path):
    """A label nested past the JSON parser's depth and an integer of 5000 digits (past Python's
    int-parsing limit) are malformed rows like any other: skipped and reported by line."""
    from glmkit.rl.data import load_prompts

    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "a", "label": ' + "[" * 100_000 + "]" * 100_000 + "}\n"
                    '{"prompt": "b", "label": ' + "9" * 5000 + "}\n"
                    '{"prompt": "1+1=", "label": "2"}\n')
    with pytest.warns(UserWarning, match="skipped 2 malformed row"):
        samples, problems = load_prompts(data, tokenizer=None, shuffle_seed=None)
    assert [s.label for s in samples] == ["2"]
    assert [p.line for p in problems] == [1, 2]
    assert "maximum recursion depth" in str(problems[0]) and "4300 digits" in str(problems[1])


def test_a_text_config_of_another_type_and_a_fifo_shard_are_refused(tiny_ckpt, tmp_path):
    """`text_config` that is not an object is named (not read as a flat config missing every
    tensor); a FIFO in a shard's place is refused before it is opened (reading one blocks)."""
    from glmkit.checkpoint import CheckpointError

    typed = copy_ckpt(tiny_ckpt, tmp_path / "typed")
    config = json.loads((typed / "config.json").read_text())
    config["text_config"] = "x"
    (typed / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="text_config must be a JSON object, found str"):
        open_checkpoint(typed)
    fifo = copy_ckpt(tiny_ckpt, tmp_path / "fifo")
    (fifo / "model.safetensors").unlink()
    os.mkfifo(fifo / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: is a named pipe \(FIFO\), not a safetensors file"):
        open_checkpoint(fifo)


def test_shapes_a_path_cannot_take_are_refused_by_name(tmp_path):
    """No shared expert: refused by the tensor list every reader and writer uses (it made zero-width
    tensors); one routed expert: glmkit's paths take it, the transformers reference (top-2 experts
    per group) is refused before it loads, instead of failing inside its router."""
    from glmkit.config import variant_config
    from glmkit.model import load_model
    from glmkit.reference import load_reference

    with pytest.raises(ValueError, match=r"n_shared_experts 0 is not supported; allowed: >= 1"):
        synth_checkpoint(variant_config("tiny", n_shared_experts=0), 0, tmp_path / "none", progress=False)
    one = synth_checkpoint(variant_config("tiny", n_routed_experts=1, num_experts_per_tok=1), 0, tmp_path / "one",
                           progress=False)
    assert load_model(one).layers[-1].mlp.experts.gate_up_proj.shape[0] == 1
    with pytest.raises(ValueError, match="the transformers reference needs n_routed_experts >= 2"):
        load_reference(one)


def test_pipes_devices_and_dangling_links_are_named_for_what_they_are(tmp_path, tiny_ckpt):
    from glmkit.inputs import not_a_file

    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "to_zero").symlink_to("/dev/zero")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "rows.jsonl").write_text("{}\n")
    (tmp_path / "to_rows").symlink_to(tmp_path / "rows.jsonl")
    assert not_a_file(tmp_path / "pipe") == "is a named pipe (FIFO)"
    assert not_a_file(tmp_path / "to_zero") == "is a character device (through a symbolic link)"
    assert not_a_file(tmp_path / "dangling") == "is a symbolic link to nothing"
    assert not_a_file(tmp_path / "missing") == "no such file"
    assert not_a_file(tmp_path) == "is a directory"
    assert "symbolic links" in not_a_file(tmp_path / "loop")
    assert not_a_file(tmp_path / "rows.jsonl") is None and not_a_file(tmp_path / "to_rows") is None
    # as a user meets it: the flag, the path and what it is; no read that would block on the pipe
    out = glmkit("train", "--prompt-data", tmp_path / "pipe", "--num-rollout", 1)
    assert error(out) == f"glmkit train: error: --prompt-data {tmp_path / 'pipe'}: is a named pipe (FIFO); give a jsonl file"
    out = glmkit("rollout-data", tmp_path / "to_zero", "--checkpoint", tiny_ckpt)
    assert error(out) == (f"glmkit rollout-data: error: {tmp_path / 'to_zero'}: is a character device (through a "
                          f"symbolic link); rollout data is one .pt file")


def test_a_marker_file_that_is_a_device_or_pipe_is_refused_not_read(tmp_path):
    """latest_checkpointed_iteration.txt pointing at /dev/zero, or a FIFO in its place: reading either
    never ends (found by the hostile pass: --resume hung). Refused by what it is."""
    from glmkit.checkpoint import CheckpointError
    from glmkit.checkpoint.torch_dist import resolve_dir
    from glmkit.inputs import read_marker

    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "ok.txt").write_text(" 12\n" + "x" * 10_000)
    with pytest.raises(ValueError, match=r"zero.txt: is a character device \(through a symbolic link\)"):
        read_marker(tmp_path / "zero.txt")
    with pytest.raises(ValueError, match=r"pipe.txt: is a named pipe \(FIFO\)"):
        read_marker(tmp_path / "pipe.txt")
    assert read_marker(tmp_path / "ok.txt", limit=8) == "12\nxxxx"
    ckpt = tmp_path / "torch_dist"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="is a character device"):
        resolve_dir(ckpt)


def test_a_full_disk_inside_a_library_is_the_environments_error(capsys):
    """safetensors reports a full disk as its own error with the OS error's text (found by the hostile pass
    on a 64 KiB tmpfs: exit 3, 'please report it'); it is exit 4, one line. A library error with no OS
    error inside stays internal (exit 3)."""
    from safetensors import SafetensorError

    from glmkit.cli import _answer_failure

    full = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert _answer_failure("ckpt", full) == 4
    assert capsys.readouterr().err == ("glmkit ckpt: environment error: No space left on device (SafetensorError; "
                                       "nothing half-written is left in place)\n")
    try:
        try:
            raise OSError(122, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed") from inner
    except RuntimeError as wrapped:
        assert _answer_failure("train", wrapped) == 4
    assert "environment error: Disk quota exceeded" in capsys.readouterr().err
    assert _answer_failure("ckpt", SafetensorError("header too large (os error 2)")) == 3  # ENOENT: not the env's
    capsys.readouterr()


@pytest.mark.parametrize("text, reason", [
    ('{"step": "x", "param_groups": []}', "expected"),        # used to end in str + int (exit 3)
    ('{"step": -2, "param_groups": []}', "expected"),
    ('[1, 2]', "expected"),
    ("[" * 100_000 + "]" * 100_000, "cannot be read"),         # used to end in RecursionError (exit 3)
    ('{"step": 1, "param_groups": [], "config": [1]}', "expected"),
    ('{"step": 1, "param_groups": []}', "expected"),                # no config: nothing to check a resume against
])
def test_a_damaged_training_state_is_named_for_resume(tmp_path, text, reason):
    from glmkit.rl.loop import _read_state

    (tmp_path / "state.json").write_text(text)
    with pytest.raises(ValueError, match=rf"state.json: {reason}.*--resume"):
        _read_state(tmp_path)
    (tmp_path / "state.json").write_text('{"step": 3, "param_groups": [{"lr": 1e-6}], "config": {"seed": 0}}')
    assert _read_state(tmp_path)["step"] == 3


def test_resume_metrics_rows_that_are_not_objects_move_aside_and_bytes_survive(tmp_path):
    from glmkit.rl.loop import _truncate_metrics

    metrics = tmp_path / "m.jsonl"
    odd = '{"step": 0, "note": "\udcff"}'  # a row holding bytes that are not UTF-8
    metrics.write_text("\n".join([odd, "3", "[1]", '{"step": "x"}', '{"step": 1}', "[" * 5000]) + "\n",
                       encoding="utf-8", errors="surrogateescape")
    notes = _truncate_metrics(metrics, start_step=1)
    assert "moved 5 later metric rows" in notes[0]
    assert metrics.read_text(encoding="utf-8", errors="surrogateescape") == odd + "\n"


def test_a_checkpoint_name_that_is_a_symlink_is_replaced_without_touching_its_target(tmp_path):
    """iter_0000002 made a link to iter_0000001 (hostile pass: 'Cannot call rmtree on a symbolic link',
    exit 3): saving step 2 replaces the link, and iter_0000001 keeps what it held."""
    from glmkit.model import load_model
    from glmkit.rl.loop import TrainConfig, _save_checkpoint
    from glmkit.checkpoint import synth_checkpoint

    ckpt = synth_checkpoint("tiny", 0, tmp_path / "ck", progress=False)
    save = tmp_path / "save"
    (save / "iter_0000001").mkdir(parents=True)
    (save / "iter_0000001" / "mine.txt").write_text("keep")
    (save / "iter_0000002").symlink_to(save / "iter_0000001")
    policy = load_model(ckpt)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    _save_checkpoint(TrainConfig(checkpoint=str(ckpt), prompt_data="p", save=str(save)), 2, policy, optimizer, None)
    assert not (save / "iter_0000002").is_symlink() and (save / "iter_0000002" / "state.json").is_file()
    assert (save / "iter_0000001" / "mine.txt").read_text() == "keep"
    # every file gets the umask's mode (safetensors creates its own 0600)
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (save / "iter_0000002").rglob("*") if p.is_file()}
    assert "optimizer.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_overwrite_of_a_training_run_removes_nothing_it_did_not_write(tmp_path):
    """Hostile pass 4: `train --overwrite` deleted a user's file inside iter_*, and with a linked iter_*
    deleted the metrics and every checkpoint before failing with exit 3. Both are refused before
    anything is removed; a checkpoint as glmkit left it is still replaced."""
    from glmkit.checkpoint import synth_checkpoint
    from glmkit.model import load_model
    from glmkit.outputs import mark_file
    from glmkit.rl.loop import TrainConfig, _claim_outputs, _save_checkpoint

    ckpt = synth_checkpoint("tiny", 0, tmp_path / "ck", progress=False)
    save, metrics = tmp_path / "save", tmp_path / "m.jsonl"
    cfg = TrainConfig(checkpoint=str(ckpt), prompt_data="p", save=str(save), metrics_out=str(metrics), overwrite=True)
    policy = load_model(ckpt)
    _save_checkpoint(cfg, 1, policy, torch.optim.AdamW(policy.parameters(), lr=1e-6), None)
    metrics.write_text('{"step": 0}\n')
    mark_file(metrics, "metrics file")
    (save / "iter_0000001" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"iter_0000001/notes.txt added after glmkit wrote the checkpoint"):
        _claim_outputs(cfg)
    (save / "iter_0000001" / "notes.txt").unlink()
    (save / "iter_0000001" / "model" / "mine.txt").write_text("mine")  # pass 5: deeper down, in model/
    with pytest.raises(ValueError, match=r"iter_0000001/model/mine.txt added after glmkit wrote"):
        _claim_outputs(cfg)
    (save / "iter_0000001" / "model" / "mine.txt").unlink()
    (save / "iter_0000002").mkdir()  # pass 5: unmarked, with the files an old glmkit checkpoint holds
    for name in ("state.json", "optimizer.safetensors", "theirs.txt"):
        (save / "iter_0000002" / name).write_text("{}")
    with pytest.raises(ValueError, match=r"iter_0000002 not marked as glmkit's"):
        _claim_outputs(cfg)
    shutil.rmtree(save / "iter_0000002")
    (tmp_path / "via").symlink_to(save)  # pass 5: --save itself a link
    with pytest.raises(ValueError, match=r"reached through a symbolic link; --overwrite never removes through a link"):
        _claim_outputs(TrainConfig(checkpoint=str(ckpt), prompt_data="p", save=str(tmp_path / "via"),
                                   metrics_out=str(metrics), overwrite=True))
    (tmp_path / "elsewhere").mkdir()
    (save / "iter_0000005").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"iter_0000005 is a symbolic link; --overwrite never removes through a link"):
        _claim_outputs(cfg)
    assert metrics.is_file() and (save / "iter_0000001" / "state.json").is_file()  # nothing removed
    (save / "iter_0000005").unlink()
    notes = _claim_outputs(cfg)
    assert not metrics.exists() and not (save / "iter_0000001").exists() and len(notes) == 2


def test_a_marked_empty_metrics_file_is_a_run_that_never_started(tmp_path):
    """A run stopped before its first row (refused weights at rollout 0, with no evaluation) leaves its
    marked, empty metrics file: the next run there starts without --overwrite. A file with a row, an
    unmarked empty one, or a link to a marked one still needs --overwrite or --resume."""
    from glmkit.outputs import mark_file
    from glmkit.rl.loop import TrainConfig, _claim_outputs

    metrics = tmp_path / "m.jsonl"
    cfg = TrainConfig(checkpoint="ck", prompt_data="p", metrics_out=str(metrics))
    metrics.touch()
    mark_file(metrics, "metrics file")
    assert _claim_outputs(cfg) == [] and metrics.exists()
    metrics.write_text('{"eval/step": 0}\n')
    with pytest.raises(ValueError, match=r"already holds a run's metrics"):
        _claim_outputs(cfg)
    for name, make in (("unmarked.jsonl", lambda p: p.touch()), ("link.jsonl", lambda p: p.symlink_to(metrics))):
        make(tmp_path / name)
        metrics.write_text("")
        with pytest.raises(ValueError, match=r"already holds a run's metrics"):
            _claim_outputs(TrainConfig(checkpoint="ck", prompt_data="p", metrics_out=str(tmp_path / name)))


def test_resume_refuses_an_iteration_that_is_a_symlink(tmp_path):
    """glmkit writes iter_* as directories; a link in its place (to another run's checkpoint, say) is
    not continued from."""
    from glmkit.rl.loop import TrainConfig, _latest

    save = tmp_path / "save"
    (tmp_path / "elsewhere").mkdir()
    save.mkdir()
    (save / "iter_0000003").symlink_to(tmp_path / "elsewhere")
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(ValueError, match=r"iter_0000003 is a symbolic link .*--resume continues only"):
        _latest(TrainConfig(checkpoint="c", prompt_data="p", save=str(save)))
    # hostile pass 15: without the marker, iter_* there were ignored and a new run started beside them;
    # an iter_* that is a file was said not to exist
    (save / "iter_0000003").unlink()
    (save / "iter_0000003").write_text("not a folder")
    with pytest.raises(ValueError, match=r"iter_0000003 is not a directory$"):
        _latest(TrainConfig(checkpoint="c", prompt_data="p", save=str(save)))
    (save / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(ValueError, match=r"holds iter_0000003 but no latest_checkpointed_iteration.txt .* --resume "
                                         r"cannot tell which is whole"):
        _latest(TrainConfig(checkpoint="c", prompt_data="p", save=str(save)))
    (save / "iter_0000003").unlink()
    assert _latest(TrainConfig(checkpoint="c", prompt_data="p", save=str(save))) is None  # nothing saved yet


def test_marker_files_keep_names_that_are_not_utf8(tmp_path):
    """A metrics file named with a byte that is not UTF-8 (hostile pass: UnicodeEncodeError, exit 3)."""
    from glmkit.outputs import foreign_entries, is_glmkit_file, mark, mark_file, record_entries

    name = os.fsdecode(b"m\xff.jsonl")
    (tmp_path / name).write_text("{}\n")
    mark_file(tmp_path / name, "metrics file")
    assert is_glmkit_file(tmp_path / name)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / name).write_text("x")
    mark(folder, "test output")
    record_entries(folder)
    assert foreign_entries(folder) == []


def test_serve_host_that_does_not_resolve_is_bad_input(tiny_ckpt):
    out = glmkit("serve", "--checkpoint", tiny_ckpt, "--host", "no-such-host.invalid", "--port", 0)
    assert error(out).startswith("glmkit serve: error: --host 'no-such-host.invalid': ")


def test_an_empty_or_foreign_marker_claims_nothing(tmp_path):
    """A 0-byte `.user.jsonl.glmkit-output` (a run cut short by a full disk leaves one) made --overwrite
    delete the user's file (hostile pass). Only a marker as glmkit writes it counts."""
    from glmkit.outputs import file_marker, is_glmkit_file, is_glmkit_output, mark, mark_file, refuse_replacing

    user = tmp_path / "user.jsonl"
    user.write_text('{"prompt": "mine"}\n')
    file_marker(user).write_text("")
    assert not is_glmkit_file(user)
    with pytest.raises(ValueError, match="user.jsonl"):
        refuse_replacing(user, "--metrics-out", "metrics file")
    assert user.read_text() == '{"prompt": "mine"}\n'
    file_marker(user).write_text("anything else\n")
    assert not is_glmkit_file(user)
    mark_file(user, "metrics file")
    assert is_glmkit_file(user)
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / ".glmkit-output").write_text("")
    assert not is_glmkit_output(folder)
    mark(folder, "test output")
    assert is_glmkit_output(folder)


def test_serve_empty_host_is_refused_not_every_interface(tiny_ckpt):
    out = glmkit("serve", "--checkpoint", tiny_ckpt, "--host", "", "--port", 0)
    assert error(out).startswith("glmkit serve: error: --host '': empty (it would listen on every interface)")


@pytest.mark.parametrize("host", ["0", "0x0", "0.0"])
def test_serve_host_shorthands_for_every_interface_are_refused(host):
    """Hostile pass 4: `--host 0` listened on 0.0.0.0 and printed http://0:PORT. Every interface is asked
    for in words; the check runs before the model loads."""
    from glmkit.serve.server import _check_host

    with pytest.raises(ValueError, match=rf"--host '{host}' means every interface \(0.0.0.0\)"):
        _check_host(host)
    for meant in ("127.0.0.1", "0.0.0.0", "::"):
        _check_host(meant)
    with pytest.raises(ValueError, match=r"means every interface \(::ffff:0.0.0.0\)"):
        _check_host("::ffff:0.0.0.0")  # pass 5: IPv4-mapped, every IPv4 interface


def test_serve_on_a_port_in_use_is_the_users_to_change(tiny_ckpt):
    """Hostile pass 5: exit 3 ('please report it') for a port in use or an address not of this machine."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = glmkit("serve", "--checkpoint", tiny_ckpt, "--port", taken.getsockname()[1])
    assert out.returncode == 2 and "already in use on 127.0.0.1; choose another port" in error(out), out.stderr


def test_safetensors_header_length_is_bounded_before_it_is_read(tmp_path):
    """A sparse file whose prefix claims a 3 GiB header made `ckpt info` read 3 GiB (hostile pass)."""
    from glmkit.checkpoint import CheckpointError
    from glmkit.checkpoint.hf import MAX_HEADER_BYTES, read_header

    file = tmp_path / "model.safetensors"
    with open(file, "wb") as f:
        f.write((3 << 30).to_bytes(8, "little"))
        f.truncate((3 << 30) + 16)  # sparse: the claimed header fits the file's size
    with pytest.raises(CheckpointError, match=rf"header of {3 << 30} bytes; safetensors allows at most "
                                              rf"{MAX_HEADER_BYTES}"):
        read_header(file)
    header = json.dumps({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(CheckpointError, match=r"dtype 'F128'; allowed: .*BF16"):
        read_header(file)


def test_json_is_parsed_only_when_its_size_and_the_memory_it_takes_allow(tiny_ckpt, tmp_path, monkeypatch):
    """Hostile pass 12: a 300 MB config.json was read whole, and a 96 MB safetensors header (within
    safetensors' limit) took 2.2 GB as Python objects. A config past 16 MiB is refused unread; a header
    is parsed only when ~32x its size is free."""
    import glmkit.bounds
    from glmkit.checkpoint import CheckpointError
    from glmkit.checkpoint.hf import read_header

    bad = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["padding"] = " " * (17 << 20)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: \d+ bytes; a config.json is read whole and glmkit reads "
                                              r"at most 16777216 \(16 MiB\)"):
        open_checkpoint(bad)
    file = tmp_path / "one.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    assert read_header(file)["w"].shape == (1,)
    monkeypatch.setattr(glmkit.bounds, "free_bytes", lambda device: 32 * len(header) - 1)
    with pytest.raises(CheckpointError, match=rf"{len(header)} bytes of JSON take about .* GiB to parse and this "
                                              rf"machine has"):
        read_header(file)


@pytest.mark.parametrize("signals", [1, 8])
def test_sigterm_unwinds_like_ctrl_c_with_one_line(tmp_path, signals):
    """SIGTERM (a scheduler's stop) used to end the process with 143 and no word, locks left behind.
    Hostile pass 12 (F07): SIGTERMs repeated 50 ms apart broke into the cleanup the first one started
    and ended in a traceback; only the first one unwinds now."""
    import signal
    import time

    run = subprocess.Popen([sys.executable, "-m", "glmkit", "check", "--out", str(tmp_path / "check")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "check").exists() and time.time() < deadline and run.poll() is None:
        time.sleep(0.2)  # the command has started its work (its output folder claimed)
    sent = 0
    for _ in range(signals):
        if run.poll() is not None:
            break
        run.send_signal(signal.SIGTERM)
        sent += 1
        time.sleep(0.01)
    _, err = run.communicate(timeout=120)
    assert sent == signals or (signals > 1 and sent >= 2), sent  # repeats reached the cleanup (what F07 broke)
    assert run.returncode == 143, err[-2000:]
    assert err.count("glmkit check: terminated (outputs are renamed into place only when complete") == 1, err[-2000:]
    assert "Traceback" not in err
    assert not list(tmp_path.glob("**/*.glmkit-lock")) and not (tmp_path / "check" / "report.html").exists()


@pytest.mark.parametrize("name, value", [("rms_norm_eps", float("nan")), ("max_position_embeddings", -1),
                                         ("routed_scaling_factor", float("inf"))])
def test_config_numbers_every_forward_uses_are_checked_at_load(tiny_ckpt, tmp_path, name, value):
    from glmkit.checkpoint import CheckpointError

    bad = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["text_config"][name] = value
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"{name} must be a positive finite number within float32's range, "
                                              rf"got {value!r}"):
        open_checkpoint(bad)


@pytest.mark.parametrize("name, value, reason", [
    ("hc_sinkhorn_iters", 10**9, r"hc_sinkhorn_iters must be an integer in 1\.\.1000, got 1000000000"),
    ("hc_sinkhorn_iters", 0, r"hc_sinkhorn_iters must be an integer in 1\.\.1000, got 0"),
    # hostile pass 15: without layer_types, transformers' config took minutes over 10**6 layers
    ("num_hidden_layers", 10**6, r"num_hidden_layers must be an integer in 1\.\.10000, got 1000000"),
    ("index_topk", 10**9, r"index_topk must be an integer in 1\.\.\d+, got 1000000000"),
    ("pad_token_id", 5000, r"pad_token_id must be a token id below vocab_size \d+ \(or null\), got 5000"),
    ("swiglu_limit", float("nan"), r"swiglu_limit must be a positive finite number \(or null\), got nan")])
def test_config_counts_that_size_every_forward_are_bounded_at_load(tiny_ckpt, tmp_path, name, value, reason):
    """Hostile pass 8: hc_sinkhorn_iters 10**9 passed `ckpt info` and hung every forward (serve too);
    index_topk 10**9 asked capture for 56 GB and was blamed on the machine; a NaN swiglu_limit and a pad
    id past the vocabulary were taken. Each is refused at load, by name, with its bounds."""
    from glmkit.checkpoint import CheckpointError

    bad = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["text_config"][name] = value
    if name == "num_hidden_layers":  # as in pass 15: the per-layer lists left to transformers to build
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            config["text_config"].pop(key, None)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=reason):
        open_checkpoint(bad)


def _train_with_file_size_limit(tmp_path, limit: int, *extra):
    """`glmkit train` in a child whose files may not grow past `limit` bytes (RLIMIT_FSIZE, SIGXFSZ
    ignored): each write past it fails with EFBIG as a full disk fails with ENOSPC, after a short write."""
    import resource
    import signal

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    metrics = tmp_path / "m.jsonl"
    done = subprocess.run([sys.executable, "-m", "glmkit", "train", "--num-rollout", "3",
                           "--metrics-out", str(metrics), *extra], capture_output=True, text=True, timeout=600,
                          preexec_fn=limited)
    return done, metrics


def test_a_disk_that_fills_mid_run_leaves_whole_rows_only(tmp_path):
    """A write the disk cuts short used to leave half a row at the end of the metrics file; it is cut
    back to the last whole row, the run ends with exit 4 and one line, and the file stays glmkit's."""
    from glmkit.outputs import is_glmkit_file

    done, metrics = _train_with_file_size_limit(tmp_path, 3000)  # a few rows fit (each ~1 KB)
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("glmkit train: environment error: File too large")
    text = metrics.read_text()
    assert text and text.endswith("\n") and len(text) <= 3000
    assert all(isinstance(json.loads(line), dict) for line in text.splitlines())
    assert is_glmkit_file(metrics)


def test_a_disk_full_at_the_save_leaves_no_empty_save_folder(tmp_path):
    """Hostile pass 10: a checkpoint the disk could not hold left the --save folder the run had made,
    empty, looking like a run's checkpoints. Every row fits here; the model's weights do not."""
    done, metrics = _train_with_file_size_limit(tmp_path, 60_000, "--save", str(tmp_path / "s"))
    assert done.returncode == 4, done.stderr
    assert "environment error: File too large" in done.stderr
    assert not (tmp_path / "s").exists() and len(metrics.read_text().splitlines()) >= 3


def test_a_disk_full_before_the_first_row_leaves_nothing_claimed(tmp_path):
    """The marker is written whole or not at all, before the metrics file: a disk full at the very start
    used to leave an empty marker beside an empty metrics file, which no later run could replace."""
    # room for the run lock's one line (pid, host, start time), not for the marker (which also names the host)
    done, metrics = _train_with_file_size_limit(tmp_path, len(socket.gethostname()) + 90)
    assert done.returncode == 4, done.stderr
    assert "environment error: File too large" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".glmkit-lock")) == []


def test_an_output_file_is_a_regular_file_and_never_standard_output(tmp_path):
    """Hostile pass 4: `--metrics-out /dev/null` or a FIFO was told it 'already holds a run's metrics', and
    `--metrics-out -` wrote a file named '-'. Both are refused by what they are."""
    from glmkit.outputs import check_file_out

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ValueError, match="--metrics-out -: glmkit writes to a file, not to standard output"):
        check_file_out("-", "--metrics-out")
    with pytest.raises(ValueError, match=r"pipe: is a named pipe \(FIFO\); give the path of a regular file"):
        check_file_out(tmp_path / "pipe", "--metrics-out")
    with pytest.raises(ValueError, match="/dev/null: is a character device"):
        check_file_out("/dev/null", "--metrics-out")
    assert check_file_out(tmp_path / "m.jsonl", "--metrics-out") == tmp_path / "m.jsonl"


def test_a_fault_in_an_arguments_type_function_is_an_internal_error(monkeypatch, capsys, tmp_path):
    """An exception other than argparse's own from a type function (a bug in glmkit, not the input) ended
    in a bare traceback with exit 1, before the CLI's error contract applied; it is exit 3 with the
    traceback saved, like any internal error."""
    import glmkit.cli as cli

    def broken(text):
        raise ZeroDivisionError("a bug in a type function")

    real = cli.build_parser

    def parser():
        built = real()
        built.add_argument("--broken", type=broken)
        return built

    monkeypatch.setattr(cli, "build_parser", parser)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert cli.main(["--broken", "1", "ckpt", "info", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert err.startswith("glmkit arguments: internal error: ZeroDivisionError: a bug in a type function (traceback "
                          "saved to "), err
    saved = Path(err.split("traceback saved to ")[1].split(";")[0])
    assert "ZeroDivisionError" in saved.read_text()


def test_hostile_pass_6_inputs_are_refused_by_name(tmp_path, capsys):
    """Hostile pass 6: each of these ended in exit 3 (an overflow inside torch, requests' InvalidURL, a
    RecursionError, open()'s 'embedded null byte'). Each is now refused by the input it names."""
    import glmkit.cli as cli
    from glmkit.launch.launcher import parse_extra_env_vars
    from glmkit.notebook import parse_value
    from glmkit.serve.client import check_server_url

    with pytest.raises(SystemExit) as refused:
        cli.main(["train", "--num-rollout", str(10 ** 26), "--metrics-out", str(tmp_path / "m.jsonl")])
    assert refused.value.code == 2 and "argument --num-rollout: must be at most 4611686018427387904" in capsys.readouterr().err
    from glmkit.rl.loop import TrainConfig

    with pytest.raises(ValueError, match="at most 1048576 tokens"):
        TrainConfig(rollout_max_response_len=1 << 30).resolved()
    with pytest.raises(ValueError, match="host '%zz' is not a host name or an IP address"):
        check_server_url("http://%zz")
    deep = "[" * 100_000 + "]" * 100_000
    assert parse_extra_env_vars("A=1") == {"A": "1"}
    with pytest.raises(ValueError, match="pair"):  # deep JSON is read as K=V pairs: refused as one
        parse_extra_env_vars(deep)
    with pytest.raises(ValueError, match="nested past"):
        parse_value(deep)


def test_pass_8_small_inputs_each_get_one_line_and_exit_2(tmp_path, capsys):
    """Hostile pass 8's smaller findings, each refused by name before any work: an output through a
    loop of links (was an internal error), a path option given as '' (was silently the default),
    a sliced checkpoint written into its source, -p out_dir that --out would replace silently,
    lora prepare with an alpha past float32, parity of a path against itself (a pass that means nothing)."""
    from glmkit.cli import main as cli_main

    from tests.test_notebooks import small_notebook

    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    ckpt = Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start"
    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    notebook = small_notebook(tmp_path / "nb.ipynb", "print(message)")
    cases = [
        (["check", "--out", str(tmp_path / "loop-a" / "x")], f"{tmp_path / 'loop-a' / 'x'}: a loop of symbolic links"),
        (["check", "--checkpoint", "", "--out", str(tmp_path / "c")], "--checkpoint is an empty path"),
        (["train", "--metrics-out", ""], "--metrics-out is an empty path"),
        (["ckpt", "slice", "--src", str(src), "--layers", "2", "--out", str(src / "inner")],
         f"--out {src / 'inner'} is inside this run's --src ({src}); write it beside its input"),
        (["report", str(notebook), "--out", str(tmp_path / "r"), "-p", "out_dir", str(tmp_path / "other")],
         f"-p out_dir {tmp_path / 'other'}: the notebook's out_dir is the report directory"),
        (["lora", "prepare", "--lora-alpha", "1e39"], "--lora-alpha 1e+39: beyond float32's range"),
        (["parity", "--checkpoint", str(ckpt), "--paths", "train,train"], "compares train with itself"),
        # hostile pass 12: a positional argument was called --path, and /proc named neither flag nor reason
        (["rollout-data", "", "--checkpoint", str(ckpt)], "the PATH argument is an empty path"),
        (["train", "--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0 (alpha / rank scales"),
        (["parity", "--checkpoint", str(src), "--paths", "train,rollout", "--save-captures", str(src / "caps")],
         f"--save-captures {src / 'caps'} is inside this run's --checkpoint ({src}); write it beside its input"),
        (["ckpt", "verify-conversion", "--hf", str(ckpt), "--torch-dist", str(src), "--json", str(src / "v.json")],
         f"--json {src / 'v.json'} is inside this run's --torch-dist ({src}); write it beside its input"),
        (["rollout-data", "x.pt", "--check", ""], "--checkpoint is an empty path"),
        # hostile pass 13: a line break in a path made the one-line error two lines, the second forgeable
        (["ckpt", "info", "/tmp/x\nglmkit ckpt: ok"], "the PATH argument '/tmp/x\\nglmkit ckpt: ok' holds a control"),
        (["launch", "--dry-run", "--hf-checkpoint", "/root/x\nPREFLIGHT: all ok"],  # pass 14: a forged plan line
         "--hf-checkpoint '/root/x\\nPREFLIGHT: all ok' holds a control character"),
        (["check", "--checkpoint", "a\x1b[31mb", "--out", str(tmp_path / "c")], "--checkpoint 'a\\x1b[31mb' holds a"),
        (["check", "--out", "/proc/glmkit-out"], "--out /proc/glmkit-out: no folder can be made at "
                                                 "/proc/glmkit-out (No such file or directory)"),
    ]
    for argv, needle in cases:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (argv, err)
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in ckpt.iterdir())
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()


def test_a_file_size_limit_names_the_file_and_leaves_nothing(tmp_path):
    """`ulimit -f` (EFBIG, 'File too large') was said without the file: now the write names it and
    leaves no temporary behind (Python ignores SIGXFSZ, so the write raises)."""
    probe = ("import resource, sys\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
             "from glmkit.report import write_atomic\n"
             "try:\n"
             "    write_atomic(sys.argv[1], b'x' * 4096)\n"
             "except OSError as err:\n"
             "    print(err.errno, err.filename)\n")
    target = tmp_path / "big.html"
    run = subprocess.run([sys.executable, "-c", probe, str(target)], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.stdout.split() == [str(errno.EFBIG), str(target)], run.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_tampered_optimizer_state_is_named_before_resume_loads_it(tmp_path):
    """Hostile pass 9: param_groups of another optimizer were torch's ValueError (exit 3), a moment of
    the wrong shape failed only after a whole rollout, a key past the parameters was a KeyError and a
    key without a dot an unnamed unpacking error. Each is named with its file before anything loads."""
    from safetensors.torch import load_file, save_file

    from glmkit.checkpoint import synth_checkpoint
    from glmkit.model import load_model
    from glmkit.rl.loop import TrainConfig, _read_state, _restore_optimizer, _save_checkpoint, build_optimizer

    ckpt = synth_checkpoint("tiny", 0, tmp_path / "ck", progress=False)
    cfg = TrainConfig(checkpoint=str(ckpt), prompt_data="p", save=str(tmp_path / "save"),
                      metrics_out=str(tmp_path / "m.jsonl"), weight_decay=0.1, lr=1e-4, adam_beta1=0.9, adam_beta2=0.98)
    policy = load_model(ckpt)
    optimizer = build_optimizer(cfg, policy)
    sum(p.sum() for p in policy.parameters()).backward()
    optimizer.step()
    folder = _save_checkpoint(cfg, 0, policy, optimizer, None)
    groups = _read_state(folder)["param_groups"]
    moments = load_file(str(folder / "optimizer.safetensors"))

    def restore(groups=groups, tensors=None):
        if tensors is not None:
            save_file(tensors, str(folder / "optimizer.safetensors"))
        _restore_optimizer(build_optimizer(cfg, load_model(ckpt)), folder, groups)

    restore()  # as saved: loads
    # hostile pass 15: maximize, eps, betas and amsgrad were loaded from state.json as they stood
    # (gradient ascent, exit 0); only the learning rate is the checkpoint's, the rest this run's
    tampered = [{**g, "maximize": True, "eps": -1.0, "betas": [2, 3], "amsgrad": True, "lr": 5e-5} for g in groups]
    resumed = build_optimizer(cfg, load_model(ckpt))
    _restore_optimizer(resumed, folder, tampered)
    assert all(g["maximize"] is False and g["eps"] > 0 and tuple(g["betas"]) == (0.9, 0.98) and not g["amsgrad"]
               and g["lr"] == 5e-5 for g in resumed.param_groups)
    with pytest.raises(ValueError, match=r"state.json: 1 param_groups; this run's optimizer has 2; --resume cannot"):
        restore(groups[:1])
    with pytest.raises(ValueError, match=r"param_groups\[0\].lr is 'fast'; this run's is"):
        restore([{**groups[0], "lr": "fast"}, groups[1]])
    wrong = dict(moments, **{"0.exp_avg": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"optimizer.safetensors: tensor '0.exp_avg' has shape \[3\]; its parameter's"):
        restore(tensors=wrong)
    for key in ("999999.exp_avg", "nodot", "0.momentum"):
        with pytest.raises(ValueError, match=rf"tensor '{key}' is not a moment of this run's optimizer"):
            restore(tensors=dict(moments, **{key: torch.zeros(1)}))
    # hostile pass 13: a moment missing was a KeyError (exit 3); an empty, truncated or garbled file
    # safetensors' own error (exit 3); a folder an OSError; a FIFO hung --resume, deaf to SIGTERM
    with pytest.raises(ValueError, match=r"optimizer.safetensors: parameter 0 has no exp_avg \(AdamW keeps"):
        restore(tensors={k: v for k, v in moments.items() if k != "0.exp_avg"})
    # hostile pass 14: a NaN moment (or a negative second moment) resumed, and the next checkpoint held NaN
    for key, value in (("0.exp_avg", float("nan")), ("0.exp_avg_sq", -1.0)):
        with pytest.raises(ValueError, match=rf"tensor '{key}' holds a NaN, an infinite.* value; AdamW's moments"):
            restore(tensors=dict(moments, **{key: torch.full_like(moments[key], value)}))
    file = folder / "optimizer.safetensors"
    for damage, reason in ((lambda: file.write_bytes(b""), r"truncated safetensors file \(0 bytes, no header\)"),
                           (lambda: file.write_bytes(b"\x10" + bytes(7) + b"{garbage}" + bytes(7)),
                            "corrupt safetensors header"),
                           (lambda: (file.unlink(), file.mkdir()), "is a directory, not a safetensors file"),
                           (lambda: (file.rmdir(), os.mkfifo(file)), r"is a named pipe \(FIFO\), not a safetensors")):
        damage()
        with pytest.raises(ValueError, match=rf"optimizer.safetensors: {reason}.*; --resume cannot continue from it"):
            restore()


def test_an_unknown_parity_path_is_refused_before_any_model_loads(monkeypatch, capsys):
    """Hostile pass 12: `--paths train,bogus` loaded and ran the train path before naming 'bogus'."""
    import glmkit.model
    import glmkit.reference
    from glmkit.cli import main as cli_main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(glmkit.model, "load_model", no_model)
    monkeypatch.setattr(glmkit.reference, "load_reference", no_model)
    ckpt = Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start"
    assert cli_main(["parity", "--checkpoint", str(ckpt), "--paths", "train,bogus"]) == 2
    err = capsys.readouterr().err
    assert err == ("glmkit parity: error: unknown path 'bogus'; allowed: reference, train, rollout, "
                   "sglang:http://HOST:PORT or a capture directory\n"), err


def test_check_decode_steps_are_bounded_by_memory_before_anything_loads(monkeypatch, tmp_path, capsys):
    """Hostile pass 12: `check --decode-steps 65536` had no memory estimate; it began a greedy rollout
    whose reference pass needs hundreds of GiB. Now refused with both numbers before any model loads."""
    import glmkit.bounds
    import glmkit.model
    from glmkit.cli import main as cli_main

    monkeypatch.setattr(glmkit.bounds, "free_bytes", lambda device: 8 << 30)
    monkeypatch.setattr(glmkit.model, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli_main(["check", "--decode-steps", "65536", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "--decode-steps 65536: 65577 tokens through the reference need at least 225 GiB" in err, err
    assert "and cpu has 8 GiB free" in err, err
    # hostile pass 13: a config whose index_topk makes check's own prompts too long blamed --decode-steps
    # ("use at most -1951441"); the config is named now
    big = copy_ckpt(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start", tmp_path / "big")
    config = json.loads((big / "config.json").read_text())
    config["text_config"]["index_topk"] = 1000000
    (big / "config.json").write_text(json.dumps(config))
    assert cli_main(["check", "--checkpoint", str(big), "--decode-steps", "2", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert f"{big / 'config.json'}: index_topk 1000000 and index_kpool 4 make glmkit check's longest prompt" in err, err


def test_a_checkpoint_with_a_nan_or_inf_weight_is_refused_when_it_loads(tmp_path):
    """Hostile pass 13: one NaN weight passed loading; train then failed in sampling and check in its
    plots, both exit 3 (and serve answered 500). The loaded weights are checked, by tensor."""
    from glmkit.checkpoint import CheckpointError
    from glmkit.model import load_model

    source = Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start"
    suffixes = {"nan": "layers.1.mlp.down_proj.weight", "-inf": "embed_tokens.weight",
                "inf": "layers.3.mlp.experts.5.up_proj.weight"}  # one expert of a stack: named as stored
    for value in (float("nan"), float("-inf"), float("inf")):
        bad = copy_ckpt(source, tmp_path / f"bad-{value}")
        tensors = load_file(str(bad / "model.safetensors"))
        key = next(k for k in tensors if k.endswith(suffixes[str(value)]))
        tensors[key].view(-1)[7] = value
        save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=rf"tensor {re.escape(key)} holds 1 NaN or infinite value\(s\) of "
                                                  rf"\d+; a checkpoint's weights must be finite"):
            load_model(bad)
    assert load_model(source) is not None


def test_a_state_step_that_does_not_follow_its_folder_is_refused(tmp_path):
    """Hostile pass 13: `"step": 10**30` in iter_0000000/state.json resumed a run that then trained
    nothing and said "no optimizer step was taken" with exit 0. iter_N is saved after rollout N and
    records step N (as _save_checkpoint writes it: checked on a real checkpoint); any other is refused."""
    from glmkit.model import load_model
    from glmkit.rl.loop import TrainConfig, TrainState, _read_state, _save_checkpoint, build_optimizer

    ckpt = synth_checkpoint("tiny", 0, tmp_path / "ck", progress=False)
    cfg = TrainConfig(checkpoint=str(ckpt), prompt_data="p", save=str(tmp_path / "save"),
                      metrics_out=str(tmp_path / "m.jsonl"), weight_decay=0.1, lr=1e-4, adam_beta1=0.9, adam_beta2=0.98)
    policy = load_model(ckpt)
    folder = _save_checkpoint(cfg, TrainState(step=5), policy, build_optimizer(cfg, policy), None)
    assert folder.name == "iter_0000004" and _read_state(folder)["step"] == 4  # as written: read back
    for step in (10 ** 30, 5, 0):
        (folder / "state.json").write_text(json.dumps({"step": step, "param_groups": [], "config": {}}))
        with pytest.raises(ValueError, match=rf"state.json: step {step} does not match its folder iter_0000004 "
                                             rf"\(the checkpoint of rollout 4 records step 4\)"):
            _read_state(folder)


def test_a_checkpoint_without_a_dsa_layer_is_refused_before_the_reference_runs(tiny_ckpt, tmp_path, capsys):
    """Hostile pass 15: `ckpt slice --layers 3` of the tiny model (its DSA layer is the 4th) is a valid
    checkpoint, and check / parity against the reference ended in exit 3 after the greedy rollout
    (transformers' cache reads the length from an attention layer). Refused when the reference loads."""
    from glmkit.checkpoint import slice_checkpoint
    from glmkit.cli import main as cli_main

    sliced = slice_checkpoint(tiny_ckpt, 3, tmp_path / "s3", progress=False)
    assert cli_main(["check", "--checkpoint", str(sliced), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (after the stage bar's line)
    assert last.startswith("glmkit check: error: ") and "the reference needs" not in err[:err.index(last)], err
    assert "the transformers reference needs at least one DSA layer" in last and "Traceback" not in err, err
    assert cli_main(["parity", "--checkpoint", str(sliced), "--paths", "train,rollout", "--seq-len", "8",
                     "--batch", "1"]) == 0


@pytest.mark.parametrize("name, value, needle", [
    ("routed_scaling_factor", 2, "Field 'routed_scaling_factor' expected float, got int (value: 2)"),
    ("index_kpool", "4", "index_kpool"),
])
def test_a_config_transformers_refuses_is_one_line(tiny_ckpt, tmp_path, capsys, name, value, needle):
    """Hostile pass 15: transformers' validation errors came out as two lines ("Validation error for
    field ...:" and the reason's), against the one-line contract."""
    from glmkit.cli import main as cli_main

    bad = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["text_config"][name] = value
    (bad / "config.json").write_text(json.dumps(config))
    assert cli_main(["ckpt", "info", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("glmkit ckpt: error: "), err
