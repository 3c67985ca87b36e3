"""`glmkit check`: glmkit's two paths against the transformers reference on one checkpoint.

Runs, on seeded prompts long enough that the DSA selection drops keys, and their greedy continuation:
  train path logits vs reference; rollout prefill logits vs reference; rollout decode, step by step,
  vs the reference at the same positions; and the greedy rollout's log-probs re-scored by the train
  path (train vs rollout log-prob |diff|, the recipe's first bring-up metric).
The reference runs each sequence unpadded, once, over prompt + continuation (causal: its prompt rows
are what a prompt-only run gives). Measures, thresholds and the tie rule are `glmkit.comparison`'s,
the ones `glmkit parity` uses: where glmkit's DSA selections differ from the reference's only by ties
(pools scoring equal at the top-k boundary), both glmkit paths are run again with the reference's
selections and compared like for like (top-k replay), as parity's `--replay-topk auto` does.
Writes an HTML + JSON report; the verdict is "pass" when every comparison is within tolerance.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from glmkit.comparison import THRESHOLDS, TIE_TOLERANCE, compare_indices, dtype_name, rel_rms, tied_layers
from glmkit.kernels.backends import Backends


@dataclass
class CheckSettings:
    checkpoint: Path | None = None
    variant: str = "tiny"
    seed: int = 0
    decode_steps: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    backends: Backends | str | None = None


MIN_DECODE_STEPS = 2  # the decode comparison feeds steps 2.. of the greedy rollout
LONGEST_PROMPT = "3 x (index_topk + index_kpool) + 5"  # how _prompts sizes its first prompt, said in errors


def _prompts(config, seed: int) -> list[list[int]]:
    """Three prompts: one long enough that the DSA selections cover every pool (LONGEST_PROMPT), one
    just past one selection's span, one shorter than a pool."""
    span = config.index_topk + config.index_kpool
    lengths = [3 * span + 5, span + 1, max(2, config.index_kpool - 1)]
    g = torch.Generator().manual_seed(seed)
    low = 3 if config.vocab_size > 3 else 0
    return [torch.randint(low, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def check_decode_steps_fit(config, settings: CheckSettings, config_file="config.json") -> None:
    """The check's sequences (its prompts and --decode-steps more tokens) within the model's context and
    the memory the device has free, for glmkit's two paths and the reference's T x T scores, before
    anything loads."""
    from glmkit.bounds import check_sequence_fits, check_tokens_fit

    prompts = [len(p) for p in _prompts(config, settings.seed)]
    lengths = [n + settings.decode_steps for n in prompts]
    what = f"--decode-steps {settings.decode_steps}"
    if max(prompts) + MIN_DECODE_STEPS > config.max_position_embeddings:  # sized by the config, not the flag
        raise ValueError(f"{config_file}: index_topk {config.index_topk} and index_kpool {config.index_kpool} make "
                         f"glmkit check's longest prompt {max(prompts)} tokens ({LONGEST_PROMPT}, "
                         f"so that selections cover every pool), past the model's context of "
                         f"{config.max_position_embeddings}; compare such a checkpoint with glmkit parity --seq-len")
    if max(lengths) > config.max_position_embeddings:
        raise ValueError(f"{what}: the longest check sequence would hold {max(lengths)} tokens, past the model's "
                         f"context of {config.max_position_embeddings}; use at most "
                         f"{config.max_position_embeddings - max(lengths) + settings.decode_steps}")
    check_tokens_fit(config, 1, sum(lengths), settings.device, what)
    check_sequence_fits(config, max(lengths), settings.device, what)


def _index_results(ref, ours, rows, config, limits: dict, tie: dict) -> list:
    """The reference's DSA selections (at token `rows`) against one glmkit path's, per layer."""
    results = []
    layers = sorted(layer for (layer, site) in ours.tensors if site == "indexer_topk" and (layer, site) in ref.tensors)
    for layer in layers:
        site, theirs = "indexer_topk", ours.tensors[(layer, "indexer_topk")]
        # each side's own pool scores: a differing row is a tie when both sides score it at their boundary
        scores = [ref.tensors.get((layer, "indexer_scores")), ours.tensors.get((layer, "indexer_scores"))]
        scores[0] = None if scores[0] is None else scores[0][rows]
        results.append(compare_indices(ref.tensors[(layer, site)][rows], theirs, layer, site, limits["identical"],
                                       *scores, group=config.index_kpool, **tie))
    return results


def run_check(settings: CheckSettings, work_dir: Path) -> dict:
    from glmkit.checkpoint import open_checkpoint, synth_checkpoint
    from glmkit.config import describe
    from glmkit.model import RolloutEngine, SamplingParams, TrainPath, load_model
    from glmkit.parity.builtin import selections_of
    from glmkit.parity.capture import capture_reference, capture_rollout, capture_train
    from glmkit.reference import load_reference

    started = time.time()
    path = settings.checkpoint
    if path is None:
        path = Path(work_dir) / f"checkpoint-{settings.variant}-seed{settings.seed}"
        if not path.exists():
            synth_checkpoint(settings.variant, settings.seed, path, progress=False)
    ckpt = open_checkpoint(path)  # bad input fails here, before any progress is shown
    config = ckpt.config
    check_decode_steps_fit(config, settings, Path(path) / "config.json")
    bar = tqdm(total=6, desc="glmkit check", unit="stage")
    bar.set_postfix_str("loading"), bar.update()
    try:
        ref = load_reference(path, settings.dtype, settings.device)
        model = load_model(path, settings.dtype, settings.device)
    except BaseException:
        bar.close()  # the bar's last line before the error's, not after it
        raise
    name = dtype_name(settings.dtype)
    limits, tie = THRESHOLDS[name], TIE_TOLERANCE[name]
    prompts = _prompts(config, settings.seed)
    checks, curves = [], {}

    bar.set_postfix_str("greedy rollout"), bar.update()
    engine = RolloutEngine(model, settings.backends)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=settings.decode_steps))
    # the tokens each decode step is fed (a sequence that stopped early is fed 0s, on both sides)
    feed = [(c.tokens + [0] * settings.decode_steps)[:settings.decode_steps - 1] for c in greedy]
    full = [p + f for p, f in zip(prompts, feed)]
    starts = [sum(map(len, full[:n])) for n in range(len(full))]
    prompt_rows = torch.cat([torch.arange(s, s + len(p)) for s, p in zip(starts, prompts)])

    bar.set_postfix_str("reference"), bar.update()
    reference = capture_reference(ref, full, keep_logits=True)

    def glmkit_paths(replay):
        train = capture_train(model, prompts, settings.backends, keep_logits=True,
                              topk_replay=None if replay is None else {k: v[prompt_rows] for k, v in replay.items()})
        rollout = capture_rollout(model, full, [len(p) for p in prompts], settings.backends, replay, keep_logits=True)
        return train, rollout

    bar.set_postfix_str("train and rollout paths"), bar.update()
    def judged(train, rollout):
        return {"train": _index_results(reference, train, prompt_rows, config, limits, tie),
                "rollout": _index_results(reference, rollout, slice(None), config, limits, tie)}

    train, rollout = glmkit_paths(None)
    selections = judged(train, rollout)
    tied = sorted(set(tied_layers(selections["train"]) + tied_layers(selections["rollout"])))
    replay_note = None
    if tied:  # parity's automatic rule: like for like downstream of a tie
        train, rollout = glmkit_paths(selections_of(reference))
        # judged again: each glmkit indexer still records its own choice, now from like-for-like inputs
        selections = judged(train, rollout)
        replay_note = (f"both glmkit paths replay the reference's DSA selections: ties were seen at layer(s) "
                       f"{', '.join(map(str, tied))} without replay")

    def compare(name, ref_rows, ours_rows):
        per_pos = (ref_rows - ours_rows).abs().amax(-1).float().cpu()
        curves.setdefault(name, []).append(per_pos)
        rel = rel_rms(ref_rows, ours_rows)
        checks.append({"name": name, "rel_rms": rel, "max_abs": per_pos.max().item(), "tolerance": limits["rel_rms"],
                       "topk_replayed": bool(tied), "pass": rel <= limits["rel_rms"]})

    ref_logits, train_logits = reference.tensors[(None, "logits")], train.tensors[(None, "logits")]
    rollout_logits = rollout.tensors[(None, "logits")]
    offset = 0
    for i, (s, p) in enumerate(zip(starts, prompts)):
        compare(f"reference vs train: logits, sequence {i}", ref_logits[s:s + len(p)],
                train_logits[offset:offset + len(p)])
        offset += len(p)
    for i, (s, p) in enumerate(zip(starts, prompts)):
        compare(f"reference vs rollout: prefill logits, sequence {i}", ref_logits[s:s + len(p)],
                rollout_logits[s:s + len(p)])
    # decode rows step by step, each step over the batch (the order the engine runs them)
    steps = torch.tensor([s + len(p) + j for j in range(settings.decode_steps - 1) for s, p in zip(starts, prompts)],
                         dtype=torch.long)
    compare("reference vs rollout: decode logits (all steps)", ref_logits[steps], rollout_logits[steps])

    bar.set_postfix_str("train vs rollout"), bar.update()
    with torch.no_grad():
        rescored = TrainPath(model, settings.backends).forward([c.prompt + c.tokens for c in greedy])
    diffs = []
    for c, (s, e) in zip(greedy, rescored.packed.bounds()):
        train_lp = rescored.logprobs[s + len(c.prompt) - 1:e - 1].cpu()
        diffs.append((train_lp - torch.tensor(c.logprobs)).abs())
    per_token = torch.cat(diffs)
    logprob = {"max_abs_diff": per_token.max().item(),
               "mean_abs_diff": torch.stack([d.mean() for d in diffs]).mean().item(),
               "tokens": len(per_token), "tolerance": limits["logprob_abs"]}
    checks.append({"name": "train vs rollout: greedy log-probs", "rel_rms": None,
                   "max_abs": logprob["max_abs_diff"], "tolerance": limits["logprob_abs"], "topk_replayed": False,
                   "pass": logprob["max_abs_diff"] <= limits["logprob_abs"]})
    bar.set_postfix_str("done"), bar.update()
    bar.close()
    nonfinite = _nonfinite(model, {"reference": ref_logits, "train": train_logits, "rollout": rollout_logits})
    # a selection that differs for real (not by a tie) fails on its own: replay must not hide it
    chosen = [{"path": path_name, "layer": r.layer, "identical": r.identical, "tied": r.tied, "different": r.different,
               "pass": not r.diverged} for path_name, results in selections.items() for r in results]
    return {
        "verdict": "pass" if all(c["pass"] for c in checks + chosen) else "fail",
        "checkpoint": str(path), "variant": settings.variant if settings.checkpoint is None else None,
        "model": describe(config), "load_summary": ckpt.skipped_summary(),
        "dtype": name, "device": settings.device,
        "backends": str(Backends.parse(settings.backends)), "seed": settings.seed,
        "prompt_lengths": [len(p) for p in prompts], "decode_steps": settings.decode_steps,
        "thresholds": dict(limits), "tie_tolerance": dict(tie), "topk_replay": replay_note,
        "selections": chosen, "nonfinite": nonfinite,
        "checks": checks, "train_rollout_logprob": logprob, "seconds": round(time.time() - started, 2),
        "_curves": {k: [c.tolist() for c in v] for k, v in curves.items()},
        "_per_token": per_token.tolist(),
    }


def _nonfinite(model, logits: dict) -> str | None:
    """Which paths' logits hold NaN or Inf, and the model's largest weight (where an overflow most
    likely starts), or None when every logit is finite. Such a check fails on its own (NaN is within no
    tolerance); this says why in one line."""
    counts = {side: int((~values.isfinite()).sum()) for side, values in logits.items()}
    if not any(counts.values()):
        return None
    from glmkit.model import largest_weight

    sides = ", ".join(f"{side} {n} of {logits[side].numel()}" for side, n in counts.items() if n)
    return f"NaN or infinite logits ({sides}); the model's largest |weight| is {largest_weight(model)}"


def _on_log_axis(values) -> list:
    """The finite values, floored at 1e-12 for a log axis (NaN and Inf cannot be placed on one)."""
    return [max(v, 1e-12) for v in values if math.isfinite(v)]


def render(result: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from glmkit import report

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, runs in result["_curves"].items():
        for i, values in enumerate(runs):
            ax.semilogy(range(len(values)), [max(v, 1e-12) if math.isfinite(v) else math.nan for v in values],
                        label=name if i == 0 else None)
    ax.set_xlabel("token position (decode: step x request)")
    ax.set_ylabel("max |logit diff| per position")
    ax.legend(fontsize=7)
    curves = report.figure_png(fig)
    fig, ax = plt.subplots(figsize=(6, 3))
    finite = _on_log_axis(result["_per_token"])
    ax.hist(finite, bins=30)
    left_out = len(result["_per_token"]) - len(finite)
    ax.set_xlabel("|logp train - logp rollout| per generated token"
                  + (f" ({left_out} NaN / Inf not shown)" if left_out else ""))
    hist = report.figure_png(fig)
    header = {k: result[k] for k in ("checkpoint", "model", "load_summary", "dtype", "device", "backends",
                                     "seed", "prompt_lengths", "decode_steps", "seconds")}
    header["top-k replay"] = result["topk_replay"] or "not needed (no ties at the DSA selections)"
    if result["nonfinite"]:
        header["non-finite"] = result["nonfinite"]
    header.update({f"version: {k}": v for k, v in report.versions().items()})
    sections = [
        ("Comparisons", report.table(result["checks"], ["name", "rel_rms", "max_abs", "tolerance", "topk_replayed",
                                                        "pass"])),
        ("DSA selections against the reference's (fractions of token rows; tied rows do not count against)",
         report.table(result["selections"], ["path", "layer", "identical", "tied", "different", "pass"])),
        ("Error against position", report.image(curves, "max |logit diff| per position")),
        ("Train vs rollout log-probs", report.table([result["train_rollout_logprob"]],
                                                    ["mean_abs_diff", "max_abs_diff", "tokens", "tolerance"])
         + report.image(hist, "histogram of per-token |logprob diff|")),
    ]
    return report.html_report("glmkit check: paths vs the transformers reference", result["verdict"], header, sections)


def write(result: dict, out_dir: Path) -> tuple[Path, Path]:
    from glmkit import report

    from glmkit.outputs import mark_file

    public = {k: v for k, v in result.items() if not k.startswith("_")}
    written = report.write_report(out_dir, "check", render(result), public)
    for path in written:
        mark_file(path, "check report")
    return written
