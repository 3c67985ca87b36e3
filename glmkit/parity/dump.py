"""The capture format every path writes: one directory per capture.

    DIR/manifest.json       {"format": "glmkit-capture/1", "path", "model", "variant", "checkpoint", "dtype",
                             "device", "mode", "input_sha256", "lengths", "prompt_lengths", "sites", "glmkit"}
    DIR/tensors.safetensors one tensor per site, rows = tokens of all sequences end to end
                            key "L{layer:03d}/{site}" (per layer) or "final/{site}"; plus
                            "input/ids" [T] and "input/cu_seqlens" [N+1]

Per-token rows let paths that run differently (packed, left-padded, prefill + decode) line up.
Index sites (indexer_topk, router_experts) hold sequence-local token positions / expert ids, -1 = empty;
indexer_scores / router_scores hold each row's candidate scores (-inf = not a candidate), which the
comparison reads to tell ties from differences.

A framework's per-token DSA selections (what an SGLang engine returns as `indexer_topk`) are read by
`read_selections`: int32 [tokens, DSA layers, k], rows in the packed token order of the capture they
go with, sequence-local positions, -1 empty.
Written to a temporary sibling directory (glmkit.outputs.staging_dir) and renamed into place when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmkit.outputs import check_dir_out, record_entries, staging_dir, usual_modes

FORMAT = "glmkit-capture/1"


def site_key(layer: int | None, site: str) -> str:
    return f"final/{site}" if layer is None else f"L{layer:03d}/{site}"


def parse_key(key: str) -> tuple[int | None, str]:
    head, site = key.split("/", 1)
    return (None, site) if head == "final" else (int(head[1:]), site)


def check_cu_seqlens(cu_seqlens, n_tokens: int, name: str = "cu_seqlens") -> torch.Tensor:
    """`cu_seqlens` as int64 [N+1] after checking it cuts `n_tokens` tokens into N >= 1 sequences:
    1-D integers from 0, strictly increasing, ending at `n_tokens`. Raises naming `name` otherwise."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.numel() < 2 or cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise ValueError(f"{name}: expected 1-D integers [N+1] with N >= 1, got {cu.dtype} {list(cu.shape)}")
    cu = cu.to(torch.int64)
    bounds = cu.tolist()
    shown = bounds if len(bounds) <= 8 else bounds[:4] + ["..."] + bounds[-2:]
    if bounds[0] != 0 or bounds[-1] != n_tokens or any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} {shown}: must start at 0, increase strictly and end at the {n_tokens} tokens")
    return cu


def input_hash(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> str:
    h = hashlib.sha256()
    h.update(input_ids.to(torch.int64).cpu().numpy().tobytes())
    h.update(cu_seqlens.to(torch.int64).cpu().numpy().tobytes())
    return h.hexdigest()


@dataclass
class Capture:
    """Sites of one path on one input. tensors: {(layer, site): [T, ...]} in token order."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    tensors: dict = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)
    source: str | None = None  # the folder it was read from, to name it in messages

    @property
    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def input_sha256(self) -> str:
        return input_hash(self.input_ids, self.cu_seqlens)

    def put(self, layer, site, rows: torch.Tensor):
        self.tensors[(layer, site)] = rows.detach().to("cpu").contiguous()


def check_capture_out(out: str | os.PathLike, flag: str | None = None) -> Path:
    """Where a capture may be written: a new or empty directory. -> its absolute path. The CLI calls this
    before running anything, so a bad --out fails at once."""
    if str(out) == "":
        raise ValueError(f"{flag or 'the capture folder'} is empty; name a new or empty directory")
    if Path(out).is_dir() and any(Path(out).iterdir()):
        raise FileExistsError(f"{flag + ' ' if flag else ''}{out}: exists and is not empty; choose a new or "
                              f"empty directory")
    return check_dir_out(out, flag, overwrite=None)


def save_capture(capture: Capture, out: str | os.PathLike) -> Path:
    given = Path(out)
    out = check_capture_out(out)
    staging = staging_dir(out, "parity capture")
    try:
        tensors = {site_key(layer, site): t for (layer, site), t in capture.tensors.items()}
        tensors["input/ids"] = capture.input_ids.cpu().contiguous()
        tensors["input/cu_seqlens"] = capture.cu_seqlens.cpu().contiguous()
        save_file(tensors, str(staging / "tensors.safetensors"), metadata={"format": FORMAT})
        manifest = dict(capture.manifest, format=FORMAT, input_sha256=capture.input_sha256,
                        lengths=capture.lengths, sites=sorted(k for k in tensors if not k.startswith("input/")))
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2))
        record_entries(staging)  # the marker lists what it holds, as every glmkit folder's does
        usual_modes(staging)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return given


def load_capture(path: str | os.PathLike) -> Capture:
    path = Path(path)
    manifest_file, tensor_file = path / "manifest.json", path / "tensors.safetensors"
    if not manifest_file.is_file() or not tensor_file.is_file():
        raise ValueError(f"{path}: not a capture directory (needs manifest.json and tensors.safetensors)")
    try:  # (an unreadable file raises PermissionError: the environment's, exit 4)
        manifest = json.loads(manifest_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{manifest_file}: unreadable JSON: {err}") from err
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_file}: expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    with open(tensor_file, "rb"):  # an unreadable file is a permission problem (exit 4), not a corrupt one
        pass
    try:  # safetensors checks the header and that the data covers it (a truncated file fails here)
        f = safe_open(str(tensor_file), "pt")
    except Exception as err:
        raise ValueError(f"{tensor_file}: not a readable safetensors file (truncated or corrupt): {err}") from err
    with f:
        keys = list(f.keys())
        for needed in ("input/ids", "input/cu_seqlens"):
            if needed not in keys:
                raise ValueError(f"{tensor_file}: missing tensor {needed!r}")
        ids = f.get_tensor("input/ids")
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{tensor_file}: tensor 'input/ids': expected 1-D token ids, got {ids.dtype} "
                             f"{list(ids.shape)}")
        cu = check_cu_seqlens(f.get_tensor("input/cu_seqlens"), ids.numel(), f"{tensor_file}: tensor 'input/cu_seqlens'")
        lengths = (cu[1:] - cu[:-1]).tolist()
        prompts = manifest.get("prompt_lengths")
        if prompts is not None and not (isinstance(prompts, list) and len(prompts) == len(lengths) and all(
                isinstance(p, int) and not isinstance(p, bool) and 0 < p <= n for p, n in zip(prompts, lengths))):
            raise ValueError(f"{manifest_file}: prompt_lengths must list one length in 1..len(sequence) for each of "
                             f"the {len(lengths)} sequences, got {str(prompts)[:120]}")
        capture = Capture(ids, cu, manifest=manifest, source=str(path))
        for key in keys:
            if not key.startswith("input/"):
                try:
                    site = parse_key(key)
                except ValueError as err:
                    raise ValueError(f"{tensor_file}: tensor {key!r} is not named L<layer>/<site> or "
                                     f"final/<site>") from err
                tensor = f.get_tensor(key)
                if tensor.is_complex() or (tensor.is_floating_point() and tensor.dtype not in SITE_FLOATS):
                    raise ValueError(f"{tensor_file}: tensor {key!r} is {str(tensor.dtype).removeprefix('torch.')}; "
                                     f"a capture's sites are float64, float32, bfloat16 or float16 (or integer "
                                     f"selections)")
                capture.tensors[site] = tensor
    return capture


SITE_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def read_selections(path, config) -> dict:
    """Per-token DSA selections from a file -> {layer: [tokens, k] int64} for every DSA layer of
    `config` in order. `.safetensors` (key `indexer_topk`; an optional int32 key `layers` names the
    layer of each slot) or `.npy` (no pickle), int32 [tokens, DSA layers, k]."""
    import numpy as np

    from glmkit.config import layer_kinds

    from glmkit.inputs import not_a_file

    path = Path(path)
    layers = None
    if path.suffix not in (".safetensors", ".npy"):
        raise ValueError(f"{path}: selections must be .safetensors or .npy, got {path.suffix or 'no suffix'!r}")
    if (why := not_a_file(path)) is not None:  # a pipe or a device would block the reader or never end
        raise ValueError(f"{path}: {why}; a selections file is a regular file")
    keys = None
    try:
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
                array = f.get_tensor("indexer_topk") if "indexer_topk" in keys else None
                layers = f.get_tensor("layers").tolist() if "layers" in keys else None
        else:
            # mapped, not read: a header that declares more than the file holds is refused, not allocated
            mapped = np.load(path, allow_pickle=False, mmap_mode="r")
            if not isinstance(mapped, np.ndarray) or mapped.dtype not in (np.int32, np.int64):
                raise ValueError(f"int32 or int64 array expected, got {getattr(mapped, 'dtype', type(mapped).__name__)}")
            array = torch.from_numpy(np.array(mapped))
    except Exception as err:  # noqa: BLE001 - safetensors' and numpy's errors for a corrupt file, named
        first = (str(err).splitlines() or [""])[0][:200]
        raise ValueError(f"{path}: not a readable selections file ({type(err).__name__}: {first})") from None
    if array is None:
        raise ValueError(f"{path}: no tensor 'indexer_topk' (found: {', '.join(keys) or 'none'})")
    if array.dim() != 3 or array.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{path}: expected int32 [tokens, DSA layers, k], got {array.dtype} {list(array.shape)}")
    if array.numel() and (int(array.min()) < -1 or int(array.max()) >= array.shape[0]):
        raise ValueError(f"{path}: selections range over [{int(array.min())}, {int(array.max())}]; allowed: -1 "
                         f"(empty) or a token position below the {array.shape[0]} tokens")
    dsa = [i for i, kind in enumerate(layer_kinds(config)) if kind == "dsa"]
    layers = dsa if layers is None else layers
    if len(layers) != array.shape[1] or not set(layers) <= set(dsa):
        raise ValueError(f"{path}: {array.shape[1]} layer slots for layers {layers}; the checkpoint's DSA layers are "
                         f"{dsa}")
    return {layer: array[:, j].long() for j, layer in enumerate(layers)}
