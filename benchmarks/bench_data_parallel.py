"""One trainer process against N data-parallel ranks (torchrun) on the same seed: time and metrics.

    python benchmarks/bench_data_parallel.py [--ranks 2] [--backend gloo|nccl] [--out FILE.json] \
        -- [glmkit train arguments, e.g. --model-name tiny --num-rollout 4]

Runs `glmkit train` once in one process and once as `torchrun --nproc-per-node N ... --data-parallel
BACKEND` (on GPUs: `--backend nccl --device cuda`, one GPU a rank), then prints for both the mean
`perf/step_time` and `perf/sync_time` per rollout, the mean of the recipe's four headline metrics
(`train/train_rollout_logprob_abs_diff`, `rollout/raw_reward`, `train/grad_norm`, `train/ppo_kl`),
and the largest difference of every train/* and rollout/* metric between the two runs (the same run,
up to summation order in fp32; bf16 rounds the all-reduced gradients once more).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEADLINE = ("train/train_rollout_logprob_abs_diff", "rollout/raw_reward", "train/grad_norm", "train/ppo_kl")


def run(train_args: list, metrics: Path, ranks: int, backend: str) -> float:
    command = [sys.executable, "-m", "glmkit", "train", *train_args, "--metrics-out", str(metrics)]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
                   "127.0.0.1", "--master-port", str(port), *command[1:], "--data-parallel", backend]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


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
    parser.add_argument("--out", default=None)
    parser.add_argument("train_args", nargs="*", help="glmkit train arguments (after --)")
    args = parser.parse_args(argv)
    train_args = args.train_args or ["--model-name", "tiny", "--num-rollout", "4"]
    with tempfile.TemporaryDirectory() as tmp:
        result = {"command": " ".join(sys.argv), "ranks": args.ranks, "backend": args.backend, "runs": {}}
        rows = {}
        for name, ranks in (("one process", 1), (f"{args.ranks} ranks", args.ranks)):
            metrics = Path(tmp) / f"{ranks}.jsonl"
            wall = run(train_args, metrics, ranks, args.backend)
            rows[name] = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            result["runs"][name] = {"wall_s": wall, **summary(rows[name])}
        one, many = rows.values()
        worst = {}
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
