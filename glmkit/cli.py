"""`glmkit` command line: argument parsing and calls into the library, nothing else.

Exit codes: 0 success / verdict pass, 1 verdict fail, 2 bad input (one-line reason on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def cmd_check(args) -> int:
    from glmkit import check

    settings = check.CheckSettings(checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                   variant=args.variant, seed=args.seed, decode_steps=args.decode_steps,
                                   dtype=_dtype(args.dtype), device=args.device, kda_backend=args.kda_backend)
    result = check.run_check(settings, work_dir=Path(args.out))
    html_path, json_path = check.write(result, Path(args.out))
    for c in result["checks"]:
        rel = "" if c["rel_rms"] is None else f"rel RMS {c['rel_rms']:.2e}  "
        print(f"{'ok  ' if c['pass'] else 'FAIL'} {c['name']}: {rel}max |diff| {c['max_abs']:.2e}")
    lp = result["train_rollout_logprob"]
    print(f"train vs rollout log-prob |diff|: mean {lp['mean_abs_diff']:.2e}, max {lp['max_abs_diff']:.2e} "
          f"over {lp['tokens']} tokens")
    print(f"verdict: {result['verdict']}\nreport: {html_path}\njson: {json_path}")
    return 0 if result["verdict"] == "pass" else 1


def cmd_ckpt_synth(args) -> int:
    from glmkit.checkpoint import synth_checkpoint

    out = synth_checkpoint(args.variant, args.seed, args.out, dtype=_dtype(args.dtype), overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_ckpt_slice(args) -> int:
    from glmkit.checkpoint import slice_checkpoint

    out = slice_checkpoint(args.src, args.layers, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_ckpt_info(args) -> int:
    from glmkit.checkpoint import open_checkpoint
    from glmkit.config import describe

    ckpt = open_checkpoint(args.path)
    print(f"{ckpt.path}\n  {describe(ckpt.config)}\n  {len(ckpt.text_keys())} text tensors, "
          f"{ckpt.nbytes / 2**20:.1f} MiB, {str(ckpt.dtype).replace('torch.', '')}\n  {ckpt.skipped_summary()}")
    return 0


def cmd_variants(args) -> int:
    from glmkit.config import VARIANTS, describe, variant_config

    for name in VARIANTS:
        print(f"{name:22s} {describe(variant_config(name))}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from glmkit.config import VARIANTS
    from glmkit.kernels.kda import BACKENDS

    parser = argparse.ArgumentParser(prog="glmkit", description="GLM-5.3-Flash RL bring-up kit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="train and rollout paths vs the transformers reference, with a report")
    p.add_argument("--checkpoint", help="HF checkpoint directory (default: synthesise --variant)")
    p.add_argument("--variant", default="tiny", choices=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--kda-backend", default="torch", choices=list(BACKENDS))
    p.add_argument("--out", default="reports/check", help="report directory")
    p.set_defaults(func=cmd_check)

    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(dest="ckpt_command", required=True,
                                                                          metavar="ACTION")
    p = ckpt.add_parser("synth", help="write a seeded random checkpoint that transformers loads")
    p.add_argument("--variant", required=True, choices=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_ckpt_synth)
    p = ckpt.add_parser("slice", help="the first N layers of a checkpoint (streamed, bounded memory)")
    p.add_argument("--src", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_ckpt_slice)
    p = ckpt.add_parser("info", help="validate a checkpoint and summarise it")
    p.add_argument("path")
    p.set_defaults(func=cmd_ckpt_info)

    p = sub.add_parser("variants", help="list the model variants")
    p.set_defaults(func=cmd_variants)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from glmkit.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        print(f"glmkit {args.command}: error: {err}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
