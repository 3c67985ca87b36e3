"""The recipe's healthy-run table (seed section 5) as data, with a verdict per metric."""

from __future__ import annotations

import math

# From the validation run in miles#2786 (16 nodes x 4 GB300, DAPO on DAPO-Math-17k).
HEALTHY_FULL = {
    "train/train_rollout_logprob_abs_diff": {"range": (0.0068, 0.0106), "lower_is_better": True,
                                             "note": "0.0068 - 0.0106 (first 11)"},
    "rollout/raw_reward": {"rise": (0.5, 0.94), "within": 10, "note": "0.5 -> 0.94 within 10 rollouts"},
    "train/ppo_kl": {"about": 2.6e-4, "note": "~2.6e-4"},
    "train/grad_norm": {"range": (0.31, 0.49), "note": "0.31 - 0.49"},
}

# What the recipe's numbers mean on each variant (None = compare as is).
NOT_APPLICABLE = {
    "tiny": {
        "train/train_rollout_logprob_abs_diff": None,
        "rollout/raw_reward": "the tiny preset learns a synthetic copy task from a pre-trained start, not DAPO-Math",
        "train/grad_norm": "a 1.5 MB model with a larger learning rate: its gradient scale is its own",
        "train/ppo_kl": "the tiny preset takes 4 optimizer steps per rollout on a 1.5 MB model: its own scale",
    },
    "GLM-5.3-Flash-4layer": {
        "rollout/raw_reward": "a 4-layer slice is not expected to solve DAPO-Math",
        "train/grad_norm": "the slice's gradient norm is not the full model's",
    },
    "GLM-5.3-Flash": {},
}


def per_rollout(history: list[dict], metric: str) -> tuple[list[float], int]:
    """The metric's value per rollout, in rollout order, and how many rows held it: a metric logged per
    optimizer step (train/*, several steps a rollout) is averaged over its rollout's steps, as the
    recipe's table reads "across the first 11 rollouts"."""
    by_rollout: dict = {}
    rows = 0
    for h in history:
        value = h.get(metric)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        rows += 1
        by_rollout.setdefault(h.get("rollout/step", h.get("step", rows)), []).append(float(value))
    return [sum(v) / len(v) for v in by_rollout.values()], rows


def verdicts(history: list[dict], variant: str) -> list[dict]:
    """history: the metric rows of a run (train rows per optimizer step, rollout rows per rollout).
    -> one row per metric of the table: {"metric", "expected", "observed", "verdict": "within range" |
    "outside" | "not applicable", "why"}; per-step metrics are judged per rollout (their mean)."""
    rows = []
    skip = NOT_APPLICABLE.get(variant, {})
    for metric, spec in HEALTHY_FULL.items():
        values, count = per_rollout(history, metric)
        observed = _summary(metric, values, spec)
        judged = min(len(values), JUDGED_ROLLOUTS) if "range" in spec else len(values)
        if observed is not None and judged < len(values):  # the range and the verdict cover the same rollouts
            observed += f" (first {judged} of {len(values)} rollouts" + (f", {count} steps)" if count > len(values)
                                                                          else ")")
        elif observed is not None and count > len(values):
            observed += f" ({len(values)} rollouts, {count} steps)"
        if skip.get(metric):
            rows.append(dict(metric=metric, expected=spec["note"], observed=observed, verdict="not applicable",
                             why=skip[metric]))
            continue
        if not values:
            rows.append(dict(metric=metric, expected=spec["note"], observed=None, verdict="not applicable",
                             why="not measured in this run"))
            continue
        ok, why = _check(values, spec)
        rows.append(dict(metric=metric, expected=spec["note"], observed=observed,
                         verdict="within range" if ok else "outside", why=why))
    return rows


# The recipe's ranges hold "across the first 11 rollouts": a range is judged, and shown, over those.
JUDGED_ROLLOUTS = 11


def _summary(metric, values, spec):
    if not values:
        return None
    if "rise" in spec:
        return f"{values[0]:.3g} -> {max(values[:spec['within']]):.3g} (first {min(len(values), spec['within'])})"
    if "range" in spec:
        values = values[:JUDGED_ROLLOUTS]
    return f"{min(values):.3g} - {max(values):.3g}"


def _check(values, spec) -> tuple[bool, str]:
    if "range" in spec:
        lo, hi = spec["range"]
        first = values[:JUDGED_ROLLOUTS]
        if spec.get("lower_is_better"):
            inside = sum(v <= hi for v in first)
            return inside == len(first), f"{inside}/{len(first)} rollouts at or below {hi} (lower is better)"
        inside = sum(lo <= v <= hi for v in first)
        return inside == len(first), f"{inside}/{len(first)} rollouts inside [{lo}, {hi}]"
    if "rise" in spec:
        start, end = spec["rise"]
        best = max(values[:spec["within"]])
        return best >= end * 0.9 and values[0] <= best, f"best {best:.3g} within {spec['within']} rollouts"
    about = spec["about"]
    mean = sum(values) / len(values)
    return about / 10 <= abs(mean) <= about * 10, f"mean {mean:.3g}, within 10x of {about:g}"


# The framework's other metrics a researcher reads beside the table (no range in the recipe: reported,
# not judged), by name or name prefix.
OBSERVED = ("train/loss", "train/entropy_loss", "train/ess_ratio", "train/tis", "train/tis_clipfrac",
            "train/pg_clipfrac", "rollout/response_len/mean", "rollout/truncated_ratio", "rollout/repetition_frac",
            "rollout/zero_std/all_zero_percentage", "rollout/zero_std/all_one_percentage", "rollout/grader_errors",
            "eval/raw_reward", "eval/pass@", "perf/actor_train_tok_per_s", "perf/actor_train_tflops",
            "perf/actor_train_mfu", "perf/rollout_time", "perf/step_time")


def observations(history: list[dict]) -> list[dict]:
    """The framework's metrics outside the recipe's table that the run logged: per metric, its first and
    last per-rollout value, min and max. -> [{"metric", "first", "last", "min", "max", "rollouts"}]."""
    names = []
    for h in history:
        for key in h:
            if key not in names and any(key == o or (o.endswith("@") and key.startswith(o)) for o in OBSERVED):
                names.append(key)
    order = {o: i for i, o in enumerate(OBSERVED)}
    names.sort(key=lambda k: order.get(k, order.get(k.split("@")[0] + "@", len(order))))
    rows = []
    for metric in names:
        values, _ = per_rollout(history, metric)
        if values:
            rows.append({"metric": metric, "first": values[0], "last": values[-1], "min": min(values),
                         "max": max(values), "rollouts": len(values)})
    return rows


def observed_over(row: dict) -> str:
    """What an observation's count counts: evaluations for eval/* (one every --eval-interval), else rollouts."""
    return f"{row['rollouts']} {'evaluations' if str(row['metric']).startswith('eval/') else 'rollouts'}"


def format_observations(rows: list[dict]) -> str:
    lines = [f"{'metric (reported, no recipe range)':40s} {'first -> last':28s} {'min - max':24s} over"]
    for r in rows:
        lines.append(f"{r['metric']:40s} {r['first']:.4g} -> {r['last']:.4g}".ljust(69)
                     + f" {r['min']:.4g} - {r['max']:.4g}".ljust(25) + f" {observed_over(r)}")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'metric':40s} {'expected':28s} {'observed':28s} verdict"]
    for r in rows:
        lines.append(f"{r['metric']:40s} {r['expected']:28s} {str(r['observed']):28s} {r['verdict']} ({r['why']})")
    return "\n".join(lines)


# What "the reward rose" means for a run's verdict: the mean of the last RISE_LAST rollouts above the
# mean of the first RISE_FIRST (the two windows must not overlap, so a run needs 8 or more rollouts).
RISE_FIRST, RISE_LAST = 3, 5
# The verdict of a run too short for that rule in which nothing else failed: neither pass nor fail.
UNDECIDED = "not enough rollouts to judge"


def run_verdict(history: list[dict], variant: str) -> dict:
    """The verdict of a GRPO run with its reasons, from its metric rows (train and rollout rows mixed,
    as `GRPOTrainer.run` writes them): "pass" when every optimizer step's loss and gradient norm were
    finite, the raw reward rose (mean of the last 5 rollouts above the mean of the first 3; 8 or more
    rollouts), and no metric of the recipe's table that applies to `variant` is outside its range;
    "fail" when any of these is broken; `UNDECIDED` ("not enough rollouts to judge") when the run has
    too few rollouts to judge the rise and nothing else failed (a smoke run of a few rollouts).
    -> {"verdict", "reasons": [...], "raw_reward_start", "raw_reward_end", "raw_reward",
        "grad_norms_finite", "skipped_steps", "health": verdicts(...), "observations": observations(...)}"""
    rewards = [h["rollout/raw_reward"] for h in history if h.get("rollout/raw_reward") is not None]
    steps = [h for h in history if "train/step" in h]
    skipped = sum(bool(h.get("train/step_skipped")) for h in steps)
    finite = bool(steps) and not skipped and all(
        "train/grad_norm" not in h.get("nonfinite", []) and h.get("train/grad_norm") is not None
        and math.isfinite(h["train/grad_norm"]) for h in steps)
    first, last = rewards[:RISE_FIRST], rewards[-RISE_LAST:]
    start = sum(first) / len(first) if first else math.nan
    end = sum(last) / len(last) if last else math.nan
    health = verdicts(history, variant)
    failed = []   # reasons that fail the run whatever its length
    if not steps:
        failed.append("no optimizer step was taken")
    elif not finite:
        failed.append(f"{skipped} optimizer step(s) had a NaN / Inf loss or gradient norm and were skipped")
    too_few = len(rewards) < RISE_FIRST + RISE_LAST
    if not too_few and not end > start:
        failed.append(f"raw reward did not rise: mean of the first {RISE_FIRST} {start:.3f}, "
                      f"of the last {RISE_LAST} {end:.3f}")
    for row in health:
        if row["verdict"] == "outside":
            failed.append(f"{row['metric']} outside the recipe's range {row['expected']}: {row['why']}")
    reasons = list(failed)
    if too_few:
        reasons.append(f"{UNDECIDED}: {len(rewards)} rollouts, too few to judge a rise (the first {RISE_FIRST} "
                       f"and the last {RISE_LAST} must not overlap; run {RISE_FIRST + RISE_LAST} or more)")
    verdict = "fail" if failed else UNDECIDED if too_few else "pass"
    return {"verdict": verdict, "reasons": reasons, "raw_reward_start": start,
            "raw_reward_end": end, "raw_reward": rewards, "grad_norms_finite": finite, "skipped_steps": skipped,
            "health": health, "observations": observations(history)}
