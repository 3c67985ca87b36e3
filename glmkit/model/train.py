"""Train path: full-sequence forward over packed variable-length sequences, per-token log-probs.

KDA runs chunked, DSA un-absorbed over gathered keys, MoE grouped per expert; autograd end to end
(the indexer's selection is discrete and runs without gradient, as in the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmkit.kernels.kda import get_backend
from glmkit.model.block import Run
from glmkit.model.model import Glm5Model
from glmkit.model.packed import Packed, pack

# Rows of the LM head computed at once: bounds the [rows, vocab] fp32 logits held for log-probs.
_LOGIT_ROWS = 4096


@dataclass
class TrainOutput:
    """logprobs [T] of `targets` [T] (0 where target is -100); logits [T, V] when requested;
    routing {layer: experts [T, k]} the MoE layers chose; entropy [T] of softmax(logits / T) when
    requested."""

    logprobs: torch.Tensor
    targets: torch.Tensor
    packed: Packed
    logits: torch.Tensor | None
    routing: dict
    entropy: torch.Tensor | None = None


def next_token_targets(input_ids: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Target of token t = token t+1 of the same sequence; -100 on each sequence's last token."""
    targets = torch.full_like(input_ids, -100)
    targets[:-1] = input_ids[1:]
    targets[packed.last_indices()] = -100
    return targets


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] in fp32; 0 where target is -100."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return picked.masked_fill(targets < 0, 0.0)


class TrainPath:
    def __init__(self, model: Glm5Model, kda_backend: str = "torch"):
        self.model = model
        self.kda = get_backend(kda_backend)

    def forward(self, sequences=None, *, input_ids=None, packed=None, targets=None, temperature=1.0,
                return_logits=False, return_entropy=False, routing=None, record=None) -> TrainOutput:
        """Give `sequences` (list of token lists) or `input_ids` [T] + `packed`. `routing` replays
        experts per MoE layer ({layer: [T, k]}); `record(layer, site, tensor)` observes every site."""
        device = self.model.device
        if sequences is not None:
            input_ids, packed = pack(sequences, device=device)
        if targets is None:
            targets = next_token_targets(input_ids, packed)
        chosen = {}

        def observe(layer, site, value):
            if site == "router_experts":
                chosen[layer] = value
            if record is not None:
                record(layer, site, value)

        run = Run(kda=self.kda, packed=packed, record=observe, routing=dict(routing or {}))
        hidden = self.model.hidden(input_ids, run)
        logprobs, logits, entropy = [], [], []
        for r0 in range(0, hidden.shape[0], _LOGIT_ROWS):
            chunk = self.model.lm_head(hidden[r0:r0 + _LOGIT_ROWS])
            logprobs.append(token_logprobs(chunk, targets[r0:r0 + _LOGIT_ROWS], temperature))
            if return_logits:
                logits.append(chunk)
            if return_entropy:
                entropy.append(token_entropy(chunk, temperature))
        if record is not None:
            if return_logits:
                record(None, "logits", torch.cat(logits))
            record(None, "logprobs", torch.cat(logprobs))
        return TrainOutput(torch.cat(logprobs), targets, packed, torch.cat(logits) if return_logits else None,
                           chosen, torch.cat(entropy) if return_entropy else None)
