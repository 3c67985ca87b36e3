"""Packed variable-length sequences: tokens of N sequences laid end to end, no padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """cu_seqlens [N+1] (int64, starts at 0); positions [T] = index of each token inside its sequence;
    seq_index [T] = which sequence each token belongs to."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    seq_index: torch.Tensor

    @classmethod
    def from_lengths(cls, lengths, device="cpu") -> "Packed":
        lengths = torch.as_tensor(list(lengths), dtype=torch.long, device=device)
        if (lengths <= 0).any():
            raise ValueError(f"every packed sequence needs at least one token, got lengths {lengths.tolist()}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long, device=device)
        cu[1:] = lengths.cumsum(0)
        seq_index = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        positions = torch.arange(int(cu[-1]), device=device) - cu[:-1][seq_index]
        return cls(cu, positions, seq_index)

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def lengths(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def bounds(self) -> list[tuple[int, int]]:
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))

    def last_indices(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1

    def to_global(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token positions inside each row's own sequence [T, W] (-1 empty) -> packed ids."""
        local = local.to(self.cu_seqlens.device, torch.long)
        start = self.cu_seqlens[self.seq_index][:, None]
        return torch.where(local >= 0, local + start, local)

    def to_local(self, ids: torch.Tensor) -> torch.Tensor:
        """Packed ids [T, W] (-1 empty) -> positions inside each row's own sequence."""
        start = self.cu_seqlens[self.seq_index][:, None]
        return torch.where(ids >= 0, ids - start, ids)


def pack(sequences, device="cpu") -> tuple[torch.Tensor, Packed]:
    """List of token-id lists/tensors -> (input_ids [T], Packed)."""
    seqs = [torch.as_tensor(s, dtype=torch.long, device=device).flatten() for s in sequences]
    return torch.cat(seqs), Packed.from_lengths([len(s) for s in seqs], device=device)
