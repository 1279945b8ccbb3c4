"""A role's optimizer state by parameter name, and its checkpoint at another layout: fp32
masters and Adam moments, saved by parameter name and flat range, re-cut for another DP size and
re-sharded for another TP/PP/EP (through `convert.reshard`); and the model weights re-sharded too.

On disk (one role): `mp_rank_TT_PPP/model.safetensors` (written by DP rank 0) and
`mp_rank_TT_PPP/optim_dp_NN_I.pt`: DP rank NN's pieces of its I-th optimizer, a list of
{name, range, tensors} in the optimizer's order. With the distributed optimizer every DP rank
writes the flat range it holds; without it DP rank 0 writes whole tensors (replicas are equal).
A mixture of experts at EP > 1 writes `mp_rank_TT_PPP_EEE`: EP rank EEE's experts (local names)
beside a copy of TP rank TT's dense tensors, from each rank of the first expert-DP replica; so a
dense tensor's pieces may lie in several directories of its TP rank, an expert's in several of
its EP rank (whole experts only: ETP 1 re-shards).
"""
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from orz.models.arch import ModelArch
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
    """Every saved DP rank's pieces of the tensors of one rank directory (or of several that hold
    the same tensors), by parameter name, memory-mapped; one piece per range."""
    by_name = defaultdict(list)
    for path in paths:
        for piece in torch.load(path, mmap=True):
            if "range" not in piece:
                raise ValueError(f"{path}: optimizer shards of this age cannot be re-cut; resume at the layout "
                                 "they were saved at")
            if all(piece["range"] != other["range"] for other in by_name[piece["name"]]):  # replicas wrote copies
                by_name[piece["name"]].append(piece)
    return by_name


def _give_each_its_own_step(optimizer) -> None:
    """Without TE/Apex, Megatron's load_state_dict gives every parameter the same `step` tensor,
    which torch's Adam then increments once per parameter per step: give each its own."""
    for state in optimizer.optimizer.state.values() if _is_distributed(optimizer) else ():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


@torch.no_grad()  # the masters are leaves that require grad
def load_shard_states(optimizer, names: dict, paths: list[Path], own: Path | None) -> None:
    """Sets this DP rank's masters and moments, at the saved TP/PP: from its own saved shard
    (`own`: the run keeps the saved DP size), else its range of each parameter cut from every
    saved shard (`paths`), so that a rank reads only what it holds."""
    params = _shard_params(optimizer, names)
    _give_each_its_own_step(optimizer)
    if own is not None:
        mine = torch.load(own)
        if len(mine) != len(params):
            raise ValueError(f"optimizer shard holds {len(mine)} parameters, this layout has {len(params)}")
        for param, piece in zip(params, mine):  # older checkpoints saved the tensors alone
            _set_states(optimizer, param, piece["tensors"] if "tensors" in piece else piece)
        return
    by_name = _pieces_by_name(paths)
    for param in params:
        _set_states(optimizer, param, _cut(by_name[names[param]], *_owned_range(optimizer, param)))


def saved_dirs(root: Path, pp_rank: int, tp_rank: int | None = None, ep_rank: int | None = None,
               holding: str = "model.safetensors") -> list[Path]:
    """The saved rank directories of stage `pp_rank` that hold a file `holding`: of TP rank
    `tp_rank` (None: any) and, in a checkpoint with experts spread over EP ranks, of EP rank
    `ep_rank` (None: any). Directories: `mp_rank_TT_PPP`, or `mp_rank_TT_PPP_EEE` with EP > 1."""
    tp = "??" if tp_rank is None else f"{tp_rank:02d}"
    suffix = "*" if ep_rank is None else f"_{ep_rank:03d}"
    return [d for d in sorted(root.glob(f"mp_rank_{tp}_{pp_rank:03d}{suffix}")) if any(d.glob(holding))]


def _tensor_dirs(root: Path, saved: Layout, expert: bool, rank: int, pp_rank: int, holding: str) -> list[Path]:
    """The saved directories holding TP rank `rank`'s dense tensors, or (`expert`) EP rank
    `rank`'s experts: whole experts (ETP 1), so every TP rank's copy."""
    if expert:
        return saved_dirs(root, pp_rank, ep_rank=rank if saved.ep > 1 else None, holding=holding)
    return saved_dirs(root, pp_rank, tp_rank=rank, holding=holding)


def saved_layout(root: Path, sizes: dict, layout: Layout) -> Layout:
    """The layout a checkpoint's shards were written at (`sizes`: its tp, pp, ep, etp; its padded
    vocabulary read from the saved embedding); TE naming and the value-head flag are this run's."""
    with safe_open(saved_dirs(root, 0, tp_rank=0)[0] / "model.safetensors", "pt") as f:
        padded = f.get_slice(EMBEDDING).get_shape()[0] * sizes["tp"]
    return replace(layout, tp=sizes["tp"], pp=sizes["pp"], ep=sizes.get("ep", 1), etp=sizes.get("etp", 1),
                   tp_rank=0, pp_rank=0, ep_rank=0, etp_rank=0, padded_vocab=padded)


def _reshard_saved(read, arch: ModelArch, saved: Layout, layout: Layout) -> dict[str, torch.Tensor]:
    """reshard, with `read(expert, rank, pp_rank, name)`: one saved tensor of TP rank `rank`, or
    (`expert`) of EP rank `rank`."""
    return reshard(lambda t, p, name: read(False, t, p, name), arch, saved, layout,
                   read_expert=lambda e, _, p, name: read(True, e, p, name))


def resharded_weights(root: Path, arch: ModelArch, saved: Layout, layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's model shard cut from every saved rank's `model.safetensors`, lazily."""
    files = {}

    def read(expert: bool, rank: int, pp_rank: int, name: str) -> torch.Tensor:
        if (expert, rank, pp_rank) not in files:
            directory = _tensor_dirs(root, saved, expert, rank, pp_rank, "model.safetensors")[0]
            files[expert, rank, pp_rank] = safe_open(directory / "model.safetensors", "pt")
        return files[expert, rank, pp_rank].get_tensor(name)

    return _reshard_saved(read, arch, saved, layout)


def allocate_states(optimizer) -> None:
    """Gives each distributed optimizer, not yet stepped, its Adam states (for load_resharded_states
    to set): Megatron allocates them when it loads param groups, here its own. A MoE at EP 1 has
    one optimizer and at EP > 1 a second for the experts, so the saved groups need not fit."""
    for one in distributed_optimizers(optimizer):
        groups = [{k: v for k, v in group.items() if k != "params"} | {"step": 0} for group in one.optimizer.param_groups]
        one.load_state_dict({"optimizer": {"param_groups": groups}})


@torch.no_grad()
def load_resharded_states(optimizer, names: dict, root: Path, arch: ModelArch, saved: Layout, layout: Layout) -> None:
    """Sets this rank's masters and moments, in each optimizer of a chained one, from a checkpoint
    of another TP/PP/EP (and any DP): each saved tensor's flat pieces (written by the DP ranks
    that held it, into whichever directories, by any of the saved optimizers) are joined into the
    whole tensor, re-sharded to this layout per state (`param`, `exp_avg`, `exp_avg_sq`), and
    this DP rank's range cut out."""
    pieces, shapes = {}, {}

    def whole(expert: bool, rank: int, pp_rank: int, name: str) -> dict[str, torch.Tensor]:
        key = expert, rank, pp_rank
        if key not in pieces:
            files = [f for d in _tensor_dirs(root, saved, expert, rank, pp_rank, "optim_dp_*.pt")
                     for f in sorted(d.glob("optim_dp_*.pt"))]
            pieces[key] = _pieces_by_name(files)
            model = _tensor_dirs(root, saved, expert, rank, pp_rank, "model.safetensors")[0] / "model.safetensors"
            with safe_open(model, "pt") as f:
                shapes[key] = {k: f.get_slice(k).get_shape() for k in f.keys()}
        shape = shapes[key][name]
        states = _cut(pieces[key][DDP_PREFIX + name], 0, int(torch.Size(shape).numel()))
        return {k: v if v.dim() == 0 else v.reshape(shape) for k, v in states.items()}

    first = whole(False, 0, 0, EMBEDDING)  # the keys every piece has, and Adam's step (the same everywhere)
    states = {key: _reshard_saved(lambda *at: whole(*at)[key], arch, saved, layout) for key in first if key != "step"}
    for one in optimizers(optimizer):
        _give_each_its_own_step(one)
        for param in _shard_params(one, names):
            start, end = _owned_range(one, param)
            name = names[param][len(DDP_PREFIX):]
            mine = {key: states[key][name].reshape(-1)[start:end] for key in states}
            _set_states(one, param, mine | ({} if "step" not in first else {"step": first["step"].clone()}))
