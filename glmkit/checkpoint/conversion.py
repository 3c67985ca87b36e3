"""Was the HF -> Megatron conversion right? A torch_dist checkpoint checked against the HF checkpoint it
came from, key by key through the framework's name map (`megatron_names`), one tensor at a time.

A conversion is a copy plus a cast, so values must match exactly after the HF tensor is cast to the
dtype the checkpoint stores (`atol` loosens that for checkpoints written through another cast path).
Memory: the stored tensor being checked (at most the largest one, a layer's stacked experts) plus one
HF tensor or one expert.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from glmkit.checkpoint.hf import Checkpoint, CheckpointError, count_nonfinite, open_checkpoint
from glmkit.checkpoint.megatron_names import ALPHAS, CAT, COPY, PICK, STACK, Rule, megatron_rules
from glmkit.checkpoint.names import LM_HEAD, TEXT_PREFIX, checkpoint_key
from glmkit.checkpoint.torch_dist import TorchDistCheckpoint, save_torch_dist

PADDED_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")  # the vocab may be padded
MAX_LISTED = 50  # per category in the text summary (the JSON lists all)


def _is_training_state(key: str) -> bool:
    """Optimizer moments, RNG and Megatron's common state: not model weights (the framework's own readers
    skip every key containing these)."""
    return "optimizer" in key or "_state" in key


def hf_shapes(ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """The HF text tensors by the map's names (text prefix removed)."""
    return {_short(name): ckpt.info(name).shape for name in ckpt.text_keys()}


def _short(name: str) -> str:
    return name if name == LM_HEAD else name.removeprefix(TEXT_PREFIX)


class _HF:
    """HF tensors by the map's names, read from the checkpoint one at a time."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def __call__(self, name: str) -> torch.Tensor:
        return self.ckpt.get(checkpoint_key(name))


def expert_tensor(rule: Rule, e: int, read) -> torch.Tensor:
    """Expert `e` of a STACK rule: its HF tensors concatenated on dim 0."""
    return torch.cat([read(n) for n in rule.expert_names(e)], dim=0)


def megatron_tensor(rule: Rule, read) -> torch.Tensor:
    """The tensor a correct conversion stores under `rule.key`."""
    if rule.join == COPY:
        return read(rule.hf[0])
    if rule.join == PICK:
        return read(rule.hf[0]).reshape(-1)[rule.index:rule.index + 1].clone()
    if rule.join == CAT:
        return torch.cat([read(n) for n in rule.hf], dim=0)
    return torch.stack([expert_tensor(rule, e, read) for e in range(rule.experts)])


def megatron_state(hf, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of the torch_dist checkpoint the framework's conversion writes from `hf` (a path or an
    open Checkpoint), in `dtype` except the ones it keeps in fp32. Whole model in memory: for tests and
    small models (the real conversion is the framework's `convert_hf_to_torch_dist.py`)."""
    ckpt = hf if isinstance(hf, Checkpoint) else open_checkpoint(hf)
    rules = megatron_rules(ckpt.config, hf_shapes(ckpt))
    read = _HF(ckpt)
    return {key: megatron_tensor(rule, read).to(torch.float32 if rule.keeps_fp32 else dtype)
            for key, rule in rules.items()}


def framework_blobs(keys) -> dict[str, bytes]:
    """The non-tensor entries a Megatron save puts beside the weights (Transformer Engine `_extra_state`
    of each linear and norm, the RNG state, the common state), as opaque bytes: what a reader must skip."""
    blobs = {"rng_state/shard_0.0_1.1": b"\x80\x04rng", "common_state/shard_0_1": b"\x80\x04common"}
    for key in keys:
        if key.endswith(".weight") and ("linear" in key or "norm" in key or "proj" in key):
            blobs[key.rsplit(".", 1)[0] + "._extra_state/shard_0_1"] = b""
    return blobs


def write_torch_dist(hf, out, dtype: torch.dtype = torch.bfloat16, iteration: int | None = None) -> Path:
    """Convert `hf` the framework's way and save it as a torch_dist checkpoint (release/ or iter_N/)."""
    state = megatron_state(hf, dtype)
    return save_torch_dist(state, out, blobs=framework_blobs(state), iteration=iteration)


# --- the check -------------------------------------------------------------------------------------------

@dataclass
class ConversionReport:
    hf: str
    torch_dist: str
    checked: int = 0
    matched: int = 0
    missing: list = field(default_factory=list)      # {"key", "hf"}
    extra: list = field(default_factory=list)        # {"key", "shape"}
    misshaped: list = field(default_factory=list)    # {"key", "hf", "shape", "expected", "cause"}
    differing: list = field(default_factory=list)    # {"key", "hf", "max_abs_diff", "differing", "numel", "cause"}
    narrowed: list = field(default_factory=list)     # {"key", "dtype"}: a tensor the framework keeps in fp32
    mistyped: list = field(default_factory=list)     # {"key", "dtype"}: stored as integers or bool
    padded: list = field(default_factory=list)       # {"key", "rows", "expected_rows"}: vocab padding (fine)
    nonfinite: list = field(default_factory=list)    # {"key", "count", "numel"}: NaN / Inf kept from the HF side
    skipped: dict = field(default_factory=dict)      # non-tensor entries and training state, by kind

    @property
    def passed(self) -> bool:
        return not (self.missing or self.extra or self.misshaped or self.differing or self.narrowed or self.mistyped
                    or self.nonfinite)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "hf": self.hf, "torch_dist": self.torch_dist, "checked": self.checked,
                "matched": self.matched, "missing": self.missing, "extra": self.extra, "misshaped": self.misshaped,
                "differing": self.differing, "narrowed": self.narrowed, "mistyped": self.mistyped,
                "padded": self.padded, "nonfinite": self.nonfinite, "skipped": self.skipped}

    def text(self) -> str:
        lines = [f"conversion check: {self.torch_dist}\n  against {self.hf}",
                 f"  {self.checked} tensors checked, {self.matched} match; "
                 f"{len(self.missing)} missing, {len(self.extra)} extra, {len(self.misshaped)} mis-shaped, "
                 f"{len(self.differing)} differing, {len(self.narrowed)} narrowed from fp32"
                 + (f", {len(self.mistyped)} not floating point" if self.mistyped else "")
                 + (f", {len(self.nonfinite)} holding NaN or Inf" if self.nonfinite else "")]
        if self.skipped:
            lines.append("  not weights, skipped: " + ", ".join(f"{n} {kind}" for kind, n in self.skipped.items()))
        for row in self.padded:
            lines.append(f"  note: {row['key']} has {row['rows']} rows for a {row['expected_rows']}-token vocab "
                         f"(padding; the first {row['expected_rows']} rows were compared)")
        sections = [("missing", self.missing, lambda r: (f"{r['key']}: experts {_ranges(r['experts'])} of its "
                                                           f"one-key-per-expert stack" if r.get("experts") else
                                                           f"{r['key']}  (from {', '.join(r['hf'][:2])}"
                                                           f"{', ...' if len(r['hf']) > 2 else ''})")),
                    ("extra", self.extra, lambda r: f"{r['key']} {list(r['shape'])}" +
                     (f" (a second copy of {r['duplicate_of']}; which one the framework loads is unclear)"
                      if r.get("duplicate_of") else "")),
                    ("mis-shaped", self.misshaped, lambda r: f"{r['key']} {list(r['shape'])}, expected "
                                                             f"{list(r['expected'])}" + _cause(r)),
                    ("differing", self.differing, lambda r: f"{r['key']}: {r['differing']} of {r['numel']} "
                                                            f"elements, max |diff| {r['max_abs_diff']:.3g}" + _cause(r)),
                    ("narrowed", self.narrowed, lambda r: f"{r['key']} stored as {r['dtype']}; the framework "
                                                          f"keeps it in float32"),
                    ("not floating point", self.mistyped, lambda r: f"{r['key']} stored as {r['dtype']}; its HF "
                                                                    f"tensor is floating point"),
                    ("not finite", self.nonfinite, lambda r: f"{r['key']}: {r['count']} of {r['numel']} elements NaN or "
                                                             f"infinite; its HF tensors hold the same (the conversion "
                                                             f"kept them; no forward of these weights is finite)")]
        for title, rows, show in sections:
            if rows:
                lines.append(f"  {title}:")
                lines += [f"    {show(r)}" for r in rows[:MAX_LISTED]]
                if len(rows) > MAX_LISTED:
                    lines.append(f"    ... {len(rows) - MAX_LISTED} more (see --json)")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _cause(row: dict) -> str:
    return f": likely {row['cause']}" if row.get("cause") else ""


CHUNK_ELEMENTS = 1 << 22  # compared this many elements at a time: temporaries stay small beside the tensors


def _chunks(a: torch.Tensor, b: torch.Tensor):
    """Matching flat pieces of two same-shape tensors, as float64 (exact for every stored dtype)."""
    a, b = a.reshape(-1), b.reshape(-1)
    for start in range(0, a.numel(), CHUNK_ELEMENTS):
        yield a[start:start + CHUNK_ELEMENTS].double(), b[start:start + CHUNK_ELEMENTS].double()


def difference(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> tuple[float, int]:
    """Largest |difference| and how many elements differ by more than atol. NaN matches NaN (an
    element NaN on one side only differs, by inf)."""
    worst, count = 0.0, 0
    for a, e in _chunks(actual, expected):
        both_nan = a.isnan() & e.isnan()
        diff = (a - e).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
        if diff.numel():
            worst = max(worst, float(diff.max()))
        count += int((diff > atol).sum())
    return worst, count


def _equal(a: torch.Tensor, b: torch.Tensor, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if atol == 0 and a.dtype == b.dtype and torch.equal(a, b):
        return True
    return difference(a, b, atol)[1] == 0


def _scaled(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> float | None:
    """The c with actual == c * expected to the stored dtype's rounding, if there is one (not 1)."""
    if expected.numel() < 4 or not actual.is_floating_point():  # a scale fitted to a number or two says nothing
        return None
    ae = ee = 0.0
    for a, e in _chunks(actual, expected):
        ae, ee = ae + float(a @ e), ee + float(e @ e)
    if not ee > 0 or not math.isfinite(ae):
        return None
    scale = ae / ee
    eps = torch.finfo(actual.dtype).eps
    if abs(scale - 1) <= 4 * eps or scale == 0:
        return None
    for a, e in _chunks(actual, expected):
        if not bool(((a - scale * e).abs() <= 2 * eps * (scale * e).abs() + atol + 1e-30).all()):
            return None
    return scale


def _fingerprint(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def _part_sizes(rule: Rule, read_shape) -> list[int]:
    names = rule.expert_names(0) if rule.join == STACK else rule.hf
    return [read_shape(n)[0] for n in names]


_PART_NAMES = {2: ("gate", "up"), 3: ("q", "k", "v")}


def _swapped_parts(actual: torch.Tensor, expected: torch.Tensor, sizes: list[int], atol: float) -> str | None:
    """The parts of a concatenation stored in another order (gate/up halves, q/k/v convs)."""
    if len(sizes) < 2 or sum(sizes) != expected.shape[0]:
        return None
    parts = list(torch.split(expected, sizes, dim=0))
    names = _PART_NAMES.get(len(sizes), tuple(str(k) for k in range(len(sizes))))
    for order in itertools.permutations(range(len(sizes))):
        if list(order) == list(range(len(sizes))):
            continue
        stored = torch.split(actual, [sizes[k] for k in order], dim=0)  # views: no copy of the tensor
        if all(_equal(piece, parts[k], atol) for piece, k in zip(stored, order)):
            if len(sizes) == 2:
                return f"{names[0]}/{names[1]} halves swapped"
            return "parts in the order " + ", ".join(names[k] for k in order) + " (expected " + ", ".join(names) + ")"
    return None


def likely_cause(actual: torch.Tensor, expected: torch.Tensor, sizes: list[int], atol: float) -> str | None:
    """A likely cause for a differing tensor, when it is one of the usual conversion slips."""
    # fp8 has no isfinite (nor most ops): its causes are read in fp32; wider types as they are (a large
    # expert tensor is not copied)
    actual, expected = (t.float() if t.is_floating_point() and t.element_size() == 1 else t for t in (actual, expected))
    if actual.is_floating_point() and not bool(actual.isfinite().all()) and bool(expected.isfinite().all()):
        return "non-finite values (NaN or inf) where the HF tensor has none"
    if not actual.any() and expected.any():
        return "all zeros (never written?)"
    cause = _swapped_parts(actual, expected, sizes, atol)
    if cause:
        return cause
    if expected.dim() >= 1 and expected.shape[0] % 2 == 0 and expected.shape[0] >= 2 and len(sizes) < 2:
        half = expected.shape[0] // 2
        if _equal(actual[:half], expected[half:], atol) and _equal(actual[half:], expected[:half], atol):
            return "halves swapped on dim 0"
    if expected.dim() == 2 and expected.shape[0] == expected.shape[1] and _equal(actual, expected.T, atol):
        return "transposed"
    scale = _scaled(actual, expected, atol)
    return None if scale is None else f"scaled by {scale:.6g}"


class _Check:
    def __init__(self, report: ConversionReport, read, read_shape, atol: float):
        self.report, self.read, self.read_shape, self.atol = report, read, read_shape, atol

    def differs(self, rule: Rule, actual: torch.Tensor, expected: torch.Tensor, cause: str | None) -> None:
        max_abs, count = difference(actual, expected, self.atol)
        self._record(rule, max_abs, count, actual.numel(), cause)

    def _record(self, rule: Rule, max_abs: float, count: int, numel: int, cause: str | None) -> dict:
        row = {"key": rule.key, "hf": list(rule.hf[:4]) + (["..."] if len(rule.hf) > 4 else []),
               "max_abs_diff": max_abs, "differing": count, "numel": numel, "cause": cause}
        self.report.differing.append(row)
        return row

    def plain(self, rule: Rule, actual: torch.Tensor) -> bool:
        expected = megatron_tensor(rule, self.read).to(actual.dtype)
        if rule.key in PADDED_KEYS and actual.shape[0] > expected.shape[0]:
            actual = actual[:expected.shape[0]]
        if _equal(actual, expected, self.atol):
            return True
        if rule.join == PICK:
            cause = self._other_element(rule, actual)
        else:
            cause = likely_cause(actual, expected, _part_sizes(rule, self.read_shape) if rule.join == CAT else [], self.atol)
        self.differs(rule, actual, expected, cause)
        return False

    def _other_element(self, rule: Rule, actual: torch.Tensor) -> str | None:
        whole = self.read(rule.hf[0]).reshape(-1).to(actual.dtype)
        for k in range(whole.numel()):
            if k != rule.index and _equal(actual, whole[k:k + 1], self.atol):
                return f"holds {rule.hf[0]}[{k}] ({ALPHAS[k] if k < len(ALPHAS) else k}'s value)"
        return None

    def stacked(self, rule: Rule, actual: torch.Tensor) -> bool:
        """Expert by expert; an expert found elsewhere in the stack is named as a permutation."""
        sizes = _part_sizes(rule, self.read_shape)
        wrong, causes, max_abs, count = [], {}, 0.0, 0
        for e in range(rule.experts):
            expected = expert_tensor(rule, e, self.read).to(actual.dtype)
            if not _equal(actual[e], expected, self.atol):
                wrong.append(e)
                causes[e] = likely_cause(actual[e], expected, sizes, self.atol)
                worst, n = difference(actual[e], expected, self.atol)
                max_abs, count = max(max_abs, worst), count + n
        if not wrong:
            return True
        # where each wrong expert's values came from: fingerprints of every expected expert, made only
        # now (a second read of the HF experts, on a failure only)
        prints = {_fingerprint(expert_tensor(rule, e, self.read).to(actual.dtype)): e for e in range(rule.experts)}
        moved = {e: prints.get(_fingerprint(actual[e].contiguous())) for e in wrong}
        moved = {e: src for e, src in moved.items() if src is not None and src != e}
        if moved:
            shown = ", ".join(f"expert {e} holds expert {src}'s" for e, src in list(moved.items())[:4])
            cause = f"experts permuted ({len(moved)} experts hold another's weights: {shown})"
        else:
            kinds = sorted({c for c in causes.values() if c})
            cause = (f"{kinds[0]} in experts {_ranges(wrong)}" if len(kinds) == 1 and all(causes.values())
                     else (f"experts {_ranges(wrong)} differ" + (f" ({'; '.join(kinds)})" if kinds else "")))
        self._record(rule, max_abs, count, actual.numel(), cause)["experts"] = wrong
        return False


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for k, v in enumerate(values):
        if start is None:
            start = v
        if k + 1 == len(values) or values[k + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


_WRAPPERS = re.compile(r"^(?:module\.)*(?:language_model\.)?")  # DDP / Float16Module / VLM wrappers' prefixes
_PER_EXPERT = re.compile(r"^(?P<stack>.+\.mlp\.experts\.)(?:experts\.)?(?P<fc>linear_fc[12])\.weight(?P<e>\d+)$")


class _Stored:
    """The checkpoint's tensors under the map's key names: wrapper prefixes removed, and routed experts
    saved one tensor per expert (`...linear_fc1.weight{e}`, Megatron's singleton local shards) seen as
    their stack."""

    def __init__(self, dist: TorchDistCheckpoint):
        self.dist = dist
        self.keys: dict[str, str] = {}                 # map key -> stored key
        self.experts: dict[str, dict[int, str]] = {}   # stacked map key -> {expert: stored key}
        self.duplicates: list[tuple[str, str]] = []    # (stored key, the stored key it repeats)
        for key in dist.tensors:
            canonical = _WRAPPERS.sub("", key)
            match = _PER_EXPERT.match(canonical)
            if match:
                stack = f"{match['stack']}experts.{match['fc']}.weight"
                slot = self.experts.setdefault(stack, {})
                if int(match["e"]) in slot:
                    self.duplicates.append((key, slot[int(match["e"])]))
                else:
                    slot[int(match["e"])] = key
            elif canonical in self.keys:
                self.duplicates.append((key, self.keys[canonical]))
            else:
                self.keys[canonical] = key

    def names(self) -> list[str]:
        return list(self.keys) + list(self.experts)

    def __contains__(self, key: str) -> bool:
        return key in self.keys or key in self.experts

    def info(self, key: str):
        """(shape, dtype) as one tensor."""
        if key in self.keys:
            t = self.dist.tensors[self.keys[key]]
            return tuple(t.shape), t.dtype
        parts = self.experts[key]
        first = self.dist.tensors[parts[min(parts)]]
        return (max(parts) + 1,) + tuple(first.shape), first.dtype

    def absent_experts(self, key: str, experts: int) -> list[int]:
        """Experts of a one-key-per-expert stack that are not stored."""
        return sorted(set(range(experts)) - set(self.experts.get(key, {}))) if key in self.experts else []

    def get(self, key: str) -> torch.Tensor:
        if key in self.keys:
            return self.dist.get(self.keys[key])
        parts = self.experts[key]
        shape, dtype = self.info(key)
        stack = torch.empty(shape, dtype=dtype)  # filled expert by expert: one expert beside the stack
        for e in range(shape[0]):
            stack[e] = self.dist.get(parts[e])
        return stack


def verify_conversion(hf, torch_dist, atol: float = 0.0, progress: bool = True) -> ConversionReport:
    """Check the torch_dist checkpoint at `torch_dist` against the HF checkpoint at `hf`."""
    ckpt = hf if isinstance(hf, Checkpoint) else open_checkpoint(hf)
    dist = TorchDistCheckpoint(torch_dist)
    stored = _Stored(dist)
    shapes = hf_shapes(ckpt)
    try:
        rules = megatron_rules(ckpt.config, shapes)
    except ValueError as err:
        raise CheckpointError(f"{ckpt.path}: {err}") from err
    report = ConversionReport(hf=str(ckpt.path), torch_dist=str(dist.path))
    state = [k for k in dist.tensors if _is_training_state(k)]
    report.skipped = {kind: n for kind, n in (("non-tensor entries", len(dist.blobs)),
                                              ("optimizer / training-state tensors", len(state))) if n}
    report.extra = [{"key": k, "shape": list(stored.info(k)[0])} for k in stored.names()
                    if k not in rules and not _is_training_state(k)]
    report.extra += [{"key": key, "shape": list(dist.tensors[key].shape), "duplicate_of": first}
                     for key, first in stored.duplicates]
    check = _Check(report, _HF(ckpt), lambda name: shapes[name], atol)
    for key, rule in tqdm(rules.items(), desc="verify-conversion", unit="tensor", disable=not progress):
        if key not in stored:
            report.missing.append({"key": key, "hf": list(rule.hf)})
            continue
        expected_shape = rule.shape(shapes)
        absent = stored.absent_experts(key, expected_shape[0]) if rule.join == STACK else []
        if absent:
            report.missing.append({"key": key, "hf": list(rule.hf[:4]), "experts": absent})
            continue
        report.checked += 1
        shape, dtype = stored.info(key)
        if not dtype.is_floating_point:
            report.mistyped.append({"key": key, "dtype": str(dtype).replace("torch.", "")})
            continue
        if rule.keeps_fp32 and dtype != torch.float32:
            report.narrowed.append({"key": key, "dtype": str(dtype).replace("torch.", "")})
        if shape != expected_shape:
            if key in PADDED_KEYS and shape[1:] == expected_shape[1:] and shape[0] > expected_shape[0]:
                report.padded.append({"key": key, "rows": shape[0], "expected_rows": expected_shape[0]})
            else:
                report.misshaped.append({"key": key, "hf": list(rule.hf[:4]), "shape": list(shape),
                                         "expected": list(expected_shape),
                                         "cause": _shape_cause(rule, stored, shape, expected_shape, check)})
                continue
        actual = stored.get(key)
        good = check.stacked(rule, actual) if rule.join == STACK else check.plain(rule, actual)
        report.matched += int(good)
        if good and (bad := count_nonfinite(actual)):  # NaN matched NaN: faithful, and still unusable weights
            report.nonfinite.append({"key": key, "count": bad, "numel": actual.numel()})
        del actual
    return report


def _shape_cause(rule: Rule, stored: _Stored, shape: tuple, expected_shape: tuple, check: _Check) -> str | None:
    """Transposed (stored as [cols, rows]), or the experts' stack laid out on another dim."""
    if len(shape) == 2 and tuple(reversed(shape)) == tuple(expected_shape) and rule.join != STACK:
        actual = stored.get(rule.key)
        expected = megatron_tensor(rule, check.read).to(actual.dtype)
        return "transposed" if _equal(actual.T, expected, check.atol) else "transposed shape (values differ too)"
    if rule.join == STACK and len(shape) == 3 and shape[0] == expected_shape[0] and \
            tuple(shape[1:]) == tuple(reversed(expected_shape[1:])):
        return "each expert transposed"
    return None
