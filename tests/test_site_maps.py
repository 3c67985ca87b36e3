"""Site maps for live Megatron and SGLang module trees (glmkit.parity.site_maps).

The stand-ins below rebuild the frameworks' module names and output signatures at toy size; each cites
where the real one is. MG = radixark/Megatron-LM@235952df6 (branch miles-main-20260819), MILES =
radixark/miles, SGL = sgl-project/sglang@0096f824 python/sglang/srt/models/glm5_next.py (not in a local
mirror: anchored by symbol).
"""

from __future__ import annotations

import os
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from glmkit.model import mhc
from glmkit.parity.capture import HookCapturer, Tap
from glmkit.parity.site_maps import TensorParallelShard, capture_live, packed_to_local, routing_map_ids

C, NS, E, K, VOCAB = 8, 2, 6, 2, 40   # hidden, residual streams (hc_mult), experts, top-k, vocab


def _rms(x, w):
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), 1e-6).to(x.dtype)


def _sp_gather(x, world):
    """megatron gather_from_sequence_parallel_region: concatenate the ranks' [s/world, ...] along s."""
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def _segments(s, b, cu):
    """(batch row, start, end) of each sequence: THD (b=1) by cu_seqlens, BSHD one per batch row."""
    if cu is None:
        return [(j, 0, s) for j in range(b)]
    cu = cu.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


# --- Megatron stand-ins ---------------------------------------------------------------------------------

class IdentityOp(nn.Module):
    # MG megatron/core/transformer/identity_op.py; what gpt_layer_specs.py:329 puts as pre_mlp_layernorm on
    # dense layers (the norm lives fused in mlp.linear_fc1)
    def forward(self, x, *args, **kwargs):
        return x


class TENorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.2 * torch.randn(C))

    def forward(self, x):
        return _rms(x, self.weight)


class HyperConnectionModule(nn.Module):
    # MG megatron/core/transformer/hyper_connection.py:216; self.n at :239
    def __init__(self):
        super().__init__()
        self.n = NS
        self.mapping_proj = nn.Linear(NS * C, NS * NS + 2 * NS, bias=False)

    def compute_mappings(self, x):
        # :371 -> (h_pre [s,b,n], h_post [s,b,n], h_res [s,b,n,n]) at :421 (Sinkhorn shortened to 3 rounds)
        s, b, _ = x.shape
        h = self.mapping_proj(x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
        h_pre, h_post = h[..., :NS].sigmoid() + 1e-6, 2 * h[..., NS:2 * NS].sigmoid()
        h_res = h[..., 2 * NS:].view(s, b, NS, NS).softmax(-1)
        for _ in range(3):
            h_res = h_res / h_res.sum(-2, keepdim=True)
            h_res = h_res / h_res.sum(-1, keepdim=True)
        return h_pre, h_post, h_res

    def forward(self, hidden_states, mhc_recompute_manager=None):
        # :551 -> (aggregated [s,b,C], h_res, h_post, residual [s,b,n*C]) at :615
        h_pre, h_post, h_res = self.compute_mappings(hidden_states)
        s, b, _ = hidden_states.shape
        aggregated = (hidden_states.view(s, b, NS, C) * h_pre.unsqueeze(-1)).sum(2)
        return aggregated, h_res, h_post, hidden_states

    def fused_h_res_h_post_bda(self, h_res, original_residual, h_post, layer_output_with_bias, *rest):
        # native_h_post_bda :132-144: bmm(h_res^T, residual) + h_post * x
        s, b, _ = original_residual.shape
        x, bias = layer_output_with_bias
        x = x if bias is None else x + bias
        mixed = torch.bmm(h_res.reshape(s * b, NS, NS).transpose(1, 2), original_residual.reshape(s * b, NS, C))
        return (h_post.unsqueeze(-1) * x.unsqueeze(2) + mixed.view(s, b, NS, C)).reshape(s, b, NS * C)


class Glm5NextKDA(nn.Module):
    # MILES@13f6c02a miles_plugins/models/glm5_next/kda.py Glm5NextKDA: [b, s, h] in, causal within each
    # sequence (here a running mean instead of the delta rule)
    def __init__(self):
        super().__init__()
        self.v_proj, self.o_proj = nn.Linear(C, C, bias=False), nn.Linear(C, C, bias=False)

    def forward(self, hidden_states, cu_seqlens=None):
        v, out = self.v_proj(hidden_states), torch.zeros_like(hidden_states)
        for row, a, e in _segments(v.shape[1], v.shape[0], cu_seqlens):
            seg = v[row, a:e]
            out[row, a:e] = seg.cumsum(0) / torch.arange(1, e - a + 1)[:, None]
        return self.o_proj(out)


class Glm5NextKDAAttention(nn.Module):
    # MILES@31f1ca96 miles_plugins/models/hf_attention.py:175-281 (HuggingfaceAttention.forward): all-gather
    # SP (:198), [s,b,h] -> [b,s,h] (:247), core at self_attention.kda, back (:252), scatter SP (:277)
    def __init__(self, sp_world=1):
        super().__init__()
        self.kda, self.sp_world = Glm5NextKDA(), sp_world

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        local = hidden_states.shape[0]
        if self.sp_world > 1:
            hidden_states = _sp_gather(hidden_states, self.sp_world)
        cu = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
        output = self.kda(hidden_states.permute(1, 0, 2), cu_seqlens=cu).permute(1, 0, 2)
        if self.sp_world > 1:
            import torch.distributed as dist

            output = output[dist.get_rank() * local:(dist.get_rank() + 1) * local]
        return output, None


class Glm5NextDSAAttention(nn.Module):
    # MILES@8f9a89a9 miles_plugins/models/glm5_next/dsa.py:37; indexer projections directly on it (wq_b)
    W = 8  # the real width is ceil((index_topk + kpool - 1) / 64) * 64, -1 padded

    def __init__(self):
        super().__init__()
        self.wq_b, self.linear_proj = nn.Linear(C, C, bias=False), nn.Linear(C, C, bias=False)

    def _kpool_select(self, index_q, index_k, head_weights, gate_score, packed_seq_params):
        # dsa.py:156 -> int32 [T, 1, W] absolute packed token indices, -1 padded (here: the sequence's first
        # token and the last three, in descending order)
        cu = packed_seq_params.cu_seqlens_kv.tolist()
        out = torch.full((index_q.shape[0], 1, self.W), -1, dtype=torch.int32)
        for a, e in zip(cu[:-1], cu[1:]):
            for t in range(a, e):
                chosen = sorted({a, *range(max(a, t - 2), t + 1)}, reverse=True)
                out[t, 0, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        return out

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None, **kwargs):
        # dsa.py:178-219: [s, 1, h] (b = 1, squeezed), top-k from _kpool_select (:208), (output, bias)
        q = self.wq_b(hidden_states.squeeze(1))
        idx = self._kpool_select(q, q, None, None, packed_seq_params)[:, 0].long()
        valid = (idx >= 0).unsqueeze(-1)
        ctx = (q[idx.clamp_min(0)] * valid).sum(1) / valid.sum(1)
        return self.linear_proj(ctx).unsqueeze(1), None


class TopKRouter(nn.Module):
    # MG megatron/core/transformer/moe/router.py:159 (topk :195, score_function, expert_bias)
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, C))
        self.topk, self.score_function = K, "sigmoid"
        self.register_buffer("expert_bias", 0.3 * torch.randn(E))

    def gating(self, input):  # :103 -> logits [s, b, E]
        return F.linear(input.float(), self.weight)

    def routing(self, logits):
        # :786; flattened sequence-major at :809; sigmoid + expert_bias choice, renormalised probs scattered
        # into a dense [tokens, E] and a bool routing_map (moe_utils.py:830, :861)
        logits = logits.view(-1, E)
        scores = logits.float().sigmoid()
        top = torch.topk(scores + self.expert_bias, K, dim=1).indices
        probs = scores.gather(1, top)
        probs = probs / probs.sum(-1, keepdim=True)
        return torch.zeros_like(logits).scatter(1, top, probs), torch.zeros_like(logits).int().scatter(1, top, 1).bool()

    def forward(self, input, padding_mask=None, input_ids=None, packed_seq_params=None):
        return self.routing(self.gating(input))  # (probs, routing_map) at :952


class MoELayer(nn.Module):
    # MG megatron/core/transformer/moe/moe_layer.py; router called at :463; returns (output, mlp_bias)
    def __init__(self):
        super().__init__()
        self.router = TopKRouter()
        self.experts = nn.ModuleList(nn.Linear(C, C, bias=False) for _ in range(E))

    def forward(self, hidden_states, padding_mask=None, **kwargs):
        s, b, _ = hidden_states.shape
        probs, _ = self.router(hidden_states)
        flat = hidden_states.reshape(s * b, C)
        out = sum(probs[:, e:e + 1] * expert(flat) for e, expert in enumerate(self.experts))
        return out.view(s, b, C), None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear_fc1, self.linear_fc2 = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.norm_weight = nn.Parameter(torch.ones(C))  # stands for linear_fc1.layer_norm_weight

    def forward(self, hidden_states, padding_mask=None, **kwargs):
        return self.linear_fc2(F.silu(self.linear_fc1(_rms(hidden_states, self.norm_weight)))), None


class HyperConnectionTransformerLayer(nn.Module):
    # MG megatron/core/transformer/transformer_layer.py:1905; layer_number global, 1-based (:356-360);
    # forward -> (output, context) (:2073-2092): hyper connection (:2220), input_layernorm (:2241),
    # self_attention (:2245), bda (:2266); mlp_hyper_connection (:2318), pre_mlp_layernorm (:2345), mlp (:2390)
    def __init__(self, layer_number, attention, moe, sp_world=1):
        super().__init__()
        self.layer_number = layer_number
        self.self_attention_hyper_connection = HyperConnectionModule()
        self.input_layernorm = TENorm()
        self.self_attention = Glm5NextDSAAttention() if attention == "dsa" else Glm5NextKDAAttention(sp_world)
        self.mlp_hyper_connection = HyperConnectionModule()
        self.pre_mlp_layernorm = TENorm() if moe else IdentityOp()
        self.mlp = MoELayer() if moe else MLP()

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None):
        x, h_res, h_post, residual = self.self_attention_hyper_connection(hidden_states)
        out = self.self_attention(self.input_layernorm(x), attention_mask, packed_seq_params=packed_seq_params)
        hidden_states = self.self_attention_hyper_connection.fused_h_res_h_post_bda(h_res, residual, h_post, out)
        x, h_res, h_post, residual = self.mlp_hyper_connection(hidden_states)
        out = self.mlp(self.pre_mlp_layernorm(x))
        return self.mlp_hyper_connection.fused_h_res_h_post_bda(h_res, residual, h_post, out), None


class TransformerBlock(nn.Module):
    # MG megatron/core/transformer/transformer_block.py: layers, input_expand (hyper_connection.py:670),
    # output contraction (miles patches it to the stream mean), final_layernorm (:395, :536; None off the
    # last pipeline stage, :412)
    def __init__(self, specs, first_layer=0, sp_world=1, final=True):
        super().__init__()
        self.layers = nn.ModuleList(HyperConnectionTransformerLayer(first_layer + i + 1, a, m == "moe", sp_world)
                                    for i, (a, m) in enumerate(specs))
        self.final_layernorm = TENorm() if final else None

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None):
        s, b, _ = hidden_states.shape
        x = hidden_states.unsqueeze(2).expand(s, b, NS, C).reshape(s, b, NS * C)
        for layer in self.layers:
            x, _ = layer(x, attention_mask=attention_mask, packed_seq_params=packed_seq_params)
        if self.final_layernorm is None:
            return x
        return self.final_layernorm(x.view(s, b, NS, C).mean(2))


class GPTModel(nn.Module):
    def __init__(self, specs, first_layer=0, sp_world=1, sp_rank=0, final=True):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, C)
        self.decoder = TransformerBlock(specs, first_layer, sp_world, final)
        self.sp = (sp_rank, sp_world)

    def forward(self, input_ids, position_ids=None, attention_mask=None, packed_seq_params=None):
        x = self.embedding(input_ids).transpose(0, 1)  # [b, s] tokens -> sequence-first [s, b, h]
        rank, world = self.sp
        if world > 1:  # scatter_to_sequence_parallel_region
            x = x.chunk(world)[rank]
        return self.decoder(x, attention_mask, packed_seq_params)


class Wrap(nn.Module):  # DDP(Float16Module(model)): names become module.module.decoder.layers.N...
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


SPECS = [("dsa", "moe"), ("kda", "dense"), ("kda", "moe")]


def megatron(specs=SPECS, seed=0, **kwargs):
    torch.manual_seed(seed)
    return Wrap(Wrap(GPTModel(specs, **kwargs))).eval()


def sequences():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 7)]


def thd(seqs, pad_to=16):
    """miles' get_batch for THD: sequences end to end, the stream padded to a multiple with a trailing
    pseudo-sequence in cu_seqlens (training_utils/data.py get_batch)."""
    ids = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    pad = (-len(ids)) % pad_to
    tokens = F.pad(ids, (0, pad))[None]
    fw_cu = torch.cat([cu, cu[-1:] + pad]) if pad else cu
    return ids, cu, tokens, fw_cu, SimpleNamespace(cu_seqlens_q=fw_cu, cu_seqlens_kv=fw_cu, qkv_format="thd")


def capture_megatron(model, seqs, **options):
    ids, cu, tokens, fw_cu, psp = thd(seqs)
    with torch.no_grad(), capture_live(model, "megatron", ids, cu, packed_cu_seqlens=fw_cu, **options) as live:
        model(tokens, None, None, packed_seq_params=psp)
    return live.to_capture()


PER_LAYER = {"attn_hc.pre", "attn_hc.post", "attn_hc.comb", "attn_in", "attn_out", "streams_after_attn",
             "ffn_hc.pre", "ffn_hc.post", "ffn_hc.comb", "mlp_out", "streams_after_ffn"}
MOE = {"mlp_in", "router_scores", "router_experts", "router_weights"}


def test_megatron_names_give_every_site_in_token_rows():
    model, seqs = megatron(), sequences()
    cap = capture_megatron(model, seqs, indexer_width=5)
    T = sum(map(len, seqs))
    assert set(cap.tensors) == ({(i, s) for i in range(3) for s in PER_LAYER} | {(i, s) for i in (0, 2) for s in MOE}
                                | {(0, "indexer_topk"), (None, "final_hidden")})
    assert all(t.shape[0] == T for t in cap.tensors.values())
    assert cap.tensors[(1, "streams_after_ffn")].shape == (T, NS, C)
    assert cap.tensors[(0, "attn_hc.comb")].shape == (T, NS, NS)
    # the dense layer's pre_mlp_layernorm is IdentityOp: listed, not captured as the un-normed input
    assert "mlp_in (layer 1)" in cap.manifest["not_captured"] and "indexer_scores" in cap.manifest["not_captured"]
    # every row is its own token's: the batch (two sequences, padded) equals each sequence alone
    alone = [capture_megatron(model, [s], indexer_width=5) for s in seqs]
    for key, rows in cap.tensors.items():
        torch.testing.assert_close(rows, torch.cat([a.tensors[key] for a in alone]), msg=str(key))


def test_megatron_comb_is_glmkit_orientation():
    model = megatron()
    t = capture_megatron(model, sequences(), indexer_width=5).tensors
    for layer in (1, 2):
        before = t[(layer - 1, "streams_after_ffn")]
        expanded = mhc.expand(t[(layer, "attn_out")], before, t[(layer, "attn_hc.post")], t[(layer, "attn_hc.comb")])
        torch.testing.assert_close(expanded, t[(layer, "streams_after_attn")])
        aggregated = mhc.collapse(before, t[(layer, "attn_hc.pre")])
        norm = model.module.module.decoder.layers[layer].input_layernorm
        torch.testing.assert_close(_rms(aggregated, norm.weight), t[(layer, "attn_in")])


def test_megatron_router_ids_and_weights_from_routing_map():
    model, seqs = megatron(), sequences()
    cap = capture_megatron(model, seqs, indexer_width=5)
    router = model.module.module.decoder.layers[2].mlp.router
    scores = F.linear(cap.tensors[(2, "mlp_in")].float(), router.weight).sigmoid()
    ids = torch.topk(scores + router.expert_bias, K).indices.sort(-1).values
    assert torch.equal(cap.tensors[(2, "router_experts")], ids)
    expected = scores.gather(1, ids)
    torch.testing.assert_close(cap.tensors[(2, "router_weights")], expected / expected.sum(-1, keepdim=True))
    torch.testing.assert_close(cap.tensors[(2, "router_scores")], scores + router.expert_bias)
    # a dropped token (fewer than k experts) keeps its row, -1 filled
    assert routing_map_ids(torch.tensor([[False, True, False, True], [False, False, True, False]]), 2).tolist() == \
        [[1, 3], [2, -1]]


def test_kpool_select_is_wrapped_converted_and_restored():
    model, seqs = megatron(), sequences()
    attention = model.module.module.decoder.layers[0].self_attention
    cap = capture_megatron(model, seqs, indexer_width=5)
    rows = []
    for s in seqs:  # sequence-local: first token and the last three up to t, ascending, -1 first
        for t in range(len(s)):
            chosen = sorted({0, *range(max(0, t - 2), t + 1)})
            rows.append([-1] * (5 - len(chosen)) + chosen)
    assert cap.tensors[(0, "indexer_topk")].tolist() == rows
    assert "_kpool_select" not in attention.__dict__
    assert attention._kpool_select.__func__ is Glm5NextDSAAttention._kpool_select
    # restored after a forward that fails too
    ids, cu, tokens, fw_cu, psp = thd(seqs)
    with pytest.raises(RuntimeError, match="boom"):
        with capture_live(model, "megatron", ids, cu, packed_cu_seqlens=fw_cu) as live:
            assert "_kpool_select" in attention.__dict__
            raise RuntimeError("boom")
    assert "_kpool_select" not in attention.__dict__ and not live.hooks
    with pytest.raises(ValueError, match="more than indexer_width=2"):
        capture_megatron(model, seqs, indexer_width=2)
    with pytest.raises(ValueError, match="outside its sequence"):
        packed_to_local(torch.tensor([[0], [0], [1]]), torch.tensor([0, 1, 3]))


def layers(cap):
    return sorted({layer for layer, _ in cap.tensors}, key=str)


def test_pipeline_stage_layer_offset():
    seqs = sequences()
    stage = megatron(SPECS[1:], first_layer=1)  # global layers 1, 2 held as decoder.layers.0, .1
    assert layers(capture_megatron(stage, seqs)) == [1, 2, None]
    assert layers(capture_megatron(stage, seqs, layer_offset=1)) == [1, 2, None]
    with pytest.raises(ValueError, match=r"layer_offset 3 \+ local index 0 = 3, but the module's layer_number says "
                                         r"layer 1"):
        capture_megatron(stage, seqs, layer_offset=3)
    for layer in stage.module.module.decoder.layers:  # no layer_number: the offset alone places them
        del layer.layer_number
    assert layers(capture_megatron(stage, seqs, layer_offset=7)) == [7, 8, None]


def test_virtual_pipeline_chunks_keep_their_own_layer_numbers():
    # both chunks name their first layer module.module.decoder.layers.0; layer_number tells them apart
    # (each toy chunk embeds the tokens itself, where a real later chunk takes the previous one's output)
    seqs = sequences()
    chunks = [megatron(SPECS[:1], final=False), megatron(SPECS[2:], first_layer=2, seed=1)]
    ids, cu, tokens, fw_cu, psp = thd(seqs)
    with torch.no_grad(), capture_live(chunks, "megatron", ids, cu, packed_cu_seqlens=fw_cu, indexer_width=5) as live:
        for chunk in chunks:
            chunk(tokens, None, None, packed_seq_params=psp)
    assert layers(live.to_capture()) == [0, 2, None]


def test_bshd_batch_rows_follow_input_order():
    specs = [("kda", "moe"), ("kda", "dense")]  # Megatron's DSA is THD only
    model, seqs = megatron(specs), sequences()
    ids = torch.cat(seqs)
    cu = torch.tensor([0, 5, 12])
    tokens = torch.stack([F.pad(s, (0, 9 - len(s))) for s in seqs])  # [b=2, s=9]: one sequence per row
    with torch.no_grad(), capture_live(model, "megatron", ids, cu, layout="bshd", padded_len=9) as live:
        model(tokens)
    batched = live.to_capture()
    alone = [capture_megatron(model, [s]) for s in seqs]
    assert batched.tensors.keys() == alone[0].tensors.keys()
    for key, rows in batched.tensors.items():
        torch.testing.assert_close(rows, torch.cat([a.tensors[key] for a in alone]), msg=str(key))


def test_tp_shard_is_refused_with_its_shapes():
    model, seqs = megatron(sp_world=2, sp_rank=0), sequences()
    with pytest.raises(TensorParallelShard) as err:
        capture_megatron(model, seqs)
    msg = str(err.value)
    assert "module.module.decoder.layers.0.self_attention_hyper_connection" in msg
    assert "shard of shape [8, 1, 2]; the full tensor is [16, 1, 2]" in msg and "gather_tp=True" in msg
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        capture_megatron(model, seqs, gather_tp=True)


def _capture_on_rank(rank, world, port, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = megatron([("kda", "moe"), ("kda", "dense")], sp_world=world, sp_rank=rank)
        cap = capture_megatron(model, sequences(), gather_tp=True, tp_group=dist.group.WORLD)
        if rank == 0:
            torch.save(cap.tensors, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # past a clean destroy, the interpreter's own teardown in a spawned child under pytest aborts now and
    # then ("terminate called without an active exception"): leave without it
    os._exit(0)


def test_sequence_parallel_shards_gathered_over_the_tp_group(tmp_path):
    from glmkit.launch.cluster import free_port

    out = tmp_path / "rank0.pt"
    mp.start_processes(_capture_on_rank, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    gathered = torch.load(out)
    whole = capture_megatron(megatron([("kda", "moe"), ("kda", "dense")]), sequences()).tensors
    assert gathered.keys() == whole.keys()
    for key in whole:
        torch.testing.assert_close(gathered[key], whole[key], msg=str(key))


# --- SGLang stand-ins -----------------------------------------------------------------------------------

StandardTopKOutput = namedtuple("StandardTopKOutput", "topk_weights topk_ids router_logits")  # layers/moe/topk.py


class RMSNorm(nn.Module):  # sglang/srt/layers/layernorm.py
    def __init__(self):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(1 + 0.2 * torch.randn(C)), 1e-6

    def forward(self, x, residual=None):
        return _rms(x, self.weight)


class RowParallelLinear(nn.Linear):  # sglang/srt/layers/linear.py: returns (output, bias)
    def __init__(self, i, o, reduce_results=True):
        super().__init__(i, o, bias=False)
        self.reduce_results, self.tp_size = reduce_results, 1

    def forward(self, x):
        return super().forward(x), None


class Glm5NextLinearAttention(nn.Module):
    # SGL Glm5NextLinearAttention: o_proj RowParallel with reduce_results=False; forward(hidden_states,
    # forward_batch) -> o_proj(...)[0] (a partial sum over attn-TP ranks when tp_size > 1)
    def __init__(self):
        super().__init__()
        self.qkv_proj, self.o_proj = nn.Linear(C, C, bias=False), RowParallelLinear(C, C, reduce_results=False)

    def forward(self, positions, hidden_states, forward_batch, **kwargs):
        v = self.qkv_proj(hidden_states)
        return self.o_proj(v.cumsum(0) / (positions[:, None] + 1))[0]  # one request per forward, causal


class MoEGate(nn.Module):  # SGL deepseek_v2 MoEGate: fp32 weight [E, C], e_score_correction_bias; -> logits
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, C))
        self.e_score_correction_bias = nn.Parameter(0.3 * torch.randn(E))

    def forward(self, hidden_states, gemm_output_zero_allocator=None, forward_batch=None):
        return F.linear(hidden_states.float(), self.weight)


class TopK(nn.Module):
    # SGL layers/moe/topk.py TopK: ids [T, k + fused shared] with the fused shared expert as id n_routed;
    # routed_scaling_factor folded into the weights when apply_routed_scaling_factor_on_output
    def __init__(self, bias, scaling=2.5):
        super().__init__()
        self.bias = bias
        self.topk_config = SimpleNamespace(top_k=K + 1, num_fused_shared_experts=1, routed_scaling_factor=scaling,
                                           apply_routed_scaling_factor_on_output=True)

    def forward(self, hidden_states, router_logits, input_ids=None):
        scores = router_logits.sigmoid()
        ids = torch.topk(scores + self.bias, K).indices
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) * self.topk_config.routed_scaling_factor
        shared = torch.full((len(ids), 1), E)
        return StandardTopKOutput(torch.cat([w, torch.ones(len(ids), 1)], 1), torch.cat([ids, shared], 1).int(),
                                  router_logits)


class Glm5NextMoE(nn.Module):  # SGL: Glm5NextMoE = DeepseekV2MoE (gate, topk, experts, shared_experts)
    def __init__(self):
        super().__init__()
        self.tp_size = 1
        self.gate = MoEGate()
        self.topk = TopK(self.gate.e_score_correction_bias)
        self.experts = nn.ModuleList(nn.Linear(C, C, bias=False) for _ in range(E + 1))

    def forward(self, hidden_states, forward_batch=None, gemm_output_zero_allocator=None):
        out = self.topk(hidden_states, self.gate(hidden_states))
        return sum(out.topk_weights[:, j:j + 1] * torch.stack([self.experts[int(e)](h) for e, h in
                                                               zip(out.topk_ids[:, j], hidden_states)])
                   for j in range(out.topk_ids.shape[1]))


class Glm5NextDecoderLayer(nn.Module):
    # SGL Glm5NextDecoderLayer: layer_id; hc_{attn,ffn}_{fn,base,scale} on the layer; MHCState receives the
    # bound methods hc_attn_pre / hc_ffn_pre / hc_post at construction; _hc_pre returns (layer_input,
    # comb [T, n*n], post [T, n], norm_fused) (kernels/ops/layernorm/mhc.py hc_pre); hc_post is
    # _mhc_post_torch: out_j = post_j * x + sum_i comb[i, j] residual_i; forward -> (hidden_states, topk)
    def __init__(self, layer_id, fuse_norm):
        super().__init__()
        self.layer_id, self.fuse_norm = layer_id, fuse_norm
        self.self_attn, self.mlp = Glm5NextLinearAttention(), Glm5NextMoE()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.randn((2 + NS) * NS, NS * C) * 0.3))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.randn((2 + NS) * NS) * 0.3))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.mhc_state = (self.hc_attn_pre, self.hc_ffn_pre, self.hc_post)  # bound now, as MHCState holds them

    def _hc_pre(self, hc_fn, hc_scale, hc_base, hidden_states, out_norm_weight, out_norm_eps):
        s = hidden_states.shape[0]
        pre, post, comb = mhc.mix_weights(hidden_states.view(s, NS, C), hc_fn, hc_base, hc_scale, 3, 1e-6, 1e-6)
        layer_input = mhc.collapse(hidden_states.view(s, NS, C), pre)
        if self.fuse_norm:
            layer_input = _rms(layer_input, out_norm_weight)
        return layer_input, comb.reshape(s, NS * NS), post.reshape(s, NS), self.fuse_norm

    def hc_attn_pre(self, hidden_states, out_norm_weight, out_norm_eps):
        return self._hc_pre(self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, hidden_states, out_norm_weight,
                            out_norm_eps)

    def hc_ffn_pre(self, hidden_states, out_norm_weight, out_norm_eps):
        return self._hc_pre(self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, hidden_states, out_norm_weight,
                            out_norm_eps)

    def hc_post(self, hidden_states, residual, h_res, h_post):
        s = hidden_states.shape[0]
        comb, res = h_res.view(s, NS, NS), residual.view(s, NS, C)
        out = h_post.view(s, NS, 1) * hidden_states.unsqueeze(1) + (comb.unsqueeze(-1) * res.unsqueeze(2)).sum(1)
        return out.view(s, -1)

    def forward(self, positions, hidden_states, forward_batch, zero_allocator=None, gemm_output_zero_allocator=None,
                prev_topk_indices=None, capture_output=None):
        attn_pre, ffn_pre, post = self.mhc_state
        for pre_fn, norm, block in ((attn_pre, self.input_layernorm, "attn"), (ffn_pre, self.post_attention_layernorm,
                                                                                "mlp")):
            x, comb, h_post, fused = pre_fn(hidden_states, norm.weight, norm.variance_epsilon)
            x = x if fused else norm(x)
            out = (self.self_attn(positions=positions, hidden_states=x, forward_batch=forward_batch) if block == "attn"
                   else self.mlp(x, forward_batch, None))
            hidden_states = post(out, hidden_states, comb, h_post)
        return hidden_states, None


class Glm5NextModel(nn.Module):  # SGL Glm5NextModel: embed_tokens, layers (make_pp_layers), norm
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, C)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(i, fuse_norm=i == 1) for i in range(2))
        self.norm = RMSNorm()

    def forward(self, input_ids, positions, forward_batch):
        h = self.embed_tokens(input_ids).repeat(1, NS)  # hc_expand
        for layer in self.layers:
            h, _ = layer(positions, h, forward_batch)
        return self.norm(h.unflatten(-1, (NS, -1)).mean(-2))  # hc_contract, final norm


class Glm5NextForConditionalGeneration(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.model = Glm5NextModel()

    def forward(self, input_ids, positions, forward_batch):
        return self.model(input_ids, positions, forward_batch)


def capture_sglang(model, seqs, **options):
    ids = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
    with torch.no_grad(), capture_live(model, "sglang", ids, cu, **options) as live:
        for s in seqs:  # one request per forward, in capture order
            model(s, torch.arange(len(s)), SimpleNamespace())
    return live.to_capture()


def test_sglang_layers_give_their_sites():
    model, seqs = Glm5NextForConditionalGeneration(), sequences()
    cap = capture_sglang(model, seqs)
    T, t = sum(map(len, seqs)), cap.tensors
    sites = {"attn_hc.post", "attn_hc.comb", "attn_in", "attn_out", "streams_after_attn", "ffn_hc.post",
             "ffn_hc.comb", "mlp_in", "mlp_out", "router_scores", "router_experts", "router_weights"}
    assert set(t) == ({(i, s) for i in range(2) for s in sites} | {(0, "streams_after_ffn"), (None, "final_hidden")})
    assert all(v.shape[0] == T for v in t.values())
    assert {"attn_hc.pre", "indexer_topk"} <= set(cap.manifest["not_captured"])
    # comb orientation: SGLang's hc_post is glmkit's expand as it is
    torch.testing.assert_close(mhc.expand(t[(1, "attn_out")], t[(0, "streams_after_ffn")], t[(1, "attn_hc.post")],
                                          t[(1, "attn_hc.comb")]), t[(1, "streams_after_attn")])
    # router: the fused shared expert (id E) dropped, weights as produced (scaling folded in)
    gate = model.model.layers[1].mlp.gate
    scores = F.linear(t[(1, "mlp_in")].float(), gate.weight).sigmoid()
    ids = torch.topk(scores + gate.e_score_correction_bias, K).indices.sort(-1).values
    assert torch.equal(t[(1, "router_experts")], ids)
    w = scores.gather(1, ids)
    torch.testing.assert_close(t[(1, "router_weights")], w / w.sum(-1, keepdim=True) * 2.5)
    # layer 1 fuses its norm into _hc_pre (input_layernorm never runs): attn_in comes from _hc_pre
    layer = model.model.layers[1]
    torch.testing.assert_close(t[(1, "attn_in")], _rms(mhc.collapse(t[(0, "streams_after_ffn")], mhc.mix_weights(
        t[(0, "streams_after_ffn")], layer.hc_attn_fn, layer.hc_attn_base, layer.hc_attn_scale, 3, 1e-6, 1e-6)[0]),
        layer.input_layernorm.weight))
    assert all("_hc_pre" not in layer.__dict__ for layer in model.model.layers)


def test_sglang_partial_attention_output_is_refused():
    model, seqs = Glm5NextForConditionalGeneration(), sequences()
    model.model.layers[0].self_attn.o_proj.tp_size = 2
    with pytest.raises(TensorParallelShard, match="model.layers.0.self_attn' gave attn_out as a partial sum over 2"):
        capture_sglang(model, seqs)


def test_hook_capturer_taps_and_row_check():
    model = nn.Sequential(nn.Linear(C, C), nn.ReLU())
    seen = []
    taps = {r"^0$": [Tap(lambda cap, layer, name, module, args, kwargs, out: cap.put(None, "mlp_out", out)),
                     Tap(lambda cap, layer, name, module, args, kwargs, out: seen.append(args[0].shape), on="pre")]}
    with HookCapturer(model, taps) as hooks:
        model(torch.randn(3, C))
    assert seen == [torch.Size([3, C])] and hooks.to_capture(torch.arange(3), torch.tensor([0, 3])).tensors[
        (None, "mlp_out")].shape == (3, C)
    with pytest.raises(ValueError, match="3 rows captured for 4 input tokens"):
        hooks.to_capture(torch.arange(4), torch.tensor([0, 4]))



def test_cu_seqlens_that_cannot_cut_the_tokens_are_refused_by_name():
    model, seqs = megatron(), sequences()  # 5 + 7 tokens
    ids, cu, _, fw_cu, _ = thd(seqs)
    for bad in ([0, 7, 5, 12], [0, 5, 10]):
        with pytest.raises(ValueError, match=rf"^cu_seqlens \[{', '.join(map(str, bad))}\]: must start at 0, "
                                             r"increase strictly and end at the 12 tokens$"):
            with capture_live(model, "megatron", ids, torch.tensor(bad), packed_cu_seqlens=fw_cu):
                pass
    with pytest.raises(ValueError, match=r"^packed_cu_seqlens \[0, 5, 3, 16\]: must start at 0"):
        with capture_live(model, "megatron", ids, cu, packed_cu_seqlens=torch.tensor([0, 5, 3, 16])):
            pass
    with pytest.raises(ValueError, match=r"^cu_seqlens for 3 index rows: expected 1-D integers"):
        packed_to_local(torch.zeros(3, 2, dtype=torch.long), torch.tensor([[0, 3]]))
