"""`glmkit kernels`: which backend runs each operator for a model on a device, and why."""

from __future__ import annotations

from glmkit.commands.args import DTYPES, DEVICES, _backends, _backend_arguments


def cmd_kernels(args) -> int:
    import torch

    from glmkit.config import variant_config
    from glmkit.model.plan import config_target

    if args.checkpoint:
        from glmkit.checkpoint import open_checkpoint

        config = open_checkpoint(args.checkpoint).config
    else:
        config = variant_config(args.variant)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    plan = _backends(args).plan(config_target(config, args.device, getattr(torch, args.dtype)))
    print(f"kernels for {args.checkpoint or args.variant} on {plan.target}:")
    print(f"  {'operator':8s} {'asked':9s}    {'runs':9s} why")
    for line in plan.explain():
        print(f"  {line}")
    print(f"compile cache: {plan.compile_cache or 'off (GLMKIT_COMPILE_CACHE); each tool uses its own default'}")
    return 0


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    from glmkit.config import VARIANTS

    p = sub.add_parser("kernels", help="which kernel backend runs each operator here, and why")
    p.add_argument("--checkpoint", help="HF checkpoint directory (its config; default: --variant)")
    p.add_argument("--variant", default="GLM-5.3-Flash", choices=list(VARIANTS))
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    _backend_arguments(p)
    p.set_defaults(func=cmd_kernels)
