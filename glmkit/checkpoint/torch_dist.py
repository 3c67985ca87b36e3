"""Megatron `torch_dist` checkpoints, read one tensor at a time without Megatron and without pickle.

Layout Megatron writes (torch.distributed.checkpoint under the hood):

    <dir>/latest_checkpointed_iteration.txt     "release" or an iteration number
    <dir>/release/ or <dir>/iter_0000012/       the checkpoint itself:
        .metadata                               DCP's index: every key, its global shape, dtype, chunks
        __0_0.distcp, __1_0.distcp, ...         the data, each chunk a torch.save'd tensor
        metadata.json, common.pt                Megatron's own (backend name; non-sharded state: not read)

A key is a tensor (a parameter, or a buffer such as an expert bias) or a byte blob (`_extra_state` of
Transformer Engine modules, optimizer and RNG entries): blobs are listed, never loaded. The `.metadata`
index is a pickle: it is read by an unpickler that knows only DCP's own metadata classes, torch sizes,
dtypes and layouts (anything else is refused, so a crafted index cannot run code), and tensor data is
read by DCP with `torch.load(weights_only=True)`. One tensor is materialised at a time, so memory is
bounded by the largest tensor.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from glmkit.checkpoint.hf import CheckpointError
from glmkit.inputs import UNPICKLE_ERRORS, not_a_file, read_marker

TRACKER = "latest_checkpointed_iteration.txt"
MAX_INDEX_BYTES = 1 << 30  # an index names tensors and chunks; a full-model one is megabytes
# Exactly these classes (by module and plain name; a dotted name, which pickle protocol 4 resolves
# attribute by attribute and which could reach e.g. the module's `os`, is never looked up).
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {(_DCP_METADATA, name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")}


# Megatron's planner may leave its own objects in the index's planner data; they are read as inert
# placeholders (glmkit's class, holding whatever arguments and state the pickle gives), never imported.
_OPAQUE_MODULES = ("megatron.", "miles.", "miles_plugins.", "transformer_engine.")


class _Opaque:
    """A stand-in for a framework object in a checkpoint index: keeps its arguments, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state


class _IndexUnpickler(pickle._Unpickler):
    """DCP's `.metadata`, and nothing else: its dataclasses, torch.Size, dtypes, layouts (framework
    objects become inert placeholders).

    Python's unpickler, not the C one: the C unpickler sizes its memo from a LONG_BINPUT index in the
    stream, so a 20-byte file could make it zero 18 GB. This one keeps the memo in a dict; BYTEARRAY8
    (which allocates the length the stream declares, and which DCP never writes) is refused. Read from
    memory, so a declared length beyond the file's end only returns what is there."""

    dispatch = {op: load for op, load in pickle._Unpickler.dispatch.items() if op != pickle.BYTEARRAY8[0]}

    def find_class(self, module, name):
        if "." in name:
            raise pickle.UnpicklingError(f"{module}.{name}: a dotted name is not part of a torch.distributed.checkpoint index")
        if (module, name) in _ALLOWED or \
                (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))):
            return super().find_class(module, name)
        if module.startswith(_OPAQUE_MODULES):
            return type(name, (_Opaque,), {"__module__": f"glmkit.opaque.{module}"})
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch.distributed.checkpoint index")


@dataclass(frozen=True)
class DistTensor:
    key: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def resolve_dir(path) -> Path:
    """The checkpoint folder of a torch_dist path: a folder with `.metadata` itself, or a Megatron save
    folder whose tracker names `release` or an iteration."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: not found")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory (a torch_dist checkpoint is a folder)")
    if _index_here(path):
        return path
    tracker = path / TRACKER
    if not (tracker.exists() or tracker.is_symlink()):
        raise CheckpointError(f"{path}: no .metadata and no {TRACKER}: not a torch_dist checkpoint")
    try:
        text = read_marker(tracker)
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    if text == "release":
        folder = path / "release"
    elif re.fullmatch(r"\d{1,12}", text):
        folder = path / f"iter_{int(text):07d}"
    else:
        raise CheckpointError(f"{tracker}: {text[:40]!r}; expected 'release' or an iteration number")
    if not _index_here(folder):
        raise CheckpointError(f"{folder}/.metadata not found (the tracker names {text!r}): an incomplete checkpoint")
    return folder


def _index_here(folder: Path) -> bool:
    """Whether `folder` holds a `.metadata` index; one that is there but not a regular file (a FIFO
    would block the read, a folder cannot be one) is refused by what it is, not called absent."""
    index = folder / ".metadata"
    if not (index.exists() or index.is_symlink()):
        return False
    if (why := not_a_file(index)) is not None:
        raise CheckpointError(f"{index}: {why}; a torch_dist index is a regular file")
    return True


class TorchDistCheckpoint:
    """A torch_dist checkpoint's index, and its tensors one at a time."""

    def __init__(self, path):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        self.path = resolve_dir(path)
        if (size := (self.path / ".metadata").stat().st_size) > MAX_INDEX_BYTES:
            raise CheckpointError(f"{self.path}/.metadata: {size} bytes, more than the {MAX_INDEX_BYTES} bytes "
                                  f"glmkit reads as a torch.distributed.checkpoint index")
        try:
            self.metadata = _IndexUnpickler(io.BytesIO((self.path / ".metadata").read_bytes())).load()
        except UNPICKLE_ERRORS as err:
            raise CheckpointError(f"{self.path}/.metadata: not a readable torch.distributed.checkpoint index "
                                  f"({type(err).__name__}: {err})") from err
        entries = getattr(self.metadata, "state_dict_metadata", None)
        if not isinstance(entries, dict):
            raise CheckpointError(f"{self.path}/.metadata: no state_dict_metadata in the index")
        self.tensors: dict[str, DistTensor] = {}
        self.blobs: list[str] = []
        for key, meta in entries.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{self.path}/.metadata: a key that is not a string ({key!r:.60})")
            if isinstance(meta, TensorStorageMetadata):
                size, dtype = getattr(meta, "size", None), getattr(getattr(meta, "properties", None), "dtype", None)
                if not (isinstance(size, (tuple, list)) and all(isinstance(n, int) and n >= 0 for n in size)
                        and isinstance(dtype, torch.dtype)):
                    raise CheckpointError(f"{self.path}/.metadata: {key}: no valid size and dtype in the index "
                                          f"({size!r:.60}, {dtype!r:.30})")
                self.tensors[key] = DistTensor(key, tuple(size), dtype)
            elif isinstance(meta, BytesStorageMetadata):
                self.blobs.append(key)
        storage = getattr(self.metadata, "storage_data", None) or {}
        if not isinstance(storage, dict):
            raise CheckpointError(f"{self.path}/.metadata: storage_data is a {type(storage).__name__}, not a mapping")
        files = sorted({str(getattr(info, "relative_path", "")) for info in storage.values()} - {""})
        odd = [name for name in files if "\0" in name]
        if odd:  # no file system names one so
            raise CheckpointError(f"{self.path}/.metadata: names a data file with a NUL character ({odd[0]!r}); refused")
        root = self.path.resolve()
        outside = [name for name in files if not (self.path / name).resolve().is_relative_to(root)]
        if outside:
            raise CheckpointError(f"{self.path}/.metadata: names data files outside the checkpoint folder "
                                  f"({', '.join(outside[:3])}); refused")
        absent = [name for name in files if not os.path.lexists(self.path / name)]
        if absent:
            raise CheckpointError(f"{self.path}: {len(absent)} of the {len(files)} data files the index names are "
                                  f"missing: {', '.join(absent[:5])}{', ...' if len(absent) > 5 else ''}")
        odd = {name: why for name in files if (why := not_a_file(self.path / name)) is not None}
        if odd:  # a pipe would block the read, a folder cannot be read, a link may lead nowhere
            name, why = next(iter(odd.items()))
            raise CheckpointError(f"{self.path}: {len(odd)} of the {len(files)} data files the index names are not "
                                  f"regular files: {name} {why}")

    def _check_chunks_cover(self, key: str, shape) -> None:
        meta = self.metadata.state_dict_metadata[key]
        why = _chunks_cover(getattr(meta, "chunks", None) or [], list(shape))
        if why is not None:
            raise CheckpointError(f"{self.path}/.metadata: {key} {list(shape)}: {why}: a damaged index")

    def get(self, key: str) -> torch.Tensor:
        """One tensor at its global shape (all its chunks, from whichever files hold them)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        if key not in self.tensors:
            raise KeyError(f"{key}: not a tensor of {self.path}")
        info = self.tensors[key]
        # the index declares the shape; its chunks' stored bytes say what can be there (a damaged or hostile
        # index must not make us allocate terabytes)
        declared = math.prod(info.shape) * torch.empty((), dtype=info.dtype).element_size()
        stored = sum(getattr(where, "length", 0) or 0 for index, where in
                     (getattr(self.metadata, "storage_data", None) or {}).items() if getattr(index, "fqn", None) == key)
        if declared > stored:
            raise CheckpointError(f"{self.path}: {key} is declared {list(info.shape)} {info.dtype} ({declared} bytes) "
                                  f"but its chunks store {stored} bytes: a damaged index")
        self._check_chunks_cover(key, info.shape)
        target = {key: torch.empty(info.shape, dtype=info.dtype)}
        reader = _SafeReader(self.path, self.metadata)
        with warnings.catch_warnings():  # one process, no process group: DCP says so, and loads
            warnings.simplefilter("ignore")
            try:
                dcp.load(target, storage_reader=reader, no_dist=True)
            except (Exception, CheckpointException) as err:  # a missing or truncated data file: name key and folder
                raise CheckpointError(f"{self.path}: cannot read {key}: {_first_cause(err)}") from err
        return target[key]


def _chunks_cover(chunks, shape) -> str | None:
    """None when the chunks lie within `shape` and their elements add up to it (no gap is left for
    uninitialised memory to be read as weights), else what is wrong."""
    total = 0
    for chunk in chunks:
        offsets, sizes = list(getattr(chunk, "offsets", ()) or ()), list(getattr(chunk, "sizes", ()) or ())
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape)):
            return f"a chunk at {offsets} of size {sizes} lies outside {list(shape)}"
        total += math.prod(sizes)
    if total != math.prod(shape):
        return f"its chunks hold {total} of its {math.prod(shape)} elements"
    return None


def _first_cause(err: BaseException) -> str:
    """The failure under DCP's wrapper (which reports a rank's traceback as text)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        err = next(iter(failures.values()))
        err = err[0] if isinstance(err, tuple) and err else err  # (exception, its stack summary)
    text = str(err).strip().splitlines()
    if isinstance(err, pickle.UnpicklingError) or any("weights_only" in line for line in text):
        # torch's text goes on to suggest weights_only=False: never for a file that failed this way
        return "the data file is damaged or holds more than tensors (glmkit reads it weights-only, never unpickling objects)"
    return f"{type(err).__name__}" + (f": {text[0]}" if text else " (the data file is truncated or damaged)")


def _SafeReader(path: Path, metadata):
    """DCP's FileSystemReader with the index already read safely (its own read_metadata would unpickle
    the file with no restriction)."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    return Reader(str(path))


def save_torch_dist(tensors: dict, folder, blobs: dict | None = None, iteration: int | None = None) -> Path:
    """Write `tensors` (and byte `blobs`, as Megatron's `_extra_state`) as a torch_dist checkpoint in the
    layout Megatron writes: `<folder>/release/` (or `iter_<n>/`) plus the tracker. For tests and for
    writing a known-good conversion."""
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    name = "release" if iteration is None else f"iter_{iteration:07d}"
    state = dict(tensors)
    state.update({k: io.BytesIO(v) for k, v in (blobs or {}).items()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder / name), no_dist=True)
    (folder / "release" if iteration is None else folder / name).mkdir(parents=True, exist_ok=True)
    (folder / name / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                                                 '"common_backend": "torch", "common_backend_version": 1}')
    (folder / TRACKER).write_text("release" if iteration is None else str(iteration))
    return folder
