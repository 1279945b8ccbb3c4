"""Where a run's processes go, decided once: which Megatron roles it starts, their sizes, the GPUs
each asks for, and what cannot be placed. run_rules, the planner, the Slurm check and the trainer's
setup all ask this module; none re-derives it.

    roles(cfg)                          # {"actor": RoleConfig, ...}, in start order
    layout = Layout.of(cfg)             # every role's sizes, the engines, colocation
    layout.gpu_demand()                 # {"actor": 8, "critic": 8, "rollout": 16}: GPUs each asks Ray for
    layout.colocation_problems()        # colocated sizes that do not line up, naming the keys
    layout.cluster_problems(nodes, gpus_per_node)   # what no cluster of that shape can hold
    role_problems(name, sizes, micro_batch_tokens, arch, longest)    # what the model cannot split

Its arithmetic imports no torch (the planner runs it on login nodes without one).
"""
from __future__ import annotations

from dataclasses import dataclass

from orz.algorithm_names import ADVANTAGE_ESTIMATORS, EstimatorNeeds
from orz.config import AlgorithmConfig, ConfigError, ExperimentConfig, RoleConfig
from orz.models.arch import ModelArch, ModelConfigError
from orz.models.spec import Sizes


def estimator(algo: AlgorithmConfig) -> EstimatorNeeds:
    """What algorithm.advantage's estimator asks of the run (orz/algorithm_names.py)."""
    if algo.advantage not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"algorithm.advantage: unknown advantage estimator {algo.advantage!r}; valid: "
                          f"{', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    return ADVANTAGE_ESTIMATORS[algo.advantage]


TEACHER = "teachers."  # a teacher's role is named by its key: "teachers.big"


def teacher_roles(cfg: ExperimentConfig) -> dict[str, str]:
    """{role name: teacher name} of the run's teachers, in config order."""
    return {f"{TEACHER}{name}": name for name in cfg.teachers}


def roles(cfg: ExperimentConfig) -> dict[str, RoleConfig]:
    """The actor always; the critic when the estimator needs one; the reference when there is a KL
    term (its log-probs enter the reward, the score or the loss: never built for nothing) and the
    actor has no LoRA adapters (then the reference is the actor with its adapters off); the
    reward model when one is set; every teacher (frozen, like the reference)."""
    needs_critic = estimator(cfg.algorithm).needs_critic
    out = {"actor": cfg.actor}
    if needs_critic:
        out["critic"] = cfg.critic
    if cfg.algorithm.kl_coef > 0 and not cfg.actor.lora.rank:
        out["ref"] = cfg.ref
    if cfg.reward.model.path:
        out["reward_model"] = cfg.reward.model
    return out | {role: cfg.teachers[name] for role, name in teacher_roles(cfg).items()}


@dataclass(frozen=True)
class Layout:
    roles: dict[str, Sizes]  # the Megatron roles, in start order
    num_engines: int  # vLLM engines of engine_tp GPUs each, on one node
    engine_tp: int
    colocate: bool  # every role beside every engine, one bundle per GPU, taking turns

    @classmethod
    def of(cls, cfg: ExperimentConfig) -> Layout:
        r = cfg.rollout
        return cls({name: Sizes.of(role) for name, role in roles(cfg).items()},
                   r.num_engines, r.engine_tp, cfg.trainer.colocate)

    @property
    def engine_gpus(self) -> int:
        return self.num_engines * self.engine_tp

    @property
    def gpu_share(self) -> float:
        """Of a colocated bundle's GPU, what each process in it asks for: one share per role and the engine."""
        return 1 / (len(self.roles) + 1)

    def gpu_demand(self) -> dict[str, int]:
        """GPUs each role asks Ray for: one per worker, engines × engine_tp for the fleet. Colocated,
        the roles share the engines' GPUs and ask for none of their own."""
        own = 0 if self.colocate else 1
        return {name: sizes.workers * own for name, sizes in self.roles.items()} | {"rollout": self.engine_gpus}

    def colocation_problems(self) -> list[str]:
        """Colocated: one bundle per GPU holds one worker of every role and one single-GPU engine."""
        if not self.colocate:
            return []
        problems = []
        if self.engine_tp != 1:
            problems.append(f"trainer.colocate=true places one engine per GPU: rollout.engine_tp={self.engine_tp} "
                            "must be 1")
        for name, s in self.roles.items():
            if s.workers != self.engine_gpus:
                problems.append(f"trainer.colocate=true: {name}'s TP·PP·DP = {s.tp}·{s.pp}·{s.dp} = {s.workers} must "
                                f"equal the engines' {self.engine_gpus} GPUs (rollout.num_engines × engine_tp): "
                                "colocated roles share every GPU")
        return problems

    def cluster_problems(self, nodes: int, gpus_per_node: int) -> list[str]:
        """What Ray could never place on nodes × gpus_per_node GPUs (it would wait forever): more GPUs
        than there are, a TP group or an engine across nodes, colocated engines not on every GPU."""
        problems, total, demand = [], nodes * gpus_per_node, self.gpu_demand()
        if sum(demand.values()) > total:
            parts = [f"{name} {demand[name]} ({s.tp}·{s.pp}·{s.dp} workers)" for name, s in self.roles.items()
                     if demand[name]]
            parts.append(f"rollout {self.engine_gpus} ({self.num_engines} engines × TP{self.engine_tp})")
            problems.append(f"GPUs needed: {' + '.join(parts)} = {sum(demand.values())} > {total} GPUs "
                            f"({nodes} nodes × {gpus_per_node}); add nodes, shrink DP or engines, or colocate the "
                            "roles with the engines (trainer.colocate=true)")
        if gpus_per_node % self.engine_tp:
            problems.append(f"rollout.engine_tp={self.engine_tp} does not divide {gpus_per_node} GPUs per node "
                            "(an engine's GPUs must be on one node)")
        problems += [f"{name}.tp={s.tp} does not divide {gpus_per_node} GPUs per node (a TP group must stay "
                     "inside one node)" for name, s in self.roles.items() if gpus_per_node % s.tp]
        if self.colocate and self.engine_gpus != total:
            problems.append(f"trainer.colocate=true: rollout.num_engines·engine_tp = {self.num_engines}·"
                            f"{self.engine_tp} = {self.engine_gpus} ≠ {total} GPUs (colocated engines use every GPU)")
        return problems


def role_problems(name: str, sizes: Sizes, micro_batch_tokens: int, arch: ModelArch | None,
                  longest: int) -> list[str]:
    """What stops a role from splitting the model (TP, PP, EP or ETP sizes that do not divide it,
    experts' groups that do not fit in tp·dp) or from holding the longest sample (prompt + response
    tokens) in one micro-batch (0: split by rows)."""
    problems, experts, ranks = [], (sizes.ep, sizes.etp), sizes.tp * sizes.cp * sizes.dp
    if min(experts) >= 1 and ranks % (sizes.ep * sizes.etp):  # below 1: a range problem
        problems.append(f"{name}.ep={sizes.ep} × {name}.etp={sizes.etp} must divide {name}.tp × {name}.cp × "
                        f"{name}.dp = {ranks}: the experts' groups are carved out of those ranks")
    if arch is not None:
        if arch.moe is None and experts != (1, 1):
            problems.append(f"{name}.ep={sizes.ep}, {name}.etp={sizes.etp}: expert parallelism needs a "
                            f"mixture-of-experts model, and this {arch.family} model is dense; set both to 1")
        try:
            arch.check_parallel(sizes.tp, sizes.pp, *(experts if arch.moe else (1, 1)))
        except ModelConfigError as err:
            problems.append(f"{name}.{err} of the model; use a size that divides it")
    if 0 < micro_batch_tokens < longest:
        problems.append(f"{name}.micro_batch_tokens={micro_batch_tokens} cannot hold the longest sample ({longest} "
                        "tokens: data.prompt_max_tokens + rollout.max_new_tokens); raise it")
    return problems
