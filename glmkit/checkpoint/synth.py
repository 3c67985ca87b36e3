"""Seeded random checkpoints in which every tensor changes the output.

transformers' own init zeroes or ones many tensors (A_log, hc base/scale, the indexer's ape,
the router bias), which would let a parity test pass with those tensors wired wrongly. Here each
tensor gets a distribution chosen so activations stay O(1) but no tensor is neutral.

Each tensor has its own generator seeded from (seed, name), so values do not depend on the
order of generation or on the shard layout, and tensors are streamed into save_checkpoint one at
a time (the full-width 4-layer variant, ~9.5B parameters, is never held in memory at once).
Values depend on the device that generates them: CUDA's generator draws other numbers than the
CPU's for the same seed, so a checkpoint synthesised on a GPU (minutes faster at full width) is
reproducible on GPUs, not equal to the CPU one.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import Glm5NextTextConfig

from glmkit.checkpoint.hf import save_checkpoint
from glmkit.checkpoint.names import EMBED, expected_tensors, keeps_fp32
from glmkit.config import variant_config

def tensor_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one tensor (hashlib, not hash(): the latter is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _fan_in_std(shape: tuple[int, ...]) -> float:
    # Linear [out, in]: std in**-0.5 keeps the output variance near the input's.
    return shape[1] ** -0.5


def _rule(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """(distribution, a, b): "normal" mean a std b, "uniform" on [a, b], "one_plus" 1 + b * randn."""
    if name == EMBED:
        return "normal", 0.0, 1.0
    if name.endswith(("conv1d.weight", "A_log", "dt_bias")):
        return "normal", 0.0, 0.5
    if re.search(r"hc_(attn|ffn)_fn$", name):
        # Input is the RMS-normalised flattened n*D streams: std (n*D)**-0.5 gives O(1) mixing logits.
        return "normal", 0.0, _fan_in_std(shape)
    if re.search(r"hc_(attn|ffn)_base$", name):
        return "normal", 0.0, 0.5
    if re.search(r"hc_(attn|ffn)_scale$", name):
        return "uniform", 0.5, 1.5
    if name.endswith("index_kpool_compress_ape"):
        return "normal", 0.0, 0.5
    if name.endswith("index_kpool_compress_gate"):
        return "normal", 0.0, _fan_in_std(shape)
    if name.endswith("e_score_correction_bias"):
        return "normal", 0.0, 0.1
    if name.endswith("norm.weight"):  # RMSNorm, gated o_norm and the indexer's LayerNorm
        return "one_plus", 0.0, 0.1
    if name.endswith(".bias"):  # LayerNorm bias, and Linear biases when attention_bias is set
        return "normal", 0.0, 0.1
    if name.endswith(".weight") and len(shape) == 2:  # every Linear, router and lm_head included
        return "normal", 0.0, _fan_in_std(shape)
    raise ValueError(f"no synthetic init rule for tensor {name} {list(shape)}")


def synth_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", keep_on_device: bool = False) -> torch.Tensor:
    """One reproducible random tensor, on the CPU (or left on `device`); generated in fp32 on
    `device`, then cast unless transformers keeps it fp32."""
    generator = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
    kind, a, b = _rule(name, shape)
    tensor = torch.empty(shape, dtype=torch.float32, device=device)
    if kind == "uniform":
        tensor.uniform_(a, b, generator=generator)
    else:
        tensor.normal_(0.0, b, generator=generator)
        tensor += 1.0 if kind == "one_plus" else a
    tensor = tensor if keeps_fp32(name) else tensor.to(dtype)
    return tensor if keep_on_device else tensor.cpu()


def synth_tensors(config: Glm5NextTextConfig, seed: int, dtype: torch.dtype = torch.float32,
                  progress: bool = True, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Lazily yield (full on-disk name, tensor) for every text tensor of `config`."""
    shapes = expected_tensors(config)
    for name, shape in tqdm(shapes.items(), total=len(shapes), desc="synth", unit="tensor", disable=not progress):
        yield name, synth_tensor(name, shape, seed, dtype, device)


def as_text_config(variant_or_config: str | Glm5NextTextConfig) -> Glm5NextTextConfig:
    if isinstance(variant_or_config, Glm5NextTextConfig):
        return variant_or_config
    return variant_config(variant_or_config)


def synth_checkpoint(variant_or_config: str | Glm5NextTextConfig, seed: int, out: str | os.PathLike,
                     dtype: torch.dtype = torch.float32, overwrite: bool = False, progress: bool = True,
                     max_shard_bytes: int = 5 * 2**30, device: str | torch.device = "cpu") -> Path:
    """Write a seeded random checkpoint for a variant name or a text config; returns `out`."""
    config = as_text_config(variant_or_config)
    tensors = synth_tensors(config, seed, dtype, progress, device)
    return save_checkpoint(out, config, tensors, max_shard_bytes=max_shard_bytes, overwrite=overwrite)
