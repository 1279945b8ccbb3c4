"""LoRA adapters on Megatron's tensor-parallel linear layers: y = W·x + (alpha/rank)·B·A·x, W frozen.

Split over TP as the base weight is:
- column-parallel (`linear_qkv`, `linear_fc1`; the output split): A (r, in) is replicated and
  B (out/TP, r) split by rows. The rank-r activation A·x enters the TP region as the layer's input
  does: identity forward, its gradient summed over TP (each rank's B sees its rows only).
- row-parallel (`linear_proj`, `linear_fc2`; the input split): A (r, in/TP) is split by columns and
  B (out, r) replicated. A·x is summed over TP before B, as the layer's output is.
One adapter sits on a fused layer: q, k and v (gate and up) share its A, each with its own rows
of B, which is how PEFT's separate q/k/v adapters hold it (`adapter_tensors`).

B starts at zero, so the first forward is the base's exactly; A starts as peft's does
(kaiming-uniform with a = √5: U(±1/√in)), drawn by `init_adapters` from a generator seeded by the
layer and the target, so that every TP rank and every layout holds the same A.
The adapters are parameters of the base layer itself (`linear_qkv.lora_A`): the base's names do
not change, so HF conversion, checkpoints and `load_hf` see the same weights as without LoRA.
No dropout: the actor's log-probs would then differ from what the engines sampled with.
"""
import contextlib
import hashlib
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from orz.models.spec import LORA_COLUMN_TARGETS, LoraSpec

ADAPTER_NAMES = ("lora_A", "lora_B")


def is_adapter(name: str) -> bool:
    """Whether a parameter's (or state dict key's) dotted name is an adapter matrix."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


class _Adapter:
    """What both parallel kinds share: the two matrices, their scaling and the switch."""

    def _add_adapter(self, lora: LoraSpec, in_local: int, out_local: int, split: str) -> None:
        """`split`: the matrix split over TP ("lora_B" by rows, or "lora_A" by columns), marked as
        Megatron marks its split weights, so that the gradient norm sums it over TP ranks (and
        counts the replicated one once)."""
        if self.config.sequence_parallel:
            raise NotImplementedError("LoRA adapters take the full sequence (sequence parallelism is not built)")
        dtype = self.config.params_dtype
        self.lora_A = torch.nn.Parameter(torch.zeros(lora.rank, in_local, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, lora.rank, dtype=dtype))
        set_tensor_model_parallel_attributes(getattr(self, split), is_parallel=True, dim=int(split == "lora_A"), stride=1)
        self.lora_scaling = lora.scaling
        self.lora_on = True

    def _sharded(self, prefix, sharded_offsets, metadata, axes: dict) -> dict:
        """The base's sharded state with the adapter's split matrix sharded along its TP axis."""
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])


class LoraColumnParallelLinear(_Adapter, ColumnParallelLinear):
    """A column-parallel layer with an adapter: A replicated, B split by output rows."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoraSpec, fc1: bool = False, **kwargs):
        """fc1: a SwiGLU's linear_fc1, whose rank r holds [gate_r; up_r] (B's rows too)."""
        super().__init__(input_size, output_size, **kwargs)
        assert not self.gather_output, "the adapter adds to this rank's output rows"
        self._add_adapter(lora, input_size, self.output_size_per_partition, split="lora_B")
        self.swiglu = fc1 and self.config.gated_linear_unit

    def forward(self, input_):
        """Megatron's column-parallel forward (its input's gradient summed over TP), through autograd's
        own linear: Megatron's keeps the input for a weight gradient that a frozen weight never takes."""
        bias = None if self.skip_bias_add else self.bias
        output = F.linear(copy_to_tensor_model_parallel_region(input_, group=self.tp_group), self.weight, bias)
        if self.lora_on:
            low = copy_to_tensor_model_parallel_region(F.linear(input_, self.lora_A), group=self.tp_group)
            output = output + self.lora_scaling * F.linear(low, self.lora_B)
        return output, self.bias if self.skip_bias_add else None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """B split by rows; a SwiGLU's B as Megatron cuts its fc1 weight ([gate_r; up_r] per rank,
        its MLP's `apply_swiglu_sharded_factory`), so that it loads at another TP."""
        state = self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0, "lora_B": 0})
        if self.swiglu:
            key = f"{prefix}lora_B"
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets,
                                                      metadata.get("singleton_local_shards", False),
                                                      tp_group=self.tp_group, dp_group=metadata["dp_cp_group"])
        return state


class LoraRowParallelLinear(_Adapter, RowParallelLinear):
    """A row-parallel layer with an adapter: A split by input columns, B replicated."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoraSpec, **kwargs):
        super().__init__(input_size, output_size, **kwargs)
        self._add_adapter(lora, self.input_size_per_partition, output_size, split="lora_A")

    def forward(self, input_):
        """Megatron's row-parallel forward (its output summed over TP), through autograd's own linear
        (as the column-parallel one)."""
        output = reduce_from_tensor_model_parallel_region(F.linear(input_, self.weight), group=self.tp_group)
        if self.lora_on:
            low = reduce_from_tensor_model_parallel_region(F.linear(input_, self.lora_A), group=self.tp_group)
            output = output + self.lora_scaling * F.linear(low, self.lora_B)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 1, "lora_A": 1})


def adapted(target: str, lora: LoraSpec) -> ModuleSpec:
    """The layer spec of `target` with an adapter, in place of Megatron's plain linear layer."""
    if target in LORA_COLUMN_TARGETS:
        return ModuleSpec(module=LoraColumnParallelLinear, params={"lora": lora, "fc1": target == "linear_fc1"})
    return ModuleSpec(module=LoraRowParallelLinear, params={"lora": lora})


def adapter_layers(module: torch.nn.Module):
    """(name, layer) of every adapted layer, in the module's order."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, _Adapter)]


def freeze_base(module: torch.nn.Module) -> None:
    """Every weight but the adapters' stops taking gradients: Megatron's DDP gives frozen weights
    no gradient buffer and its optimizer no states."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter(name))


def init_adapters(module: torch.nn.Module, first_layer: int) -> None:
    """A ~ U(±1/√in) over the full input (peft's init), the same on every rank and at every layout
    (seeded by the global layer and the target); B = 0. `first_layer`: this stage's first."""
    with torch.no_grad():
        for name, layer in adapter_layers(module):
            local, target = _layer_and_target(name)
            key = f"{local + first_layer}/{target}".encode()
            generator = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
            tp, rank = layer.tp_group.size(), layer.tp_group.rank()
            row_parallel = isinstance(layer, LoraRowParallelLinear)
            full_in = layer.lora_A.shape[1] * (tp if row_parallel else 1)
            bound = 1 / math.sqrt(full_in)
            full = torch.empty(layer.lora_A.shape[0], full_in).uniform_(-bound, bound, generator=generator)
            layer.lora_A.copy_(full.chunk(tp, dim=1)[rank] if row_parallel else full)
            layer.lora_B.zero_()


def _layer_and_target(name: str) -> tuple[int, str]:
    """`decoder.layers.3.self_attention.linear_qkv` -> (3, "linear_qkv")."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]), parts[-1]


@contextlib.contextmanager
def adapters_off(module: torch.nn.Module):
    """The base model's forward (the reference of a LoRA run), the adapters back on after."""
    layers = [layer for _, layer in adapter_layers(module)]
    for layer in layers:
        layer.lora_on = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_on = True
