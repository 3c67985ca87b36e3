"""`glmkit` command line: argument parsing and calls into the library, nothing else.

Exit codes: 0 success / verdict pass, 1 verdict fail, 2 bad input (the reason on stderr: one line naming the
file, tensor or flag, then any detail lines the library gave, at most MAX_ERROR_LINES).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from glmkit.inputs import ascii_float, ascii_int

DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}
DEVICES = ["cpu", "cuda"]
MAX_ERROR_LINES = 14  # a checkpoint error lists 10 tensors, a header and a count; longer reasons are cut


def _backends(args):
    """The one Backends value of a run, from --kda-backend / --dsa-backend / --moe-backend / --fuse."""
    from glmkit.kernels.backends import Backends

    return Backends(kda=args.kda_backend, dsa=args.dsa_backend, moe=args.moe_backend, fuse=args.fuse)


def _backend_arguments(p):
    from glmkit.kernels.backends import DSA_BACKENDS, FUSE_MODES, KDA_BACKENDS, MOE_BACKENDS, Backends

    default = Backends()
    p.add_argument("--kda-backend", default=default.kda, choices=list(KDA_BACKENDS),
                   help="KDA kernels: torch (reference) or fla (CUDA)")
    p.add_argument("--dsa-backend", default=default.dsa, choices=list(DSA_BACKENDS),
                   help="sparse MLA for full sequences: naive (reference), absorbed, triton (CUDA) or auto")
    p.add_argument("--moe-backend", default=default.moe, choices=list(MOE_BACKENDS),
                   help="routed experts: loop (reference), grouped (torch._grouped_mm, CUDA bf16) or auto")
    p.add_argument("--fuse", default=default.fuse, choices=list(FUSE_MODES),
                   help="fused elementwise kernels (torch.compile): auto (on CUDA), on, off (eager reference)")


def _int_at_least(least: int, name: str, most: int | None = None):
    """An argparse type: an int >= `least` (and <= `most`); `name` is what argparse calls a value it
    cannot parse."""
    def parse(text: str) -> int:
        value = ascii_int(text)
        if value < least or (most is not None and value > most):
            bound = f"in {least}..{most}" if most is not None else f">= {least}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    parse.__name__ = name
    return parse


def _finite(text: str) -> float:
    try:
        return ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}") from None


_finite.__name__ = "finite number"


def _finite_positive(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


_finite_positive.__name__ = "positive number"
MAX_LORA_RANK = 1 << 16  # far above any projection's smaller side; past it the adapter sizes overflow
MAX_DECODE_STEPS = 1 << 16


_positive = _int_at_least(1, "positive integer")
_integer = _int_at_least(-(1 << 63), "integer")
# torch and numpy seed from a signed 64-bit int; a larger seed fails deep inside a run
_seed = _int_at_least(0, "seed", (1 << 63) - 1)
_non_negative = _int_at_least(0, "non-negative integer")


def _gpu_fraction(text: str) -> float:
    """An argparse type: a GPU share in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


_gpu_fraction.__name__ = "GPU fraction"


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def cmd_check(args) -> int:
    from glmkit.outputs import RunLock, check_dir_out, removed_if_left_empty

    check_dir_out(args.out, "--out", whole=False)  # a file there is named before the lock would need the folder
    with removed_if_left_empty(args.out) as out, RunLock(out / "check", "--out"):  # one check at a time there
        return _check(args)


def _check(args) -> int:
    from glmkit import check
    from glmkit.outputs import check_dir_out, claim_file

    check_dir_out(args.out, "--out", whole=False)  # the report is written into it, after minutes of work
    for name in ("check.json", "check.html"):  # replaced only when an earlier check wrote them
        claim_file(Path(args.out) / name, "--out", "check report", _given_paths(args, "out"))
    if args.decode_steps < 2:  # the decode comparison feeds steps 2.. of the greedy rollout
        raise ValueError(f"--decode-steps must be >= 2, got {args.decode_steps}")
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
    lp = result["train_rollout_logprob"]
    print(f"train vs rollout log-prob |diff|: mean {lp['mean_abs_diff']:.2e}, max {lp['max_abs_diff']:.2e} "
          f"over {lp['tokens']} tokens")
    print(f"verdict: {result['verdict']}\nreport: {html_path}\njson: {json_path}")
    return 0 if result["verdict"] == "pass" else 1


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
    import math

    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        if key not in ("rel_rms", "identical") or not value:
            raise ValueError(f"--threshold {item!r}: expected rel_rms=FLOAT or identical=FLOAT")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--threshold {item!r}: {value!r} is not a number") from None
        if not math.isfinite(number) or number < 0 or (key == "identical" and number > 1):
            allowed = "a fraction in 0..1" if key == "identical" else "a finite number >= 0"
            raise ValueError(f"--threshold {item!r}: {key} must be {allowed}")
        out[key] = number
    return out


def _given_paths(args, *outputs: str) -> dict:
    """The command's arguments that name something on disk (its inputs), by flag; `outputs` (argument
    names) left out. --paths' comma-separated entries count one by one."""
    found = {}
    for name, value in vars(args).items():
        if name in outputs or name == "func":
            continue
        values = value.split(",") if name == "paths" and isinstance(value, str) else \
            value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str) and v.strip() and os.path.exists(v.strip()):
                found[f"--{name.replace('_', '-')}" + (f" {v.strip()}" if len(values) > 1 else "")] = v.strip()
    return found


def _json_lock(args):
    """The --json file's lock while the command runs (nothing when no --json is given)."""
    import contextlib

    from glmkit.outputs import RunLock

    return RunLock(args.json, "--json") if getattr(args, "json", None) else contextlib.nullcontext()


def cmd_parity(args) -> int:
    with _json_lock(args):
        return _parity(args)


def _parity(args) -> int:
    import json

    from glmkit.outputs import check_dir_out, claim_file, write_marked
    from glmkit.parity.builtin import parity

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if len(paths) != 2:
        raise ValueError(f"--paths takes two paths separated by a comma, got {args.paths!r}")
    thresholds = _thresholds(args.threshold)
    if not any(Path(p).is_dir() for p in paths):  # generated inputs (dump folders bring their own)
        from glmkit.bounds import check_tokens_fit
        from glmkit.checkpoint import open_checkpoint

        check_tokens_fit(open_checkpoint(args.checkpoint).config, args.batch, args.seq_len, args.device,
                         "--batch x --seq-len", paths=1 if args.streaming else 2)
    # outputs are checked before the comparison runs, not after it
    if args.json:
        claim_file(args.json, "--json", "JSON result", _given_paths(args, "json", "save_captures"))
    if args.save_captures:
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
            write_marked(args.json, json.dumps({"gradients": acts.to_json(), "parameter_gradients": params.to_json()},
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
        write_marked(args.json, json.dumps(result.to_json(), indent=2), "JSON result")
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
    seqs, prompts = make_inputs(config.vocab_size, args.batch, args.seq_len, args.seed)
    cap = capture_path(args.path, args.checkpoint, seqs, prompts, getattr(torch, args.dtype), args.device,
                       _backends(args))
    print(f"wrote {save_capture(cap, args.out)}")
    return 0


def _train_config(args):
    from dataclasses import fields

    from glmkit.rl.loop import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(args).items() if k in names}, backends=str(_backends(args)))


def cmd_train(args) -> int:
    from glmkit.rl.health import format_table, verdicts
    from glmkit.rl.loop import GRPOTrainer

    from glmkit.rl.health import run_verdict
    from glmkit.rl.loop import NonFiniteRun, rollout_rows

    rollout = None
    if args.data_parallel and args.rollout_url and args.weight_update == "distributed":  # every rank stops here
        raise SystemExit("glmkit train: --data-parallel and --weight-update distributed both need this process's "
                         "torch.distributed group; use --weight-update tensor or disk with --data-parallel")
    # under data parallelism rank 0 alone rolls out: the other ranks build no client (torchrun sets RANK)
    lead = not args.data_parallel or os.environ.get("RANK", "0") == "0"
    if args.rollout_url and lead:
        from glmkit.serve.client import SGLangRollout

        rollout = SGLangRollout(args.rollout_url, mode=args.weight_update, update_dir=args.weight_update_dir,
                                master=args.weight_update_master)
        rollout.client.health()  # an unreachable server fails here, before the model loads
    trainer = GRPOTrainer(_train_config(args), rollout=rollout)
    cfg = trainer.cfg
    for note in trainer.notes:
        print(note)
    if trainer.problems and trainer.lead:
        print(f"{cfg.prompt_data}: skipped {len(trainer.problems)} malformed rows (first: {trainer.problems[0]})",
              file=sys.stderr)
    if trainer.lora_names and trainer.lead:
        print(f"LoRA rank {cfg.lora_rank}: {len(trainer.lora_names)} projections adapted, "
              f"{sum(p.numel() for p in trainer.trainable)} trainable parameters")
    stopped, history = None, []
    try:
        trainer.run(on_metrics=history.append)  # rows kept as they come, so a stopped run still reports
    except NonFiniteRun as err:
        stopped = str(err)
        print(f"glmkit train: {stopped}", file=sys.stderr)
    finally:
        if trainer.dp is not None:
            trainer.dp.close()
    if not trainer.lead:  # rank 0 reports for the data-parallel group
        return 1 if stopped is not None else 0
    rollouts = rollout_rows(history)
    first, last = rollouts[0] if rollouts else {}, rollouts[-1] if rollouts else {}
    print(f"rollouts {len(rollouts)}: raw_reward {first.get('rollout/raw_reward', float('nan')):.3f} -> "
          f"{last.get('rollout/raw_reward', float('nan')):.3f}; metrics: {cfg.metrics_out}")
    print(format_table(verdicts(history, cfg.model_name)))
    result = run_verdict(history, cfg.model_name)
    _print_verdict("run verdict", result)
    if stopped is not None:
        return 1
    return 1 if args.fail_unhealthy and result["verdict"] != "pass" else 0


def cmd_lora_prepare(args) -> int:
    import torch

    from glmkit.model import Glm5Model
    from glmkit.rl import lora
    from glmkit.rl.loop import PRESETS

    from glmkit.checkpoint import open_checkpoint
    from glmkit.config import variant_config

    # the checkpoint's own config when there is one (tiny: the shipped start), else the variant's
    checkpoint = args.checkpoint or PRESETS[args.model_name].get("checkpoint")
    config = open_checkpoint(checkpoint).config if checkpoint else variant_config(args.model_name)
    with torch.device("meta"):
        model = Glm5Model(config)
    names = lora.select(model, args.target_modules, args.exclude_modules)
    for row in lora.table(model, names):
        print(f"{row['module']:48s} {row['layer_type']:4s} {str(row['shape']):14s} "
              f"rank-{args.lora_rank} adapter: {args.lora_rank * sum(row['shape'])} params")
    print(f"{len(names)} projections adapted; frozen: routed experts, kv_b_proj, KDA conv1d / A_log / dt_bias / "
          f"o_norm, the DSA indexer, the router and the mHC parameters")
    return 0


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
    refuse_input_as_output(args.out, "--out", {"--src": args.src})  # an output never replaces its own input
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


def _finding_command(args, run) -> int:
    """A check of the user's artefacts: `run()` -> a result with text(), to_json() and verdict; printed,
    written to --json (strict JSON, atomically), exit 0 on pass and 1 on a finding."""
    import json

    from glmkit.outputs import claim_file, write_marked
    from glmkit.report import json_safe

    with _json_lock(args):
        if args.json:
            claim_file(args.json, "--json", "JSON result", _given_paths(args, "json"))  # before any work
        result = run()
        print(result.text())
        if args.json:
            write_marked(args.json, json.dumps(json_safe(result.to_json()), indent=2), "JSON result")
    return 0 if result.verdict == "pass" else 1


def cmd_ckpt_verify_conversion(args) -> int:
    from glmkit.checkpoint.conversion import verify_conversion

    if not (args.atol >= 0 and args.atol != float("inf")):  # NaN fails the first test
        raise ValueError(f"--atol: must be >= 0, got {args.atol}")
    return _finding_command(args, lambda: verify_conversion(args.hf, args.torch_dist, atol=args.atol))


def cmd_ckpt_verify_engine(args) -> int:
    from glmkit.serve.weights import verify_engine

    return _finding_command(args, lambda: verify_engine(args.hf, args.url, sample=args.sample, rows=args.rows,
                                                        seed=args.seed))


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


def _launcher_options(args) -> dict:
    """The launcher options given on the command line (field -> value), by the launcher's own names."""
    from glmkit.launch.launcher import ALL_FIELDS

    return {f: getattr(args, f) for f in ALL_FIELDS if getattr(args, f, None) is not None}


def cmd_launch(args) -> int:
    """Plan (and with --address / --local-head, run, re-attach or stop) a launch; see glmkit.launch."""
    import json as _json

    from glmkit.launch import plan
    from glmkit.launch.run import launch_verdict, open_cluster, run_miles

    if args.stop:
        return _launch_stop(args)
    if args.attach:
        return _launch_attach(args)
    if args.backend == "builtin":
        return _launch_builtin(args)
    given = _launcher_options(args)
    model = given.pop("model_name", None)
    if model == "tiny":
        raise ValueError("--model-name tiny is the builtin backend's preset; the recipe's launcher takes "
                         "GLM-5.3-Flash or GLM-5.3-Flash-4layer")
    launch = plan(model, lora=args.lora, prompt_data=args.prompt_data, input_key=args.input_key,
                  label_key=args.label_key, gpu_mem_gib=args.gpu_memory_gib, max_tokens_per_gpu=args.max_tokens_per_gpu,
                  first_stage_layers=args.decoder_first_pipeline_num_layers,
                  last_stage_layers=args.decoder_last_pipeline_num_layers, options=given,
                  hf_checkpoint=given.pop("hf_checkpoint", None), ckpt_dir=given.pop("ckpt_dir", None),
                  inventory=_inventory_or_none(args.address), miles_dir=args.miles_dir)
    print(_json.dumps(launch.as_dict(), indent=2) if args.json else launch.text())
    if args.dry_run or not (args.address or args.local_head):
        if not args.dry_run and not args.json:
            print("(no --address: nothing submitted)")
        return 0 if launch.ok else 1
    if not launch.ok:
        print("glmkit launch: preflight failed; nothing submitted", file=sys.stderr)
        return 1
    with open_cluster(args.address if not args.local_head else None) as cluster:
        result = run_miles(cluster, launch, args.run_name, reattach=args.reattach, metrics_out=args.metrics_out,
                           on_log=lambda t: print(t, end=""), on_job=lambda j: print(_following(cluster, j)),
                           on_training_job=lambda j: print(f"training job {j} (the launcher's)"))
    print(result.summary())
    verdict = launch_verdict(result, launch)
    _print_verdict("verdict", verdict)
    return 0 if verdict["verdict"] == "pass" else 1


def _print_verdict(label: str, verdict: dict) -> None:
    print(f"{label}: {verdict['verdict']}" + "".join(f"\n  - {r}" for r in verdict["reasons"]))


def _following(cluster, job) -> str:
    if cluster.head is not None:
        return f"job {job} on {cluster.address}; following (the head is this command's: Ctrl-C stops the run)"
    return f"job {job} on {cluster.address}; following (Ctrl-C stops following, not the job; --stop stops it)"


def _launch_attach(args) -> int:
    from glmkit.launch.cluster import connect
    from glmkit.launch.run import Cluster, attach, launch_verdict

    if not args.address:
        raise ValueError("--attach needs --address http://HOST:8265 (the cluster the run is on)")
    result = attach(Cluster(args.address, connect(args.address)), args.run_name, metrics_out=args.metrics_out,
                    on_log=lambda t: print(t, end=""),
                    on_training_job=lambda j: print(f"training job {j} (the launcher's)"))
    if result is None:
        print(f"no job of {args.run_name!r} on {args.address}", file=sys.stderr)
        return 1
    print(result.summary())
    verdict = launch_verdict(result)
    _print_verdict("verdict", verdict)
    return 0 if verdict["verdict"] == "pass" else 1


def _inventory_or_none(address):
    from glmkit.launch.cluster import inventory

    return inventory(address) if address and address.startswith("http") else None


def _launch_stop(args) -> int:
    from glmkit.launch.cluster import connect
    from glmkit.launch.run import Cluster, stop_run

    if not args.address:
        raise ValueError("--stop needs --address http://HOST:8265 (the cluster the run is on)")
    status = stop_run(Cluster(args.address, connect(args.address)), args.run_name)
    print(f"no running job of {args.run_name!r}" if status is None else f"{args.run_name}: {status.lower()}")
    return 0 if status is not None else 1


def _launch_builtin(args) -> int:
    import json as _json

    from glmkit.launch.run import launch_verdict, open_cluster, run_builtin
    from glmkit.rl.health import run_verdict

    if not args.address and not args.local_head:
        raise ValueError("--backend builtin needs --address http://HOST:8265 or --local-head")
    if args.bundle_gpu != 1 and args.device != "cuda":
        raise ValueError(f"--bundle-gpu {args.bundle_gpu} is a share of a GPU: it needs --device cuda")
    model = args.model_name or "tiny"
    fields = {"model_name": model, "checkpoint": args.checkpoint, "prompt_data": args.prompt_data,
              "num_rollout": args.num_rollout or 20, "rollout_batch_size": args.rollout_batch_size,
              "n_samples_per_prompt": args.n_samples_per_prompt or 8, "global_batch_size": args.global_batch_size,
              "rollout_max_response_len": args.rollout_max_response_len, "enable_r3": bool(args.enable_r3),
              "device": args.device, "dtype": args.dtype, "seed": args.seed, "lora_rank": args.lora_rank or 0,
              "metrics_out": args.job_metrics_out or str(Path(args.metrics_out).resolve()) + ".job", "overwrite": True}
    fields = {k: v for k, v in fields.items() if v is not None}
    from glmkit.launch import jobs
    from glmkit.rl.loop import TrainConfig

    TrainConfig(**fields).resolved()  # a bad config fails here, before any cluster work
    if args.dry_run:
        print(jobs.builtin_entrypoint(fields, args.rollout_actors, args.device == "cuda", trainers=args.trainers,
                                      bundle_gpu=args.bundle_gpu))
        return 0
    # a local head advertises a logical CPU per bundle the run asks for (a smoke run, not a benchmark)
    with open_cluster(None if args.local_head else args.address,
                      num_cpus=max(2, args.rollout_actors + args.trainers)) as cluster:
        result = run_builtin(cluster, fields, args.run_name, rollout_actors=args.rollout_actors,
                             trainers=args.trainers, gpus=args.device == "cuda", bundle_gpu=args.bundle_gpu,
                             reattach=args.reattach, metrics_out=args.metrics_out,
                             on_job=lambda j: print(_following(cluster, j)),
                             on_rows=lambda rows: [print(_json.dumps(r)) for r in rows
                                                   if "rollout/step" in r and "train/step" not in r])
    print(result.summary())
    verdict = launch_verdict(result)
    _print_verdict("verdict", verdict)
    if result.ok:
        health = run_verdict(result.rows, model)
        _print_verdict("run verdict", health)
    return 0 if verdict["verdict"] == "pass" else 1


def cmd_serve(args) -> int:
    from glmkit.serve.server import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for root in args.allow_updates_from:
        if not Path(root).is_dir():
            raise FileNotFoundError(f"--allow-updates-from {root}: not a directory")
    if args.max_context < 2:
        raise ValueError(f"--max-context must be >= 2, got {args.max_context}")
    serve(args.checkpoint, args.host, args.port, args.device, args.dtype, _backends(args), args.tokenizer,
          args.max_batch_size, args.allow_updates_from, on_ready=lambda line: print(line, flush=True),
          max_context=args.max_context, prefill_chunk=args.prefill_chunk, max_body=args.max_body_bytes,
          max_weights_body=args.max_weights_body_bytes, body_timeout_s=args.body_timeout_s,
          served_model_name=args.served_model_name, enable_memory_saver=args.enable_memory_saver,
          seed=args.random_seed, base_gpu_id=args.base_gpu_id, max_prefill_tokens=args.max_prefill_tokens)
    return 0


def cmd_variants(args) -> int:
    from glmkit.config import VARIANTS, describe, variant_config

    for name in VARIANTS:
        print(f"{name:22s} {describe(variant_config(name))}")
    return 0


def _launcher_arguments(p) -> None:
    """Every option of the recipe's two launchers, by its own name (default None: the launcher's own
    default applies); the builtin backend reads the ones it shares (num-rollout, batch sizes, ...)."""
    from glmkit.launch.launcher import ALL_FIELDS, option_spec

    types = {"int": int, "float": float, "str": str}
    for field in ALL_FIELDS:
        option = option_spec(field)
        default = "" if option.default in (None, "") else f" (launcher default {option.default})"
        text = (option.help + default) if option.help else default.strip(" ()") or None
        if field == "model_name":
            p.add_argument(option.flag, dest=field, choices=[*option.choices, "tiny"],
                           help="GLM-5.3-Flash or GLM-5.3-Flash-4layer (launcher default); builtin: also tiny")
        elif option.kind == "bool":
            p.add_argument(option.flag, dest=field, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif option.kind == "choice":
            p.add_argument(option.flag, dest=field, choices=list(option.choices), help=text)
        elif option.kind == "list":
            p.add_argument(option.flag, dest=field, action="append", help=text)
        else:
            p.add_argument(option.flag, dest=field, type=types[option.kind], help=text)
    # the names glmkit used before it took the launcher's own
    p.add_argument("--nodes", dest="num_nodes", type=_positive, help=argparse.SUPPRESS)
    p.add_argument("--gpus-per-node", dest="num_gpus_per_node", type=_positive, help=argparse.SUPPRESS)


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: the command (subcommands included) and the reason,
    and where the usage is, instead of the whole usage block. Subparsers are of this class too."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from glmkit.config import VARIANTS

    parser = _Parser(prog="glmkit", description="GLM-5.3-Flash RL bring-up kit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    def train_arguments(p, lora_required=False):
        from glmkit.rl.lora import DEFAULT_EXCLUDE
        from glmkit.rl.loop import PRESETS

        p.add_argument("--model-name", default="tiny", choices=list(PRESETS))
        p.add_argument("--checkpoint", help="HF checkpoint directory (tiny: the shipped starting checkpoint)")
        p.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's own files)")
        p.add_argument("--prompt-data", help="jsonl with chat prompts and labels (tiny: shipped synthetic arithmetic)")
        p.add_argument("--input-key", default="prompt")
        p.add_argument("--label-key", default="label")
        p.add_argument("--rm-type", default="deepscaler", choices=["deepscaler", "math", "dapo"])
        p.add_argument("--on-bad-row", default="skip", choices=["skip", "raise"])
        p.add_argument("--prompt-pool", type=_positive,
                       help="train on the first N prompts of the shuffled data only (tiny preset: 32)")
        p.add_argument("--num-rollout", type=_positive, default=20)
        p.add_argument("--rollout-batch-size", type=_positive, help="prompts per rollout (recipe 8; tiny preset 16)")
        p.add_argument("--n-samples-per-prompt", type=_positive, default=8)
        p.add_argument("--global-batch-size", type=_positive, help="samples per optimizer step (recipe 64; tiny 32)")
        p.add_argument("--rollout-max-response-len", type=_integer)
        p.add_argument("--rollout-temperature", type=_finite, default=1.0)
        p.add_argument("--rollout-top-p", type=_finite, default=1.0)
        p.add_argument("--lr", type=_finite, help="Adam learning rate (recipe: 1e-6; the tiny preset: 2e-4)")
        p.add_argument("--eps-clip", type=_finite, default=0.2)
        p.add_argument("--eps-clip-high", type=_finite, default=0.28)
        p.add_argument("--kl-loss-coef", type=_finite, default=0.0)
        p.add_argument("--kl-loss-type", default="low_var_kl", choices=["k1", "k2", "k3", "low_var_kl"])
        p.add_argument("--entropy-coef", type=_finite, default=0.0)
        p.add_argument("--enable-r3", action="store_true", help="routing replay: the trainer uses the rollout's experts")
        p.add_argument("--use-rollout-indexer-replay", action="store_true",
                       help="DSA top-k replay: the trainer attends over the positions the rollout selected")
        # glmkit lora train: rank >= 1 (rank 0 would train every weight); glmkit train: 0 = full weights
        p.add_argument("--lora-rank", type=_int_at_least(1 if lora_required else 0, "integer", MAX_LORA_RANK),
                       default=8 if lora_required else 0)
        p.add_argument("--lora-alpha", type=_finite, default=16.0)
        p.add_argument("--target-modules", default="attn,mlp")
        p.add_argument("--exclude-modules", default=DEFAULT_EXCLUDE)
        p.add_argument("--device", default="cpu", choices=DEVICES)
        p.add_argument("--dtype", default="float32", choices=list(DTYPES))
        _backend_arguments(p)
        p.add_argument("--seed", type=_seed, default=0)
        p.add_argument("--data-parallel", default="", choices=["gloo", "nccl"],
                       help="this process is one rank of a data-parallel trainer started by torchrun "
                            "(torchrun --nproc-per-node N -m glmkit train --data-parallel nccl ...); rank 0 rolls "
                            "out and writes the metrics")
        p.add_argument("--metrics-out", default="reports/train/metrics.jsonl")
        p.add_argument("--save", help="checkpoint directory")
        p.add_argument("--save-interval", type=_integer, default=0,
                       help="save every N rollouts (default with --save: once, after the last rollout)")
        p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --save "
                       "(its recorded settings must match; see --accept-changes)")
        p.add_argument("--accept-changes", default="", metavar="NAMES",
                       help="with --resume: settings (comma-separated, e.g. lr,seed) that may differ from the run's")
        p.add_argument("--overwrite", action="store_true",
                       help="start over an earlier run's --metrics-out and --save checkpoints (default: refuse)")
        p.add_argument("--max-nonfinite-steps", type=_positive, default=3,
                       help="stop after this many optimizer steps in a row with a NaN / Inf loss or grad norm")
        p.add_argument("--fail-unhealthy", action="store_true",
                       help="exit 1 when the run verdict is fail (reasons printed)")
        p.add_argument("--rollout-url", metavar="URL",
                       help="generate on a server speaking SGLang's native API (an SGLang server or glmkit serve) "
                            "instead of in this process; weights are pushed to it after every optimizer step")
        p.add_argument("--weight-update", default="tensor", choices=["tensor", "disk", "distributed"],
                       help="with --rollout-url: push weights in the request (tensor), as a directory (disk), or "
                            "broadcast over a weights-update process group (distributed: gloo / nccl)")
        p.add_argument("--weight-update-master", metavar="HOST:PORT",
                       help="with --weight-update distributed: the rendezvous address (this process is rank 0)")
        p.add_argument("--weight-update-dir", metavar="DIR",
                       help="with --weight-update disk: where the update directory is written (the server "
                            "must allow it with --allow-updates-from)")

    p = sub.add_parser("train", help="GRPO on the tiny variant or the 4-layer slice, metrics as JSONL")
    train_arguments(p)
    p.set_defaults(func=cmd_train)

    lora_cmd = sub.add_parser("lora", help="native LoRA: prepare (validate and list targets) and train")
    lora_sub = lora_cmd.add_subparsers(dest="lora_command", required=True, metavar="ACTION")
    p = lora_sub.add_parser("prepare", help="validate the target selection and list the adapted projections")
    train_arguments(p, lora_required=True)
    p.set_defaults(func=cmd_lora_prepare)
    p = lora_sub.add_parser("train", help="GRPO training only the LoRA adapters")
    train_arguments(p, lora_required=True)
    p.set_defaults(func=cmd_train)

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

    p = sub.add_parser("launch", help="plan, preflight and run the recipe's launcher (miles) or glmkit's GRPO on Ray",
                       description="The recipe's launcher options are taken by their own names "
                                   "(scripts/run_glm5_3_flash.py, with --lora scripts/run_glm5_3_flash_lora.py), "
                                   "so a command line moves between the two unchanged; unset ones keep the "
                                   "launcher's defaults.")
    p.add_argument("--backend", default="miles", choices=["miles", "builtin"])
    p.add_argument("--lora", action="store_true", help="the LoRA launcher (miles)")
    _launcher_arguments(p)
    p.add_argument("--address", help="Ray cluster: http://HOST:8265 (Jobs API)")
    p.add_argument("--local-head", action="store_true", help="start a Ray head on 127.0.0.1 for this run")
    p.add_argument("--dry-run", action="store_true", help="print the plan, the preflight and the commands only")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument("--run-name", default="glmkit-launch", help="the job's tag (re-attach and --stop find it by this)")
    p.add_argument("--reattach", action=argparse.BooleanOptionalAction, default=True,
                   help="follow the running job of --run-name if there is one (default), instead of a new one")
    p.add_argument("--stop", action="store_true", help="stop the running job of --run-name (its training processes)")
    p.add_argument("--attach", action="store_true",
                   help="follow the newest job of --run-name, running or finished, submitting nothing")
    p.add_argument("--metrics-out", default="reports/launch/metrics.jsonl")
    p.add_argument("--miles-dir", help="miles: the framework's checkout on the cluster, where the commands run "
                                       "(default /root/miles, the recipe's image)")
    p.add_argument("--prompt-data", help="the dataset (jsonl; first rows checked); miles: reaches the trainer "
                                         "through --extra-args (the launcher has no option for it)")
    p.add_argument("--input-key", help="miles, with --prompt-data: the prompt field (default prompt)")
    p.add_argument("--label-key", help="miles, with --prompt-data: the label field (default label)")
    p.add_argument("--gpu-memory-gib", type=_finite, help="per-GPU memory for the memory check (default: the inventory's)")
    p.add_argument("--max-tokens-per-gpu", type=_positive,
                   help="miles: passed through --extra-args (default: the launcher's, 8192; LoRA 16384)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=_positive,
                   help="miles: the first stage's layers, through --extra-args (default: the launcher's, 11 at PP 4)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=_positive,
                   help="miles: the last stage's layers, through --extra-args (default: the launcher's, 12 at PP 4)")
    p.add_argument("--checkpoint", help="builtin: HF checkpoint directory (tiny: the shipped one)")
    p.add_argument("--rollout-actors", type=_positive, default=1)
    p.add_argument("--trainers", type=_non_negative, default=0,
                   help="builtin: 0 = one trainer beside the first rollout actor; N = N data-parallel trainer ranks "
                        "on bundles (GPUs) of their own, weights to the rollout actors over a process group")
    p.add_argument("--bundle-gpu", type=_gpu_fraction, default=1.0,
                   help="builtin, --device cuda: the GPU each bundle holds (default 1); a fraction packs several "
                        "bundles on one GPU, e.g. 0.5 for --trainers 1 on a one-GPU host (their world runs over gloo)")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--job-metrics-out", help="builtin: where the trainer actor writes its own metrics file")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("serve", help="the rollout engine behind SGLang's native HTTP API (/generate, /health, ...)")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=_integer, default=30000, help="0 picks a free port (printed)")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    p.add_argument("--tokenizer", help="tokenizer directory for text inputs (default: the checkpoint's own files)")
    p.add_argument("--max-batch-size", type=_positive, default=64, help="most inputs batched into one engine call")
    p.add_argument("--max-context", type=_integer, default=65536,
                   help="most prompt + new tokens of one request (larger ones are refused with 400)")
    p.add_argument("--prefill-chunk", type=_positive, metavar="TOKENS",
                   help="prefill joining prompts at most TOKENS a decode step (default: whole prompts at once)")
    p.add_argument("--max-prefill-tokens", type=_positive, default=16384, metavar="TOKENS",
                   help="most prompt tokens prefilled in one forward (SGLang's option; a longer single prompt "
                        "runs alone); teacher-forced log-probs are computed in pieces either way")
    p.add_argument("--allow-updates-from", action="append", default=[], metavar="DIR",
                   help="/update_weights_from_disk may read directories under DIR (repeatable; default: none)")
    p.add_argument("--max-body-bytes", type=_positive, default=64 << 20,
                   help="largest request body accepted (larger ones get 413; default 64 MiB, ~9M token ids)")
    p.add_argument("--max-weights-body-bytes", type=_positive, default=1 << 30,
                   help="largest /update_weights_from_tensor body (safetensors blobs in base64; default 1 GiB)")
    p.add_argument("--body-timeout-s", type=_finite_positive, default=60.0, metavar="SECONDS",
                   help="answer 408 and close when a request body sends nothing for this long (default 60)")
    p.add_argument("--served-model-name", help="the name /v1/models and /server_info report (default: the checkpoint)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="report SGLang's memory saver as on in /server_info (the framework compares it with its "
                        "--offload-rollout); glmkit keeps its memory either way")
    p.add_argument("--random-seed", type=_seed, default=0, help="seeds requests that give no sampling_seed")
    p.add_argument("--base-gpu-id", type=_non_negative, default=0,
                   help="the base_gpu_id /server_info reports (the framework compares it for an external engine)")
    _backend_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("variants", help="list the model variants")
    p.set_defaults(func=cmd_variants)

    from glmkit.notebook import add_report_command
    from glmkit.rl.rewards import add_reward_command

    add_report_command(sub)
    add_reward_command(sub)
    return parser


def _require_device(args) -> None:
    """--device cuda where this process runs the model (not launch: its --device is the cluster's)."""
    if getattr(args, "device", None) != "cuda" or args.func not in (cmd_check, cmd_parity, cmd_capture, cmd_train,
                                                                     cmd_ckpt_synth, cmd_serve, cmd_rollout_data):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); use --device cpu")


def _error_text(command: str, err: BaseException) -> str:
    """The whole reason, bounded: the library's messages put the file / tensor on the first line and list
    the offending tensors (at most 10, and a count) on the next ones."""
    lines = str(err).splitlines() or [type(err).__name__]
    if len(lines) > MAX_ERROR_LINES:
        lines = lines[:MAX_ERROR_LINES - 1] + [f"  ... ({len(lines) - MAX_ERROR_LINES + 1} more lines)"]
    return f"glmkit {command}: error: " + "\n".join(lines)


def _glmkit_warnings(command: str, default):
    """A warnings.showwarning that prints glmkit's own warnings as "glmkit CMD: warning: ..." (other
    packages' as Python does)."""
    package = str(Path(__file__).resolve().parent)

    def show(message, category, filename, lineno, file=None, line=None):
        if str(Path(filename).resolve()).startswith(package):
            print(f"glmkit {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


# Options whose value is itself a command line (`--extra-args "--lr 2e-6"`, as the launchers take it):
# argparse would read such a value as an option, so it is joined to its flag before parsing.
_COMMAND_LINE_VALUES = ("--extra-args", "--extra-env-vars")


def _values_that_look_like_options(argv: list) -> list:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _COMMAND_LINE_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv=None) -> int:
    import warnings

    try:
        args = build_parser().parse_args(_values_that_look_like_options(sys.argv[1:] if argv is None else list(argv)))
    except KeyboardInterrupt:
        print("glmkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - a fault in an argument's type function: glmkit's, not the input's
        return _internal_error("arguments", err)
    default_show = warnings.showwarning
    default_term = _on_sigterm(_terminate)
    try:
        warnings.showwarning = _glmkit_warnings(args.command, default_show)
        _require_device(args)
        return args.func(args)
    except Exception as err:  # noqa: BLE001 - the error contract: each kind of failure its exit code
        return _answer_failure(args.command, err)
    except KeyboardInterrupt as stop:
        how = "terminated" if isinstance(stop, Terminated) else "interrupted"
        print(f"glmkit {args.command}: {how} (outputs are renamed into place only when complete: nothing "
              f"half-written is left as if it were whole)", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED
    finally:
        warnings.showwarning = default_show
        _on_sigterm(default_term)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler or `kill`): unwound like Ctrl-C, so locks are released and staging removed."""


def _terminate(signum, frame):
    raise Terminated()


def _on_sigterm(handler):
    """Set SIGTERM's handler (main thread only; elsewhere nothing changes) -> the previous one."""
    import signal
    import threading

    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _answer_failure(command: str, err: Exception) -> int:
    """What the user sees of a failed command: one line and its exit code (see the contract below)."""
    import errno

    from glmkit.checkpoint import CheckpointError

    if isinstance(err, BrokenPipeError):  # the reader of our output went away (`glmkit ... | head`)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_BROKEN_PIPE
    if isinstance(err, OSError):
        if _environment_error(err):
            where = f": {err.filename}" if getattr(err, "filename", None) else ""
            print(f"glmkit {command}: environment error: {err.strerror or err}{where} (nothing half-written is "
                  f"left in place)", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if err.errno == errno.ENAMETOOLONG:
            name = str(getattr(err, "filename", "") or "")
            print(f"glmkit {command}: error: a path is too long for the file system "
                  f"({len(os.path.basename(name))} characters in its last part): {name[:80]}...", file=sys.stderr)
            return EXIT_BAD_INPUT
        if isinstance(err, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                            ConnectionError)):
            print(_error_text(command, err), file=sys.stderr)
            return EXIT_BAD_INPUT
        return _wrapped_environment_error(command, err) or _internal_error(command, err)
    if _out_of_memory(err):
        print(f"glmkit {command}: environment error: out of memory ({str(err).splitlines()[0][:160] if str(err) else type(err).__name__}); "
              f"a smaller input, or a machine with more free memory (nothing half-written is left in place)",
              file=sys.stderr)
        return EXIT_ENVIRONMENT
    if isinstance(err, (CheckpointError, ValueError, ImportError)):
        if isinstance(err, ValueError) and not isinstance(err, CheckpointError) and not _raised_by_glmkit(err):
            return _wrapped_environment_error(command, err) or _internal_error(command, err)
        print(_error_text(command, err), file=sys.stderr)
        return EXIT_BAD_INPUT
    return _wrapped_environment_error(command, err) or _internal_error(command, err)


def _out_of_memory(err: BaseException) -> bool:
    """Memory the machine could not give: Python's MemoryError, torch's CUDA out-of-memory error and its
    CPU allocator's RuntimeError."""
    import torch

    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def _wrapped_environment_error(command: str, err: BaseException) -> int | None:
    """A library's own error around an OS one (safetensors' Rust `... (os error 28)`, torch.save's
    `file write failed`): the environment's (exit 4) when the OS error is one, else None."""
    import re

    seen, chain = set(), err
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno is not None and _environment_error(chain):
            code = chain.errno
            break
        found = re.search(r"\(os error (\d+)\)", str(chain))
        if found and _environment_error(OSError(int(found.group(1)), "")):
            code = int(found.group(1))
            break
        chain = chain.__cause__ or chain.__context__
    else:
        return None
    print(f"glmkit {command}: environment error: {os.strerror(code)} ({type(err).__name__}; nothing half-written is "
          f"left in place)", file=sys.stderr)
    return EXIT_ENVIRONMENT


# The CLI's error contract: 0 done, 1 a run that fails its check, 2 bad input (one line naming it),
# 3 an internal error (traceback saved to a file), 4 the environment (disk full, permission denied,
# read-only), 130 interrupted.
EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 1, 2, 3, 4, 130
EXIT_BROKEN_PIPE = 141  # as a shell reports a process that SIGPIPE ended
EXIT_TERMINATED = 143  # as a shell reports a process that SIGTERM ended


def _environment_error(err: OSError) -> bool:
    import errno

    return isinstance(err, PermissionError) or err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                             errno.EPERM, errno.EMFILE, errno.ENOMEM,
                                                             errno.EFBIG, errno.EIO)


def _raised_by_glmkit(err: BaseException) -> bool:
    """Whether the innermost frame that raised `err` is glmkit's own code (its checks of the user's
    input raise ValueError with the reason) rather than a library's."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return True
    package = Path(__file__).resolve().parent
    filename = Path(last.tb_frame.f_code.co_filename).resolve()
    return package in filename.parents or package.parent / "widgets" in filename.parents


def _error_folder() -> Path:
    """This user's folder for tracebacks: $TMPDIR/glmkit-errors-UID, made 0700 and owned by this user
    (a folder of that name someone else made, or a symlink, is refused: the file is not written)."""
    import stat
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"glmkit-errors-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a private folder of this user")
    return folder


def _internal_error(command: str, err: BaseException) -> int:
    """A bug, not the user's input: one line, and the traceback in a file whose path is printed (a new
    file, never one that exists or a link)."""
    import traceback

    import tempfile

    text = "".join(traceback.format_exception(err))
    name = f"glmkit-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    saved = "the traceback could not be saved (no writable temporary folder)"
    for folder in (_error_folder, lambda: Path(tempfile.mkdtemp(prefix="glmkit-errors-"))):  # the 2nd: made private, new
        try:
            path = folder() / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            saved = f"traceback saved to {path}"
            break
        except OSError:
            continue
    first = (str(err).splitlines() or [""])[0][:300]
    print(f"glmkit {command}: internal error: {type(err).__name__}: {first} ({saved}; please report it)",
          file=sys.stderr)
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
