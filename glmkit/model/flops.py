"""The model's FLOP count, for throughput and MFU (`perf/*_tflops`, `perf/actor_train_mfu`).

Counted from GLM-5.3-Flash's own shapes, not a dense-attention formula: every weight product of a
token's forward (2 x its multiply-adds, read from the model's parameters), the routed experts at
top-k of n_routed_experts, plus the attention that depends on the position:

- DSA (absorbed NoPE MLA over the selected keys): 4 x heads x kv_lora_rank per selected key, with
  min(index_topk, p + 1) keys at position p; its indexer scores the kpool-compressed keys,
  2 x index_n_heads x index_head_dim per pool, ceil((p + 1) / index_kpool) pools.
- KDA (chunked delta rule, chunks of 64): per token and head the state read and update,
  4 x dk x dv, and the in-chunk products, 2 x 64 x (dk + dv).

Embedding lookups, norms, mHC's elementwise mixing and the softmax are left out (a few percent at
most at full width). A training step counts 3 x the forward, as the framework does.
"""

from __future__ import annotations

import math

KDA_CHUNK = 64

# Dense bf16 peak TFLOP/s per GPU (vendor figures, without sparsity), matched on the device name.
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100 PCIE": 756.0, "H100": 989.0, "H200": 989.0, "GH200": 989.0,
                    "B200": 2250.0, "B300": 2250.0, "GB200": 2500.0, "GB300": 2500.0}


def peak_bf16_tflops(device_name: str) -> float | None:
    """The peak for a device name such as 'NVIDIA H100 80GB HBM3' (the longest matching key wins), or
    None when the device is not in the table."""
    words = " " + "".join(c if c.isalnum() else " " for c in device_name.upper()) + " "
    words = " ".join(words.split())
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if f" {key} " in f" {words} ":
            return PEAK_BF16_TFLOPS[key]
    return None


def matmul_params_per_token(config) -> float:
    """Multiply-adds of a token's weight products: every weight of two or more dims once (the routed
    experts' stacked weights at top-k / n_routed_experts), the embedding table excepted (a lookup).
    Read from the model built on the meta device, so it follows the architecture as glmkit builds it."""
    import torch

    from glmkit.model.model import Glm5Model

    with torch.device("meta"):
        model = Glm5Model(config)
    total = 0.0
    for name, param in model.named_parameters():
        if param.dim() < 2 or name.startswith("embed_tokens."):
            continue
        share = config.num_experts_per_tok / config.n_routed_experts if ".mlp.experts." in name else 1.0
        total += param.numel() * share
    if config.tie_word_embeddings:
        total += config.vocab_size * config.hidden_size  # the head is the embedding table, used as a product
    return total


def forward_flops(config, seq_lens, weight_macs: float | None = None) -> float:
    """FLOPs of one forward over sequences of these lengths (packed, each causal on its own).
    `weight_macs`: matmul_params_per_token(config), when the caller keeps it (it builds a meta model)."""
    from glmkit.config import DSA

    per_token = 2 * (matmul_params_per_token(config) if weight_macs is None else weight_macs)
    dsa = [i for i, kind in enumerate(config.layer_types) if kind == DSA]
    full = [i for i in dsa if config.indexer_types[i] == "full"]
    kda_layers = len(config.layer_types) - len(dsa)
    H, R = config.num_attention_heads, config.kv_lora_rank
    dk = dv = config.linear_head_dim
    total = 0.0
    for L in seq_lens:
        L = int(L)
        total += per_token * L
        k = min(config.index_topk, L)  # sum over p of min(topk, p + 1)
        selected = k * (k + 1) / 2 + (L - k) * config.index_topk
        total += len(dsa) * 4 * H * R * selected
        pools = sum(math.ceil((p + 1) / config.index_kpool) for p in range(L)) if L <= 4096 else \
            L * (L + config.index_kpool) / (2 * config.index_kpool)
        total += len(full) * 2 * config.index_n_heads * config.index_head_dim * pools
        total += kda_layers * L * config.linear_num_heads * (4 * dk * dv + 2 * KDA_CHUNK * (dk + dv))
    return total
