"""Weights-update process groups as the recipe's framework and SGLang form them.

The trainer (rank 0) and each engine rank meet at `tcp://master_address:master_port`: rank 0 hosts
the rendezvous TCP store, every member wraps it in `PrefixStore(group_name, store)` and builds a
process group of its own with that name, outside torch's default group. So one process can belong
to several such groups at once (the framework makes one per trainer pipeline stage, `miles-pp_<k>`)
and keep its own default group for anything else. Members call this same helper on both sides.

The group is built with `torch.distributed`'s internal `_new_process_group_helper`, as the
framework does (its `init_process_group` copy, and SGLang's `init_custom_process_group`); glmkit
calls it by keyword and names the torch version when that internal API does not fit.
"""

from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist

BACKENDS = ("nccl", "gloo")


def new_named_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                    group_name: str, timeout_s: float = 300.0):
    """Join (rank > 0) or host (rank 0) the group `group_name` -> its ProcessGroup. Blocks until all
    `world_size` members have arrived or `timeout_s` passes (then raises)."""
    from torch.distributed import distributed_c10d as c10d

    from glmkit.collectives import NO_MULTICAST
    from glmkit.native_log import condense_native_traces

    if backend not in BACKENDS:
        raise ValueError(f"process group backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size {world_size})")
    if backend == "nccl":
        os.environ.update(NO_MULTICAST)
        if not torch.cuda.is_available():
            raise ValueError("a nccl process group needs CUDA; this machine has none (use gloo)")
    condense_native_traces()  # a failed rendezvous is answered by its exception, not c10d's C++ frames
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{_bracketed(master_address)}:{int(master_port)}"
    store, rank, world_size = next(c10d.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    helper = c10d._new_process_group_helper
    options = "backend_options" if "backend_options" in inspect.signature(helper).parameters else "pg_options"
    try:
        made = helper(world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
                      timeout=timeout, **{options: None})
    except TypeError as err:  # torch moved its internal API: say which torch, not a bare TypeError
        raise RuntimeError(f"torch {torch.__version__}: _new_process_group_helper does not take the framework's "
                           f"arguments ({err})") from None
    group = made[0] if isinstance(made, tuple) else made
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_named_group(group) -> None:
    dist.destroy_process_group(group)


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
