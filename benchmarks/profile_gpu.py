"""Where the time goes: GLM-5.3-Flash-4layer at full width on one GPU, glmkit's forward and train step.

    python benchmarks/profile_gpu.py [--forward-t 8192] [--train-t 4096] [--prefill-b 64] [--top 25]
                                     [--out DIR]

(0 skips a row; prefill is B prompts of 512 tokens into the rollout caches.)

For each row, after one warm-up call (compiles and autotune stay out): the wall time of one call,
the forward's split by module (CUDA events around every block's attention, indexer, MLP and the
LM head; "mhc+norms" is the block's remainder), and the kernels that took the most GPU time over one
call (torch.profiler), grouped by name, and where the call waits for the GPU (host syncs, by the
Python line that asked). Tables print; with --out, a JSON of the same numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.bench_gpu import (build_glmkit, glmkit_forward, glmkit_prefill, glmkit_train,  # noqa: E402
                                  token_batch)


class ModuleTimer:
    """CUDA events around chosen modules' methods (the attention's forward_packed, the indexer's
    select_packed, the MLP's and LM head's forward); totals per label in ms."""

    def __init__(self, model):
        self.events, self.patched = defaultdict(list), []
        targets = [(model.lm_head, "forward", "lm_head")]
        for block in model.layers:
            L = block.layer
            targets += [(block, "forward", f"block{L}"), (block.self_attn, "forward_packed", f"block{L}.{block.kind}"),
                        (block.mlp, "forward", f"block{L}.{'moe' if block.is_moe else 'mlp'}")]
            if getattr(block.self_attn, "indexer", None) is not None:
                targets.append((block.self_attn.indexer, "select_packed", f"block{L}.indexer"))
        for module, method, label in targets:
            self._wrap(module, method, label)

    def _wrap(self, module, method, label):
        inner = getattr(module, method)

        def timed_call(*args, **kwargs):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*args, **kwargs)
            stop.record()
            self.events[label].append((start, stop))
            return out
        setattr(module, method, timed_call)  # an instance attribute shadows the class's method
        self.patched.append((module, method))

    def totals(self):
        torch.cuda.synchronize()
        return {label: sum(a.elapsed_time(b) for a, b in pairs) for label, pairs in self.events.items()}

    def remove(self):
        for module, method in self.patched:
            delattr(module, method)


def split_by_module(totals: dict) -> dict:
    """Attention, indexer, MLP per block, and the block's remainder (mHC mixing, norms) as mhc+norms."""
    rows = {}
    for label, ms in totals.items():
        if label.startswith("block") and "." not in label:
            inner = sum(v for k, v in totals.items() if k.startswith(label + ".") and not k.endswith("indexer"))
            rows[label + ".mhc+norms"] = ms - inner
        elif label.endswith(".dsa") and label.replace(".dsa", ".indexer") in totals:
            rows[label + "(-indexer)"] = ms - totals[label.replace(".dsa", ".indexer")]
            rows[label.replace(".dsa", ".indexer")] = totals[label.replace(".dsa", ".indexer")]
        elif not label.endswith("indexer"):
            rows[label] = ms
    return rows


def kernel_table(fn, top: int):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:90]
            totals[name] += event.device_time / 1e3
            counts[name] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return sum(totals.values()), [(name, ms, counts[name]) for name, ms in ranked[:top]], sum(counts.values())


def host_ops(fn, top: int) -> list:
    """The operators one call dispatches, by how often (a launch-bound call is won back by dispatching
    fewer): [(name, calls, host ms)] of the top-level ones (ops called from inside another op are
    folded into their caller)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    calls, host = defaultdict(int), defaultdict(float)
    for event in prof.events():
        if event.cpu_parent is None and event.device_type == torch.autograd.DeviceType.CPU:
            calls[event.name[:70]] += 1
            host[event.name[:70]] += event.cpu_time_total / 1e3
    ranked = sorted(calls.items(), key=lambda kv: -kv[1])
    return [(name, n, host[name]) for name, n in ranked[:top]]


def python_hotspots(fn, top: int) -> list:
    """[(function, calls, own host ms)] under cProfile: where the host spends its time dispatching."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{Path(file).name}:{line}({name})", calls, own * 1e3) for (file, line, name), (_, calls, own, _, _)
            in ranked]


def host_syncs(fn) -> dict:
    """Where one call waits for the GPU (a .item(), a device-to-host copy, a blocking host-to-device
    copy): torch's sync debug mode warns at each; counted by the Python line that asked."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    where = defaultdict(int)
    for w in caught:
        if "synchroniz" in str(w.message):
            where[f"{Path(w.filename).name}:{w.lineno}"] += 1
    return dict(where)


def print_kernels(title, total, rows):
    print(f"\n{title}: GPU kernel time {total:.1f} ms")
    for name, ms, n in rows:
        print(f"  {ms:8.2f} ms {100 * ms / total:5.1f}%  x{n:<5d} {name}")


def timed(fn, repeat=2):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward-t", type=int, default=8192)
    parser.add_argument("--train-t", type=int, default=4096)
    parser.add_argument("--prefill-b", type=int, default=0)
    parser.add_argument("--backends", default="kda=fla,dsa=auto,moe=auto")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from glmkit.config import variant_config

    config = variant_config("GLM-5.3-Flash-4layer")
    model = build_glmkit(config, 0, torch.bfloat16)
    report = {}
    rows = (("forward", args.forward_t, 1), ("prefill", 512 * args.prefill_b, args.prefill_b),
            ("train", args.train_t, 1))
    for row, t, n in rows:
        if not t:
            continue
        ids = token_batch(config.vocab_size, n, t // n)
        fn = {"forward": lambda: glmkit_forward(model, args.backends, ids),
              "prefill": lambda: glmkit_prefill(model, args.backends, ids),
              "train": lambda: glmkit_train(model, args.backends, ids, args.recompute)}[row]()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        wall = timed(fn)
        peak = torch.cuda.max_memory_allocated() / 2 ** 30
        timer = ModuleTimer(model)
        with torch.no_grad() if row != "train" else torch.enable_grad():
            fn()
        modules = split_by_module(timer.totals())
        timer.remove()
        total, kernels, launches = kernel_table(fn, args.top)
        ops = host_ops(fn, args.top)
        syncs = host_syncs(fn)
        print(f"\n== {row} T={t}: {wall:.1f} ms per call ({t / wall * 1e3:.0f} tok/s), peak {peak:.1f} GiB, "
              f"first call {first:.1f} s")
        print("forward split by module (ms):")
        for label, ms in sorted(modules.items()):
            print(f"  {label:28s} {ms:8.2f}")
        print_kernels(f"{row} T={t}", total, kernels)
        print(f"kernels launched in one call: {launches}; GPU busy {100 * total / wall:.0f}% of the wall time")
        print("top-level operators dispatched, by count (calls, host ms under the profiler):")
        for name, n, ms in ops:
            print(f"  x{n:<5d} {ms:8.2f} ms  {name}")
        hotspots = python_hotspots(fn, args.top)
        print("Python functions by own host time (cProfile, inflated by it):")
        for name, n, ms in hotspots:
            print(f"  x{n:<5d} {ms:8.2f} ms  {name}")
        print(f"host syncs in one call: {sum(syncs.values())}")
        for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  x{n:<4d} {where}")
        report[row] = {"tokens": t, "ms": wall, "peak_gib": peak, "first_s": first, "modules_ms": modules,
                       "kernel_ms": total, "kernels": kernels, "launches": launches,
                       "host_ops": ops, "python": hotspots, "host_syncs": syncs}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
