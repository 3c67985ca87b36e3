"""Launching the full run from a Ray client: plan and preflight (`shapes`, `preflight`), the recipe's
launchers as data (`launcher`) and their exact commands (`commands`), the cluster (`cluster`), jobs
(`jobs`) and glmkit's own GRPO as Ray actors (`builtin`, run by `run`). `plan()` puts a launch's
checks and commands together."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field


@dataclass
class LaunchPlan:
    shape: object
    checks: list
    commands: list = field(default_factory=list)
    launcher: object = None      # glmkit.launch.launcher.Launcher
    given: dict = field(default_factory=dict)     # the launcher options as passed (launcher field names)
    values: dict = field(default_factory=dict)    # every launcher option as the launcher resolves it
    paths: dict = field(default_factory=dict)     # where the trainer reads and writes
    notes: list = field(default_factory=list)
    miles_dir: str = "/root/miles"                # the framework's checkout on the cluster
    stages: list | None = None                    # layers per pipeline stage (None: the split fails)
    max_tokens_per_gpu: int = 8192                # as the trainer will run (the launcher's, or --extra-args)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def routing_replay(self) -> dict:
        """The launcher's routing-replay option as it spells it, whether it is on, the framework flag."""
        from glmkit.launch.launcher import ROUTING_REPLAY

        option = self.launcher.option(self.launcher.r3_option)
        return {"option": option.flag, "on": bool(self.values.get(option.field)), "framework_flag": ROUTING_REPLAY}

    def layout(self) -> dict:
        s = self.shape
        return {"tp": s.tp, "pp": s.pp, "ep": s.ep, "cp": 1, "expert_tp": 1, "dp": s.dp,
                "pipeline_stages": self.stages, "trainer_gpus": s.world, "rollout_gpus": s.rollout_gpus,
                "colocated": True, "engines": s.engines, "engine_gpus": s.engine_gpus, "engine_tp": s.engine_tp,
                "engine_ep": s.engine_ep, "offload": s.offload, "max_tokens_per_gpu": self.max_tokens_per_gpu}

    def _secrets(self) -> list[str]:
        """Values of secret-looking variables in --extra-env-vars (kept out of what is shown and saved)."""
        import re

        from glmkit.launch.launcher import parse_extra_env_vars

        env = parse_extra_env_vars(self.given.get("extra_env_vars") or "")
        return [v for k, v in env.items() if v and re.search(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL", k, re.I)]

    def _redact(self, text: str) -> str:
        for secret in self._secrets():
            text = text.replace(secret, "***")
        return text

    def as_dict(self) -> dict:
        """The plan as data (what --json prints and notebook 03 saves), secret values shown as ***."""
        import json

        return json.loads(self._redact(json.dumps(self._as_dict())))

    def _as_dict(self) -> dict:
        return {"ok": self.ok, "launcher": self.launcher.script, "shape": self.shape.as_dict(), "layout": self.layout(),
                "routing_replay": self.routing_replay, "paths": self.paths, "options": self.given,
                "notes": self.notes, "preflight": [c.__dict__ for c in self.checks],
                "commands": [{"name": c.name, "argv": list(c.argv), "env": c.env, "cwd": c.cwd, "shell": c.shell()}
                             for c in self.commands]}

    def text(self) -> str:
        s, layout, r3 = self.shape, self.layout(), self.routing_replay
        stages = " / ".join(map(str, layout["pipeline_stages"])) if layout["pipeline_stages"] else "?"
        lines = [f"launcher {self.launcher.script} ({'LoRA' if s.lora else 'full'}): {s.model} on "
                 f"{s.nodes} x {s.gpus_per_node} GPUs",
                 f"  trainer: TP {s.tp}, PP {s.pp} (layers {stages}), EP {s.ep}, CP 1, expert TP 1, DP {s.dp}; "
                 f"max {layout['max_tokens_per_gpu']} tokens a GPU",
                 f"  rollout: colocated on all {s.rollout_gpus} GPUs, {s.engines} SGLang engine(s) of {s.engine_gpus} "
                 f"GPUs (TP {s.engine_tp} / EP {s.engine_ep}); trainer offloaded to {s.offload}"
                 + (f" ({self.paths['offload_dir']})" if s.offload == "disk" and "offload_dir" in self.paths else ""),
                 f"  routing replay: {r3['option']} {'on' if r3['on'] else 'off'}"
                 + (f" -> {r3['framework_flag']}" if r3["on"] else ""),
                 "  paths: " + ", ".join(f"{k} {v}" for k, v in self.paths.items())]
        lines += [f"  note: {n}" for n in self.notes]
        lines += ["", "preflight:"] + ["  " + c.line() for c in self.checks]
        lines += ["", "commands:"]
        for cmd in self.commands:
            lines += [f"# {cmd.name}", cmd.shell(), ""]
        return self._redact("\n".join(lines))


# glmkit's options for the miles backend that no launcher option carries: they reach the trainer
# through --extra-args (appended last by the launcher; the framework's argparse keeps the last value)
EXTRA_ARG_FLAGS = {"prompt_data": "--prompt-data", "input_key": "--input-key", "label_key": "--label-key",
                   "max_tokens_per_gpu": "--max-tokens-per-gpu",
                   "first_stage_layers": "--decoder-first-pipeline-num-layers",
                   "last_stage_layers": "--decoder-last-pipeline-num-layers"}


def plan(model: str | None = None, nodes: int | None = None, gpus_per_node: int | None = None, lora: bool = False, *,
         hf_checkpoint: str | None = None, ckpt_dir: str | None = None, prompt_data: str | None = None,
         input_key: str | None = None, label_key: str | None = None, inventory: list | None = None,
         gpu_mem_gib: float | None = None, max_tokens_per_gpu: int | None = None, num_rollout: int | None = None,
         response_len: int | None = None, enable_r3: bool | None = None, first_stage_layers: int | None = None,
         last_stage_layers: int | None = None, options: dict | None = None,
         miles_dir: str | None = None) -> LaunchPlan:
    """The launch of the recipe's launcher (`lora`: the LoRA one) for these options, in the launcher's
    own terms: its layout (NoShape, a ValueError, when the launcher would refuse), every preflight check
    and the commands. `options`: any other launcher option by field name (`data_dir`, `extra_args`,
    `use_r3`, ...); an option the chosen launcher does not have is refused by name. `enable_r3` is the
    chosen launcher's routing-replay option (the LoRA launcher's `--use-r3`). Paths are checked when
    given; the model config is the variant's, and the HF checkpoint's own config is checked against it.
    `miles_dir`: the framework's checkout on the cluster, where the commands run (default /root/miles)."""
    from glmkit.config import variant_config
    from glmkit.launch import commands, preflight
    from glmkit.launch.launcher import HOST_KILLS, LAUNCHERS, extra_args_flags, extra_args_value, option_spec
    from glmkit.launch.shapes import pick_shape, pipeline_split

    launcher = LAUNCHERS["lora" if lora else "full"]
    given = dict(options or {})
    for key, value in (("model_name", model), ("num_nodes", nodes), ("num_gpus_per_node", gpus_per_node),
                       ("hf_checkpoint", hf_checkpoint), ("ckpt_dir", ckpt_dir), ("num_rollout", num_rollout),
                       ("rollout_max_response_len", response_len), (launcher.r3_option, enable_r3)):
        if value is not None:
            given[key] = value
    for key in given:
        if launcher.option(key) is None:
            other = "the full" if lora else "the LoRA"
            where = f" (only {other} launcher has it)" if option_spec(key) else ""
            hint = {"ckpt_dir": "; it builds the trainer from --hf-checkpoint (bridge mode), no torch_dist",
                    "enable_r3": "; routing replay is its --use-r3 (on by default)",
                    "use_r3": "; routing replay is its --enable-r3"}.get(key, "")
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{flag}: {launcher.script} has no such option{where}{hint}")
    values = launcher.resolved(given)
    shape = pick_shape(values["model_name"], values["num_nodes"], values["num_gpus_per_node"], lora,
                       **({"tensor_parallel": values["tensor_model_parallel_size"],
                           "engine_gpus": values["rollout_num_gpus_per_engine"]} if lora else {}))

    # what the launcher has no option for goes through --extra-args, never silently dropped
    if prompt_data:  # a dataset names its fields (the framework's defaults otherwise)
        input_key, label_key = input_key or "prompt", label_key or "label"
    own = {"prompt_data": prompt_data, "input_key": input_key, "label_key": label_key,
           "max_tokens_per_gpu": max_tokens_per_gpu, "first_stage_layers": first_stage_layers,
           "last_stage_layers": last_stage_layers}
    user_flags = extra_args_flags(values.get("extra_args"))
    added = []
    for key, value in own.items():
        if value is None:
            continue
        flag = EXTRA_ARG_FLAGS[key]
        if flag in user_flags:
            raise ValueError(f"{flag} is given twice: by glmkit's own option and inside --extra-args; give it once")
        added += [flag, str(value)]
    if added:
        given["extra_args"] = " ".join(filter(None, [values.get("extra_args") or "", shlex.join(added)]))
        values = launcher.resolved(given)
    paths = launcher.paths(values)
    extra = values.get("extra_args")
    for key, flag in (("prompt_data", "--prompt-data"), ("input_key", "--input-key"), ("label_key", "--label-key"),
                      ("hf_checkpoint", "--hf-checkpoint"), ("ref_load", "--ref-load"), ("save", "--save")):
        value = extra_args_value(extra, flag)
        if value is not None:  # the last one wins, as in the framework's argparse
            paths[key] = value
    first = extra_args_value(extra, "--decoder-first-pipeline-num-layers", int)
    last = extra_args_value(extra, "--decoder-last-pipeline-num-layers", int)
    tokens = extra_args_value(extra, "--max-tokens-per-gpu", int) or shape.max_tokens_per_gpu
    config = variant_config(shape.model)
    checks = preflight.preflight(config, shape, inventory, gpu_mem_gib, tokens, first, last)
    try:
        stages = pipeline_split(config.num_hidden_layers, shape.pp,
                                shape.first_stage_layers if first is None else first,
                                shape.last_stage_layers if last is None else last)
    except ValueError:  # the preflight's "pipeline split" check says why
        stages = None
    if hf_checkpoint:
        checks.append(preflight.hf_checkpoint_check(shape.model, hf_checkpoint))
    if ckpt_dir:
        checks.append(preflight.torch_dist_check(shape.model, ckpt_dir))
    if prompt_data:
        checks.append(preflight.dataset_check(prompt_data, own["input_key"], own["label_key"]))
    notes = [f"the launcher first kills sglang, miles and redis processes on the host it runs on "
             f"({HOST_KILLS}): do not launch from a host others use for those"]
    if "ref_load" in paths and not ckpt_dir:
        notes.append(f"--ref-load {paths['ref_load']} must exist on the cluster (the conversion below writes it)")
    miles_dir = miles_dir or commands.MILES_DIR
    cmds = commands.plan_commands(launcher, given, shape.gpus_per_node, miles_dir)
    return LaunchPlan(shape, checks, cmds, launcher, given, values, paths, notes, miles_dir, stages, tokens)
