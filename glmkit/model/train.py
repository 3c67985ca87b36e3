"""Train path: full-sequence forward over packed variable-length sequences, per-token log-probs.

KDA runs chunked, DSA over the indexer's selection, MoE grouped per expert, each through the kernel
backend the run chose (`Backends`); autograd end to end (the indexer's selection is discrete and runs
without gradient, as in the reference). `recompute=True` recomputes each block in the backward
(the recipe's full uniform recompute), so long sequences fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmkit.kernels.backends import Backends
from glmkit.model.plan import ModelKernels
from glmkit.kernels.fuse import fusable, fusing
from glmkit.model.block import Run
from glmkit.model.head import LogprobHead
from glmkit.model.model import Glm5Model
from glmkit.model.packed import Packed, pack

# Rows of the LM head computed at once: bounds the [rows, vocab] logits alive at a time. A forward
# of at most this many rows keeps its bf16 logits for the backward (one GEMM fewer, ~1.3 GB at
# vocab 154880); longer ones recompute each chunk's logits there.
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
    topk: dict | None = None


def next_token_targets(input_ids: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Target of token t = token t+1 of the same sequence; -100 on each sequence's last token."""
    targets = torch.full_like(input_ids, -100)
    targets[:-1] = input_ids[1:]
    return targets.index_fill_(0, packed.last_indices(), -100)  # a scalar fill: nothing copied from the host


@fusable
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@fusable
def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] in fp32; 0 where target is -100."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return picked.masked_fill(targets < 0, 0.0)


class TrainPath:
    def __init__(self, model: Glm5Model, backends: Backends | str | None = None, recompute: bool = False):
        self.model = model
        self.kernels = ModelKernels(model, backends)  # every operator's backend, chosen here (see .plan)
        self.backends = self.kernels.backends
        self.recompute = recompute

    def _head(self, rows, targets, temperature, want_entropy, keep_logits):
        with fusing(self.kernels.plan.fuse_mode):
            return LogprobHead.apply(rows, self.model.lm_head.weight, targets, temperature, want_entropy,
                                     keep_logits)

    def forward(self, sequences=None, *, input_ids=None, packed=None, targets=None, temperature=1.0,
                return_logits=False, return_entropy=False, routing=None, topk_replay=None, record=None,
                record_scores=False) -> TrainOutput:
        """Give `sequences` (list of token lists) or `input_ids` [T] + `packed`. `routing` replays
        experts per MoE layer ({layer: [T, k]}); `topk_replay` replays DSA selections per DSA layer
        ({layer: [T, W] positions inside each token's sequence, -1 empty; an all-empty row keeps this
        forward's choice}); `record(layer, site, tensor)` observes every site (with `record_scores`,
        the index scores too). `TrainOutput.topk` holds the selections used, sequence-local."""
        device = self.model.device
        if sequences is not None:
            input_ids, packed = pack(sequences, device=device)
        if targets is None:
            targets = next_token_targets(input_ids, packed)
        chosen, selected = {}, {}

        def observe(layer, site, value):
            if site == "router_experts":
                chosen[layer] = value
            if site == "indexer_topk":
                selected[layer] = value
            if record is not None:
                record(layer, site, value)

        replay = {layer: packed.to_global(rows) for layer, rows in (topk_replay or {}).items()}
        run = Run(self.kernels.plan, packed=packed, record=observe, routing=dict(routing or {}),
                  recompute=self.recompute, topk_replay=replay, record_scores=record_scores)
        hidden = self.model.hidden(input_ids, run)
        logprobs, logits, entropy = [], [], []
        for r0 in range(0, hidden.shape[0], _LOGIT_ROWS):
            rows, chunk_targets = hidden[r0:r0 + _LOGIT_ROWS], targets[r0:r0 + _LOGIT_ROWS]
            if return_logits:
                chunk = self.model.lm_head(rows)
                logits.append(chunk)
                logprobs.append(token_logprobs(chunk, chunk_targets, temperature))
                if return_entropy:
                    entropy.append(token_entropy(chunk, temperature))
                continue
            keep = torch.is_grad_enabled() and hidden.shape[0] <= _LOGIT_ROWS
            lp, ent = self._head(rows, chunk_targets, temperature, return_entropy, keep)
            logprobs.append(lp)
            if return_entropy:
                entropy.append(ent)
        if record is not None:
            if return_logits:
                record(None, "logits", torch.cat(logits))
            record(None, "logprobs", torch.cat(logprobs))
        return TrainOutput(torch.cat(logprobs), targets, packed, torch.cat(logits) if return_logits else None,
                           chosen, torch.cat(entropy) if return_entropy else None,
                           {layer: packed.to_local(ids) for layer, ids in selected.items()})
