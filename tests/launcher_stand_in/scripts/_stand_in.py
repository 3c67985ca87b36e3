"""The launchers' execution, as a stand-in (see ../README.md)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

BOOLS = ("cuda_core_dump", "force", "ci_run", "check_weight_update_equal", "enable_r3", "skip_saving",
         "lora_base_cpu_backup", "experts_shared_outer_loras", "check_lora_weight_equal", "use_r3", "enable_wandb")
VALUES = ("num_nodes", "extra_env_vars", "output_dir", "cluster_backend", "run_id", "namespace", "model_name", "task",
          "num_gpus_per_node", "hf_checkpoint", "model_dir", "ckpt_dir", "data_dir", "save_dir", "megatron_path",
          "train_offload_dir", "num_rollout", "rollout_max_response_len", "extra_args", "tensor_model_parallel_size",
          "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "rollout_batch_size", "n_samples_per_prompt",
          "global_batch_size", "rollout_temperature", "rollout_num_gpus_per_engine", "sglang_mem_fraction_static",
          "sglang_lora_backend", "lr")


def parse(argv, allowed):
    parser = argparse.ArgumentParser()
    for field in allowed:
        flag = "--" + field.replace("_", "-")
        if field in BOOLS:
            parser.add_argument(flag, dest=field, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=field)
    return parser.parse_args(argv)


def extra_env(text):
    text = (text or "").strip()
    if not text:
        return {}
    try:
        return json.loads(text)
    except ValueError:
        return dict(pair.split("=", 1) for pair in text.split())


def run(args, train_words):
    master = os.environ.get("MASTER_ADDR", "no-master-addr-given")  # the real launcher: 127.0.0.1
    env = {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_NVLS_ENABLE": "1",
           "no_proxy": f"127.0.0.1,{master}", "MASTER_ADDR": master}
    env.update(extra_env(args.extra_env_vars))
    if os.environ.get("WANDB_API_KEY"):  # as the launchers turn the key into the trainer's argument
        train_words = [*train_words, "--wandb-key", os.environ["WANDB_API_KEY"]]
    here = Path(__file__).resolve().parents[1]
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
    cmd = [ray, "job", "submit"]
    if "RAY_ADDRESS" not in os.environ:
        cmd.append("--address=http://127.0.0.1:8265")
    cmd += [f"--runtime-env-json={json.dumps({'env_vars': env})}", "--", sys.executable, str(here / "train.py"),
            *train_words]
    print("EXEC:", " ".join(cmd[:3]), "...", flush=True)
    return subprocess.run(cmd).returncode
