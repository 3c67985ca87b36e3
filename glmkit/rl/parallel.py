"""Data-parallel GRPO: trainer ranks in one torch.distributed process group (gloo on CPUs, NCCL on GPUs).

Launched as torchrun launches any trainer (`torchrun --nproc-per-node N -m glmkit train
--data-parallel nccl ...`: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK from the
environment), or by the Ray builtin backend, one actor a rank. What each rank does (`GRPOTrainer`
with `dp=`):
- rank 0 rolls out (it alone has a rollout side) and sends the rollout to every rank as one byte
  buffer (JSON + safetensors, `encode_rollout`; never pickle);
- every optimizer step's samples are split between the ranks in order (`share`); a rank runs the train
  path on its share only, and its loss is its share of the global mean: each sample's token mean summed
  over its own samples, divided by the count of samples over all ranks. The gradients summed over the
  ranks are then the one-process gradients: all-reduces over flattened buckets sum them, and every
  rank clips and steps its optimizer on the same numbers, so the weights stay equal (rank 0's weights
  are broadcast once at the start, as DDP does);
- metrics are reduced the same way (sums over ranks), so every rank reports the one-process numbers;
- rank 0 writes the metrics and checkpoints and syncs the rollout side.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from glmkit.collectives import BACKENDS, collective_device, init_group

BUCKET_BYTES = 256 << 20  # per gradient all-reduce: few calls, and little memory next to the gradients


class DataParallel:
    """This process's place in the trainer ranks' process group (the default group unless given)."""

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = collective_device(group)

    @classmethod
    def from_env(cls, backend: str, timeout_s: float = 600.0) -> "DataParallel":
        """Join the group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks
        the GPU under nccl), with NVLink multicast off in this process before NCCL starts."""
        if backend not in BACKENDS:
            raise ValueError(f"--data-parallel {backend!r}; allowed: {', '.join(BACKENDS)}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("--data-parallel nccl needs CUDA; this machine has none (use gloo)")
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"--data-parallel needs a launcher's environment (torchrun sets it); missing "
                             f"{', '.join(missing)}")
        if not dist.is_initialized():
            init_group(backend, int(os.environ.get("LOCAL_RANK", 0)), timeout_s)
        return cls()

    def share(self, ids: list) -> list:
        return share(ids, self.rank, self.world)

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the ranks, elementwise (one all-reduce, on the group's device)."""
        t = t.to(self.device)
        dist.all_reduce(t, group=self.group)
        return t

    def sum_gradients(self, params: list, bucket_bytes: int = BUCKET_BYTES) -> None:
        """Every parameter's gradient summed over the ranks, in place: one all-reduce per bucket of
        gradients of one dtype (flattened together, at most `bucket_bytes` unless one gradient is larger),
        as DDP buckets them, so the extra memory is one bucket, not a copy of every gradient. A parameter
        without a gradient on this rank (an expert its tokens never reached) takes part as zeros, so that
        every rank reduces the same buffers."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in params], bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket]).to(self.device)
            dist.all_reduce(flat, group=self.group)
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    @torch.no_grad()
    def broadcast_parameters(self, params: list) -> None:
        """Rank 0's values into every rank's parameters."""
        for p in params:
            buffer = p.data.to(self.device)
            dist.broadcast(buffer, src=0, group=self.group)
            if buffer.data_ptr() != p.data.data_ptr():
                p.data.copy_(buffer)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0's bytes on every rank (other ranks pass None)."""
        size = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0, group=self.group)
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=0, group=self.group)
        return payload if self.rank == 0 else buffer.cpu().numpy().tobytes()

    def close(self):
        if dist.is_initialized():
            dist.destroy_process_group()


def _buckets(tensors: list, bucket_bytes: int) -> list[list]:
    """Consecutive runs of same-dtype tensors of at most `bucket_bytes` together (a larger tensor alone)."""
    buckets, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or buckets[-1][0].dtype != t.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def share(ids: list, rank: int, world: int) -> list:
    """Rank `rank`'s contiguous part of `ids` out of `world` (parts differ in size by at most one)."""
    n = len(ids)
    return ids[round(rank * n / world):round((rank + 1) * n / world)]


def encode_rollout(completions: list, rewards: torch.Tensor) -> bytes:
    """Completions and their rewards as safetensors bytes: token ids, log-probs (float64, the exact
    Python floats), routing and DSA selections as tensors; finish reasons and the layer lists in the
    header's metadata (JSON)."""
    from safetensors.torch import save

    tensors = {"rewards": rewards.detach().cpu().float().contiguous()}
    meta = []
    for i, c in enumerate(completions):
        tensors[f"{i}.prompt"] = torch.tensor(c.prompt, dtype=torch.int64)
        tensors[f"{i}.tokens"] = torch.tensor(c.tokens, dtype=torch.int64)
        tensors[f"{i}.logprobs"] = torch.tensor(c.logprobs, dtype=torch.float64)
        for kind in ("routing", "topk"):
            for layer, value in (getattr(c, kind) or {}).items():
                tensors[f"{i}.{kind}.{layer}"] = value.detach().cpu().contiguous()
        meta.append({"finish_reason": c.finish_reason, "routing": None if c.routing is None else list(c.routing),
                     "topk": None if c.topk is None else list(c.topk)})
    return save(tensors, metadata={"glmkit_rollout": json.dumps(meta)})


def decode_rollout(payload: bytes) -> tuple[list, torch.Tensor]:
    """-> (completions, rewards); what `encode_rollout` wrote, or a ValueError naming what is wrong."""
    from safetensors.torch import load

    from glmkit.model.rollout import Completion

    try:
        tensors = load(payload)
        meta = json.loads(_metadata(payload)["glmkit_rollout"])
    except Exception as err:  # noqa: BLE001 - any malformed buffer is reported the same way
        raise ValueError(f"not a glmkit rollout buffer: {err}") from None

    def need(key):
        if key not in tensors:
            raise ValueError(f"rollout buffer lacks tensor {key!r}")
        return tensors[key]

    completions = []
    for i, m in enumerate(meta):
        c = Completion(prompt=need(f"{i}.prompt").tolist(), tokens=need(f"{i}.tokens").tolist(),
                       logprobs=need(f"{i}.logprobs").tolist(), finish_reason=m["finish_reason"])
        for kind in ("routing", "topk"):
            if m[kind] is not None:
                setattr(c, kind, {int(layer): need(f"{i}.{kind}.{layer}") for layer in m[kind]})
        completions.append(c)
    return completions, need("rewards")


def _metadata(payload: bytes) -> dict:
    """The safetensors header's __metadata__ (the format: 8-byte little-endian length, then JSON)."""
    length = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + length])["__metadata__"]
