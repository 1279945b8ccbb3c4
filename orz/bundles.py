"""Where Ray puts a role's processes (a placement group with one bundle per process index), and
the environment they start with.

Separate placement gives each role (and the vLLM fleet) its own group. Colocated placement
(trainer.colocate) gives them all one group of one bundle per GPU: bundle g holds worker g of
every Megatron role and engine g, each with an equal share of the GPU, so that Ray places them
together and they take turns. On CPU a bundle holds CPUs only.
"""
from dataclasses import dataclass

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class Bundles:
    group: PlacementGroup
    gpu_share: float  # of a bundle's GPUs that each process placed in it asks for (on GPU)

    @classmethod
    def create(cls, count: int, cpus: float, gpus: int = 1, gpu_share: float = 1.0) -> "Bundles":
        """`count` bundles of `cpus` CPUs and, on GPU, `gpus` GPUs each; waits until Ray holds them."""
        bundle = {"CPU": cpus, **({"GPU": gpus} if torch.cuda.is_available() else {})}
        group = placement_group([bundle] * count, strategy="PACK")
        ray.get(group.ready())
        return cls(group, gpu_share)

    def options(self, index: int, cpus: float, env: dict[str, str]) -> dict:
        """Ray actor options for a process on bundle `index`, started with `env` in its environment.
        On CPU it also gets TORCHDYNAMO_DISABLE=1: there vLLM runs eagerly and Megatron's layers
        call nothing compiled, and torch.compile's imports and first-call builds (g++) cost each
        engine 3-5 s of CPU and each Megatron worker 1 s, for the numbers eager gives."""
        on_gpu = torch.cuda.is_available()
        return {"num_cpus": cpus, "num_gpus": self.gpu_share if on_gpu else 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index),
                "runtime_env": {"env_vars": env if on_gpu else {**env, "TORCHDYNAMO_DISABLE": "1"}}}

    def remove(self) -> None:
        remove_placement_group(self.group)
