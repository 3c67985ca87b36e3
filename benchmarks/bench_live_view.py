"""What notebook 02's live view costs a GRPO run: the tiny preset run twice in the same process, once
with no view and once with `widgets.LiveMetrics.update` as its `on_metrics` (then `finish()`), headless
(this process) and, with --kernel, inside a Jupyter kernel (nbclient, as JupyterLab and papermill run
it). Prints each wall time, the view's own redraw seconds, and the overhead ratio (target <= 5%).

    python benchmarks/bench_live_view.py [--rollouts 12] [--kernel]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = '''
import json, time, tempfile
from pathlib import Path
from glmkit.rl.loop import GRPOTrainer, TrainConfig
from widgets.training import LiveMetrics

def run(rollouts, view):
    out = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    trainer = GRPOTrainer(TrainConfig(model_name="tiny", num_rollout=rollouts, metrics_out=str(out), progress=False,
                                      eval_interval=None))
    started = time.perf_counter()
    trainer.run(on_metrics=view.update if view is not None else None)
    if view is not None:
        view.finish()
    return time.perf_counter() - started

def measure(rollouts):
    run(1, None)  # warm: imports, the first forward's allocations
    bare = run(rollouts, None)
    view = LiveMetrics(variant="tiny", total_rollouts=rollouts)
    viewed = run(rollouts, view)
    return {"bare_s": bare, "viewed_s": viewed, "redraw_s": view.draw_seconds, "draws": view.draws,
            "overhead": viewed / bare - 1, "redraw_share": view.draw_seconds / viewed}
'''


def in_kernel(rollouts: int) -> dict:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        f"import os, sys, json\nos.chdir({str(ROOT)!r}); sys.path.insert(0, {str(ROOT)!r})\n{MEASURE}\n"
        f"print('RESULT', json.dumps(measure({rollouts})))")])
    NotebookClient(nb, timeout=3600, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream")
    return json.loads(text.split("RESULT", 1)[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=12)
    p.add_argument("--kernel", action="store_true", help="also measure inside a Jupyter kernel")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    scope: dict = {}
    exec(compile(MEASURE, "bench_live_view", "exec"), scope)  # the same code the kernel runs
    results = {"headless": scope["measure"](args.rollouts)}
    if args.kernel:
        results["kernel"] = in_kernel(args.rollouts)
    for where, r in results.items():
        print(f"{where:9s} {args.rollouts} rollouts: bare {r['bare_s']:.1f} s, with the live view {r['viewed_s']:.1f} s "
              f"(overhead {r['overhead']:+.1%}); the view redrew {r['draws']} times in {r['redraw_s']:.2f} s "
              f"= {r['redraw_share']:.1%} of the run (target <= 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
