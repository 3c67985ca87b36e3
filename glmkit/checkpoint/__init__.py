"""GLM-5.3-Flash checkpoints: expected names, lazy validated reading, atomic writing,
seeded synthetic checkpoints and layer slicing."""

from glmkit.checkpoint.hf import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    count_nonfinite,
    open_checkpoint,
    save_checkpoint,
)
from glmkit.checkpoint.names import TEXT_PREFIX, expected_tensors, layer_of, layer_tensors
from glmkit.checkpoint.slice import slice_checkpoint, sliced_config
from glmkit.checkpoint.synth import synth_checkpoint, synth_tensor

__all__ = [
    "TEXT_PREFIX",
    "Checkpoint",
    "CheckpointError",
    "TensorInfo",
    "count_nonfinite",
    "expected_tensors",
    "layer_of",
    "layer_tensors",
    "open_checkpoint",
    "save_checkpoint",
    "slice_checkpoint",
    "sliced_config",
    "synth_checkpoint",
    "synth_tensor",
]
