"""`glmkit parity` and `glmkit capture`: two paths site by site, the first divergence named; one path's capture."""

from __future__ import annotations

from pathlib import Path

from glmkit.commands.args import (DTYPES, DEVICES, _backends, _backend_arguments, _positive, _seed, _given_paths,
                                  _json_lock)
from glmkit.report import json_safe


def _parity_table(result) -> str:
    """One line per layer: its worst value site, index-site agreement, and whether it diverged."""
    lines = [f"{'layer':>5}  {'worst site':24s} {'rel RMS':>9}  {'max |diff|':>10}  "
             f"{'top-k same / tied / diff':>26}  {'experts same / tied / diff':>28}  status"]
    layers = sorted({s.layer for s in result.sites}, key=lambda x: float("inf") if x is None else x)
    for layer in layers:
        sites = [s for s in result.sites if s.layer == layer]
        values = [s for s in sites if s.kind == "values"]
        # a site holding NaN / Inf is the worst, and shows as such (its rel RMS covers the finite part only)
        worst = max(values, key=lambda s: (bool(s.nan or s.inf), s.rel_rms)) if values else None
        index = {s.site: s for s in sites if s.kind == "indices"}

        def kinds(site):
            s = index.get(site)
            return "" if s is None else f"{s.identical:.1%} / {s.tied:.1%} / {s.different:.1%}"

        status = "DIVERGED" if any(s.diverged for s in sites) else \
            ("ok (ties)" if any(s.tied for s in index.values()) else "ok")
        rel = ("non-finite" if worst.nan or worst.inf else f"{worst.rel_rms:9.2e}") if worst else f"{0:9.2e}"
        lines.append(f"{'final' if layer is None else layer:>5}  {worst.site if worst else '':24s} "
                     f"{rel:>9}  {worst.max_abs if worst else 0:10.2e}  "
                     f"{kinds('indexer_topk'):>26}  {kinds('router_experts'):>28}  {status}")
    return "\n".join(lines)


def _thresholds(items) -> dict:
    from glmkit.inputs import ascii_float

    def cut(text: str) -> str:  # echoed in an error: a typo-sized text, not a page of digits
        return text if len(text) <= 60 else text[:57] + "..."

    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        if key not in ("rel_rms", "identical") or not value:
            raise ValueError(f"--threshold {cut(item)!r}: expected rel_rms=FLOAT or identical=FLOAT")
        try:
            number = ascii_float(value)  # ASCII digits only: float() also reads '١٠' and '1_0'
        except ValueError:
            raise ValueError(f"--threshold {cut(item)!r}: {cut(value)!r} is not a finite decimal number") from None
        if number < 0 or (key == "identical" and number > 1):
            allowed = "a fraction in 0..1" if key == "identical" else "a finite number >= 0"
            raise ValueError(f"--threshold {cut(item)!r}: {key} must be {allowed}")
        out[key] = number
    return out


def cmd_parity(args) -> int:
    with _json_lock(args):
        return _parity(args)


def _parity(args) -> int:
    import json

    from glmkit.outputs import check_dir_out, claim_file, refuse_input_as_output, write_marked
    from glmkit.parity.builtin import check_path_name, parity

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if len(paths) != 2:
        raise ValueError(f"--paths takes two paths separated by a comma, got {args.paths!r}")
    for path in paths:
        check_path_name(path)
    if paths[0] == paths[1] and not args.checkpoint_b:  # a path against itself can only pass
        raise ValueError(f"--paths {args.paths}: compares {paths[0]} with itself; give two paths, or --checkpoint-b to "
                         f"compare two checkpoints on one path")
    thresholds = _thresholds(args.threshold)
    if not any(Path(p).is_dir() for p in paths):  # generated inputs (dump folders bring their own)
        from glmkit.bounds import check_tokens_fit
        from glmkit.checkpoint import open_checkpoint

        config = open_checkpoint(args.checkpoint).config
        check_tokens_fit(config, args.batch, args.seq_len, args.device, "--batch x --seq-len",
                         paths=1 if args.streaming else 2)
        if "reference" in paths:  # its attention holds T x T scores: one sequence must fit as well
            from glmkit.bounds import check_sequence_fits

            check_sequence_fits(config, args.seq_len, args.device, "--seq-len")
    # outputs are checked before the comparison runs, not after it
    if args.json:
        claim_file(args.json, "--json", "JSON result", _given_paths(args, "json", "save_captures"), nested=True)
    if args.save_captures:  # beside the checkpoint and dumps it reads, never into them
        refuse_input_as_output(args.save_captures, "--save-captures", _given_paths(args, "json", "save_captures"),
                               nested=True)
        check_dir_out(args.save_captures, "--save-captures", whole=False)
    replay_from = None
    if args.replay_topk_from:
        from glmkit.checkpoint import open_checkpoint
        from glmkit.parity.dump import read_selections

        replay_from = read_selections(args.replay_topk_from, open_checkpoint(args.checkpoint).config)
    from glmkit.parity.framework_dump import is_framework_dump

    dumps = [is_framework_dump(p) for p in paths]
    if args.gradients and any(dumps) and not all(dumps):
        raise ValueError(f"--gradients with --paths {','.join(paths)}: gradients compare two dumps of a "
                         f"forward-backward phase, or the paths reference,train")
    if args.gradients and not any(dumps):
        from glmkit.parity.builtin import gradient_parity

        acts, params = gradient_parity(args.checkpoint, paths, args.seq_len, args.batch, args.dtype, args.device,
                                       _backends(args), thresholds, args.seed)
        result = acts
        result.parameter_gradients = params
        print(_gradient_lines(acts, params))
        if args.json:
            write_marked(args.json, json.dumps(json_safe({"gradients": acts.to_json(), "parameter_gradients": params.to_json()}),
                                               indent=2), "JSON result")
        return 0 if acts.verdict == params.verdict == "pass" else 1
    result, cap_a, cap_b = parity(args.checkpoint, paths, args.checkpoint_b, args.seq_len, args.batch, args.dtype,
                                  args.device, _backends(args), args.streaming, thresholds,
                                  args.seed, replay_topk=args.replay_topk, replay_from=replay_from,
                                  replay_from_name=args.replay_topk_from, third=args.third)
    print(f"{result.path_a} vs {result.path_b} ({result.mode}, {result.dtype}; thresholds {result.thresholds})")
    if result.topk_replay:
        print(f"top-k replay: {result.topk_replay}")
    print(_parity_table(result))
    for warning in result.warnings:
        print(f"warning: {warning}")
    if result.logprob is not None:
        print(f"logprob abs diff (train/train_rollout_logprob_abs_diff definition): {result.logprob.value:.3e}")
    first = result.first_divergence
    not_compared = f" ({len(result.skipped_sites)} sites not compared: see the warnings)" if result.skipped_sites else ""
    print(f"verdict: pass{not_compared}" if first is None else
          f"verdict: fail, first divergence at layer {first.layer}, site {first.site} "
          + (f"({first.nan} NaN and {first.inf} Inf values)" if getattr(first, "nan", 0) or getattr(first, "inf", 0)
             else f"(rel RMS {first.rel_rms}, identical {first.identical})"))
    if result.departure is not None:
        print(f"departure: {result.departure.text}")
    if args.gradients and result.gradients is None:
        raise ValueError(f"--gradients: the dumps {','.join(paths)} hold no gradients of the same sites (dump a "
                         f"forward-backward phase with --dumper-fwd-bwd enable_grad=1)")
    if result.gradients is not None or result.parameter_gradients is not None:
        print(_gradient_lines(result.gradients, result.parameter_gradients))
    if args.json:
        write_marked(args.json, json.dumps(json_safe(result.to_json()), indent=2, allow_nan=False), "JSON result")
    if args.save_captures:
        from glmkit.parity.dump import save_capture

        for tag, cap in (("a", cap_a), ("b", cap_b)):
            save_capture(cap, f"{args.save_captures}/{tag}-{cap.manifest.get('path', tag)}")
    gradients = [r for r in (result.gradients, result.parameter_gradients) if r is not None]
    return 0 if result.verdict == "pass" and all(r.verdict == "pass" for r in gradients) else 1


def _gradient_lines(acts, params) -> str:
    """The gradient verdicts, first divergence in the backward order."""
    lines = []
    for label, r in (("activation gradients", acts), ("parameter gradients", params)):
        if r is None:
            continue
        f = r.first_divergence
        lines.append(f"{label}: {len(r.sites)} compared, {len(r.skipped_sites)} skipped; " +
                     ("pass" if f is None else f"fail, first divergence in the backward order at layer {f.layer} "
                                               f"{f.site} (rel RMS {f.rel_rms:.3e})"))
        lines += [f"  {w}" for w in r.warnings[:1]]
        if r.departure is not None:
            lines.append(f"  departure: {r.departure.text}")
        lines += [f"  warning: {w}" for w in r.warnings[1:] if w.startswith("no third path")]
    return "\n".join(lines)


def cmd_capture(args) -> int:
    import torch

    from glmkit.checkpoint import open_checkpoint
    from glmkit.parity.builtin import capture_path, make_inputs
    from glmkit.parity.dump import check_capture_out, save_capture

    if args.path not in ("reference", "train", "rollout"):
        raise ValueError(f"unknown path {args.path!r}; allowed: reference, train, rollout")
    check_capture_out(args.out, "--out")  # before the model runs
    from glmkit.bounds import check_tokens_fit

    config = open_checkpoint(args.checkpoint).config
    check_tokens_fit(config, args.batch, args.seq_len, args.device, "--batch x --seq-len", paths=1)
    if args.path == "reference":  # its attention holds T x T scores: one sequence must fit as well
        from glmkit.bounds import check_sequence_fits

        check_sequence_fits(config, args.seq_len, args.device, "--seq-len")
    seqs, prompts = make_inputs(config.vocab_size, args.batch, args.seq_len, args.seed)
    cap = capture_path(args.path, args.checkpoint, seqs, prompts, getattr(torch, args.dtype), args.device,
                       _backends(args))
    print(f"wrote {save_capture(cap, args.out)}")
    return 0


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    def run_arguments(p):
        """The seeded input and where the paths run: shared by parity and capture."""
        p.add_argument("--seq-len", type=_positive, default=64)
        p.add_argument("--batch", type=_positive, default=2)
        p.add_argument("--seed", type=_seed, default=0)
        p.add_argument("--dtype", default="float32", choices=list(DTYPES))
        p.add_argument("--device", default="cpu", choices=DEVICES)
        _backend_arguments(p)

    p = sub.add_parser("parity", help="compare two paths site by site and name the first divergence")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory")
    p.add_argument("--checkpoint-b", help="load the second path from this checkpoint instead")
    p.add_argument("--paths", default="reference,train",
                   help="two of reference, train, rollout, sglang:http://HOST:PORT (a server speaking SGLang's "
                        "native API, teacher-forced), a capture directory or a framework dump directory (SGLang's "
                        "dumper: an engines/ folder, or a trainer phase folder such as fwd_bwd/rollout_0), "
                        "comma-separated")
    run_arguments(p)
    p.add_argument("--replay-topk", default="auto", choices=["auto", "on", "off"],
                   help="path B uses path A's DSA selections (auto: when A is the reference or a capture and "
                        "rows differed only by ties)")
    p.add_argument("--replay-topk-from", metavar="FILE",
                   help="replay these per-token DSA selections into both paths: .safetensors (key indexer_topk) "
                        "or .npy, int32 [tokens, DSA layers, k], sequence-local positions, -1 empty")
    p.add_argument("--streaming", action="store_true",
                   help="layer by layer from the files, each layer fed the reference's input (reference,train)")
    p.add_argument("--threshold", action="append", metavar="NAME=VALUE",
                   help="override a default threshold: rel_rms=1e-4, identical=0.99")
    p.add_argument("--third", default="reference", choices=["reference", "train", "none"],
                   help="with two dump directories: the path each side is compared with, run on the checkpoint on "
                        "the dumps' tokens, to name the side that departs first (none: the two sides only)")
    p.add_argument("--gradients", action="store_true",
                   help="compare gradients of the paths reference,train (next-token cross-entropy), per site and "
                        "parameter, first divergence in the backward order (dumps of a forward-backward phase are "
                        "compared on their gradients without this flag)")
    p.add_argument("--json", help="write the result as JSON here")
    p.add_argument("--save-captures", metavar="DIR", help="also write both captures (dump format) under DIR")
    p.set_defaults(func=cmd_parity)

    p = sub.add_parser("capture", help="run one path and write its capture (dump format)")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--path", required=True, help="reference, train or rollout")
    p.add_argument("--out", required=True)
    run_arguments(p)
    p.set_defaults(func=cmd_capture)
