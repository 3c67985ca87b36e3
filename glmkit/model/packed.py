"""Packed variable-length sequences: tokens of N sequences laid end to end, no padding."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class Packed:
    """cu_seqlens [N+1] (int64, starts at 0); positions [T] = index of each token inside its sequence;
    seq_index [T] = which sequence each token belongs to."""

    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    seq_index: torch.Tensor
    # cu_seqlens as host ints: bounds() and lengths() are read by every layer, and reading a CUDA
    # tensor back stalls the stream each time
    host_cu_seqlens: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    _cpu_cu: torch.Tensor | None = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def from_lengths(cls, lengths, device="cpu") -> "Packed":
        host = [int(n) for n in (lengths.tolist() if torch.is_tensor(lengths) else lengths)]
        if any(n <= 0 for n in host):
            raise ValueError(f"every packed sequence needs at least one token, got lengths {host}")
        host_cu = (0, *itertools.accumulate(host))
        cu = to_device(torch.tensor(host_cu, dtype=torch.long), device)
        lengths = cu[1:] - cu[:-1]
        seq_index = torch.repeat_interleave(torch.arange(len(host), device=device), lengths, output_size=host_cu[-1])
        positions = torch.arange(host_cu[-1], device=device) - cu[:-1][seq_index]
        return cls(cu, positions, seq_index, host_cu)

    @property
    def num_sequences(self) -> int:
        return len(self.cu_seqlens) - 1

    def cu_seqlens_cpu(self) -> torch.Tensor:
        """cu_seqlens on the CPU, one tensor per Packed: fla's varlen kernels plan their chunks from
        it without reading the device, and cache the plan while they are given the same tensor."""
        if self._cpu_cu is None:
            self._cpu_cu = torch.tensor(self._host_cu(), dtype=torch.long)
        return self._cpu_cu

    def _host_cu(self) -> tuple[int, ...]:
        return self.host_cu_seqlens if self.host_cu_seqlens is not None else tuple(self.cu_seqlens.tolist())

    @property
    def num_tokens(self) -> int:
        return self._host_cu()[-1]

    def lengths(self) -> list[int]:
        cu = self._host_cu()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]

    def bounds(self) -> list[tuple[int, int]]:
        cu = self._host_cu()
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


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, so the copy does not wait for it."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def pack(sequences, device="cpu") -> tuple[torch.Tensor, Packed]:
    """List of token-id lists/tensors -> (input_ids [T], Packed); host ids go over in one copy."""
    seqs = [torch.as_tensor(s, dtype=torch.long).flatten() for s in sequences]
    if all(s.device.type == "cpu" for s in seqs):
        ids = to_device(torch.cat(seqs), device)
    else:
        ids = torch.cat([s.to(device) for s in seqs])
    return ids, Packed.from_lengths([len(s) for s in seqs], device=device)
