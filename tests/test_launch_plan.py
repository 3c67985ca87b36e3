"""Launch planning without a cluster: the shape table, pipeline splits, preflight checks and the
recipe's exact commands (snapshots pinned in tests/snapshots/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from glmkit.config import variant_config
from glmkit.launch import commands
from glmkit.launch.preflight import failed, preflight
from glmkit.launch.shapes import SHAPES, NoShape, pick_shape, pipeline_split

SNAPSHOTS = Path(__file__).parent / "snapshots"


def test_pick_shape_for_every_row_and_explains_misses():
    for shape in SHAPES:
        assert pick_shape(shape.model, shape.nodes, shape.gpus_per_node, lora=shape.lora) is shape
    with pytest.raises(NoShape, match=r"on 2 x 4 GPUs; 8 GPUs are fewer than the smallest layout needs \(32\)"):
        pick_shape("GLM-5.3-Flash", 2, 4)
    with pytest.raises(NoShape, match="the recipe has: 2 x 4 \\(slice-2x4\\), 1 x 8 \\(slice-1x8\\)"):
        pick_shape("GLM-5.3-Flash-4layer", 4, 4)
    with pytest.raises(NoShape, match="unknown model 'GLM-5'; allowed: GLM-5.3-Flash, GLM-5.3-Flash-4layer"):
        pick_shape("GLM-5", 1, 8)
    with pytest.raises(NoShape, match="--nodes must be a positive integer, got 0"):
        pick_shape("GLM-5.3-Flash", 0, 8)


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
    out = []
    for shape in SHAPES:
        out.append(f"### {shape.name}")
        for cmd in commands.plan_commands(shape, "/root/models/" + shape.model, "/root/ckpt", num_rollout=20,
                                          response_len=4096, enable_r3=shape.name.startswith("slice")):
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
    full = commands.plan_commands(SHAPES[0], "/root/models/GLM-5.3-Flash", "/root/ckpt", 20, 4096)
    convert, train = full
    assert convert.argv[:4] == ("torchrun", "--nproc-per-node", "8", "tools/convert_hf_to_torch_dist.py")
    assert convert.argv[-2:] == ("--save", "/root/ckpt/glm5.3-flash_torch_dist")
    assert convert.env == {"CONVERT_KEEP_PP1": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": "/root/Megatron-LM"}
    assert list(train.argv) == ["python", "scripts/run_glm5_3_flash.py", "train", "--model-name", "GLM-5.3-Flash",
                                "--num-nodes", "16", "--num-gpus-per-node", "4", "--num-rollout", "20",
                                "--rollout-max-response-len", "4096"]
    assert train.env == {"MILES_SCRIPT_EXTERNAL_RAY": "1"}
    lora = commands.plan_commands(SHAPES[4], "/m", "/c")
    assert [c.name for c in lora] == ["convert", "lora-prepare", "train"]
    assert lora[2].argv[:3] == ("python", "scripts/run_glm5_3_flash_lora.py", "train")
    env = commands.runtime_env({"NCCL_NVLS_ENABLE": "1", "MASTER_ADDR": "10.0.0.1"})["env_vars"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["MASTER_ADDR"] == "10.0.0.1"


def test_cli_dry_run_prints_preflight_then_commands(capsys):
    from glmkit.cli import main

    rc = main(["launch", "--model-name", "GLM-5.3-Flash", "--nodes", "16", "--gpus-per-node", "4", "--dry-run",
               "--gpu-memory-gib", "288", "--num-rollout", "20", "--rollout-max-response-len", "4096"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.index("preflight:") < out.index("commands:")
    assert "PASS  pipeline split: 45 layers over PP 4: 11 / 11 / 11 / 12" in out
    assert "MILES_SCRIPT_EXTERNAL_RAY=1 python scripts/run_glm5_3_flash.py train" in out


def test_cli_impossible_shape_exits_2_before_printing_commands(capsys):
    from glmkit.cli import main

    rc = main(["launch", "--model-name", "GLM-5.3-Flash", "--nodes", "2", "--gpus-per-node", "4", "--dry-run"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "no layout of the recipe for GLM-5.3-Flash on 2 x 4 GPUs" in captured.err


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
