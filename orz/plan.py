"""Memory and time planner: does a recipe fit a cluster, and how long is one of its iterations?

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/orz_7b_ppo.py \
        model.path=Qwen2.5-7B [actor.tp=4 ...] [--nodes 8] [--json]

The run is the recipe itself (its RECIPE, with key=value overrides as for training): its roles,
parallel sizes, batch and lengths, every stage of it. The cluster file holds only what a recipe
cannot know: the nodes and GPUs, the efficiencies assumed, and the mean lengths that size time.
model.path is a preset (MODELS), an HF model directory or its config.json.

    plans = plan_recipe(cfg, load_cluster(path))   # [(stage label, Plan)]
    problems = check(plan)                         # [] when everything fits

The arithmetic imports no torch, Ray, vLLM or Megatron (only `placement_of` asks the trainer's
run_rules which roles exist), so the Slurm launcher can refuse a run before it allocates GPUs.
Memory is bytes per GPU on the heaviest pipeline stage of each role; every formula is in the
docstring of the function that computes it. Exit codes: 0 fits, 1 does not fit (the message names
the role, its largest component and the recipe overrides that would make it fit), 2 bad input.
"""
import argparse
import json
import math
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

import yaml

from orz.config import ConfigError, ExperimentConfig, from_dict, load_config, load_recipe, stage_configs
from orz.models.arch import Llama3Rope, ModelArch, ModelConfigError, arch_from_dict, read_arch

GIB = 2**30
BF16, FP32 = 2, 4
MEGATRON_VOCAB_MULTIPLE = 1  # orz.models.builder pads the vocabulary to a multiple of TP only
VLLM_VOCAB_MULTIPLE = 64  # vLLM pads embedding and LM head to 64 rows per TP rank


class PlanError(ConfigError):
    """A run that cannot be placed at all (sizes that do not divide); lists every problem found."""


def _qwen2(**numbers) -> ModelArch:
    shared = dict(family="qwen2", head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072)
    return ModelArch(**(shared | numbers))


def _qwen3(**numbers) -> ModelArch:
    shared = dict(family="qwen3", head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
                  vocab_size=151936, num_kv_heads=8, tie_word_embeddings=False)
    return ModelArch(**(shared | numbers))


# From the published config.json files; `ModelArch.num_params` gives 7.62B, 32.76B, 1.54B, 0.49B, 8.03B,
# 8.19B, 32.76B.
MODELS = {
    "Qwen2.5-0.5B": _qwen2(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                           num_heads=14, num_kv_heads=2, tie_word_embeddings=True, head_dim=64,
                           max_position_embeddings=32768),
    "Qwen2.5-1.5B": _qwen2(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                           num_heads=12, num_kv_heads=2, tie_word_embeddings=True),
    "Qwen2.5-7B": _qwen2(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                         num_heads=28, num_kv_heads=4, tie_word_embeddings=False),
    "Qwen2.5-32B": _qwen2(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                          num_heads=40, num_kv_heads=8, tie_word_embeddings=False, rms_norm_eps=1e-5),
    # Its llama3 RoPE scaling changes neither memory nor FLOPs; kept so that the preset equals what
    # the trainer reads from the model's config.json.
    "Llama-3.1-8B": ModelArch(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=131072,
                              rope_scaling=Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_max_position_embeddings=8192)),
    "Qwen3-8B": _qwen3(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32),
    "Qwen3-32B": _qwen3(hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64),
}


@dataclass(frozen=True)
class GPU:
    tflops: float  # dense bf16 peak, TFLOP/s (datasheet, without sparsity)
    hbm_tb_s: float  # peak HBM bandwidth, TB/s


# Memory is the cluster's gpu_mem_gib, as nvidia-smi reports it: A100 80 GB 80.0 GiB, H100/H800 79.6 GiB
# (81559 MiB), H200 140.4 GiB (143771 MiB).
GPUS = {
    "A100": GPU(tflops=312, hbm_tb_s=2.039),  # SXM 80 GB
    "H100": GPU(tflops=989, hbm_tb_s=3.35),  # SXM
    "H800": GPU(tflops=989, hbm_tb_s=3.35),  # an H100 with slower NVLink
    "H200": GPU(tflops=989, hbm_tb_s=4.8),
}


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Cluster:
    nodes: int  # Slurm nodes
    gpus_per_node: int  # a TP group must stay inside one node (NVLink)
    gpu_mem_gib: float  # usable memory per GPU; the budget every role is checked against
    gpu: str = "H100"  # a GPUS preset: peak FLOP/s and bandwidth for the time estimate
    reserved_gib: float = 2.0  # per process on a GPU: CUDA context, NCCL buffers, allocator slack
    train_mfu: float = 0.40  # achieved fraction of peak FLOP/s in training, forward passes and prefill
    hbm_efficiency: float = 0.70  # achieved fraction of peak HBM bandwidth in vLLM decode

    def __post_init__(self):
        if self.gpu not in GPUS:
            raise PlanError(f"gpu={self.gpu!r} is not a preset; choose one of {sorted(GPUS)}")
        _require_positive(self, "nodes", "gpus_per_node", "gpu_mem_gib")
        if not (0 < self.train_mfu <= 1 and 0 < self.hbm_efficiency <= 1 and self.reserved_gib >= 0):
            raise PlanError(f"need 0 < train_mfu, hbm_efficiency <= 1 and reserved_gib >= 0, got "
                              f"{self.train_mfu}, {self.hbm_efficiency}, {self.reserved_gib}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class ModelParallel:
    """A Megatron role's sizes, named as in the recipe's RoleConfig."""

    tp: int = 1  # tensor parallel: splits every matmul, needs NVLink
    pp: int = 1  # pipeline stages: splits the layers
    dp: int = 1  # data parallel replicas
    micro_batch_tokens: int = 16384  # tokens per micro-batch (b·s); ORZ packs up to 16384
    sequence_parallel: bool = False  # Megatron SP also splits norms/dropout by TP; orz.models.builder has it off

    def __post_init__(self):
        _require_positive(self, "tp", "pp", "dp", "micro_batch_tokens")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        return f"TP{self.tp} PP{self.pp} DP{self.dp}"


@dataclass(frozen=True)
class TrainParallel(ModelParallel):
    recompute: bool = False  # model.recompute: keep only each layer's input, rerun it in backward
    use_distributed_optimizer: bool = False  # ZeRO-1: fp32 master weights and Adam states sharded over DP


@dataclass(frozen=True)
class Rollout:
    """The vLLM fleet, named as in the recipe's RolloutConfig."""

    num_engines: int  # vLLM engines, each serving an equal share of the samples
    engine_tp: int = 1  # GPUs per engine
    gpu_memory_utilization: float = 0.85  # vLLM's budget as a fraction of GPU memory (weights + KV cache)
    max_num_seqs: int = 256  # sequences an engine decodes at once; its KV cache is sized for them

    def __post_init__(self):
        _require_positive(self, "num_engines", "engine_tp", "max_num_seqs")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def label(self) -> str:
        return f"{self.num_engines}×TP{self.engine_tp}"


@dataclass(frozen=True)
class Placement:
    """Where a run's roles go: what `placement_of(cfg)` reads from the recipe."""

    actor: TrainParallel
    rollout: Rollout
    critic: TrainParallel | None = None  # None for critic-free algorithms (GRPO, RLOO, REINFORCE++)
    ref: ModelParallel | None = None  # None when no KL term needs reference log-probs
    colocate: bool = False  # every role on every GPU, phases taking turns (ORZ's colocate_all)
    offload_idle_roles: bool = False  # colocated: idle roles move their states to CPU and vLLM sleeps

    def megatron_roles(self) -> dict[str, ModelParallel]:
        roles = {"actor": self.actor, "critic": self.critic, "ref": self.ref}
        return {name: par for name, par in roles.items() if par is not None}


@dataclass(frozen=True)
class Workload:
    """One iteration's samples and lengths, named as in the recipe; the means are assumptions."""

    prompts_per_iteration: int = 128  # trainer.prompts_per_iteration
    n_samples: int = 64  # rollout.n_samples: 128 × 64 = 8192 samples
    prompt_max_tokens: int = 2048  # data.prompt_max_tokens; sizes memory with max_new_tokens
    max_new_tokens: int = 8192  # rollout.max_new_tokens
    mean_prompt_tokens: int = 256  # sizes time: tokens actually generated and trained on
    mean_response_tokens: int = 4096  # grows during training; take it from your metrics

    def __post_init__(self):
        _require_positive(self, *(f.name for f in fields(self)))
        if self.mean_prompt_tokens > self.prompt_max_tokens or self.mean_response_tokens > self.max_new_tokens:
            raise PlanError(f"mean lengths ({self.mean_prompt_tokens}, {self.mean_response_tokens}) exceed "
                            f"the maxima ({self.prompt_max_tokens}, {self.max_new_tokens})")

    @property
    def samples(self) -> int:
        return self.prompts_per_iteration * self.n_samples

    @property
    def max_seq_tokens(self) -> int:
        return self.prompt_max_tokens + self.max_new_tokens

    @property
    def mean_seq_tokens(self) -> int:
        return self.mean_prompt_tokens + self.mean_response_tokens


def _require_positive(obj, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise PlanError(f"{name} must be positive, got {getattr(obj, name)}")


# ---------------------------------------------------------------- outputs


@dataclass(frozen=True)
class RoleMemory:
    role: str  # actor | critic | ref | rollout
    gpus: int  # GPUs the role runs on
    parallel: str  # e.g. "TP2 PP1 DP16", for the table
    weights: int  # bytes per GPU, heaviest stage
    grads: int
    optimizer: int
    activations: int  # kept for backward (training) or one layer's working set (forward only), logits included
    kv_cache: int  # vLLM only
    overhead: int  # this process's reserved_gib
    kept_by_others: int  # bytes other colocated processes keep on the same GPU meanwhile
    limit: int  # bytes this role may use on its GPUs
    limit_why: str  # how `limit` was derived, for messages

    COMPONENTS = ("weights", "grads", "optimizer", "activations", "kv_cache", "overhead")

    @property
    def total(self) -> int:
        return sum(getattr(self, c) for c in self.COMPONENTS)

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    @property
    def dominant(self) -> str:
        return max(self.COMPONENTS, key=lambda c: getattr(self, c))


@dataclass(frozen=True)
class Timing:
    rollout_s: float  # prefill + decode on the engines
    forward_s: float  # old log-probs, reference log-probs and values
    train_s: float  # actor and critic updates
    decode_concurrency: int  # sequences each engine decodes at once
    decode_step_ms: float  # one decode step of one engine
    rollout_tokens_per_s: float  # generated tokens per second, whole fleet

    @property
    def iteration_s(self) -> float:
        return self.rollout_s + self.forward_s + self.train_s


@dataclass(frozen=True)
class Plan:
    model: str
    arch: ModelArch
    cluster: Cluster
    placement: Placement
    workload: Workload
    memory: tuple[RoleMemory, ...]
    timing: Timing

    def row(self, role: str) -> RoleMemory:
        return next(r for r in self.memory if r.role == role)


# ---------------------------------------------------------------- parameters


def layer_params(arch: ModelArch, tp: int) -> int:
    """Parameters of one decoder layer on one TP rank.

    attention  q, o: h×(a·d); k, v: h×(g·d)  →  h·d·(2a + 2g)        split by TP
    qkv bias (qwen2)                           d·(a + 2g)             split by TP
    SwiGLU gate, up, down                      3·h·f                  split by TP
    two RMSNorm weights                        2·h                    replicated
    q and k RMSNorm weights (qwen3)            2·d                    replicated
    """
    h, d, a, g = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    split = h * d * (2 * a + 2 * g) + 3 * h * arch.intermediate_size
    if arch.qkv_bias:
        split += d * (a + 2 * g)
    return split // tp + 2 * h + (2 * d if arch.qk_norm else 0)


def stage_params(arch: ModelArch, tp: int, pp: int, head: str, vocab_multiple: int) -> list[int]:
    """Parameters on one TP rank of the first and the last pipeline stage (one stage when pp = 1).

    every stage: L/pp layers. first: + embedding V'·h/t (V' = vocabulary padded to a multiple of
    vocab_multiple·t). last: + final norm h + head: LM head V'·h/t, a copy of the embedding when tied
    and pp > 1 (Megatron keeps both), nothing more when tied and pp = 1; a value head h + 1.
    At t = pp = 1, unpadded, the sum is ModelArch.num_params (+ h + 1 − V·h for a value head).
    """
    h = arch.hidden_size
    layers = arch.num_layers // pp * layer_params(arch, tp)
    vocab = arch.padded_vocab_size(tp, vocab_multiple) * h // tp
    head_params = h + 1 if head == "value" else 0 if arch.tie_word_embeddings and pp == 1 else vocab
    first, last = layers + vocab, layers + h + head_params
    return [first + last - layers] if pp == 1 else [first, last]


def matmul_params(arch: ModelArch, head: str) -> int:
    """M: weights that take part in a matmul per token: L·(h·d·(2a + 2g) + 3·h·f) + head (V·h or h).

    The embedding is a lookup, norms and biases are negligible.
    """
    h, d = arch.hidden_size, arch.head_dim
    layer = h * d * (2 * arch.num_heads + 2 * arch.num_kv_heads) + 3 * h * arch.intermediate_size
    return arch.num_layers * layer + (arch.vocab_size * h if head == "lm" else h)


# ---------------------------------------------------------------- activations and KV cache


def layer_activation_bytes(arch: ModelArch, tokens: int, tp: int, sequence_parallel: bool) -> int:
    """Bytes one decoder layer keeps for backward, bf16, for a micro-batch of T = b·s tokens.

    Korthikanti et al. 2022 (GPT: multi-head attention, 4h GeLU MLP, dropout) keep
    s·b·h·(34 + 5·a·s/h) per layer; with TP and no sequence parallelism s·b·h·(10 + 24/t + 5·a·s/(h·t)),
    with sequence parallelism all of it / t. Adapted to Llama/Qwen2 as trained here:
      - flash attention keeps no s×s matrices, so 5·a·s/h goes; no dropout, so its two s·b·h masks go;
      - GQA: attention keeps its input 2·T·h, Q 2·T·a·d, K and V 4·T·g·d, the context 2·T·a·d (o's input);
      - SwiGLU of width f keeps its input 2·T·h, gate and up 4·T·f (silu is recomputed in the fused
        kernel) and their product 2·T·f (down's input);
      - the two RMSNorms keep their inputs, 4·T·h.
    Total T·(8h + 4·a·d + 4·g·d + 6f). Check: with a·d = g·d = h, an ungated MLP (4f for 6f) and f = 4h
    it is 32·T·h, Korthikanti's 34 less the two masks; Megatron-LM's theoretical_memory_usage keeps
    s·b·h·(18 + 4f/h), the same plus the masks. The 8h part (norm inputs and the copies entering
    column-parallel linears) is split by t only with sequence parallelism; the rest always.
    With packing every term is linear in T.
    """
    h, ad, gd = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    replicated = tokens * 8 * h // (tp if sequence_parallel else 1)
    return replicated + tokens * (4 * ad + 4 * gd + 6 * arch.intermediate_size) // tp


def logits_bytes(arch: ModelArch, tokens: int, tp: int, training: bool) -> int:
    """Vocab-parallel logits of one micro-batch, T·V'/t entries (orz.models.logprobs).

    bf16 logits (2) + fp32 temperature-scaled copy (4) + fp32 exp (4), + their fp32 gradient in
    backward (4): 14 bytes per entry when training, 10 forward-only.
    """
    entries = tokens * arch.padded_vocab_size(tp, MEGATRON_VOCAB_MULTIPLE) // tp
    return entries * (14 if training else 10)


def kv_bytes_per_token(arch: ModelArch, tp: int) -> int:
    """K and V of every layer for one token on one GPU of an engine: 2·L·max(g/t, 1)·d·2 bytes.

    With t > g vLLM replicates KV heads, so each GPU still holds one.
    """
    return 2 * arch.num_layers * max(arch.num_kv_heads // tp, 1) * arch.head_dim * BF16


# ---------------------------------------------------------------- memory per role


def train_memory(arch: ModelArch, par: TrainParallel, head: str) -> dict[str, int]:
    """Bytes per GPU of a trained role (actor: LM head; critic: value head) on its heaviest stage.

    P = that stage's parameters on one TP rank (stage_params); bf16 mixed precision as in Megatron:
      weights      2·P      bf16 parameters
      grads        4·P      fp32 main gradients (accumulated and reduced in fp32)
      optimizer   12·P      fp32 master weights + Adam m + v; 12·P/DP with the distributed optimizer
                            (Megatron's 18, or 6 + 12/DP, bytes per parameter)
      activations n·(L/pp)·A(T)                          without recompute
                  n·(L/pp)·2·T·h/t_sp + A(T)             full recompute: each layer's input, plus one
                                                         layer re-materialised during its backward
                  + logits on the last stage (LM head only)
    A(T) = layer_activation_bytes; n = micro-batches in flight under 1F1B: pp on the first stage,
    1 on the last (Korthikanti et al. §4.2); t_sp = t with sequence parallelism, else 1.
    """
    t, pp = par.tp, par.pp
    layer = layer_activation_bytes(arch, par.micro_batch_tokens, t, par.sequence_parallel)
    layer_input = 2 * par.micro_batch_tokens * arch.hidden_size // (t if par.sequence_parallel else 1)
    stages = stage_params(arch, t, pp, head, MEGATRON_VOCAB_MULTIPLE)
    candidates = []
    for index, params in enumerate(stages):
        last = index == len(stages) - 1
        in_flight = 1 if last else pp
        kept = in_flight * (arch.num_layers // pp) * (layer_input if par.recompute else layer)
        activations = kept + (layer if par.recompute else 0)
        if last and head == "lm":
            activations += logits_bytes(arch, par.micro_batch_tokens, t, training=True)
        optimizer = 12 * params // (par.dp if par.use_distributed_optimizer else 1)
        candidates.append(dict(weights=BF16 * params, grads=FP32 * params, optimizer=optimizer,
                               activations=activations))
    return max(candidates, key=lambda c: sum(c.values()))


def forward_memory(arch: ModelArch, par: ModelParallel) -> dict[str, int]:
    """Bytes per GPU of a forward-only role (reference): weights 2·P, activations A(T) + logits.

    Nothing is kept across layers, so the working set is one layer's activations plus the last
    stage's forward-only logits (logits_bytes); the last stage, which holds both, is the heaviest.
    """
    params = stage_params(arch, par.tp, par.pp, "lm", MEGATRON_VOCAB_MULTIPLE)[-1]
    layer = layer_activation_bytes(arch, par.micro_batch_tokens, par.tp, par.sequence_parallel)
    return dict(weights=BF16 * params,
                activations=layer + logits_bytes(arch, par.micro_batch_tokens, par.tp, training=False))


def rollout_concurrency(rollout: Rollout, workload: Workload) -> int:
    """Sequences an engine holds at once: min(max_num_seqs, ⌈samples / num_engines⌉)."""
    return min(rollout.max_num_seqs, -(-workload.samples // rollout.num_engines))


def rollout_memory(arch: ModelArch, rollout: Rollout, workload: Workload) -> dict[str, int]:
    """Bytes per GPU of a vLLM engine: weights 2·P/t (P on one TP rank, vocabulary padded by vLLM)
    and a KV cache for c concurrent sequences of the longest length: c·(prompt + response)·kv_bytes_per_token.
    """
    params = stage_params(arch, rollout.engine_tp, 1, "lm", VLLM_VOCAB_MULTIPLE)[0]
    kv = rollout_concurrency(rollout, workload) * workload.max_seq_tokens * kv_bytes_per_token(arch, rollout.engine_tp)
    return dict(weights=BF16 * params, kv_cache=kv)


def _resident(placement: Placement, role: str, states: dict[str, int], mem: int, reserved: int) -> int:
    """What an idle colocated role keeps on the GPU: its reserved memory, plus, without offload,
    its weights, grads and optimizer states (vLLM, awake: its whole gpu_memory_utilization budget)."""
    if placement.offload_idle_roles:
        return reserved
    if role == "rollout":
        return int(placement.rollout.gpu_memory_utilization * mem)
    return reserved + states.get("weights", 0) + states.get("grads", 0) + states.get("optimizer", 0)


def memory_rows(arch: ModelArch, cluster: Cluster, placement: Placement, workload: Workload) -> tuple[RoleMemory, ...]:
    """One row per role. Separate GPUs: the limit is the GPU's memory. Colocated: the GPU's memory
    less what the other roles keep resident (_resident). vLLM's limit is gpu_memory_utilization × memory."""
    mem, reserved, rollout = int(cluster.gpu_mem_gib * GIB), int(cluster.reserved_gib * GIB), placement.rollout
    roles = {name: (train_memory(arch, par, "value" if name == "critic" else "lm") if isinstance(par, TrainParallel)
                    else forward_memory(arch, par), par.label(), par.gpus)
             for name, par in placement.megatron_roles().items()}
    roles["rollout"] = (rollout_memory(arch, rollout, workload), rollout.label(), rollout.num_engines * rollout.engine_tp)
    others = len(roles) - 1 if placement.colocate else 0
    rows = []
    for role, (own, label, gpus) in roles.items():
        kept = sum(_resident(placement, o, roles[o][0], mem, reserved) for o in roles if o != role) if others else 0
        limit, why = mem - kept, f"{_gib(mem)} GiB"
        if kept:
            why += f" − {_gib(kept)} GiB kept by {others} other colocated process{'es' * (others > 1)}"
        if role == "rollout":
            limit = int(rollout.gpu_memory_utilization * mem)
            why = f"gpu_memory_utilization {rollout.gpu_memory_utilization} × {_gib(mem)} GiB"
        rows.append(RoleMemory(role=role, gpus=gpus, parallel=label,
                               **{c: own.get(c, 0) for c in RoleMemory.COMPONENTS[:-1]},
                               overhead=reserved, kept_by_others=kept, limit=limit, limit_why=why))
    return tuple(rows)


# ---------------------------------------------------------------- time


def forward_flops(arch: ModelArch, tokens: float, seq_len: float, head: str) -> float:
    """FLOPs of one forward pass over `tokens` tokens in sequences of seq_len: 2·M·n + 2·L·a·d·s·n.

    2·M per token for the matmuls (matmul_params); causal attention (QKᵀ and AV over s/2 earlier
    tokens on average) 2·2·a·d·s/2 per token and layer. A backward pass costs twice a forward, so a
    training step is 3× forward, 4× with full recompute.
    """
    attention = 2 * arch.num_layers * arch.num_heads * arch.head_dim * seq_len
    return (2 * matmul_params(arch, head) + attention) * tokens


def rollout_time(arch: ModelArch, cluster: Cluster, rollout: Rollout, workload: Workload) -> tuple[float, int, float]:
    """(seconds, concurrency c, decode step seconds) for one engine's share of the samples.

    prefill: forward_flops of its prompts at train_mfu of the engine's t GPUs (no prefix caching).
    decode, continuous batching at c sequences: n·mean_response / c steps, each
      max(bytes / (hbm_efficiency · bandwidth), flops / (train_mfu · peak)) per GPU, with
      bytes = 2·P/t (weights, read once per step) + c·(mean_prompt + mean_response/2)·kv_bytes_per_token
      flops = c·(2·M + 4·L·a·d·(mean_prompt + mean_response/2))/t.
    """
    gpu = GPUS[cluster.gpu]
    flop_s, byte_s = gpu.tflops * 1e12 * cluster.train_mfu, gpu.hbm_tb_s * 1e12 * cluster.hbm_efficiency
    per_engine = -(-workload.samples // rollout.num_engines)
    c = rollout_concurrency(rollout, workload)
    prefill_tokens = per_engine * workload.mean_prompt_tokens
    prefill = forward_flops(arch, prefill_tokens, workload.mean_prompt_tokens, "lm") / (rollout.engine_tp * flop_s)
    context = workload.mean_prompt_tokens + workload.mean_response_tokens / 2
    weights = BF16 * stage_params(arch, rollout.engine_tp, 1, "lm", VLLM_VOCAB_MULTIPLE)[0]
    read = weights + c * context * kv_bytes_per_token(arch, rollout.engine_tp)
    attention = 4 * arch.num_layers * arch.num_heads * arch.head_dim * context
    step = max(read / byte_s, c * (2 * matmul_params(arch, "lm") + attention) / (rollout.engine_tp * flop_s))
    steps = per_engine * workload.mean_response_tokens / c
    return prefill + steps * step, c, step


def timing(arch: ModelArch, cluster: Cluster, placement: Placement, workload: Workload) -> Timing:
    """Seconds per iteration: rollout, then forward passes, then updates (synchronous RL).

    Role time = FLOPs / (GPUs · peak · train_mfu) over samples·mean_seq_tokens tokens. Forward: actor
    (old log-probs), reference and critic (values). Updates: 3, or 4 with recompute, × forward (one pass over the batch).
    Colocated roles take turns on all GPUs (times add up); separate roles overlap (the slowest counts).
    """
    flop_s = GPUS[cluster.gpu].tflops * 1e12 * cluster.train_mfu
    tokens, s = workload.samples * workload.mean_seq_tokens, workload.mean_seq_tokens
    forward, train = [], []
    for name, par in placement.megatron_roles().items():
        one = forward_flops(arch, tokens, s, "value" if name == "critic" else "lm") / (par.gpus * flop_s)
        forward.append(one)
        if isinstance(par, TrainParallel):
            train.append(one * (4 if par.recompute else 3))
    combine = sum if placement.colocate else max
    rollout_s, c, step = rollout_time(arch, cluster, placement.rollout, workload)
    return Timing(rollout_s=rollout_s, forward_s=combine(forward), train_s=combine(train), decode_concurrency=c,
                  decode_step_ms=step * 1e3,
                  rollout_tokens_per_s=workload.samples * workload.mean_response_tokens / rollout_s)


# ---------------------------------------------------------------- plan and check


def placement_problems(arch: ModelArch, cluster: Cluster, placement: Placement, workload: Workload) -> list[str]:
    """Everything that stops the placement from running at all, whatever the memory; each names the
    recipe's key."""
    problems, total = [], cluster.gpus
    for name, par in placement.megatron_roles().items():
        try:
            arch.check_parallel(par.tp, par.pp)
        except ModelConfigError as err:
            problems.append(f"{name}.{err}")
        if arch.intermediate_size % par.tp:
            problems.append(f"{name}.tp={par.tp} does not divide intermediate_size={arch.intermediate_size}")
        if cluster.gpus_per_node % par.tp:
            problems.append(f"{name}.tp={par.tp} does not divide gpus_per_node={cluster.gpus_per_node} "
                            "(a TP group must stay inside one node)")
        if par.micro_batch_tokens < workload.max_seq_tokens:
            problems.append(f"{name}.micro_batch_tokens={par.micro_batch_tokens} cannot hold the longest sample "
                            f"(data.prompt_max_tokens + rollout.max_new_tokens = {workload.max_seq_tokens})")
        if placement.colocate and par.gpus != total:
            problems.append(f"{name}: TP·PP·DP = {par.tp}·{par.pp}·{par.dp} = {par.gpus} ≠ {total} GPUs "
                            f"(colocated roles each use all {cluster.nodes}×{cluster.gpus_per_node})")
    rollout = placement.rollout
    tp = rollout.engine_tp
    if arch.num_heads % tp or (arch.num_kv_heads % tp and tp % arch.num_kv_heads):
        problems.append(f"rollout.engine_tp={tp} must divide num_attention_heads={arch.num_heads} and divide "
                        f"or be a multiple of num_key_value_heads={arch.num_kv_heads}")
    if cluster.gpus_per_node % tp:
        problems.append(f"rollout.engine_tp={tp} does not divide gpus_per_node={cluster.gpus_per_node}")
    engine_gpus = rollout.num_engines * tp
    if placement.colocate and engine_gpus != total:
        problems.append(f"rollout: num_engines·engine_tp = {rollout.num_engines}·{tp} = {engine_gpus} ≠ {total} "
                        "GPUs (colocated engines use every GPU)")
    if not placement.colocate:
        used = {name: par.gpus for name, par in placement.megatron_roles().items()} | {"rollout": engine_gpus}
        if sum(used.values()) > total:
            parts = " + ".join(f"{name} {n}" for name, n in used.items())
            problems.append(f"GPUs needed: {parts} = {sum(used.values())} > {total} GPUs in the cluster "
                            f"({cluster.nodes} nodes × {cluster.gpus_per_node}); colocate roles or add nodes")
    return problems


def plan(model_arch: ModelArch, cluster: Cluster, placement: Placement, workload: Workload,
         model: str = "model") -> Plan:
    """Memory per GPU for every role and the time of one iteration; raises PlanError listing every
    reason the placement cannot run at all. Whether it fits is check()'s answer."""
    problems = placement_problems(model_arch, cluster, placement, workload)
    if problems:
        raise PlanError("\n".join(problems))
    return Plan(model=model, arch=model_arch, cluster=cluster, placement=placement, workload=workload,
                memory=memory_rows(model_arch, cluster, placement, workload),
                timing=timing(model_arch, cluster, placement, workload))


def _changes(p: Plan, role: str) -> list[tuple[str, Placement]]:
    """Single changes worth trying for a role that does not fit, each as the recipe overrides that
    make it."""
    placement, w = p.placement, p.workload
    if role == "rollout":
        r = placement.rollout
        row = p.row("rollout")
        per_seq = w.max_seq_tokens * kv_bytes_per_token(p.arch, r.engine_tp)
        seqs = (row.limit - row.weights - row.overhead) // per_seq
        options = [(f"rollout.max_num_seqs={seqs}", replace(r, max_num_seqs=seqs))] if seqs >= 1 else []
        if r.num_engines % 2 == 0:
            options.append((f"rollout.engine_tp={2 * r.engine_tp} rollout.num_engines={r.num_engines // 2}",
                            replace(r, engine_tp=2 * r.engine_tp, num_engines=r.num_engines // 2)))
        needed = math.ceil(100 * row.total / (p.cluster.gpu_mem_gib * GIB)) / 100
        if needed <= 0.95:
            options.append((f"rollout.gpu_memory_utilization={needed}", replace(r, gpu_memory_utilization=needed)))
        return [(text, replace(placement, rollout=new)) for text, new in options]
    par = placement.megatron_roles()[role]
    options = []
    if isinstance(par, TrainParallel) and not par.use_distributed_optimizer and par.dp > 1:
        options.append((f"{role}.use_distributed_optimizer=true", replace(par, use_distributed_optimizer=True)))
    if par.dp % 2 == 0:
        options.append((f"{role}.tp={2 * par.tp} {role}.dp={par.dp // 2}", replace(par, tp=2 * par.tp, dp=par.dp // 2)))
        options.append((f"{role}.pp={2 * par.pp} {role}.dp={par.dp // 2}", replace(par, pp=2 * par.pp, dp=par.dp // 2)))
    if par.micro_batch_tokens // 2 >= w.max_seq_tokens:
        options.append((f"{role}.micro_batch_tokens={par.micro_batch_tokens // 2}",
                        replace(par, micro_batch_tokens=par.micro_batch_tokens // 2)))
    changes = [(text, replace(placement, **{role: new})) for text, new in options]
    if isinstance(par, TrainParallel) and not par.recompute:  # model.recompute: every trained role
        trained = {name: replace(other, recompute=True) for name, other in placement.megatron_roles().items()
                   if isinstance(other, TrainParallel)}
        changes.insert(1, ("model.recompute=true", replace(placement, **trained)))
    if placement.colocate and not placement.offload_idle_roles:
        changes.append(("trainer.offload_idle_roles=true", replace(placement, offload_idle_roles=True)))
    return changes


def _replans(p: Plan, role: str) -> list[tuple[str, Plan]]:
    """Plans after each single change of _changes that still makes a valid placement."""
    plans = []
    for text, placement in _changes(p, role):
        try:
            plans.append((text, plan(p.arch, p.cluster, placement, p.workload, p.model)))
        except PlanError:
            continue
    return plans


def _fixes(p: Plan, role: str, most_changes: int = 4) -> list[str]:
    """The single changes after which `role` fits, with its new total. When none does, changes are
    stacked in _changes' order (cheapest for throughput first), each kept if it shrinks the role,
    and the overrides that together make it fit are named."""
    singles = [f"{text} ({_gib(new.row(role).total)} GiB)" for text, new in _replans(p, role) if _fits(new, role)]
    if singles:
        return singles
    applied = {}  # key: value, the latest of each
    for _ in range(most_changes):
        smaller = [(text, new) for text, new in _replans(p, role) if new.row(role).total < p.row(role).total]
        if not smaller:
            return []
        text, p = smaller[0]
        applied |= dict(override.split("=") for override in text.split())
        if _fits(p, role):
            together = " ".join(f"{key}={value}" for key, value in applied.items())
            return [f"{together} together ({_gib(p.row(role).total)} GiB)"]
    return []


def check(p: Plan) -> list[str]:
    """Problems that stop the plan from running, each naming the role, what dominates and the recipe
    overrides that would make it fit."""
    problems = []
    for row in p.memory:
        if row.fits:
            continue
        fixes = _fixes(p, row.role)
        tried = len(_changes(p, row.role))
        advice = ("Would fit with: " + "; ".join(fixes)) if fixes else f"None of {tried} changes tried fits: add GPUs"
        problems.append(f"{row.role} does not fit: {_gib(row.total)} GiB per GPU > {_gib(row.limit)} GiB "
                        f"({row.limit_why}); largest part: {row.dominant} {_gib(getattr(row, row.dominant))} GiB. "
                        f"{advice}.")
    overcommit = _vllm_overcommit(p)
    return problems + [overcommit] if overcommit else problems


def _vllm_overcommit(p: Plan) -> str | None:
    """vLLM refuses to start when its gpu_memory_utilization budget exceeds the free memory beside the
    other colocated processes; the problem when it does."""
    mem, rollout = p.cluster.gpu_mem_gib * GIB, p.row("rollout")
    free = mem - rollout.kept_by_others
    if rollout.limit <= free:
        return None
    return (f"rollout: gpu_memory_utilization {p.placement.rollout.gpu_memory_utilization} asks for "
            f"{_gib(rollout.limit)} GiB but only {_gib(free)} GiB are free beside the other colocated "
            f"processes; set rollout.gpu_memory_utilization={math.floor(100 * free / mem) / 100}")


def _fits(p: Plan, role: str) -> bool:
    return p.row(role).fits and (role != "rollout" or _vllm_overcommit(p) is None)


# ---------------------------------------------------------------- inputs: a recipe and a cluster


def resolve_model(name: str) -> tuple[str, ModelArch]:
    """model.path: a preset name (MODELS), an HF model directory or its config.json."""
    if name in MODELS:
        return name, MODELS[name]
    path = Path(name)
    if path.is_dir():
        return path.name, read_arch(path)
    if path.is_file():
        try:
            return path.parent.name, arch_from_dict(json.loads(path.read_text()), path)
        except (json.JSONDecodeError, AttributeError) as err:
            raise ModelConfigError(f"{path}: not an HF config.json ({err})") from None
    raise ModelConfigError(f"model.path={name!r} is neither a preset ({', '.join(MODELS)}) nor an HF model "
                           "directory or config.json")


@dataclass(frozen=True)
class Means:
    """Lengths a recipe cannot know: they size time only (take them from your run's metrics)."""

    mean_prompt_tokens: int = 256
    mean_response_tokens: int = 4096

    def __post_init__(self):
        _require_positive(self, "mean_prompt_tokens", "mean_response_tokens")


@dataclass(frozen=True)
class ClusterFile:
    """configs/clusters/*.yaml: the cluster, and the workload's mean lengths."""

    cluster: Cluster
    workload: Means = Means()


def load_cluster(path: str | Path | None, **changes) -> ClusterFile:
    """The cluster file (or none), with `changes` (nodes=4, mean_response_tokens=2048, ...; None
    leaves a value) laid over it; unknown and missing keys name the file and the key."""
    where = str(path or "command line")
    tree = {}
    if path:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise PlanError(f"{path}: {err}") from None
        if not isinstance(tree, dict):
            raise PlanError(f"{path}: expected a mapping with sections cluster and workload")
    for key, value in changes.items():
        if value is not None:
            section = "workload" if key in (f.name for f in fields(Means)) else "cluster"
            tree.setdefault(section, {})[key] = value
    try:
        return from_dict(ClusterFile, tree, where)
    except ConfigError as err:
        raise PlanError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None


def placement_of(cfg: ExperimentConfig) -> Placement:
    """The recipe's roles, decided by the trainer's own rule (orz.ppo.run_rules.roles), and their
    sizes. A role split by rows (micro_batch_size) holds that many of the longest samples."""
    from orz.ppo import run_rules  # imports torch: kept out of the arithmetic above

    roles = run_rules.roles(cfg)
    longest = cfg.data.prompt_max_tokens + cfg.rollout.max_new_tokens

    def tokens(role) -> int:
        return role.micro_batch_tokens or role.micro_batch_size * longest

    def trained(role) -> TrainParallel:
        return TrainParallel(tp=role.tp, pp=role.pp, dp=role.dp, micro_batch_tokens=tokens(role),
                             recompute=cfg.model.recompute, use_distributed_optimizer=role.use_distributed_optimizer)

    r, ref = cfg.rollout, roles.get("ref")
    return Placement(
        actor=trained(roles["actor"]), critic=trained(roles["critic"]) if "critic" in roles else None,
        ref=ModelParallel(tp=ref.tp, pp=ref.pp, dp=ref.dp, micro_batch_tokens=tokens(ref)) if ref else None,
        rollout=Rollout(num_engines=r.num_engines, engine_tp=r.engine_tp,
                        gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs),
        colocate=cfg.trainer.colocate,
        offload_idle_roles=cfg.trainer.offload_idle_roles)


def workload_of(cfg: ExperimentConfig, means: Means) -> Workload:
    """The recipe's batch and maximum lengths; the means, capped at those maxima."""
    prompt, response = cfg.data.prompt_max_tokens, cfg.rollout.max_new_tokens
    return Workload(prompts_per_iteration=cfg.trainer.prompts_per_iteration, n_samples=cfg.rollout.n_samples,
                    prompt_max_tokens=prompt, max_new_tokens=response,
                    mean_prompt_tokens=min(means.mean_prompt_tokens, prompt),
                    mean_response_tokens=min(means.mean_response_tokens, response))


def plan_recipe(cfg: ExperimentConfig, cluster: ClusterFile) -> list[tuple[str, Plan]]:
    """(stage label, plan) for every stage of the run (one, labelled "", without stages)."""
    if not cfg.model.path:
        raise PlanError("model.path is not set: give a preset (model.path=Qwen2.5-7B) or an HF model directory")
    from orz.ppo import run_rules  # imports torch: kept out of the arithmetic above

    name, arch = resolve_model(cfg.model.path)
    try:
        run_rules.check(cfg, arch)  # what the trainer refuses, the planner refuses
    except ConfigError as err:
        raise PlanError("\n".join(f"the trainer refuses it: {line}" for line in str(err).splitlines())) from None
    plans, problems = [], []
    for label, staged in stage_configs(cfg):
        try:
            plans.append((label, plan(arch, cluster.cluster, placement_of(staged), workload_of(staged, cluster.workload),
                                      name)))
        except PlanError as err:
            problems += [label + line for line in str(err).splitlines()]
    if problems:
        raise PlanError("\n".join(problems))
    return plans


# ---------------------------------------------------------------- output


ASSUMPTIONS = (
    "bf16 weights, fp32 main grads, fp32 master weights + Adam m, v (Megatron mixed precision)",
    "flash attention (no s×s scores kept), no dropout, 1F1B pipeline with ≥ PP micro-batches in flight",
    "KV cache sized for max_num_seqs sequences of the longest length, so vLLM never preempts",
    "time: FLOPs at train_mfu of peak bf16; decode step = max(weights + KV read at hbm_efficiency of peak "
    "bandwidth, FLOPs at train_mfu); continuous batching at full concurrency",
    "not counted: the slowest sequence's tail, prefix caching, weight sync, rewards (a reward-model role too), "
    "offload/onload, data movement",
)


def _gib(n: float) -> float:
    return round(n / GIB, 1)


def to_json(p: Plan, problems: list[str]) -> dict:
    """Everything the table shows, GiB and seconds, as one JSON object."""
    t = p.timing
    return {
        "model": p.model, "params_b": round(p.arch.num_params / 1e9, 2), "gpus": p.cluster.gpus,
        "gpu": p.cluster.gpu, "gpu_mem_gib": p.cluster.gpu_mem_gib, "colocate": p.placement.colocate,
        "offload_idle_roles": p.placement.offload_idle_roles, "fits": not problems,
        "memory_gib": {r.role: {"parallel": r.parallel, "gpus": r.gpus,
                                **{c: _gib(getattr(r, c)) for c in RoleMemory.COMPONENTS},
                                "total": _gib(r.total), "limit": _gib(r.limit)} for r in p.memory},
        "time_s": {"rollout": round(t.rollout_s, 1), "forward": round(t.forward_s, 1), "train": round(t.train_s, 1),
                   "iteration": round(t.iteration_s, 1)},
        "decode": {"concurrency": t.decode_concurrency, "step_ms": round(t.decode_step_ms, 2),
                   "tokens_per_s": round(t.rollout_tokens_per_s)},
        "problems": problems,
    }


def print_table(p: Plan, problems: list[str], stage: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    c, placement = p.cluster, p.placement
    where = ("colocated" + (" + offload" if placement.offload_idle_roles else "")) if placement.colocate \
        else "separate GPUs"
    title = (f"{stage}{p.model} ({p.arch.num_params / 1e9:.2f}B) on {c.nodes}×{c.gpus_per_node} {c.gpu} "
             f"({c.gpu_mem_gib} GiB), {where}")
    table = Table(title=title + " — GiB per GPU, heaviest stage")
    for header in ("role", "GPUs", "parallel", "weights", "grads", "optim", "activ", "KV", "reserved", "total",
                   "limit", "fits"):
        table.add_column(header, justify="left" if header in ("role", "parallel") else "right")
    for r in p.memory:
        table.add_row(r.role, str(r.gpus), r.parallel, *(f"{_gib(getattr(r, k))}" if getattr(r, k) else "-"
                                                         for k in RoleMemory.COMPONENTS),
                      f"{_gib(r.total)}", f"{_gib(r.limit)}", "[green]yes[/]" if r.fits else "[red]NO[/]")
    t, w = p.timing, p.workload
    console = Console(width=None if sys.stdout.isatty() else 140)  # piped: wide enough not to fold the table
    console.print(table)
    console.print(f"per iteration ({w.samples} samples, mean {w.mean_prompt_tokens}+{w.mean_response_tokens} tokens): "
                  f"rollout {t.rollout_s:.0f} s ({t.decode_concurrency} seqs/engine, {t.decode_step_ms:.1f} ms/step, "
                  f"{t.rollout_tokens_per_s:,.0f} tok/s) + forward {t.forward_s:.0f} s + train {t.train_s:.0f} s "
                  f"= [bold]{t.iteration_s:.0f} s[/]  (MFU {c.train_mfu:.0%}, HBM {c.hbm_efficiency:.0%} of "
                  f"{GPUS[c.gpu].tflops:.0f} TFLOP/s, {GPUS[c.gpu].hbm_tb_s} TB/s)")
    console.print("assumptions: " + "; ".join(ASSUMPTIONS) + ".", style="dim")
    for problem in problems:
        console.print(f"[red]✗[/] {problem}", highlight=False)


# the flags laid over the cluster file (load_cluster)
_CLUSTER_FLAGS = ("nodes", "gpus_per_node", "gpu", "gpu_mem_gib", "reserved_gib", "train_mfu", "hbm_efficiency",
                  "mean_prompt_tokens", "mean_response_tokens")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m orz.plan", description=__doc__.split("\n\n")[0],
                                 epilog="Flags override the --cluster file; key=value overrides the recipe.")
    ap.add_argument("--cluster", help="configs/clusters/*.yaml: the cluster and the mean lengths")
    ap.add_argument("--recipe", help="playground/*.py (its RECIPE); without it, orz.config's defaults")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the tables")
    for flag, kind in (("nodes", int), ("gpus-per-node", int), ("gpu", str), ("gpu-mem-gib", float),
                       ("reserved-gib", float), ("train-mfu", float), ("hbm-efficiency", float),
                       ("mean-prompt-tokens", int), ("mean-response-tokens", int)):
        ap.add_argument(f"--{flag}", type=kind)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.path=Qwen2.5-7B actor.tp=4")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cluster = load_cluster(args.cluster, **{key: getattr(args, key) for key in _CLUSTER_FLAGS})
        cfg = load_config(None, args.overrides, base=load_recipe(args.recipe) if args.recipe else None)
        plans = plan_recipe(cfg, cluster)
    except (ConfigError, ModelConfigError) as err:
        hint = "\n(give --cluster FILE, or --nodes, --gpus-per-node and --gpu-mem-gib)" if not args.cluster else ""
        print("orz.plan: cannot plan this run:\n" + "\n".join(f"  - {line}" for line in str(err).splitlines())
              + hint, file=sys.stderr)
        return 2
    checked = [(label, p, check(p)) for label, p in plans]
    if args.json:
        print(json.dumps({"recipe": args.recipe, "fits": not any(problems for _, _, problems in checked),
                          "stages": [{"stage": label.rstrip(": ")} | to_json(p, problems)
                                     for label, p, problems in checked]}, ensure_ascii=False))
    else:
        for label, p, problems in checked:
            print_table(p, problems, label)
    return 1 if any(problems for _, _, problems in checked) else 0


if __name__ == "__main__":
    sys.exit(main())
