"""The recipe's launchers as data: their options, defaults and paths, and their command lines.

Read from the framework at the launcher's merged commit (radixark/miles #2786; the full launcher as
merged in vincentzed/miles 287d2761, the LoRA launcher at radixark/miles 91f99e32, the only one
published). Both build their typer CLI from a config dataclass: a field `num_gpus_per_node` is the
option `--num-gpus-per-node`, a bool field is a `--x/--no-x` pair, each can also come from the
environment as `MILES_SCRIPT_<FIELD>`.

- `scripts/run_glm5_3_flash.py` has a single command, and typer runs a single-command app without
  its name: `python scripts/run_glm5_3_flash.py --num-nodes 1 ...`; with the word `train` in front
  (as the recipe's text writes it) the launcher stops with "Got unexpected extra argument (train)".
- `scripts/run_glm5_3_flash_lora.py` has the commands `prepare`, `train` and `full-train`.

Paths and how each reaches the trainer:
- `--hf-checkpoint` (default `<model-dir>/<model-name>`): `--hf-checkpoint` of the framework.
- `--ckpt-dir` (full only, default /root/ckpt): `--ref-load <ckpt-dir>/<megatron model type>_torch_dist`.
  The LoRA launcher has no `--ckpt-dir`: it builds the model from the HF checkpoint (bridge mode).
- the dataset has no option: `<data-dir>/dapo-math-17k/dapo-math-17k.jsonl` (LoRA: by `--task`,
  `gsm8k/train.parquet` or the same dapo file). Another file reaches the trainer only through
  `--extra-args "--prompt-data F --input-key K --label-key L"`: the launcher appends `--extra-args`
  last and the framework's argparse keeps the last value. glmkit's `--prompt-data` does exactly that.
- `--save-dir`/`--run-id`: `--save` only with `--no-skip-saving`.
- `--extra-env-vars` (JSON, or `K=V K=V`): added last to the training job's runtime env, so they
  reach the processes that train (the launcher's own variables are `PYTHONUNBUFFERED`,
  `CUDA_DEVICE_MAX_CONNECTIONS`, `NCCL_NVLS_ENABLE` from its NVLink probe, `NCCL_SOCKET_IFNAME`,
  `GLOO_SOCKET_IFNAME`, `NCCL_DEBUG(_FILE)` passed through, `no_proxy`, `MASTER_ADDR`, `PYTHONPATH`).

How the launcher runs: it first kills `sglang`, `miles` and `redis` processes on the host it runs on
(`pkill -9`; also `ray` unless `MILES_SCRIPT_EXTERNAL_RAY=1`), then runs its own blocking
`ray job submit --address=http://127.0.0.1:8265` (no submission id; `RAY_ADDRESS` replaces the
address when set) of `python3 train.py <model args> <train args>`.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from glmkit.launch.shapes import FULL, SLICE

MEGATRON_MODEL_TYPE = {FULL: "glm5.3-flash", SLICE: "glm5.3-flash-4layer"}
HOST_KILLS = "pkill -9 sglang; pkill -9 miles; pkill -9 redis"
ROUTING_REPLAY = "--use-rollout-routing-replay"


@dataclass(frozen=True)
class Option:
    """One launcher option: its field, its type ("int", "float", "str", "bool", "choice", "list": a
    repeatable option), default."""

    field: str
    kind: str
    default: object
    choices: tuple = ()
    help: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def no_flag(self) -> str:
        return "--no-" + self.field.replace("_", "-")

    def words(self, value) -> list[str]:
        """The launcher's words for `value` (`--flag=VALUE` when the value itself begins with '-', so that
        no parser takes it for an option)."""
        if self.kind == "bool":
            return [self.flag if value else self.no_flag]
        if self.kind == "list":
            return [word for item in value for word in self.words_one(item)]
        return self.words_one(value)

    def words_one(self, value) -> list[str]:
        if str(value).startswith("-"):
            return [f"{self.flag}={value}"]
        return [self.flag, str(value)]


def _base(num_nodes: int) -> tuple:
    """The options every launcher's config inherits, in their order (each launcher its own node count)."""
    return (Option("cuda_core_dump", "bool", False),
            Option("num_nodes", "int", num_nodes),
            Option("extra_env_vars", "str", "", help="added last to the training job's runtime env (JSON, or K=V K=V)"),
            Option("output_dir", "str", "/root/shared_data", help="where CUDA core dumps go"))
_PATHS = (
    Option("hf_checkpoint", "str", None, help="default <model-dir>/<model-name>"),
    Option("model_dir", "str", "/root/models"),
)


@dataclass(frozen=True)
class Launcher:
    name: str
    script: str
    command: str | None          # the subcommand word; None: a single-command typer app, run bare
    options: tuple
    r3_option: str               # the field that turns routing replay on
    wandb_project: str

    def option(self, field: str) -> Option | None:
        return next((o for o in self.options if o.field == field), None)

    @property
    def fields(self) -> tuple:
        return tuple(o.field for o in self.options)

    def resolved(self, given: dict) -> dict:
        """Every option's value as the launcher sees it: the given ones, else its defaults, with the
        defaults it derives (`__post_init__`) filled in."""
        values = {o.field: o.default for o in self.options}
        values.update({k: v for k, v in given.items() if v is not None})
        run_id = values.get("run_id")
        if run_id is not None and ("/" in str(run_id) or str(run_id) in ("", ".", "..") or "\0" in str(run_id)):
            # the launcher saves under {save_dir}/{run_id}: a run id with a '/' or '..' writes elsewhere
            raise ValueError(f"--run-id {str(run_id)[:80]!r}: a run id is one folder name under --save-dir (no '/', "
                             f"not '.' or '..')")
        if values.get("hf_checkpoint") is None:
            values["hf_checkpoint"] = f"{values['model_dir'].rstrip('/')}/{values['model_name']}"
        if self.name == "lora":
            if not values["rollout_max_response_len"]:
                values["rollout_max_response_len"] = 4096 if values["task"] == "dapo-math" else 8192
        return values

    def argv(self, given: dict) -> list[str]:
        """The launcher's command line for the options the user gave (the rest stay the launcher's own
        defaults), in the launcher's spelling."""
        argv = ["python", self.script] + ([self.command] if self.command else [])
        for option in self.options:
            value = given.get(option.field)
            if value is None or (option.kind == "str" and value == "" and option.default == "") or \
                    (option.kind == "list" and not value):
                continue
            argv += option.words(value)
        return argv

    def paths(self, values: dict) -> dict:
        """Where the trainer reads and writes, from resolved values (before --extra-args overrides)."""
        paths = {"hf_checkpoint": values["hf_checkpoint"]}
        if "ckpt_dir" in values:
            paths["ref_load"] = f"{values['ckpt_dir'].rstrip('/')}/{MEGATRON_MODEL_TYPE[values['model_name']]}_torch_dist"
        data = values["data_dir"].rstrip("/")
        if values.get("task", "dapo-math") == "gsm8k":
            paths["prompt_data"], paths["input_key"] = f"{data}/gsm8k/train.parquet", "messages"
        else:
            paths["prompt_data"], paths["input_key"] = f"{data}/dapo-math-17k/dapo-math-17k.jsonl", "prompt"
        paths["label_key"] = "label"
        if not values["skip_saving"]:
            paths["save"] = f"{values['save_dir'].rstrip('/')}/{values['run_id']}" + \
                ("" if self.name == "lora" else "/checkpoints")
        if "train_offload_dir" in values:
            paths["offload_dir"] = values["train_offload_dir"]
        return paths


FULL_LAUNCHER = Launcher(
    "full", "scripts/run_glm5_3_flash.py", None,
    _base(num_nodes=2) + (
        Option("cluster_backend", "choice", "ray", ("ray", "kubernetes")),
        Option("run_id", "str", None, help="default: a time stamp the launcher makes"),
        Option("namespace", "str", ""),
        Option("helm_values", "list", (), help="repeatable; used by --cluster-backend kubernetes"),
        Option("force", "bool", False),
        Option("ci_run", "bool", False),
        Option("model_name", "choice", SLICE, (FULL, SLICE)),
        Option("num_gpus_per_node", "int", 4),
    ) + _PATHS + (
        Option("ckpt_dir", "str", "/root/ckpt", help="--ref-load is <ckpt-dir>/<model type>_torch_dist"),
        Option("data_dir", "str", "/root/datasets"),
        Option("save_dir", "str", "/root/shared_data"),
        Option("megatron_path", "str", "/root/Megatron-LM"),
        Option("train_offload_dir", "str", "/root/train_offload"),
        Option("num_rollout", "int", 5),
        Option("rollout_max_response_len", "int", 4096),
        Option("check_weight_update_equal", "bool", True),
        Option("enable_r3", "bool", False, help="routing replay: the framework's --use-rollout-routing-replay"),
        Option("skip_saving", "bool", True),
        Option("extra_args", "str", "", help="appended last to the framework's arguments"),
    ),
    "enable_r3", "miles-run_glm5_3_flash")

LORA_LAUNCHER = Launcher(
    "lora", "scripts/run_glm5_3_flash_lora.py", "train",
    _base(num_nodes=1) + (
        Option("run_id", "str", None, help="default: a time stamp the launcher makes"),
        Option("model_name", "choice", SLICE, (FULL, SLICE)),
        Option("task", "choice", "gsm8k", ("gsm8k", "dapo-math")),
    ) + _PATHS + (
        Option("save_dir", "str", "/root/shared_data"),
        Option("data_dir", "str", "/root/datasets"),
        Option("megatron_path", "str", "/root/Megatron-LM"),
        Option("num_gpus_per_node", "int", 8),
        Option("tensor_model_parallel_size", "int", 0, help="0: min(8, GPUs a node)"),
        Option("lora_rank", "int", 16),
        Option("lora_alpha", "int", 32),
        Option("lora_dropout", "float", 0.0),
        Option("target_modules", "str", None, help="default: the launcher's attention and MLP projections"),
        Option("lora_base_cpu_backup", "bool", True),
        Option("experts_shared_outer_loras", "bool", False),
        Option("check_lora_weight_equal", "bool", True),
        Option("num_rollout", "int", 10),
        Option("rollout_batch_size", "int", 16),
        Option("n_samples_per_prompt", "int", 8),
        Option("global_batch_size", "int", 128),
        Option("rollout_max_response_len", "int", 0, help="0: 4096 for dapo-math, else 8192"),
        Option("rollout_temperature", "float", 1.0),
        Option("use_r3", "bool", True, help="routing replay (on by default): --use-rollout-routing-replay"),
        Option("rollout_num_gpus_per_engine", "int", 0, help="0: a node's GPUs"),
        Option("sglang_mem_fraction_static", "float", 0.5),
        Option("sglang_lora_backend", "str", "triton"),
        Option("lr", "float", 1e-5),
        Option("enable_wandb", "bool", False),
        Option("skip_saving", "bool", True),
        Option("extra_args", "str", "", help="appended last to the framework's arguments"),
    ),
    "use_r3", "miles-run_glm5_3_flash_lora")

LAUNCHERS = {"full": FULL_LAUNCHER, "lora": LORA_LAUNCHER}
ALL_FIELDS = tuple(dict.fromkeys(f for launcher in LAUNCHERS.values() for f in launcher.fields))


def option_spec(field: str) -> Option:
    """The option of that field in whichever launcher has it (the full one first)."""
    return FULL_LAUNCHER.option(field) or LORA_LAUNCHER.option(field)


def parse_extra_env_vars(text: str) -> dict:
    """`--extra-env-vars` as the launcher reads it: a JSON object, else space-separated K=V pairs
    (a pair without `=` is refused here; the launcher would fail on it)."""
    text = (text or "").strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # not JSON (or nested past Python's stack): read as K=V pairs
        value = None
    if isinstance(value, dict):
        # Ray's runtime env takes strings only: 1, true, null or an object would reach the job as "1",
        # "True", "None" (PATH=None) or a Python repr, so they are refused by name
        wrong = next(((k, v) for k, v in value.items() if not isinstance(v, str)), None)
        if wrong is not None:
            raise ValueError(f"--extra-env-vars: the value of {wrong[0]!r} is {json.dumps(wrong[1])[:40]}; environment "
                             f"values must be JSON strings (\"1\", not 1)")
        env = {str(k): v for k, v in value.items()}
    else:
        env = {}
        for pair in text.split():
            key, sep, val = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"--extra-env-vars: {pair!r} is not KEY=VALUE (give a JSON object or KEY=VALUE pairs)")
            if "=" in val:  # the launcher keeps only up to the next '=' of a K=V pair: say so, not lose it
                raise ValueError(f"--extra-env-vars: the value of {key} contains '='; the launcher's K=V form would "
                                 f"cut it; give the variables as a JSON object")
            env[key] = val
    # the process environment cannot hold such a name, nor a NUL in a value (in either form)
    bad = next((k for k in env if not k or "=" in k or "\0" in k or not k.isprintable()), None)
    if bad is not None:
        raise ValueError(f"--extra-env-vars: {bad!r} is not an environment variable name (non-empty, no '=', "
                         f"no control characters)")
    bad = next((k for k, v in env.items() if "\0" in v), None)
    if bad is not None:
        raise ValueError(f"--extra-env-vars: the value of {bad!r} holds a NUL character, which no environment holds")
    return env


def extra_args_words(text: str) -> list[str]:
    """--extra-args as the shell splits it, `--flag=value` written as two words."""
    try:
        words = shlex.split(text or "")
    except ValueError as err:
        raise ValueError(f"--extra-args: cannot be split as the shell would ({err}): {text!r}") from None
    out = []
    for w in words:
        out += w.split("=", 1) if w.startswith("--") and "=" in w else [w]
    return out


def extra_args_flags(text: str) -> set:
    """The framework flags a user's --extra-args already sets."""
    return {w for w in extra_args_words(text) if w.startswith("--")}


def extra_args_value(text: str, flag: str, kind=str):
    """The value the framework's argparse keeps for `flag` in --extra-args (the last one), or None."""
    words = extra_args_words(text)
    if flag not in words:
        return None
    at = len(words) - 1 - words[::-1].index(flag)
    if at + 1 >= len(words) or words[at + 1].startswith("--"):
        raise ValueError(f"--extra-args: {flag} has no value")
    try:
        return kind(words[at + 1])
    except ValueError:
        raise ValueError(f"--extra-args: {flag} {words[at + 1]!r} is not {'an integer' if kind is int else kind.__name__}") \
            from None
