"""A plan: the memory of every role and the time of one iteration, for a placement that can run."""
from dataclasses import dataclass

from orz.models.arch import ModelArch, ModelConfigError
from orz.plan.inputs import Cluster, Placement, PlanError, Workload
from orz.plan.memory import RoleMemory, memory_rows
from orz.plan.timing import Timing, timing


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
