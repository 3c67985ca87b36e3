"""One trainer process against N data-parallel ranks (torchrun), or against the builtin backend's
separate layout (N trainer ranks and a rollout actor as Ray actors), on the same seed: time and metrics.

    python benchmarks/bench_data_parallel.py [--ranks 2] [--backend gloo|nccl] [--out FILE.json] \
        -- [glmkit train arguments, e.g. --model-name tiny --num-rollout 4]
    python benchmarks/bench_data_parallel.py --layout separate [--ranks 1] [--gpus [--bundle-gpu 0.5]] -- ...
    ... [--only one|other --out FILE.json]   one side alone (a device command's time limit), then
    python benchmarks/bench_data_parallel.py --compare ONE.json OTHER.json    the comparison of the two

data-parallel (default): `glmkit train` once in one process and once as `torchrun --nproc-per-node N
... --data-parallel BACKEND` (on GPUs: `--backend nccl --device cuda`, one GPU a rank; gloo lets the
ranks share one GPU, their gradients summed through the host).
separate: the job entrypoint of `glmkit launch --backend builtin --trainers N` (`python -m
glmkit.launch.builtin`, a Ray instance of its own on this machine) with the same TrainConfig: N
trainer ranks and one rollout actor on bundles of their own, weights broadcast over a weights-update
group (nccl; gloo when `--bundle-gpu` below 1 packs the bundles on shared GPUs).
Prints for both runs the mean `perf/step_time` and `perf/sync_time` per rollout, the mean of the
recipe's four headline metrics (`train/train_rollout_logprob_abs_diff`, `rollout/raw_reward`,
`train/grad_norm`, `train/ppo_kl`), and the largest difference of every train/* and rollout/* metric
between the two (the same run, up to summation order in fp32; bf16 rounds the all-reduced gradients
once more, and atomic adds in the GPU kernels differ run to run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADLINE = ("train/train_rollout_logprob_abs_diff", "rollout/raw_reward", "train/grad_norm", "train/ppo_kl")


def run(train_args: list, metrics: Path, ranks: int, backend: str, layout: str = "data-parallel",
        bundle_gpu: float | None = None, label: str = "") -> float:
    """Run one side to its end, its output streamed line by line under `label` (a run cut short by a
    timeout still shows how far it got); -> wall seconds."""
    command = [sys.executable, "-m", "glmkit", "train", *train_args, "--metrics-out", str(metrics)]
    if layout == "separate" and ranks:
        command = separate_command(train_args, metrics, ranks, bundle_gpu)
    elif ranks > 1:
        from glmkit.launch.cluster import free_port

        port = free_port()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                   "127.0.0.1", "--master-port", str(port), *command[1:], "--data-parallel", backend]
    start = time.perf_counter()
    # the Ray actors of the separate layout import glmkit too: from this checkout, wherever they start
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    tail = collections.deque(maxlen=40)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            print(f"[{label}] {line}", end="", flush=True)
            tail.append(line)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{''.join(tail)}")
    return time.perf_counter() - start


def separate_command(train_args: list, metrics: Path, trainers: int, bundle_gpu: float | None) -> list:
    """The builtin backend's job entrypoint for the TrainConfig these `glmkit train` arguments make."""
    import dataclasses

    from glmkit.cli import _train_config, build_parser
    from glmkit.launch import jobs

    cfg = _train_config(build_parser().parse_args(["train", *train_args, "--metrics-out", str(metrics)]))
    fields = {**dataclasses.asdict(cfg), "overwrite": True}
    gpus = bundle_gpu is not None
    return shlex.split(jobs.builtin_entrypoint(fields, 1, gpus, sys.executable, trainers=trainers,
                                               bundle_gpu=bundle_gpu or 1.0))


def summary(rows: list) -> dict:
    def mean(key):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else None
    return {"step_time_s": mean("perf/step_time"), "sync_time_s": mean("perf/sync_time"),
            **{key: mean(key) for key in HEADLINE}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--layout", default="data-parallel", choices=("data-parallel", "separate"))
    parser.add_argument("--gpus", action="store_true", help="separate: the bundles are GPUs")
    parser.add_argument("--bundle-gpu", type=float, default=1.0, help="separate, --gpus: the GPU a bundle holds")
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", choices=("one", "other"), default=None,
                        help="run one side alone and write its rows to --out (compare later with --compare)")
    parser.add_argument("--compare", nargs=2, metavar=("ONE", "OTHER"), default=None,
                        help="compare two --only outputs instead of running anything")
    parser.add_argument("train_args", nargs="*", help="glmkit train arguments (after --)")
    args = parser.parse_args(argv)
    train_args = args.train_args or ["--model-name", "tiny", "--num-rollout", "4"]
    other = f"{args.ranks} ranks" if args.layout == "data-parallel" else f"separate, {args.ranks} trainer(s)"
    sides = {"one": ("one process", 0), "other": (other, args.ranks)}
    result = {"command": " ".join(sys.argv), "layout": args.layout, "ranks": args.ranks, "backend": args.backend,
              "runs": {}, "rows": {}}
    if args.compare:
        for path in args.compare:
            part = json.loads(Path(path).read_text())
            for name in part["rows"]:
                # two runs of one side (e.g. one process twice: the run-to-run noise) keep both
                label = name if name not in result["rows"] else f"{name} [{Path(path).stem}]"
                result["runs"][label], result["rows"][label] = part["runs"][name], part["rows"][name]
                result.setdefault("side_commands", {})[label] = part.get("command")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for name, ranks in [sides[args.only]] if args.only else sides.values():
                metrics = Path(tmp) / f"{ranks}.jsonl"
                wall = run(train_args, metrics, ranks, args.backend, args.layout,
                           args.bundle_gpu if args.gpus else None, label=name)
                result["rows"][name] = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                result["runs"][name] = {"wall_s": wall, **summary(result["rows"][name])}
    worst = {}
    if len(result["rows"]) == 2:
        one, many = result["rows"].values()
        for a, b in zip(one, many):
            for key, value in a.items():
                if key.startswith(("train/", "rollout/")) and isinstance(value, float) and isinstance(b.get(key), float):
                    worst[key] = max(worst.get(key, 0.0), abs(b[key] - value))
        result["largest_abs_difference"] = worst
    for name, values in result["runs"].items():
        print(f"{name:12s} " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} -" for k, v in values.items()))
    for key, value in sorted(worst.items(), key=lambda kv: -kv[1]):
        print(f"  largest |difference| {value:.3g}  {key}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
