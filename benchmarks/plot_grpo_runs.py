"""Plot GRPO runs side by side: the train-vs-rollout log-prob diff against the recipe's healthy range,
step time and peak GPU memory per rollout, one line per metrics JSONL.

    python benchmarks/plot_grpo_runs.py benchmarks/results/smoke_grpo_4layer/metrics_*.jsonl \
        --out benchmarks/results/smoke_grpo_4layer/runs.png
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from glmkit.rl.health import HEALTHY_FULL
from glmkit.rl.loop import read_metrics

# (metric, title, y scale): step time is log-scaled, the first rollout includes kernel compiles
PANELS = (
    ("train/train_rollout_logprob_abs_diff", "train-rollout log-prob |diff|", "linear"),
    ("perf/step_time", "step time (s; rollout 0 compiles)", "log"),
    ("perf/max_memory_allocated_gib", "peak GPU memory (GiB)", "linear"),
)


def plot(paths: list[Path], title: str) -> Figure:
    fig = Figure(figsize=(4.2 * len(PANELS), 3.4))
    axes = fig.subplots(1, len(PANELS))
    for ax, (metric, label, scale) in zip(axes, PANELS):
        band = HEALTHY_FULL.get(metric, {}).get("range")
        if band:
            ax.axhspan(*band, color="#2e9d4f", alpha=0.15, label="recipe's healthy range")
        for path in paths:
            rows = [r for r in read_metrics(path) if r.get(metric) is not None]
            ax.plot([r["step"] for r in rows], [r[metric] for r in rows], marker="o",
                    label=path.stem.removeprefix("metrics_"))
        ax.set_title(label, fontsize=10)
        ax.set_yscale(scale)
        ax.set_xlabel("rollout")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    axes[2].set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--title", default="GLM-5.3-Flash-4layer, LoRA rank 8, bf16, one H200")
    args = parser.parse_args()
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    plot(args.metrics, args.title).savefig(tmp, format="png", dpi=110)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
