"""Shared fixtures: small checkpoints written by transformers itself and by glmkit's synth."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels can only run in Triton's CPU interpreter, and the switch is read when
# triton (and each kernel) is first imported: set it before any test module can import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glmkit.config import DSA, KDA, variant_config
from glmkit.reference import _block_fla_on_cpu

_block_fla_on_cpu()

# GLMKIT_TEST_DETERMINISTIC=1: torch's deterministic algorithms for the whole run (CI's second pass of the
# numerically sensitive files sets it, with another thread count: a result that moves with either is a
# tolerance that was never stated).
if os.environ.get("GLMKIT_TEST_DETERMINISTIC") == "1":
    torch.use_deterministic_algorithms(True)


def reference_checkpoint(text_config, seed: int, path):
    """A checkpoint written by transformers' own save_pretrained, every tensor seeded-random so that
    each one matters (transformers' init leaves e.g. the kpool gate at ones and its ape at zeros)."""
    from transformers import Glm5NextForConditionalGeneration

    from glmkit.config import full_config

    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(full_config(text_config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual"):
                continue
            std = p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.3
            p.copy_(torch.randn_like(p) * std + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    return path


# Configurations the parity tests run on; every one keeps all structural features.
CONFIGS = {
    # the tiny variant itself: KDA x3 then DSA, kpool 4, top-8 (2 pools + tail)
    "tiny": {},
    # shared indexers (a "shared" DSA layer right after a full one) and kpool 2
    "shared-kpool2": dict(num_hidden_layers=6, layer_types=[KDA, DSA, DSA, KDA, DSA, DSA],
                          indexer_types=["full", "full", "shared", "full", "full", "shared"],
                          mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
                          index_kpool=2, index_topk=6),
    # a third kpool size, pools of 8
    "kpool8": dict(index_kpool=8, index_topk=16),
}


@pytest.fixture(scope="session", params=sorted(CONFIGS))
def ref_ckpt(request, tmp_path_factory):
    """(name, path) of a transformers-written checkpoint for each parity configuration."""
    name = request.param
    path = tmp_path_factory.mktemp(f"ref-{name}")
    return name, reference_checkpoint(variant_config("tiny", **CONFIGS[name]), seed=1234, path=path)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return reference_checkpoint(variant_config("tiny"), seed=7, path=tmp_path_factory.mktemp("tiny"))
