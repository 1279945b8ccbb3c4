"""One role's torch.distributed world and Megatron's TP/PP/DP groups inside it.

    init_model_parallel(tp=2, pp=1, seed=1)   # every rank of the world calls it once
"""
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1, timeout_s: float = 600.0,
                        ep: int = 1, etp: int = 1) -> None:
    """Joins the default group (from the usual MASTER_ADDR/RANK/WORLD_SIZE variables unless it
    exists) and builds Megatron's parallel groups; DP = world / (TP * PP). The experts' groups
    (EP × ETP, then expert DP) are carved out of the same TP × DP ranks of each stage."""
    import megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(default_backend(), timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tp * pp) or (world // pp) % (ep * etp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp}*{pp}, "
                         f"or ep*etp = {ep}*{etp} does not divide tp*dp = {world // pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
