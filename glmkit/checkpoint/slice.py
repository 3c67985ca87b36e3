"""Cut the first N decoder layers (plus embed, final norm and lm_head) out of a checkpoint.

Used to make the 4-layer bring-up model from the full one. Tensors are copied one at a time
(bit for bit, dtype unchanged) so the source is never held in memory; MTP and vision tensors
are dropped.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import Glm5NextTextConfig

from glmkit.checkpoint.hf import Checkpoint, CheckpointError, count_nonfinite, open_checkpoint, save_checkpoint
from glmkit.checkpoint.names import expected_tensors, layer_of
from glmkit.config import DSA


def check_shared_indexers(config: Glm5NextTextConfig) -> None:
    """Every "shared" DSA layer must directly follow a "full" DSA layer.

    transformers hands top-k indices only from layer i to layer i+1 (a KDA layer passes None),
    so a shared layer anywhere else fails at run time.
    """
    for i, (kind, indexer) in enumerate(zip(config.layer_types, config.indexer_types)):
        if kind != DSA or indexer != "shared":
            continue
        previous_ok = i > 0 and config.layer_types[i - 1] == DSA and config.indexer_types[i - 1] == "full"
        if not previous_ok:
            raise CheckpointError(f"layer {i} is a 'shared' indexer DSA layer but layer {i - 1} "
                                  f"is not a 'full' indexer DSA layer")


def sliced_config(config: Glm5NextTextConfig, layers: int) -> Glm5NextTextConfig:
    """`config` cut to its first `layers` layers (per-layer schedules truncated)."""
    if not 1 <= layers <= config.num_hidden_layers:
        raise CheckpointError(f"cannot keep {layers} layers of a {config.num_hidden_layers}-layer model "
                              f"(allowed 1..{config.num_hidden_layers})")
    fields = config.to_dict()
    fields.pop("model_type", None)
    fields["num_hidden_layers"] = layers
    for schedule in ("layer_types", "mlp_layer_types", "indexer_types"):
        fields[schedule] = list(fields[schedule][:layers])
    sliced = Glm5NextTextConfig.from_dict(fields)
    check_shared_indexers(sliced)
    return sliced


def slice_summary(source: Checkpoint, config: Glm5NextTextConfig) -> str:
    """One line saying what a slice of `source` to `config` keeps and drops."""
    total = source.config.num_hidden_layers
    kept = config.num_hidden_layers
    dropped = [n for n in source.text_keys() if (layer_of(n) or 0) >= kept]
    text = f"kept layers 0-{kept - 1} of {total}"
    if dropped:
        text += f", dropped layers {kept}-{total - 1} ({len(dropped)} tensors)"
    if source.skipped_vision or source.skipped_mtp:
        text += f"; {source.skipped_summary()} (not copied)"
    return text


def _copied_tensors(source: Checkpoint, config: Glm5NextTextConfig, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    names = list(expected_tensors(config))
    for name in tqdm(names, desc="slice", unit="tensor", disable=not progress):
        tensor = source.get(name)
        if bad := count_nonfinite(tensor):  # copied as it is (a slice may be how one looks into it), said once
            warnings.warn(f"{source.path}: tensor {name} holds {bad} NaN or infinite value(s) of {tensor.numel()}; "
                          f"copied as is (training and checking refuse such a checkpoint)", stacklevel=2)
        yield name, tensor


def slice_checkpoint(src: str | os.PathLike | Checkpoint, layers: int, out: str | os.PathLike,
                     overwrite: bool = False, progress: bool = True,
                     max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write layers 0..layers-1 of `src` (plus embed, norm, lm_head) to `out`; returns `out`.

    With progress, prints a summary of what was kept and dropped to stderr.
    """
    source = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    try:
        config = sliced_config(source.config, layers)
    except CheckpointError as e:
        raise CheckpointError(f"{source.path}: {e}") from e
    path = save_checkpoint(out, config, _copied_tensors(source, config, progress),
                           max_shard_bytes=max_shard_bytes, overwrite=overwrite)
    if progress:
        print(f"sliced {source.path} -> {path}: {slice_summary(source, config)}", file=sys.stderr)
    return path
