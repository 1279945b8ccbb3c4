"""GRPO on Qwen2.5-7B base with ORZ's data and template: the PPO recipe without a critic.

    python playground/orz_7b_grpo.py model.path=/models/Qwen2.5-7B data.train=[/data/orz_math_57k_collected.json]

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/orz_7b_grpo.py model.path=Qwen2.5-7B
"""
import sys
from dataclasses import replace

from orz.config import RoleConfig
from orz.train import main
from playground.orz_7b_ppo import RECIPE as PPO

RECIPE = replace(
    PPO,
    actor=replace(PPO.actor, tp=2, dp=8),  # the critic's GPUs go to the actor
    critic=RoleConfig(),  # unused: GRPO has no critic
    # GRPO's published form: group-normalised scores, no batch whitening on top (the estimator's
    # default, None, rather than the PPO recipe's explicit True).
    algorithm=replace(PPO.algorithm, advantage="grpo", whiten_advantages=None),
    trainer=replace(PPO.trainer, output_dir="runs/orz_7b_grpo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
