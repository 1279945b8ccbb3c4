"""What a plan is computed from: the cluster and its GPUs, each role's parallel sizes, the vLLM
fleet, the placement of them all, and one iteration's workload."""
from dataclasses import dataclass, fields

from orz.config import ConfigError
from orz.models.arch import ModelArch
from orz.models.spec import Sizes

GIB = 2**30
BF16, FP32 = 2, 4
MEGATRON_VOCAB_MULTIPLE = 1  # orz.models.builder pads the vocabulary to a multiple of TP only
VLLM_VOCAB_MULTIPLE = 64  # vLLM pads embedding and LM head to 64 rows per TP rank
LOGPROB_CHUNK_BYTES = 128 << 20  # orz.models.logprobs.CHUNK_BYTES: the default chunk's fp32 logits per rank


class PlanError(ConfigError):
    """A run that cannot be placed at all (sizes that do not divide); lists every problem found."""


@dataclass(frozen=True)
class GPU:
    tflops: float  # dense bf16 peak, TFLOP/s (datasheet, without sparsity)
    hbm_tb_s: float  # peak HBM bandwidth, TB/s
    nvlink_gb_s: float  # NVLink bandwidth per GPU and direction, GB/s (half the datasheet's bidirectional figure)


# Memory is the cluster's gpu_mem_gib, as nvidia-smi reports it: A100 80 GB 80.0 GiB, H100/H800 79.6 GiB
# (81559 MiB), H200 140.4 GiB (143771 MiB).
GPUS = {
    "A100": GPU(tflops=312, hbm_tb_s=2.039, nvlink_gb_s=300),  # SXM 80 GB
    "H100": GPU(tflops=989, hbm_tb_s=3.35, nvlink_gb_s=450),  # SXM
    "H800": GPU(tflops=989, hbm_tb_s=3.35, nvlink_gb_s=200),  # an H100 with slower NVLink
    "H200": GPU(tflops=989, hbm_tb_s=4.8, nvlink_gb_s=450),
}


MEASURED = "measured"


@dataclass(frozen=True)
class Cluster:
    nodes: int  # Slurm nodes
    gpus_per_node: int  # a TP group must stay inside one node (NVLink)
    gpu_mem_gib: float  # usable memory per GPU; the budget every role is checked against
    # a GPUS preset: peak FLOP/s and bandwidth for the time estimate; "measured": `measured_gpu`,
    # this machine's device as a run measured it (orz plan --against; configs/clusters/this_machine.yaml)
    gpu: str = "H100"
    reserved_gib: float = 2.0  # per process on a GPU: CUDA context, NCCL buffers, allocator slack
    train_mfu: float = 0.40  # achieved fraction of peak FLOP/s in training, forward passes and prefill
    hbm_efficiency: float = 0.70  # achieved fraction of peak HBM bandwidth in vLLM decode
    link_efficiency: float = 0.50  # achieved fraction of NVLink bandwidth in the experts' all-to-all
    measured_gpu: GPU | None = None  # gpu="measured": filled from the run (orz.plan.against), never by hand

    def __post_init__(self):
        if self.gpu not in GPUS and self.gpu != MEASURED:
            raise PlanError(f"gpu={self.gpu!r} is not a preset; choose one of {sorted(GPUS)}, or {MEASURED!r} "
                            "(orz plan --against: this machine as a run measured it)")
        _require_positive(self, "nodes", "gpus_per_node", "gpu_mem_gib")
        efficiencies = (self.train_mfu, self.hbm_efficiency, self.link_efficiency)
        if not (all(0 < e <= 1 for e in efficiencies) and self.reserved_gib >= 0):
            raise PlanError(f"need 0 < train_mfu, hbm_efficiency, link_efficiency <= 1 and reserved_gib >= 0, got "
                            f"{', '.join(map(str, efficiencies))}, {self.reserved_gib}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device(self) -> GPU:
        """The GPU preset, or the measured device."""
        if self.gpu != MEASURED:
            return GPUS[self.gpu]
        if self.measured_gpu is None:
            raise PlanError("gpu=measured describes the machine a run measured: use it with `orz plan --against RUN_DIR`")
        return self.measured_gpu


@dataclass(frozen=True)
class ModelParallel(Sizes):
    """A Megatron role as the planner sizes it: the trainer's placement of it (Sizes: tp, pp, dp,
    ep, etp, cp, one GPU per worker) and what its passes hold."""

    micro_batch_tokens: int = 16384  # tokens per micro-batch (b·s); ORZ packs up to 16384
    sequence_parallel: bool = False  # Megatron SP also splits norms/dropout by TP; orz.models.builder has it off
    logprob_chunk_tokens: int = 0  # model.logprob_chunk_tokens: tokens whose logits are held at once; 0: the default
    moe_dispatcher: str = "allgather"  # model.moe_dispatcher: how tokens reach their experts' EP ranks

    def __post_init__(self):
        _require_positive(self, "tp", "pp", "dp", "micro_batch_tokens", "ep", "etp", "cp")

    @property
    def gpus(self) -> int:
        return self.workers

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert shard, over which its gradients are reduced: tp·cp·dp / (ep·etp)."""
        return max(self.tp * self.cp * self.dp // (self.ep * self.etp), 1)

    @property
    def cp_tokens(self) -> int:
        """A micro-batch's tokens on each CP rank: ⌈T / cp⌉."""
        return -(-self.micro_batch_tokens // self.cp)


@dataclass(frozen=True)
class TrainParallel(ModelParallel):
    recompute: bool = False  # model.recompute: keep only each layer's input, rerun it in backward
    use_distributed_optimizer: bool = False  # ZeRO-1: fp32 master weights and Adam states sharded over DP
    lora_rank: int = 0  # actor.lora.rank: only adapters of this rank train; 0: every weight
    lora_targets: tuple[str, ...] = ()  # actor.lora.targets


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
    reward_model: ModelParallel | None = None  # reward.model: forward only, a value head on its own model
    reward_model_arch: ModelArch | None = None  # that model's architecture (the actor's when None)
    colocate: bool = False  # every role on every GPU, phases taking turns (ORZ's colocate_all)
    offload_idle_roles: bool = False  # colocated: idle roles move their states to CPU and vLLM sleeps
    # (role name, sizes, architecture) of each teacher ("teachers.big": forward only, its own model);
    # each is planned for every row of the batch, an upper bound where routes split the rows
    teachers: tuple[tuple[str, ModelParallel, ModelArch], ...] = ()

    def megatron_roles(self) -> dict[str, ModelParallel]:
        roles = {"actor": self.actor, "critic": self.critic, "ref": self.ref, "reward_model": self.reward_model}
        return {name: par for name, par in roles.items() if par is not None} | {
            name: par for name, par, _ in self.teachers}

    def arch_of(self, role: str, actor_arch: ModelArch) -> ModelArch:
        """The model a role runs: the reward model's and each teacher's own, every other role the actor's."""
        teachers = {name: arch for name, _, arch in self.teachers}
        if role in teachers:
            return teachers[role]
        return self.reward_model_arch or actor_arch if role == "reward_model" else actor_arch


def head_of(role: str) -> str:
    """What a role's last stage ends in: a value head (critic, reward model) or the LM head."""
    return "value" if role in ("critic", "reward_model") else "lm"


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


def gib(n: float) -> float:
    """Bytes as GiB, one decimal, for tables and messages."""
    return round(n / GIB, 1)
