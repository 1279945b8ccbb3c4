"""Open-Reasoner-Zero's PPO recipe for Qwen2.5-32B base.

    python playground/orz_32b_ppo.py model.path=/models/Qwen2.5-32B data.train=[/data/orz_math_57k_collected.json]

Planned for 16 nodes × 8 H100 80 GB (configs/clusters/h100_16x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_16x8.yaml --recipe playground/orz_32b_ppo.py model.path=Qwen2.5-32B
"""
import sys
from dataclasses import replace

from orz.train import main
from playground.orz_7b_ppo import RECIPE as PPO_7B

RECIPE = replace(
    PPO_7B,
    # 128 GPUs: actor 32 (TP8 PP2 DP2), critic 32 (TP8 PP2 DP2), 16 engines of TP4.
    # 10240-token micro-batches: the longest sample (2048 + 8000 tokens) fits in one.
    actor=replace(PPO_7B.actor, tp=8, pp=2, dp=2, micro_batch_tokens=10240),
    critic=replace(PPO_7B.critic, tp=8, pp=2, dp=2, micro_batch_tokens=10240),
    rollout=replace(PPO_7B.rollout, num_engines=16, engine_tp=4),
    trainer=replace(PPO_7B.trainer, output_dir="runs/orz_32b_ppo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
