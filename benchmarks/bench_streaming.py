"""Streaming parity vs end-to-end parity (reference vs train path): seconds per layer and peak RSS.

    python benchmarks/bench_streaming.py [--variant tiny] [--set FIELD=JSON ...] [--seq-len 64] [--batch 2]

Each mode runs in its own process so its peak RSS is its own. Streaming holds one layer's weights
(twice: the reference's layer and glmkit's block); end-to-end holds the whole model twice.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(checkpoint: str, streaming: bool, seq_len: int, batch: int) -> None:
    import resource

    sys.path.insert(0, str(ROOT))
    from glmkit.parity.builtin import parity

    start = time.perf_counter()
    result, _, _ = parity(checkpoint, ("reference", "train"), seq_len=seq_len, batch=batch, streaming=streaming)
    print(json.dumps({"seconds": time.perf_counter() - start, "verdict": result.verdict,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("CHECKPOINT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child[0], args.child[1] == "streaming", args.seq_len, args.batch)

    sys.path.insert(0, str(ROOT))
    from glmkit.checkpoint import synth_checkpoint
    from glmkit.config import describe, variant_config

    config = variant_config(args.variant, **{k: json.loads(v) for k, v in (s.split("=", 1) for s in args.set)})
    path = synth_checkpoint(config, 0, Path(tempfile.mkdtemp()) / "ckpt", progress=False)
    print(f"{describe(config)}; reference vs train, B={args.batch} T={args.seq_len}")
    runs = {}
    for mode in ("end-to-end", "streaming"):
        out = subprocess.run([sys.executable, __file__, "--child", str(path), mode, "--seq-len", str(args.seq_len),
                              "--batch", str(args.batch)], capture_output=True, text=True, check=True)
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    layers = config.num_hidden_layers
    for mode, r in runs.items():
        print(f"{mode:10s}: {r['seconds']:6.2f} s ({r['seconds'] / layers:5.2f} s/layer), peak RSS "
              f"{r['peak_rss_mib']:7.0f} MiB, verdict {r['verdict']}")
    e2e, st = runs["end-to-end"], runs["streaming"]
    print(f"streaming / end-to-end: time {st['seconds'] / e2e['seconds']:.2f}x, "
          f"peak RSS {st['peak_rss_mib'] / e2e['peak_rss_mib']:.2f}x")


if __name__ == "__main__":
    main()
