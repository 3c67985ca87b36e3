"""A full-width model made in place with a synthetic checkpoint's values: how benchmarks and GPU tests
get one in seconds. Here, above the checkpoint code it draws its values from (glmkit.checkpoint.synth),
so that the checkpoint code never imports the model."""

from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import Glm5NextTextConfig

from glmkit.checkpoint.names import checkpoint_key
from glmkit.checkpoint.synth import as_text_config, synth_tensor
from glmkit.model import Glm5Model, cast_model


@torch.no_grad()
def synth_model(variant_or_config: str | Glm5NextTextConfig, seed: int, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cuda", progress: bool = True):
    """glmkit's model with the values `synth_checkpoint(..., device=device)` would write, made in
    place on `device` (no disk, no CPU copy): how benchmarks get a full-width model in seconds."""
    config = as_text_config(variant_or_config)
    with torch.device("meta"):
        model = cast_model(Glm5Model(config), dtype)
    model = model.to_empty(device=device)
    state = model.state_dict()  # per-expert entries are views into the stacked expert weights
    for name, target in tqdm(state.items(), total=len(state), desc="synth", unit="tensor", disable=not progress):
        full = checkpoint_key(name)
        target.copy_(synth_tensor(full, tuple(target.shape), seed, dtype, device, keep_on_device=True))
    return model
