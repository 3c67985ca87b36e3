"""`glmkit check`: glmkit's two paths against the transformers reference on one checkpoint.

Runs, on seeded prompts long enough that the DSA selection drops keys:
  train path logits vs reference (left-padded batch); rollout prefill logits vs reference;
  rollout decode, step by step, vs the reference's cached decode; and a greedy rollout whose tokens
  the train path re-scores (train vs rollout log-prob |diff|, the recipe's first bring-up metric).
Writes an HTML + JSON report; the verdict is "pass" when every comparison is within tolerance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from glmkit.kernels.backends import Backends

# fp32 tolerances (see tests/test_model_parity.py for why): relative RMS of logits, and the
# train-vs-rollout log-prob max |diff|. bf16 runs get looser bounds.
TOLERANCE = {
    torch.float32: {"rel_rms": 5e-5, "logprob_abs": 1e-4},
    torch.bfloat16: {"rel_rms": 2e-2, "logprob_abs": 5e-2},
}


@dataclass
class CheckSettings:
    checkpoint: Path | None = None
    variant: str = "tiny"
    seed: int = 0
    decode_steps: int = 16
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    backends: Backends | str | None = None


def _rel_rms(ref, x) -> float:
    return ((ref - x).float().norm() / ref.float().norm().clamp_min(1e-30)).item()


def _prompts(config, seed: int) -> list[list[int]]:
    span = config.index_topk + config.index_kpool
    lengths = [3 * span + 5, span + 1, max(2, config.index_kpool - 1)]
    g = torch.Generator().manual_seed(seed)
    low = 3 if config.vocab_size > 3 else 0
    return [torch.randint(low, config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def run_check(settings: CheckSettings, work_dir: Path) -> dict:
    from glmkit.checkpoint import open_checkpoint, synth_checkpoint
    from glmkit.config import describe
    from glmkit.model import RolloutEngine, SamplingParams, TrainPath, load_model
    from glmkit.reference import load_reference, reference_decode_logits, reference_logits

    started = time.time()
    path = settings.checkpoint
    if path is None:
        path = Path(work_dir) / f"checkpoint-{settings.variant}-seed{settings.seed}"
        if not path.exists():
            synth_checkpoint(settings.variant, settings.seed, path, progress=False)
    ckpt = open_checkpoint(path)  # bad input fails here, before any progress is shown
    config = ckpt.config
    bar = tqdm(total=6, desc="glmkit check", unit="stage")
    bar.set_postfix_str("loading"), bar.update()
    ref = load_reference(path, settings.dtype, settings.device)
    model = load_model(path, settings.dtype, settings.device)
    tol = TOLERANCE[settings.dtype]
    prompts = _prompts(config, settings.seed)
    checks, curves = [], {}

    def compare(name, ref_rows, ours_rows):
        per_pos = (ref_rows - ours_rows).abs().amax(-1).float().cpu()
        curves.setdefault(name, []).append(per_pos)
        rel = _rel_rms(ref_rows, ours_rows)
        checks.append({"name": name, "rel_rms": rel, "max_abs": per_pos.max().item(),
                       "tolerance": tol["rel_rms"], "pass": rel < tol["rel_rms"]})

    bar.set_postfix_str("train path"), bar.update()
    expected = reference_logits(ref, prompts)
    with torch.no_grad():
        train = TrainPath(model, settings.backends).forward(prompts, return_logits=True)
    for i, (s, e) in enumerate(train.packed.bounds()):
        compare(f"reference vs train: logits, sequence {i}", expected[i], train.logits[s:e])

    bar.set_postfix_str("rollout prefill"), bar.update()
    engine = RolloutEngine(model, settings.backends)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=settings.decode_steps))
    feed = torch.tensor([c.tokens + [0] * (settings.decode_steps - len(c.tokens)) for c in greedy])
    _, ref_steps = reference_decode_logits(ref, prompts, feed[:, :-1])
    batch, prefill = engine.prefill(prompts, max(map(len, prompts)) + settings.decode_steps, all_logits=True)
    for i, (s, e) in enumerate(train.packed.bounds()):
        compare(f"reference vs rollout: prefill logits, sequence {i}", expected[i], prefill[s:e])

    bar.set_postfix_str("rollout decode"), bar.update()
    steps = [engine.step(batch, feed[:, s].to(model.device)) for s in range(settings.decode_steps - 1)]
    compare("reference vs rollout: decode logits (all steps)", ref_steps.transpose(0, 1).flatten(0, 1),
            torch.stack(steps).flatten(0, 1))

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
               "tokens": len(per_token), "tolerance": tol["logprob_abs"]}
    checks.append({"name": "train vs rollout: greedy log-probs", "rel_rms": None,
                   "max_abs": logprob["max_abs_diff"], "tolerance": tol["logprob_abs"],
                   "pass": logprob["max_abs_diff"] < tol["logprob_abs"]})
    bar.set_postfix_str("done"), bar.update()
    bar.close()
    return {
        "verdict": "pass" if all(c["pass"] for c in checks) else "fail",
        "checkpoint": str(path), "variant": settings.variant if settings.checkpoint is None else None,
        "model": describe(config), "load_summary": ckpt.skipped_summary(),
        "dtype": str(settings.dtype).replace("torch.", ""), "device": settings.device,
        "backends": str(Backends.parse(settings.backends)), "seed": settings.seed,
        "prompt_lengths": [len(p) for p in prompts], "decode_steps": settings.decode_steps,
        "checks": checks, "train_rollout_logprob": logprob, "seconds": round(time.time() - started, 2),
        "_curves": {k: [c.tolist() for c in v] for k, v in curves.items()},
        "_per_token": per_token.tolist(),
    }


def render(result: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from glmkit import report

    fig, ax = plt.subplots(figsize=(9, 4))
    for name, runs in result["_curves"].items():
        for i, values in enumerate(runs):
            ax.semilogy(range(len(values)), [max(v, 1e-12) for v in values], label=name if i == 0 else None)
    ax.set_xlabel("token position (decode: step x request)")
    ax.set_ylabel("max |logit diff| per position")
    ax.legend(fontsize=7)
    curves = report.figure_png(fig)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist([max(v, 1e-12) for v in result["_per_token"]], bins=30)
    ax.set_xlabel("|logp train - logp rollout| per generated token")
    hist = report.figure_png(fig)
    header = {k: result[k] for k in ("checkpoint", "model", "load_summary", "dtype", "device", "backends",
                                     "seed", "prompt_lengths", "decode_steps", "seconds")}
    header.update({f"version: {k}": v for k, v in report.versions().items()})
    sections = [
        ("Comparisons", report.table(result["checks"], ["name", "rel_rms", "max_abs", "tolerance", "pass"])),
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
