"""A role's optimizer state by parameter name, and its checkpoint at another layout: fp32
masters and Adam moments, saved by parameter name and flat range, re-cut for another DP size and
re-sharded for another TP/PP (through `convert.reshard`); and the model weights re-sharded too.

On disk (one role): `mp_rank_TT_PPP/model.safetensors` (written by DP rank 0) and
`mp_rank_TT_PPP/optim_dp_NN_I.pt`: DP rank NN's pieces of its I-th optimizer, a list of
{name, range, tensors} in the optimizer's order. With the distributed optimizer every DP rank
writes the flat range it holds; without it DP rank 0 writes whole tensors (replicas are equal).
"""
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from orz.models.arch import ModelArch
from orz.models.checkpoint import rank_dir
from orz.models.convert import EMBEDDING, Layout, reshard

DDP_PREFIX = "module."  # Megatron DDP's name for the wrapped model


def optimizers(optimizer) -> list:
    """The optimizers inside a Megatron optimizer (a ChainedOptimizer holds one per param-group kind)."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizer(s) inside a Megatron optimizer ([] without ZeRO-1)."""
    return [o for o in optimizers(optimizer) if _is_distributed(o)]


def _main(param) -> torch.Tensor:
    """The fp32 tensor a non-distributed optimizer steps for a model parameter: its copy in mixed
    precision (Megatron's `main_param`), else the parameter itself."""
    return getattr(param, "main_param", param)


def _shard_params(optimizer, names: dict) -> list:
    """An optimizer's model parameters in its order (fixed by the layout): the distributed
    optimizer's buffers', or the param groups' of a non-distributed one."""
    if _is_distributed(optimizer):
        return [param for buffer in optimizer.gbuf_ranges for by_dtype in buffer.values()
                for bucket in by_dtype for param in bucket["param_map"]]
    model_param = {id(_main(p)): p for p in names}
    return [model_param[id(main)] for group in optimizer.optimizer.param_groups for main in group["params"]]


def _owned_range(optimizer, param) -> tuple[int, int]:
    """[start, end) of the flattened parameter whose states this DP rank's optimizer holds."""
    if not _is_distributed(optimizer):
        return 0, param.numel()
    owned = optimizer._get_model_param_range_map(param)["param"]
    return owned.start, owned.end


def _states(optimizer, param) -> dict[str, torch.Tensor]:
    """The fp32 master (`param`) and Adam moments (and step) this rank holds for `param`, flat."""
    if _is_distributed(optimizer):
        return optimizer._get_main_param_and_optimizer_states(param)
    main = _main(param)
    adam = optimizer.optimizer.state.get(main, {})
    return {"param": main.detach().reshape(-1), **{k: v.reshape(-1) if v.dim() else v for k, v in adam.items()}}


def _set_states(optimizer, param, states: dict[str, torch.Tensor]) -> None:
    if _is_distributed(optimizer):
        optimizer._set_main_param_and_optimizer_states(param, states)
        return
    main = _main(param)
    main.data.copy_(states["param"].reshape(main.shape))
    optimizer.optimizer.state[main] = {k: v.clone() if v.dim() == 0 else v.reshape(main.shape).clone()
                                       for k, v in states.items() if k != "param"}


def shard_states(optimizer, names: dict) -> list[dict]:
    """This DP rank's fp32 masters and Adam moments, parameter by parameter: its name, the flat
    range it holds and the tensors. (Megatron's own `get_parameter_state_dp_reshardable` output
    cannot be fed back to its loader, which wants `padding` entries, so the per-parameter
    accessors both use are called directly.)"""
    return [{"name": names[p], "range": _owned_range(optimizer, p),
             "tensors": {k: v.detach().clone() for k, v in _states(optimizer, p).items()}}
            for p in _shard_params(optimizer, names)]


def _cut(pieces: list[dict], start: int, end: int) -> dict[str, torch.Tensor]:
    """[start, end) of one parameter's states from the saved pieces that cover it (each DP rank
    of the saving run held one flat range); 0-d states (Adam's step) are the same in each."""
    inside = sorted((p for p in pieces if p["range"][0] < end and p["range"][1] > start), key=lambda p: p["range"][0])
    out = {}
    for key, tensor in inside[0]["tensors"].items():
        if tensor.dim() == 0:
            out[key] = tensor.clone()
            continue
        slices = []
        for piece in inside:
            offset = piece["range"][0]
            slices.append(piece["tensors"][key].reshape(-1)[max(start, offset) - offset:min(end, piece["range"][1]) - offset])
        out[key] = torch.cat(slices)
    if out["param"].numel() != end - start:
        raise ValueError(f"the saved optimizer shards cover {out['param'].numel()} of the {end - start} values asked")
    return out


def _pieces_by_name(paths: list[Path]) -> dict[str, list[dict]]:
    """Every saved DP rank's pieces of one optimizer, by parameter name, memory-mapped."""
    by_name = defaultdict(list)
    for path in paths:
        for piece in torch.load(path, mmap=True):
            if "range" not in piece:
                raise ValueError(f"{path}: optimizer shards of this age cannot be re-cut; resume at the layout "
                                 "they were saved at")
            by_name[piece["name"]].append(piece)
    return by_name


def _give_each_its_own_step(optimizer) -> None:
    """Without TE/Apex, Megatron's load_state_dict gives every parameter the same `step` tensor,
    which torch's Adam then increments once per parameter per step: give each its own."""
    for state in optimizer.optimizer.state.values() if _is_distributed(optimizer) else ():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


@torch.no_grad()  # the masters are leaves that require grad
def load_shard_states(optimizer, names: dict, paths: list[Path], saved_dp_rank: int | None) -> None:
    """Sets this DP rank's masters and moments, at the saved TP/PP: from its own saved shard
    (saved_dp_rank: the run keeps the saved DP size), else its range of each parameter cut from
    every saved shard, so that a rank reads only what it holds."""
    params = _shard_params(optimizer, names)
    _give_each_its_own_step(optimizer)
    if saved_dp_rank is not None:
        mine = torch.load(paths[saved_dp_rank])
        if len(mine) != len(params):
            raise ValueError(f"optimizer shard holds {len(mine)} parameters, this layout has {len(params)}")
        for param, piece in zip(params, mine):  # older checkpoints saved the tensors alone
            _set_states(optimizer, param, piece["tensors"] if "tensors" in piece else piece)
        return
    by_name = _pieces_by_name(paths)
    for param in params:
        _set_states(optimizer, param, _cut(by_name[names[param]], *_owned_range(optimizer, param)))


def saved_layout(root: Path, tp: int, pp: int, layout: Layout) -> Layout:
    """The layout a checkpoint's shards were written at (its padded vocabulary read from the
    saved embedding); TE naming and the value-head flag are this run's."""
    with safe_open(root / rank_dir(0, 0) / "model.safetensors", "pt") as f:
        padded = f.get_slice(EMBEDDING).get_shape()[0] * tp
    return replace(layout, tp=tp, pp=pp, tp_rank=0, pp_rank=0, padded_vocab=padded)


def resharded_weights(root: Path, arch: ModelArch, saved: Layout, layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's model shard cut from every saved rank's `model.safetensors`, lazily."""
    files = {}

    def read(tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        if (tp_rank, pp_rank) not in files:
            files[tp_rank, pp_rank] = safe_open(root / rank_dir(tp_rank, pp_rank) / "model.safetensors", "pt")
        return files[tp_rank, pp_rank].get_tensor(name)

    return reshard(read, arch, saved, layout)


@torch.no_grad()
def load_resharded_states(optimizer, names: dict, index: int, root: Path, arch: ModelArch,
                          saved: Layout, layout: Layout) -> None:
    """Sets this rank's masters and moments from a checkpoint of another TP/PP (and any DP):
    each saved rank's flat pieces are joined into its whole local tensors, re-sharded to this
    layout per state (`param`, `exp_avg`, `exp_avg_sq`), and this DP rank's range cut out."""
    pieces, shapes = {}, {}
    for tp_rank in range(saved.tp):
        for pp_rank in range(saved.pp):
            shard = root / rank_dir(tp_rank, pp_rank)
            pieces[tp_rank, pp_rank] = _pieces_by_name(sorted(shard.glob(f"optim_dp_*_{index}.pt")))
            with safe_open(shard / "model.safetensors", "pt") as f:
                shapes[tp_rank, pp_rank] = {k: f.get_slice(k).get_shape() for k in f.keys()}

    def whole(tp_rank: int, pp_rank: int, name: str) -> dict[str, torch.Tensor]:
        shape = shapes[tp_rank, pp_rank][name]
        states = _cut(pieces[tp_rank, pp_rank][DDP_PREFIX + name], 0, int(torch.Size(shape).numel()))
        return {k: v if v.dim() == 0 else v.reshape(shape) for k, v in states.items()}

    params = _shard_params(optimizer, names)
    _give_each_its_own_step(optimizer)
    saved_tensors = next(iter(pieces[0, 0].values()))[0]["tensors"]  # the keys every piece has
    step = saved_tensors.get("step")  # Adam's, the same everywhere
    states = {key: reshard(lambda t, p, name: whole(t, p, name)[key], arch, saved, layout)
              for key in saved_tensors if key != "step"}
    for param in params:
        start, end = _owned_range(optimizer, param)
        name = names[param][len(DDP_PREFIX):]
        mine = {key: states[key][name].reshape(-1)[start:end] for key in states}
        _set_states(optimizer, param, mine | ({} if step is None else {"step": step.clone()}))
