"""Compare two captures site by site, name the first divergence, and compute the recipe's
train/rollout log-prob metric. The measures, thresholds and tie rule are `glmkit.comparison`'s; this
module applies them to every site two captures share. Sites are ordered by layer, then by where they
occur in the block, so the first divergence is the earliest place the two paths part ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmkit.comparison import (THRESHOLDS, TIE_TOLERANCE, SiteResult, classify_rows,  # noqa: F401 - used here and
                               compare_indices, compare_values)                      # re-exported for callers
from glmkit.model.sites import AUX_SITES, FINAL, INDEX_SITES, PER_LAYER, SCORE_SITE
from glmkit.parity.dump import Capture


@dataclass
class LogprobDiff:
    """The recipe's train/train_rollout_logprob_abs_diff: mean over samples of each sample's mean
    |logp_a - logp_b| over its response tokens."""

    value: float
    per_token: list
    worst: list                    # [{"sequence", "position", "a", "b", "abs_diff"}], largest first


@dataclass
class ParityResult:
    path_a: str
    path_b: str
    dtype: str
    mode: str
    thresholds: dict
    sites: list
    first_divergence: SiteResult | None
    logprob: LogprobDiff | None
    skipped_sites: list
    warnings: list = field(default_factory=list)
    topk_replay: str | None = None  # where path B's DSA selections came from, when replayed
    departure: object | None = None  # glmkit.parity.departure.Departure, when a third path was compared
    versus_third: dict | None = None  # {"a": ParityResult, "b": ParityResult} each side against the third path
    gradients: "ParityResult | None" = None             # activation gradients (backward order)
    parameter_gradients: "ParityResult | None" = None   # parameter gradients (backward order)

    @property
    def verdict(self) -> str:
        return "fail" if self.first_divergence is not None else "pass"

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "first_divergence": None if self.first_divergence is None else self.first_divergence.public(),
            "logprob_abs_diff": None if self.logprob is None else self.logprob.value,
            "logprob_worst_tokens": None if self.logprob is None else self.logprob.worst,
            "paths": [self.path_a, self.path_b], "dtype": self.dtype, "mode": self.mode,
            "thresholds": self.thresholds, "skipped_sites": self.skipped_sites,
            "warnings": self.warnings, "topk_replay": self.topk_replay,
            "sites": [s.public() for s in self.sites],
            "departure": None if self.departure is None else self.departure.to_json(),
            "versus_third": None if not self.versus_third else {k: v.to_json() for k, v in self.versus_third.items()},
            "gradients": None if self.gradients is None else self.gradients.to_json(),
            "parameter_gradients": None if self.parameter_gradients is None else self.parameter_gradients.to_json(),
        }


def _order(key):
    layer, site = key
    if layer is None:
        return (float("inf"), FINAL.index(site) if site in FINAL else len(FINAL))
    return (layer, PER_LAYER.index(site) if site in PER_LAYER else len(PER_LAYER))


def site_order(key, backward: bool = False):
    """Sort key of a (layer, site): where it occurs in the forward, or (backward) where its gradient is
    made: the loss end first."""
    layer, index = _order(key)
    return (-layer, -index) if backward else (layer, index)


def logprob_abs_diff(a: Capture, b: Capture, response_starts=None, worst: int = 10) -> LogprobDiff | None:
    """Over response tokens: positions p >= response_start of each sequence (whose log-prob is that of
    token p+1); default response_start = 0, i.e. every predicted token."""
    la, lb = a.tensors.get((None, "logprobs")), b.tensors.get((None, "logprobs"))
    if la is None or lb is None:
        return None
    diff = (la.double() - lb.double()).abs()
    per_sample, per_token, rows = [], [], []
    for n, (s, e) in enumerate(zip(a.cu_seqlens[:-1].tolist(), a.cu_seqlens[1:].tolist())):
        start = s + (response_starts[n] if response_starts is not None else 0)
        idx = torch.arange(max(start, s), e - 1)  # the last token has no target
        if len(idx) == 0:
            continue
        per_sample.append(diff[idx].mean().item())
        per_token.extend(diff[idx].tolist())
        rows.extend((n, int(i) - s, la[i].item(), lb[i].item(), diff[i].item()) for i in idx)
    rows.sort(key=lambda r: -r[4])
    return LogprobDiff(sum(per_sample) / max(1, len(per_sample)), per_token,
                       [{"sequence": r[0], "position": r[1], "a": r[2], "b": r[3], "abs_diff": r[4]}
                        for r in rows[:worst]])


def compare(a: Capture, b: Capture, dtype: str = "float32", thresholds: dict | None = None,
            response_starts=None, backward: bool = False, skip_mismatched: bool = False) -> ParityResult:
    """Compare every site both captures hold. Raises ValueError when they ran on different inputs.
    `backward`: gradients, ordered (and the first divergence named) from the loss end. `skip_mismatched`:
    a site whose shapes differ is listed as skipped (with both shapes) rather than refused."""
    if a.input_sha256 != b.input_sha256:
        raise ValueError(f"captures ran on different inputs (input sha256 {a.input_sha256[:12]} vs "
                         f"{b.input_sha256[:12]}, lengths {a.lengths} vs {b.lengths})")
    if dtype not in THRESHOLDS:
        raise ValueError(f"no default thresholds for dtype {dtype!r}; allowed: {', '.join(THRESHOLDS)}")
    limits = dict(THRESHOLDS[dtype], **(thresholds or {}))
    common = sorted(set(a.tensors) & set(b.tensors), key=lambda k: site_order(k, backward))
    skipped = sorted(f"{k[0]}/{k[1]}" for k in set(a.tensors) ^ set(b.tensors))
    if skip_mismatched:
        mismatched = [k for k in common if a.tensors[k].shape != b.tensors[k].shape]
        skipped += [f"{k[0]}/{k[1]} (shapes {list(a.tensors[k].shape)} vs {list(b.tensors[k].shape)})"
                    for k in mismatched]
        common = [k for k in common if k not in mismatched]
    else:
        for k in common:
            if a.tensors[k].shape != b.tensors[k].shape:
                names = [c.source or c.manifest.get("path", side) for c, side in ((a, "a"), (b, "b"))]
                raise ValueError(f"site {k[0]}/{k[1]} is {list(a.tensors[k].shape)} in {names[0]} and "
                                 f"{list(b.tensors[k].shape)} in {names[1]}: the captures disagree on the model's "
                                 f"shapes (a damaged capture, or one of another config)")
    results = []
    tie = TIE_TOLERANCE[dtype]
    kpools = {c.manifest.get("index_kpool") for c in (a, b)} - {None}
    kpool = next(iter(kpools)) if len(kpools) == 1 else None
    warnings = []
    one_side = {name: sorted(set(mine) - set(theirs), key=lambda k: site_order(k, backward))
                for name, mine, theirs in ((a.manifest.get("path", "a"), a.tensors, b.tensors),
                                           (b.manifest.get("path", "b"), b.tensors, a.tensors))}
    for name, keys in one_side.items():
        if keys and skip_mismatched:  # captures of different kinds (a dump, a path): what one lacks is said
            shown = ", ".join(f"{k[0]}/{k[1]}" for k in keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
            warnings.append(f"only {name} has {shown}: not compared")
    if skip_mismatched:
        warnings += [f"layer {k[0]} {k[1]}: shapes {list(a.tensors[k].shape)} vs {list(b.tensors[k].shape)}, not "
                     f"compared (a dump's dims annotation that does not match the model?)" for k in mismatched]
    # a path that reports no hidden states (a server: log-probs, experts, selections) is judged on its
    # log-probs; elsewhere they are the diff metric only, the hidden sites before them carry the verdict
    # (and anywhere they are NaN or infinite: finite hidden states ahead of an overflowing head must not pass)
    judge_logprobs = not [k for k in common if k[1] not in (*INDEX_SITES, *AUX_SITES, "logprobs")] or not all(
        bool(c.tensors[(None, "logprobs")].isfinite().all()) for c in (a, b) if (None, "logprobs") in c.tensors)
    for layer, site in common:
        if (site == "logprobs" and not judge_logprobs) or site in AUX_SITES:
            continue
        ta, tb = a.tensors[(layer, site)], b.tensors[(layer, site)]
        if site in INDEX_SITES:
            group = 1 if site == "router_experts" else kpool
            scores = [c.tensors.get((layer, SCORE_SITE[site])) for c in (a, b)]
            if group is None:  # without the pool size no id maps to its pool: ties cannot be judged
                scores = [None, None]
            r = compare_indices(ta, tb, layer, site, limits["identical"], *scores, group=group or 1, **tie)
            results.append(r)
            if r.tied:
                warnings.append(f"layer {layer} {site}: {round(r.tied * len(ta))} of {len(ta)} rows differ only "
                                f"by ties (equal scores at the top-k boundary on both sides)")
            elif r.different and None in scores:
                warnings.append(f"layer {layer} {site}: no candidate scores on both sides, ties not judged")
        else:
            results.append(compare_values(ta, tb, layer, site, limits["rel_rms"]))
    first = next((r for r in results if r.diverged), None)
    return ParityResult(a.manifest.get("path", "a"), b.manifest.get("path", "b"), dtype,
                        "streaming" if "streaming" in (a.manifest.get("mode"), b.manifest.get("mode")) else "end-to-end",
                        limits, results, first, logprob_abs_diff(a, b, response_starts), skipped, warnings)
