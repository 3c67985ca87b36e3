"""One decoder block: mHC around the attention (KDA or DSA) and around the MLP (dense or MoE)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from glmkit.kernels.fuse import fusing
from glmkit.kernels.registry import KernelPlan
from glmkit.model import mhc
from glmkit.model.dsa import SparseMLA
from glmkit.model.kda import KimiDeltaAttention
from glmkit.model.mlp import MLP
from glmkit.model.moe import MoE
from glmkit.model.norms import RMSNorm
from glmkit.model.packed import Packed


@dataclass(frozen=True)
class Run:
    """What one forward needs besides the tokens, fixed for the whole forward: the kernel plan (the
    backend of every operator, chosen when the path was built: glmkit.model.plan), the layout (packed
    sequences, one decode step with cache lengths, or a prefill chunk continuing cache slots), the
    decode caches (`states`, filled in place by the layers that own them), routing and DSA selections
    to replay, whether each block is recomputed in the backward (activation checkpointing), and an
    optional `record(layer, site, tensor)` observer that parity captures use (sites in
    glmkit.model.sites). What passes from one layer to the next is a `Carry`."""

    kernels: KernelPlan
    packed: Packed | None = None
    lengths: torch.Tensor | None = None               # decode: cache lengths [B]; a chunk: offsets [N]
    slots: torch.Tensor | None = None                 # a chunk: the cache slot of each packed sequence
    states: list | None = None
    record: Callable | None = None
    routing: dict = field(default_factory=dict)
    recompute: bool = False
    topk_replay: dict = field(default_factory=dict)   # {DSA layer: ids [rows, W] as this run addresses keys}
    record_scores: bool = False                        # also emit indexer_scores / router_scores

    def __post_init__(self):
        if not isinstance(self.kernels, KernelPlan):
            raise TypeError(f"Run takes a KernelPlan (glmkit.model.plan.plan_kernels(model, backends)), got "
                            f"{type(self.kernels).__name__}")
        for op in ("kda", "dsa", "indexer", "moe"):  # each backend's module, looked up once per forward
            object.__setattr__(self, op, self.kernels[op].ops)
        object.__setattr__(self, "fuse", self.kernels.fuse_mode)

    def emit(self, layer: int, site: str, value):
        if self.record is not None:
            self.record(layer, site, value)


@dataclass(frozen=True)
class Carry:
    """What a forward hands from one DSA layer to the next: the keys the last DSA layer attended over
    (a shared-indexer layer attends over them again), and the last full indexer's own choice and
    scores (the sites a shared layer reports, so a replayed run still shows its own choice)."""

    topk: torch.Tensor | None = None
    own_topk: torch.Tensor | None = None
    own_scores: torch.Tensor | None = None


class DecoderBlock(nn.Module):
    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer
        self.kind = "kda" if config.layer_types[layer] == "linear_attention" else "dsa"
        self.is_moe = config.mlp_layer_types[layer] == "sparse"
        n, D = config.hc_mult, config.hidden_size
        self.hc_iters, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * D)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.input_layernorm = RMSNorm(D, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(D, config.rms_norm_eps)
        if self.kind == "kda":
            self.self_attn = KimiDeltaAttention(config)
        else:
            self.self_attn = SparseMLA(config, shared_indexer=config.indexer_types[layer] == "shared")
        self.mlp = MoE(config) if self.is_moe else MLP(D, config.intermediate_size, config.swiglu_limit)

    def _enter(self, site: str, streams, norm: RMSNorm):
        """mHC weights of `site`, the collapsed streams through the block's input norm."""
        return mhc.enter(streams, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                         getattr(self, f"hc_{site}_scale"), self.hc_iters, self.hc_eps, self.norm_eps,
                         norm.weight, norm.eps)

    def forward(self, streams: torch.Tensor, run: Run, carry: Carry = Carry()) -> tuple[torch.Tensor, Carry]:
        """streams [T, n, D] (packed tokens, or one token per request when decoding) -> (same shape, the
        carry for the next layer)."""
        with fusing(run.fuse):
            return self._forward(streams, run, carry)

    def _forward(self, streams: torch.Tensor, run: Run, carry: Carry) -> tuple[torch.Tensor, Carry]:
        L = self.layer
        x, pre, post, comb = self._enter("attn", streams, self.input_layernorm)
        run.emit(L, "attn_hc.pre", pre), run.emit(L, "attn_hc.post", post), run.emit(L, "attn_hc.comb", comb)
        run.emit(L, "attn_in", x)
        state = run.states[L] if run.states is not None else None
        if self.kind == "kda":
            if run.slots is not None:
                out = self.self_attn.forward_chunk(x, run.packed, run.slots, state, run.kda)
            elif run.packed is not None:
                out, new_state = self.self_attn.forward_packed(x, run.packed, run.kda, want_state=state is not None)
                if state is not None:
                    run.states[L] = new_state
            else:
                out = self.self_attn.forward_step(x, state, run.kda)
        else:
            scored = []  # a full indexer's scores, when asked for
            on_scores = scored.append if run.record_scores else None
            replay = run.topk_replay.get(L)
            if run.slots is not None:
                out, used, own = self.self_attn.forward_chunk(x, run.packed, run.slots, run.lengths, state, run.dsa,
                                                              carry.topk, replay, on_scores, run.indexer)
            elif run.packed is not None:
                out, used, own = self.self_attn.forward_packed(x, run.packed, run.dsa, carry.topk, state, replay,
                                                               on_scores, run.indexer)
            else:
                out, used, own = self.self_attn.forward_step(x, run.lengths, state, run.dsa, carry.topk, replay,
                                                             on_scores, run.indexer)
            # the site reports this path's own choice (a shared indexer's is the layer's before it),
            # so a replayed run still shows where its indexer would have differed
            carry = Carry(used, own if own is not None else carry.own_topk,
                          scored[-1] if scored else carry.own_scores)
            if run.record_scores:  # a shared indexer's scores are those of the layer it shares
                run.emit(L, "indexer_scores", carry.own_scores)
            run.emit(L, "indexer_topk", carry.own_topk)
        run.emit(L, "attn_out", out)
        streams = mhc.leave(out, streams, post, comb)
        run.emit(L, "streams_after_attn", streams)

        x, pre, post, comb = self._enter("ffn", streams, self.post_attention_layernorm)
        run.emit(L, "ffn_hc.pre", pre), run.emit(L, "ffn_hc.post", post), run.emit(L, "ffn_hc.comb", comb)
        run.emit(L, "mlp_in", x)
        if self.is_moe:
            out, routing = self.mlp(x, run.routing.get(L), run.moe)
            if run.record_scores:
                run.emit(L, "router_scores", routing.choice_scores)
            run.emit(L, "router_experts", routing.experts)
            run.emit(L, "router_weights", routing.weights)
        else:
            out = self.mlp(x)
        run.emit(L, "mlp_out", out)
        streams = mhc.leave(out, streams, post, comb)
        run.emit(L, "streams_after_ffn", streams)
        return streams, carry
