"""On-disk tensor names and shapes of a GLM-5.3-Flash checkpoint, derived from the config alone.

The names are the ones `Glm5NextForConditionalGeneration.save_pretrained` writes (transformers
renames several of them in memory: `f_a_proj` -> `forget_gate.f_a_proj`, the three `*_conv1d`
are fused into `conv1d`, per-expert weights are stacked into `gate_up_proj` / `down_proj`,
`hc_attn_fn` -> `attn_hc.fn`). Only text tensors are listed; vision (`model.visual.*`) and MTP
tensors are not part of what glmkit reads or writes.
"""

from __future__ import annotations

import re

from transformers import Glm5NextTextConfig

from glmkit.config import DSA, KDA

TEXT_PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"
EMBED = TEXT_PREFIX + "embed_tokens.weight"
FINAL_NORM = TEXT_PREFIX + "norm.weight"
VISION_PREFIX = "model.visual."

_LAYER_RE = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def checkpoint_key(name: str) -> str:
    """A text model's parameter name (`layers.0.mlp...`, `lm_head.weight`) as a checkpoint stores it."""
    return name if name == LM_HEAD else TEXT_PREFIX + name


def layer_prefix(i: int) -> str:
    """`model.language_model.layers.{i}.`"""
    return f"{TEXT_PREFIX}layers.{i}."


def layer_of(name: str) -> int | None:
    """Layer index of a full on-disk name, or None for embed / norm / lm_head / vision tensors."""
    match = _LAYER_RE.match(name)
    return int(match.group(1)) if match else None


def _hyper_connection(config: Glm5NextTextConfig) -> dict[str, tuple[int, ...]]:
    # mHC: one projection of the flattened n streams to (pre n, post n, comb n*n) mixing weights.
    n, width = config.hc_mult, config.hidden_size
    mixes = (2 + n) * n
    shapes = {}
    for site in ("attn", "ffn"):
        shapes[f"hc_{site}_fn"] = (mixes, n * width)
        shapes[f"hc_{site}_base"] = (mixes,)
        shapes[f"hc_{site}_scale"] = (3,)
    return shapes


def _kda(config: Glm5NextTextConfig) -> dict[str, tuple[int, ...]]:
    d, heads, dk = config.hidden_size, config.linear_num_heads, config.linear_head_dim
    qkv = heads * dk
    kernel = config.linear_conv_kernel_dim
    shapes = {}
    for proj in ("q", "k", "v"):
        shapes[f"self_attn.{proj}_proj.weight"] = (qkv, d)
        shapes[f"self_attn.{proj}_conv1d.weight"] = (qkv, 1, kernel)  # depthwise conv
    shapes.update({
        "self_attn.A_log": (heads,),
        "self_attn.dt_bias": (qkv,),
        "self_attn.f_a_proj.weight": (dk, d),
        "self_attn.f_b_proj.weight": (qkv, dk),
        "self_attn.b_proj.weight": (heads, d),
        "self_attn.g_a_proj.weight": (dk, d),
        "self_attn.g_b_proj.weight": (qkv, dk),
        "self_attn.o_norm.weight": (dk,),
        "self_attn.o_proj.weight": (d, qkv),
    })
    return shapes


def _dsa(config: Glm5NextTextConfig, with_indexer: bool) -> dict[str, tuple[int, ...]]:
    d, heads = config.hidden_size, config.num_attention_heads
    q_rank, kv_rank = config.q_lora_rank, config.kv_lora_rank
    qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    shapes = {
        "self_attn.q_a_proj.weight": (q_rank, d),
        "self_attn.q_a_layernorm.weight": (q_rank,),
        "self_attn.q_b_proj.weight": (heads * qk_head, q_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + config.qk_rope_head_dim, d),
        "self_attn.kv_a_layernorm.weight": (kv_rank,),
        "self_attn.kv_b_proj.weight": (heads * (config.qk_nope_head_dim + config.v_head_dim), kv_rank),
        "self_attn.o_proj.weight": (d, heads * config.v_head_dim),
    }
    if config.attention_bias:
        shapes["self_attn.q_a_proj.bias"] = (q_rank,)
        shapes["self_attn.kv_a_proj_with_mqa.bias"] = (kv_rank + config.qk_rope_head_dim,)
        shapes["self_attn.o_proj.bias"] = (d,)
    if with_indexer:
        i_heads, i_dim = config.index_n_heads, config.index_head_dim
        shapes.update({
            "self_attn.indexer.wq_b.weight": (i_heads * i_dim, q_rank),
            "self_attn.indexer.wk.weight": (i_dim, d),
            "self_attn.indexer.k_norm.weight": (i_dim,),
            "self_attn.indexer.k_norm.bias": (i_dim,),
            "self_attn.indexer.weights_proj.weight": (i_heads, d),
            "self_attn.indexer.index_kpool_compress_gate": (i_dim, d),
            "self_attn.indexer.index_kpool_compress_ape": (config.index_kpool, i_dim),
        })
    return shapes


def _swiglu(prefix: str, d: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}gate_proj.weight": (inner, d),
        f"{prefix}up_proj.weight": (inner, d),
        f"{prefix}down_proj.weight": (d, inner),
    }


def _moe(config: Glm5NextTextConfig) -> dict[str, tuple[int, ...]]:
    d, experts, inner = config.hidden_size, config.n_routed_experts, config.moe_intermediate_size
    if config.n_shared_experts < 1:  # glm5_next's MoE always runs its shared expert (width I x n)
        raise ValueError(f"n_shared_experts {config.n_shared_experts} is not supported; allowed: >= 1 "
                         f"(GLM-5.3-Flash has 1)")
    shapes = {}
    for e in range(experts):
        shapes.update(_swiglu(f"mlp.experts.{e}.", d, inner))
    shapes["mlp.gate.weight"] = (experts, d)
    shapes["mlp.gate.e_score_correction_bias"] = (experts,)
    shapes.update(_swiglu("mlp.shared_experts.", d, inner * config.n_shared_experts))
    return shapes


def layer_tensors(config: Glm5NextTextConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Names (relative to `layers.{i}.`) and shapes of one decoder layer."""
    d = config.hidden_size
    shapes = _hyper_connection(config)
    shapes["input_layernorm.weight"] = (d,)
    shapes["post_attention_layernorm.weight"] = (d,)

    kind = config.layer_types[i]
    if kind == KDA:
        shapes.update(_kda(config))
    elif kind == DSA:
        # A "shared" DSA layer reuses the previous layer's top-k and has no indexer module.
        shapes.update(_dsa(config, with_indexer=config.indexer_types[i] != "shared"))
    else:
        raise ValueError(f"layer {i}: unknown layer type {kind!r}")

    mlp = config.mlp_layer_types[i]
    if mlp == "dense":
        shapes.update(_swiglu("mlp.", d, config.intermediate_size))
    elif mlp == "sparse":
        shapes.update(_moe(config))
    else:
        raise ValueError(f"layer {i}: unknown mlp type {mlp!r}")
    return shapes


def expected_tensor_count(config: Glm5NextTextConfig) -> int:
    """len(expected_tensors(config)), counted without making the names: one layer of each kind is
    built with a single routed expert, and each routed expert adds its three projections."""
    import copy

    one = copy.copy(config)
    one.n_routed_experts = 1
    per_kind, count = {}, 1 + 1 + (0 if config.tie_word_embeddings else 1)  # embed, final norm, lm_head
    for i in range(config.num_hidden_layers):
        kind = (config.layer_types[i], config.mlp_layer_types[i], config.indexer_types[i])
        if kind not in per_kind:
            per_kind[kind] = len(layer_tensors(one, i)) + (3 * (config.n_routed_experts - 1)
                                                           if kind[1] == "sparse" else 0)
        count += per_kind[kind]
    return count


def expected_tensors(config: Glm5NextTextConfig) -> dict[str, tuple[int, ...]]:
    """Every text tensor save_pretrained writes for `config`: full name -> shape.

    Ordered embed, layers 0..L-1, norm, lm_head, so sharded writes keep a layer together.
    """
    shapes = {EMBED: (config.vocab_size, config.hidden_size)}
    for i in range(config.num_hidden_layers):
        prefix = layer_prefix(i)
        shapes.update({prefix + name: shape for name, shape in layer_tensors(config, i).items()})
    shapes[FINAL_NORM] = (config.hidden_size,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, config.hidden_size)
    return shapes


# Tensors transformers keeps in fp32 whatever the model dtype (`_keep_in_fp32_modules_strict`,
# matched here on the on-disk names).
_FP32_RE = re.compile(r"(e_score_correction_bias|mlp\.gate\.weight|conv1d\.weight|dt_bias|A_log"
                      r"|hc_(attn|ffn)_(base|scale))$")


def keeps_fp32(name: str) -> bool:
    """Whether transformers holds this on-disk tensor in fp32 even in a bf16 model."""
    return bool(_FP32_RE.search(name))
