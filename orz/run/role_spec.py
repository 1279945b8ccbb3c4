"""What each Megatron role of a run is built from: `role_spec(cfg, name)`, the one builder.

The trainer, `orz convert upgrade` and the planner call it; nothing else builds a role. A new model
setting touches config.py (its field), orz/models/spec.py (ModelSpec's field), `model_spec` below
and the module that uses it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from orz.config import ExperimentConfig, RoleConfig, stage_configs
from orz.models.spec import LoraSpec, ModelSpec, OptimSpec, Sizes
from orz.run.placement import roles, teacher_roles

TRAINED = ("actor", "critic")  # the roles with an optimizer; the reference, reward model and teachers are frozen
VALUE_HEADS = ("critic", "reward_model")


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """A role's own facts and its model's spec: what a worker needs to build its part of the role."""

    name: str  # "actor" | "critic" | "ref" | "reward_model" | "teachers.<name>"
    model_path: str  # the HF directory the weights start from
    model: ModelSpec
    # The role's settings at the run's first stage: micro-batching, threads, LR schedule (each
    # stage sends its own: MegatronWorker.configure; the sizes cannot change).
    cfg: RoleConfig
    total_steps: int = 1  # optimizer steps of the whole run, for the LR schedule
    seed: int = 0
    log_dir: str = ""  # this worker's stdout/stderr go to log_dir/<name>-<rank>.log; "" keeps them
    engine_dtype: str = ""  # the actor's: what the engines hold (rollout.engine_dtype), synced weights cast to it
    lora_sync: str = ""  # a LoRA actor's: what a sync sends, "adapter" or "merged" (rollout.lora_sync)

    @property
    def train(self) -> bool:
        return self.model.trained

    def at(self, sizes: Sizes) -> RoleSpec:
        """The same role at other parallel sizes (a re-cut, a resume at another layout)."""
        return replace(self, cfg=replace(self.cfg, **sizes.as_dict()), model=replace(self.model, sizes=sizes))


def optimizer_steps(cfg: ExperimentConfig, role: str) -> int:
    """Optimizer steps of the whole run for `role`, over every stage's iterations × steps."""
    if not cfg.stages:
        return cfg.trainer.iterations * getattr(cfg, role).steps_per_iteration
    return sum(stage.iterations * getattr(staged, role).steps_per_iteration
               for stage, (_, staged) in zip(cfg.stages, stage_configs(cfg)))


def model_path(cfg: ExperimentConfig, name: str) -> str:
    if name in teacher_roles(cfg):
        return cfg.teachers[teacher_roles(cfg)[name]].path
    return {"critic": cfg.model.critic_path or cfg.model.path, "reward_model": cfg.reward.model.path}.get(
        name, cfg.model.path)


def model_spec(cfg: ExperimentConfig, name: str, role: RoleConfig) -> ModelSpec:
    """Role `name`'s ModelSpec from the run's config and the role's own settings `role`."""
    m = cfg.model
    optim = OptimSpec(lr=role.lr, min_lr=role.min_lr, weight_decay=role.weight_decay, adam_beta1=role.adam_betas[0],
                      adam_beta2=role.adam_betas[1], clip_grad=role.clip_grad,
                      use_distributed_optimizer=role.use_distributed_optimizer) if name in TRAINED else None
    dtype = role.dtype if name in teacher_roles(cfg) else m.dtype  # a teacher's own
    return ModelSpec(sizes=Sizes.of(role), dtype=dtype, recompute=m.recompute,
                     deterministic=cfg.trainer.batch_invariant, vocab_divisible_by=m.vocab_divisible_by,
                     value_head=name in VALUE_HEADS, moe_aux_loss_coef=m.moe_aux_loss_coef,
                     moe_dispatcher=m.moe_dispatcher, routing_replay=name == "actor" and cfg.rollout.routing_replay,
                     logprob_chunk_tokens=m.logprob_chunk_tokens or 0, optim=optim,
                     lora=LoraSpec(rank=role.lora.rank, alpha=role.lora.alpha, targets=tuple(role.lora.targets))
                     if name == "actor" and role.lora.rank else None)


def role_spec(cfg: ExperimentConfig, name: str, log_dir: str = "", engine_dtype: str = "",
              sizes: Sizes | None = None) -> RoleSpec:
    """Role `name` of the run `cfg` (at its first stage; a stage changes no size), at `sizes` or
    its configured ones. engine_dtype: the actor's, what the engines hold ("": the model's own)."""
    role = roles(stage_configs(cfg)[0][1])[name]
    spec = RoleSpec(name=name, model_path=model_path(cfg, name), model=model_spec(cfg, name, role), cfg=role,
                    total_steps=optimizer_steps(cfg, name) if name in TRAINED else 1, seed=cfg.trainer.seed,
                    log_dir=log_dir, engine_dtype=engine_dtype if name == "actor" else "",
                    lora_sync=cfg.rollout.lora_sync if name == "actor" and role.lora.rank else "")
    return spec.at(sizes) if sizes else spec
