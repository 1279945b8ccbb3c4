"""Does a plan fit, and if not, which recipe overrides would make it fit."""
import math
from dataclasses import replace

from orz.plan.estimate import Plan, plan
from orz.plan.inputs import GIB, Placement, PlanError, TrainParallel, gib
from orz.plan.memory import kv_bytes_per_token, recurrent_bytes_per_sequence


def _changes(p: Plan, role: str) -> list[tuple[str, Placement]]:
    """Single changes worth trying for a role that does not fit, each as the recipe overrides that
    make it."""
    placement, w = p.placement, p.workload
    if role == "rollout":
        r = placement.rollout
        row = p.row("rollout")
        per_seq = (w.max_seq_tokens * kv_bytes_per_token(p.arch, r.engine_tp)
                   + recurrent_bytes_per_sequence(p.arch, r.engine_tp))
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
        options.append((f"{role}.cp={2 * par.cp} {role}.dp={par.dp // 2}", replace(par, cp=2 * par.cp, dp=par.dp // 2)))
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
    singles = [f"{text} ({gib(new.row(role).total)} GiB)" for text, new in _replans(p, role) if _fits(new, role)]
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
            return [f"{together} together ({gib(p.row(role).total)} GiB)"]
    return []


def blockers(p: Plan) -> list[str]:
    """Problems that stop the plan from running, each naming the role, what dominates and the recipe
    overrides that would make it fit."""
    problems = []
    for row in p.memory:
        if row.fits:
            continue
        fixes = _fixes(p, row.role)
        tried = len(_changes(p, row.role))
        advice = ("Would fit with: " + "; ".join(fixes)) if fixes else f"None of {tried} changes tried fits: add GPUs"
        problems.append(f"{row.role} does not fit: {gib(row.total)} GiB per GPU > {gib(row.limit)} GiB "
                        f"({row.limit_why}); largest part: {row.dominant} {gib(getattr(row, row.dominant))} GiB. "
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
            f"{gib(rollout.limit)} GiB but only {gib(free)} GiB are free beside the other colocated "
            f"processes; set rollout.gpu_memory_utilization={math.floor(100 * free / mem) / 100}")


def _fits(p: Plan, role: str) -> bool:
    return p.row(role).fits and (role != "rollout" or _vllm_overcommit(p) is None)
