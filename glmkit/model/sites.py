"""The site vocabulary every path reports in: (layer, site). Defined once; parity builds on it."""

PER_LAYER = (
    "attn_hc.pre", "attn_hc.post", "attn_hc.comb", "attn_in", "indexer_scores", "indexer_topk", "attn_out",
    "streams_after_attn", "ffn_hc.pre", "ffn_hc.post", "ffn_hc.comb", "mlp_in",
    "router_scores", "router_experts", "router_weights", "mlp_out", "streams_after_ffn",
)
FINAL = ("final_hidden", "logits", "logprobs")
INDEX_SITES = ("indexer_topk", "router_experts")  # compared as sets, not values
# What each index site's tie judgement reads: per row, the score of every candidate (-inf where a
# pool or expert is not one). Full rows rather than the selected scores alone, because judging a
# differing pool needs the score each side gave it, including the side that did not select it.
SCORE_SITE = {"indexer_topk": "indexer_scores", "router_experts": "router_scores"}
AUX_SITES = tuple(SCORE_SITE.values())  # recorded for the comparison of index sites, not compared
