"""The ORZ/Skywork-OR1 math recipe on Qwen3-8B-Base: GRPO without a critic or a reference, ORZ's
base-model template, DAPO's clip-higher and dynamic sampling, and Skywork's adaptive entropy.

    python playground/qwen3_8b_grpo.py model.path=/models/Qwen3-8B-Base \
        data.train=[/data/orz_math_57k_collected.json] data.eval={aime24: /data/aime2024.json}

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/qwen3_8b_grpo.py model.path=Qwen3-8B

Launch it with `make qwen3-8b-grpo NODES=4 MODEL=... DATA=... CLUSTER=configs/clusters/h100_4x8.yaml`.
Every setting below that differs from the 7B GRPO recipe it starts from says why.
"""
import sys
from dataclasses import replace

from orz.train import main
from playground.orz_7b_grpo import RECIPE as GRPO

RECIPE = replace(
    GRPO,
    # Qwen3's 8B has 36 layers of width 4096 and an untied 151,936-row head: the actor (TP2 DP8, with
    # recomputation and ZeRO-1, as the 7B recipe) fits an H100 by the planner; 16 engines of TP1 take
    # the other 16 GPUs.
    # Its KV cache is 2.6× Qwen2.5-7B's per token (36 layers × 8 KV heads against 28 × 4): 32 sequences of
    # 10k tokens take 45 GiB per engine, where the 7B recipe's 64 would need 90.
    rollout=replace(GRPO.rollout, n_samples=16, max_new_tokens=8192, max_num_seqs=32),
    algorithm=replace(
        GRPO.algorithm,
        # DAPO's clip-higher: a wider upper clip lets rare tokens' probabilities grow, which keeps
        # entropy from collapsing on a base model.
        clip_low=0.2, clip_high=0.28,
        # Groups whose 16 samples all score alike carry no gradient: drawn again (DAPO).
        dynamic_sampling=True,
        # Every token weighs the same whatever its response's length (DAPO, Skywork-OR1).
        loss_agg="token-mean",
        # Skywork-OR1's adaptive entropy control: a coefficient that holds entropy near 0.2.
        entropy_target=0.2, entropy_step=0.005, entropy_max_coef=0.005,
    ),
    trainer=replace(GRPO.trainer, prompts_per_iteration=256, output_dir="runs/qwen3_8b_grpo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
