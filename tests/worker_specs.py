"""The RoleSpec of a Megatron worker that a test builds by hand, made by the trainer's own builder
(`orz.run.role_spec.model_spec`) from a default run's config and the test's RoleConfig."""
from dataclasses import replace

from orz.config import ExperimentConfig, RoleConfig
from orz.run.role_spec import RoleSpec, model_spec


def worker_spec(model_path: str, role: RoleConfig, name: str = "actor", total_steps: int = 1, seed: int = 0,
                **model) -> RoleSpec:
    """Role `name` at `role`'s sizes and settings, its ModelSpec's fields `model` replaced."""
    spec = replace(model_spec(ExperimentConfig(), name, role), **model)
    return RoleSpec(name=name, model_path=model_path, model=spec, cfg=role, total_steps=total_steps, seed=seed)
