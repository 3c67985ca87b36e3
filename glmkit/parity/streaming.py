"""Streaming parity for checkpoints that do not fit in memory: layer by layer from the safetensors
files, holding one layer's weights at a time (once as the transformers reference layer, once as
glmkit's block). Every layer of both implementations is fed the reference's input streams for that
layer (teacher forcing), so a result says how each layer behaves given the same input — not how
errors accumulate end to end; reports mark it "streaming".
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from glmkit.checkpoint import open_checkpoint
from glmkit.checkpoint.names import EMBED, FINAL_NORM, LM_HEAD
from glmkit.kernels.backends import Backends
from glmkit.model.packed import pack
from glmkit.model.plan import config_target
from glmkit.model.train import next_token_targets, token_logprobs
from glmkit.parity.capture import _Collector, _local, _manifest, hook_reference_layer
from glmkit.parity.dump import Capture


def reference_layer_state(tensors: dict, num_experts: int) -> dict:
    """On-disk names of one layer -> the names transformers uses in memory (its conversion mapping):
    forget-gate tensors under `forget_gate.`, hc tensors as `attn_hc.fn` ..., the three short convs
    concatenated, experts stacked as gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    out = {}
    for name, t in tensors.items():
        for part in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            if name.startswith(f"self_attn.{part}"):
                name = name.replace(f"self_attn.{part}", f"self_attn.forget_gate.{part}")
        for site in ("attn", "ffn"):
            for field in ("fn", "base", "scale"):
                if name == f"hc_{site}_{field}":
                    name = f"{site}_hc.{field}"
        if "_conv1d." in name or ".mlp.experts." in f".{name}":
            continue
        out[name] = t
    if "self_attn.q_conv1d.weight" in tensors:
        out["self_attn.conv1d.weight"] = torch.cat([tensors[f"self_attn.{c}_conv1d.weight"] for c in "qkv"])
    if "mlp.experts.0.gate_proj.weight" in tensors:
        out["mlp.experts.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"mlp.experts.{e}.gate_proj.weight"], tensors[f"mlp.experts.{e}.up_proj.weight"]])
            for e in range(num_experts)])
        out["mlp.experts.down_proj"] = torch.stack([tensors[f"mlp.experts.{e}.down_proj.weight"]
                                                    for e in range(num_experts)])
    return out


def _reference_layer(config, i, tensors, dtype, device):
    from glmkit.reference import _block_fla_on_cpu

    _block_fla_on_cpu()
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextDecoderLayer

    with torch.device("meta"):
        layer = Glm5NextTextDecoderLayer(config, i)
    layer = layer.to_empty(device=device)
    layer.load_state_dict(reference_layer_state(tensors, config.n_routed_experts), strict=True)
    return layer.to(dtype).eval()


def _glmkit_block(config, i, tensors, dtype, device):
    from glmkit.model import cast_model
    from glmkit.model.block import DecoderBlock

    with torch.device("meta"):
        block = DecoderBlock(config, i)
    block = block.to_empty(device=device)
    block.load_state_dict(tensors, strict=True)
    return cast_model(block, dtype).eval()


@torch.no_grad()
def stream_parity(checkpoint, sequences, dtype=torch.float32, device="cpu", backends=None,
                  progress: bool = True) -> tuple[Capture, Capture]:
    """-> (reference capture, train capture), both marked mode "streaming"."""
    from glmkit.model.block import Carry, Run

    ckpt = open_checkpoint(checkpoint)
    config = ckpt.config
    config._attn_implementation = "sdpa"
    input_ids, packed = pack(sequences, device=device)
    meta = dict(checkpoint=str(checkpoint), mode="streaming")
    caps = {}
    for path in ("reference", "train"):
        caps[path] = Capture(input_ids.cpu(), packed.cu_seqlens.cpu(),
                             manifest=_manifest(path, config, dtype, device, **meta))
    ref_sink, ours_sink = (_Collector(caps[p], packed.num_tokens) for p in ("reference", "train"))
    embed = ckpt.get(EMBED, dtype=dtype, device=device)
    streams = embed[input_ids].unsqueeze(-2).expand(-1, config.hc_mult, -1).contiguous()
    del embed
    kernels = Backends.parse(backends).plan(config_target(config, device, dtype))  # chosen once, for every layer
    ref_topk, carry = [None] * packed.num_sequences, Carry()  # what each side hands its next layer
    for i in tqdm(range(config.num_hidden_layers), desc="streaming parity", unit="layer", disable=not progress):
        tensors = ckpt.layer(i, device=device)
        ref_layer = _reference_layer(config, i, tensors, dtype, device)
        block = _glmkit_block(config, i, tensors, dtype, device)
        del tensors
        # reference, one unpadded sequence at a time, its sites through hooks
        rows_now = {}
        hooks = hook_reference_layer(ref_layer, i, lambda layer, site, v: ref_sink.put(
            layer, site, v.flatten(0, 1), rows_now["rows"]), {})
        outs = []
        try:
            for n, (s, e) in enumerate(packed.bounds()):
                rows_now["rows"] = torch.arange(s, e)
                mask = torch.ones(1, e - s, dtype=torch.bool, device=device)
                out, topk = ref_layer(streams[s:e][None], attention_mask=mask, prev_topk_indices=ref_topk[n])
                if topk is not None:
                    ref_topk[n] = topk
                outs.append(out[0])
        finally:
            for h in hooks:
                h.remove()
        # glmkit's block on the same input streams
        run = Run(kernels, packed=packed, record_scores=True,
                  record=lambda layer, site, v: ours_sink.put(layer, site, _local(v, packed) if site == "indexer_topk" else v))
        _, carry = block(streams, run, carry)
        streams = torch.cat(outs)  # teacher forcing: the reference's output feeds the next layer
        del ref_layer, block
    norm_w = ckpt.get(FINAL_NORM, dtype=dtype, device=device)
    head = ckpt.get(LM_HEAD, dtype=dtype, device=device)
    mean = streams.mean(-2)
    hidden = norm_w * (mean.float() * torch.rsqrt(mean.float().pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)).to(dtype)
    targets = next_token_targets(input_ids, packed)
    logprobs = token_logprobs((hidden @ head.t()).float(), targets).cpu()
    for sink in (ref_sink, ours_sink):  # the head is shared: both see the reference's final streams
        sink.put(None, "final_hidden", hidden)
        sink.put(None, "logprobs", logprobs)
    return caps["reference"], caps["train"]
