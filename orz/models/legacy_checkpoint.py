"""Reads a role's checkpoint in the format orz wrote until 2026-12-05, once, for
`orz convert upgrade` (orz/convert.py), which re-saves it in Megatron's format. Nothing else reads it.

That format, per role directory: `mp_rank_TT_PPP/` per TP × PP rank (`mp_rank_TT_PPP_EEE/` per EP
rank of a MoE at EP > 1), each with `model.safetensors` (the rank's weights by Megatron name),
`optim.pt` (RNG, the layout, the scheduler's step count, the distributed optimizer's param
groups; before 2026-11 a non-distributed optimizer's whole Megatron state dict) and
`optim_dp_NN_I.pt` (DP rank NN's pieces of its I-th optimizer: {name, range, tensors} per
parameter in the optimizer's order; without the distributed optimizer DP rank 0's whole tensors).

    layout = saved_layout(role_dir)      # {"tp", "pp", "dp", "ep", "etp"}: the world to read it in
    scheduler_steps = load(model, role_dir)    # on every rank of a MegatronModel at exactly that layout
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch

from orz.models.checkpoint import ModelConfigError


def saved_layout(role_dir: str | Path) -> dict:
    """The sizes the role was saved at: recorded in optim.pt since 2026-11; before, one rank
    directory per TP × PP rank and DP 1 (the earliest checkpoints knew no other)."""
    role_dir = Path(role_dir)
    state_file = role_dir / "mp_rank_00_000" / "optim.pt"
    if not state_file.is_file():
        raise ModelConfigError(f"{role_dir}: {state_file.name} of TP rank 0, stage 0 is missing: not a checkpoint "
                               "orz wrote before 2026-12-05")
    state = torch.load(state_file, weights_only=False)
    if "layout" in state:
        return {"ep": 1, "etp": 1} | state["layout"]
    ranks = [re.fullmatch(r"mp_rank_(\d+)_(\d+)", d.name) for d in role_dir.glob("mp_rank_*")]
    return {"tp": 1 + max(int(m[1]) for m in ranks if m), "pp": 1 + max(int(m[2]) for m in ranks if m),
            "dp": 1, "ep": 1, "etp": 1}


def _optimizers(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def _main(param) -> torch.Tensor:
    """The fp32 tensor a non-distributed optimizer steps for `param` (its master in mixed precision)."""
    return getattr(param, "main_param", param)


def _params(optimizer, names: dict) -> list:
    """An optimizer's model parameters in its order: the distributed optimizer's buffers', or the
    param groups' of a non-distributed one."""
    if _is_distributed(optimizer):
        return [param for buffer in optimizer.gbuf_ranges for by_dtype in buffer.values()
                for bucket in by_dtype for param in bucket["param_map"]]
    model_param = {id(_main(p)): p for p in names}
    return [model_param[id(main)] for group in optimizer.optimizer.param_groups for main in group["params"]]


def _owned_range(optimizer, param) -> tuple[int, int]:
    if not _is_distributed(optimizer):
        return 0, param.numel()
    owned = optimizer._get_model_param_range_map(param)["param"]
    return owned.start, owned.end


def _set_states(optimizer, param, states: dict[str, torch.Tensor]) -> None:
    if _is_distributed(optimizer):
        optimizer._set_main_param_and_optimizer_states(param, states)
        return
    main = _main(param)
    main.data.copy_(states["param"].reshape(main.shape))
    optimizer.optimizer.state[main] = {k: v.clone() if v.dim() == 0 else v.reshape(main.shape).clone()
                                       for k, v in states.items() if k != "param"}


def _cut(pieces: list[dict], start: int, end: int) -> dict[str, torch.Tensor]:
    """[start, end) of one parameter's states from the saved pieces that cover it."""
    inside = sorted((p for p in pieces if p["range"][0] < end and p["range"][1] > start), key=lambda p: p["range"][0])
    out = {}
    for key, tensor in inside[0]["tensors"].items():
        if tensor.dim() == 0:  # Adam's step: the same in each piece
            out[key] = tensor.clone()
            continue
        out[key] = torch.cat([piece["tensors"][key].reshape(-1)[max(start, piece["range"][0]) - piece["range"][0]:
                                                                 min(end, piece["range"][1]) - piece["range"][0]]
                              for piece in inside])
    return out


@torch.no_grad()  # the masters are leaves that require grad
def _load_optimizer(optimizer, names: dict, shard: Path, index: int, dp_rank: int, distributed: bool) -> None:
    """This DP rank's masters and moments: its own saved piece list (distributed), else its range
    of each parameter cut from DP rank 0's whole tensors."""
    params = _params(optimizer, names)
    if distributed:
        mine = torch.load(shard / f"optim_dp_{dp_rank:02d}_{index}.pt")
        if len(mine) != len(params):
            raise ModelConfigError(f"{shard}: optimizer shard holds {len(mine)} parameters, this layout has {len(params)}")
        for param, piece in zip(params, mine):
            _set_states(optimizer, param, piece["tensors"])
        return
    by_name = defaultdict(list)
    for path in sorted(shard.glob(f"optim_dp_*_{index}.pt")):
        for piece in torch.load(path):
            by_name[piece["name"]].append(piece)
    for param in params:
        _set_states(optimizer, param, _cut(by_name[names[param]], *_owned_range(optimizer, param)))


def load(model, role_dir: str | Path) -> int:
    """Weights, optimizer state and RNG of this rank from `role_dir` into a MegatronModel built at
    the saved layout (its HF weights loaded); returns the scheduler's step count."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    layout = model.layout
    ep_rank = f"_{layout.ep_rank:03d}" if layout.ep > 1 else ""
    shard = Path(role_dir) / f"mp_rank_{layout.tp_rank:02d}_{layout.pp_rank:03d}{ep_rank}"
    if not (shard / "optim.pt").is_file():  # only the first expert-DP replica wrote a MoE's
        raise ModelConfigError(f"{shard}/optim.pt: missing; upgrade at the layout the role was saved at")
    state = torch.load(shard / "optim.pt", weights_only=False)
    model.module.load_state_dict(load_file(shard / "model.safetensors"), strict=False)
    model.refresh_masters()
    torch.set_rng_state(state["rng"])
    distributed = state.get("distributed", any(Path(role_dir).glob("mp_rank_*/optim_dp_*.pt")))
    if "optimizer" in state:  # the distributed optimizer's param groups, or the earliest whole state
        with torch.no_grad():
            model.optimizer.load_state_dict(state["optimizer"])
    names = {param: name for name, param in model.model.named_parameters()}
    if "distributed" in state or distributed:  # pieces by name (since 2026-11)
        for i, optimizer in enumerate(_optimizers(model.optimizer)):
            _load_optimizer(optimizer, names, shard, i, ps.get_data_parallel_rank(), distributed)
    return state.get("scheduler_steps") or state["scheduler"]["num_steps"]
