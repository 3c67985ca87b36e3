"""`glmkit rollout-data`: which side of the framework's saved rollout departs from the reference."""

from __future__ import annotations


from glmkit.commands.args import DTYPES, DEVICES, _backends, _backend_arguments, _finite, _dtype, _finding_command


def cmd_rollout_data(args) -> int:
    import math

    from glmkit.parity.rollout_data import attribute_file

    if not (math.isfinite(args.threshold) and args.threshold > 0 and math.isfinite(args.temperature)
            and args.temperature > 0):
        raise ValueError(f"--threshold and --temperature must be finite and > 0, got {args.threshold}, "
                         f"{args.temperature}")
    return _finding_command(args, lambda: attribute_file(
        args.path, args.checkpoint, args.train_data, device=args.device, dtype=_dtype(args.dtype),
        backends=_backends(args), threshold=args.threshold, temperature=args.temperature))


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    from glmkit.parity.rollout_data import DEFAULT_THRESHOLD

    p = sub.add_parser("rollout-data", help="the framework's saved rollout data: which side (engine or trainer) "
                                            "departs from the reference, per sample and token",
                       description="Reads a --save-debug-rollout-data file (torch.load weights_only; files that need "
                                   "pickle are refused), recomputes each sample's response log-probs through the "
                                   "transformers reference and the trainer side (glmkit's train path, or the trainer's "
                                   "own from --train-data). Exit 0: no sample departs; 1: one does; 2: bad input.")
    p.add_argument("path", help="the rollout data file (.pt)")
    p.add_argument("--checkpoint", required=True, help="the HF checkpoint the rollout ran (or its slice)")
    p.add_argument("--train-data", help="the framework's --save-debug-train-data file of one rank: the trainer's "
                                        "own log-probs replace glmkit's stand-in")
    p.add_argument("--threshold", type=_finite, default=DEFAULT_THRESHOLD,
                   help=f"a side departs when its mean |logp - reference| over a sample's response exceeds this "
                        f"(default {DEFAULT_THRESHOLD})")
    p.add_argument("--temperature", type=_finite, default=1.0, help="the run's --rollout-temperature")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    _backend_arguments(p)
    p.set_defaults(func=cmd_rollout_data)
