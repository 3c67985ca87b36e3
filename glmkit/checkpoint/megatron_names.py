"""The recipe framework's glm5_next name map: Megatron `torch_dist` keys <-> HF checkpoint names.

Built from what miles' bridge (`miles_plugins/mbridge/glm5_next.py`, HF -> Megatron, used by
`tools/convert_hf_to_torch_dist.py`) and raw converter (`megatron_to_hf/glm5_next.py`, Megatron -> HF,
used for weight sync) do, as facts; the code is glmkit's own. Keys are the ones a torch_dist checkpoint
stores (no `module.` prefix, global layer index, experts stacked), not the live module names:

    embedding.word_embeddings.weight                       <- embed_tokens.weight (rows may be padded)
    output_layer.weight                                    <- lm_head.weight
    decoder.final_layernorm.weight                         <- norm.weight
    decoder.layers.{i}.input_layernorm.weight              <- layers.{i}.input_layernorm.weight
    ...{self_attention,mlp}_hyper_connection.mapping_proj.weight <- hc_{attn,ffn}_fn
    ...{self_attention,mlp}_hyper_connection.bias           <- hc_{attn,ffn}_base
    ...{self_attention,mlp}_hyper_connection.alpha_{pre,post,res}  <- hc_{attn,ffn}_scale[0], [1], [2]
    KDA  ...self_attention.kda.<name>                       <- self_attn.<name>, except
         ...self_attention.kda.conv1d.weight                <- cat(q_conv1d, k_conv1d, v_conv1d) on dim 0
    DSA  ...self_attention.linear_q_down_proj.weight        <- self_attn.q_a_proj.weight
         ...self_attention.linear_q_up_proj.layer_norm_weight <- self_attn.q_a_layernorm.weight (fused norm)
         ...self_attention.linear_q_up_proj.weight          <- self_attn.q_b_proj.weight
         ...self_attention.linear_kv_down_proj.weight       <- self_attn.kv_a_proj_with_mqa.weight
         ...self_attention.linear_kv_up_proj.layer_norm_weight <- self_attn.kv_a_layernorm.weight
         ...self_attention.linear_kv_up_proj.weight         <- self_attn.kv_b_proj.weight
         ...self_attention.linear_proj.weight               <- self_attn.o_proj.weight
         ...self_attention.{wq_b,wk,k_norm,weights_proj,index_kpool_compress_*} <- self_attn.indexer.*
    dense MLP (layers before first_k_dense_replace)
         ...mlp.linear_fc1.layer_norm_weight                <- post_attention_layernorm.weight (fused norm)
         ...mlp.linear_fc1.weight                           <- cat(gate_proj, up_proj) on dim 0
         ...mlp.linear_fc2.weight                           <- down_proj
    MoE  ...pre_mlp_layernorm.weight                        <- post_attention_layernorm.weight
         ...mlp.router.weight / .expert_bias                <- mlp.gate.weight / .e_score_correction_bias
         ...mlp.shared_experts.linear_fc{1,2}.weight        <- shared_experts (fc1 = cat(gate, up))
         ...mlp.experts.experts.linear_fc1.weight [E, 2I, D] <- experts.{e}: stack over e of cat(gate, up)
         ...mlp.experts.experts.linear_fc2.weight [E, D, I]  <- experts.{e}.down_proj, stacked

HF names here are relative to the text prefix (`model.language_model.` in the released checkpoint,
`model.` in the framework's own export); `lm_head.weight` has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Glm5NextTextConfig

from glmkit.config import DSA, KDA

# How a Megatron tensor is made of its HF tensors.
COPY = "copy"    # the one HF tensor as it is
CAT = "cat"      # the HF tensors concatenated on dim 0 (gate; up  or  q; k; v)
PICK = "pick"    # one element of the HF tensor, as a [1] tensor (mHC alpha <- hc_*_scale[index])
STACK = "stack"  # experts: a new dim 0 over experts, each expert the CAT of its `group` HF tensors

# Tensors the framework keeps in fp32 in the torch_dist checkpoint (`mark_keep_in_fp32`, and the
# router's expert_bias buffer); stored narrower they lose what the HF checkpoint holds.
_FP32_SUFFIXES = ("kda.A_log", "kda.dt_bias", "index_kpool_compress_ape", "router.expert_bias")
_FP32_PARTS = ("_hyper_connection.",)


@dataclass(frozen=True)
class Rule:
    """One torch_dist key and the HF tensors it is made of."""

    key: str
    hf: tuple[str, ...]
    join: str = COPY
    index: int = 0   # PICK: which element
    group: int = 1   # STACK: HF tensors per expert

    @property
    def experts(self) -> int:
        return len(self.hf) // self.group if self.join == STACK else 0

    def expert_names(self, e: int) -> tuple[str, ...]:
        return self.hf[e * self.group:(e + 1) * self.group]

    @property
    def keeps_fp32(self) -> bool:
        return self.key.endswith(_FP32_SUFFIXES) or any(part in self.key for part in _FP32_PARTS)

    def shape(self, hf_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The Megatron shape, from the HF shapes."""
        if self.join == COPY:
            return tuple(hf_shapes[self.hf[0]])
        if self.join == PICK:
            return (1,)
        first = tuple(hf_shapes[self.hf[0]])
        if self.join == CAT:
            return (sum(hf_shapes[n][0] for n in self.hf),) + first[1:]
        rows = sum(hf_shapes[n][0] for n in self.expert_names(0))
        return (self.experts, rows) + first[1:]


_KDA_COPIED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "f_a_proj.weight",
               "f_b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "A_log", "dt_bias", "o_norm.weight",
               "o_proj.weight")
_MLA = {
    "q_a_proj.weight": "linear_q_down_proj.weight",
    "q_a_layernorm.weight": "linear_q_up_proj.layer_norm_weight",
    "q_b_proj.weight": "linear_q_up_proj.weight",
    "kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
    "kv_a_layernorm.weight": "linear_kv_up_proj.layer_norm_weight",
    "kv_b_proj.weight": "linear_kv_up_proj.weight",
    "o_proj.weight": "linear_proj.weight",
    # attention_bias configs (not GLM-5.3-Flash): Megatron's linears carry the bias beside the weight
    "q_a_proj.bias": "linear_q_down_proj.bias",
    "kv_a_proj_with_mqa.bias": "linear_kv_down_proj.bias",
    "o_proj.bias": "linear_proj.bias",
}
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
            "index_kpool_compress_gate", "index_kpool_compress_ape")
_SITES = (("attn", "self_attention"), ("ffn", "mlp"))
ALPHAS = ("alpha_pre", "alpha_post", "alpha_res")  # hc_*_scale[0], [1], [2]


def _layer_rules(config: Glm5NextTextConfig, i: int, hf_names: set[str]) -> list[Rule]:
    hf = f"layers.{i}."
    mc = f"decoder.layers.{i}."
    rules = [Rule(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",))]
    for site, module in _SITES:
        hc = f"{mc}{module}_hyper_connection."
        rules.append(Rule(hc + "mapping_proj.weight", (f"{hf}hc_{site}_fn",)))
        rules.append(Rule(hc + "bias", (f"{hf}hc_{site}_base",)))
        rules += [Rule(hc + alpha, (f"{hf}hc_{site}_scale",), PICK, index=k) for k, alpha in enumerate(ALPHAS)]

    if config.layer_types[i] == KDA:
        rules += [Rule(f"{mc}self_attention.kda.{name}", (f"{hf}self_attn.{name}",)) for name in _KDA_COPIED]
        rules.append(Rule(mc + "self_attention.kda.conv1d.weight",
                          tuple(f"{hf}self_attn.{p}_conv1d.weight" for p in "qkv"), CAT))
    elif config.layer_types[i] == DSA:
        rules += [Rule(f"{mc}self_attention.{ours}", (f"{hf}self_attn.{theirs}",))
                  for theirs, ours in _MLA.items() if f"{hf}self_attn.{theirs}" in hf_names]
        rules += [Rule(f"{mc}self_attention.{name}", (f"{hf}self_attn.indexer.{name}",))
                  for name in _INDEXER if f"{hf}self_attn.indexer.{name}" in hf_names]
    else:
        raise ValueError(f"layer {i}: no Megatron name map for layer type {config.layer_types[i]!r}; "
                         f"allowed: {KDA!r}, {DSA!r}")

    if config.mlp_layer_types[i] == "dense":
        rules += [Rule(mc + "mlp.linear_fc1.layer_norm_weight", (hf + "post_attention_layernorm.weight",)),
                  Rule(mc + "mlp.linear_fc1.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), CAT),
                  Rule(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",))]
    elif config.mlp_layer_types[i] == "sparse":
        experts = range(config.n_routed_experts)
        fc1 = tuple(f"{hf}mlp.experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up"))
        fc2 = tuple(f"{hf}mlp.experts.{e}.down_proj.weight" for e in experts)
        shared = hf + "mlp.shared_experts."
        rules += [Rule(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",)),
                  Rule(mc + "mlp.router.weight", (hf + "mlp.gate.weight",)),
                  Rule(mc + "mlp.router.expert_bias", (hf + "mlp.gate.e_score_correction_bias",)),
                  Rule(mc + "mlp.shared_experts.linear_fc1.weight", (shared + "gate_proj.weight", shared + "up_proj.weight"), CAT),
                  Rule(mc + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",)),
                  Rule(mc + "mlp.experts.experts.linear_fc1.weight", fc1, STACK, group=2),
                  Rule(mc + "mlp.experts.experts.linear_fc2.weight", fc2, STACK, group=1)]
    else:
        raise ValueError(f"layer {i}: no Megatron name map for mlp type {config.mlp_layer_types[i]!r}; "
                         f"allowed: 'dense', 'sparse'")
    return rules


def megatron_rules(config: Glm5NextTextConfig, hf_shapes: dict[str, tuple[int, ...]]) -> dict[str, Rule]:
    """Every torch_dist key of a model with `config` -> its Rule. `hf_shapes` are the HF tensors (names
    relative to the text prefix, `lm_head.weight` as is); every one of them must be used by a rule, so a tensor the map does not know is an error here, not a silent gap in a check."""
    names = set(hf_shapes)
    rules = [Rule("embedding.word_embeddings.weight", ("embed_tokens.weight",)),
             Rule("decoder.final_layernorm.weight", ("norm.weight",))]
    if "lm_head.weight" in names:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    for i in range(config.num_hidden_layers):
        rules += _layer_rules(config, i, names)
    used = [n for rule in rules for n in rule.hf]
    missing = sorted(set(used) - names)
    if missing:
        raise ValueError(f"the HF tensors lack {len(missing)} names the map needs, e.g. {missing[:3]}")
    unmapped = sorted(names - set(used))
    if unmapped:
        raise ValueError(f"no Megatron name for {len(unmapped)} HF tensors, e.g. {unmapped[:3]}")
    return {rule.key: rule for rule in rules}
