"""The site vocabulary every path reports in: (layer, site). Defined once; parity builds on it."""

PER_LAYER = (
    "attn_hc.pre", "attn_hc.post", "attn_hc.comb", "attn_in", "indexer_topk", "attn_out",
    "streams_after_attn", "ffn_hc.pre", "ffn_hc.post", "ffn_hc.comb", "mlp_in",
    "router_experts", "router_weights", "mlp_out", "streams_after_ffn",
)
FINAL = ("final_hidden", "logits", "logprobs")
INDEX_SITES = ("indexer_topk", "router_experts")  # compared as sets, not values
