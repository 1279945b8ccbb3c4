"""How a Megatron model is built, as one frozen value: its parallel sizes, numerics, heads, MoE
settings, log-prob chunking and optimizer (None for a frozen model).

megatron-core builds a model from a config and a layer spec; orz's ModelSpec is the one object a
role's model is made from. `orz.run.role_spec` builds it once from the run's config; the parallel
setup (`orz.models.parallel.init_model_parallel`), `transformer_config` and `MegatronModel` take it
whole, and checkpoints record its sizes. Imports no torch (the planner reads `Sizes`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def smallest_dp(tp: int, ep: int, etp: int) -> int:
    """The smallest DP at which ep·etp divides tp·dp (Megatron carves the experts' groups out of
    each stage's TP × DP ranks): lcm(tp, ep·etp) / tp."""
    return math.lcm(tp, ep * etp) // tp


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """A model's parallel sizes: tp·pp·cp·dp workers, one GPU each; its experts' groups (ep·etp
    GPUs) are carved out of the tp·cp·dp ranks of each pipeline stage, as in Megatron."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def workers(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def label(self) -> str:
        """`TP2 PP1 DP4`, with ` CP2` and ` EP4 ETP2` where they are not 1."""
        experts = f" EP{self.ep}" + (f" ETP{self.etp}" if self.etp > 1 else "") if self.ep * self.etp > 1 else ""
        context = f" CP{self.cp}" if self.cp > 1 else ""
        return f"TP{self.tp} PP{self.pp}{context} DP{self.dp}{experts}"

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def of(cls, holder) -> Sizes:
        """The sizes of anything with tp, pp, cp, dp, ep and etp attributes (a RoleConfig)."""
        return cls(**{name: getattr(holder, name) for name in ("tp", "pp", "cp", "dp", "ep", "etp")})


@dataclass(frozen=True, kw_only=True)
class OptimSpec:
    """Adam with decoupled weight decay, clipped by the global gradient norm. A stage may change the
    rates, betas and clip later (MegatronWorker.configure); the distributed optimizer is fixed."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # max global gradient norm
    use_distributed_optimizer: bool = False  # ZeRO-1: fp32 masters and Adam moments sharded over DP


# The linear layers an adapter may sit beside, in Megatron's names (HF's in docs/lora.md):
# column-parallel (output split over TP) and row-parallel (input split).
LORA_COLUMN_TARGETS = ("linear_qkv", "linear_fc1")  # q, k, v / gate, up
LORA_ROW_TARGETS = ("linear_proj", "linear_fc2")  # o / down
LORA_TARGETS = LORA_COLUMN_TARGETS + LORA_ROW_TARGETS


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Low-rank adapters beside frozen linear layers: y = W·x + (alpha/rank)·B·A·x (orz/models/lora.py)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = LORA_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    sizes: Sizes = Sizes()
    dtype: str = "auto"  # "auto" (bfloat16 on GPU, float32 on CPU) or a torch dtype's name: "bfloat16"
    recompute: bool = False  # full activation recompute of every layer
    deterministic: bool = False  # Megatron's deterministic mode (GPU kernels; on CPU a hybrid's is always on)
    vocab_divisible_by: int = 1  # embedding and LM head padded to a multiple (of this × TP)
    value_head: bool = False  # a scalar head instead of the LM head
    moe_aux_loss_coef: float = 0.0  # the load-balancing loss's weight (a trained MoE's)
    moe_dispatcher: str = "allgather"  # Megatron's token dispatcher (config.MOE_DISPATCHERS)
    routing_replay: bool = False  # the routers take given routes, and report what they chose (models/routing.py)
    logprob_chunk_tokens: int = 0  # tokens whose logits are held at once in log-prob passes; 0: the default
    optim: OptimSpec | None = None  # None: a frozen model (forward only)
    lora: LoraSpec | None = None  # adapters, the only trained weights; None: every weight trains

    @property
    def trained(self) -> bool:
        return self.optim is not None
