"""Launch planning without a cluster: the shape table, pipeline splits, preflight checks and the
recipe's exact commands (snapshots pinned in tests/snapshots/)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from glmkit.config import variant_config
from glmkit.launch import commands
from glmkit.launch.preflight import failed, preflight
from glmkit.launch.shapes import SHAPES, NoShape, pick_shape, pipeline_split

SNAPSHOTS = Path(__file__).parent / "snapshots"


# The recipe's tables, as the launchers at the recipe's commit lay them out (read from
# scripts/run_glm5_3_flash.py as merged and scripts/run_glm5_3_flash_lora.py): launcher, model, nodes,
# GPUs a node -> TP, PP, first / last stage layers, EP, GPUs an engine, engines (colocated: the rollout
# uses every trainer GPU), max tokens a GPU, trainer offload target, routing-replay option.
RECIPE = [
    ("full", "GLM-5.3-Flash", 16, 4, dict(tp=8, pp=4, first=11, last=12, ep=16, engine=8, engines=8, tokens=8192,
                                          offload="disk", r3="--enable-r3")),
    ("full", "GLM-5.3-Flash", 8, 4, dict(tp=8, pp=4, first=11, last=12, ep=8, engine=8, engines=4, tokens=8192,
                                         offload="disk", r3="--enable-r3")),
    ("full", "GLM-5.3-Flash-4layer", 2, 4, dict(tp=2, pp=2, first=None, last=None, ep=2, engine=4, engines=2,
                                                tokens=8192, offload="disk", r3="--enable-r3")),
    ("full", "GLM-5.3-Flash-4layer", 1, 8, dict(tp=2, pp=2, first=None, last=None, ep=2, engine=4, engines=2,
                                                tokens=8192, offload="disk", r3="--enable-r3")),
    ("lora", "GLM-5.3-Flash-4layer", 1, 8, dict(tp=8, pp=1, first=None, last=None, ep=8, engine=8, engines=1,
                                                tokens=16384, offload="cpu", r3="--use-r3")),
    ("lora", "GLM-5.3-Flash", 3, 8, dict(tp=8, pp=1, first=None, last=None, ep=24, engine=8, engines=3,
                                         tokens=16384, offload="cpu", r3="--use-r3")),
]


@pytest.mark.parametrize("launcher, model, nodes, gpus, want", RECIPE)
def test_the_plan_for_each_recipe_shape_is_the_launchers(launcher, model, nodes, gpus, want):
    from glmkit.launch import plan

    launch = plan(model, nodes, gpus, lora=launcher == "lora", gpu_mem_gib=288)
    layout = launch.layout()
    assert (layout["tp"], layout["pp"], layout["ep"], layout["engine_gpus"], layout["engines"]) == \
        (want["tp"], want["pp"], want["ep"], want["engine"], want["engines"])
    assert (launch.shape.first_stage_layers, launch.shape.last_stage_layers) == (want["first"], want["last"])
    assert layout["rollout_gpus"] == layout["trainer_gpus"] == nodes * gpus and layout["colocated"]
    assert layout["engine_tp"] == layout["engine_ep"] == want["engine"]
    assert (layout["max_tokens_per_gpu"], layout["offload"]) == (want["tokens"], want["offload"])
    assert launch.routing_replay["option"] == want["r3"]
    assert launch.routing_replay["framework_flag"] == "--use-rollout-routing-replay"
    assert launch.routing_replay["on"] == (launcher == "lora")  # the LoRA launcher's --use-r3 is on by default
    assert sum(layout["pipeline_stages"]) == variant_config(model).num_hidden_layers
    assert launch.ok, [c.line() for c in failed(launch.checks)]
    text = launch.text()
    assert f"TP {want['tp']}, PP {want['pp']}" in text and f"EP {want['ep']}" in text
    assert f"{want['engines']} SGLang engine(s) of {want['engine']} GPUs" in text
    train = launch.commands[-1]
    script = "scripts/run_glm5_3_flash_lora.py" if launcher == "lora" else "scripts/run_glm5_3_flash.py"
    # the full launcher is a single-command typer app: run bare, the word `train` would be refused
    assert list(train.argv[:3 if launcher == "lora" else 2]) == ["python", script] + (["train"] if launcher == "lora" else [])
    argv = list(train.argv)
    for flag, value in (("--model-name", model), ("--num-nodes", str(nodes)), ("--num-gpus-per-node", str(gpus))):
        assert argv[argv.index(flag) + 1] == value
    if launcher == "full":  # conversion: a process per GPU of the node it runs on
        convert = launch.commands[0]
        assert convert.argv[:3] == ("torchrun", "--nproc-per-node", str(gpus))
    else:
        assert [c.name for c in launch.commands] == ["lora-prepare", "train"]
        assert launch.commands[0].argv[2] == "prepare"


def test_shapes_the_launchers_refuse_are_refused_with_their_reason():
    with pytest.raises(NoShape, match=r"full-model layout on 32 or 64 GPUs; 2 x 4 = 8"):
        pick_shape("GLM-5.3-Flash", 2, 4)
    with pytest.raises(NoShape, match=r"4-layer layout on 8 GPUs; 4 x 4 = 16"):
        pick_shape("GLM-5.3-Flash-4layer", 4, 4)
    with pytest.raises(NoShape, match="--model-name 'GLM-5'; allowed: GLM-5.3-Flash, GLM-5.3-Flash-4layer"):
        pick_shape("GLM-5", 1, 8)
    with pytest.raises(NoShape, match="--num-nodes must be a positive integer, got 0"):
        pick_shape("GLM-5.3-Flash", 0, 8)
    with pytest.raises(NoShape, match="expert parallel size 40 must divide 288 experts"):
        pick_shape("GLM-5.3-Flash", 5, 8, lora=True)
    with pytest.raises(NoShape, match="--tensor-model-parallel-size 3 does not divide 1 x 8 = 8 GPUs"):
        pick_shape("GLM-5.3-Flash-4layer", 1, 8, lora=True, tensor_parallel=3)
    # the launcher checks GPU totals, not a list: 4 x 8 is the 8 x 4 layout on 8-GPU nodes
    assert pick_shape("GLM-5.3-Flash", 4, 8).ep == 8
    assert pick_shape("GLM-5.3-Flash-4layer", 2, 4, lora=True).tp == 4  # TP min(8, GPUs a node)


def test_the_users_paths_and_settings_reach_the_trainer():
    """Each path a user gives goes where the launcher reads it: its own options by their own names,
    what it has no option for (the dataset, max tokens, the stage split) through --extra-args, which it
    appends last (the framework's argparse keeps the last value)."""
    import shlex

    from glmkit.launch import plan

    launch = plan("GLM-5.3-Flash", 8, 4, hf_checkpoint="/data/hf", ckpt_dir="/data/ckpt", prompt_data="/data/p.jsonl",
                  input_key="question", label_key="answer", max_tokens_per_gpu=4096, last_stage_layers=12,
                  enable_r3=True, gpu_mem_gib=288, options={"data_dir": "/data/sets", "save_dir": "/data/out",
                                                             "skip_saving": False, "run_id": "r1",
                                                             "extra_args": "--lr 2e-6",
                                                             "extra_env_vars": "WANDB_MODE=offline"})
    argv = [part for w in launch.commands[-1].argv for part in (w.split("=", 1) if w.startswith("--extra") else [w])]
    value = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    # a value that begins with '-' is joined to its flag, so no parser takes it for an option
    assert any(w.startswith("--extra-args=--lr 2e-6") for w in launch.commands[-1].argv)
    assert value["--hf-checkpoint"] == "/data/hf" and value["--ckpt-dir"] == "/data/ckpt"
    assert value["--data-dir"] == "/data/sets" and value["--save-dir"] == "/data/out" and "--no-skip-saving" in argv
    assert "--enable-r3" in argv
    extra = shlex.split(value["--extra-args"])
    assert extra[:2] == ["--lr", "2e-6"]  # the user's own first, untouched
    pairs = dict(zip(extra[2::2], extra[3::2]))
    assert pairs == {"--prompt-data": "/data/p.jsonl", "--input-key": "question", "--label-key": "answer",
                     "--max-tokens-per-gpu": "4096", "--decoder-last-pipeline-num-layers": "12"}
    env = json.loads(value["--extra-env-vars"])
    assert env["WANDB_MODE"] == "offline" and env["NCCL_NVLS_ENABLE"] == "0"
    assert launch.paths["prompt_data"] == "/data/p.jsonl" and launch.paths["ref_load"] == "/data/ckpt/glm5.3-flash_torch_dist"
    assert launch.paths["save"] == "/data/out/r1/checkpoints" and launch.layout()["max_tokens_per_gpu"] == 4096
    assert launch.commands[0].argv[-1] == "/data/ckpt/glm5.3-flash_torch_dist"  # the conversion writes --ref-load
    with pytest.raises(ValueError, match="--prompt-data is given twice"):
        plan("GLM-5.3-Flash-4layer", 1, 8, prompt_data="/a", options={"extra_args": "--prompt-data /b"})
    with pytest.raises(ValueError, match=r"--ckpt-dir: scripts/run_glm5_3_flash_lora.py has no such option"):
        plan("GLM-5.3-Flash-4layer", 1, 8, lora=True, ckpt_dir="/c")
    with pytest.raises(ValueError, match=r"--enable-r3: .* routing replay is its --use-r3"):
        plan("GLM-5.3-Flash-4layer", 1, 8, lora=True, options={"enable_r3": True})  # the CLI's --enable-r3
    assert plan("GLM-5.3-Flash-4layer", 1, 8, lora=True, enable_r3=False).values["use_r3"] is False  # the API's
    for bad, why in (("--max-tokens-per-gpu", "has no value"), ("--max-tokens-per-gpu=lots", "'lots' is not an integer"),
                     ("--prompt-data 'unclosed", "cannot be split as the shell would")):
        with pytest.raises(ValueError, match=why):
            plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_args": bad})
    assert plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_args": "--prompt-data=/p.jsonl"}).paths["prompt_data"] \
        == "/p.jsonl"
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_env_vars": "JUSTAWORD"})
    # hostile pass 13: JSON values that are not strings reached the job stringified (PATH=None)
    for given, shown in (('{"PATH": null}', "'PATH' is null"), ('{"A": 1}', "'A' is 1"),
                         ('{"C": {"x": 1}}', """'C' is {"x": 1}""")):
        with pytest.raises(ValueError, match=rf"--extra-env-vars: the value of {re.escape(shown)}; environment values "
                                             rf"must be JSON strings"):
            plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_env_vars": given})
    # hostile pass 14: the K=V form took a name the JSON form refuses; a NUL in a value was taken
    with pytest.raises(ValueError, match=r"'A\\x1b\[31m' is not an environment variable name"):
        plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_env_vars": "A\x1b[31m=1"})
    with pytest.raises(ValueError, match=r"the value of 'A' holds a NUL character"):
        plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_env_vars": '{"A": "x\\u0000y"}'})
    lora = plan("GLM-5.3-Flash-4layer", 1, 8, lora=True, options={"use_r3": False, "task": "dapo-math"})
    assert "--no-use-r3" in lora.commands[-1].argv and not lora.routing_replay["on"]
    assert lora.paths["prompt_data"] == "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl"
    assert lora.values["rollout_max_response_len"] == 4096  # the launcher's rule for dapo-math


def test_a_command_line_moves_between_glmkit_and_the_launcher_unchanged(capsys):
    """The launcher's options given to `glmkit launch` come out in the launch command as they went in."""
    from glmkit.cli import main

    options = ["--model-name", "GLM-5.3-Flash", "--num-nodes", "16", "--num-gpus-per-node", "4", "--num-rollout", "20",
               "--rollout-max-response-len", "4096", "--enable-r3", "--no-check-weight-update-equal",
               "--train-offload-dir", "/scratch/offload", "--run-id", "bringup-1",
               "--helm-values", "a.yaml", "--helm-values", "b.yaml"]  # a repeatable option, repeated
    assert main(["launch", "--dry-run", "--json", "--gpu-memory-gib", "288", *options]) == 0
    data = json.loads(capsys.readouterr().out)
    argv = data["commands"][-1]["argv"]
    assert argv[:2] == ["python", "scripts/run_glm5_3_flash.py"]
    rest = [w for i, w in enumerate(argv[2:]) if w != "--extra-env-vars" and argv[2:][i - 1] != "--extra-env-vars"]
    assert sorted(rest) == sorted(options)
    assert data["layout"]["ep"] == 16 and data["routing_replay"]["on"] and data["ok"]
    assert data["paths"]["offload_dir"] == "/scratch/offload"
    # a value that is itself a command line, as the launchers take it; secrets shown as ***
    assert main(["launch", "--dry-run", "--json", "--gpu-memory-gib", "288", "--extra-args", "--lr 2e-6", "--extra-env-vars",
                 '{"WANDB_API_KEY": "s3cr3t", "NCCL_DEBUG": "INFO"}']) == 0
    text = capsys.readouterr().out
    data = json.loads(text)
    assert "--extra-args=--lr 2e-6" in data["commands"][-1]["argv"] and "s3cr3t" not in text and "***" in text


def test_pipeline_split_as_megatron_derives_it():
    assert pipeline_split(45, 4, last=12) == [11, 11, 11, 12]
    assert pipeline_split(45, 4, first=12) == [12, 11, 11, 11]
    assert pipeline_split(45, 3) == [15, 15, 15]
    assert pipeline_split(46, 4, first=10, last=12) == [10, 12, 12, 12]
    assert pipeline_split(45, 1) == [45]
    with pytest.raises(ValueError, match="45 layers do not split over 4 stages"):
        pipeline_split(45, 4)
    with pytest.raises(ValueError, match="leaves 2 layers unplaced"):
        pipeline_split(10, 2, first=4, last=4)


def test_every_recipe_shape_passes_its_layout_checks():
    for shape in SHAPES:
        checks = preflight(variant_config(shape.model), shape, gpu_mem_gib=288)  # the recipe's GB300
        assert not failed(checks), [c.line() for c in failed(checks)]
        names = {c.name for c in checks}
        assert {"world divisible by TP x PP", "routed experts divisible by EP", "pipeline split",
                "every stage computes its own top-k", "memory per GPU"} <= names


def _with(shape, **changes):
    from dataclasses import replace
    return replace(shape, **changes)


@pytest.mark.parametrize("changes, failing, words", [
    (dict(tp=3), "world divisible by TP x PP", "does not divide"),
    (dict(tp=24, nodes=24), "DSA heads divisible by TP", "leaves a remainder"),
    (dict(ep=7), "routed experts divisible by EP", "leaves a remainder"),
    (dict(ep=32), "EP fits the data-parallel layout", "must divide"),
    (dict(pp=4, last_stage_layers=None), "pipeline split", "do not split over 4 stages"),
])
def test_bad_shapes_fail_the_right_check(changes, failing, words):
    shape = _with(SHAPES[0], **changes)
    bad = {c.name: c for c in failed(preflight(variant_config(shape.model), shape, gpu_mem_gib=288))}
    assert failing in bad, [c.line() for c in bad.values()]
    if words:
        assert words in bad[failing].detail


def test_a_shared_indexer_at_a_stage_start_fails():
    config = variant_config("GLM-5.3-Flash")
    types = list(config.indexer_types)
    types[11] = "shared"  # layer 11 opens stage 1 of 11/11/11/12 and would need layer 7's top-k
    config.indexer_types = types
    checks = {c.name: c for c in preflight(config, SHAPES[0], gpu_mem_gib=288)}
    assert not checks["every stage computes its own top-k"].ok
    assert "layer 11, which shares the top-k of a layer on stage 0" in checks["every stage computes its own top-k"].detail


def test_memory_arithmetic_is_shown_and_judged():
    full_8x4 = next(s for s in SHAPES if s.name == "full-8x4")
    mem = {c.name: c for c in preflight(variant_config(full_8x4.model), full_8x4, gpu_mem_gib=141)}["memory per GPU"]
    assert not mem.ok  # Adam states of 45 layers over 32 H200s do not fit; on GB300 (288 GB) they do
    for part in ("weights", "grads", "Adam", "kept inputs", "recomputed layer", "engine weights", "limit 90% of 141"):
        assert part in mem.detail
    inventory = [{"node": "a", "gpus": 8, "gpu_memory_gib": 139.8}]
    checks = {c.name: c for c in preflight(variant_config("GLM-5.3-Flash-4layer"), SHAPES[3], inventory=inventory)}
    assert checks["the cluster has the GPUs"].ok and checks["memory per GPU"].ok
    assert "of 140 GiB" in checks["memory per GPU"].detail
    two_small = [{"node": "a", "gpus": 4}, {"node": "b", "gpus": 2}]
    checks = {c.name: c for c in preflight(variant_config("GLM-5.3-Flash-4layer"), SHAPES[2], inventory=two_small)}
    assert not checks["the cluster has the GPUs"].ok
    assert not checks["memory per GPU"].ok and "GPU memory unknown" in checks["memory per GPU"].detail


def render_all() -> str:
    from glmkit.launch import plan

    out = []
    for launcher, model, nodes, gpus, _ in RECIPE:
        launch = plan(model, nodes, gpus, lora=launcher == "lora", num_rollout=20, response_len=4096,
                      enable_r3=True if launcher == "full" and model.endswith("4layer") else None)
        out.append(f"### {launch.shape.name}")
        for cmd in launch.commands:
            out += [f"# {cmd.name}", cmd.shell(), f"# entrypoint: {cmd.entrypoint()}"]
    return "\n".join(out) + "\n"


def test_commands_match_the_snapshot():
    """Every shape's commands, exactly. After an intended change: GLMKIT_UPDATE_SNAPSHOTS=1 pytest ..."""
    path = SNAPSHOTS / "launch_commands.txt"
    text = render_all()
    if os.environ.get("GLMKIT_UPDATE_SNAPSHOTS"):
        path.write_text(text)
    assert text == path.read_text()


def test_commands_are_the_recipes():
    from glmkit.launch import plan

    convert, train = plan("GLM-5.3-Flash", 16, 4, num_rollout=20, response_len=4096).commands
    assert convert.argv[:4] == ("torchrun", "--nproc-per-node", "4", "tools/convert_hf_to_torch_dist.py")
    assert convert.argv[-2:] == ("--save", "/root/ckpt/glm5.3-flash_torch_dist")
    assert convert.env == {"CONVERT_KEEP_PP1": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": "/root/Megatron-LM"}
    argv = list(train.argv)
    assert argv[:2] == ["python", "scripts/run_glm5_3_flash.py"] and "train" not in argv
    assert json.loads(argv[argv.index("--extra-env-vars") + 1]) == commands.NO_MULTICAST
    assert train.env == {"MILES_SCRIPT_EXTERNAL_RAY": "1"}
    env = commands.runtime_env({"NCCL_NVLS_ENABLE": "1", "MASTER_ADDR": "10.0.0.1"})["env_vars"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["MASTER_ADDR"] == "10.0.0.1"
    # a user's NCCL_NVLS_ENABLE=1 through --extra-env-vars cannot switch multicast back on
    launch = plan("GLM-5.3-Flash-4layer", 1, 8, options={"extra_env_vars": '{"NCCL_NVLS_ENABLE": "1", "A": "b"}'})
    argv = list(launch.commands[-1].argv)
    assert json.loads(argv[argv.index("--extra-env-vars") + 1]) == {**commands.NO_MULTICAST, "A": "b"}


def test_cli_dry_run_prints_preflight_then_commands(capsys):
    from glmkit.cli import main

    rc = main(["launch", "--model-name", "GLM-5.3-Flash", "--num-nodes", "16", "--num-gpus-per-node", "4", "--dry-run",
               "--gpu-memory-gib", "288", "--num-rollout", "20", "--rollout-max-response-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.index("preflight:") < out.index("commands:")
    assert "PASS  pipeline split: 45 layers over PP 4: 11 / 11 / 11 / 12" in out
    assert "MILES_SCRIPT_EXTERNAL_RAY=1 python scripts/run_glm5_3_flash.py \\\n    --num-nodes 16" in out
    assert "8 SGLang engine(s) of 8 GPUs" in out and "kills sglang, miles and redis" in out


def test_cli_impossible_shape_exits_2_before_printing_commands(capsys):
    from glmkit.cli import main

    rc = main(["launch", "--model-name", "GLM-5.3-Flash", "--nodes", "2", "--gpus-per-node", "4", "--dry-run"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "full-model layout on 32 or 64 GPUs; 2 x 4 = 8" in captured.err


def test_cli_failing_preflight_exits_1_and_names_the_check(capsys, tmp_path):
    from glmkit.cli import main

    (tmp_path / "data.jsonl").write_text('{"question": "1+1", "label": "2"}\n')
    rc = main(["launch", "--model-name", "GLM-5.3-Flash-4layer", "--nodes", "1", "--gpus-per-node", "8", "--dry-run",
               "--gpu-memory-gib", "141", "--prompt-data", str(tmp_path / "data.jsonl"),
               "--hf-checkpoint", str(tmp_path / "missing"), "--ckpt-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL  dataset" in out and "needs keys 'prompt' and 'label'" in out
    assert "FAIL  HF checkpoint" in out and "config.json not found" in out
    assert "FAIL  reference checkpoint (--ref-load)" in out and "glm5.3-flash-4layer_torch_dist not found" in out


def test_path_checks_on_real_files(tiny_ckpt, tmp_path):
    from glmkit.launch.preflight import dataset_check, hf_checkpoint_check, torch_dist_check

    ok = hf_checkpoint_check("tiny", tiny_ckpt)   # a model with no fixed layer count: config read and reported
    assert ok.ok and "index_kpool" in ok.detail and "index_topk" in ok.detail
    wrong = hf_checkpoint_check("GLM-5.3-Flash", tiny_ckpt)
    assert not wrong.ok and "(a GLM-5.3-Flash checkpoint has 45)" in wrong.detail
    root = tmp_path / "glm5.3-flash-4layer_torch_dist"
    (root / "release").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert "incomplete torch_dist" in torch_dist_check("GLM-5.3-Flash-4layer", tmp_path).detail
    names = b"".join(f"decoder.layers.{i}.self_attention.x".encode() for i in range(3))
    (root / "release" / ".metadata").write_bytes(b"\x80\x04" + names + b"embedding.word_embeddings.weight")
    bad = torch_dist_check("GLM-5.3-Flash-4layer", tmp_path)
    assert not bad.ok and "decoder.layers.3., output_layer." in bad.detail
    (root / "release" / ".metadata").write_bytes(b"\x80\x04" + names + b"decoder.layers.3.x embedding.w output_layer.w")
    assert torch_dist_check("GLM-5.3-Flash-4layer", tmp_path).ok
    (root / "latest_checkpointed_iteration.txt").write_text("12")
    assert "iter_0000012" in torch_dist_check("GLM-5.3-Flash-4layer", tmp_path).detail
    (root / "latest_checkpointed_iteration.txt").write_text("rm -rf /")
    assert "expected 'release' or an iteration number" in torch_dist_check("GLM-5.3-Flash-4layer", tmp_path).detail
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"prompt": [{"role": "user", "content": "hi"}], "label": "3"}\n\xff\xfe\n')
    assert "line 2: not JSON" in dataset_check(data).detail  # the first rows (up to 3) must all parse
    data.write_bytes(b'{"prompt": "p", "label": "1"}\n' * 2 + b'{"prompt": "p", "label": "2"}\n' + b"\xff\n")
    assert dataset_check(data).ok  # rows after the first three are not read
    data.write_bytes(b"\xff\xfe not json\n")
    assert "line 1: not JSON" in dataset_check(data).detail


def test_builtin_bundle_gpu_fraction_reaches_the_job_and_bad_values_are_refused(capsys):
    """--bundle-gpu packs bundles on shared GPUs: the dry run's entrypoint carries it, argparse refuses a
    value outside (0, 1], and the job's own entrypoint refuses a fraction without --gpus."""
    from glmkit.cli import main
    from glmkit.launch import builtin

    args = ["launch", "--backend", "builtin", "--local-head", "--model-name", "tiny", "--dry-run", "--trainers", "1",
            "--device", "cuda", "--dtype", "bfloat16"]
    assert main(args + ["--bundle-gpu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "--trainers 1 --gpus --bundle-gpu 0.5" in out
    assert main(args) == 0
    assert "--bundle-gpu" not in capsys.readouterr().out  # the default (a whole GPU) is not spelled out
    for bad in ("0", "1.5", "half"):
        with pytest.raises(SystemExit):
            main(args + ["--bundle-gpu", bad])
        assert "--bundle-gpu" in capsys.readouterr().err
    assert main([a for a in args if a not in ("--device", "cuda")] + ["--bundle-gpu", "0.5"]) != 0
    assert "--bundle-gpu 0.5 is a share of a GPU: it needs --device cuda" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--bundle-gpu is a GPU fraction: it needs --gpus"):
        builtin.main(["--config-json", "{}", "--trainers", "1", "--bundle-gpu", "0.5"])
    with pytest.raises(SystemExit, match=r"--bundle-gpu must be in \(0, 1\], got 2.0"):
        builtin.main(["--config-json", "{}", "--gpus", "--bundle-gpu", "2"])


def test_a_run_id_that_leaves_the_save_dir_is_refused(capsys):
    """Hostile pass 9: `launch --dry-run --run-id ../../x` planned a save folder outside --save-dir."""
    from glmkit.cli import main

    for run_id in ("../../x", "a/b", ".."):
        assert main(["launch", "--dry-run", "--run-id", run_id]) == 2
        err = capsys.readouterr().err
        assert f"--run-id {run_id!r}: a run id is one folder name under --save-dir" in err and err.count("\n") == 1


@pytest.mark.parametrize("address, reason", [("http://[::1", "Invalid IPv6 URL"), ("http://h:99999", "Port out of range"),
                                             ("ftp://h:8265", None)])
def test_a_ray_address_urllib_cannot_parse_is_named(address, reason):
    """Hostile pass 11: `launch --address 'http://[::1' --attach` was an internal error (exit 3)."""
    from glmkit.launch.cluster import ClusterUnreachable, _check_address

    needle = f"{address!r} is not a Ray address" + (f" ({reason}" if reason else "; use http://HOST:8265")
    with pytest.raises(ClusterUnreachable, match=re.escape(needle)):
        _check_address(address)
    assert _check_address("ray://head:10001") == ("ray", "head", 10001)


@pytest.mark.parametrize("option, value, message", [
    ("--lora-rank", "-5", "must be >= 1 and <= 65536, got -5"),
    ("--lora-dropout", "2", "must be >= 0 and <= 1, got 2"),
    ("--rollout-temperature", "-3", "must be >= 0, got -3"),
    ("--n-samples-per-prompt", "0", "must be >= 1, got 0"),
    ("--num-rollout", "-4", "must be >= 1, got -4"),
    ("--rollout-max-response-len", "-1", "must be >= 1, got -1"),
    ("--sglang-mem-fraction-static", "7", "must be > 0 and <= 1, got 7"),
    ("--lora-alpha", "0", "must be > 0, got 0"),
    ("--lr", "inf", "must be a finite number, got 'inf'"),
])
def test_launcher_numbers_the_framework_cannot_run_are_refused_by_range(option, value, message, capsys):
    """Hostile pass 12: the preflight passed --lora-rank -5, --lora-dropout 2, --rollout-temperature -3,
    --n-samples-per-prompt 0 and more with exit 0, and printed them into the launcher's command."""
    from glmkit.cli import main

    with pytest.raises(SystemExit) as stopped:  # argparse's own exit, before anything runs
        main(["launch", "--dry-run", "--lora", "--gpu-memory-gib", "80", option, value])
    assert stopped.value.code == 2 and f"argument {option}: {message}" in capsys.readouterr().err
