"""Sizes checked against the machine before anything is allocated: a run that cannot fit is refused
with the numbers, instead of running the machine out of memory or hanging."""

from __future__ import annotations

from pathlib import Path

FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: settings the model computes with must stay within it


def free_bytes(device: str) -> int:
    """Memory a run may still take on `device`: free GPU memory, or available host memory, within
    what this process's memory cgroup (a container's limit) still allows."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info()[0]
    import psutil

    available = psutil.virtual_memory().available
    room = cgroup_room()
    return available if room is None else min(available, room)


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def cgroup_room(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's memory cgroup and its ancestors still allow (the tightest limit less its
    usage), or None where none is set: a container killed past its limit sees the host's free memory
    in psutil (cgroup v2: memory.max / memory.current; v1: memory.limit_in_bytes / usage_in_bytes)."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2's unified hierarchy
            base, limit_name, usage_name = Path(root), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base, limit_name, usage_name = Path(root) / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        group = base / path.strip("/")
        while True:  # the process's group, then each one above it up to the hierarchy's root
            try:
                limit = (group / limit_name).read_text().strip()
                usage = int((group / usage_name).read_text().strip())
                if limit.isdigit() and int(limit) < UNLIMITED:
                    rooms.append(max(0, int(limit) - usage))
            except (OSError, ValueError):
                pass
            if group == base or base not in group.parents:
                break
            group = group.parent
    return min(rooms) if rooms else None


def bytes_per_token(config) -> int:
    """A lower bound of what one token kept through a forward takes: its logits in fp32 and each
    layer's mHC streams for one site."""
    return 4 * (config.vocab_size + config.num_hidden_layers * config.hidden_size * config.hc_mult)


def check_tokens_fit(config, batch: int, seq_len: int, device: str, what: str, paths: int = 2) -> None:
    """batch x seq_len tokens through `paths` paths that keep per-token captures: a lower bound of the
    memory they take (the logits in fp32, and each layer's mHC streams for one site) against what
    `device` has free. Refused with both numbers when it cannot fit."""
    if batch < 1 or seq_len < 1:
        raise ValueError(f"{what}: batch and sequence length must be >= 1, got {batch} x {seq_len}")
    tokens = batch * seq_len
    per_token = bytes_per_token(config)
    need = paths * tokens * per_token
    have = free_bytes(device)
    if need > have:
        raise ValueError(f"{what}: {batch} x {seq_len} = {tokens} tokens need at least {need / 2**30:.3g} GiB "
                         f"({paths} paths x {per_token} bytes a token) and {device} has {have / 2**30:.3g} GiB free; "
                         f"use fewer or shorter sequences (or the streaming mode)")


def sequence_bytes(config, tokens: int, device: str) -> int:
    """A lower bound of what one sequence of `tokens` takes through the transformers reference: its
    per-token bytes and one layer's T x T matrices in fp32. On the CPU the reference attends eagerly:
    every head's scores, probabilities and their intermediate copies at once, with the mask and the
    indexer's scores beside them (measured on the tiny model at 6000 tokens: 62 bytes per T x T
    element, against 56 counted here for its 4 heads; a 24000-token sample passed 24 GB). A CUDA kernel
    may hold as little as the mask and one score matrix."""
    matrices = 3 * config.num_attention_heads + 2 if not str(device).startswith("cuda") else 2
    return tokens * bytes_per_token(config) + 4 * matrices * tokens * tokens


def check_sequence_fits(config, tokens: int, device: str, what: str) -> None:
    """Refuse, with both numbers, one sequence the reference cannot hold in the memory `device` has free."""
    need, have = sequence_bytes(config, tokens, device), free_bytes(device)
    if need > have:
        raise ValueError(f"{what}: {tokens} tokens through the reference need at least {need / 2**30:.3g} GiB "
                         f"(attention scores grow with the square of the length) and {device} has "
                         f"{have / 2**30:.3g} GiB free; use a machine with more memory or a GPU")

