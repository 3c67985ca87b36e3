"""`glmkit ckpt synth / slice / info / verify-conversion / verify-engine` and `glmkit variants`."""

from __future__ import annotations


from glmkit.commands.args import (DTYPES, DEVICES, _finite, _positive, _integer, _seed, _non_negative, _dtype,
                                  _finding_command)


def cmd_ckpt_synth(args) -> int:
    from glmkit.checkpoint import synth_checkpoint
    from glmkit.outputs import check_dir_out

    from glmkit.outputs import RunLock, refuse_package_paths

    refuse_package_paths(args.out, "--out")
    check_dir_out(args.out, "--out", args.overwrite)
    with RunLock(args.out, "--out"):
        out = synth_checkpoint(args.variant, args.seed, args.out, dtype=_dtype(args.dtype), overwrite=args.overwrite,
                               device=args.device)
    print(f"wrote {out}")
    return 0


def cmd_ckpt_slice(args) -> int:
    from glmkit.checkpoint import open_checkpoint, slice_checkpoint
    from glmkit.outputs import check_dir_out

    source = open_checkpoint(args.src)  # headers only: a bad --src is named first
    from glmkit.outputs import RunLock, refuse_input_as_output, refuse_package_paths

    refuse_package_paths(args.out, "--out")
    refuse_input_as_output(args.out, "--out", {"--src": args.src}, nested=True)  # never replaces, nor goes into, its input
    check_dir_out(args.out, "--out", args.overwrite)
    with RunLock(args.out, "--out"):
        out = slice_checkpoint(source, args.layers, args.out, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_ckpt_info(args) -> int:
    from glmkit.checkpoint import open_checkpoint
    from glmkit.config import describe

    ckpt = open_checkpoint(args.path)
    print(f"{ckpt.path}\n  {describe(ckpt.config)}\n  {len(ckpt.text_keys())} text tensors, "
          f"{ckpt.nbytes / 2**20:.1f} MiB, {str(ckpt.dtype).replace('torch.', '')}\n  {ckpt.skipped_summary()}")
    return 0


def cmd_ckpt_verify_conversion(args) -> int:
    from glmkit.checkpoint.conversion import verify_conversion

    if not (args.atol >= 0 and args.atol != float("inf")):  # NaN fails the first test
        raise ValueError(f"--atol: must be >= 0, got {args.atol}")
    return _finding_command(args, lambda: verify_conversion(args.hf, args.torch_dist, atol=args.atol))


def cmd_ckpt_verify_engine(args) -> int:
    from glmkit.serve.weights import verify_engine

    return _finding_command(args, lambda: verify_engine(args.hf, args.url, sample=args.sample, rows=args.rows,
                                                        seed=args.seed))


def cmd_variants(args) -> int:
    from glmkit.config import VARIANTS, describe, variant_config

    for name in VARIANTS:
        print(f"{name:22s} {describe(variant_config(name))}")
    return 0


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    from glmkit.config import VARIANTS

    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(dest="ckpt_command", required=True,
                                                                          metavar="ACTION")
    p = ckpt.add_parser("synth", help="write a seeded random checkpoint that transformers loads")
    p.add_argument("--variant", required=True, choices=list(VARIANTS))
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="where the random numbers are drawn (cuda: much faster at full width, other values)")
    p.set_defaults(func=cmd_ckpt_synth)
    p = ckpt.add_parser("slice", help="the first N layers of a checkpoint (streamed, bounded memory)")
    p.add_argument("--src", required=True)
    p.add_argument("--layers", type=_integer, default=4)
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_ckpt_slice)
    p = ckpt.add_parser("info", help="validate a checkpoint and summarise it")
    p.add_argument("path")
    p.set_defaults(func=cmd_ckpt_info)
    p = ckpt.add_parser("verify-conversion", help="check a Megatron torch_dist checkpoint against the HF checkpoint "
                                                  "it was converted from (the framework's glm5_next name map)",
                        description="Exit 0: every tensor matches; 1: missing, extra, mis-shaped, differing or "
                                    "narrowed tensors (each named, with a likely cause where one is recognised); "
                                    "2: unreadable input.")
    p.add_argument("--hf", required=True, help="the HF checkpoint folder (safetensors)")
    p.add_argument("--torch-dist", required=True,
                   help="the torch_dist save folder (with latest_checkpointed_iteration.txt) or an iteration folder")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--atol", type=_finite, default=0.0,
                   help="allowed |difference| after casting to the stored dtype (default 0: a conversion is a copy)")
    p.set_defaults(func=cmd_ckpt_verify_conversion)
    p = ckpt.add_parser("verify-engine", help="ask a running SGLang-protocol server for tensors by name "
                                              "(/get_weights_by_name) and compare them with a checkpoint",
                        description="Exit 0: every tensor asked for matches (exactly, or rounded to the engine's "
                                    "bfloat16 / float16); 1: some differ, are mis-shaped or were not answered; "
                                    "2: bad input, or an engine that is unreachable or answers for none.")
    p.add_argument("--hf", required=True, help="the HF checkpoint folder the engine should hold")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("--sample", type=_non_negative, default=64,
                   help="how many tensors to compare (embedding, final norm and head always among them); 0: all")
    p.add_argument("--rows", type=_positive, default=100, help="leading rows of each tensor (SGLang's truncate_size)")
    p.add_argument("--seed", type=_seed, default=0, help="which tensors --sample draws")
    p.add_argument("--json", help="write the result as JSON here")
    p.set_defaults(func=cmd_ckpt_verify_engine)

    p = sub.add_parser("variants", help="list the model variants")
    p.set_defaults(func=cmd_variants)
