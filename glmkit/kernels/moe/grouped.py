"""Routed experts as two `torch._grouped_mm` calls over a buffer holding each (token, slot) pair once,
grouped by expert: no loop over experts and no host sync (the buffer has its upper-bound size).
CUDA bf16; the reference is `loop.py`."""

from __future__ import annotations

import torch

from glmkit.kernels.fuse import fusable
from glmkit.kernels.swiglu import clamped_swiglu

# Each expert's rows in the grouped buffer start at a multiple of this many rows.
GROUP_ALIGN = 16


def experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
            down: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    T, k = experts.shape
    E, D, slots = gate_up.shape[0], x.shape[1], T * k
    arange = torch.arange(slots + E * (GROUP_ALIGN - 1), device=x.device)
    flat_expert = experts.flatten()
    sorted_expert, order = flat_expert.sort(stable=True)
    # per expert [E]: its run in the sorted slots, and its rows in the buffer (padded to GROUP_ALIGN)
    sorted_end = torch.searchsorted(sorted_expert, arange[:E], right=True)
    counts = sorted_end.diff(prepend=sorted_end.new_zeros(1))
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    padded_end = padded.cumsum(0)
    shift = (padded_end - padded) - (sorted_end - counts)  # buffer start - sorted start
    sorted_row = arange[:slots] + shift[sorted_expert]
    row_of_slot = torch.empty_like(sorted_row).scatter_(0, order, sorted_row)  # [T*k], slot t*k+j
    # every row is written once (index_copy) and read once (index_select), so forward and backward
    # are free of accumulation; each token's k copies come from expand, whose backward is a sum over k
    x_per_slot = x.unsqueeze(1).expand(T, k, D).reshape(slots, D)
    buffer = x.new_zeros(len(arange), D).index_copy(0, row_of_slot, x_per_slot)
    offs = padded_end.to(torch.int32)
    gate_up_rows = torch._grouped_mm(buffer, gate_up.transpose(-2, -1), offs=offs)
    # _grouped_mm leaves the rows past offs[-1] uninitialised: zero them before SwiGLU, whose
    # forward and backward would otherwise turn garbage into inf / NaN
    gate_up_rows = gate_up_rows.masked_fill((arange >= padded_end[-1]).unsqueeze(1), 0)
    gate, up = gate_up_rows.chunk(2, dim=-1)
    hidden = clamped_swiglu(gate, up, swiglu_limit)
    y = torch._grouped_mm(hidden, down.transpose(-2, -1), offs=offs)
    return weighted_sum(y.index_select(0, row_of_slot).view(T, k, D), weights)


@fusable
def weighted_sum(per_slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """per_slot [T, k, D], weights [T, k] -> sum_j weights_j * per_slot_j [T, D], fp32 sum."""
    return (per_slot.float() * weights.unsqueeze(-1)).sum(1).to(per_slot.dtype)
