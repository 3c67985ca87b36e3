"""Process groups and the weights broadcast over them: what the data-parallel trainer (glmkit.rl),
the Ray builtin backend (glmkit.launch) and the engine's weight updates (glmkit.serve) share.

NVLink multicast stays off in every group glmkit makes and every job it launches (NCCL's NVLS,
torch's symmetric memory, NVSHMEM): the hosts the kit is run on are set up without it.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from glmkit.native_log import condense_native_traces

BACKENDS = ("gloo", "nccl")
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_group(backend: str, gpu: int = 0, timeout_s: float = 600.0, **init) -> None:
    """This process into a torch.distributed group: NVLink multicast off before NCCL reads its
    environment, GPU `gpu` picked under nccl, then `dist.init_process_group(backend, **init)`."""
    if backend not in BACKENDS:
        raise ValueError(f"process group backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    os.environ.update(NO_MULTICAST)
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ValueError("a nccl process group needs CUDA; this machine has none (use gloo)")
        torch.cuda.set_device(gpu)
    condense_native_traces()  # a failed rendezvous is answered by its exception, not c10d's C++ frames
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **init)


def announce(tensors: dict, device) -> tuple[list, list]:
    """A weights update's sending side, part one -> (ordered [(name, tensor)], contiguous on `device`;
    announced [(name, dtype name, shape)]): what the receivers need to allocate, in the order sent."""
    ordered = [(name, t.detach().to(device).contiguous()) for name, t in tensors.items()]
    return ordered, [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in ordered]


def send_announced(ordered: list, group=None) -> None:
    """Part two: every announced tensor broadcast from rank 0 of `group`, in the announced order."""
    for _, t in ordered:
        dist.broadcast(t, src=0, group=group)


def receive_announced(announced, device, group=None) -> dict:
    """The receiving side: tensors allocated on `device` from [(name, dtype name, shape)] (an unknown
    dtype is a ValueError naming the tensor, before anything is received), then filled by rank 0's
    broadcasts in the announced order."""
    tensors = {}
    for name, dtype, shape in announced:
        kind = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        tensors[name] = torch.empty(shape, dtype=kind, device=device)
    for t in tensors.values():
        dist.broadcast(t, src=0, group=group)
    return tensors


def collective_device(group=None) -> torch.device:
    """Where a group's collectives take their tensors: NCCL moves only CUDA tensors, gloo host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
