"""Process groups that span processes of different roles (trainer rank 0 and vLLM workers)
without touching either side's default torch.distributed group.

    pg = init_custom_process_group("gloo", "10.0.0.1", 29600, rank, world_size, "weights-v3")

Rank 0 hosts the rendezvous store. The group is built directly from a TCPStore wrapped in a
PrefixStore (torch's `new_group` would need every member in one default world). Construction
blocks until all `world_size` members have joined, so the caller starts the others first (a
Ray call that does not wait) and then joins itself.
"""
from datetime import timedelta

import torch
import torch.distributed as dist


def init_custom_process_group(
    backend: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    elif backend == "nccl":  # untested here: no GPU
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return group


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """In-place broadcast from group rank `src` over a group made above."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


def destroy(group: dist.ProcessGroup) -> None:
    """Releases the group's connections (an abort at exit was seen without it)."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        shutdown()
