"""Variants by recipe name, each as a transformers `Glm5NextTextConfig`.

The layer schedule (KDA / DSA), the MLP schedule (dense / MoE) and the indexer schedule
(full / shared) always come from the config object; nothing else in glmkit hard-codes a
layer number.
"""

from __future__ import annotations

from transformers import Glm5NextConfig, Glm5NextTextConfig

KDA = "linear_attention"
DSA = "indexed_attention"

# Widths of the tiny CPU variant: every structural feature of the real model at a size that
# runs in milliseconds. index_topk // index_kpool = 2 pools, so any prompt longer than
# index_topk + index_kpool really drops keys.
_TINY = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    linear_num_heads=4,
    linear_head_dim=16,
    # 16 indexer heads: a pool's score is exactly 0 (every head's ReLU at 0) with probability
    # 2^-16, so ties in the top-k are rare enough for parity against the reference
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
    index_kpool=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

VARIANTS: dict[str, dict] = {
    "GLM-5.3-Flash": {},
    "GLM-5.3-Flash-4layer": {"num_hidden_layers": 4},
    "tiny": _TINY,
}

# The vision tower is not used by the RL recipe; checkpoints written by glmkit carry a one-block
# vision config so transformers can instantiate the full class cheaply.
TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=64,
                   projection_intermediate_size=32)


def variant_config(name: str, **overrides) -> Glm5NextTextConfig:
    """The text config of a named variant; `overrides` replace single fields (e.g. indexer_types)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; allowed: {', '.join(VARIANTS)}")
    fields = {**VARIANTS[name], **overrides}
    return Glm5NextTextConfig(**fields)


def full_config(text: Glm5NextTextConfig) -> Glm5NextConfig:
    """Wrap a text config into the checkpoint-level `Glm5NextConfig` that save_pretrained writes."""
    vision = dict(TINY_VISION, out_hidden_size=text.hidden_size)
    return Glm5NextConfig(text_config=text.to_dict(), vision_config=vision,
                          tie_word_embeddings=text.tie_word_embeddings)


def layer_kinds(config: Glm5NextTextConfig) -> list[str]:
    """Per layer: "kda" or "dsa"."""
    return ["kda" if t == KDA else "dsa" for t in config.layer_types]


def describe(config: Glm5NextTextConfig) -> str:
    kinds = layer_kinds(config)
    return (f"{config.num_hidden_layers} layers ({kinds.count('kda')} KDA + {kinds.count('dsa')} DSA), "
            f"hidden {config.hidden_size}, {config.n_routed_experts} experts top-{config.num_experts_per_tok}, "
            f"index top-{config.index_topk} kpool {config.index_kpool}, vocab {config.vocab_size}")
