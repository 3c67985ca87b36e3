"""The recipe's commands, built exactly, as data: what `glmkit launch --dry-run` prints and what a
Ray job runs for the `miles` backend.

    conversion   torchrun --nproc-per-node <GPUs a node> tools/convert_hf_to_torch_dist.py <model args>
                   --hf-checkpoint HF --save <ckpt-dir>/<megatron_model_type>_torch_dist
                 env CONVERT_KEEP_PP1=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONPATH=<megatron path>
                 (full launcher only: the LoRA launcher builds its model from the HF checkpoint)
    train        python scripts/run_glm5_3_flash.py <the launcher's options as given>
                 env MILES_SCRIPT_EXTERNAL_RAY=1 (the cluster is up: the launcher must not restart Ray)
    lora         python scripts/run_glm5_3_flash_lora.py prepare <options>, then ... train <options>

The model arguments of the conversion come from the framework's own helper at run time (`MODEL_ARGS`
read from `model_args_utils.py <megatron_model_type>`), as the recipe does: the kit never guesses them.
The launcher's options are `glmkit.launch.launcher`'s data; what the user gives is passed in the
launcher's own spelling, so the same command line works with either.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from glmkit.collectives import NO_MULTICAST
from glmkit.launch.launcher import MEGATRON_MODEL_TYPE, Launcher, parse_extra_env_vars

MILES_DIR = "/root/miles"
MEGATRON_DIR = "/root/Megatron-LM"


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


def conversion(model: str, hf_checkpoint: str, ckpt_dir: str, nproc: int,
               megatron_path: str = MEGATRON_DIR, miles_dir: str = MILES_DIR) -> Command:
    """The recipe's conversion of the HF checkpoint to --ref-load's torch_dist, one process a GPU of
    the node it runs on (the recipe writes 8 for its 8-GPU nodes)."""
    key = MEGATRON_MODEL_TYPE[model]
    prelude = (f'MODEL_ARGS_LINE="$(python3 miles/utils/external_utils/model_args_utils.py {key})" || exit 1',
               'read -ra MODEL_ARGS <<< "${MODEL_ARGS_LINE}"')
    argv = ("torchrun", "--nproc-per-node", str(nproc), "tools/convert_hf_to_torch_dist.py", '"${MODEL_ARGS[@]}"',
            "--hf-checkpoint", hf_checkpoint, "--save", torch_dist_dir(ckpt_dir, model))
    env = {"CONVERT_KEEP_PP1": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": megatron_path}
    return Command("convert", argv, env, cwd=miles_dir, prelude=prelude)


def launcher_given(given: dict, job_env: dict | None = None) -> dict:
    """The user's launcher options with NVLink multicast kept off in the training job (and `job_env`
    added): the launcher adds --extra-env-vars last to the training job's runtime env, after its own
    NVLink probe, so these reach the processes that train. Passed as one JSON object."""
    env = {**parse_extra_env_vars(given.get("extra_env_vars") or ""), **(job_env or {}), **NO_MULTICAST}
    return {**given, "extra_env_vars": json.dumps(env, sort_keys=True)}


def train(launcher: Launcher, given: dict, job_env: dict | None = None, miles_dir: str = MILES_DIR) -> Command:
    """The launcher's training run (the LoRA launcher's `train`) with the options the user gave, run in
    the framework's checkout `miles_dir`."""
    return Command("train", tuple(launcher.argv(launcher_given(given, job_env))), {"MILES_SCRIPT_EXTERNAL_RAY": "1"},
                   cwd=miles_dir)


def lora_prepare(launcher: Launcher, given: dict, miles_dir: str = MILES_DIR) -> Command:
    """The LoRA launcher's `prepare` (downloads the known HF checkpoint and the task's dataset)."""
    argv = launcher.argv(launcher_given(given))
    argv[argv.index("train")] = "prepare"
    return Command("lora-prepare", tuple(argv), {"MILES_SCRIPT_EXTERNAL_RAY": "1"}, cwd=miles_dir)


def runtime_env(extra: dict | None = None) -> dict:
    """The job's runtime env as the framework sets it, NVLink multicast kept off."""
    env = {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
           "PYTHONPATH": f"{MILES_DIR}:{MEGATRON_DIR}", **NO_MULTICAST}
    env.update(extra or {})
    for key, value in NO_MULTICAST.items():  # never switched back on by a caller
        env[key] = value
    return {"env_vars": env}


def plan_commands(launcher: Launcher, given: dict, gpus_per_node: int, miles_dir: str = MILES_DIR) -> list[Command]:
    """Everything a launch runs, in order: the conversion (full launcher), the LoRA launcher's
    prepare, the training run."""
    values = launcher.resolved(given)
    commands = []
    if launcher.name == "full":
        commands.append(conversion(values["model_name"], values["hf_checkpoint"], values["ckpt_dir"], gpus_per_node,
                                   values["megatron_path"], miles_dir))
    else:
        commands.append(lora_prepare(launcher, given, miles_dir))
    commands.append(train(launcher, given, miles_dir=miles_dir))
    return commands
