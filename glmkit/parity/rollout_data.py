"""Which side departs, engine or trainer? The framework's own rollout data (`--save-debug-rollout-data`)
recomputed through the transformers reference and glmkit's train path, token by token.

The file is what miles writes: `torch.save({"rollout_id", "metadata", "samples": [Sample.to_dict()]})`,
each sample with `tokens` (prompt + response), `response_length`, `rollout_log_probs` (the engine's, one
per response token), `loss_mask` (or None: every token), `status`, `index`, `group_index`, `reward`, ...
and, with routing replay, numpy arrays. It is read with `torch.load(weights_only=True)` and numpy's
array types allowed, nothing else: a file that needs pickle (custom classes in it) is refused by name.

The trainer side is the trainer's own log-probs when given (the framework's `--save-debug-train-data`
file of a rank, whose `rollout_data` holds `tokens` and `log_probs`; samples matched by their tokens),
else glmkit's train path on the checkpoint as its stand-in. Numbers, as the framework computes
`train/train_rollout_logprob_abs_diff`: per sample the masked mean over response tokens of |a - b|,
then the mean over samples.
"""

from __future__ import annotations

import math
import pickle
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmkit.bounds import FLOAT32_MAX
from tqdm import tqdm

from glmkit.inputs import UNPICKLE_ERRORS, check_loaded_tensors, not_a_file, shown_key

DEFAULT_THRESHOLD = 0.02  # mean |logp - reference| per sample; the recipe's healthy abs diff is ~0.007
WORST_TOKENS = 8
PROFILE_BINS = 32
SIDES = ("engine", "trainer")


def _numpy_globals() -> list:
    """numpy's array and scalar reconstruction, under the names numpy 2 and numpy 1 files use."""
    import numpy as np

    allowed = [np.ndarray, np.dtype]
    reconstruct = getattr(np._core.multiarray, "_reconstruct", None) if hasattr(np, "_core") else None
    scalar = getattr(np._core.multiarray, "scalar", None) if hasattr(np, "_core") else None
    for fn, name in ((reconstruct, "_reconstruct"), (scalar, "scalar")):
        if fn is not None:
            allowed += [fn, (fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
    allowed += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    return allowed


def _load(path: Path, what: str):
    if (why := not_a_file(path)) == "no such file":
        raise FileNotFoundError(f"{path}: not found")
    if why is not None:
        raise ValueError(f"{path}: {why}; {what} is one .pt file")
    try:
        # torch warns before failing on a legacy (non-zip) pickle: the one-line error below says it all
        with torch.serialization.safe_globals(_numpy_globals()), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)|(REDUCE|BUILD|INST|OBJ)", str(err))
        if not found:
            raise ValueError(f"{path}: not a readable torch.save file (damaged or another format)") from None
        raise ValueError(f"{path}: needs pickle to read ({found.group(1) or found.group(2)}); glmkit reads {what} with "
                         f"torch.load(weights_only=True) only (tensors, numbers, strings, lists, dicts, numpy "
                         f"arrays), never arbitrary classes") from None
    except UNPICKLE_ERRORS as err:
        raise ValueError(f"{path}: not a readable torch.save file ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200] if str(err) else 'truncated'})") from None
    check_loaded_tensors(loaded, str(path))
    return loaded


def _int_list(value, where: str) -> list[int]:
    if hasattr(value, "tolist"):  # a tensor or a numpy array
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{where}: expected a flat list of token ids")
    return list(value)


def _integer(value, where: str, expected: str):
    """An integer as the file holds it: a Python int, a numpy integer, or a 0-d integer tensor or
    array; anything else (a float 2.7, a list, a tensor of several values, a bool) refused by name."""
    import numpy as np

    if isinstance(value, (torch.Tensor, np.ndarray)):
        kind = value.dtype
        integral = (not value.is_floating_point() and not value.is_complex() and kind != torch.bool) \
            if isinstance(value, torch.Tensor) else value.dtype.kind in "iu"
        if value.ndim != 0 or not integral:
            raise ValueError(f"{where}: a {type(value).__name__} of shape {list(value.shape)} and dtype "
                             f"{str(kind).removeprefix('torch.')}; expected {expected}")
        value = value.item()
    elif isinstance(value, np.integer):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: {value!r:.40}; expected {expected}")
    return value


def _floats(value: list, where: str) -> list[float]:
    """The values as floats; one past float32's range is infinite, as the framework's fp32 tensors
    would hold it (a log-prob of 1e308 is not a number any side computed: it counts as non-finite)."""
    try:
        floats = [float(v) for v in value]
    except OverflowError:  # an int past a float's range
        raise ValueError(f"{where}: holds a number too large for a float") from None
    return [math.copysign(math.inf, v) if abs(v) > FLOAT32_MAX else v for v in floats]


def _float_list(value, n: int, where: str, bools: bool = False) -> list[float]:
    """`n` finite numbers; True/False only where `bools` (a mask), never as a log-prob."""
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (int, float)) and (bools or not isinstance(v, bool)) for v in value):
        raise ValueError(f"{where}: expected a list of {n} numbers" + ("" if bools else " (not booleans)"))
    if len(value) != n:
        raise ValueError(f"{where}: {len(value)} values for {n} response tokens")
    return _floats(value, where)


def _plain(value, where: str):
    """A label the report writes as it is (an id, an index, a reward): None, a bool, a number or a
    string; a numpy or 0-d tensor scalar becomes its number; anything else is refused by name."""
    import numpy as np

    if (isinstance(value, torch.Tensor) and value.dim() == 0) or isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{where}: a {type(value).__name__}; expected a number or a string")


@dataclass
class RolloutSample:
    """One sample of the file, validated: tokens = prompt + response."""

    position: int          # place in the file
    index: object          # the sample's own `index` (None when absent)
    group_index: object
    status: str
    reward: object
    tokens: list
    response_length: int
    engine: list           # rollout_log_probs
    mask: list             # loss_mask (1 = counted)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length


@dataclass
class RolloutData:
    path: str
    rollout_id: object
    metadata: dict
    samples: list


def load_rollout_data(path, vocab_size: int | None = None) -> RolloutData:
    """The framework's debug rollout data, validated sample by sample (errors name the sample and key)."""
    path = Path(path)
    raw = _load(path, "rollout data")
    if not isinstance(raw, dict) or not isinstance(raw.get("samples"), list):
        raise ValueError(f"{path}: not the framework's rollout data: expected a dict with a 'samples' list "
                         f"(--save-debug-rollout-data), got {type(raw).__name__}"
                         + (f" with keys {sorted(map(shown_key, raw))[:8]}" if isinstance(raw, dict) else ""))
    samples = []
    # a file may refer to one stored list from many samples (torch.save keeps one copy of an object
    # shared): each is validated once and shared, not copied per sample (a 500 KB file referring to
    # one sample 250000 times took 167 s and 2.9 GB to read)
    read = {}

    def once(value, what, make):
        key = (id(value), what)
        if key not in read:
            read[key] = (value, make())  # the value kept with it, so its id is not reused meanwhile
        return read[key][1]

    for k, s in enumerate(raw["samples"]):
        where = f"{path}: samples[{k}]"
        if not isinstance(s, dict):
            raise ValueError(f"{where}: expected a dict (Sample.to_dict()), got {type(s).__name__}")
        for key in ("tokens", "response_length", "rollout_log_probs"):
            if s.get(key) is None:
                raise ValueError(f"{where}: no {key!r} (the engine's log-probs are saved only when the rollout "
                                 f"asked for them)" if key == "rollout_log_probs" else f"{where}: no {key!r}")
        tokens = once(s["tokens"], "tokens", lambda: _int_list(s["tokens"], f"{where}.tokens"))
        if len(tokens) < 2:
            raise ValueError(f"{where}.tokens: {len(tokens)} token(s); a sample holds at least 2 (its prompt and "
                             f"its response)")
        expected = f"an integer from 1 to {len(tokens) - 1} (the tokens hold prompt + response)"
        length = _integer(s["response_length"], f"{where}.response_length", expected)
        if not 0 < length < len(tokens):
            raise ValueError(f"{where}.response_length: {length!r}; expected 1 to {len(tokens) - 1} "
                             f"(the tokens hold prompt + response)")
        bad = None if vocab_size is None else once(
            tokens, "outside the vocabulary", lambda: next((t for t in tokens if not 0 <= t < vocab_size), None))
        if bad is not None:
            raise ValueError(f"{where}.tokens: token id {bad} is outside the checkpoint's vocabulary of {vocab_size}")
        engine = once(s["rollout_log_probs"], ("log-probs", length),
                      lambda: _float_list(s["rollout_log_probs"], length, f"{where}.rollout_log_probs"))
        mask = [1] * length if s.get("loss_mask") is None else once(
            s["loss_mask"], ("mask", length), lambda: _mask_list(s["loss_mask"], length, f"{where}.loss_mask"))
        reward = s.get("reward")
        samples.append(RolloutSample(k, _plain(s.get("index"), f"{where}.index"),
                                     _plain(s.get("group_index"), f"{where}.group_index"),
                                     str(_plain(s.get("status"), f"{where}.status") or ""),
                                     reward if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None,
                                     tokens, length, engine, mask))
    if not samples:
        raise ValueError(f"{path}: the file holds no samples")
    if not any(any(s.mask) for s in samples):  # nothing counted: a 0 difference would pass unseen
        raise ValueError(f"{path}: every sample's loss_mask is all zeros: no response token is counted, so there "
                         f"is nothing to compare")
    metadata = raw.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ValueError(f"{path}: metadata is a {type(metadata).__name__}; the framework writes a dict")
    return RolloutData(str(path), _plain(raw.get("rollout_id"), f"{path}: rollout_id"), metadata or {}, samples)


def load_trainer_logprobs(path) -> dict[tuple, list[float]]:
    """The trainer's own log-probs from a `--save-debug-train-data` file (one rank): response tokens'
    log-probs keyed by the sample's whole token sequence."""
    path = Path(path)
    raw = _load(path, "train data")
    data = raw.get("rollout_data") if isinstance(raw, dict) else None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not the framework's train data: expected a dict with 'rollout_data'")
    cp_size = raw.get("cp_size")
    cp_size = 1 if cp_size is None else _integer(cp_size, f"{path}: cp_size", "a positive integer")
    if cp_size < 1:
        raise ValueError(f"{path}: cp_size {cp_size!r:.40}; expected a positive integer")
    if cp_size > 1:
        raise ValueError(f"{path}: written with context parallelism (cp_size {cp_size}): each rank holds a "
                         f"slice of every sample; glmkit reads cp_size 1 train data only")
    for key in ("tokens", "log_probs"):
        if not isinstance(data.get(key), (list, tuple)):
            raise ValueError(f"{path}: rollout_data[{key!r}] is missing or not a list (keys: {sorted(map(shown_key, data))[:12]})")
    if len(data["tokens"]) != len(data["log_probs"]):
        raise ValueError(f"{path}: rollout_data has {len(data['tokens'])} token sequences but "
                         f"{len(data['log_probs'])} log-prob lists")
    out = {}
    for k, (tokens, logp) in enumerate(zip(data["tokens"], data["log_probs"])):
        tokens = tuple(_int_list(tokens, f"{path}: rollout_data.tokens[{k}]"))
        where = f"{path}: rollout_data.log_probs[{k}]"
        values = logp.tolist() if hasattr(logp, "tolist") else logp
        if not isinstance(values, (list, tuple)) or not all(isinstance(v, (int, float)) for v in values):
            raise ValueError(f"{where}: expected a flat list (or 1-D tensor) of numbers")
        out[tokens] = _floats(values, where)
    return out


# --- attribution -----------------------------------------------------------------------------------------

def _masked_mean(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    diff = torch.nan_to_num((a - b).abs(), nan=0.0, posinf=0.0, neginf=0.0)  # as the framework's metric
    return float((diff * mask).sum() / mask.sum().clamp(min=1))


@dataclass
class SampleAttribution:
    sample: RolloutSample
    reference: list
    trainer: list
    trainer_source: str
    engine_vs_reference: float = 0.0
    trainer_vs_reference: float = 0.0
    engine_vs_trainer: float = 0.0
    departs: str = "none"
    worst_tokens: list = field(default_factory=list)
    # counted tokens whose log-prob is NaN or infinite: the means above zero them (as the framework's
    # metric does), so they are counted here and shown instead of a misleading small mean
    engine_nonfinite: int = 0
    trainer_nonfinite: int = 0

    def to_json(self) -> dict:
        s = self.sample
        return {"index": s.index if s.index is not None else s.position, "position_in_file": s.position,
                "group_index": s.group_index, "status": s.status,
                "reward": s.reward if isinstance(s.reward, (int, float)) else None,
                "prompt_length": s.prompt_length, "response_length": s.response_length,
                "masked_tokens": sum(s.mask), "engine_vs_reference": self.engine_vs_reference,
                "trainer_vs_reference": self.trainer_vs_reference, "engine_vs_trainer": self.engine_vs_trainer,
                "engine_nonfinite_tokens": self.engine_nonfinite, "trainer_nonfinite_tokens": self.trainer_nonfinite,
                "trainer_source": self.trainer_source, "departs": self.departs, "worst_tokens": self.worst_tokens}


@dataclass
class RolloutAttribution:
    path: str
    checkpoint: str
    rollout_id: object
    threshold: float
    trainer_source: str
    samples: list
    logprob_abs_diff: float
    position_profile: dict

    @property
    def departing(self) -> list:
        return [a for a in self.samples if a.departs != "none"]

    @property
    def verdict(self) -> str:
        return "fail" if self.departing else "pass"

    def sides(self) -> dict:
        """How many samples depart on each side."""
        out = {"engine": 0, "trainer": 0, "both": 0, "none": 0}
        for a in self.samples:
            out[a.departs] += 1
        return out

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "rollout_data": self.path, "checkpoint": self.checkpoint,
                "rollout_id": self.rollout_id, "threshold": self.threshold, "trainer_source": self.trainer_source,
                "logprob_abs_diff": self.logprob_abs_diff, "departs": self.sides(),
                "samples": [a.to_json() for a in self.samples], "position_profile": self.position_profile}

    def text(self) -> str:
        sides = self.sides()
        lines = [f"rollout data: {self.path} (rollout {_label(self.rollout_id)}, {len(self.samples)} samples)",
                 f"  against {self.checkpoint}; trainer side: {self.trainer_source}",
                 f"  train/train_rollout_logprob_abs_diff = {self.logprob_abs_diff:.4g}",
                 f"  departs (mean |diff| vs the reference > {self.threshold:g}): engine {sides['engine']}, "
                 f"trainer {sides['trainer']}, both {sides['both']}, none {sides['none']}",
                 f"  {'sample':>6} {'engine-ref':>11} {'trainer-ref':>11} {'engine-trainer':>14}  departs"]
        shown = sorted(self.samples, key=severity)[:20]
        for a in shown:
            j = a.to_json()
            engine, trainer = _mean_cell(a.engine_vs_reference, a.engine_nonfinite), \
                _mean_cell(a.trainer_vs_reference, a.trainer_nonfinite)
            pair = _mean_cell(a.engine_vs_trainer, max(a.engine_nonfinite, a.trainer_nonfinite))
            lines.append(f"  {_label(j['index']):>6} {engine:>11} {trainer:>11} {pair:>14}  {a.departs}")
        if len(self.samples) > len(shown):
            lines.append(f"  ... {len(self.samples) - len(shown)} more samples (see --json)")
        for a in self.departing[:5]:
            worst = ", ".join(f"pos {w['position']} (token {w['token']}): engine {w['engine']:.4g}, reference "
                              f"{w['reference']:.4g}, trainer {w['trainer']:.4g}" for w in a.worst_tokens[:3])
            lines.append(f"  sample {_label(a.to_json()['index'])} worst: {worst}")
        nonfinite = sum(a.engine_nonfinite + a.trainer_nonfinite for a in self.samples)
        if nonfinite:
            lines.append(f"  {nonfinite} counted log-probs are NaN or infinite (shown as 'nonfinite:N'); the abs "
                         f"diff above counts them as 0, as the framework's metric does")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _label(value, limit: int = 40) -> str:
    """An id or index from the file as the terminal shows it: text with control characters (an escape
    sequence, a newline forging a line of the report) as its repr, and no longer than `limit`."""
    text = str(value)
    if not text.isprintable():
        text = repr(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _mask_list(value, length: int, where: str) -> list[int]:
    """A loss mask: one 0 or 1 (or bool) per response token, as the framework builds it; a NaN, a 2 or a
    0.5 is refused by position (read as truthy it would have been counted)."""
    values = _float_list(value, length, where, bools=True)
    odd = next(((k, v) for k, v in enumerate(values) if v not in (0, 1)), None)
    if odd is not None:
        raise ValueError(f"{where}[{odd[0]}] is {odd[1]!r}; a loss mask holds 0 or 1 per response token")
    return [int(v) for v in values]


def _mean_cell(mean: float, nonfinite: int) -> str:
    return f"nonfinite:{nonfinite}" if nonfinite else f"{mean:.3e}"


def severity(a: SampleAttribution) -> tuple:
    """Sort key, worst first: departing samples (a non-finite log-prob departs whatever its mean), then
    by the larger mean difference against the reference."""
    return (a.departs == "none", -max(a.engine_vs_reference, a.trainer_vs_reference))


def _profile(attributions: list, bins: int = PROFILE_BINS) -> dict:
    """Mean |side - reference| by response position, in at most `bins` equal position bins."""
    longest = max(a.sample.response_length for a in attributions)
    width = max(1, math.ceil(longest / bins))
    n = math.ceil(longest / width)
    sums = {side: torch.zeros(n, dtype=torch.float64) for side in SIDES}
    counts = torch.zeros(n, dtype=torch.float64)
    for a in attributions:
        mask = torch.tensor(a.sample.mask, dtype=torch.float64)
        slot = torch.arange(a.sample.response_length) // width
        ref = torch.tensor(a.reference, dtype=torch.float64)
        for side, values in (("engine", a.sample.engine), ("trainer", a.trainer)):
            diff = torch.nan_to_num((torch.tensor(values, dtype=torch.float64) - ref).abs(), nan=0.0)
            sums[side].index_add_(0, slot, diff * mask)
        counts.index_add_(0, slot, mask)
    return {"bin_start": [k * width for k in range(n)], "bin_width": width, "tokens": counts.tolist(),
            **{side: (sums[side] / counts.clamp(min=1)).tolist() for side in SIDES}}


LOGIT_ROWS = 2048  # the reference's head applied this many positions at a time: [rows, vocab] fp32 at most


@torch.no_grad()
def reference_response_logprobs(model, tokens: list, start: int, temperature: float) -> list[float]:
    """log p(tokens[t] | tokens[:t]) for t >= start under the transformers reference: its hidden states
    once, its head over the response positions in chunks (full logits of a 32k-token sequence at a
    154880-token vocabulary would be 20 GB)."""
    ids = torch.tensor([tokens], device=model.device)
    hidden = model.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0]
    targets = torch.tensor(tokens[start:], device=hidden.device)
    out = []
    for r0 in range(start - 1, len(tokens) - 1, LOGIT_ROWS):
        rows = hidden[r0:min(r0 + LOGIT_ROWS, len(tokens) - 1)]
        logp = torch.log_softmax(model.lm_head(rows).float() / temperature, dim=-1)
        picked = targets[r0 - start + 1:r0 - start + 1 + rows.shape[0]]
        out.append(logp.gather(-1, picked[:, None])[:, 0])
    return torch.cat(out).cpu().tolist()


def attribute(data: RolloutData, checkpoint, device: str = "cpu", dtype: torch.dtype = torch.float32,
              backends=None, threshold: float = DEFAULT_THRESHOLD, temperature: float = 1.0,
              trainer_logprobs: dict | None = None, progress: bool = True) -> RolloutAttribution:
    """Recompute every sample's response log-probs through the reference and the trainer side and tell,
    per sample, which side departs from the reference."""
    from glmkit.bounds import check_sequence_fits
    from glmkit.checkpoint import open_checkpoint
    from glmkit.model import TrainPath, load_model
    from glmkit.reference import load_reference

    if not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the framework divides the logits by it), got {temperature}")
    longest = max(data.samples, key=lambda s: len(s.tokens))  # checked before any model is loaded
    check_sequence_fits(open_checkpoint(checkpoint).config, len(longest.tokens), device,
                        f"{data.path}: samples[{longest.position}]")
    reference = load_reference(checkpoint, dtype, device)
    trainer = None if trainer_logprobs is not None else TrainPath(load_model(checkpoint, dtype, device), backends)
    source = "the trainer's own log-probs (train data)" if trainer_logprobs is not None else \
        "glmkit's train path (stand-in for the trainer)"
    out = []
    for s in tqdm(data.samples, desc="rollout-data", unit="sample", disable=not progress):
        start = s.prompt_length
        with torch.no_grad():
            ref = reference_response_logprobs(reference, s.tokens, start, temperature)
            if not all(math.isfinite(v) for v in ref):  # the yardstick itself: nothing can be judged against it
                from glmkit.model import largest_weight

                raise ValueError(f"{checkpoint}: the reference's log-probs of samples[{s.position}] are NaN or "
                                 f"infinite ({sum(not math.isfinite(v) for v in ref)} of {len(ref)}): the checkpoint's "
                                 f"weights overflow the forward (its largest |weight| is "
                                 f"{largest_weight(reference, key=str)}); neither side can be judged")
            if trainer is not None:
                train = trainer.forward([s.tokens], temperature=temperature).logprobs[start - 1:len(s.tokens) - 1]
                train = train.float().cpu().tolist()
            else:
                train = trainer_logprobs.get(tuple(s.tokens))
                if train is None:
                    raise ValueError(f"{data.path}: samples[{s.position}] has no entry in the train data (matched by "
                                     f"its tokens); give the train data of the rank that trained it")
                if len(train) != s.response_length:
                    raise ValueError(f"train data: {len(train)} log-probs for samples[{s.position}]'s "
                                     f"{s.response_length} response tokens")
        out.append(_attribute_sample(s, ref, train, source, threshold))
    mean = sum(a.engine_vs_trainer for a in out) / len(out)
    return RolloutAttribution(data.path, str(checkpoint), data.rollout_id, threshold, source, out, mean, _profile(out))


def _attribute_sample(s: RolloutSample, ref: list, train: list, source: str, threshold: float) -> SampleAttribution:
    engine, reference, trainer = (torch.tensor(v, dtype=torch.float64) for v in (s.engine, ref, train))
    mask = torch.tensor(s.mask, dtype=torch.float64)
    a = SampleAttribution(s, ref, train, source, _masked_mean(engine, reference, mask),
                          _masked_mean(trainer, reference, mask), _masked_mean(engine, trainer, mask))
    # a non-finite log-prob on a counted token departs, whatever the mean (the framework's metric zeroes it)
    counted = mask > 0
    a.engine_nonfinite = int((~engine[counted].isfinite()).sum())
    a.trainer_nonfinite = int((~trainer[counted].isfinite()).sum())
    engine_off = a.engine_vs_reference > threshold or a.engine_nonfinite > 0
    trainer_off = a.trainer_vs_reference > threshold or a.trainer_nonfinite > 0
    a.departs = "both" if engine_off and trainer_off else "engine" if engine_off else \
        "trainer" if trainer_off else "none"
    worst = torch.nan_to_num(torch.maximum((engine - reference).abs(), (trainer - reference).abs()), nan=math.inf)
    worst = torch.where(counted, worst, -1.0)
    for pos in torch.argsort(worst, descending=True)[:WORST_TOKENS].tolist():
        if not counted[pos]:
            break
        a.worst_tokens.append({"position": pos, "token": s.tokens[s.prompt_length + pos], "engine": s.engine[pos],
                               "reference": ref[pos], "trainer": train[pos],
                               "engine_abs_diff": abs(s.engine[pos] - ref[pos]),
                               "trainer_abs_diff": abs(train[pos] - ref[pos])})
    return a


def attribute_file(path, checkpoint, train_data=None, **settings) -> RolloutAttribution:
    """`attribute` on a rollout data file (validated against the checkpoint's vocabulary), with the
    trainer's own log-probs from `train_data` when given. `settings`: attribute's keywords."""
    from glmkit.checkpoint import open_checkpoint

    config = open_checkpoint(checkpoint).config  # a bad checkpoint is named before the data is read
    data = load_rollout_data(path, vocab_size=config.vocab_size)
    trainer = load_trainer_logprobs(train_data) if train_data else None
    return attribute(data, checkpoint, trainer_logprobs=trainer, **settings)
