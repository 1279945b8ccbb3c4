"""Open-Reasoner-Zero's PPO recipe for Qwen2.5-32B base.

    python playground/orz_32b_ppo.py model.path=/models/Qwen2.5-32B data.train=[/data/orz_math_57k_collected.json]

16 nodes × 8 GPUs: `python -m orz.plan --layout configs/layouts/orz_32b.yaml` shows the memory.
"""
import sys
from dataclasses import replace

from orz.train import main
from playground.orz_7b_ppo import RECIPE as PPO_7B

RECIPE = replace(
    PPO_7B,
    # 128 GPUs: actor 32 (TP8 PP2 DP2), critic 32 (TP8 PP2 DP2), 16 engines of TP4.
    actor=replace(PPO_7B.actor, tp=8, pp=2, dp=2, micro_batch_tokens=8192),
    critic=replace(PPO_7B.critic, tp=8, pp=2, dp=2, micro_batch_tokens=8192),
    rollout=replace(PPO_7B.rollout, num_engines=16, engine_tp=4),
    model=replace(PPO_7B.model, recompute=True),  # full recomputation: activations of 8k-token sequences
    trainer=replace(PPO_7B.trainer, output_dir="runs/orz_32b_ppo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
