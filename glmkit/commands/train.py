"""`glmkit train` and `glmkit lora prepare / train`: the GRPO loop from the command line."""

from __future__ import annotations

import argparse

import os
import sys

from glmkit.commands.args import (DTYPES, DEVICES, _backends, _backend_arguments, _int_at_least, _finite, MAX_LORA_RANK,
                                  _positive, _integer, _seed, _print_verdict)


def _train_config(args):
    from dataclasses import fields

    from glmkit.rl.loop import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    data = given.get("eval_prompt_data")
    if data is not None:  # the framework's form is NAME PATH (pairs, for several sets); glmkit reads one set
        if len(data) > 2:
            raise ValueError(f"--eval-prompt-data {' '.join(data)}: glmkit evaluates one held-out file "
                             f"([NAME] FILE), got {len(data)} values")
        given["eval_prompt_data"] = data[-1]
    return TrainConfig(**given, backends=str(_backends(args)))


def cmd_train(args) -> int:
    from glmkit.rl.health import format_observations, format_table, verdicts
    from glmkit.rl.loop import GRPOTrainer

    from glmkit.rl.health import run_verdict
    from glmkit.rl.loop import NonFiniteRun, rollout_rows

    rollout = None
    if args.data_parallel and args.rollout_url and args.weight_update == "distributed":  # every rank stops here
        raise ValueError("--data-parallel and --weight-update distributed both need this process's "
                         "torch.distributed group; use --weight-update tensor or disk with --data-parallel")
    # under data parallelism rank 0 alone rolls out: the other ranks build no client (torchrun sets RANK)
    lead = not args.data_parallel or os.environ.get("RANK", "0") == "0"
    if args.rollout_url and lead:
        from glmkit.serve.client import SGLangRollout

        rollout = SGLangRollout(args.rollout_url, mode=args.weight_update, update_dir=args.weight_update_dir,
                                master=args.weight_update_master)
        rollout.client.health()  # an unreachable server fails here, before the model loads
    trainer = GRPOTrainer(_train_config(args), rollout=rollout)
    cfg = trainer.cfg
    for note in trainer.notes:
        print(note)
    if trainer.problems and trainer.lead:
        print(f"{cfg.prompt_data}: skipped {len(trainer.problems)} malformed rows (first: {trainer.problems[0]})",
              file=sys.stderr)
    if trainer.lora_names and trainer.lead:
        print(f"LoRA rank {cfg.lora_rank}: {len(trainer.lora_names)} projections adapted, "
              f"{sum(p.numel() for p in trainer.trainable)} trainable parameters")
    stopped, history = None, []
    try:
        trainer.run(on_metrics=history.append)  # rows kept as they come, so a stopped run still reports
    except NonFiniteRun as err:
        stopped = str(err)
        print(f"glmkit train: {stopped}", file=sys.stderr)
    finally:
        if trainer.dp is not None:
            trainer.dp.close()
    if not trainer.lead:  # rank 0 reports for the data-parallel group
        return 1 if stopped is not None else 0
    rollouts = rollout_rows(history)
    first, last = rollouts[0] if rollouts else {}, rollouts[-1] if rollouts else {}
    print(f"rollouts {len(rollouts)}: raw_reward {first.get('rollout/raw_reward', float('nan')):.3f} -> "
          f"{last.get('rollout/raw_reward', float('nan')):.3f}; metrics: {cfg.metrics_out}")
    print(format_table(verdicts(history, cfg.model_name)))
    result = run_verdict(history, cfg.model_name)
    if result["observations"]:
        print(format_observations(result["observations"]))
    _print_verdict("run verdict", result)
    if stopped is not None:
        return 1
    return 1 if args.fail_unhealthy and result["verdict"] != "pass" else 0


def cmd_lora_prepare(args) -> int:
    import torch

    from glmkit.model import Glm5Model
    from glmkit.rl import lora
    from glmkit.rl.loop import PRESETS

    from glmkit.checkpoint import open_checkpoint
    from glmkit.config import variant_config

    lora.check_settings(args.lora_rank, args.lora_alpha)
    # the checkpoint's own config when there is one (tiny: the shipped start), else the variant's
    checkpoint = args.checkpoint or PRESETS[args.model_name].get("checkpoint")
    config = open_checkpoint(checkpoint).config if checkpoint else variant_config(args.model_name)
    with torch.device("meta"):
        model = Glm5Model(config)
    names = lora.select(model, args.target_modules, args.exclude_modules)
    lora.check_rank_fits(model, names, args.lora_rank)
    for row in lora.table(model, names):
        print(f"{row['module']:48s} {row['layer_type']:4s} {str(row['shape']):14s} "
              f"rank-{args.lora_rank} adapter: {args.lora_rank * sum(row['shape'])} params")
    print(f"{len(names)} projections adapted; frozen: routed experts, kv_b_proj, KDA conv1d / A_log / dt_bias / "
          f"o_norm, the DSA indexer, the router and the mHC parameters")
    return 0


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    def train_arguments(p, lora_required=False):
        from glmkit.rl.lora import DEFAULT_EXCLUDE
        from glmkit.rl.loop import PRESETS

        p.add_argument("--model-name", default="tiny", choices=list(PRESETS))
        p.add_argument("--checkpoint", help="HF checkpoint directory (tiny: the shipped starting checkpoint)")
        p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's own files)")
        p.add_argument("--prompt-data", help="jsonl with chat prompts and labels (tiny: the shipped synthetic copy task)")
        p.add_argument("--input-key", default="prompt")
        p.add_argument("--label-key", default="label")
        p.add_argument("--rm-type", default="deepscaler", choices=["deepscaler", "math", "dapo"])
        p.add_argument("--grader", default="framework", choices=["framework", "math-verify"],
                       help="framework: exactly what the framework's reward returns (default); math-verify: "
                            "glmkit's lenient equivalence grader")
        p.add_argument("--on-bad-row", default="skip", choices=["skip", "raise"])
        p.add_argument("--prompt-pool", type=_positive,
                       help="train on the first N prompts of the shuffled data only (tiny preset: 32)")
        p.add_argument("--num-rollout", type=_positive, default=20)
        p.add_argument("--rollout-batch-size", type=_positive, help="prompts per rollout (recipe 8; tiny preset 16)")
        p.add_argument("--n-samples-per-prompt", type=_positive, default=8)
        p.add_argument("--global-batch-size", type=_positive, help="samples per optimizer step (recipe 64; tiny 32)")
        p.add_argument("--rollout-max-response-len", type=_integer)
        p.add_argument("--rollout-max-prompt-len", type=_integer,
                       help="leave prompts of more tokens out of the data, named in a warning (the framework's "
                            "option; tiny preset: 1024)")
        p.add_argument("--rollout-temperature", type=_finite, default=1.0)
        p.add_argument("--rollout-top-p", type=_finite, default=1.0)
        p.add_argument("--lr", type=_finite, help="Adam learning rate (recipe: 1e-6; the tiny preset: 4e-4)")
        p.add_argument("--eps-clip", type=_finite, default=0.2)
        p.add_argument("--eps-clip-high", type=_finite, default=0.28)
        p.add_argument("--kl-loss-coef", type=_finite, default=0.0)
        p.add_argument("--kl-loss-type", default="low_var_kl", choices=["k1", "k2", "k3", "low_var_kl"])
        p.add_argument("--eps-clip-c", type=_finite, help="dual-clip PPO: the loss of a negative-advantage token is at "
                                                          "most eps_clip_c x |A| (> 1; default off)")
        p.add_argument("--entropy-coef", type=_finite, default=0.0)
        p.add_argument("--observe-training-entropy", action="store_true",
                       help="compute and log train/entropy_loss at --entropy-coef 0 (the framework logs 0 then)")
        # the optimizer and its schedule, by the framework's (Megatron's) names; default: the launchers'
        p.add_argument("--adam-beta1", type=_finite, help="default 0.9 (the launchers')")
        p.add_argument("--adam-beta2", type=_finite, help="default 0.98 (the launchers'; Megatron's own 0.999)")
        p.add_argument("--adam-eps", type=_finite, default=1e-8)
        p.add_argument("--weight-decay", type=_finite,
                       help="decoupled, not on biases or 1-D parameters; default 0.1 (the launchers')")
        p.add_argument("--clip-grad", type=_finite, default=1.0, help="gradient norm clip")
        p.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"],
                       help="default constant (the launchers')")
        p.add_argument("--lr-warmup-iters", type=_integer, default=0, help="optimizer steps of linear warmup from 0")
        p.add_argument("--lr-decay-iters", type=_integer,
                       help="linear / cosine: optimizer steps to reach --min-lr (default: the whole run)")
        p.add_argument("--min-lr", type=_finite, default=0.0)
        p.add_argument("--calculate-per-token-loss", action=argparse.BooleanOptionalAction, default=None,
                       help="loss and metrics as means over the step's tokens, not over its samples' token means "
                            "(default: on with LoRA, as its launcher sets it)")
        p.add_argument("--use-tis", action="store_true",
                       help="truncated importance sampling: weight each token's loss by exp(train - rollout "
                            "log-prob) clamped to [--tis-clip-low, --tis-clip]; logs train/tis, tis_clipfrac, "
                            "tis_abs, ois")
        p.add_argument("--tis-clip", type=_finite, default=2.0)
        p.add_argument("--tis-clip-low", type=_finite, default=0.0)
        p.add_argument("--eval-prompt-data", nargs="+", metavar="[NAME] FILE",
                       help="held-out prompts (jsonl; none of them a training prompt), evaluated before training, "
                            "every --eval-interval rollouts and after the last (tiny preset: the copy task's 100 held-out numbers)")
        p.add_argument("--eval-interval", type=_positive, help="rollouts between evaluations (tiny preset: 5)")
        p.add_argument("--n-samples-per-eval-prompt", type=_positive, default=1,
                       help="samples per eval prompt (> 1: sampled at --eval-temperature, eval/pass@k logged)")
        p.add_argument("--eval-temperature", type=_finite,
                       help="default: greedy with one sample, else the rollout temperature")
        p.add_argument("--mfu-peak-tflops", type=_finite,
                       help="peak dense bf16 TFLOP/s of the training device, for perf/actor_train_mfu (default: "
                            "known GPUs by name; on a CPU no MFU is logged without it)")
        p.add_argument("--enable-r3", action="store_true", help="routing replay: the trainer uses the rollout's experts")
        p.add_argument("--use-rollout-indexer-replay", action="store_true",
                       help="DSA top-k replay: the trainer attends over the positions the rollout selected")
        # glmkit lora train: rank >= 1 (rank 0 would train every weight); glmkit train: 0 = full weights
        p.add_argument("--lora-rank", type=_int_at_least(1 if lora_required else 0, "integer", MAX_LORA_RANK),
                       default=8 if lora_required else 0)
        p.add_argument("--lora-alpha", type=_finite, default=16.0)
        p.add_argument("--target-modules", default="attn,mlp")
        p.add_argument("--exclude-modules", default=DEFAULT_EXCLUDE)
        p.add_argument("--device", default="cpu", choices=DEVICES)
        p.add_argument("--dtype", default="float32", choices=list(DTYPES))
        _backend_arguments(p)
        p.add_argument("--seed", type=_seed, default=0)
        p.add_argument("--data-parallel", default="", choices=["gloo", "nccl"],
                       help="this process is one rank of a data-parallel trainer started by torchrun "
                            "(torchrun --nproc-per-node N -m glmkit train --data-parallel nccl ...); rank 0 rolls "
                            "out and writes the metrics")
        p.add_argument("--metrics-out", default="reports/train/metrics.jsonl")
        p.add_argument("--save", help="checkpoint directory")
        p.add_argument("--save-interval", type=_integer, default=0,
                       help="save every N rollouts (default with --save: once, after the last rollout)")
        p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --save "
                       "(its recorded settings must match; see --accept-changes)")
        p.add_argument("--accept-changes", default="", metavar="NAMES",
                       help="with --resume: settings (comma-separated, e.g. lr,seed) that may differ from the run's")
        p.add_argument("--overwrite", action="store_true",
                       help="start over an earlier run's --metrics-out and --save checkpoints (default: refuse)")
        p.add_argument("--max-nonfinite-steps", type=_positive, default=3,
                       help="stop after this many optimizer steps in a row with a NaN / Inf loss or grad norm")
        p.add_argument("--fail-unhealthy", action="store_true",
                       help="exit 1 when the run verdict is fail (reasons printed)")
        p.add_argument("--rollout-url", metavar="URL",
                       help="generate on a server speaking SGLang's native API (an SGLang server or glmkit serve) "
                            "instead of in this process; weights are pushed to it after every optimizer step")
        p.add_argument("--weight-update", default="tensor", choices=["tensor", "disk", "distributed"],
                       help="with --rollout-url: push weights in the request (tensor), as a directory (disk), or "
                            "broadcast over a weights-update process group (distributed: gloo / nccl)")
        p.add_argument("--weight-update-master", metavar="HOST:PORT",
                       help="with --weight-update distributed: the rendezvous address (this process is rank 0)")
        p.add_argument("--weight-update-dir", metavar="DIR",
                       help="with --weight-update disk: where the update directory is written (the server "
                            "must allow it with --allow-updates-from)")

    p = sub.add_parser("train", help="GRPO on the tiny variant or the 4-layer slice, metrics as JSONL")
    train_arguments(p)
    p.set_defaults(func=cmd_train)

    lora_cmd = sub.add_parser("lora", help="native LoRA: prepare (validate and list targets) and train")
    lora_sub = lora_cmd.add_subparsers(dest="lora_command", required=True, metavar="ACTION")
    p = lora_sub.add_parser("prepare", help="validate the target selection and list the adapted projections")
    train_arguments(p, lora_required=True)
    p.set_defaults(func=cmd_lora_prepare)
    p = lora_sub.add_parser("train", help="GRPO training only the LoRA adapters")
    train_arguments(p, lora_required=True)
    p.set_defaults(func=cmd_train)
