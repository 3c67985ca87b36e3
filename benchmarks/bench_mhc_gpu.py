"""One mHC site on one GPU: the fused entry (`mhc.enter` under fuse=on) with the Triton Sinkhorn
against the same entry with inductor's Sinkhorn loop, forward and forward+backward, same inputs.

    python benchmarks/bench_mhc_gpu.py [--tokens 512,4096,8192] [--out FILE.json]

GLM-5.3-Flash's shape: 4 streams of hidden 4096 (bf16), 20 Sinkhorn iterations. Prints, for each,
the wall time of a call (synchronised, so launch costs count as they do in a host-bound prefill),
the CUDA kernels it launches, and the ratio loop / kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def wall_ms(fn, repeat=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def kernel_count(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="512,4096,8192")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import glmkit.kernels.mhc as mhc_kernels
    from glmkit.config import variant_config
    from glmkit.kernels.fuse import fusing
    from glmkit.model import mhc

    config = variant_config("GLM-5.3-Flash-4layer")
    n, D, iters = config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters
    rows = []
    for T in map(int, args.tokens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        streams = torch.randn(T, n, D, generator=g, device="cuda", dtype=torch.bfloat16)
        fn = torch.randn(2 * n + n * n, n * D, generator=g, device="cuda") * (n * D) ** -0.5
        base, scale = 0.1 * torch.randn(2 * n + n * n, device="cuda"), torch.rand(3, device="cuda")
        norm_weight = torch.ones(D, device="cuda", dtype=torch.bfloat16)
        leaves = [t.clone().requires_grad_() for t in (streams, fn, base, scale, norm_weight)]

        def forward():
            with fusing("on"), torch.no_grad():
                return mhc.enter(streams, fn, base, scale, iters, config.hc_eps, 1e-6, norm_weight, 1e-6)

        def train():
            with fusing("on"):
                x, pre, post, comb = mhc.enter(*leaves[:4], iters, config.hc_eps, 1e-6, leaves[4], 1e-6)
            (x.float().sum() + pre.sum() + (post * comb.sum(-1)).sum()).backward()

        row = {"tokens": T, "streams": n, "hidden": D, "iters": iters}
        for label, use_kernel in (("loop", False), ("kernel", True)):
            mhc_kernels.USE_KERNEL = use_kernel  # read while tracing: a guard, so the flip recompiles
            torch._dynamo.reset()  # each (shape, form, grad mode) compiles afresh, under dynamo's recompile limit
            row[f"{label}_fwd_ms"], row[f"{label}_train_ms"] = wall_ms(forward), wall_ms(train)
            row[f"{label}_fwd_kernels"], row[f"{label}_train_kernels"] = kernel_count(forward), kernel_count(train)
        mhc_kernels.USE_KERNEL = True
        row["fwd_ratio"] = row["loop_fwd_ms"] / row["kernel_fwd_ms"]
        row["train_ratio"] = row["loop_train_ms"] / row["kernel_train_ms"]
        rows.append(row)
        print(f"T={T}: forward loop {row['loop_fwd_ms']:.3f} ms / {row['loop_fwd_kernels']} kernels, Triton "
              f"{row['kernel_fwd_ms']:.3f} ms / {row['kernel_fwd_kernels']} ({row['fwd_ratio']:.2f}x); forward+backward "
              f"loop {row['loop_train_ms']:.3f} ms / {row['loop_train_kernels']}, Triton {row['kernel_train_ms']:.3f} ms "
              f"/ {row['kernel_train_kernels']} ({row['train_ratio']:.2f}x)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
