"""A plan: the memory of every role and the time of one iteration, for a placement that can run."""
from dataclasses import dataclass

from orz.models.arch import ModelArch
from orz.plan.inputs import Cluster, Placement, PlanError, Workload
from orz.plan.memory import RoleMemory, memory_rows
from orz.plan.timing import Timing, timing
from orz.run.placement import Layout, role_problems


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
    """Everything that stops the placement from running at all, whatever the memory, as the trainer
    and the Slurm check decide it (orz.run.placement); each names the recipe's key."""
    roles = placement.megatron_roles()  # each the trainer's Sizes, and what its passes hold
    rollout = placement.rollout
    layout = Layout(roles, rollout.num_engines, rollout.engine_tp, placement.colocate)
    problems = [problem for name, par in roles.items()
                for problem in role_problems(name, par, par.micro_batch_tokens, placement.arch_of(name, arch),
                                             workload.max_seq_tokens)]
    tp = rollout.engine_tp
    if arch.num_heads % tp or (arch.num_kv_heads % tp and tp % arch.num_kv_heads):
        problems.append(f"rollout.engine_tp={tp} must divide num_attention_heads={arch.num_heads} and divide "
                        f"or be a multiple of num_key_value_heads={arch.num_kv_heads}")
    return problems + layout.colocation_problems() + layout.cluster_problems(cluster.nodes, cluster.gpus_per_node)


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
