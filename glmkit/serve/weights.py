"""Does the engine hold the checkpoint's weights? A running SGLang-protocol server asked for tensors by
name (SGLang's `/get_weights_by_name`, which answers each tensor's first rows as float32 lists) and
compared with the checkpoint, so a weight sync that went wrong is found before a rollout is spent.

An engine may hold a tensor in a narrower dtype than the checkpoint: a value matches when it equals the
checkpoint's exactly or rounded to bfloat16 / float16 (rounding is the only change a correct load makes).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from glmkit.checkpoint import open_checkpoint
from glmkit.checkpoint.conversion import likely_cause, difference
from glmkit.checkpoint.names import LM_HEAD, TEXT_PREFIX
from glmkit.serve.client import SGLangClient, SGLangError

_ROUNDINGS = (("float32", None), ("bfloat16", torch.bfloat16), ("float16", torch.float16))


def engine_name(checkpoint_name: str) -> str:
    """The name SGLang's model holds a checkpoint tensor under (`model.language_model.` -> `model.`)."""
    return checkpoint_name if checkpoint_name == LM_HEAD else "model." + checkpoint_name.removeprefix(TEXT_PREFIX)


def sample_names(names: list[str], count: int, seed: int) -> list[str]:
    """`count` names (0: all): the embedding, final norm and head always, the rest drawn with `seed`; in
    checkpoint order."""
    if count <= 0 or count >= len(names):
        return list(names)
    always = [n for n in names if n in (TEXT_PREFIX + "embed_tokens.weight", TEXT_PREFIX + "norm.weight", LM_HEAD)]
    rest = [n for n in names if n not in always]
    chosen = set(always[:count]) | set(random.Random(seed).sample(rest, max(0, count - len(always))))
    return [n for n in names if n in chosen]


@dataclass
class EngineReport:
    url: str
    hf: str
    rows: int
    sampled: int = 0
    matched: list = field(default_factory=list)      # {"name", "as"}: as float32 / bfloat16 / float16
    differing: list = field(default_factory=list)    # {"name", "max_abs_diff", "differing", "numel", "cause"}
    misshaped: list = field(default_factory=list)    # {"name", "shape", "expected"}
    unavailable: list = field(default_factory=list)  # {"name", "reason"}: the engine did not answer for it
    nonfinite: list = field(default_factory=list)    # {"name", "count", "numel"}: NaN / inf held (null answered)

    @property
    def passed(self) -> bool:
        return not (self.differing or self.misshaped or self.unavailable or self.nonfinite)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "fail"

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "url": self.url, "hf": self.hf, "rows": self.rows, "sampled": self.sampled,
                "matched": self.matched, "differing": self.differing, "misshaped": self.misshaped,
                "unavailable": self.unavailable, "nonfinite": self.nonfinite}

    def text(self) -> str:
        rounded = {}
        for row in self.matched:
            rounded[row["as"]] = rounded.get(row["as"], 0) + 1
        lines = [f"engine weights: {self.url}\n  against {self.hf} (first {self.rows} rows of each tensor)",
                 f"  {self.sampled} tensors asked for, {len(self.matched)} match"
                 + (f" ({', '.join(f'{n} as {k}' for k, n in rounded.items())})" if rounded else "")
                 + f"; {len(self.differing)} differing, {len(self.misshaped)} mis-shaped, "
                   f"{len(self.unavailable)} not answered"
                 + (f", {len(self.nonfinite)} holding NaN or inf" if self.nonfinite else "")]
        for row in self.differing:
            lines.append(f"  differing: {row['name']}: {row['differing']} of {row['numel']} elements, max |diff| "
                         f"{row['max_abs_diff']:.3g}" + (f": likely {row['cause']}" if row["cause"] else ""))
        for row in self.misshaped:
            lines.append(f"  mis-shaped: {row['name']}: engine {row['shape']}, checkpoint {row['expected']}")
        for row in self.nonfinite[:10]:
            lines.append(f"  not finite: {row['name']}: the engine holds {row['count']} NaN or infinite values in the "
                         f"{row['numel']} answered (null in its answer; no forward of them is finite)")
        for row in self.unavailable[:10]:
            lines.append(f"  not answered: {row['name']}: {row['reason']}")
        if len(self.unavailable) > 10:
            lines.append(f"  ... {len(self.unavailable) - 10} more not answered")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, non-finite matching non-finite (the answer's null does not say which)."""
    fa, fb = a.isfinite(), b.isfinite()
    return torch.equal(fa, fb) and torch.equal(a[fa], b[fb])


def _match(got: torch.Tensor, expected: torch.Tensor) -> str | None:
    for label, dtype in _ROUNDINGS:
        if _same(got, expected if dtype is None else expected.to(dtype).float()):
            return label
    return None


def verify_engine(hf, url: str, sample: int = 64, rows: int = 100, seed: int = 0, progress: bool = True,
                  client: SGLangClient | None = None) -> EngineReport:
    """Compare `sample` tensors (0: all) of the checkpoint at `hf` with what the server at `url` holds."""
    if sample < 0 or rows < 1:
        raise ValueError(f"need sample >= 0 (0: every tensor) and rows >= 1; got {sample}, {rows}")
    ckpt = open_checkpoint(hf)
    client = client or SGLangClient(url, timeout_s=120, retries=2)
    report = EngineReport(url=client.shown, hf=str(ckpt.path), rows=rows)
    names = sample_names(ckpt.text_keys(), sample, seed)
    for name in tqdm(names, desc="verify-engine", unit="tensor", disable=not progress):
        report.sampled += 1
        try:
            answer = client.get_weights_by_name(engine_name(name), truncate_size=rows)
        except SGLangError as err:
            if not re.search(r"HTTP \d{3}", str(err)):
                raise  # the server is gone or unreachable: no verdict
            report.unavailable.append({"name": name, "reason": str(err).split(": ", 1)[-1][:300]})
            continue
        expected = ckpt.get(name)
        expected = (expected[:rows] if expected.dim() else expected).float()
        try:  # null is a non-finite value (SGLang's orjson writes NaN and inf as null)
            got = torch.from_numpy(np.array(answer, dtype=np.float32))
        except (TypeError, ValueError) as err:
            report.unavailable.append({"name": name, "reason": f"the answer is not a tensor ({err})"})
            continue
        if bad := int((~got.isfinite()).sum()):  # matching or not (a bf16 cast of 3.4e38 is inf): a finding
            report.nonfinite.append({"name": name, "count": bad, "numel": got.numel()})
        if got.dim() == expected.dim() + 1 and got.shape[1:] == expected.shape and got.shape[0] > 0:
            # SGLang with data parallelism answers one copy per DP rank: every copy must hold the weights
            copies = [_match(copy, expected) for copy in got]
            if all(copies):
                report.matched.append({"name": name, "as": copies[0], "copies": len(copies)})
                continue
            got = got[next(k for k, c in enumerate(copies) if not c)]
        if got.shape != expected.shape:
            report.misshaped.append({"name": name, "shape": list(got.shape), "expected": list(expected.shape)})
            continue
        matched = _match(got, expected)
        if matched:
            report.matched.append({"name": name, "as": matched})
            continue
        max_abs, count = difference(got, expected, 0.0)
        report.differing.append({"name": name, "max_abs_diff": max_abs, "differing": count, "numel": got.numel(),
                                 "cause": likely_cause(got, expected, [], 0.0)})
    if report.unavailable and len(report.unavailable) == report.sampled:
        raise ConnectionError(f"{client.shown}: the engine answered /get_weights_by_name for none of the {report.sampled} "
                              f"tensors asked for (first: {report.unavailable[0]['reason']}); an SGLang model class "
                              f"without get_weights_by_name (SGLang's glm5_next has none) cannot be checked this way")
    return report
