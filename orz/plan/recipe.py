"""A plan's inputs from a recipe (its roles, sizes, batch and lengths, every stage) and a cluster file."""
import json
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from orz.config import ConfigError, ExperimentConfig, from_dict, stage_configs
from orz.models.arch import ModelArch, ModelConfigError, arch_from_dict, read_arch
from orz.models.presets import MODELS
from orz.plan.estimate import Plan, plan
from orz.plan.inputs import (Cluster, ModelParallel, Placement, PlanError, Rollout, TrainParallel, Workload,
                             _require_positive)
from orz.run.placement import roles, teacher_roles
from orz.run.role_spec import role_spec


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
    """The recipe's roles, decided by the trainer's own rule (orz.run.placement.roles), each sized
    and built as the trainer builds it (orz.run.role_spec). A role split by rows (micro_batch_size)
    holds that many of the longest samples."""
    started = roles(cfg)
    longest = cfg.data.prompt_max_tokens + cfg.rollout.max_new_tokens

    def parallel(name: str) -> ModelParallel | None:
        """The role's sizes and what its passes hold (a micro-batch: its token budget, or
        micro_batch_size rows of the longest sample); None where the run has no such role."""
        if name not in started:
            return None
        spec, role = role_spec(cfg, name).model, started[name]
        held = dict(**spec.sizes.as_dict(), micro_batch_tokens=role.micro_batch_tokens or role.micro_batch_size * longest,
                    moe_dispatcher=spec.moe_dispatcher, logprob_chunk_tokens=spec.logprob_chunk_tokens)
        if not spec.trained:
            return ModelParallel(**held)
        lora = spec.lora
        return TrainParallel(**held, recompute=spec.recompute, use_distributed_optimizer=spec.optim.use_distributed_optimizer,
                             lora_rank=lora.rank if lora else 0, lora_targets=lora.targets if lora else ())

    r, rm = cfg.rollout, started.get("reward_model")
    return Placement(
        actor=parallel("actor"), critic=parallel("critic"), ref=parallel("ref"), reward_model=parallel("reward_model"),
        reward_model_arch=resolve_model(rm.path)[1] if rm else None,
        rollout=Rollout(num_engines=r.num_engines, engine_tp=r.engine_tp,
                        gpu_memory_utilization=r.gpu_memory_utilization, max_num_seqs=r.max_num_seqs),
        colocate=cfg.trainer.colocate,
        offload_idle_roles=cfg.trainer.offload_idle_roles,
        teachers=tuple((role, parallel(role), resolve_model(cfg.teachers[name].path)[1])
                       for role, name in teacher_roles(cfg).items()))


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
    from orz.run import run_rules  # imports torch: kept out of the arithmetic above

    name, arch = resolve_model(cfg.model.path)
    try:
        run_rules.check(cfg, arch, on_gpu=True)  # what the trainer refuses on the GPU cluster planned, the planner refuses
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
