"""Compare two captures site by site, name the first divergence, and compute the recipe's
train/rollout log-prob metric.

Per value site: max |a - b|, relative RMS ||a - b|| / ||a|| (the ratio fla's tests use), cosine,
NaN/Inf counts, and the error per token row. Per index site (indexer top-k, router experts):
Jaccard overlap of the row sets, and each row counted as identical, tied (the sets differ only in
pools or experts that score equal to the top-k boundary on both sides, within the dtype's tie
tolerance) or different. A site diverges when its relative RMS is over the dtype's threshold (or,
for index sites, when more than 1 - `identical` of its rows are different; ties do not count). Sites are ordered by layer, then by where they occur
in the block, so the first divergence is the earliest place the two paths part ways.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from glmkit.model.sites import AUX_SITES, FINAL, INDEX_SITES, PER_LAYER, SCORE_SITE
from glmkit.parity.dump import Capture

# Defaults: fp32 paths agree to ~1e-6 (the reference's own padding floor is ~1.5e-5); bf16 rounds
# every activation (2^-8 relative) and through a few layers lands at ~1e-2.
THRESHOLDS = {
    "float32": {"rel_rms": 1e-4, "identical": 0.99},
    "bfloat16": {"rel_rms": 5e-2, "identical": 0.9},
}
# When two scores count as equal for a tie: |s - boundary| <= atol + rtol |boundary|. fp32 paths
# compute the same fp32 scores in another order (~1e-7 relative); bf16 paths feed the scores bf16
# activations rounded at 2^-8, so near-equal there means within about one bf16 step.
TIE_TOLERANCE = {"float32": {"atol": 1e-6, "rtol": 1e-5}, "bfloat16": {"atol": 1e-3, "rtol": 1e-2}}


@dataclass
class SiteResult:
    layer: int | None
    site: str
    kind: str                      # "values" or "indices"
    max_abs: float | None = None
    rel_rms: float | None = None
    cosine: float | None = None
    nan: int = 0
    inf: int = 0
    jaccard: float | None = None
    identical: float | None = None
    tied: float | None = None       # rows whose sets differ only by ties at the top-k boundary
    different: float | None = None  # rows that differ otherwise: these count toward divergence
    diverged: bool = False
    per_row: list = field(default_factory=list)   # error per token row (rel error, or 1 - Jaccard)

    def public(self) -> dict:
        d = asdict(self)
        d.pop("per_row")
        return d


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


def compare_values(a: torch.Tensor, b: torch.Tensor, layer, site, threshold: float) -> SiteResult:
    if a.shape != b.shape:
        raise ValueError(f"site {layer}/{site}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    a64, b64 = a.double(), b.double()
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    diff = torch.where(finite, a64 - b64, torch.zeros_like(a64))
    ref = torch.where(finite, a64, torch.zeros_like(a64))
    norm = ref.norm().clamp_min(1e-30)
    rel = (diff.norm() / norm).item()
    cos = torch.nn.functional.cosine_similarity(ref.flatten(), torch.where(finite, b64, 0).flatten(), dim=0,
                                                eps=1e-30).item()
    rows = diff.reshape(len(a), -1).norm(dim=-1) / ref.reshape(len(a), -1).norm(dim=-1).clamp_min(1e-30)
    nan = int(torch.isnan(a).sum() + torch.isnan(b).sum())
    inf = int(torch.isinf(a).sum() + torch.isinf(b).sum())
    return SiteResult(layer, site, "values", diff.abs().max().item() if diff.numel() else 0.0, rel, cos, nan, inf,
                      diverged=rel > threshold or nan > 0 or inf > 0, per_row=rows.tolist())


def _side_is_tied(selected: set, scores: torch.Tensor | None, differing: set, atol: float, rtol: float) -> bool:
    """One side's view of a differing row: its selection is a top-k of its own scores, and every
    differing pool (or expert) scores equal to its boundary, the lowest score it selected."""
    if scores is None:
        return False
    finite = torch.isfinite(scores)
    chosen = [p for p in selected if p < len(scores) and finite[p]]
    if not chosen:
        return False
    boundary = min(scores[p].item() for p in chosen)
    tol = atol + rtol * abs(boundary)
    others = finite.clone()
    others[chosen] = False
    if others.any() and scores[others].max().item() > boundary + tol:
        return False  # not a top-k of these scores: nothing to judge a tie by
    return all(p < len(scores) and finite[p] and abs(scores[p].item() - boundary) <= tol for p in differing)


def classify_rows(a: torch.Tensor, b: torch.Tensor, scores_a=None, scores_b=None, group: int = 1,
                  atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    """Per row of ids (-1 empty): "identical" sets, "tied" (see compare_indices) or "different"."""
    kinds = []
    for r, (row_a, row_b) in enumerate(zip(a.tolist(), b.tolist())):
        sa, sb = {x for x in row_a if x >= 0}, {x for x in row_b if x >= 0}
        if sa == sb:
            kinds.append("identical")
            continue
        pa, pb = {x // group for x in sa}, {x // group for x in sb}
        differing = pa ^ pb
        tied = bool(differing) and all(
            _side_is_tied(sel, None if sc is None else sc[r], differing, atol, rtol)
            for sel, sc in ((pa, scores_a), (pb, scores_b)))
        kinds.append("tied" if tied else "different")
    return kinds


def compare_indices(a: torch.Tensor, b: torch.Tensor, layer, site, identical_needed: float,
                    scores_a: torch.Tensor | None = None, scores_b: torch.Tensor | None = None,
                    group: int = 1, atol: float = 0.0, rtol: float = 0.0) -> SiteResult:
    """Rows of ids (-1 empty) compared as sets. With both sides' candidate scores ([rows, candidates],
    -inf where not a candidate), a differing row is a tie when the ids that differ belong to
    candidates (id // `group`: pools of `group` tokens, or experts with group 1) that score equal to
    the top-k boundary on both sides, and each side's selection is a top-k of its own scores."""
    if len(a) != len(b):
        raise ValueError(f"site {layer}/{site}: {len(a)} rows vs {len(b)}")
    jaccards = []
    for row_a, row_b in zip(a.tolist(), b.tolist()):
        sa, sb = {x for x in row_a if x >= 0}, {x for x in row_b if x >= 0}
        union = sa | sb
        jaccards.append(len(sa & sb) / len(union) if union else 1.0)
    kinds = classify_rows(a, b, scores_a, scores_b, group, atol, rtol)
    n = max(1, len(kinds))
    frac = {k: kinds.count(k) / n for k in ("identical", "tied", "different")}
    jac = torch.tensor(jaccards, dtype=torch.float64)
    return SiteResult(layer, site, "indices", jaccard=jac.mean().item() if len(jac) else 1.0,
                      identical=frac["identical"], tied=frac["tied"], different=frac["different"],
                      diverged=frac["different"] > 1 - identical_needed + 1e-12, per_row=(1 - jac).tolist())


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
    judge_logprobs = not [k for k in common if k[1] not in (*INDEX_SITES, *AUX_SITES, "logprobs")]
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
