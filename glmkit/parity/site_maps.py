"""Capture glmkit sites inside a Megatron (miles / Megatron-Bridge) or SGLang process, where no dumper runs.

A few lines in the process that holds the model, around one forward of the capture's input:

    # Megatron (miles / Megatron-Bridge): `model` as the trainer holds it (DDP chunks are fine);
    # `batch` from miles' get_batch; run forward only, once, on the whole input.
    from megatron.core import mpu
    from glmkit.parity.site_maps import capture_live
    from glmkit.parity.dump import save_capture
    with torch.no_grad(), capture_live(model, "megatron", input_ids, cu_seqlens,
                                       packed_cu_seqlens=batch["cu_seqlens"], gather_tp=True,
                                       tp_group=mpu.get_tensor_model_parallel_group()) as live:
        model[0](batch["tokens"], None, None, packed_seq_params=batch["packed_seq_params"])
    if torch.distributed.get_rank() == 0:
        save_capture(live.to_capture(), "captures/megatron")

    # SGLang: in the process that holds the ModelRunner (e.g. a script built on sglang.bench_one_batch's
    # load_model), run with --disable-cuda-graph (hooks do not fire inside CUDA graph replays), one
    # prefill of the sequences in capture order, then
    with capture_live(model_runner.model, "sglang", input_ids, cu_seqlens) as live:
        ...                                   # extend() / the prefill forward
    save_capture(live.to_capture(), "captures/sglang")

`input_ids` [T] and `cu_seqlens` [N+1] are the capture's own tokens (glmkit.model.packed.pack of the
sequences); the result compares with `glmkit parity` like any other capture.

What each map reads, with its source (repo@commit:file:line, radixark/Megatron-LM branch
miles-main-20260819 = 235952df6):
  Megatron, under `<prefix>decoder.layers.<i>.` (prefix "module.module." under DDP/Float16Module):
    self_attention_hyper_connection / mlp_hyper_connection: HyperConnectionModule.forward returns
      (aggregated [s,b,C], h_res [s,b,n,n], h_post [s,b,n], residual [s,b,n*C]) (hyper_connection.py:551,
      615) -> {attn,ffn}_hc.comb / .post; h_pre is not returned, so compute_mappings (:371, returns
      h_pre, h_post, h_res at :421) is wrapped for .pre. h_res is applied as H_res^T @ residual
      (:139, :547): new stream j = sum_i h_res[i, j] stream i, glmkit's comb orientation as it is.
    mlp_hyper_connection's input (transformer_layer.py:2318) -> streams_after_attn; the layer's output
      (output, context) (:2092) -> streams_after_ffn; input_layernorm / pre_mlp_layernorm outputs
      (:2241, :2345) -> attn_in / mlp_in; self_attention / mlp (output, bias) -> attn_out / mlp_out.
    mlp.router: TopKRouter.forward returns (probs [s*b, E], routing_map [s*b, E] bool) (router.py:952,
      flattened sequence-major at :809) -> router_experts / router_weights; its gating (:103) is wrapped
      for router_scores = sigmoid(logits) + expert_bias (moe_utils.py:830).
    self_attention._kpool_select on DSA layers (radixark/miles@8f9a89a9
      miles_plugins/models/glm5_next/dsa.py:156, called at :208; Megatron-Bridge's Glm5NextDSAAttention
      has the same method): int32 [T, 1, W] packed token indices, -1 padded -> indexer_topk.
    decoder.final_layernorm (transformer_block.py:536) -> final_hidden.
  SGLang (sgl-project/sglang@0096f824 python/sglang/srt/models/glm5_next.py), under `model.layers.<i>.`:
    Glm5NextDecoderLayer._hc_pre (called by hc_attn_pre / hc_ffn_pre) returns (layer_input,
      comb [T, n*n], post [T, n], norm_fused) (kernels/ops/layernorm/mhc.py hc_pre) -> .comb / .post,
      its input streams -> streams_after_attn (ffn) / the previous layer's streams_after_ffn (attn),
      layer_input -> attn_in / mlp_in when the norm was fused; input_layernorm /
      post_attention_layernorm, self_attn, mlp.gate (logits), mlp.topk (topk_weights, topk_ids),
      mlp, model.norm.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from glmkit.parity.capture import HookCapturer, Tap
from glmkit.parity.dump import Capture, check_cu_seqlens

FRAMEWORKS = ("megatron", "sglang")


class TensorParallelShard(ValueError):
    """A module gave a tensor-parallel shard (or partial sum) and no gather was asked for."""


@dataclass
class SiteMap:
    """Where a framework's module tree produces glmkit sites. `taps` {module-name regex: [Tap]};
    the regexes' first group is the layer index in the module list, `layer_prefix` names the layer
    module itself (its `layer_attr` is the global layer number, `layer_base` its first value).
    `not_captured` {site: why}: sites this map cannot produce (listed, not faked)."""

    framework: str
    taps: dict
    layer_prefix: str
    layer_attr: str
    layer_base: int
    not_captured: dict = field(default_factory=dict)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _with_bias(out):
    """Megatron modules return (output, bias); the bias-dropout-add adds the bias (no dropout in eval)."""
    if isinstance(out, (tuple, list)):
        return out[0] if len(out) < 2 or out[1] is None else out[0] + out[1]
    return out


def _arg(args, kwargs, index, name):
    return args[index] if len(args) > index else kwargs[name]


# --- Megatron -------------------------------------------------------------------------------------------

_MG = r"(?:^|\.)decoder\.layers\.(\d+)"


def _mg_hc(prefix: str) -> list:
    def out(cap, layer, name, module, args, kwargs, out):
        _, h_res, h_post, _ = out
        cap.seq_first(layer, f"{prefix}.post", h_post, name)
        cap.seq_first(layer, f"{prefix}.comb", h_res, name)

    def pre(cap, layer, name, module, args, kwargs, out):
        cap.seq_first(layer, f"{prefix}.pre", out[0], name + ".compute_mappings")

    taps = [Tap(out), Tap(pre, on="method:compute_mappings")]
    if prefix == "ffn_hc":
        def streams(cap, layer, name, module, args, kwargs, out):
            x = _arg(args, kwargs, 0, "hidden_states")
            cap.seq_first(layer, "streams_after_attn", x.unflatten(-1, (module.n, -1)), name)
        taps.append(Tap(streams, on="pre"))
    return taps


def _mg_norm(site: str) -> Tap:
    def norm(cap, layer, name, module, args, kwargs, out):
        if type(module).__name__ == "IdentityOp":  # the norm is fused into the next linear
            cap.skip(layer, site, f"{name} is IdentityOp: the norm is fused into the following linear "
                                  f"(TELayerNormColumnParallelLinear), which does not return its output")
            return
        cap.seq_first(layer, site, _first(out), name)
    return Tap(norm)


def _mg_kpool(cap, layer, name, module, args, kwargs, out):
    psp = _arg(args, kwargs, 4, "packed_seq_params")
    cap.packed_topk(layer, out, getattr(psp, "cu_seqlens_kv", None), name + "._kpool_select")


def _mg_router(cap, layer, name, module, args, kwargs, out):
    probs, routing_map = out
    s, b = _arg(args, kwargs, 0, "input").shape[:2]
    ids = routing_map_ids(routing_map, module.topk)
    weights = torch.where(ids >= 0, probs.gather(-1, ids.clamp_min(0)), torch.zeros((), dtype=probs.dtype,
                                                                                      device=probs.device))
    cap.seq_first(layer, "router_experts", ids.view(s, b, -1), name)
    cap.seq_first(layer, "router_weights", weights.view(s, b, -1), name)


def _mg_gating(cap, layer, name, module, args, kwargs, out):
    if getattr(module, "score_function", "sigmoid") != "sigmoid":
        cap.skip(layer, "router_scores", f"{name}: score function {module.score_function!r}, not sigmoid")
        return
    scores = out.float().sigmoid()
    if getattr(module, "expert_bias", None) is not None:
        scores = scores + module.expert_bias.float()
    cap.seq_first(layer, "router_scores", scores, name + ".gating")


def _mg_layer_out(cap, layer, name, module, args, kwargs, out):
    cap.seq_first(layer, "streams_after_ffn", _first(out).unflatten(-1, (module.mlp_hyper_connection.n, -1)), name)


def megatron_glm5_next_sites() -> SiteMap:
    """glm5_next in Megatron: miles' plugin (miles_plugins/models/glm5_next) and Megatron-Bridge
    (megatron/bridge/models/glm5_next) build the same GPTModel tree of HyperConnectionTransformerLayers
    (Bridge's Glm5NextHyperConnectionModule subclasses HyperConnectionModule), so one map serves both.
    Names match with or without the DDP / Float16Module prefix ("module.module.")."""

    def seq(site):
        return Tap(lambda cap, layer, name, module, args, kwargs, out: cap.seq_first(layer, site, _with_bias(out),
                                                                                   name))

    taps = {
        _MG + r"\.self_attention_hyper_connection$": _mg_hc("attn_hc"),
        _MG + r"\.input_layernorm$": [_mg_norm("attn_in")],
        _MG + r"\.self_attention$": [seq("attn_out"), Tap(_mg_kpool, on="method:_kpool_select")],
        _MG + r"\.mlp_hyper_connection$": _mg_hc("ffn_hc"),
        _MG + r"\.pre_mlp_layernorm$": [_mg_norm("mlp_in")],
        _MG + r"\.mlp\.router$": [Tap(_mg_router), Tap(_mg_gating, on="method:gating")],
        _MG + r"\.mlp$": [seq("mlp_out")],
        _MG + r"$": [Tap(_mg_layer_out)],
        r"(?:^|\.)decoder\.final_layernorm$": [seq("final_hidden")],
    }
    not_captured = {
        "indexer_scores": "the kpool pool scores are ranked inside kpool_select_topk "
                          "(miles_plugins/models/glm5_next/ops/kpool_indexer.py), which returns indices only",
        "logits": "output_layer is vocab-parallel and miles computes log-probs in its loss, outside the "
                  "model; take log-probs from the framework's own output",
        "logprobs": "as logits",
        "mlp_in (dense layers)": "pre_mlp_layernorm is IdentityOp on dense layers (Megatron-LM "
                                 "gpt_layer_specs.py:329): the norm is fused into mlp.linear_fc1",
        "router_experts under routing replay": "with miles' routing replay, routing_map is the replayed "
                                               "choice, not this forward's own",
    }
    return SiteMap("megatron", taps, layer_prefix=_MG, layer_attr="layer_number", layer_base=1,
                   not_captured=not_captured)


# --- SGLang ---------------------------------------------------------------------------------------------

_SG = r"(?:^|\.)model\.layers\.(\d+)"


def _sg_positions(cap, layer, name, module, args, kwargs, out):
    cap.forward_rows = _arg(args, kwargs, 0, "positions").shape[0]


def _sg_hc_pre(cap, layer, name, module, args, kwargs, out):
    hc_fn, hidden_states = _arg(args, kwargs, 0, "hc_fn"), _arg(args, kwargs, 3, "hidden_states")
    layer_input, comb, post, norm_fused = out
    kind = "attn" if hc_fn is getattr(module, "hc_attn_fn", None) else "ffn"
    n = post.shape[-1]
    where = f"{name}._hc_pre ({kind})"
    cap.flat(layer, f"{kind}_hc.post", post, where)
    cap.flat(layer, f"{kind}_hc.comb", comb.view(-1, n, n), where)
    if kind == "ffn":
        cap.flat(layer, "streams_after_attn", hidden_states.view(hidden_states.shape[0], n, -1), where)
    elif layer > 0:  # the streams entering layer i are those layer i-1 left
        cap.flat(layer - 1, "streams_after_ffn", hidden_states.view(hidden_states.shape[0], n, -1), where)
    if norm_fused:
        cap.flat(layer, "attn_in" if kind == "attn" else "mlp_in", layer_input, where)


def _sg_attn(cap, layer, name, module, args, kwargs, out):
    o_proj = getattr(module, "o_proj", None)
    partial = (o_proj is not None and getattr(o_proj, "reduce_results", True) is False
               and getattr(o_proj, "tp_size", 1) > 1)
    cap.flat(layer, "attn_out", _first(out), name, partial_over=getattr(o_proj, "tp_size", 1) if partial else 1)


def _sg_mlp(cap, layer, name, module, args, kwargs, out):
    tp = getattr(module, "tp_size", None) or getattr(getattr(module, "down_proj", None), "tp_size", 1)
    if tp > 1:
        cap.skip(layer, "mlp_out", f"{name}: tp_size {tp}; whether its output is already reduced depends on "
                                   f"SGLang's all-reduce fusion at the layer boundary")
        return
    cap.flat(layer, "mlp_out", _first(out), name)


def _sg_gate(cap, layer, name, module, args, kwargs, out):
    scores = _first(out).float().sigmoid()
    if getattr(module, "e_score_correction_bias", None) is not None:
        scores = scores + module.e_score_correction_bias.float()
    cap.flat(layer, "router_scores", scores, name)


def _sg_topk(cap, layer, name, module, args, kwargs, out):
    if not hasattr(out, "topk_ids"):
        cap.skip(layer, "router_experts", f"{name}: top-k output {type(out).__name__} carries no expert ids "
                                          f"(a bypassed / kernel format)")
        return
    ids, weights = out.topk_ids.long(), out.topk_weights.float()
    gate = cap.modules.get(name.rsplit(".", 1)[0] + ".gate")
    routed = gate.weight.shape[0] if gate is not None else None
    if routed is not None:  # a fused shared expert rides along as ids >= n_routed: not a routed choice
        keep = ids < routed
        k = int(keep.sum(-1).max()) if ids.numel() else ids.shape[-1]
        order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[:, :k]
        ids, weights, keep = ids.gather(-1, order), weights.gather(-1, order), keep.gather(-1, order)
        ids, weights = torch.where(keep, ids, -1), torch.where(keep, weights, 0.0)
    config = getattr(module, "topk_config", None)
    scaling = getattr(config, "routed_scaling_factor", None)
    if getattr(config, "apply_routed_scaling_factor_on_output", None) is False and scaling:
        weights = weights * scaling  # SGLang scales the experts' output instead; glmkit's weights carry it
    cap.flat(layer, "router_experts", ids, name)
    cap.flat(layer, "router_weights", weights, name)


def sglang_glm5_next_sites() -> SiteMap:
    """glm5_next in SGLang (python/sglang/srt/models/glm5_next.py): flattened tokens [T, ...], mHC
    parameters and hc_* methods on the decoder layer."""

    def flat(site):
        return Tap(lambda cap, layer, name, module, args, kwargs, out: cap.flat(layer, site, _first(out), name))

    taps = {
        _SG + r"$": [Tap(_sg_positions, on="pre"), Tap(_sg_hc_pre, on="method:_hc_pre")],
        _SG + r"\.input_layernorm$": [flat("attn_in")],
        _SG + r"\.self_attn$": [Tap(_sg_attn)],
        _SG + r"\.post_attention_layernorm$": [flat("mlp_in")],
        _SG + r"\.mlp\.gate$": [Tap(_sg_gate)],
        _SG + r"\.mlp\.topk$": [Tap(_sg_topk)],
        _SG + r"\.mlp$": [Tap(_sg_mlp)],
        r"(?:^|\.)model\.norm$": [Tap(lambda cap, layer, name, module, args, kwargs, out:
                                      cap.flat(None, "final_hidden", _first(out), name))],
    }
    not_captured = {
        "attn_hc.pre": "SGLang's hc_pre returns (layer_input, comb, post, norm_fused): pre is used inside "
                       "the kernel and never returned",
        "ffn_hc.pre": "as attn_hc.pre",
        "indexer_topk": "SGLang's DSA/kpool indexer selects KV-cache locations (paged), not packed token "
                        "positions; use glmkit's capture_sglang (the server's return_indexer_topk)",
        "indexer_scores": "computed inside the indexer kernel, not returned",
        "streams_after_ffn (last layer)": "read from the next layer's hc_attn_pre input; the last layer's "
                                          "streams are contracted inside the layer boundary",
        "logits": "LogitsProcessor gathers vocab shards outside the layers; use capture_sglang",
        "logprobs": "as logits",
        "steps with cross-layer mHC fusion": "hc_ffn_post_pre (<= 16 tokens, when enabled) bypasses _hc_pre: "
                                             "such a forward leaves ffn_hc / streams_after_attn rows missing",
    }
    return SiteMap("sglang", taps, layer_prefix=_SG, layer_attr="layer_id", layer_base=0,
                   not_captured=not_captured)


def site_map(framework: str) -> SiteMap:
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework {framework!r}: expected one of {', '.join(FRAMEWORKS)}")
    return megatron_glm5_next_sites() if framework == "megatron" else sglang_glm5_next_sites()


# --- conversions ----------------------------------------------------------------------------------------

def routing_map_ids(routing_map: torch.Tensor, k: int) -> torch.Tensor:
    """Megatron's routing_map [T, E] bool -> expert ids [T, k] int64, ascending, -1 where a row chose
    fewer than k (dropped tokens)."""
    E = routing_map.shape[-1]
    chosen = int(routing_map.sum(-1).max()) if routing_map.numel() else 0
    if chosen > k:
        raise ValueError(f"routing_map selects up to {chosen} experts in a row, more than top-k {k}")
    key = torch.where(routing_map.bool(), torch.arange(E, device=routing_map.device), E)
    ids = key.sort(-1).values[..., :k]
    return torch.where(ids == E, -1, ids)


def packed_to_local(indices: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Absolute packed token indices [T, W] (-1 empty; row t is token t of the packed stream) ->
    positions inside row t's own sequence. Raises if an index leaves its row's sequence."""
    T = indices.shape[0]
    cu = check_cu_seqlens(cu_seqlens.cpu(), T, f"cu_seqlens for {T} index rows").to(indices.device)
    seq = torch.searchsorted(cu[1:], torch.arange(T, device=indices.device), right=True)
    start, end = cu[seq][:, None], cu[seq + 1][:, None]
    valid = indices >= 0
    bad = valid & ((indices < start) | (indices >= end))
    if bad.any():
        t = int(bad.any(-1).nonzero()[0])
        raise ValueError(f"row {t} (sequence {int(seq[t])}, tokens {int(start[t])}..{int(end[t]) - 1}) selects "
                         f"token {int(indices[t][bad[t]][0])} outside its sequence: the indices are not packed "
                         f"positions under these cu_seqlens")
    return torch.where(valid, indices.long() - start, -1)


# --- the capturer ---------------------------------------------------------------------------------------

class LiveCapture(HookCapturer):
    """HookCapturer with a framework's site map and its layout rules. See `capture_live`."""

    def __init__(self, model, framework: str, input_ids, cu_seqlens, *, layout: str = "thd",
                 packed_cu_seqlens=None, padded_len: int | None = None, layer_offset: int | None = None,
                 gather_tp: bool = False, tp_group=None, indexer_width: int | None = None, **manifest):
        self.sites = site_map(framework)
        super().__init__(model, self.sites.taps, layer=self._layer)
        self.framework = framework
        self.input_ids = torch.as_tensor(input_ids).flatten()
        self.cu_seqlens = check_cu_seqlens(torch.as_tensor(cu_seqlens).cpu(), self.input_ids.numel())
        self.lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        self.layer_offset, self.gather_tp, self.tp_group = layer_offset, gather_tp, tp_group
        self.indexer_width, self.manifest = indexer_width, manifest
        self.skipped, self.forward_rows = {}, None
        if layout not in ("thd", "bshd"):
            raise ValueError(f"layout {layout!r}: expected 'thd' (packed, b=1) or 'bshd' (one sequence per batch row)")
        self.layout = layout
        if framework == "megatron":
            self._megatron_layout(packed_cu_seqlens, padded_len)

    def _megatron_layout(self, packed_cu_seqlens, padded_len):
        """Where each capture token sits among the framework's batch-major rows ([s, b] -> b*s rows)."""
        if self.layout == "thd":
            fw = self.cu_seqlens if packed_cu_seqlens is None else torch.as_tensor(packed_cu_seqlens).cpu()
            if packed_cu_seqlens is not None:
                fw = check_cu_seqlens(fw, int(fw.reshape(-1)[-1]) if fw.numel() else 0, "packed_cu_seqlens")
            fw_lengths = (fw[1:] - fw[:-1]).tolist()
            if len(fw_lengths) < len(self.lengths) or any(f < n for f, n in zip(fw_lengths, self.lengths)):
                raise ValueError(f"packed_cu_seqlens {fw.tolist()} does not hold sequences of lengths {self.lengths}")
            self.batch, self.seq_len, self.fw_cu = 1, int(fw[-1]), fw
            starts = fw[:-1].tolist()
        else:
            self.batch = len(self.lengths)
            self.seq_len = padded_len or max(self.lengths)
            if self.seq_len < max(self.lengths):
                raise ValueError(f"padded_len {self.seq_len} is shorter than the longest sequence "
                                 f"({max(self.lengths)})")
            self.fw_cu = None
            starts = [n * self.seq_len for n in range(self.batch)]
        self.token_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, self.lengths)])

    # layer numbers ---------------------------------------------------------------------------------------
    def _layer(self, name, module, m):
        if not m.groups():
            return None
        local = int(m.group(1))
        owner = self.modules.get(name[:re.search(self.sites.layer_prefix, name).end()])
        given = getattr(owner, self.sites.layer_attr, None)
        if self.layer_offset is None:
            return int(given) - self.sites.layer_base if given is not None else local
        layer = self.layer_offset + local
        if given is not None and int(given) - self.sites.layer_base != layer:
            raise ValueError(f"{name}: layer_offset {self.layer_offset} + local index {local} = {layer}, but the "
                             f"module's {self.sites.layer_attr} says layer {int(given) - self.sites.layer_base}")
        return layer

    # reporting -------------------------------------------------------------------------------------------
    def skip(self, layer, site, why: str):
        self.skipped.setdefault(site, {})[layer] = why

    def put(self, layer, site, rows):
        if self.framework == "megatron" and (layer, site) in self.outputs:
            raise RuntimeError(f"{'final' if layer is None else f'layer {layer}'} {site} reported twice: a Megatron "
                               f"capture takes exactly one forward of the whole input (run it under "
                               f"torch.no_grad(), one micro-batch, no activation recompute)")
        super().put(layer, site, rows)

    def _full_rows(self, t: torch.Tensor, full: int, name: str, site: str, partial_over: int = 1):
        """t [rows, ...] as the whole batch: all-gathered over the TP group if it is a shard (rows split
        over tensor / sequence-parallel ranks), all-reduced if a partial sum; else refused."""
        if t.shape[0] > full:
            raise ValueError(f"{self.framework} module '{name}' gave {site} with {t.shape[0]} token rows, more than "
                             f"the {full} the layout holds (pass the framework's padded packed_cu_seqlens / "
                             f"padded_len)")
        shard = t.shape[0] < full
        if not shard and partial_over == 1:
            return t
        what = (f"a tensor-parallel shard of shape {list(t.shape)}; the full tensor is {[full, *t.shape[1:]]}"
                if shard else f"a partial sum over {partial_over} tensor-parallel ranks (o_proj reduce_results=False), "
                              f"shape {list(t.shape)}")
        if not self.gather_tp:
            raise TensorParallelShard(
                f"{self.framework} module '{name}' gave {site} as {what}. Pass gather_tp=True with tp_group=<the "
                f"tensor-parallel process group> (torch.distributed initialised) to gather it, or capture with "
                f"TP=1 and sequence parallelism off; a shard is never captured as it is")
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"gather_tp=True but torch.distributed is not initialised ({name}: {what})")
        world = dist.get_world_size(self.tp_group)
        if shard:
            if t.shape[0] * world != full:
                raise TensorParallelShard(f"{self.framework} module '{name}' gave {site} as {what}; {world} ranks x "
                                          f"{t.shape[0]} rows != {full} (context parallelism or an uneven split: "
                                          f"not supported)")
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            t = torch.cat(parts)
        if partial_over > 1:
            t = t.detach().clone()
            dist.all_reduce(t, group=self.tp_group)
        return t

    def seq_first(self, layer, site, t: torch.Tensor, name: str):
        """Megatron [s, b, ...] (sequence-first; s may be a TP/SP shard) -> capture token rows."""
        if t.dim() < 2 or t.shape[1] != self.batch:
            raise ValueError(f"megatron module '{name}' gave {site} of shape {list(t.shape)}: expected "
                             f"[s, b={self.batch}, ...] for layout {self.layout!r}")
        t = self._full_rows(t.detach(), self.seq_len, name, site)
        rows = t.transpose(0, 1).reshape(self.batch * self.seq_len, *t.shape[2:])  # batch-major: input order
        self.put(layer, site, rows[self.token_rows.to(rows.device)])

    def packed_topk(self, layer, indices: torch.Tensor, cu_kv, name: str):
        """Megatron _kpool_select's int32 [T, 1, W] absolute packed indices -> sequence-local rows."""
        if self.layout != "thd":
            raise ValueError(f"{name}: Megatron's DSA runs packed THD only (b=1); capture with layout='thd'")
        idx = indices.detach().reshape(indices.shape[0], -1)
        if idx.shape[0] != self.seq_len:
            raise ValueError(f"{name} gave {idx.shape[0]} index rows; the packed stream has {self.seq_len} tokens")
        if cu_kv is not None and not torch.equal(torch.as_tensor(cu_kv).long().cpu(), self.fw_cu):
            raise ValueError(f"{name} ran with cu_seqlens_kv {torch.as_tensor(cu_kv).tolist()}, but the capture was "
                             f"given {self.fw_cu.tolist()} (pass the batch's own packed_cu_seqlens)")
        local = packed_to_local(idx, self.fw_cu)[self.token_rows.to(idx.device)].sort(-1).values
        if self.indexer_width is not None and local.shape[1] > self.indexer_width:
            extra = local.shape[1] - self.indexer_width
            if (local[:, :extra] != -1).any():
                raise ValueError(f"{name}: rows select more than indexer_width={self.indexer_width} tokens")
            local = local[:, extra:]
        self.put(layer, "indexer_topk", local)

    def flat(self, layer, site, t: torch.Tensor, name: str, partial_over: int = 1):
        """SGLang [tokens of this forward, ...] -> capture rows (forwards append in order)."""
        full = self.forward_rows if self.forward_rows is not None else t.shape[0]
        self.put(layer, site, self._full_rows(t.detach(), full, name, site, partial_over))

    def to_capture(self, **manifest) -> Capture:
        """The capture of what ran inside the `with` block: every site reported, in token order."""
        runtime = {f"{site} ({', '.join('final' if k is None else f'layer {k}' for k in layers)})":
                   next(iter(layers.values())) for site, layers in self.skipped.items()}
        return super().to_capture(self.input_ids, self.cu_seqlens, path=self.framework,
                                  not_captured={**self.sites.not_captured, **runtime},
                                  **{**self.manifest, **manifest})


@contextmanager
def capture_live(model, framework: str, input_ids, cu_seqlens, **options):
    """Hooks on a live Megatron or SGLang model for the `with` block; `.to_capture()` after it.

    framework: "megatron" (miles' or Megatron-Bridge's glm5_next) or "sglang".
    input_ids [T], cu_seqlens [N+1]: the capture's tokens, sequences end to end.
    Options:
      layout: "thd" (packed, b=1; default) or "bshd" (Megatron, one sequence per batch row, padded to
        padded_len): [s, b, h] tensors become batch-major token rows in the input's order.
      packed_cu_seqlens: the cu_seqlens the framework ran with (miles pads the packed stream to a
        multiple of TP*128 with a trailing pseudo-sequence); default: cu_seqlens.
      layer_offset: global index of this pipeline stage's first layer; default: each layer module's own
        global number (Megatron's 1-based layer_number, SGLang's layer_id), checked when both are given.
      gather_tp, tp_group: all-gather sequence-parallel shards (and all-reduce SGLang's partial
        attention outputs) over the TP group; without them a shard is refused with its shapes.
      indexer_width: narrow indexer_topk to glmkit's width (index_topk + kpool - 1) when the framework
        pads wider (Megatron rounds up to a multiple of 64) and the extra slots are empty.
    """
    live = LiveCapture(model, framework, input_ids, cu_seqlens, **options)
    with live:
        yield live
