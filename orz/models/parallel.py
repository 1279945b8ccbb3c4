"""One role's torch.distributed world and Megatron's TP/PP/DP groups inside it.

    init_model_parallel(Sizes(tp=2), seed=1)   # every rank of the world calls it once

A world meets at rank 0's TCPStore. `host_store` listens at once on a port the OS picks and
keeps it; the others `join_store` it. (Picking a free port and listening on it later is a race:
in between, any outgoing connection on the node may take that port as its source; CI saw
EADDRINUSE.)

    store = host_store(ip)                   # rank 0, before anyone is told where
    store = join_store(ip, port)             # every other member
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from orz.models.spec import Sizes


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def host_store(host: str, timeout_s: float = 600.0) -> dist.TCPStore:
    """A rendezvous listening now, on every interface, at the port `.port`; `host` is how this
    process reaches itself."""
    return dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float = 600.0) -> dist.TCPStore:
    """A client of the rendezvous at host:port (retried until it listens, up to timeout_s)."""
    return dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))


def init_model_parallel(sizes: Sizes = Sizes(), seed: int = 1, timeout_s: float = 600.0,
                        store: dist.Store | None = None) -> None:
    """Joins the default group unless it exists (at `store` as RANK of WORLD_SIZE, or from the
    usual MASTER_ADDR/MASTER_PORT variables) and builds Megatron's parallel groups at `sizes`;
    the world decides DP = world / (TP * PP * CP). The experts' groups (EP × ETP, then expert DP)
    are carved out of the same TP × CP × DP ranks of each stage."""
    import megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            dist.init_process_group(default_backend(), timeout=timeout)
        else:
            dist.init_process_group(default_backend(), store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    world = dist.get_world_size()
    tp, pp, cp, ep, etp = sizes.tp, sizes.pp, sizes.cp, sizes.ep, sizes.etp
    if world % (tp * pp * cp) or (world // pp) % (ep * etp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp*cp = {tp}*{pp}*{cp}, "
                         f"or ep*etp = {ep}*{etp} does not divide tp*cp*dp = {world // pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
