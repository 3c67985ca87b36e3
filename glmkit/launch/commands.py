"""The recipe's commands, built exactly, as data: what `glmkit launch --dry-run` prints and what a
Ray job runs for the `miles` backend.

    conversion   torchrun --nproc-per-node N tools/convert_hf_to_torch_dist.py <model args>
                   --hf-checkpoint HF --save <ckpt-dir>/<megatron_model_type>_torch_dist
                 env CONVERT_KEEP_PP1=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=/root/Megatron-LM
    train        python scripts/run_glm5_3_flash.py train --model-name M --num-nodes N
                   --num-gpus-per-node G --num-rollout R --rollout-max-response-len L [--enable-r3]
                 env MILES_SCRIPT_EXTERNAL_RAY=1 (the kit brings the Ray cluster up itself)
    lora         python scripts/run_glm5_3_flash_lora.py prepare --model-name M, then ... train
                   --model-name M --num-nodes N --num-gpus-per-node G

The model arguments of the conversion come from the framework's own helper at run time (`MODEL_ARGS`
read from `model_args_utils.py <megatron_model_type>`), as the recipe does: the kit never guesses them.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from glmkit.launch.shapes import FULL, Shape

MILES_DIR = "/root/miles"
MEGATRON_DIR = "/root/Megatron-LM"
# The framework's name of each model (its model_args_utils key; --ref-load's <megatron_model_type>).
MEGATRON_MODEL_TYPE = {FULL: "glm5.3-flash", "GLM-5.3-Flash-4layer": "glm5.3-flash-4layer"}
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Command:
    """argv run in `cwd` with `env` added; `prelude` lines (shell) run first, as the recipe writes them."""

    name: str
    argv: tuple
    env: dict = field(default_factory=dict)
    cwd: str = MILES_DIR
    prelude: tuple = ()

    def shell(self) -> str:
        """The command as a user pastes it: cd, prelude, then VAR=value ... argv, one flag a line."""
        lines = [f"cd {shlex.quote(self.cwd)}", *self.prelude]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        words, parts = [], list(self.argv)
        i = 0
        while i < len(parts):  # keep "--flag value" together on one continuation line
            word = parts[i] if parts[i] == '"${MODEL_ARGS[@]}"' else shlex.quote(parts[i])
            if parts[i].startswith("--") and i + 1 < len(parts) and not parts[i + 1].startswith("--"):
                word += " " + shlex.quote(parts[i + 1])
                i += 1
            words.append(word)
            i += 1
        first_flag = next((i for i, w in enumerate(words) if w.startswith("--")), len(words))
        head = (env + " " if env else "") + " ".join(words[:max(1, first_flag)])
        lines.append(" \\\n    ".join([head, *words[max(1, first_flag):]]))
        return "\n".join(lines)

    def entrypoint(self) -> str:
        """One shell line for a Ray job's entrypoint, the command's own env in front of it. Ray runs
        entrypoints with /bin/sh: a prelude in bash syntax (read -ra, arrays) goes through bash -c."""
        env = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        body = " ".join(env + ['"${MODEL_ARGS[@]}"' if a == '"${MODEL_ARGS[@]}"' else shlex.quote(a) for a in self.argv])
        line = " && ".join([f"cd {shlex.quote(self.cwd)}", *self.prelude, body])
        return f"bash -c {shlex.quote(line)}" if self.prelude else line


def torch_dist_dir(ckpt_dir: str, model: str) -> str:
    """Where --ref-load resolves: <ckpt-dir>/<megatron_model_type>_torch_dist."""
    return f"{ckpt_dir.rstrip('/')}/{MEGATRON_MODEL_TYPE[model]}_torch_dist"


def conversion(model: str, hf_checkpoint: str, ckpt_dir: str, nproc: int = 8) -> Command:
    key = MEGATRON_MODEL_TYPE[model]
    prelude = (f'MODEL_ARGS_LINE="$(python3 miles/utils/external_utils/model_args_utils.py {key})" || exit 1',
               'read -ra MODEL_ARGS <<< "${MODEL_ARGS_LINE}"')
    argv = ("torchrun", "--nproc-per-node", str(nproc), "tools/convert_hf_to_torch_dist.py", '"${MODEL_ARGS[@]}"',
            "--hf-checkpoint", hf_checkpoint, "--save", torch_dist_dir(ckpt_dir, model))
    env = {"CONVERT_KEEP_PP1": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": MEGATRON_DIR}
    return Command("convert", argv, env, prelude=prelude)


def train(shape: Shape, num_rollout: int | None = None, response_len: int | None = None,
          enable_r3: bool = False) -> Command:
    """The training launch of a shape (the LoRA launcher's train step for LoRA shapes)."""
    if shape.lora:
        argv = ["python", "scripts/run_glm5_3_flash_lora.py", "train", "--model-name", shape.model]
    else:
        argv = ["python", "scripts/run_glm5_3_flash.py", "train", "--model-name", shape.model]
    argv += ["--num-nodes", str(shape.nodes), "--num-gpus-per-node", str(shape.gpus_per_node)]
    if num_rollout is not None:
        argv += ["--num-rollout", str(num_rollout)]
    if response_len is not None:
        argv += ["--rollout-max-response-len", str(response_len)]
    if enable_r3:
        argv.append("--enable-r3")
    return Command("train", tuple(argv), {"MILES_SCRIPT_EXTERNAL_RAY": "1"})


def lora_prepare(model: str) -> Command:
    return Command("lora-prepare", ("python", "scripts/run_glm5_3_flash_lora.py", "prepare", "--model-name", model),
                   {"MILES_SCRIPT_EXTERNAL_RAY": "1"})


def runtime_env(extra: dict | None = None) -> dict:
    """The job's runtime env as the framework sets it, NVLink multicast kept off."""
    env = {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": f"{MILES_DIR}:{MEGATRON_DIR}", **NO_MULTICAST}
    env.update(extra or {})
    for key, value in NO_MULTICAST.items():  # never switched back on by a caller
        env[key] = value
    return {"env_vars": env}


def plan_commands(shape: Shape, hf_checkpoint: str, ckpt_dir: str, num_rollout: int | None = None,
                  response_len: int | None = None, enable_r3: bool = False) -> list[Command]:
    """Everything a launch of `shape` runs, in order."""
    commands = [conversion(shape.model, hf_checkpoint, ckpt_dir)]
    if shape.lora:
        commands.append(lora_prepare(shape.model))
    commands.append(train(shape, num_rollout, response_len, enable_r3))
    return commands
