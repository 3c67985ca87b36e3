"""`glmkit check`: glmkit's paths against the transformers reference, with a report."""

from __future__ import annotations

import os
from pathlib import Path

from glmkit.commands.args import (DTYPES, DEVICES, _backends, _backend_arguments, _int_at_least, MAX_DECODE_STEPS,
                                  _seed, _dtype, _given_paths)


def cmd_check(args) -> int:
    from glmkit.outputs import RunLock, check_dir_out, removed_if_left_empty

    check_dir_out(args.out, "--out", whole=False)  # a file there is named before the lock would need the folder
    with removed_if_left_empty(args.out) as out, RunLock(out / "check", "--out", shown=args.out):  # one check at a time there
        return _check(args)


def _check(args) -> int:
    from glmkit import check
    from glmkit.outputs import check_dir_out, claim_file

    check_dir_out(args.out, "--out", whole=False)  # the report is written into it, after minutes of work
    if args.checkpoint and os.path.isdir(args.checkpoint) and os.path.isdir(args.out):
        inside = Path(os.path.realpath(args.out))
        source = Path(os.path.realpath(args.checkpoint))
        if inside == source or source in inside.parents:
            raise ValueError(f"--out {args.out} is inside --checkpoint {args.checkpoint}: the report would add files "
                             f"to the checkpoint; give another folder")
    for name in ("check.json", "check.html"):  # replaced only when an earlier check wrote them
        claim_file(Path(args.out) / name, "--out", "check report", _given_paths(args, "out"))
    if args.decode_steps < check.MIN_DECODE_STEPS:  # the decode comparison feeds steps 2.. of the greedy rollout
        raise ValueError(f"--decode-steps must be >= {check.MIN_DECODE_STEPS}, got {args.decode_steps}")
    settings = check.CheckSettings(checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                                   variant=args.variant, seed=args.seed, decode_steps=args.decode_steps,
                                   dtype=_dtype(args.dtype), device=args.device, backends=_backends(args))
    result = check.run_check(settings, work_dir=Path(args.out))
    html_path, json_path = check.write(result, Path(args.out))
    for c in result["checks"]:
        rel = "" if c["rel_rms"] is None else f"rel RMS {c['rel_rms']:.2e}  "
        print(f"{'ok  ' if c['pass'] else 'FAIL'} {c['name']}: {rel}max |diff| {c['max_abs']:.2e}")
    for r in result["selections"]:
        if not r["pass"] or r["tied"]:
            print(f"{'ok  ' if r['pass'] else 'FAIL'} DSA selections, {r['path']} layer {r['layer']}: "
                  f"{r['identical']:.1%} identical, {r['tied']:.1%} tied, {r['different']:.1%} different")
    if result["topk_replay"]:
        print(f"top-k replay: {result['topk_replay']}")
    if result["nonfinite"]:
        print(f"FAIL {result['nonfinite']}")
    lp = result["train_rollout_logprob"]
    print(f"train vs rollout log-prob |diff|: mean {lp['mean_abs_diff']:.2e}, max {lp['max_abs_diff']:.2e} "
          f"over {lp['tokens']} tokens")
    print(f"verdict: {result['verdict']}\nreport: {html_path}\njson: {json_path}")
    return 0 if result["verdict"] == "pass" else 1


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    from glmkit.config import VARIANTS

    p = sub.add_parser("check", help="train and rollout paths vs the transformers reference, with a report")
    p.add_argument("--checkpoint", help="HF checkpoint directory (default: synthesise --variant)")
    p.add_argument("--variant", default="tiny", choices=list(VARIANTS))
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--decode-steps", type=_int_at_least(2, "integer", MAX_DECODE_STEPS), default=16)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default="cpu", choices=DEVICES)
    _backend_arguments(p)
    p.add_argument("--out", default="reports/check", help="report directory")
    p.set_defaults(func=cmd_check)
