"""Memory and time planner: does a recipe fit a cluster, and how long is one of its iterations?

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/orz_7b_ppo.py \
        model.path=Qwen2.5-7B [actor.tp=4 ...] [--nodes 8] [--json]

The run is the recipe itself (its RECIPE, with key=value overrides as for training): its roles,
parallel sizes, batch and lengths, every stage of it. The cluster file holds only what a recipe
cannot know: the nodes and GPUs, the efficiencies assumed, and the mean lengths that size time.
model.path is a preset (MODELS), an HF model directory or its config.json.

    plans = plan_recipe(cfg, load_cluster(path))   # [(stage label, Plan)]
    problems = blockers(plan)                      # [] when everything fits

The package, one idea a module: inputs (cluster, sizes, workload), memory, timing, estimate (a
plan), advice (does it fit, what would), recipe (a plan's inputs from a recipe), cli. Its arithmetic
imports no torch, Ray, vLLM or Megatron (only `plan_recipe` asks the trainer's run_rules what it
refuses), so the Slurm launcher can refuse a run before it allocates GPUs.
Memory is bytes per GPU on the heaviest pipeline stage of each role; every formula is in the
docstring of the function that computes it. Exit codes: 0 fits, 1 does not fit (the message names
the role, its largest component and the recipe overrides that would make it fit), 2 bad input.
"""
from orz.models.presets import MODELS
from orz.plan.advice import blockers
from orz.plan.cli import main
from orz.plan.estimate import Plan, plan
from orz.plan.inputs import (GIB, GPUS, Cluster, ModelParallel, Placement, PlanError, Rollout, TrainParallel,
                             Workload)
from orz.plan.memory import stage_params
from orz.plan.recipe import load_cluster, plan_recipe, resolve_model

__all__ = ["MODELS", "blockers", "main", "Plan", "plan", "GIB", "GPUS", "Cluster", "ModelParallel", "Placement",
           "PlanError", "Rollout", "TrainParallel", "Workload", "stage_params", "load_cluster", "plan_recipe",
           "resolve_model"]
