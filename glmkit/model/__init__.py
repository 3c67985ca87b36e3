"""The GLM-5.3-Flash text model, one set of weights and two paths over it (train, rollout)."""

from __future__ import annotations

import itertools

import torch

from glmkit.checkpoint.names import checkpoint_key, keeps_fp32
from glmkit.model.model import Glm5Model
from glmkit.model.packed import Packed, pack
from glmkit.model.rollout import Completion, RolloutEngine, SamplingParams
from glmkit.model.train import TrainPath

def cast_model(model: Glm5Model, dtype: torch.dtype) -> Glm5Model:
    """Cast to `dtype`, leaving the reference's fp32 tensors in fp32."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keeps_fp32(name) else dtype)
    return model


def load_model(path, dtype: torch.dtype | None = None, device="cpu", finite: bool = True) -> Glm5Model:
    """Build the model from an HF checkpoint directory (safetensors, mmap-read). `finite`: refuse a
    checkpoint whose weights hold a NaN or an Inf (serve, standing in for SGLang, loads what it is given)."""
    from glmkit.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    with torch.device("meta"):
        model = cast_model(Glm5Model(ckpt.config), dtype or ckpt.dtype)
    # allocated once in the final dtypes: no fp32 copy of a bf16 model on the way (2x the memory)
    model = model.to_empty(device=device)
    model.load_state_dict(ckpt.state_dict(), strict=True)
    if finite:
        refuse_nonfinite_weights(model, path)
    return model


def refuse_nonfinite_weights(model: Glm5Model, path) -> None:
    """A checkpoint whose weights hold a NaN or an Inf is refused by tensor (checked where they now
    are, in pieces, one sync a parameter): every forward of it would be NaN, and sampling, the loss
    and the plots would fail far from the cause."""
    from glmkit.checkpoint import CheckpointError, count_nonfinite

    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if count_nonfinite(tensor):
            # named as the checkpoint names it: state_dict's entries (an expert stack's are per expert)
            within = name.rpartition(".")[0] + "."
            key, view = next((k, v) for k, v in model.state_dict().items()
                             if (k == name or k.startswith(within)) and count_nonfinite(v))
            raise CheckpointError(f"{path}: tensor {checkpoint_key(key)} holds {count_nonfinite(view)} NaN or "
                                  f"infinite value(s) of {view.numel()}; a checkpoint's weights must be finite")


def largest_weight(model: torch.nn.Module, key=checkpoint_key) -> str:
    """Where the model's largest |weight| is, as a phrase ("3.0e+38 in KEY"): a finite weight that large
    overflows the forward (bf16 and fp32 end at ~3.4e38), so it is where NaN outputs most likely start.
    A NaN counts as the largest (it is the first thing to name). `key`: a parameter name -> the
    checkpoint's (the identity for the transformers reference, whose names are the checkpoint's)."""
    best, where = -1.0, ""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.numel():
            pieces = tensor.detach().reshape(-1).split(1 << 24)
            peak = torch.stack([p.float().abs().amax() for p in pieces]).amax().item()  # amax keeps a NaN
            if not peak <= best:
                best, where = peak, key(name)
    return f"{best:.1e} in {where}" if where else "no floating-point weights"


def save_model(model: Glm5Model, path, overwrite: bool = False, max_shard_bytes: int = 5 * 2**30):
    """Write the model in the on-disk format transformers' save_pretrained uses (text weights)."""
    from glmkit.checkpoint import save_checkpoint

    def tensors():
        for name, tensor in model.state_dict().items():
            yield checkpoint_key(name), tensor.detach()

    return save_checkpoint(path, model.config, tensors(), max_shard_bytes=max_shard_bytes, overwrite=overwrite)


__all__ = ["Glm5Model", "TrainPath", "RolloutEngine", "SamplingParams", "Completion", "Packed", "pack",
           "load_model", "save_model", "cast_model", "largest_weight"]
