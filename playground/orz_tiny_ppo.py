"""PPO (critic, GAE with γ = λ = 1, whitened advantages: ORZ's recipe) on the CPU demo's tiny model.

    python playground/orz_tiny_ppo.py trainer.iterations=30
"""
import sys
from dataclasses import replace

from orz.train import main
from playground.orz_tiny_grpo import recipe

GRPO = recipe(name="tiny_ppo")
RECIPE = replace(
    GRPO,
    algorithm=replace(GRPO.algorithm, advantage="gae", gamma=1.0, lam=1.0, whiten_advantages=True),
    critic=replace(GRPO.critic, lr=1e-4, steps_per_iteration=4, micro_batch_size=64),  # ORZ: more critic than actor steps
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
