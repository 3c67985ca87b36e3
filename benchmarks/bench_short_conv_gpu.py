"""KDA's short conv on one GPU: the fla backend's kernel (fla's varlen causal_conv1d) against the
torch reference fused by inductor (`fuse=on`), forward and forward+backward, same inputs.

    python benchmarks/bench_short_conv_gpu.py [--tokens 4096,32768] [--out FILE.json]

Full width: q, k and v of 64 heads x 128 (C = 8192 channels each), bf16, kernel 4, packed as
sequences of 512 tokens. Prints ms for each and the ratio torch / fla; the traffic floor is one read
and one write of q, k, v (forward) at the GPU's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.testing  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="4096,32768")
    parser.add_argument("--channels", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from glmkit.kernels.fuse import fusing
    from glmkit.kernels.kda import get_backend, naive
    from glmkit.model.packed import Packed

    fla = get_backend("fla")
    rows = []
    for T in map(int, args.tokens.split(",")):
        packed = Packed.from_lengths([512] * (T // 512), device="cuda")
        parts = [torch.randn(T, args.channels, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        weight = torch.randn(3 * args.channels, 4, device="cuda")
        offsets = (packed.positions, packed.cu_seqlens, packed.cu_seqlens_cpu())
        row = {"tokens": T, "channels": args.channels}
        for name, backend in (("torch-fused", naive), ("fla", fla)):
            def forward():
                with fusing("on"):
                    return backend.short_conv(*parts, weight, *offsets)

            leaves = [p.clone().requires_grad_() for p in parts] + [weight.clone().requires_grad_()]

            def train():
                with fusing("on"):
                    outs = backend.short_conv(*leaves, *offsets)
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

            with torch.no_grad():
                row[f"{name}_fwd_ms"] = triton.testing.do_bench(forward, rep=200)
            row[f"{name}_train_ms"] = triton.testing.do_bench(train, rep=200)
        row["fwd_ratio"] = row["torch-fused_fwd_ms"] / row["fla_fwd_ms"]
        row["train_ratio"] = row["torch-fused_train_ms"] / row["fla_train_ms"]
        row["floor_fwd_ms"] = 2 * 3 * T * args.channels * 2 / 4.3e12 * 1e3
        rows.append(row)
        print(f"T={T}: forward torch-fused {row['torch-fused_fwd_ms']:.3f} ms, fla {row['fla_fwd_ms']:.3f} ms "
              f"({row['fwd_ratio']:.2f}x; floor {row['floor_fwd_ms']:.3f}); forward+backward torch-fused "
              f"{row['torch-fused_train_ms']:.3f} ms, fla {row['fla_train_ms']:.3f} ms ({row['train_ratio']:.2f}x)",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
