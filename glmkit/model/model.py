"""The GLM-5.3-Flash text model: embeddings copied into n mHC streams, the decoder blocks, the
plain mean over streams, a final RMSNorm and the LM head. Parameter names are the checkpoint's
without the `model.language_model.` prefix (lm_head keeps `lm_head.weight`)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from glmkit.model.block import Carry, DecoderBlock, Run
from glmkit.model.norms import RMSNorm


class Glm5Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            # lm_head is the embedding, as transformers ties them: one parameter, and state dicts hold
            # it once, under embed_tokens.weight (the checkpoint has no lm_head.weight)
            self.register_state_dict_post_hook(_drop_tied_head)
            self.register_load_state_dict_pre_hook(_fill_tied_head)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def to_empty(self, *, device, recurse: bool = True):
        # leaving the meta device makes new parameters: the tie is made again on them
        model = super().to_empty(device=device, recurse=recurse)
        model.tie_weights()
        return model

    def hidden(self, input_ids: torch.Tensor, run: Run) -> torch.Tensor:
        """input_ids [T] (packed, or one per request when decoding) -> final hidden [T, D]."""
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.config.hc_mult, x.shape[-1]).contiguous()
        carry = Carry()
        for block in self.layers:
            if run.recompute and torch.is_grad_enabled():
                recomputed = _Recomputed(block, run, carry)
                streams = checkpoint(recomputed, streams, use_reentrant=False)
                carry = recomputed.carry_out
            else:
                streams, carry = block(streams, run, carry)
        hidden = self.norm(streams.mean(-2))
        run.emit(None, "final_hidden", hidden)
        return hidden

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device


def _drop_tied_head(module, state_dict, prefix, local_metadata):
    state_dict.pop(prefix + "lm_head.weight", None)


def _fill_tied_head(module, state_dict, prefix, *args):
    if prefix + "embed_tokens.weight" in state_dict:
        state_dict.setdefault(prefix + "lm_head.weight", state_dict[prefix + "embed_tokens.weight"])


class _Recomputed:
    """One block under activation checkpointing: the forward keeps the carry it hands on; the
    backward runs the block a second time from the same carry, recording nothing."""

    def __init__(self, block: DecoderBlock, run: Run, carry: Carry):
        self.block, self.run, self.carry_in, self.carry_out = block, run, carry, None

    def __call__(self, streams):
        if self.carry_out is None:  # the forward
            streams, self.carry_out = self.block(streams, self.run, self.carry_in)
            return streams
        return self.block(streams, replace(self.run, record=None), self.carry_in)[0]
