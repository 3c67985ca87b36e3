"""Read and write GLM-5.3-Flash checkpoints in the Hugging Face layout (config.json + safetensors).

Reading is lazy: `open_checkpoint` parses only config.json, the index and the safetensors
headers, validates every text tensor's name and shape against the config, and reads tensor data
on demand through `safetensors.safe_open` (mmap). Writing streams (name, tensor) pairs into
shards inside a temporary sibling directory that is renamed into place only when complete (see
glmkit.outputs for the marker that lets --overwrite replace it later). Nothing here uses pickle.

Dtype rule on reading: every text tensor must be floating point (bf16, fp16, fp32 or fp64); integer,
bool and float8 tensors are refused (a cast would load them silently as wrong weights). A float tensor in
another dtype than the checkpoint's (the dtype holding most elements; fp32 is also expected for the
tensors transformers keeps in fp32) is cast when loaded, as before, with one warning naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, Glm5NextTextConfig

from glmkit.checkpoint.names import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    TEXT_PREFIX,
    VISION_PREFIX,
    expected_tensor_count,
    expected_tensors,
    keeps_fp32,
    layer_of,
    layer_prefix,
)
from glmkit.bounds import FLOAT32_MAX
from glmkit.config import full_config
from glmkit.inputs import not_a_file
from glmkit.outputs import check_dir_out, move_into_place, staging_dir

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MODEL_TYPES = ("glm5_next", "glm5_next_text")
ARCHITECTURE = "Glm5NextForConditionalGeneration"

# Keys a composite Glm5NextConfig carries next to the text fields; dropped when a flat
# (text-only) config.json is turned into a Glm5NextTextConfig.
_COMPOSITE_ONLY_KEYS = {
    "text_config", "vision_config", "model_type", "architectures", "transformers_version",
    "image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
    "video_start_token_id", "video_end_token_id",
}

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}

# Longest list of problems shown in one CheckpointError before "... and N more".
_MAX_LISTED = 10
_WARNED: set[str] = set()


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from the safetensors header."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    stored_as: str | None = None  # the name in the file, where it is not glmkit's name for the tensor


# ----------------------------------------------------------------------------- reading


# A config.json is kilobytes, a full model's index a few megabytes (a name and a file per tensor);
# anything past these is refused before it is read, so a huge file cannot take the machine's memory.
MAX_JSON_BYTES = {CONFIG_FILE: 16 << 20, INDEX_FILE: 256 << 20}


def _read_json(file: Path) -> dict:
    limit = MAX_JSON_BYTES.get(file.name, 256 << 20)
    if file.exists() and (why := not_a_file(file)) is not None:
        raise CheckpointError(f"{file}: {why}, not a JSON file")
    try:
        if file.stat().st_size > limit:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes; a {file.name} is read whole and glmkit "
                                  f"reads at most {limit} ({limit >> 20} MiB)")
        check_json_fits(file, file.stat().st_size)
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file}: not UTF-8 text: {e}") from e
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # ValueError: JSON errors and over-long integers
        raise CheckpointError(f"{file}: unreadable JSON: {str(e)[:200]}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def text_config_from_json(raw: dict, file: Path) -> Glm5NextTextConfig:
    """The text config of a parsed config.json, nested (`text_config`) or flat (text-only)."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{file}: model_type is {model_type!r}, expected 'glm5_next'")
    if "text_config" in raw and not isinstance(raw["text_config"], dict):
        raise CheckpointError(f"{file}: text_config must be a JSON object, found {type(raw['text_config']).__name__}")
    if isinstance(raw.get("text_config"), dict):
        _check_types(raw["text_config"], file)  # what the reference reads too, before the top-level flag
        _check_types({k: v for k, v in raw.items() if k != "text_config"}, file)
        fields = dict(raw["text_config"])
        # transformers ties lm_head from the top-level flag of the composite config.
        if "tie_word_embeddings" in raw:
            fields["tie_word_embeddings"] = raw["tie_word_embeddings"]
    else:
        fields = {k: v for k, v in raw.items() if k not in _COMPOSITE_ONLY_KEYS}
    fields.pop("model_type", None)
    _check_types(fields, file)
    vocab = fields.get("vocab_size", 1)  # checked first: transformers warns of every token id past a bad one
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise CheckpointError(f"{file}: vocab_size must be a positive integer, got {vocab!r}")
    layers = fields.get("num_hidden_layers", 1)  # transformers builds layer_types in time quadratic in it
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > MAX_LAYERS:
        raise CheckpointError(f"{file}: num_hidden_layers must be an integer in 1..{MAX_LAYERS}, got {layers}")
    try:
        config = Glm5NextTextConfig.from_dict(fields)
    except Exception as e:  # strict-dataclass and architecture validation errors
        # transformers' text is a "Validation error for field ...:" line and the reason's: one line here
        reason = ": ".join(line.strip().rstrip(":") for line in str(e).splitlines() if line.strip()) or type(e).__name__
        raise CheckpointError(f"{file}: invalid glm5_next text config: "
                              f"{reason[:400] + ' ...' if len(reason) > 400 else reason}") from e
    _check_sizes(config, file)
    return config


# The activations glmkit's experts compute (SwiGLU); the reference's config may name others, which
# would then compute something else than glmkit does.
HIDDEN_ACTS = ("silu",)
POSITIVE_NUMBERS = ("rms_norm_eps", "routed_scaling_factor", "max_position_embeddings", "rope_theta")
OWN_RULES = ("swiglu_limit",)  # checked in _check_sizes (null allowed)


def _check_types(fields: dict, file: Path) -> None:
    """Each field whose default is a bool, a number or a text given as one (a strict reference
    config raises deep inside a run otherwise), and each number finite and within float32, which the
    model computes in (a NaN hc_eps or a routed_scaling_factor of 1e308 turns every output to NaN)."""
    import math

    defaults = Glm5NextTextConfig()
    for name, value in fields.items():
        default = getattr(defaults, name, None)
        if name.startswith("_") or default is None or name in OWN_RULES:
            continue
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise CheckpointError(f"{file}: {name} must be true or false, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or abs(value) > FLOAT32_MAX or (name in POSITIVE_NUMBERS and value <= 0):
                kind = "positive finite number" if name in POSITIVE_NUMBERS else "finite number"
                raise CheckpointError(f"{file}: {name} must be a {kind} within float32's range, got {value!r}")
    act = fields.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise CheckpointError(f"{file}: hidden_act {str(act)[:60]!r}; glmkit's experts compute "
                              f"{', '.join(HIDDEN_ACTS)} (SwiGLU)")


def _check_sizes(config, file: Path) -> None:
    """Relations between sizes that transformers' config accepts but no model can run with."""
    pairs = [("num_experts_per_tok", "n_routed_experts"), ("index_topk", None), ("index_kpool", None),
             ("num_hidden_layers", None), ("vocab_size", None), ("hidden_size", None)]
    for name, bound in pairs:
        value = getattr(config, name, None)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{file}: {name} must be a positive integer, got {value!r}")
        limit = getattr(config, bound, None) if bound else None
        if isinstance(limit, int) and value > limit:
            raise CheckpointError(f"{file}: {name} {value} is larger than {bound} {limit}")
    import math

    # numbers every forward uses: a NaN or a negative one fails only later, deep in a run
    for name in POSITIVE_NUMBERS:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0 \
                or (isinstance(value, float) and value > FLOAT32_MAX):
            raise CheckpointError(f"{file}: {name} must be a positive finite number within float32's range, "
                                  f"got {value!r}")
    # counts that size every forward's work or memory: beyond these nothing runs in a lifetime (hostile
    # pass 8: hc_sinkhorn_iters 10**9 hung every forward; index_topk 10**9 asked for 56 GB)
    bounds = {"hc_sinkhorn_iters": (1, MAX_SINKHORN_ITERS),
              "index_topk": (1, getattr(config, "max_position_embeddings", None))}
    for name, (low, high) in bounds.items():
        value = getattr(config, name, None)
        if value is None or not isinstance(high, int):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise CheckpointError(f"{file}: {name} must be an integer in {low}..{high}, got {value!r}")
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < config.vocab_size):
        raise CheckpointError(f"{file}: pad_token_id must be a token id below vocab_size {config.vocab_size} "
                              f"(or null), got {pad!r}")
    _check_expert_groups(config, file)
    for name in ("layer_types", "mlp_layer_types", "indexer_types"):  # one entry a layer, as the reference reads
        listed = getattr(config, name, None)
        if isinstance(listed, (list, tuple)) and len(listed) != config.num_hidden_layers:
            raise CheckpointError(f"{file}: {name} lists {len(listed)} layers and num_hidden_layers is "
                                  f"{config.num_hidden_layers}; give one entry a layer")
    limit = getattr(config, "swiglu_limit", None)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                              or not math.isfinite(limit) or limit <= 0 or limit > FLOAT32_MAX):
        raise CheckpointError(f"{file}: swiglu_limit must be a positive finite number (or null), got {limit!r}")


def _check_expert_groups(config, file: Path) -> None:
    """The router's grouped top-k (DeepSeek's): experts split into n_group equal groups, the best
    topk_group groups kept, num_experts_per_tok experts chosen among them."""
    experts, k = config.n_routed_experts, config.num_experts_per_tok
    groups, kept = getattr(config, "n_group", 1), getattr(config, "topk_group", 1)
    for name, value in (("n_group", groups), ("topk_group", kept)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CheckpointError(f"{file}: {name} must be a positive integer, got {value!r}")
    if experts % groups:
        raise CheckpointError(f"{file}: n_group {groups} must divide n_routed_experts {experts} (equal groups)")
    if kept > groups:
        raise CheckpointError(f"{file}: topk_group {kept} must be in 1..n_group ({groups})")
    if k > kept * (experts // groups):
        raise CheckpointError(f"{file}: num_experts_per_tok {k} is more than the {kept * (experts // groups)} "
                              f"experts of the topk_group {kept} groups kept (n_group {groups})")


MAX_LAYERS = 10_000  # the recipe's model has 45; 10**6 kept transformers' config busy for minutes
MAX_SINKHORN_ITERS = 1000  # the model's 20, with room for experiments

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check the file is long enough for the data it declares.

    safetensors itself rejects a truncated header; the explicit size check also names the
    file when only the tensor data at the end is missing.
    """
    if file.exists() and (why := not_a_file(file)) is not None:  # a FIFO or a device would block or never end
        raise CheckpointError(f"{file}: {why}, not a safetensors file")
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: truncated safetensors file ({size} bytes, no header)")
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_BYTES:  # read whole before parsing: bounded first
                raise CheckpointError(f"{file}: safetensors header of {header_len} bytes; safetensors allows at "
                                      f"most {MAX_HEADER_BYTES}")
            if header_len > size - 8:
                raise CheckpointError(
                    f"{file}: truncated safetensors file: header needs {header_len} bytes, "
                    f"file has {size - 8} after the length prefix")
            check_json_fits(file, header_len)
            header = json.loads(fh.read(header_len))
    except (PermissionError, CheckpointError):
        raise  # the environment's (exit 4), not a damaged file; or already named above
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from e
    except (ValueError, RecursionError) as e:  # JSON / UTF-8 errors, nesting deeper than the parser goes
        raise CheckpointError(f"{file}: corrupt safetensors header: {str(e)[:200]}") from e

    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    infos, data_end = {}, 0
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in _ST_DTYPES:
                raise ValueError(f"dtype {entry['dtype']!r}; allowed: {', '.join(_ST_DTYPES)}")
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            if not (type(begin) is int and type(end) is int and 0 <= begin <= end):
                raise ValueError(f"data_offsets {entry['data_offsets']!r}: expected two integers, begin <= end")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt header entry for tensor {name}: {e!r}") from e
        infos[name] = TensorInfo(file, dtype, shape, end - begin)
        data_end = max(data_end, end)
    if data_start + data_end > size:
        raise CheckpointError(
            f"{file}: truncated safetensors file: tensor data ends at byte {data_start + data_end}, "
            f"file has {size} bytes")
    _probe_with_safetensors(file)
    return infos


# Python's objects for parsed JSON take up to ~25x its bytes (a 96 MB header of small
# entries took 2.2 GB); the bound below counts 32x.
JSON_OBJECT_FACTOR = 32


def check_json_fits(file: Path, size: int) -> None:
    """A JSON text of `size` bytes is parsed only where the memory it takes as Python objects is free."""
    from glmkit.bounds import free_bytes

    need, have = JSON_OBJECT_FACTOR * size, free_bytes("cpu")
    if need > have:
        raise CheckpointError(f"{file}: {size} bytes of JSON take about {need / 2**30:.3g} GiB to parse and this "
                              f"machine has {have / 2**30:.3g} GiB free")


def _probe_with_safetensors(file: Path) -> None:
    # Let safetensors run its own checks (offsets cover the body exactly, no overlaps).
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as e:
        raise CheckpointError(f"{file}: corrupt safetensors file: {e}") from e


def _tensor_map(path: Path) -> tuple[dict[str, TensorInfo], Path]:
    """Every tensor in the checkpoint (text or not) and the file that lists them."""
    index_file, single_file = path / INDEX_FILE, path / SINGLE_FILE
    if index_file.exists():
        return _sharded_tensor_map(index_file), index_file
    if single_file.exists():
        return read_header(single_file), single_file
    raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _sharded_tensor_map(index_file: Path) -> dict[str, TensorInfo]:
    index = _read_json(index_file)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file}: no 'weight_map' object")

    # Every entry must name a file directly inside the checkpoint directory; checked before any file is
    # touched, so an index cannot make glmkit open (or reveal anything about) a file elsewhere.
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index_file}: weight_map entry for tensor {name} is {shard!r}, "
                                  f"expected a shard file name")
        if not shard or shard in (".", "..") or "/" in shard or "\\" in shard or "\x00" in shard:
            raise CheckpointError(f"{index_file}: shard path {shard!r} for tensor {name} is not a file name inside "
                                  f"the checkpoint directory; refused without opening it")
    shard_names = sorted(set(weight_map.values()))
    for shard in shard_names:
        if (why := not_a_file(index_file.parent / shard)) is not None:
            first_key = next(k for k, v in weight_map.items() if v == shard)
            why = "does not exist" if why == "no such file" else why
            raise CheckpointError(f"{index_file}: shard {shard} {why} (listed for tensor {first_key})")

    tensors: dict[str, TensorInfo] = {}
    for shard in shard_names:
        for name, info in read_header(index_file.parent / shard).items():
            if name in tensors:
                raise CheckpointError(
                    f"{index_file}: tensor {name} is stored twice, in {tensors[name].file.name} "
                    f"and {shard}")
            tensors[name] = info
    for name, shard in weight_map.items():
        if name not in tensors or tensors[name].file.name != shard:
            raise CheckpointError(f"{index_file}: tensor {name} is listed in shard {shard} but not stored there")
    return tensors


def _is_mtp(name: str, num_layers: int) -> bool:
    layer = layer_of(name)
    return ".shared_head." in name or (layer is not None and layer >= num_layers)


def _limited(lines: list[str]) -> str:
    shown = lines[:_MAX_LISTED]
    if len(lines) > _MAX_LISTED:
        shown.append(f"... and {len(lines) - _MAX_LISTED} more")
    return "\n  ".join(shown)


def _validate_text_tensors(path: Path, source: Path, expected: dict[str, tuple[int, ...]],
                           found: dict[str, TensorInfo]) -> None:
    """Raise one CheckpointError listing every missing, unexpected or mis-shaped text tensor."""
    problems = []
    for name, shape in expected.items():
        if name not in found:
            problems.append(f"missing tensor {name} {list(shape)}: not in {source.name}")
    for name, info in found.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name} in {info.file.name}")
        elif info.shape != expected[name]:
            problems.append(f"tensor {name} in {info.file.name} has shape {list(info.shape)}, "
                            f"expected {list(expected[name])} from {CONFIG_FILE}")
    if problems:
        count = _count(len(problems), "problem")
        raise CheckpointError(f"{path}: checkpoint does not match its {CONFIG_FILE} ({count}):\n  {_limited(problems)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dominant_dtype(infos) -> torch.dtype | None:
    """The dtype holding the most elements of these tensors (None for none)."""
    elements = Counter()
    for info in infos:
        elements[info.dtype] += _numel(info.shape)
    return elements.most_common(1)[0][0] if elements else None


def _check_dtypes(path: Path, found: dict[str, TensorInfo]) -> None:
    """The module's dtype rule: raise for non-float tensors, warn once naming the float ones loading casts."""
    refused = [f"tensor {name} in {info.file.name} is {_dtype_name(info.dtype)}" for name, info in sorted(found.items())
               if not info.dtype.is_floating_point or info.dtype.itemsize == 1]
    if refused:
        raise CheckpointError(f"{path}: {_count(len(refused), 'tensor')} not stored as bfloat16, float16 or float32 "
                              f"(a cast would load wrong weights):\n  {_limited(refused)}")
    main = _dominant_dtype(found.values())
    cast = [f"{name} ({_dtype_name(info.dtype)})" for name, info in sorted(found.items())
            if info.dtype != main and not (info.dtype == torch.float32 and keeps_fp32(name))]
    message = (f"{path}: {_count(len(cast), 'tensor')} stored in another dtype than the checkpoint's "
               f"{_dtype_name(main)}, cast when loaded:\n  {_limited(cast)}")
    if cast and message not in _WARNED:  # once per process, however often the checkpoint is opened
        _WARNED.add(message)
        warnings.warn(message)


class Checkpoint:
    """A validated, lazily read checkpoint: only headers are in memory until tensors are asked for."""

    def __init__(self, path: Path, config: Glm5NextTextConfig, tensors: dict[str, TensorInfo],
                 skipped_vision: list[str], skipped_mtp: list[str]):
        self.path = path
        self.config = config
        self._tensors = tensors
        self.skipped_vision = skipped_vision
        self.skipped_mtp = skipped_mtp
        self._handles: dict[Path, object] = {}

    # -- metadata

    def text_keys(self) -> list[str]:
        return sorted(self._tensors)

    def info(self, name: str) -> TensorInfo:
        if name not in self._tensors:
            raise KeyError(f"{self.path}: no text tensor {name}")
        return self._tensors[name]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype holding the most elements (fp32 router/gate tensors are a small minority)."""
        return _dominant_dtype(self._tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._tensors.values())

    def skipped_summary(self) -> str:
        """E.g. "skipped 12 vision tensors, 5 MTP tensors (layer 45, shared_head)"."""
        parts = []
        if self.skipped_vision:
            parts.append(_count(len(self.skipped_vision), "vision tensor"))
        if self.skipped_mtp:
            parts.append(f"{_count(len(self.skipped_mtp), 'MTP tensor')} "
                         f"({_describe_mtp(self.skipped_mtp, self.config)})")
        return "skipped " + ", ".join(parts) if parts else "skipped nothing"

    # -- data

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read one tensor from disk (only this one), optionally cast and moved."""
        info = self.info(name)
        try:
            tensor = self._handle(info.file).get_tensor(info.stored_as or name)
        except Exception as e:
            raise CheckpointError(f"{info.file}: cannot read tensor {name}: {e}") from e
        if dtype is not None or torch.device(device).type != "cpu":
            tensor = tensor.to(device=device, dtype=dtype)
        return tensor

    def layer(self, i: int, dtype: torch.dtype | None = None, device="cpu") -> dict[str, torch.Tensor]:
        """Layer i's tensors keyed relative to `model.language_model.layers.{i}.`."""
        if not 0 <= i < self.config.num_hidden_layers:
            raise IndexError(f"{self.path}: layer {i} out of range 0..{self.config.num_hidden_layers - 1}")
        prefix = layer_prefix(i)
        return {name[len(prefix):]: self.get(name, dtype, device)
                for name in self.text_keys() if name.startswith(prefix)}

    def shared(self, dtype: torch.dtype | None = None, device="cpu") -> dict[str, torch.Tensor]:
        """Embedding, final norm and (when untied) lm_head, keyed by full on-disk name."""
        return {name: self.get(name, dtype, device)
                for name in (EMBED, FINAL_NORM, LM_HEAD) if name in self._tensors}

    def state_dict(self, prefix_strip: bool = True, dtype: torch.dtype | None = None,
                   device="cpu") -> dict[str, torch.Tensor]:
        """All text tensors; with prefix_strip, keys lose `model.language_model.` (lm_head.weight stays)."""
        out = {}
        for name in self.text_keys():
            key = name[len(TEXT_PREFIX):] if prefix_strip and name.startswith(TEXT_PREFIX) else name
            out[key] = self.get(name, dtype, device)
        return out

    def _handle(self, file: Path):
        # One mmap handle per file, opened on first use and reused.
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Checkpoint({str(self.path)!r}, {self.config.num_hidden_layers} layers, "
                f"{len(self._tensors)} text tensors, {self.nbytes / 2**30:.2f} GiB {self.dtype})")


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many elements of a floating-point tensor are NaN or infinite, counted where it is (in pieces:
    no bool copy of a large tensor; one sync), 0 for other dtypes. fp8 has no isfinite: its pieces
    are read in fp32."""
    if not tensor.is_floating_point():
        return 0
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for piece in tensor.detach().reshape(-1).split(1 << 24):
        total += (~(piece.float() if piece.element_size() == 1 else piece).isfinite()).sum()
    return int(total)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _describe_mtp(names: list[str], config: Glm5NextTextConfig) -> str:
    layers = sorted({layer_of(n) for n in names if layer_of(n) is not None and layer_of(n) >= config.num_hidden_layers})
    parts = []
    if layers:
        parts.append(("layer " if len(layers) == 1 else "layers ") + ", ".join(map(str, layers)))
    if any(".shared_head." in n for n in names):
        parts.append("shared_head")
    return ", ".join(parts)


_FLAT_TEXT = "model."  # the framework's own HF export (miles' megatron_to_hf) names text tensors model.layers.N...


def _flat_prefix_renamed(tensors: dict[str, TensorInfo], source: Path) -> tuple[dict[str, TensorInfo], Path]:
    """A checkpoint naming its text tensors `model.layers.N...` / `model.embed_tokens.weight` (as the
    recipe's framework exports them; SGLang reads both) seen under the released names
    (`model.language_model.`); the file's names are kept for reading. Vision tensors are not moved."""
    if any(name.startswith(TEXT_PREFIX) for name in tensors):
        return tensors, source
    renamed = {}
    for name, info in tensors.items():
        if name.startswith(_FLAT_TEXT) and not name.startswith(VISION_PREFIX):
            name, info = TEXT_PREFIX + name[len(_FLAT_TEXT):], replace(info, stored_as=name)
        renamed[name] = info
    return renamed, source


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open and validate a checkpoint directory without reading any tensor data.

    Vision (`model.visual.*`) and MTP (layers >= num_hidden_layers, `*.shared_head.*`) tensors
    are skipped and recorded; every other tensor must be exactly what the config implies.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    config_file = path / CONFIG_FILE
    if (why := not_a_file(config_file)) is not None:
        raise CheckpointError(f"{config_file}: " + ("missing" if why == "no such file" else why))
    config = text_config_from_json(_read_json(config_file), config_file)

    all_tensors, source = _flat_prefix_renamed(*_tensor_map(path))
    text, vision, mtp = {}, [], []
    for name, info in all_tensors.items():
        if name.startswith(VISION_PREFIX):
            vision.append(name)
        elif _is_mtp(name, config.num_hidden_layers):
            mtp.append(name)
        else:
            text[name] = info
    _check_counts_against_storage(config_file, config, len(text))
    _validate_text_tensors(path, source, expected_tensors(config), text)
    _check_dtypes(path, text)
    return Checkpoint(path, config, text, sorted(vision), sorted(mtp))


# A checkpoint missing this many more tensors than it holds is not a damaged copy of what its config
# describes: its counts are wrong, and listing every missing name would take gigabytes (hostile pass 10:
# n_routed_experts 10**7 took 7.5 GB; 10**9 crashed the interpreter).
MAX_MISSING_LISTED = 100_000


def _check_counts_against_storage(file: Path, config, stored: int) -> None:
    expected = expected_tensor_count(config)
    if expected > stored + MAX_MISSING_LISTED:
        raise CheckpointError(
            f"{file}: the config describes {expected} text tensors (num_hidden_layers {config.num_hidden_layers}, "
            f"n_routed_experts {config.n_routed_experts}) and the checkpoint stores {stored}; these counts do not "
            f"belong to this checkpoint")


# ----------------------------------------------------------------------------- writing


def _refuse_existing(target: Path, overwrite: bool) -> None:
    """Absent, empty, or (overwrite) a directory glmkit wrote: see glmkit.outputs.check_dir_out."""
    try:
        check_dir_out(target, overwrite=overwrite)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _storable(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous tensor that owns its storage (save_file rejects views of shared memory)."""
    t = tensor.detach().to("cpu").contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


class _ShardWriter:
    """Buffers tensors up to max_shard_bytes, then writes them as one temporary shard file."""

    def __init__(self, folder: Path, max_shard_bytes: int):
        self.folder = folder
        self.max_shard_bytes = max_shard_bytes
        self.shards: list[tuple[Path, list[str]]] = []
        self.elements_by_dtype: Counter = Counter()
        self.total_bytes = 0
        self.total_elements = 0
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._pending_ptrs: set[int] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = _storable(tensor)
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        if t.untyped_storage().data_ptr() in self._pending_ptrs:
            t = t.clone()  # the same tensor under two names (e.g. a tied head) must be stored twice
        self._pending[name] = t
        self._pending_ptrs.add(t.untyped_storage().data_ptr())
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.total_elements += t.numel()
        self.elements_by_dtype[t.dtype] += t.numel()

    def flush(self) -> None:
        if not self._pending:
            return
        file = self.folder / f"part-{len(self.shards):05d}.safetensors"
        save_file(self._pending, str(file), metadata={"format": "pt"})
        self.shards.append((file, list(self._pending)))
        self._pending, self._pending_bytes, self._pending_ptrs = {}, 0, set()

    def dominant_dtype(self) -> torch.dtype:
        return self.elements_by_dtype.most_common(1)[0][0]


def _stream_into(writer: _ShardWriter, target: Path, expected: dict[str, tuple[int, ...]],
                 tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    seen: set[str] = set()
    for name, tensor in tensors:
        if name not in expected:
            raise CheckpointError(f"{target}: unexpected tensor {name} for this config")
        if name in seen:
            raise CheckpointError(f"{target}: tensor {name} given twice")
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{target}: tensor {name} has shape {list(tensor.shape)}, "
                                  f"expected {list(expected[name])}")
        seen.add(name)
        writer.add(name, tensor)
    writer.flush()
    missing = [f"missing tensor {name} {list(shape)}" for name, shape in expected.items() if name not in seen]
    if missing:
        raise CheckpointError(f"{target}: incomplete checkpoint:\n  {_limited(missing)}")


def _name_shards(folder: Path, writer: _ShardWriter) -> None:
    """Rename temporary shards to transformers' names; write the index when there are several."""
    if len(writer.shards) == 1:
        writer.shards[0][0].rename(folder / SINGLE_FILE)
        return
    count = len(writer.shards)
    weight_map = {}
    for i, (file, names) in enumerate(writer.shards):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        file.rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_parameters": writer.total_elements, "total_size": writer.total_bytes},
             "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=False) + "\n")


def _write_configs(folder: Path, text_config: Glm5NextTextConfig, dtype: torch.dtype) -> None:
    config = full_config(text_config)
    config.architectures = [ARCHITECTURE]
    config.dtype = str(dtype).removeprefix("torch.")
    config.to_json_file(str(folder / CONFIG_FILE))
    GenerationConfig.from_model_config(config).to_json_file(str(folder / "generation_config.json"))


def save_checkpoint(path: str | os.PathLike, text_config: Glm5NextTextConfig,
                    tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = 5 * 2**30,
                    overwrite: bool = False) -> Path:
    """Write (full on-disk name, tensor) pairs as a checkpoint transformers can load.

    The stream is consumed once; at most one shard (max_shard_bytes) is buffered. Everything
    goes into a marked staging directory `.NAME.tmp-*` beside `path` first and is renamed to `path`
    only when names and shapes match `expected_tensors(text_config)` exactly, so a failed save leaves
    nothing at `path`. overwrite replaces only a directory glmkit wrote (glmkit.outputs).
    """
    target = Path(os.path.abspath(path))  # "." and ".." get a name and a parent
    _refuse_existing(target, overwrite)
    staged = staging_dir(target, "checkpoint")
    try:
        writer = _ShardWriter(staged, max_shard_bytes)
        _stream_into(writer, target, expected_tensors(text_config), tensors)
        _name_shards(staged, writer)
        _write_configs(staged, text_config, writer.dominant_dtype())
        _refuse_existing(target, overwrite)  # something may have appeared while we were writing
        staged.chmod(0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
        for file in staged.iterdir():
            file.chmod(0o644)
        move_into_place(staged, target)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return Path(path)
