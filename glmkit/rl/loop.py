"""The GRPO loop: rollout with glmkit's engine, rewards, group advantages, PPO-clip updates on the
train path, weight (or adapter) sync back to the engine, metrics as JSONL, checkpoints, resume.

The rollout engine holds its own copy of the weights, as SGLang does beside Megatron: after every
update the trainer's trainable tensors (the whole model, or only the LoRA adapters) are copied into it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import warnings
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from glmkit.bounds import FLOAT32_MAX
from glmkit.inputs import not_a_file, read_marker
from glmkit.model.rollout import GREEDY_BELOW, RolloutSide
from glmkit.outputs import (MARKER, RunLock, check_dir_out, check_file_out, is_glmkit_file, is_glmkit_output, mark_file,
                            refuse_input_as_output, refuse_package_paths, refuse_replacing,
                            added_entries, record_entries, staging_dir, through_link, usual_modes)
from glmkit.report import write_atomic
from glmkit.rl import grpo, lora
from glmkit.rl.lora import DEFAULT_EXCLUDE

ASSETS = Path(__file__).resolve().parents[1] / "assets"

MAX_RESPONSE_LEN = 1 << 20  # tokens one response may reach (the recipe's runs use 4096 - 65536)
MAX_EVAL_SAMPLES = 1024  # samples per held-out prompt: pass@k past k = 1024 is not a smoke run's question
EVAL_SEED_OFFSET = 1 << 40  # evaluation samples with seeds no training rollout uses
# A sample whose grader raised (the framework's run would stop) counts as a miss: its lowest score.
MISS_SCORE = {"deepscaler": 0.0, "math": 0.0, "dapo": -1.0}
# The optimizer as both GLM-5.3-Flash launchers set it (scripts/run_glm5_3_flash.py and _lora.py:
# `--optimizer adam --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98`);
# Megatron's own defaults differ (beta2 0.999, weight decay 0.01, linear decay). The LoRA launcher also
# passes `--calculate-per-token-loss` (see TrainConfig.resolved).
LAUNCHER_OPTIMIZER = dict(adam_beta1=0.9, adam_beta2=0.98, weight_decay=0.1, lr_decay_style="constant")

# Per --model-name defaults; anything given on the command line wins.
PRESETS = {
    # The tiny preset learns to answer in the rewarded form on a synthetic copy task (`a+0=` -> a, 900
    # training and 100 held-out numbers below 1000) from a briefly pre-trained start that knows the
    # answers but boxes them only part of the time (scripts/make_tiny_start.py --plain-share 0.7): what
    # it learns on one number carries over to numbers it never saw, so the held-out reward measures
    # learning, not memory (arithmetic did not transfer: 16 fresh problems a rollout rose 0.34 -> 0.48).
    # It differs from the recipe on purpose: lr 4e-4 (a 1.5 MB model moves too little at 1e-6 to see in
    # 20 rollouts); 16 prompts x 8 samples in 4 optimizer steps of 32 (less noise per rollout, more
    # updates). Seed 0, 2 CPU cores: held-out 0.04 -> 0.79, training prompts (each seen once) 0.32 -> 0.74.
    "tiny": dict(checkpoint=str(ASSETS / "tiny_start"), prompt_data=str(ASSETS / "copy" / "train.jsonl"),
                 tokenizer=str(ASSETS / "tiny_tokenizer"), lr=4e-4, rollout_max_response_len=12,
                 rollout_max_prompt_len=1024, rollout_batch_size=16, global_batch_size=32,
                 eval_prompt_data=str(ASSETS / "copy" / "test.jsonl"), eval_interval=5, **LAUNCHER_OPTIMIZER),
    "GLM-5.3-Flash-4layer": dict(prompt_data="/root/datasets/dapo-math-17k/dapo-math-17k.jsonl", lr=1e-6,
                                 rollout_max_response_len=4096, rollout_batch_size=8, global_batch_size=64,
                                 **LAUNCHER_OPTIMIZER),
}


@dataclass(frozen=True)
class TrainConfig:
    """A run's settings, fixed for the run: `resolved()` gives the complete, checked copy the trainer
    keeps (presets filled in); nothing changes it afterwards."""

    model_name: str = "tiny"
    checkpoint: str | None = None
    tokenizer: str | None = None          # default: the checkpoint's own tokenizer files
    prompt_data: str | None = None
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = True
    rm_type: str = "deepscaler"
    grader: str = "framework"               # framework (its rm_hub, exactly) or math-verify (lenient)
    on_bad_row: str = "skip"
    prompt_pool: int | None = None          # train on the first N prompts of the shuffled data only
    num_rollout: int = 20
    rollout_batch_size: int | None = None   # recipe: 8
    n_samples_per_prompt: int = 8
    global_batch_size: int | None = None    # recipe: 64
    rollout_max_response_len: int | None = None
    rollout_max_prompt_len: int | None = None  # the framework's: longer prompts are left out of the data
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    lr: float | None = None
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    eps_clip_c: float | None = None         # dual-clip PPO (> 1); None: off
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    observe_training_entropy: bool = False  # log the entropy at entropy_coef 0 (the framework logs 0 then)
    clip_grad: float = 1.0
    # Adam (decoupled weight decay, none on biases and 1-D parameters: Megatron's rule); None: the preset's
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_eps: float = 1e-8
    weight_decay: float | None = None
    lr_decay_style: str | None = None       # constant, linear or cosine (Megatron's scheduler)
    lr_warmup_iters: int = 0                # optimizer steps of linear warmup from 0
    lr_decay_iters: int | None = None       # linear / cosine: steps to reach min_lr (default: the whole run)
    min_lr: float = 0.0
    calculate_per_token_loss: bool | None = None  # None: on with LoRA (its launcher's), else off
    use_tis: bool = False                   # truncated importance sampling of the trainer/rollout ratio
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    mfu_peak_tflops: float | None = None    # the device's peak for perf/actor_train_mfu (default: known GPUs)
    # held-out evaluation: prompts no training prompt repeats, before training, every eval_interval
    # rollouts and after the last; greedy, or n samples at eval_temperature for eval/pass@k
    eval_prompt_data: str | None = None
    eval_interval: int | None = None
    n_samples_per_eval_prompt: int = 1
    eval_temperature: float | None = None   # None: greedy with one sample, else the rollout temperature
    enable_r3: bool = False
    use_rollout_indexer_replay: bool = False
    max_nonfinite_steps: int = 3
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: str = "attn,mlp"
    exclude_modules: str = DEFAULT_EXCLUDE
    device: str = "cpu"
    dtype: str = "float32"
    backends: str = ""  # Backends spec, e.g. "kda=fla,dsa=absorbed"; empty = the defaults
    seed: int = 0
    data_parallel: str = ""  # "" = one process; gloo / nccl = a rank of a torchrun-launched group
    metrics_out: str = "reports/train/metrics.jsonl"
    save: str | None = None
    save_interval: int = 0
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    accept_changes: str = ""  # --resume: settings that may differ from the run's recorded ones (comma-separated)

    def resolved(self) -> "TrainConfig":
        """Fill unset fields from the --model-name preset and validate."""
        if self.model_name not in PRESETS:
            raise ValueError(f"unknown --model-name {self.model_name!r}; allowed: {', '.join(PRESETS)}")
        cfg = replace(self, **{key: value for key, value in PRESETS[self.model_name].items()
                               if getattr(self, key) is None})
        if cfg.calculate_per_token_loss is None:
            cfg = replace(cfg, calculate_per_token_loss=bool(cfg.lora_rank))
        if cfg.checkpoint is None:
            raise ValueError(f"--model-name {cfg.model_name} needs --checkpoint (an HF checkpoint directory)")
        total = cfg.rollout_batch_size * cfg.n_samples_per_prompt
        if cfg.global_batch_size < 1 or total % cfg.global_batch_size:
            raise ValueError(f"--global-batch-size {cfg.global_batch_size} must divide rollout-batch-size x "
                             f"n-samples-per-prompt = {total}")
        from glmkit.rl.rewards import GRADERS

        if cfg.grader not in GRADERS:
            raise ValueError(f"--grader {cfg.grader!r}; allowed: {', '.join(GRADERS)}")
        if cfg.kl_loss_type not in grpo.KL_TYPES:
            raise ValueError(f"--kl-loss-type {cfg.kl_loss_type!r}; allowed: {', '.join(grpo.KL_TYPES)}")
        if cfg.save_interval and not cfg.save:
            raise ValueError("--save-interval needs --save DIR")
        if cfg.save and os.path.abspath(cfg.save) == os.path.abspath(cfg.metrics_out):
            raise ValueError(f"--metrics-out and --save both name {cfg.save}: the metrics file and the checkpoint "
                             f"folder need two paths")
        if cfg.resume and cfg.overwrite:
            raise ValueError("--resume continues a run and --overwrite replaces it: give one of them")
        if cfg.resume and not cfg.save:
            raise ValueError("--resume continues from the checkpoints under --save DIR, and no --save was given")
        if cfg.accept_changes and not cfg.resume:
            raise ValueError(f"--accept-changes {cfg.accept_changes}: only a resumed run (--resume) compares settings")
        if not cfg.rollout_temperature >= GREEDY_BELOW:
            raise ValueError(f"--rollout-temperature {cfg.rollout_temperature}: GRPO needs >= {GREEDY_BELOW} "
                             f"(log-probs are those of softmax(logits / T); below it sampling is greedy)")
        for name in ("eps_clip", "eps_clip_high", "kl_loss_coef", "save_interval"):
            if getattr(cfg, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
        for name in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "global_batch_size",
                     "max_nonfinite_steps", "rollout_max_response_len"):
            if getattr(cfg, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
        if cfg.rollout_max_prompt_len is not None and cfg.rollout_max_prompt_len < 1:
            raise ValueError(f"--rollout-max-prompt-len must be >= 1, got {cfg.rollout_max_prompt_len}")
        if cfg.rollout_max_response_len > MAX_RESPONSE_LEN:
            raise ValueError(f"--rollout-max-response-len {cfg.rollout_max_response_len}: at most {MAX_RESPONSE_LEN} "
                             f"tokens (the decode caches are sized by it)")
        # checked here, before the model loads: an Inf / NaN would only show up in sampling or as skipped steps
        for name in ("lr", "rollout_temperature", "rollout_top_p", "eps_clip", "eps_clip_high", "kl_loss_coef",
                     "entropy_coef", "lora_alpha"):
            if not math.isfinite(getattr(cfg, name)):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(cfg, name)}")
        if cfg.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {cfg.lr}")
        if cfg.lora_rank:
            lora.check_settings(cfg.lora_rank, cfg.lora_alpha)
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(cfg, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(cfg, name)}")
        for name in ("adam_eps", "weight_decay", "min_lr", "clip_grad", "tis_clip", "tis_clip_low",
                     "lr_warmup_iters"):
            value = getattr(cfg, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
        if cfg.adam_eps <= 0:
            raise ValueError(f"--adam-eps must be > 0, got {cfg.adam_eps}")
        if cfg.lr_decay_style not in grpo.LR_DECAY_STYLES:
            raise ValueError(f"--lr-decay-style {cfg.lr_decay_style!r}; allowed: {', '.join(grpo.LR_DECAY_STYLES)}")
        if cfg.lr_decay_iters is not None and cfg.lr_decay_iters < 1:
            raise ValueError(f"--lr-decay-iters must be >= 1, got {cfg.lr_decay_iters}")
        if cfg.min_lr > cfg.lr:
            raise ValueError(f"--min-lr {cfg.min_lr} is above --lr {cfg.lr}")
        if cfg.eps_clip_c is not None and not (math.isfinite(cfg.eps_clip_c) and cfg.eps_clip_c > 1):
            raise ValueError(f"--eps-clip-c must be > 1 (the lower bound of dual-clip PPO), got {cfg.eps_clip_c}")
        if cfg.eval_interval is not None and cfg.eval_interval < 1:
            raise ValueError(f"--eval-interval must be >= 1, got {cfg.eval_interval}")
        if not 1 <= cfg.n_samples_per_eval_prompt <= MAX_EVAL_SAMPLES:
            raise ValueError(f"--n-samples-per-eval-prompt must be in 1..{MAX_EVAL_SAMPLES}, got "
                             f"{cfg.n_samples_per_eval_prompt}")
        if cfg.eval_temperature is not None and not (math.isfinite(cfg.eval_temperature) and cfg.eval_temperature >= 0):
            raise ValueError(f"--eval-temperature must be a finite number >= 0, got {cfg.eval_temperature}")
        if cfg.n_samples_per_eval_prompt > 1 and cfg.eval_temperature is not None and cfg.eval_temperature < GREEDY_BELOW:
            raise ValueError(f"--eval-temperature {cfg.eval_temperature} is greedy: its "
                             f"{cfg.n_samples_per_eval_prompt} samples per prompt would be one sample repeated (pass@k "
                             f"meaningless); give a temperature >= {GREEDY_BELOW} or --n-samples-per-eval-prompt 1")
        if cfg.eval_prompt_data is not None and not str(cfg.eval_prompt_data).strip():
            raise ValueError("--eval-prompt-data '': give a jsonl file of held-out prompts (leave the flag out for the "
                             "preset's)")
        # the loss and the optimizer compute in float32: a larger setting overflows there, after a rollout's work
        for f in fields(cfg):
            value = getattr(cfg, f.name)
            if isinstance(value, float) and math.isfinite(value) and abs(value) > FLOAT32_MAX:
                raise ValueError(f"--{f.name.replace('_', '-')} {value:g}: beyond float32's range (|x| <= 3.4e38), "
                                 f"which the loss and the optimizer compute in")
        # torch's Adam hands these to the weights as float32 scalars: past its range the step is an error
        first_step = cfg.lr / (1 - cfg.adam_beta1)
        if first_step > FLOAT32_MAX or cfg.lr * cfg.weight_decay > FLOAT32_MAX:
            raise ValueError(f"--lr {cfg.lr:g}: Adam's first step size lr / (1 - adam_beta1) = {first_step:.3g} and its "
                             f"decay lr x weight_decay = {cfg.lr * cfg.weight_decay:.3g} must stay within float32 "
                             f"({FLOAT32_MAX:.3g}); use a smaller --lr")
        if cfg.mfu_peak_tflops is not None and not (math.isfinite(cfg.mfu_peak_tflops) and cfg.mfu_peak_tflops > 0):
            raise ValueError(f"--mfu-peak-tflops must be > 0, got {cfg.mfu_peak_tflops}")
        if cfg.tis_clip_low > cfg.tis_clip:
            raise ValueError(f"--tis-clip-low {cfg.tis_clip_low} is above --tis-clip {cfg.tis_clip}")
        if not 0 < cfg.rollout_top_p <= 1:
            raise ValueError(f"--rollout-top-p must be in (0, 1], got {cfg.rollout_top_p}")
        return cfg


def rollout_seed(cfg: TrainConfig, step: int) -> int:
    """The sampling seed of rollout `step`: the run's seed and the step, nothing else."""
    return cfg.seed * 100003 + step


@dataclass(frozen=True)
class TrainState:
    """What one rollout hands the next, besides the weights and the optimizer's moments: which rollout
    comes next and how many optimizer steps in a row were skipped for a NaN / Inf. The randomness of a
    rollout is a function of it (`sampling_seed`, and the prompt order from the run's seed), so a resumed
    run draws what the uninterrupted one would have. Checkpoints write it and --resume reads it back."""

    step: int = 0              # the next rollout to run
    nonfinite_streak: int = 0  # optimizer steps in a row skipped for a NaN / Inf loss or gradient norm

    def sampling_seed(self, cfg: TrainConfig) -> int:
        return rollout_seed(cfg, self.step)

    def to_record(self) -> dict:
        """As state.json holds it: `step` is the rollout the checkpoint completed."""
        return {"step": self.step - 1, "nonfinite_streak": self.nonfinite_streak}

    @classmethod
    def from_record(cls, record: dict) -> "TrainState":
        streak = record.get("nonfinite_streak", 0)  # checkpoints before it was recorded: none
        if not (isinstance(streak, int) and not isinstance(streak, bool) and streak >= 0):
            raise ValueError(f"nonfinite_streak {streak!r}: expected a non-negative integer")
        return cls(step=record["step"] + 1, nonfinite_streak=streak)


@dataclass(frozen=True)
class RolloutBatch:
    """One rollout as the updates read it: packed sequences, the response mask, what the rollout
    recorded (log-probs, routing, DSA selections) and each token's group advantage; after
    `GRPOTrainer.recompute`, also the trainer's old log-probs (and the reference's, with KL) and the
    per-token comparisons with the rollout."""

    completions: list
    input_ids: torch.Tensor
    packed: object
    mask: torch.Tensor
    rollout_logp: torch.Tensor
    routing: dict
    topk: dict
    adv_tok: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    abs_diff: torch.Tensor | None = None
    rollout_kl: torch.Tensor | None = None
    routing_differs: torch.Tensor | None = None
    topk_kinds: tuple | None = None


# ------------------------------------------------------------------ checkpoints (safetensors only)

def _save_checkpoint(cfg, state: TrainState | int, policy, optimizer, lora_names, inputs: dict | None = None) -> Path:
    """The checkpoint after rollout `state.step - 1` (an int: the rollout just completed): weights (or
    adapters), the optimizer's moments, and state.json with the TrainState, the optimizer's param
    groups, the run's settings and its data files' digests (`inputs`: input_digests(cfg))."""
    from glmkit.model import save_model
    from glmkit.rl.lora import adapter_state

    if isinstance(state, int):
        state = TrainState(step=state + 1)
    step = state.step - 1
    root = Path(cfg.save)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{step:07d}"
    staging = staging_dir(final, "training checkpoint")
    try:
        if lora_names:
            save_file({k: v.detach().cpu().contiguous() for k, v in adapter_state(policy).items()},
                      str(staging / "adapter.safetensors"))
        else:
            save_model(policy, staging / "model")
        moments = optimizer.state_dict()
        tensors = {f"{i}.{k}": v.detach().cpu().contiguous() for i, s in moments["state"].items()
                   for k, v in s.items() if torch.is_tensor(v)}
        save_file(tensors, str(staging / "optimizer.safetensors"))
        (staging / "state.json").write_text(json.dumps({**state.to_record(), "param_groups": moments["param_groups"],
                                                        "lora": lora_names, "config": asdict(cfg),
                                                        "inputs": inputs or {}}, default=str))
        usual_modes(staging)  # safetensors creates its files 0600; a checkpoint gets the umask's modes
        record_entries(staging)  # what --overwrite may later remove: these names, nothing added since
        if final.is_symlink():
            final.unlink()  # the link only: what it points to is not glmkit's to replace
        elif final.exists():  # a later checkpoint of this run (the latest marker was rolled back): glmkit's own only
            foreign = [final.name] if not final.is_dir() or not is_glmkit_output(final) else _checkpoint_additions(final)
            if foreign:
                raise ValueError(f"--save {root}: {final.name} already exists and holds what glmkit did not write "
                                 f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); the checkpoint "
                                 f"is not replaced: move it away and resume again")
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    write_atomic(root / "latest_checkpointed_iteration.txt", str(step))  # never through a planted temporary
    return final


def _latest(cfg) -> Path | None:
    marker = Path(cfg.save) / "latest_checkpointed_iteration.txt" if cfg.save else None
    if marker is None or not (marker.exists() or marker.is_symlink()):
        saved = sorted(p.name for p in Path(cfg.save).glob("iter_*")) if cfg.save and Path(cfg.save).is_dir() else []
        if saved:  # checkpoints without the marker a finished save writes last: not a fresh start
            raise ValueError(f"--save {cfg.save} holds {', '.join(saved[-3:])} but no latest_checkpointed_iteration.txt "
                             f"(the marker each finished save writes last); --resume cannot tell which is whole: "
                             f"write the number of the one to continue from there, or pass --overwrite to start over")
        return None
    text = read_marker(marker)
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{marker}: expected the latest iteration number, found {text[:40]!r}; --resume cannot tell "
                         f"which checkpoint to continue from (write the number of an iter_* directory there)")
    folder = Path(cfg.save) / f"iter_{int(text):07d}"
    if folder.is_symlink():  # glmkit writes iter_* as directories: a link there is someone else's
        raise ValueError(f"{folder} is a symbolic link (to {os.readlink(folder)}); --resume continues only from a "
                         f"checkpoint directory this run's --save holds")
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise ValueError(f"{marker} names iteration {int(text)} but {folder} {what}")
    return folder


# Settings a resumed run may change without being told: how far it goes, how often it saves, what it
# prints and the resume / overwrite switches themselves. Any other difference changes the run's math.
RESUMABLE_CHANGES = {"num_rollout", "save_interval", "progress", "resume", "overwrite", "accept_changes"}


_UNRECORDED = "(not recorded)"
STATE_BYTES = 64 << 20  # a state.json is a few KB (step, param_groups, config); past this it is not one


def _read_state(folder: Path) -> dict:
    """A training checkpoint's state.json, checked: {"step": int >= 0, "param_groups": [...], "config": {...}}."""
    path = folder / "state.json"
    try:
        if (why := not_a_file(path)) is not None:
            raise ValueError(why)
        if path.stat().st_size > STATE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, more than a state file holds ({STATE_BYTES})")
        state = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot be read ({err}); --resume needs it") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0) \
            or not isinstance(state.get("param_groups"), list) or not isinstance(state.get("config"), dict):
        raise ValueError(f"{path}: expected {{\"step\": a non-negative integer, \"param_groups\": [...], \"config\": "
                         f"{{...}}}}; --resume cannot continue from it")
    name = folder.name.removeprefix("iter_")
    if name.isdigit() and name.isascii() and step != int(name):  # iter_N is saved after rollout N, "step": N
        raise ValueError(f"{path}: step {step} does not match its folder {folder.name} (the checkpoint of rollout "
                         f"{int(name)} records step {int(name)}); --resume cannot continue from it")
    return state


def _check_resumed_settings(cfg, folder: Path, digests: dict | None = None) -> None:
    """--resume continues the run recorded in `folder`'s state.json: a setting that differs (other than
    RESUMABLE_CHANGES and those named in --accept-changes) is refused, each named with both values; so
    is a data file whose contents differ from the recorded digest (`digests`: input_digests(cfg)) though
    its name is the same: the resumed run would walk other prompts than the run it continues."""
    from dataclasses import asdict

    state = _read_state(folder)
    recorded = state.get("config") or {}
    accepted = {name.strip().lstrip("-").replace("-", "_") for name in cfg.accept_changes.split(",") if name.strip()}
    known = {f for f in asdict(cfg)}
    unknown = sorted(accepted - known)
    if unknown:
        raise ValueError(f"--accept-changes {', '.join(unknown)}: not a setting of glmkit train")
    now = json.loads(json.dumps(asdict(cfg), default=str))
    # a setting the state does not record cannot be shown unchanged: it counts as changed
    differing = [(name, f"--{name.replace('_', '-')} {recorded.get(name, _UNRECORDED)!r} -> {now[name]!r}")
                 for name in sorted(now)
                 if recorded.get(name, _UNRECORDED) != now[name] and name not in RESUMABLE_CHANGES | accepted]
    # digests are recorded from this version on: a checkpoint without them is resumed as before
    before = state.get("inputs") if isinstance(state.get("inputs"), dict) else {}
    differing += [(name, f"--{name.replace('_', '-')} {now[name]}: its contents changed (sha256 "
                         f"{str(before[name])[:12]}... -> {digest[:12]}...)")
                  for name, digest in sorted((digests or {}).items())
                  if name in before and before[name] != digest and name not in accepted
                  and name not in {n for n, _ in differing}]
    if differing:
        shown = "; ".join(text for _, text in differing[:8])
        raise ValueError(f"--resume: {len(differing)} setting(s) differ from the run in {folder}: {shown}; resume "
                         f"with the recorded values, or name the changes you mean with --accept-changes "
                         f"{','.join(n.replace('_', '-') for n, _ in differing)}")


def input_digests(cfg) -> dict:
    """sha256 of each data file the run reads (--prompt-data, --eval-prompt-data), by setting name:
    state.json records them, so --resume tells a file whose contents changed under the same name."""
    import hashlib

    digests = {}
    for name in ("prompt_data", "eval_prompt_data"):
        path = getattr(cfg, name)
        if path:
            digest = hashlib.sha256()
            with open(path, "rb") as stream:
                for chunk in iter(lambda: stream.read(1 << 20), b""):
                    digest.update(chunk)
            digests[name] = digest.hexdigest()
    return digests


def _inputs(cfg) -> dict:
    return {"--prompt-data": cfg.prompt_data, "--checkpoint": cfg.checkpoint, "--tokenizer": cfg.tokenizer,
            "--eval-prompt-data": cfg.eval_prompt_data}


def _checkpoint_additions(folder: Path) -> list[str]:
    """What a training checkpoint (iter_*) holds that glmkit did not write there: entries added after
    it was written, at any depth; a folder glmkit did not mark (a recorded file replaced by a folder);
    a marked folder whose marker lists nothing (it cannot tell what else was put there)."""
    found = [f"{folder.name}/{name}" for name in added_entries(folder)]
    for entry in [folder, *(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink())]:
        shown = f"{folder.name}/{entry.relative_to(folder)}" if entry != folder else folder.name
        if not is_glmkit_output(entry):
            found.append(f"{shown}/ (a folder glmkit did not write)")
        elif not any(line.startswith("entry: ") for line in read_marker(entry / MARKER, 1 << 20).splitlines()):
            found.append(f"{shown}/ (its marker lists none of its entries)")
    return sorted(set(found))


def _claim_outputs(cfg) -> list[str]:
    """Refuse to start over an earlier run's metrics or checkpoints unless told to; with --overwrite,
    clear what glmkit wrote there (the metrics file, iter_* and the latest marker). -> notes to print."""
    metrics = check_file_out(cfg.metrics_out, "--metrics-out")
    refuse_package_paths(metrics, "--metrics-out")
    if cfg.save:
        refuse_package_paths(cfg.save, "--save")
    refuse_input_as_output(metrics, "--metrics-out", _inputs(cfg))
    save = Path(cfg.save) if cfg.save else None
    if save is not None:
        refuse_input_as_output(save, "--save", _inputs(cfg))
    if save is not None:
        check_dir_out(save, "--save", whole=False)
    if save is not None and os.path.realpath(metrics).startswith(os.path.realpath(save) + os.sep):
        raise ValueError(f"--metrics-out {metrics} is inside --save {save}: the checkpoint folder holds only "
                         f"checkpoints; give the metrics file another place")
    checkpoints = sorted(save.glob("iter_*")) + [m for m in [save / "latest_checkpointed_iteration.txt"]
                                                  if m.exists() or m.is_symlink()] if save is not None and save.is_dir() else []
    marker = save / "latest_checkpointed_iteration.txt" if save is not None else None
    if marker is not None and (marker.exists() or marker.is_symlink()) and (
            marker.is_symlink() or not marker.is_file()):
        what = "a symbolic link" if marker.is_symlink() else (not_a_file(marker) or "not a file").removeprefix("is ")
        raise ValueError(f"--save {save}: latest_checkpointed_iteration.txt is {what}, not the marker glmkit "
                         f"writes; move it away first")
    if cfg.resume:  # the run's own metrics file is cut back and appended to: never another file
        if metrics.exists() or metrics.is_symlink():
            refuse_replacing(metrics, "--metrics-out", "metrics file", _inputs(cfg), action="--resume appends to")
        return []
    if not cfg.overwrite:
        # a marked, empty file is a run that stopped before its first row (a run lock keeps a live one)
        started_only = (metrics.is_file() and not metrics.is_symlink() and is_glmkit_file(metrics)
                        and metrics.stat().st_size == 0)
        if metrics.exists() and not started_only:
            raise ValueError(f"{metrics} already holds a run's metrics: pass --resume to continue that run, or "
                             f"--overwrite to replace it")
        if checkpoints:
            raise ValueError(f"{save} already holds checkpoints ({checkpoints[-1].name}, ...): pass --resume to "
                             f"continue that run, or --overwrite to replace them")
        return []
    # --overwrite removes only what glmkit wrote (marked, a regular file, not through a link, not an input)
    if metrics.exists() or metrics.is_symlink():
        refuse_replacing(metrics, "--metrics-out", "metrics file", _inputs(cfg))
    if checkpoints and through_link(save):
        raise ValueError(f"--save {save}: reached through a symbolic link; --overwrite never removes through a link: "
                         f"name the directory itself")
    links = [p.name for p in checkpoints if p.is_symlink()]
    if links:
        raise ValueError(f"--save {save}: {', '.join(links[:3])}{', ...' if len(links) > 3 else ''} is a symbolic link; "
                         f"--overwrite never removes through a link (glmkit writes iter_* as directories): remove it "
                         f"yourself or choose another --save")
    # only a marked iter_* is removed: an unmarked one holding state.json and optimizer.safetensors may be
    # an older glmkit's, but may as well be anyone's (resume still reads it)
    foreign = [p.name for p in checkpoints if p.name.startswith("iter_") and not is_glmkit_output(p)]
    added = [name for p in checkpoints if p.name.startswith("iter_") and is_glmkit_output(p)
             for name in _checkpoint_additions(p)]
    if added:
        raise ValueError(f"--save {save}: {', '.join(added[:3])}{', ...' if len(added) > 3 else ''} added after glmkit "
                         f"wrote the checkpoint; --overwrite removes only what glmkit wrote: move them away first")
    if foreign:
        raise ValueError(f"--save {save}: {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''} not marked as "
                         f"glmkit's (no {MARKER}; checkpoints of glmkit versions before the marker have none); "
                         f"--overwrite replaces only glmkit's checkpoints: remove them yourself or choose another --save")
    notes = []
    if metrics.exists():
        metrics.unlink()
        notes.append(f"--overwrite: removed the earlier metrics {metrics}")
    for path in checkpoints:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if checkpoints:
        notes.append(f"--overwrite: removed {len(checkpoints)} earlier checkpoint entries under {save}")
    return notes


def _truncate_metrics(path: Path, start_step: int) -> list[str]:
    """On resume, cut the metrics stream back to the rollouts the checkpoint covers (rows of rollout
    >= start_step would be written again); the cut rows go to a side file, never lost."""
    if not path.exists():
        return []
    keep, drop = [], []
    text = {"encoding": "utf-8", "errors": "surrogateescape"}  # rows move as the bytes they were
    for line in path.read_text(**text).splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # a half-written last line of a killed run, or not a row at all
            drop.append(line)
            continue
        step = row.get("step", -1) if isinstance(row, dict) else None
        # an evaluation row's step counts the rollouts done before it: the one after the checkpoint stays
        limit = start_step + 1 if isinstance(row, dict) and "eval/step" in row else start_step
        (drop if not isinstance(step, (int, float)) or step >= limit else keep).append(line)
    if not drop:
        return []
    stamp, n = time.strftime('%Y%m%d-%H%M%S'), 0
    while True:  # a new file, created exclusively: never an existing file or one reached through a link
        side = path.with_name(f"{path.name}.dropped-{stamp}" + (f"-{n}" if n else ""))
        try:
            with open(side, "x", **text) as f:
                f.write("\n".join(drop) + "\n")
            break
        except FileExistsError:
            n += 1
    write_atomic(path, "".join(line + "\n" for line in keep), **text)
    return [f"--resume: the checkpoint covers rollouts < {start_step}; moved {len(drop)} later metric rows of "
            f"{path} to {side}"]


def build_optimizer(cfg: TrainConfig, model) -> torch.optim.Optimizer:
    """Adam with decoupled weight decay over the trainable parameters, as Megatron builds it: group 0
    decays (matrices), group 1 does not (biases and 1-D parameters: norms, mHC scales); empty groups
    are left out. Each group's lr is set per optimizer step from the schedule (see GRPOTrainer.update)."""
    decay, plain = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (plain if name.endswith(".bias") or param.dim() == 1 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                             eps=cfg.adam_eps)


MOMENTS = ("exp_avg", "exp_avg_sq", "step")  # what AdamW keeps per parameter


SCHEDULED = ("lr", "initial_lr")  # the param-group settings a resumed run takes from its checkpoint


def _restore_optimizer(optimizer, folder: Path, param_groups):
    """The optimizer's moments and learning rates from a checkpoint, each checked against this run's
    optimizer before any is loaded: the same groups over the same parameters, settings of the same
    kinds, and one moment of each parameter's shape per `<index>.<name>` tensor. Settings other than
    the learning rate stay this run's."""
    file, state_file = folder / "optimizer.safetensors", folder / "state.json"
    current = optimizer.state_dict()["param_groups"]
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def refuse(what: str):
        raise ValueError(f"{what}; --resume cannot continue from it")

    if len(param_groups) != len(current):
        refuse(f"{state_file}: {len(param_groups)} param_groups; this run's optimizer has {len(current)}")
    for k, (given, mine) in enumerate(zip(param_groups, current)):
        if not isinstance(given, dict) or given.get("params") != mine["params"]:
            refuse(f"{state_file}: param_groups[{k}] does not hold this run's parameters {mine['params'][:4]}...")
        for name, value in mine.items():
            got = given.get(name)
            numbers = (int, float)
            if isinstance(value, (tuple, list)):
                ok = isinstance(got, (tuple, list)) and len(got) == len(value) and all(
                    isinstance(v, numbers) and not isinstance(v, bool) for v in got)
            elif isinstance(value, bool) or value is None:
                ok = isinstance(got, bool) or got is None
            elif isinstance(value, numbers):
                ok = isinstance(got, numbers) and not isinstance(got, bool) and math.isfinite(got)
            else:
                ok = True
            if not ok:
                refuse(f"{state_file}: param_groups[{k}].{name} is {got!r:.40}; this run's is {value!r:.40}")
    from glmkit.checkpoint import CheckpointError
    from glmkit.checkpoint.hf import read_header

    try:  # a FIFO, a folder, an empty, truncated or garbled file: named by glmkit's reader, before loading
        read_header(file)
    except CheckpointError as err:
        refuse(str(err))
    state = {}
    for key, value in load_file(str(file)).items():
        index, dot, name = key.partition(".")
        if not dot or not index.isdigit() or int(index) >= len(params) or name not in MOMENTS:
            refuse(f"{file}: tensor {key!r} is not a moment of this run's optimizer (<index>.{'/'.join(MOMENTS)} "
                   f"for {len(params)} parameters)")
        shape = params[int(index)].shape
        if name != "step" and value.shape != shape:
            refuse(f"{file}: tensor {key!r} has shape {list(value.shape)}; its parameter's is {list(shape)}")
        if not bool(torch.isfinite(value).all()) or (name != "exp_avg" and bool((value < 0).any())):
            # a NaN moment (or a negative second moment or step) turns the next step's weights to NaN
            refuse(f"{file}: tensor {key!r} holds a NaN, an infinite" + ("" if name == "exp_avg" else " or a negative")
                   + " value; AdamW's moments are finite" + ("" if name == "exp_avg" else " and >= 0"))
        state.setdefault(int(index), {})[name] = value
    for index, moments in sorted(state.items()):
        if missing := [name for name in MOMENTS if name not in moments]:
            refuse(f"{file}: parameter {index} has no {'/'.join(missing)} (AdamW keeps {', '.join(MOMENTS)} for each)")
    # the schedule's place (lr) comes from the checkpoint; every other setting (betas, eps, weight decay,
    # amsgrad, maximize, ...) is this run's: an edited state.json cannot turn descent into ascent
    groups = [{**mine, **{k: given[k] for k in SCHEDULED if k in given}} for given, mine in zip(param_groups, current)]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------ the loop

def topk_row_kinds(trainer: dict, rollout: dict, scores: dict, mask: torch.Tensor, kpool: int,
                   dtype: torch.dtype):
    """Per token, summed over DSA layers: (differs, ties) [T] int64. A response token's trainer
    selection (its own indexer's, even under replay) differs from the rollout's when the sets
    differ; a tie when, under the trainer's own scores, the differing pools score its top-k
    boundary and the rollout's set is a top-k too. None without DSA layers."""
    from glmkit.comparison import TIE_TOLERANCE, classify_rows

    if not rollout:
        return None
    rows = mask.nonzero().flatten()
    tol = TIE_TOLERANCE["float32" if dtype == torch.float32 else "bfloat16"]
    differs = torch.zeros(len(mask), dtype=torch.long)
    ties = torch.zeros(len(mask), dtype=torch.long)
    for layer, theirs in rollout.items():
        sc = scores.get(layer)
        sc = None if sc is None else sc[rows]
        kinds = classify_rows(theirs.cpu()[rows], trainer[layer].cpu()[rows], sc, sc, kpool, **tol)
        differs[rows] += torch.tensor([k != "identical" for k in kinds], dtype=torch.long)
        ties[rows] += torch.tensor([k == "tied" for k in kinds], dtype=torch.long)
    return differs, ties


class LocalRollout:
    """The rollout side in this process: a RolloutEngine over its own copy of the trainable weights
    (the frozen ones shared), updated by `load` after every optimizer step. The Ray backend puts the
    same two calls behind actors (glmkit.launch.builtin)."""

    def __init__(self, engine_model, backends):
        from glmkit.model import RolloutEngine

        self.model = engine_model
        self.engine = RolloutEngine(engine_model, backends)

    def bind(self, policy) -> None:
        """Nothing to keep: this side holds its own copy of the trainable weights."""

    def generate(self, prompt_ids, params, seed: int):
        return self.engine.generate(prompt_ids, params, seed=seed, record_routing=True, record_topk=True)

    @torch.no_grad()
    def load(self, tensors: dict):
        """Trainer -> engine: copy the named tensors (every trainable one; the adapters with LoRA)."""
        params = dict(self.model.named_parameters())
        for name, value in tensors.items():
            params[name].copy_(value)


class GRPOTrainer:
    def __init__(self, cfg: TrainConfig, rollout: "RolloutSide | None" = None, dp=None):
        """`rollout`: a RolloutSide (glmkit.model.rollout); None = LocalRollout on a copy of the
        policy's trainable weights.
        `dp`: a `glmkit.rl.parallel.DataParallel` (or made from the environment when
        cfg.data_parallel is set): this process is one trainer rank; rank 0 alone rolls out, writes
        metrics and checkpoints."""
        from glmkit.checkpoint import open_checkpoint
        from glmkit.rl.data import drop_longer, load_prompts
        from glmkit.tokenizer import load_tokenizer

        self.cfg = cfg = cfg.resolved()
        if (dp is not None or cfg.data_parallel) and getattr(rollout, "mode", None) == "distributed":
            raise ValueError("data parallelism and the 'distributed' weight update both need this process's "
                             "default torch.distributed group; use the 'tensor' or 'disk' weight update with it")
        if dp is None and cfg.data_parallel:
            from glmkit.rl.parallel import DataParallel

            dp = DataParallel.from_env(cfg.data_parallel)
        if dp is not None and dp.world > cfg.global_batch_size:
            raise ValueError(f"{dp.world} data-parallel ranks need at least as many samples per optimizer step; "
                             f"--global-batch-size is {cfg.global_batch_size}")
        self.dp = dp
        self.lead = dp is None or dp.rank == 0  # the rank that rolls out, writes and syncs
        data = Path(cfg.prompt_data)
        if (why := not_a_file(data)) is not None:
            raise ValueError(f"--prompt-data {data}: {why}; give a jsonl file")
        dtype = getattr(torch, cfg.dtype)
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.checkpoint)
        self.samples, self.problems = load_prompts(cfg.prompt_data, cfg.input_key, cfg.label_key, self.tokenizer,
                                                   cfg.apply_chat_template, cfg.seed, cfg.on_bad_row)
        # names, shapes and dtypes from the headers, before the outputs are claimed
        config = open_checkpoint(cfg.checkpoint).config
        longest = _longest_prompt(cfg, config)  # a row no step could hold is skipped (or raised) by line, not an OOM later
        self.samples, too_long = drop_longer(self.samples, longest[0], longest[1], cfg.prompt_data, cfg.on_bad_row)
        self.problems += too_long
        if not self.samples:
            first = f" ({len(self.problems)} malformed rows; first: {self.problems[0]})" if self.problems else ""
            raise ValueError(f"--prompt-data {cfg.prompt_data}: no usable prompts{first}")
        if cfg.prompt_pool:
            self.samples = self.samples[:cfg.prompt_pool]
        self.eval_samples = []
        if cfg.eval_prompt_data:
            if (why := not_a_file(cfg.eval_prompt_data)) is not None:
                raise ValueError(f"--eval-prompt-data {cfg.eval_prompt_data}: {why}; give a jsonl file")
            self.eval_samples, _ = load_prompts(cfg.eval_prompt_data, cfg.input_key, cfg.label_key, self.tokenizer,
                                                cfg.apply_chat_template, None, cfg.on_bad_row)
            shared = {tuple(s.prompt_ids) for s in self.samples} & {tuple(s.prompt_ids) for s in self.eval_samples}
            if shared:
                raise ValueError(f"--eval-prompt-data {cfg.eval_prompt_data}: {len(shared)} of its prompts are also "
                                 f"training prompts; a held-out evaluation needs prompts the run never trains on")
            if not self.eval_samples:
                raise ValueError(f"--eval-prompt-data {cfg.eval_prompt_data}: no usable prompts")
        self.input_digests = input_digests(cfg)
        # every input checked first (--overwrite removes an earlier run only once this one can start),
        # before anything slow: a refused run fails at once
        # the run's outputs are locked from here to the end of run(): a second writer is refused
        self.locks = ([RunLock(cfg.metrics_out, "--metrics-out")] + ([RunLock(cfg.save, "--save")] if cfg.save else [])
                      if self.lead else [])
        # a --save folder this run makes goes again if the run ends with nothing in it (a full disk)
        self._made_save = bool(cfg.save) and self.lead and not os.path.lexists(cfg.save)
        for lock in self.locks:
            try:
                lock.__enter__()
            except BaseException:
                self.release()
                raise
        try:
            self._build(cfg, dtype, rollout, dp)
        except BaseException:
            self.release()
            raise

    def release(self):
        """Let go of the outputs' locks (run() does at its end); a --save folder this run made and
        left empty is removed, so no empty folder looks like a run's checkpoints."""
        for lock in getattr(self, "locks", []):
            lock.__exit__(None, None, None)
        save = Path(self.cfg.save) if getattr(self, "_made_save", False) else None
        if save is not None and save.is_dir() and not save.is_symlink() and not any(save.iterdir()):
            save.rmdir()

    def _build(self, cfg, dtype, rollout, dp):
        from glmkit.model import TrainPath, load_model

        self.notes = _claim_outputs(cfg) if self.lead else []
        latest = _latest(cfg) if cfg.resume else None  # a bad resume marker too
        if latest is not None:
            _check_resumed_settings(cfg, latest, self.input_digests)
        self.policy = load_model(cfg.checkpoint, dtype, cfg.device)
        self.lora_names = []
        if cfg.lora_rank:
            self.lora_names = lora.select(self.policy, cfg.target_modules, cfg.exclude_modules)
            lora.apply_lora(self.policy, self.lora_names, cfg.lora_rank, cfg.lora_alpha)
        # The rollout engine's own copy, synced after every update. With LoRA only the adapters are
        # copied: the frozen base is shared, as SGLang keeps its base in place and loads adapters.
        self.rollout_side = None if not self.lead else rollout if rollout is not None else \
            LocalRollout(self._copy_trainable(self.policy), cfg.backends)
        if self.rollout_side is not None:
            if not isinstance(self.rollout_side, RolloutSide):
                missing = [m for m in ("bind", "generate", "load") if not callable(getattr(self.rollout_side, m, None))]
                raise TypeError(f"rollout side {type(self.rollout_side).__name__} lacks {', '.join(missing)} "
                                f"(see glmkit.model.rollout.RolloutSide)")
            self.rollout_side.bind(self.policy)
        self.train_path = TrainPath(self.policy, cfg.backends)
        self.reference = self._copy_trainable(self.policy).eval() if cfg.kl_loss_coef else None
        self.trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, self.policy)
        self.total_optimizer_steps = cfg.num_rollout * (cfg.rollout_batch_size * cfg.n_samples_per_prompt
                                                        // cfg.global_batch_size)
        if dp is not None:  # LoRA's random init (and anything else) equal on every rank, as DDP starts
            dp.broadcast_parameters(self.trainable)  # rank 0's are the source: its rollout copy is current
        self.state = TrainState()
        if latest is not None:
            self.state = self._resume(latest)
            self._check_later_checkpoints()
        if cfg.resume and self.lead:
            self.notes += _truncate_metrics(Path(cfg.metrics_out), self.state.step)
        self.stop_ids = [t for t in (self.tokenizer.eos_token_id,) if t is not None]

    @staticmethod
    def _copy_trainable(model):
        """A copy of `model` whose trainable parameters are its own and whose frozen ones are shared."""
        shared = {id(p): p for p in model.parameters() if not p.requires_grad}
        shared |= {id(b): b for b in model.buffers()}
        return copy.deepcopy(model, memo=shared)

    def _check_later_checkpoints(self):
        """Resuming from a rolled-back marker rewrites the later iter_* of the run: refused before any
        work when one of them holds what glmkit did not write (it would be replaced at its save)."""
        root = Path(self.cfg.save)
        for folder in sorted(root.glob("iter_*")):
            number = folder.name.removeprefix("iter_")
            if not (number.isascii() and number.isdigit()) or int(number) < self.state.step:
                continue
            foreign = ([folder.name] if folder.is_symlink() or not folder.is_dir() or not is_glmkit_output(folder)
                       else _checkpoint_additions(folder))
            if foreign:
                raise ValueError(f"--save {root}: {folder.name}, which this resumed run would write again, holds what "
                                 f"glmkit did not write ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
                                 f"; move it away first")

    @property
    def start_step(self) -> int:
        """The next rollout to run (0, or the one after a resumed checkpoint's)."""
        return self.state.step

    def _resume(self, folder: Path) -> TrainState:
        """Weights and optimizer from `folder` -> the TrainState its state.json records."""
        from glmkit.checkpoint import CheckpointError, open_checkpoint
        from glmkit.checkpoint.hf import read_header
        from glmkit.model import refuse_nonfinite_weights
        from glmkit.rl.lora import adapter_state

        state = _read_state(folder)
        try:
            if self.lora_names:
                read_header(folder / "adapter.safetensors")  # a FIFO, a folder, a damaged file: named
                loaded = load_file(str(folder / "adapter.safetensors"))
            else:
                loaded = open_checkpoint(folder / "model").state_dict()
        except CheckpointError as err:
            raise ValueError(f"{err}; --resume cannot continue from it") from None
        tensors = self.policy.state_dict()  # checkpoint names; per-expert entries view the stacked experts
        if self.lora_names:  # exactly this run's adapters: another key would overwrite a frozen base weight
            _refuse_other_adapter(folder / "adapter.safetensors", loaded, adapter_state(self.policy))
        with torch.no_grad():
            for name, value in loaded.items():
                tensors[name].copy_(value)
        refuse_nonfinite_weights(self.policy, folder)  # a NaN saved there would only show up in sampling
        _restore_optimizer(self.optimizer, folder, state["param_groups"])
        self.sync()
        try:
            return TrainState.from_record(state)
        except ValueError as err:
            raise ValueError(f"{folder / 'state.json'}: {err}; --resume cannot continue from it") from None

    def trainable_state(self) -> dict:
        """Every trainable tensor by name (the adapters only, with LoRA): what a sync sends."""
        return {name: p.detach() for name, p in self.policy.named_parameters() if p.requires_grad}

    def sync(self):
        """Trainer -> rollout side (rank 0's, under data parallelism; the ranks' weights are equal)."""
        if self.rollout_side is not None:
            self.rollout_side.load(self.trainable_state())

    def batch_for(self, step: int):
        """The prompts of rollout `step`: a seeded walk over the shuffled data, so resume repeats it."""
        n = self.cfg.rollout_batch_size
        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.cfg.seed))
        start = step * n
        return [self.samples[int(order[(start + i) % len(self.samples)])] for i in range(n)]

    def rollout(self, step: int):
        """-> (samples, completions, rewards) of rollout `step`; under data parallelism rank 0 rolls out
        and scores, and every rank receives the same completions and rewards (and stops together on a
        non-finite one)."""
        if self.dp is None:
            samples, completions, rewards = self._rollout(step)
        elif self.lead:
            from glmkit.rl.parallel import encode_rollout

            samples, completions, rewards = self._rollout(step)
            self.dp.broadcast_bytes(encode_rollout(completions, rewards))
        else:
            from glmkit.rl.parallel import decode_rollout

            samples = [s for s in self.batch_for(step) for _ in range(self.cfg.n_samples_per_prompt)]
            completions, rewards = decode_rollout(self.dp.broadcast_bytes(None))
        self._refuse_nonfinite(step, completions)
        return samples, completions, rewards

    def _rollout(self, step: int):
        from glmkit.model import SamplingParams
        from glmkit.rl.rewards import score

        cfg = self.cfg
        prompts = self.batch_for(step)
        expanded = [s for s in prompts for _ in range(cfg.n_samples_per_prompt)]
        params = SamplingParams(cfg.rollout_temperature, cfg.rollout_top_p, cfg.rollout_max_response_len,
                                self.stop_ids)
        completions = self.rollout_side.generate([s.prompt_ids for s in expanded], params, rollout_seed(cfg, step))
        rewards, failed, texts = [], [], []
        for s, c in zip(expanded, completions):
            text = self.tokenizer.decode(c.tokens, skip_special_tokens=False)
            texts.append(text)
            graded = score(cfg.rm_type, text, s.label, cfg.grader)
            if graded["score"] is None:  # where the framework's reward raises: said, and scored as a miss
                failed.append(graded["error"])
            rewards.append(MISS_SCORE[cfg.rm_type] if graded["score"] is None else graded["score"])
        self.grader_errors, self.rollout_texts = failed, texts
        if failed:
            warnings.warn(f"rollout {step}: the {cfg.rm_type} grader raised on {len(failed)} of {len(expanded)} "
                          f"samples (the framework's run would stop there), each scored as a miss "
                          f"({MISS_SCORE[cfg.rm_type]}); the first: {failed[0]}", stacklevel=2)
        return expanded, completions, torch.tensor(rewards, dtype=torch.float32)

    def _refuse_nonfinite(self, step: int, completions):
        """A sampled token's log-prob that is NaN or infinite means the policy's forward overflowed
        (SGLang answers those as null): nothing of this rollout can be scored or trained on."""
        bad = [(i, j) for i, c in enumerate(completions) for j, lp in enumerate(c.logprobs) if not math.isfinite(lp)]
        if bad:
            from glmkit.model import largest_weight

            first = bad[0]
            raise NonFiniteRollout(f"rollout {step}: {len(bad)} sampled log-probs are NaN or infinite, in "
                                   f"{len({i for i, _ in bad})} of {len(completions)} samples (first: sample "
                                   f"{first[0]}, token {first[1]}): the rollout's forward overflows; the policy's "
                                   f"largest |weight| is {largest_weight(self.policy)}")

    def _pack(self, completions):
        return pack_completions(completions, self.policy.device)

    def step(self, step: int) -> list[dict]:
        """Rollout `step` from the trainer's current state (see `advance`) -> its metric rows."""
        rows, self.state = self.advance(replace(self.state, step=step))
        return rows

    def advance(self, state: TrainState) -> tuple[list[dict], TrainState]:
        """Rollout `state.step` and its optimizer steps -> (the metric rows, the state for the next
        rollout). The rows are as the recipe's framework logs them:
        one `train/*` row per optimizer step (`train/step` = rollout x steps per rollout + step id,
        each row's metrics over that step's samples), then one `rollout/*` + `perf/*` row
        (`rollout/step`). Every row also carries `step` (the rollout), for readers of either kind.
        The phases: rollout, batch building, log-prob recompute, updates, sync, rollout metrics."""
        step = state.step
        t0 = time.time()
        samples, completions, rewards = self.rollout(step)
        t_rollout = time.time() - t0
        size = self.cfg.global_batch_size
        minibatches = len(completions) // size
        # this rank's samples of each optimizer step (all of them in one process), in batch order
        shares = [list(range(mb * size, (mb + 1) * size)) for mb in range(minibatches)]
        if self.dp is not None:
            shares = [self.dp.share(ids) for ids in shares]
        kept = [i for ids in shares for i in ids]
        t_built = time.time()
        batch = self.recompute(self.build_batch(completions, rewards, kept))
        t1 = time.time()
        starts = [sum(map(len, shares[:mb])) for mb in range(minibatches)]
        rows, streak = [], state.nonfinite_streak
        for mb, (start, ids) in enumerate(zip(starts, shares)):
            row = self.update(batch, step, mb, minibatches, list(range(start, start + len(ids))))
            streak = streak + 1 if row.get("train/step_skipped") else 0
            rows.append(row)
        self.phase_times = {"log_probs": t1 - t_built, "actor_train": time.time() - t1}
        t_sync = time.time()
        self.sync()
        t_sync = time.time() - t_sync
        rows.append(self.rollout_metrics(step, completions, rewards, t0, t_rollout, time.time() - t1, t_sync, batch))
        return rows, TrainState(step=step + 1, nonfinite_streak=streak)

    def build_batch(self, completions, rewards, kept: list) -> RolloutBatch:
        """Packed sequences and what the updates need from the rollout: response mask, rollout
        log-probs, routing and DSA selections (see _pack), per-token group advantages (over the
        whole rollout's groups); `kept`: the completions (indices) this rank trains on."""
        advantages = grpo.group_advantages(rewards, self.cfg.n_samples_per_prompt)
        completions, advantages = [completions[i] for i in kept], advantages[kept]
        input_ids, packed, mask, rollout_logp, routing, topk = self._pack(completions)
        return RolloutBatch(completions, input_ids, packed, mask, rollout_logp, routing, topk,
                            advantages[packed.seq_index.cpu()])

    def _sum(self, on_device: dict, on_host: dict) -> dict:
        """Named 0-d tensors (on one device) and Python numbers, each summed over the ranks (itself in
        one process): one read-back and, under data parallelism, one all-reduce for all of them."""
        device = self.dp.device if self.dp is not None else torch.device("cpu")
        values = torch.tensor([float(v) for v in on_host.values()], dtype=torch.float64).to(device)
        if on_device:
            values = torch.cat([torch.stack([v.detach().double() for v in on_device.values()]).to(device), values])
        if self.dp is not None:
            values = self.dp.sum_tensor(values)
        return dict(zip([*on_device, *on_host], values.tolist()))

    @torch.no_grad()
    def recompute(self, batch: RolloutBatch) -> RolloutBatch:
        """The trainer's "old" log-probs before the update (of softmax(logits / T), the distribution the
        rollout sampled from), the reference model's if KL is on, and the per-token comparisons with
        the rollout: abs diff, KL, routing and top-k mismatches -> `batch` with them."""
        cfg = self.cfg
        routing, topk = batch.routing, batch.topk
        replay = routing if cfg.enable_r3 else None
        topk_replay = topk if cfg.use_rollout_indexer_replay else None
        scores = {}
        old = self.train_path.forward(input_ids=batch.input_ids, packed=batch.packed, routing=replay,
                                      topk_replay=topk_replay, temperature=cfg.rollout_temperature,
                                      record_scores=bool(topk), record=lambda layer, site, v: scores.__setitem__(
                                          layer, v.cpu()) if site == "indexer_scores" else None)
        old_logp = old.logprobs.float().cpu()
        ref_logp = (None if self.reference is None else
                    type(self.train_path)(self.reference, cfg.backends)
                    .forward(input_ids=batch.input_ids, packed=batch.packed, routing=replay,
                             topk_replay=topk_replay, temperature=cfg.rollout_temperature)
                    .logprobs.float().cpu())
        # per token, once; each optimizer step's row reduces them over its own samples
        return replace(
            batch, old_logp=old_logp, ref_logp=ref_logp, abs_diff=(old_logp - batch.rollout_logp).abs(),
            rollout_kl=grpo.kl_estimate(batch.rollout_logp, old_logp, "low_var_kl"),
            routing_differs=sum(
                (old.routing[layer].sort(-1).values.cpu() != routing[layer].sort(-1).values.cpu()).any(-1).long()
                for layer in routing) if routing else None,
            topk_kinds=topk_row_kinds(old.topk, topk, scores, batch.mask, self.policy.config.index_kpool,
                                      self.policy.dtype))

    def update(self, batch: RolloutBatch, step: int, mb: int, minibatches: int, ids: list) -> dict:
        """Optimizer step `mb` of rollout `step` over its global_batch_size samples -> its train row.
        `ids`: this rank's samples of the step (all of them in one process), as indices into `batch`."""
        cfg = self.cfg
        completions, packed = batch.completions, batch.packed
        routing, topk = batch.routing, batch.topk
        sub_in, sub_packed, sub_mask, _, sub_routing, sub_topk = self._pack([completions[i] for i in ids])
        sub_rows = torch.cat([torch.arange(*packed.bounds()[i]) for i in ids])
        row = {"train/step": step * minibatches + mb, "rollout/step": step, "step": step}
        sub_of_cpu = sub_packed.seq_index.cpu()
        num = len(ids)
        # every loss term and metric is a mean over the step's samples of each sample's token mean (this
        # rank adds its samples' means and divides by the samples with a response token of all ranks), or
        # with --calculate-per-token-loss a mean over the step's tokens (each sample counts at least 1,
        # as the framework's token count does)
        per_token = cfg.calculate_per_token_loss
        tokens_of = torch.zeros(num).index_add(0, sub_of_cpu, sub_mask.float()).clamp(min=1)
        counts = self._sum({}, {"present": grpo.samples_present(sub_mask, sub_of_cpu, num),
                                "tokens": tokens_of.sum().item()})
        present, tokens = counts["present"], counts["tokens"]

        def share_of_mean(values, mask, sample_of):
            if per_token:
                return (values.float() * mask.float()).sum() / tokens
            total = grpo.sample_total(values, mask, sample_of, num)
            return total / present if present else total

        on_host = {"train/train_rollout_logprob_abs_diff": share_of_mean(batch.abs_diff[sub_rows], sub_mask,
                                                                         sub_of_cpu).item(),
                   "train/train_rollout_kl": share_of_mean(batch.rollout_kl[sub_rows], sub_mask, sub_of_cpu).item()}
        responses = int(sub_mask.sum())
        if batch.routing_differs is not None:
            on_host["routing_differs"] = batch.routing_differs[sub_rows][sub_mask].sum().item()
            on_host["routing_rows"] = responses * len(routing)
        if batch.topk_kinds is not None:
            differs, ties = (k[sub_rows][sub_mask].sum().item() for k in batch.topk_kinds)
            on_host.update(topk_differs=differs, topk_ties=ties, topk_rows=responses * len(topk))
        # the entropy is computed where it is used or asked for; the framework logs 0 otherwise
        with_entropy = cfg.entropy_coef != 0 or cfg.observe_training_entropy
        out = self.train_path.forward(input_ids=sub_in, packed=sub_packed, return_entropy=with_entropy,
                                      temperature=cfg.rollout_temperature,
                                      routing=sub_routing if cfg.enable_r3 else None,
                                      topk_replay=sub_topk if cfg.use_rollout_indexer_replay else None)
        sub_of = sub_packed.seq_index
        m = sub_mask.to(out.logprobs.device)
        old_logp = batch.old_logp
        loss_tok, clipped, kl_tok = grpo.ppo_clip_loss(out.logprobs.float(), old_logp[sub_rows].to(m.device),
                                                      batch.adv_tok[sub_rows].to(m.device), cfg.eps_clip,
                                                      cfg.eps_clip_high, cfg.eps_clip_c)
        on_device = {}
        if cfg.use_tis:  # weights on the trainer/rollout ratio, metrics on the ratio before the clamp
            ratio, weight, tis_clipped = grpo.tis_weights(old_logp[sub_rows], batch.rollout_logp[sub_rows],
                                                          cfg.tis_clip, cfg.tis_clip_low)
            loss_tok = loss_tok * weight.to(m.device)
            on_device.update({"train/ois": share_of_mean((-kl_tok.detach()).exp(), m, sub_of),
                              "train/tis": share_of_mean(ratio.to(m.device), m, sub_of),
                              "train/tis_clipfrac": share_of_mean(tis_clipped.to(m.device), m, sub_of),
                              "train/tis_abs": share_of_mean((ratio - 1).abs().to(m.device), m, sub_of)})
        pg_loss = share_of_mean(loss_tok, m, sub_of)
        loss = pg_loss
        entropy = torch.zeros((), device=m.device)
        if with_entropy:
            entropy = share_of_mean(out.entropy, m, sub_of)  # of softmax(logits / T)
            loss = pg_loss - cfg.entropy_coef * entropy if cfg.entropy_coef else pg_loss
        ess, n_tok = grpo.ess_ratio_per_sample(-kl_tok, m, sub_of, num)
        ess_share = (ess * n_tok).sum() / tokens if per_token else ess.sum() / max(1, present)
        on_device.update({"train/pg_loss": pg_loss, "train/loss": loss, "train/entropy_loss": entropy.detach(),
                          "train/pg_clipfrac": share_of_mean(clipped, m, sub_of),
                          "train/ppo_kl": share_of_mean(kl_tok.detach(), m, sub_of), "train/ess_ratio": ess_share})
        if self.reference is not None:
            kl = share_of_mean(grpo.kl_estimate(out.logprobs, batch.ref_logp[sub_rows].to(m.device),
                                                cfg.kl_loss_type), m, sub_of)
            loss = loss + cfg.kl_loss_coef * kl
            on_device.update({"train/kl_loss": kl, "train/loss": loss})
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.dp is not None:
            self.dp.sum_gradients(self.trainable)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.clip_grad)
        sums = self._sum({k: v.detach() for k, v in on_device.items()}, on_host)  # every metric: one reduce
        total_loss = sums["train/loss"]
        if "routing_rows" in sums:
            sums["train/routing_mismatch_frac"] = sums.pop("routing_differs") / max(1, sums.pop("routing_rows"))
        if "topk_rows" in sums:
            rows_all = max(1, sums.pop("topk_rows"))
            sums["train/topk_mismatch_frac"] = sums.pop("topk_differs") / rows_all
            sums["train/topk_tie_frac"] = sums.pop("topk_ties") / rows_all
        row.update(sums)
        row["train/grad_norm"] = grad_norm.item()
        lr = grpo.scheduled_lr(row["train/step"], cfg.lr, cfg.lr_decay_style, cfg.lr_warmup_iters,
                               cfg.lr_decay_iters or self.total_optimizer_steps, cfg.min_lr)
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = lr
            row[f"train/lr-pg_{i}"] = lr
        if math.isfinite(row["train/pg_loss"]) and math.isfinite(row["train/grad_norm"]) and \
                math.isfinite(total_loss):
            self.optimizer.step()
        else:  # a NaN / Inf update would poison the weights and crash the next sampling
            self.optimizer.zero_grad(set_to_none=True)
            row["train/step_skipped"] = True
        return row

    def rollout_metrics(self, step: int, completions, rewards, t0: float, t_rollout: float, t_train: float,
                        t_sync: float = 0.0, batch: RolloutBatch | None = None) -> dict:
        """The rollout's `rollout/*` and `perf/*` row (over the whole rollout, on every rank), with the
        framework's names: its rollout manager's (response_len/*, zero_std/*, repetition_frac,
        truncated_ratio, perf/rollout_time and token rates) and its trainer's (raw_reward,
        response_lengths, truncated, and the sample means of log_probs, rollout_log_probs, ref_log_probs,
        advantages and returns over the response tokens)."""
        n = len(completions)
        lengths = torch.tensor([len(c.tokens) for c in completions], dtype=torch.float32)
        tokens = sum(len(c.prompt) + len(c.tokens) for c in completions)
        truncated = sum(c.finish_reason == "length" for c in completions) / n
        summary = {"rollout/step": step, "step": step, "rollout/raw_reward": rewards.mean().item(),
                   "rollout/grader_errors": len(getattr(self, "grader_errors", [])),
                   "rollout/response_lengths": lengths.mean().item(), "rollout/truncated": truncated,
                   "rollout/truncated_ratio": truncated,
                   **{f"rollout/response_len/{k}": v for k, v in grpo.statistics(lengths).items()},
                   **{f"rollout/{k}": v for k, v in grpo.zero_std_groups(rewards, self.cfg.n_samples_per_prompt).items()},
                   "perf/rollout_time": t_rollout, "perf/train_time": t_train,
                   "perf/longest_sample_tokens_per_sec": lengths.max().item() / max(1e-9, t_rollout),
                   "perf/tokens_per_gpu_per_sec": lengths.sum().item() / max(1e-9, t_rollout),  # one device
                   "perf/tokens_per_s": tokens / max(1e-9, t_rollout + t_train), "perf/step_time": time.time() - t0,
                   "perf/sync_time": t_sync}
        if batch is not None:
            summary.update(self._throughput(batch))
        texts = getattr(self, "rollout_texts", None)
        if texts is not None and len(texts) == n:
            summary["rollout/repetition_frac"] = sum(map(grpo.has_repetition, texts)) / n
        if batch is not None and batch.old_logp is not None:
            summary.update(self._token_means(batch))
        if self.policy.device.type == "cuda":
            summary["perf/max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.policy.device) / 2**30
        return summary

    def evaluate(self, step: int) -> dict:
        """The held-out evaluation after `step` rollouts (0: before training): eval/raw_reward, the mean
        reward of the eval prompts' samples (greedy, one each, unless --eval-temperature), with
        eval/pass@k for k = 1, 2, 4, ... up to --n-samples-per-eval-prompt (the unbiased estimator over
        each prompt's samples), eval/truncated_ratio and eval/step."""
        from glmkit.model import SamplingParams
        from glmkit.rl.rewards import score

        cfg = self.cfg
        n = cfg.n_samples_per_eval_prompt
        temperature = cfg.eval_temperature if cfg.eval_temperature is not None else (
            cfg.rollout_temperature if n > 1 else 0.0)
        expanded = [s for s in self.eval_samples for _ in range(n)]
        params = SamplingParams(temperature, cfg.rollout_top_p if temperature else 1.0, cfg.rollout_max_response_len,
                                self.stop_ids)
        completions = self.rollout_side.generate([s.prompt_ids for s in expanded], params,
                                                 rollout_seed(cfg, step) + EVAL_SEED_OFFSET)
        rewards = []
        for s, c in zip(expanded, completions):
            graded = score(cfg.rm_type, self.tokenizer.decode(c.tokens, skip_special_tokens=False), s.label,
                           cfg.grader)
            rewards.append(MISS_SCORE[cfg.rm_type] if graded["score"] is None else graded["score"])
        row = {"eval/step": step, "step": step, "eval/raw_reward": sum(rewards) / len(rewards),
               "eval/truncated_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions)}
        row.update({f"eval/{k}": v for k, v in grpo.pass_at_k(rewards, n).items()})
        return row

    def _evaluates_after(self, done: int) -> bool:
        """Whether the held-out evaluation runs once `done` rollouts are done (0: before training)."""
        cfg = self.cfg
        if not self.eval_samples or self.rollout_side is None:
            return False
        return done == 0 or done == cfg.num_rollout or bool(cfg.eval_interval and done % cfg.eval_interval == 0)

    def _throughput(self, batch: RolloutBatch) -> dict:
        """The framework's perf metrics of this rank's share: perf/{log_probs,actor_train}_time, their
        TFLOP/s from the model's FLOP count (glmkit.model.flops; training = 3 x forward), the training
        tokens/s, and on a GPU whose peak is known (or --mfu-peak-tflops) perf/mfu_peak_tflops and
        perf/actor_train_mfu."""
        from glmkit.model.flops import matmul_params_per_token, forward_flops, peak_bf16_tflops

        times = getattr(self, "phase_times", None)
        if not times:
            return {}
        lengths = [end - start for start, end in batch.packed.bounds()]
        if getattr(self, "_weight_macs", None) is None:  # counted once a run: it builds the model on meta
            self._weight_macs = matmul_params_per_token(self.policy.config)
        tflop = forward_flops(self.policy.config, lengths, self._weight_macs) / 1e12
        out = {f"perf/{k}_time": v for k, v in times.items()}
        if times["log_probs"] > 0:
            out["perf/log_probs_tflops"] = tflop / times["log_probs"]
        if times["actor_train"] > 0:
            out["perf/actor_train_tflops"] = 3 * tflop / times["actor_train"]
            out["perf/actor_train_tok_per_s"] = sum(lengths) / times["actor_train"]
            peak = self.cfg.mfu_peak_tflops or (peak_bf16_tflops(torch.cuda.get_device_name(self.policy.device))
                                                if self.policy.device.type == "cuda" else None)
            if peak:
                out["perf/mfu_peak_tflops"] = peak
                out["perf/actor_train_mfu"] = out["perf/actor_train_tflops"] / peak
        return out

    def _token_means(self, batch: RolloutBatch) -> dict:
        """rollout/log_probs, rollout_log_probs, ref_log_probs, advantages and returns (GRPO's returns are
        its advantages): means over samples of each sample's response-token mean, over every rank's."""
        of, num = batch.packed.seq_index.cpu(), len(batch.completions)
        values = {"rollout/log_probs": batch.old_logp, "rollout/rollout_log_probs": batch.rollout_logp,
                  "rollout/advantages": batch.adv_tok, "rollout/returns": batch.adv_tok}
        if batch.ref_logp is not None:
            values["rollout/ref_log_probs"] = batch.ref_logp
        totals = {k: grpo.sample_total(v.float(), batch.mask, of, num).item() for k, v in values.items()}
        sums = self._sum({}, {**totals, "present": grpo.samples_present(batch.mask, of, num)})
        present = max(1, sums.pop("present"))
        return {k: v / present for k, v in sums.items()}

    def run(self, on_metrics=None) -> list[dict]:
        """Every rollout from `start_step` to `num_rollout`: its rows appended to `metrics_out` as they
        happen and passed to `on_metrics(row)`. Stops (raising NonFiniteRun, after writing) when
        `max_nonfinite_steps` optimizer steps in a row had a NaN / Inf loss or gradient."""
        cfg = self.cfg
        out = Path(cfg.metrics_out)
        history = []
        steps = range(self.state.step, cfg.num_rollout)
        bar = tqdm(steps, desc="GRPO", unit="rollout", disable=not (cfg.progress and self.lead))
        try:  # the locks go at the end, however it ends (a full disk at the marker too)
            if self.lead:
                out.parent.mkdir(parents=True, exist_ok=True)
            # other data-parallel ranks compute the same rows and keep them; rank 0 alone writes them
            if self.lead and (not cfg.resume or not is_glmkit_file(out)):  # a new stream names the run writing it
                mark_file(out, "metrics file")  # the marker first: a metrics file never stands unmarked
                out.touch()
            return self._run(out, bar, history, on_metrics)
        finally:
            self.release()

    def _run(self, out, bar, history, on_metrics):
        cfg = self.cfg
        # unbuffered bytes: each row is written whole or cut back (append_row), never left half a line
        with (out.open("ab", buffering=0) if self.lead else contextlib.nullcontext()) as stream:
            if self.state.step == 0 and self._evaluates_after(0):
                self._write([self.evaluate(0)], history, stream, on_metrics)
            trained = False
            for step in bar:
                try:
                    rows, self.state = self.advance(self.state)
                except NonFiniteRollout as err:
                    if not trained:  # nothing trained yet in this run: the weights it was given
                        raise
                    raise NonFiniteRun(f"stopped at {err}") from None
                trained = True
                if self._evaluates_after(step + 1):
                    rows.append(self.evaluate(step + 1))
                self._write(rows, history, stream, on_metrics)
                last_train = next((r for r in reversed(rows) if "train/step" in r), {})
                last_rollout = next(r for r in reversed(rows) if "rollout/raw_reward" in r)
                rate = last_rollout.get("perf/tokens_per_s")
                bar.set_postfix(step=last_train.get("train/step", "-"), reward=f"{last_rollout['rollout/raw_reward']:.3f}",
                                diff=f"{last_train.get('train/train_rollout_logprob_abs_diff') or 0:.1e}",
                                tok_s=f"{rate:.0f}" if rate else "-")
                # --save without --save-interval: one checkpoint, after the last rollout
                periodic = (step + 1) % cfg.save_interval == 0 if cfg.save_interval else step + 1 == cfg.num_rollout
                if cfg.save and periodic and self.lead:
                    _save_checkpoint(cfg, self.state, self.policy, self.optimizer, self.lora_names, self.input_digests)
                if self.state.nonfinite_streak >= cfg.max_nonfinite_steps:
                    raise NonFiniteRun(f"stopped after rollout {step}: {self.state.nonfinite_streak} optimizer steps "
                                       f"in a row had a NaN / Inf loss or gradient norm (each was skipped; see "
                                       f"train/step_skipped in {out})")
        return history

    def _write(self, rows, history, stream, on_metrics):
        for row in rows:
            row = json_row(row)
            history.append(row)
            if not self.lead:
                continue
            append_row(stream, json.dumps(row, allow_nan=False))  # a crash loses nothing already measured
            if on_metrics is not None:
                on_metrics(row)


def _longest_prompt(cfg, config) -> tuple[int, str]:
    """The most prompt tokens a row may hold, and why: --rollout-max-prompt-len when given (the
    framework's filter), the model's context less the response, and a lower-bound memory estimate
    (glmkit.bounds per token, plus one fp32 score matrix of the sequence) for its n samples against
    the memory free now; the tightest of them."""
    import math

    from glmkit.bounds import bytes_per_token, free_bytes

    response = cfg.rollout_max_response_len
    bounds = [(int(config.max_position_embeddings) - response,
               f"the model's context of {config.max_position_embeddings} tokens less --rollout-max-response-len "
               f"{response}")]
    if cfg.rollout_max_prompt_len is not None:
        bounds.append((cfg.rollout_max_prompt_len, "--rollout-max-prompt-len"))
    free = free_bytes(cfg.device)
    linear = cfg.n_samples_per_prompt * bytes_per_token(config)  # n x bytes per token, plus 4 T^2 <= free
    longest = int((-linear + math.sqrt(linear * linear + 16 * free)) / 8)
    bounds.append((longest - response, f"by a lower-bound estimate, {cfg.n_samples_per_prompt} samples of it with "
                                       f"responses of up to {response} tokens need more than the {free / 2**30:.3g} "
                                       f"GiB free on {cfg.device}"))
    limit, why = min(bounds, key=lambda b: b[0])
    return max(0, limit), why


def append_row(stream, row: str) -> None:
    """One JSON line appended to an unbuffered binary stream, whole: a write the disk cuts short (full,
    over quota) is truncated back to the last whole row before the error goes on, so the file a later
    run, a notebook or --resume reads never ends in a cut row."""
    start = os.fstat(stream.fileno()).st_size
    data = memoryview((row + "\n").encode("utf-8", "surrogateescape"))
    try:
        while data:
            data = data[stream.write(data):]  # a raw write may take only part
    except OSError as err:
        os.ftruncate(stream.fileno(), start)
        if err.filename is None and err.errno is not None:  # a full disk, a size limit: named by its file
            raise OSError(err.errno, err.strerror, str(getattr(stream, "name", "the metrics file"))) from None
        raise
    except BaseException:
        os.ftruncate(stream.fileno(), start)
        raise


def _refuse_other_adapter(file: Path, loaded: dict, expected: dict) -> None:
    """A saved adapter must hold exactly the run's adapter tensors, in their shapes and a floating-point
    dtype: a missing one would restart from a fresh adapter unsaid, an extra one (a base weight's name)
    would overwrite a frozen weight."""
    missing = sorted(set(expected) - set(loaded))
    extra = sorted(set(loaded) - set(expected))
    shaped = [f"{k} {list(loaded[k].shape)} (expected {list(expected[k].shape)})" for k in sorted(set(loaded) & set(expected))
              if loaded[k].shape != expected[k].shape]
    typed = [f"{k} ({str(loaded[k].dtype).replace('torch.', '')})" for k in sorted(loaded)
             if k in expected and not loaded[k].is_floating_point()]

    def listed(names: list) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    problems = [f"{what}{listed(names)}" for what, names in (("missing ", missing), ("not an adapter of this run: ", extra),
                                                               ("mis-shaped: ", shaped), ("not floating point: ", typed))
                if names]
    if problems:
        raise ValueError(f"{file}: {'; '.join(problems)}; it is not the adapter this run saves (--lora-rank, "
                         f"--target-modules and --exclude-modules as when it was saved); --resume cannot continue from it")


class NonFiniteRun(RuntimeError):
    """Too many consecutive optimizer steps with a NaN / Inf loss or gradient."""


class NonFiniteRollout(ValueError):
    """A rollout whose sampled log-probs are NaN or infinite. From the weights a run starts with it is
    bad input (exit 2, naming the largest weight); once this run has trained, it stops the run as
    NonFiniteRun does."""


def json_row(row: dict) -> dict:
    """A metric row as valid JSON: a NaN / Inf value becomes null and its name is listed under
    `nonfinite` (so a reader tells "diverged" from "not measured")."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return row
    return {**{k: (None if k in bad else v) for k, v in row.items()}, "nonfinite": bad}


def rollout_rows(history: list[dict]) -> list[dict]:
    """The once-per-rollout rows (rollout/*, perf/*) of a metrics stream."""
    return [h for h in history if "rollout/raw_reward" in h]


def train_rows(history: list[dict]) -> list[dict]:
    """The once-per-optimizer-step rows (train/*) of a metrics stream."""
    return [h for h in history if "train/step" in h]


def read_metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def pack_completions(completions, device):
    """Packed sequences, per-token sample ids, response mask (rows whose target is a response token),
    rollout log-probs on those rows, the rollout's routing per MoE layer and its DSA selections per
    DSA layer (sequence-local; -1 rows on each sequence's last token, which was never fed)."""
    from glmkit.model.packed import pack

    seqs = [c.prompt + c.tokens for c in completions]
    input_ids, packed = pack(seqs, device=device)
    T = packed.num_tokens
    mask = torch.zeros(T, dtype=torch.bool)
    rollout_logp = torch.zeros(T)
    for c, (s, e) in zip(completions, packed.bounds()):
        rows = slice(s + len(c.prompt) - 1, e - 1)
        mask[rows] = True
        rollout_logp[rows] = torch.tensor(c.logprobs)
    routing = {}
    for layer in completions[0].routing:
        k = completions[0].routing[layer].shape[1]
        rows = [torch.cat([c.routing[layer], torch.full((1, k), -1, dtype=torch.long)]) for c in completions]
        routing[layer] = torch.cat(rows).to(device)
    topk = {}
    for layer in completions[0].topk or {}:
        width = max(c.topk[layer].shape[1] for c in completions)
        rows = [torch.nn.functional.pad(torch.cat([c.topk[layer], torch.full((1, c.topk[layer].shape[1]), -1,
                                                                              dtype=torch.int32)]),
                                        (0, width - c.topk[layer].shape[1]), value=-1) for c in completions]
        topk[layer] = torch.cat(rows).long()
    return input_ids, packed, mask, rollout_logp, routing, topk
