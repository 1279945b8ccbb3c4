"""Bytes per GPU of every role: parameters per pipeline stage, activations, logits, KV cache,
optimizer states; every formula is in the docstring of the function that computes it."""
from dataclasses import dataclass

from orz.models.arch import ModelArch
from orz.plan.inputs import (BF16, FP32, GIB, MEGATRON_VOCAB_MULTIPLE, VLLM_VOCAB_MULTIPLE, Cluster, ModelParallel,
                             Placement, Rollout, TrainParallel, Workload, gib)


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
        limit, why = mem - kept, f"{gib(mem)} GiB"
        if kept:
            why += f" − {gib(kept)} GiB kept by {others} other colocated process{'es' * (others > 1)}"
        if role == "rollout":
            limit = int(rollout.gpu_memory_utilization * mem)
            why = f"gpu_memory_utilization {rollout.gpu_memory_utilization} × {gib(mem)} GiB"
        rows.append(RoleMemory(role=role, gpus=gpus, parallel=label,
                               **{c: own.get(c, 0) for c in RoleMemory.COMPONENTS[:-1]},
                               overhead=reserved, kept_by_others=kept, limit=limit, limit_why=why))
    return tuple(rows)
