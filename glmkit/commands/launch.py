"""`glmkit launch`: plan, preflight and run the recipe's launcher (miles) or glmkit's GRPO on Ray."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from glmkit.commands.args import (DTYPES, DEVICES, MAX_LORA_RANK, _finite, _finite_positive, _positive,
                                  _seed, _non_negative, _gpu_fraction, _print_verdict)
from glmkit.inputs import ascii_int


def _launcher_options(args) -> dict:
    """The launcher options given on the command line (field -> value), by the launcher's own names."""
    from glmkit.launch.launcher import ALL_FIELDS

    return {f: getattr(args, f) for f in ALL_FIELDS if getattr(args, f, None) is not None}


def cmd_launch(args) -> int:
    """Plan (and with --address / --local-head, run, re-attach or stop) a launch; see glmkit.launch."""
    import json as _json

    from glmkit.launch import plan
    from glmkit.launch.run import launch_verdict, open_cluster, run_miles

    if args.stop:
        return _launch_stop(args)
    if args.attach:
        return _launch_attach(args)
    if args.backend == "builtin":
        return _launch_builtin(args)
    given = _launcher_options(args)
    model = given.pop("model_name", None)
    if model == "tiny":
        raise ValueError("--model-name tiny is the builtin backend's preset; the recipe's launcher takes "
                         "GLM-5.3-Flash or GLM-5.3-Flash-4layer")
    launch = plan(model, lora=args.lora, prompt_data=args.prompt_data, input_key=args.input_key,
                  label_key=args.label_key, gpu_mem_gib=args.gpu_memory_gib, max_tokens_per_gpu=args.max_tokens_per_gpu,
                  first_stage_layers=args.decoder_first_pipeline_num_layers,
                  last_stage_layers=args.decoder_last_pipeline_num_layers, options=given,
                  hf_checkpoint=given.pop("hf_checkpoint", None), ckpt_dir=given.pop("ckpt_dir", None),
                  inventory=_inventory_or_none(args.address), miles_dir=args.miles_dir)
    print(_json.dumps(launch.as_dict(), indent=2) if args.json else launch.text())
    if args.dry_run or not (args.address or args.local_head):
        if not args.dry_run and not args.json:
            print("(no --address: nothing submitted)")
        return 0 if launch.ok else 1
    if not launch.ok:
        print("glmkit launch: preflight failed; nothing submitted", file=sys.stderr)
        return 1
    with open_cluster(args.address if not args.local_head else None) as cluster:
        result = run_miles(cluster, launch, args.run_name, reattach=args.reattach, metrics_out=args.metrics_out,
                           on_log=lambda t: print(t, end=""), on_job=lambda j: print(_following(cluster, j)),
                           on_training_job=lambda j: print(f"training job {j} (the launcher's)"))
    print(result.summary())
    verdict = launch_verdict(result, launch)
    _print_verdict("verdict", verdict)
    return 0 if verdict["verdict"] == "pass" else 1


def _following(cluster, job) -> str:
    if cluster.head is not None:
        return f"job {job} on {cluster.address}; following (the head is this command's: Ctrl-C stops the run)"
    return f"job {job} on {cluster.address}; following (Ctrl-C stops following, not the job; --stop stops it)"


def _launch_attach(args) -> int:
    from glmkit.launch.cluster import connect
    from glmkit.launch.run import Cluster, attach, launch_verdict

    if not args.address:
        raise ValueError("--attach needs --address http://HOST:8265 (the cluster the run is on)")
    result = attach(Cluster(args.address, connect(args.address)), args.run_name, metrics_out=args.metrics_out,
                    on_log=lambda t: print(t, end=""),
                    on_training_job=lambda j: print(f"training job {j} (the launcher's)"))
    if result is None:
        print(f"no job of {args.run_name!r} on {args.address}", file=sys.stderr)
        return 1
    print(result.summary())
    verdict = launch_verdict(result)
    _print_verdict("verdict", verdict)
    return 0 if verdict["verdict"] == "pass" else 1


def _inventory_or_none(address):
    from glmkit.launch.cluster import inventory

    return inventory(address) if address and address.startswith("http") else None


def _launch_stop(args) -> int:
    from glmkit.launch.cluster import connect
    from glmkit.launch.run import Cluster, stop_run

    if not args.address:
        raise ValueError("--stop needs --address http://HOST:8265 (the cluster the run is on)")
    status = stop_run(Cluster(args.address, connect(args.address)), args.run_name)
    print(f"no running job of {args.run_name!r}" if status is None else f"{args.run_name}: {status.lower()}")
    return 0 if status is not None else 1


def _launch_builtin(args) -> int:
    import json as _json

    from glmkit.launch.run import launch_verdict, open_cluster, run_builtin
    from glmkit.rl.health import run_verdict

    if not args.address and not args.local_head:
        raise ValueError("--backend builtin needs --address http://HOST:8265 or --local-head")
    if args.bundle_gpu != 1 and args.device != "cuda":
        raise ValueError(f"--bundle-gpu {args.bundle_gpu} is a share of a GPU: it needs --device cuda")
    model = args.model_name or "tiny"
    fields = {"model_name": model, "checkpoint": args.checkpoint, "prompt_data": args.prompt_data,
              "num_rollout": args.num_rollout or 20, "rollout_batch_size": args.rollout_batch_size,
              "n_samples_per_prompt": args.n_samples_per_prompt or 8, "global_batch_size": args.global_batch_size,
              "rollout_max_response_len": args.rollout_max_response_len, "enable_r3": bool(args.enable_r3),
              "device": args.device, "dtype": args.dtype, "seed": args.seed, "lora_rank": args.lora_rank or 0,
              "metrics_out": args.job_metrics_out or str(Path(args.metrics_out).resolve()) + ".job", "overwrite": True}
    fields = {k: v for k, v in fields.items() if v is not None}
    from glmkit.launch import jobs
    from glmkit.rl.loop import TrainConfig

    TrainConfig(**fields).resolved()  # a bad config fails here, before any cluster work
    if args.dry_run:
        print(jobs.builtin_entrypoint(fields, args.rollout_actors, args.device == "cuda", trainers=args.trainers,
                                      bundle_gpu=args.bundle_gpu))
        return 0
    # a local head advertises a logical CPU per bundle the run asks for (a smoke run, not a benchmark)
    with open_cluster(None if args.local_head else args.address,
                      num_cpus=max(2, args.rollout_actors + args.trainers)) as cluster:
        result = run_builtin(cluster, fields, args.run_name, rollout_actors=args.rollout_actors,
                             trainers=args.trainers, gpus=args.device == "cuda", bundle_gpu=args.bundle_gpu,
                             reattach=args.reattach, metrics_out=args.metrics_out,
                             on_job=lambda j: print(_following(cluster, j)),
                             on_rows=lambda rows: [print(_json.dumps(r)) for r in rows
                                                   if "rollout/step" in r and "train/step" not in r])
    print(result.summary())
    verdict = launch_verdict(result)
    _print_verdict("verdict", verdict)
    if result.ok:
        health = run_verdict(result.rows, model)
        _print_verdict("run verdict", health)
    return 0 if verdict["verdict"] == "pass" else 1


# The launcher's numbers the framework could not run with: each refused at the command line, naming
# its range, instead of reaching the cluster's job (lowest, highest, whether the lowest itself is out).
LAUNCHER_RANGES = {
    "num_nodes": (1, None, False), "num_gpus_per_node": (1, None, False), "num_rollout": (1, None, False),
    "rollout_max_response_len": (1, None, False), "tensor_model_parallel_size": (0, None, False),
    "lora_rank": (1, MAX_LORA_RANK, False), "lora_alpha": (0, None, True), "lora_dropout": (0, 1, False),
    "rollout_batch_size": (1, None, False), "n_samples_per_prompt": (1, None, False),
    "global_batch_size": (1, None, False), "rollout_temperature": (0, None, False),
    "rollout_num_gpus_per_engine": (0, None, False), "sglang_mem_fraction_static": (0, 1, True),
    "lr": (0, None, True)}


def _in_range(kind: str, field: str):
    """An argparse type: an int or finite float in LAUNCHER_RANGES[field] (any, where none is listed)."""
    low, high, open_low = LAUNCHER_RANGES.get(field, (None, None, False))

    def parse(text: str):
        value = ascii_int(text) if kind == "int" else _finite(text)  # argparse names a ValueError's input
        if low is not None and (value < low or (open_low and value == low)) or high is not None and value > high:
            lowest = f"> {low}" if open_low else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {lowest}{f' and <= {high}' if high is not None else ''}, "
                                             f"got {text}")
        return value
    parse.__name__ = "integer" if kind == "int" else "finite number"
    return parse


def _launcher_arguments(p) -> None:
    """Every option of the recipe's two launchers, by its own name (default None: the launcher's own
    default applies); the builtin backend reads the ones it shares (num-rollout, batch sizes, ...)."""
    from glmkit.launch.launcher import ALL_FIELDS, option_spec

    types = {"str": str}
    for field in ALL_FIELDS:
        option = option_spec(field)
        default = "" if option.default in (None, "") else f" (launcher default {option.default})"
        text = (option.help + default) if option.help else default.strip(" ()") or None
        if field == "model_name":
            p.add_argument(option.flag, dest=field, choices=[*option.choices, "tiny"],
                           help="GLM-5.3-Flash or GLM-5.3-Flash-4layer (launcher default); builtin: also tiny")
        elif option.kind == "bool":
            p.add_argument(option.flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif option.kind == "choice":
            p.add_argument(option.flag, dest=field, choices=list(option.choices), help=text)
        elif option.kind == "list":
            p.add_argument(option.flag, dest=field, action="append", help=text)
        else:
            kind = types.get(option.kind) or _in_range(option.kind, field)
            p.add_argument(option.flag, dest=field, type=kind, help=text)
    # the names glmkit used before it took the launcher's own
    p.add_argument("--nodes", dest="num_nodes", type=_positive, help=argparse.SUPPRESS)
    p.add_argument("--gpus-per-node", dest="num_gpus_per_node", type=_positive, help=argparse.SUPPRESS)


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    p = sub.add_parser("launch", help="plan, preflight and run the recipe's launcher (miles) or glmkit's GRPO on Ray",
                       description="The recipe's launcher options are taken by their own names "
                                   "(scripts/run_glm5_3_flash.py, with --lora scripts/run_glm5_3_flash_lora.py), "
                                   "so a command line moves between the two unchanged; unset ones keep the "
                                   "launcher's defaults.")
    p.add_argument("--backend", default="miles", choices=["miles", "builtin"])
    p.add_argument("--lora", action="store_true", help="the LoRA launcher (miles)")
    _launcher_arguments(p)
    p.add_argument("--address", help="Ray cluster: http://HOST:8265 (Jobs API)")
    p.add_argument("--local-head", action="store_true", help="start a Ray head on 127.0.0.1 for this run")
    p.add_argument("--dry-run", action="store_true", help="print the plan, the preflight and the commands only")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument("--run-name", default="glmkit-launch", help="the job's tag (re-attach and --stop find it by this)")
    p.add_argument("--reattach", action=argparse.BooleanOptionalAction, default=True,
                   help="follow the running job of --run-name if there is one (default), instead of a new one")
    p.add_argument("--stop", action="store_true", help="stop the running job of --run-name (its training processes)")
    p.add_argument("--attach", action="store_true",
                   help="follow the newest job of --run-name, running or finished, submitting nothing")
    p.add_argument("--metrics-out", default="reports/launch/metrics.jsonl")
    p.add_argument("--miles-dir", help="miles: the framework's checkout on the cluster, where the commands run "
                                       "(default /root/miles, the recipe's image)")
    p.add_argument("--prompt-data", help="the dataset (jsonl; first rows checked); miles: reaches the trainer "
                                         "through --extra-args (the launcher has no option for it)")
    p.add_argument("--input-key", help="miles, with --prompt-data: the prompt field (default prompt)")
    p.add_argument("--label-key", help="miles, with --prompt-data: the label field (default label)")
    p.add_argument("--gpu-memory-gib", type=_finite_positive, help="per-GPU memory for the memory check (default: the inventory's)")
    p.add_argument("--max-tokens-per-gpu", type=_positive,
                   help="miles: passed through --extra-args (default: the launcher's, 8192; LoRA 16384)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=_positive,
                   help="miles: the first stage's layers, through --extra-args (default: the launcher's, 11 at PP 4)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=_positive,
                   help="miles: the last stage's layers, through --extra-args (default: the launcher's, 12 at PP 4)")
    p.add_argument("--checkpoint", help="builtin: HF checkpoint directory (tiny: the shipped one)")
    p.add_argument("--rollout-actors", type=_positive, default=1)
    p.add_argument("--trainers", type=_non_negative, default=0,
                   help="builtin: 0 = one trainer beside the first rollout actor; N = N data-parallel trainer ranks "
                        "on bundles (GPUs) of their own, weights to the rollout actors over a process group")
    p.add_argument("--bundle-gpu", type=_gpu_fraction, default=1.0,
                   help="builtin, --device cuda: the GPU each bundle holds (default 1); a fraction packs several "
                        "bundles on one GPU, e.g. 0.5 for --trainers 1 on a one-GPU host (their world runs over gloo)")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--job-metrics-out", help="builtin: where the trainer actor writes its own metrics file")
    p.set_defaults(func=cmd_launch)
