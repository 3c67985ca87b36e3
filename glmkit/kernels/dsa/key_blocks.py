"""Which key blocks a sparse-attention row visits: the plan the TileLang forward runs on (pure torch,
so the CPU tests check it).

    ids, order, blocks = plan(idx, block)
    idx    [T, W] selected key ids, -1 = empty, anywhere in the row
    ids    int32 [T, W'], idx padded with -1 to W' = a whole number (>= 1) of pairs of blocks
    order  int32 [T, W' / block], per row the blocks holding a key first, then the empty ones, each
           group in slot order
    blocks int32 [T], how many blocks of `order` the row visits: those holding a key, rounded up to
           even (a two-stage pipeline runs whole stage pairs; the extra block is an empty one)

A flag per block and an argsort over ~34 of them per row, instead of sorting the ids themselves
(at T = 4096, W = 2063 that sort took 0.8 ms, a third of the kernel's time).
"""

from __future__ import annotations

import torch


def plan(idx: torch.Tensor, block: int):
    if idx.dim() != 2:
        raise ValueError(f"idx must be [T, W], got shape {tuple(idx.shape)}")
    T, W = idx.shape
    pair = 2 * block
    width = max(pair, -(-W // pair) * pair)
    ids = torch.nn.functional.pad(idx.to(torch.int32), (0, width - W), value=-1)
    filled = (ids.view(T, width // block, block) >= 0).any(-1)
    order = torch.argsort((~filled).to(torch.int8), dim=1, stable=True).to(torch.int32)
    blocks = (filled.sum(1, dtype=torch.int32) + 1) // 2 * 2
    return ids, order.contiguous(), blocks
