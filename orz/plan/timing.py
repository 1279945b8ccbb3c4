"""Seconds per iteration: rollout (prefill and decode), forward passes and updates."""
from dataclasses import dataclass

from orz.models.arch import ModelArch
from orz.plan.inputs import BF16, Cluster, ModelParallel, Placement, Rollout, TrainParallel, Workload, head_of
from orz.plan.memory import (attention_layers, engine_params, expert_params, kv_bytes_per_token, matmul_params,
                             recurrent_bytes_per_sequence, rollout_concurrency)


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


def forward_flops(arch: ModelArch, tokens: float, seq_len: float, head: str) -> float:
    """FLOPs of one forward pass over `tokens` tokens in sequences of seq_len: 2·M·n + 2·L_a·a·d·s·n
    (+ 6·L_g·n_v·d_k·d_v·n for a hybrid).

    2·M per token for the matmuls (matmul_params); causal attention (QKᵀ and AV over s/2 earlier
    tokens on average) 2·2·a·d·s/2 per token and attention layer; a Gated DeltaNet layer's recurrence
    (read S·k, a rank-one update, S·q: three d_k×d_v products per value head) 6·n_v·d_k·d_v per token,
    whatever s. A backward pass costs twice a forward, so a training step is 3× forward, 4× with
    full recompute.
    """
    attention = 2 * attention_layers(arch) * arch.num_heads * arch.head_dim * seq_len
    return (2 * matmul_params(arch, head) + attention + recurrence_flops(arch)) * tokens


def recurrence_flops(arch: ModelArch) -> int:
    """A hybrid's Gated DeltaNet recurrences per token: 6·n_v·d_k·d_v per GDN layer (0 without)."""
    gdn = arch.linear_attention
    return 6 * len(gdn.layers) * gdn.num_value_heads * gdn.key_head_dim * gdn.value_head_dim if gdn else 0


def rollout_time(arch: ModelArch, cluster: Cluster, rollout: Rollout, workload: Workload) -> tuple[float, int, float]:
    """(seconds, concurrency c, decode step seconds) for one engine's share of the samples.

    prefill: forward_flops of its prompts at train_mfu of the engine's t GPUs (no prefix caching).
    decode, continuous batching at c sequences: n·mean_response / c steps, each
      max(bytes / (hbm_efficiency · bandwidth), flops / (train_mfu · peak)) per GPU, with
      bytes = 2·P (one GPU's weights, read once per step) + c·(mean_prompt + mean_response/2)·kv_bytes_per_token
              + c·recurrent_bytes_per_sequence (a hybrid's states, read and written once per step)
      flops = c·(2·M + 4·L_a·a·d·(mean_prompt + mean_response/2) + recurrence_flops)/t.
    With experts, a step reads only the experts its c tokens route to: of each sparse layer's experts
    the expected share 1 − (1 − k/E)^c under uniform routing.
    """
    gpu = cluster.device
    flop_s, byte_s = gpu.tflops * 1e12 * cluster.train_mfu, gpu.hbm_tb_s * 1e12 * cluster.hbm_efficiency
    per_engine = -(-workload.samples // rollout.num_engines)
    c = rollout_concurrency(rollout, workload)
    prefill_tokens = per_engine * workload.mean_prompt_tokens
    prefill = forward_flops(arch, prefill_tokens, workload.mean_prompt_tokens, "lm") / (rollout.engine_tp * flop_s)
    context = workload.mean_prompt_tokens + workload.mean_response_tokens / 2
    experts = sum(expert_params(arch, i, etp=rollout.engine_tp) for i in range(arch.num_layers))
    touched = 1 - (1 - arch.moe.top_k / arch.moe.num_experts) ** c if arch.moe else 0.0
    weights = BF16 * (engine_params(arch, rollout.engine_tp) - experts * (1 - touched))
    t = rollout.engine_tp
    read = weights + c * (context * kv_bytes_per_token(arch, t) + 2 * recurrent_bytes_per_sequence(arch, t))
    attention = 4 * attention_layers(arch) * arch.num_heads * arch.head_dim * context
    step = max(read / byte_s, c * (2 * matmul_params(arch, "lm") + attention + recurrence_flops(arch)) / (t * flop_s))
    steps = per_engine * workload.mean_response_tokens / c
    return prefill + steps * step, c, step


def all_to_all_s(arch: ModelArch, cluster: Cluster, par: ModelParallel, tokens: float, passes: int) -> float:
    """Seconds of a role's expert-parallel token exchange over `tokens` tokens, for `passes` passes
    of each sparse layer (forward 1; training 3, or 4 with recompute, as FLOPs count them).

    With the all-to-all (and flex) dispatcher each pass sends every routed copy to its expert's GPU
    and back; with the all-gather one (model.moe_dispatcher's default) every GPU gathers all its
    EP peers' tokens and reduce-scatters their outputs back, whatever they route to. Per GPU and
    forward pass, T = tokens/(dp·cp) its tokens, S sparse layers, bf16 hidden states:
      alltoall   bytes = T·(S/pp)·k·2h·(ep − 1)/ep · 2
      allgather  bytes = T·(S/pp)·2h·(ep − 1) · 2          (the same at k = ep, more at k < ep)
    at link_efficiency of nvlink_gb_s (the planner assumes an EP group within one node); 0 at ep = 1.
    """
    if arch.moe is None or par.ep == 1:
        return 0.0
    sparse = sum(arch.is_moe_layer(i) for i in range(arch.num_layers))
    copies = par.ep - 1 if par.moe_dispatcher == "allgather" else arch.moe.top_k * (par.ep - 1) / par.ep
    per_pass = tokens / (par.dp * par.cp) * sparse / par.pp * copies * BF16 * arch.hidden_size * 2
    return passes * per_pass / (cluster.device.nvlink_gb_s * 1e9 * cluster.link_efficiency)


def timing(arch: ModelArch, cluster: Cluster, placement: Placement, workload: Workload) -> Timing:
    """Seconds per iteration: rollout, then forward passes, then updates (synchronous RL).

    Role time = FLOPs / (GPUs · peak · train_mfu) over samples·mean_seq_tokens tokens, plus its
    experts' all-to-all (all_to_all_s). Forward: actor (old log-probs), reference and critic
    (values). Updates: 3, or 4 with recompute, × forward (one pass over the batch).
    Colocated roles take turns on all GPUs (times add up); separate roles overlap (the slowest counts).
    """
    flop_s = cluster.device.tflops * 1e12 * cluster.train_mfu
    tokens, s = workload.samples * workload.mean_seq_tokens, workload.mean_seq_tokens
    forward, train = [], []
    for name, par in placement.megatron_roles().items():
        model = placement.arch_of(name, arch)
        one = forward_flops(model, tokens, s, head_of(name)) / (par.gpus * flop_s)
        forward.append(one + all_to_all_s(model, cluster, par, tokens, 1))
        if isinstance(par, TrainParallel):
            passes = 4 if par.recompute else 3
            train.append(one * passes + all_to_all_s(arch, cluster, par, tokens, passes))
    combine = sum if placement.colocate else max
    rollout_s, c, step = rollout_time(arch, cluster, placement.rollout, workload)
    return Timing(rollout_s=rollout_s, forward_s=combine(forward), train_s=combine(train), decode_concurrency=c,
                  decode_step_ms=step * 1e3,
                  rollout_tokens_per_s=workload.samples * workload.mean_response_tokens / rollout_s)
