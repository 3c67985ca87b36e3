"""How two computations of the same thing are compared, in one place: error measures, the thresholds
a verdict uses per dtype, and the tie rule for top-k selections. `glmkit check`, `glmkit parity`
(end to end, streaming, gradients), the training loop's replay checks, the benchmarks and the tests
all measure with these.

Values: max |a - b|, relative RMS ||a - b|| / ||a|| (the ratio fla's tests use), cosine, NaN/Inf
counts, and the error per token row. Selections (indexer top-k, router experts): Jaccard overlap of
the row sets, and each row counted as identical, tied (the sets differ only in pools or experts that
score equal to the top-k boundary on both sides, within the dtype's tie tolerance) or different.
A value site diverges when its relative RMS is over the dtype's threshold; a selection site when
more than 1 - `identical` of its rows are different (ties do not count).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# Defaults: fp32 paths agree to ~1e-6 (the reference's own padding floor is ~1.5e-5); bf16 rounds
# every activation (2^-8 relative) and through a few layers lands at ~1e-2.
# `logprob_abs` bounds the largest |train - rollout| log-prob of one token (glmkit check).
THRESHOLDS = {
    "float32": {"rel_rms": 1e-4, "identical": 0.99, "logprob_abs": 1e-4},
    "bfloat16": {"rel_rms": 5e-2, "identical": 0.9, "logprob_abs": 5e-2},
}
# When two scores count as equal for a tie: |s - boundary| <= atol + rtol |boundary|. fp32 paths
# compute the same fp32 scores in another order (~1e-7 relative); bf16 paths feed the scores bf16
# activations rounded at 2^-8, so near-equal there means within about one bf16 step.
TIE_TOLERANCE = {"float32": {"atol": 1e-6, "rtol": 1e-5}, "bfloat16": {"atol": 1e-3, "rtol": 1e-2}}


# Gradients sum every token's contribution in an order each path picks: a small parameter (an mHC
# scale of 3 values) lands at ~1e-4 relative between two correct fp32 paths, so the fp32 bound is 1e-3
# (an injected 1.05x error is 5e-2); bf16 keeps its activation bound, doubled.
GRADIENT_THRESHOLDS = {"float32": {"rel_rms": 1e-3}, "bfloat16": {"rel_rms": 1e-1}}


def dtype_name(dtype) -> str:
    """'float32' / 'bfloat16' for a torch dtype or its name; the keys of the tables above."""
    name = str(dtype).removeprefix("torch.")
    if name not in THRESHOLDS:
        raise ValueError(f"no thresholds for dtype {name!r}; allowed: {', '.join(THRESHOLDS)}")
    return name


def rel_rms(ref: torch.Tensor, x: torch.Tensor) -> float:
    """||ref - x|| / ||ref|| in float64 (0 / 0 counts as 0)."""
    ref64 = ref.double()
    return ((ref64 - x.double()).norm() / ref64.norm().clamp_min(1e-30)).item()


def row_rel_rms(ref: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """rel_rms per leading row: [rows] float64."""
    ref64 = ref.double().reshape(len(ref), -1)
    return (ref64 - x.double().reshape(len(x), -1)).norm(dim=-1) / ref64.norm(dim=-1).clamp_min(1e-30)


def tied_layers(results) -> list:
    """The layers whose DSA selections differ only by ties somewhere: where the automatic top-k replay
    applies (run the second path again with the first path's selections, then compare like for like)."""
    return [r.layer for r in results if r.site == "indexer_topk" and r.tied]


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


