"""A Megatron model's checkpoint, with its optimizer, in Megatron's own format: dist_checkpointing's
torch_dist, as Megatron-LM, verl, slime and NeMo-RL write it.

    save(megatron_model, directory, meta, hf_config)   # every rank of the model's world; an empty directory
    meta = load(megatron_model, directory)     # every rank, at any TP/PP/DP/EP the re-sharding rules below allow
    request = save(..., asynchronous=True); saves = PendingSaves(); saves.add(request); saves.finish()  # GPU

A directory holds Megatron's files (`.metadata`, `__R_0.distcp`, `common.pt`, `metadata.json`) and
`orz_checkpoint.json`: the HF config, the layout it was saved at, the optimizer and its sharding, and
the caller's small state (`meta`, e.g. the scheduler's step count). Tensors are keyed by Megatron's
global names with their global shapes, so Megatron re-shards them at load for any layout; CPU
(local layers) and GPU (Transformer Engine) write the same keys.

The distributed optimizer's state is the costly part, and Megatron offers two cuts of it:
- `dp_reshardable` (saved here): each rank writes its own flat shard, fully in parallel, with no
  gather; it loads at another DP size but the same TP, PP, EP and ETP.
- `fully_reshardable`: the same states in the model's own shapes, gathered on each model-parallel
  group's DP rank 0 (over gloo, in Megatron's memory-efficient mode) at save; loads at any layout.
A resume at another model-parallel layout first re-cuts a `dp_reshardable` checkpoint into a
`fully_reshardable` one at its own layout (`recut`, on workers of the saved layout), once. Without
the distributed optimizer, the states are saved in the model's shapes and load at any layout.
"""
from __future__ import annotations

import contextlib
import json
import queue
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_content_metadata
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from orz.models.arch import ModelConfigError
from orz.models.lora import is_adapter
from orz.models.checkpoint import (
    FAST,
    MEGATRON_META,
    RESHARDABLE,
    NeedsRecut,
    describe,
    model_parallel,
    read_megatron_meta,
    recut_dir,
)

_SHARDING_KEY = "distrib_optim_sharding_type"  # where Megatron-LM records the cut (content metadata)


def layout_sizes(megatron_model) -> dict[str, int]:
    """The sizes a checkpoint records, the model's groups'; tp, pp, ep and etp decide what loads
    where, dp does not (nor cp: its ranks hold copies of the weights, as DP replicas do)."""
    return megatron_model.sizes.as_dict()


def chain(optimizer) -> list:
    """The optimizers inside a Megatron optimizer: a MoE at EP > 1 (or ETP ≠ TP) steps its experts
    with a second one, and a ChainedOptimizer holds both."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def optimizer_kind(megatron_model) -> str | None:
    """None (no optimizer: a reference model), "distributed" (ZeRO-1) or "plain"."""
    if megatron_model.optimizer is None:
        return None
    return "distributed" if any(isinstance(o, DistributedOptimizer) for o in chain(megatron_model.optimizer)) else "plain"


def _state(megatron_model, loading: bool, sharding: str, with_optimizer: bool, with_rng: bool) -> dict:
    """The sharded state dict of the model, its optimizer and this rank's RNG."""
    model = megatron_model.module.sharded_state_dict()
    if megatron_model.spec.lora is not None:  # the frozen base is its HF directory's (lora_base in the meta)
        model = {key: value for key, value in model.items() if is_adapter(key)}
    state = {"model": model}
    if with_optimizer and megatron_model.optimizer is not None:
        # Keys without the chain's `chained_i.` prefix, so that the model-shaped cuts are the same
        # whether the experts have an optimizer of their own or not (EP 1 against EP > 1).
        metadata = {"chained_optim_avoid_prefix": True}
        if optimizer_kind(megatron_model) == "distributed":  # memory-efficient: gathered over gloo on DP rank 0 only
            metadata |= {_SHARDING_KEY: sharding, "distrib_optim_fully_reshardable_mem_efficient": True}
        state["optimizer"] = megatron_model.optimizer.sharded_state_dict(model, is_loading=loading, metadata=metadata)
    if with_rng:  # per rank: it loads only where the world is laid out as it was saved
        world, rank = dist.get_world_size(), dist.get_rank()
        state["rng"] = ShardedObject("orz.rng_state", torch.get_rng_state(), (world,), (rank,), replica_id=0)
    return state


def save(megatron_model, directory: str | Path, meta: dict, hf_config: dict, sharding: str = FAST,
         asynchronous: bool = False):
    """Writes the model, its optimizer (in `sharding`'s cut) and each rank's RNG into `directory`
    (made if missing; it must be empty), then rank 0 writes orz_checkpoint.json: `meta` plus what
    `load` checks. asynchronous (GPU): returns Megatron's AsyncRequest, whose finalisation (once
    every rank's files are written: PendingSaves) writes orz_checkpoint.json; else None, when done."""
    directory = Path(directory)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    kind = optimizer_kind(megatron_model)
    record = {"format": "torch_dist", "hf_config": hf_config, "layout": layout_sizes(megatron_model),
              "padded_vocab": megatron_model.layout.padded_vocab, "value_head": megatron_model.layout.value_head,
              "dtype": str(megatron_model.config.params_dtype).removeprefix("torch."), "optimizer": kind,
              "chained": len(chain(megatron_model.optimizer)) if kind else 0,
              "optimizer_sharding": sharding if kind == "distributed" else None} | meta

    def write_meta():
        if dist.get_rank() == 0:
            (directory / MEGATRON_META).write_text(json.dumps(record, indent=1))

    # "mcore": Megatron's own background writer (its default, "nvrx", needs nvidia-resiliency-ext)
    background = {"async_sharded_save": True, "async_strategy": "mcore"} if asynchronous else {}
    with contextlib.nullcontext() if asynchronous else _results_in_this_process():
        request = dist_checkpointing.save(_state(megatron_model, False, sharding, True, True), str(directory),
                                          content_metadata={_SHARDING_KEY: sharding}, **background)
    if asynchronous:  # untested here: GPU only (tests/gpu)
        request.add_finalize_fn(write_meta)
        return request
    dist.barrier()
    write_meta()
    dist.barrier()
    return None


@contextlib.contextmanager
def _results_in_this_process():
    """A synchronous save writes its files in this process (Megatron's `execute_sync`), yet Megatron
    collects the writers' results through a `multiprocessing.Manager` queue made on the first save:
    a spawned process that imports torch to unpickle them, ~4 s of every run's first checkpoint on
    two cores. An in-process queue serves it; the Manager's stays for asynchronous saves."""
    kept = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = kept


class PendingSaves:
    """This rank's asynchronous saves in flight (GPU; untested here): `add` an AsyncRequest that
    `save` returned, `finish` waits until every rank's files are written and finalises them."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()

    def add(self, request) -> None:
        self.queue.schedule_async_request(request)

    def finish(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)


def _check_shapes(state: dict, directory: Path) -> None:
    """Refuses a checkpoint of another model before any weight is read: the first tensor whose
    global shape differs from this model's, by Megatron name."""
    saved = dist_checkpointing.load_tensors_metadata(str(directory))
    for key, tensor in _sharded_tensors(state["model"]):
        # Megatron loads the rows both share of a vocabulary padded to another size (another TP)
        first = 1 if tensor.allow_shape_mismatch else 0
        if key in saved and tuple(saved[key].global_shape)[first:] != tuple(tensor.global_shape)[first:]:
            raise ModelConfigError(f"{directory}: {key} was saved with shape {tuple(saved[key].global_shape)}, "
                                   f"this model has {tuple(tensor.global_shape)}: a checkpoint of another model")


def _sharded_tensors(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _sharded_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _sharded_tensors(value)
    elif isinstance(tree, ShardedTensor):
        yield tree.key, tree


def load(megatron_model, directory: str | Path, with_optimizer: bool = True, adjust_optimizer=None) -> dict:
    """Loads what `save` wrote into `megatron_model` (weights; with_optimizer: masters, moments, param
    groups), re-sharded by Megatron to this layout; returns orz_checkpoint.json. The RNG comes
    back where the world is laid out as saved. adjust_optimizer(state) may edit the optimizer's
    loaded param groups (a stage's LR) before they are set. NeedsRecut: a `dp_reshardable`
    checkpoint at another model-parallel layout, not yet re-cut (`recut`); ModelConfigError: one this model cannot take."""
    directory = Path(directory)
    meta = read_megatron_meta(directory)
    mine, kind = layout_sizes(megatron_model), optimizer_kind(megatron_model) if with_optimizer else None
    if kind is not None and meta["optimizer"] not in (None, kind):
        raise ModelConfigError(f"{directory}: saved with the {meta['optimizer']} optimizer, this run has the {kind} "
                               "one (<role>.use_distributed_optimizer): resume as it was saved")
    if kind is not None and meta["optimizer"] is None:
        raise ModelConfigError(f"{directory}: holds weights only (no optimizer state) and cannot be resumed; "
                               "start a run from it instead")
    sharding = load_content_metadata(str(directory)) or {}
    sharding = sharding.get(_SHARDING_KEY, FAST)
    same_model_parallel = model_parallel(meta["layout"]) == model_parallel(mine)
    if kind == "distributed" and sharding == FAST and not same_model_parallel:
        if (recut_dir(directory) / MEGATRON_META).is_file():
            return load(megatron_model, recut_dir(directory), with_optimizer, adjust_optimizer)
        raise NeedsRecut(f"{directory}: saved at {describe(meta['layout'])} in Megatron's dp_reshardable cut, "
                         f"which loads at another DP only; this run has {describe(mine)}")
    state = _state(megatron_model, True, sharding, kind is not None, with_rng=meta["layout"] == mine)
    _check_shapes(state, directory)
    loaded = dist_checkpointing.load(state, str(directory))
    _load_model_state(megatron_model, loaded["model"])
    if kind is None:
        megatron_model.refresh_masters()
    elif meta["chained"] == len(chain(megatron_model.optimizer)):
        if adjust_optimizer is not None:
            adjust_optimizer(loaded["optimizer"])
        with torch.no_grad():  # the fp32 masters are leaves that require grad
            megatron_model.optimizer.load_state_dict(loaded["optimizer"])
    else:
        _load_into_another_chain(megatron_model.optimizer, loaded["optimizer"], meta["chained"])
    if "rng" in loaded:
        torch.set_rng_state(loaded["rng"])
    return meta


def _load_model_state(megatron_model, state: dict) -> None:
    """The loaded weights into the model: all of them, or a LoRA model's adapters (its base stays
    as loaded from the HF directory)."""
    missing, unexpected = megatron_model.module.load_state_dict(state, strict=megatron_model.spec.lora is None)
    adapters_missing = [key for key in missing if is_adapter(key)]
    if adapters_missing or unexpected:
        raise ModelConfigError(f"a LoRA checkpoint without adapters {adapters_missing[:3]} or with other weights "
                               f"{unexpected[:3]}")


@torch.no_grad()  # the fp32 masters are leaves that require grad
def _load_into_another_chain(optimizer, loaded: dict, saved_chain: int) -> None:
    """An optimizer state saved by a chain of another length (a MoE moved between EP 1 and EP > 1,
    where Megatron gives the experts an optimizer of their own). Its model-shaped tensors came back
    by key into this chain's places; its param groups, kept per optimizer, cannot follow: each
    optimizer takes its own, with the saved Adam step."""
    live = chain(optimizer)
    step = _saved_step(loaded[0] if saved_chain > 1 else loaded)
    for i, one in enumerate(live):
        entry = loaded[i] if len(live) > 1 else loaded
        if isinstance(one, DistributedOptimizer):
            groups = one.state_dict()["optimizer"]
            for group in groups["param_groups"]:
                group["step"] = step
            one.load_state_dict({"optimizer": groups, "param_state": entry["param_state"],
                                 "param_state_sharding_type": RESHARDABLE})
            continue
        groups = one.optimizer.state_dict()["param_groups"]  # torch's, as the plain optimizers keep them
        if "fp32_from_fp16_params" in entry:  # mixed precision: the fp32 masters beside the moments
            one.load_state_dict({"optimizer": {"state": entry["optimizer"]["state"] | {"common_step": step},
                                               "param_groups": groups},
                                 "fp32_from_fp16_params": entry["fp32_from_fp16_params"]})
        else:
            one.load_state_dict({"state": entry["state"] | {"common_step": step}, "param_groups": groups})


def _saved_step(common: dict):
    """The Adam step in a saved optimizer's common state: the distributed optimizer keeps it in its
    param groups, the plain ones as `common_step` beside the per-parameter states."""
    if "param_state_sharding_type" in common:
        return common["optimizer"]["param_groups"][0]["step"]
    return (common["optimizer"] if "fp32_from_fp16_params" in common else common)["state"]["common_step"]


def recut(megatron_model, source: str | Path) -> Path:
    """Re-saves a `dp_reshardable` checkpoint in the `fully_reshardable` cut beside it, on workers of
    its own TP/PP/EP/ETP (any DP): what a resume at another model-parallel layout loads."""
    target = recut_dir(source)
    meta = load(megatron_model, source)
    save(megatron_model, target, {k: v for k, v in meta.items() if k not in _RECORDED}, meta["hf_config"], RESHARDABLE)
    return target


_RECORDED = ("format", "hf_config", "layout", "padded_vocab", "value_head", "dtype", "optimizer", "chained",
             "optimizer_sharding")


