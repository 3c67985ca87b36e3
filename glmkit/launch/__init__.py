"""Launching the full run from a Ray client: plan and preflight (`shapes`, `preflight`), the recipe's
exact commands (`commands`), the cluster (`cluster`), jobs (`jobs`) and glmkit's own GRPO as Ray
actors (`builtin`). `plan()` puts a launch's checks and commands together."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LaunchPlan:
    shape: object
    checks: list
    commands: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def text(self) -> str:
        lines = [f"shape {self.shape.name}: {self.shape.nodes} x {self.shape.gpus_per_node} GPUs, TP {self.shape.tp}, "
                 f"PP {self.shape.pp}, EP {self.shape.ep}, rollout {self.shape.rollout_gpus} GPUs "
                 f"(engine TP {self.shape.engine_tp} / EP {self.shape.engine_ep})", "", "preflight:"]
        lines += ["  " + c.line() for c in self.checks]
        lines += ["", "commands:"]
        for cmd in self.commands:
            lines += [f"# {cmd.name}", cmd.shell(), ""]
        return "\n".join(lines)


def plan(model: str, nodes: int, gpus_per_node: int, lora: bool = False, *, hf_checkpoint: str | None = None,
         ckpt_dir: str | None = None, prompt_data: str | None = None, input_key: str = "prompt",
         label_key: str = "label", inventory: list | None = None, gpu_mem_gib: float | None = None,
         max_tokens_per_gpu: int = 8192, num_rollout: int | None = None, response_len: int | None = None,
         enable_r3: bool = False, first_stage_layers: int | None = None,
         last_stage_layers: int | None = None) -> LaunchPlan:
    """The shape for the request (NoShape, a ValueError, when none fits), every preflight check and
    the commands. Paths are checked when given; the model config is the variant's, and the HF
    checkpoint's own config is checked against it. `first_stage_layers` / `last_stage_layers` are
    the framework's --decoder-first/last-pipeline-num-layers (default: the shape's)."""
    from glmkit.config import variant_config
    from glmkit.launch import commands, preflight
    from glmkit.launch.shapes import pick_shape

    shape = pick_shape(model, nodes, gpus_per_node, lora)
    checks = preflight.preflight(variant_config(model), shape, inventory, gpu_mem_gib, max_tokens_per_gpu,
                                 first_stage_layers, last_stage_layers)
    if hf_checkpoint:
        checks.append(preflight.hf_checkpoint_check(model, hf_checkpoint))
    if ckpt_dir:
        checks.append(preflight.torch_dist_check(model, ckpt_dir))
    if prompt_data:
        checks.append(preflight.dataset_check(prompt_data, input_key, label_key))
    cmds = commands.plan_commands(shape, hf_checkpoint or f"/root/models/{model}", ckpt_dir or "/root/ckpt",
                                  num_rollout, response_len, enable_r3)
    return LaunchPlan(shape, checks, cmds)
