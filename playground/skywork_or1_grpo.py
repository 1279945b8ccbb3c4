"""A Skywork-OR1-style GRPO recipe: adaptive entropy control and multi-stage context growth
(8k -> 16k -> 32k tokens), on a 7B model, on Skywork-OR1's math + code mixture. Its parquet files
load as shipped: each row's verifier (math-verify, or the sandbox for code) is read from it.

    python playground/skywork_or1_grpo.py model.path=/models/DeepSeek-R1-Distill-Qwen-7B data.template=chat \
        data.train=[/data/skywork_or1/math.parquet,/data/skywork_or1/code.parquet]

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml), every stage (R1-Distill-Qwen-7B
has Qwen2.5-7B's shapes):

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/skywork_or1_grpo.py model.path=Qwen2.5-7B
"""
import sys
from dataclasses import replace

from orz.config import StageConfig
from orz.train import main
from playground.orz_7b_grpo import RECIPE as GRPO

RECIPE = replace(
    GRPO,
    # 24 sequences of 34k tokens (the last stage's) take 45 GiB of KV cache per engine.
    rollout=replace(GRPO.rollout, n_samples=16, stop=[], max_num_seqs=24),
    algorithm=replace(
        GRPO.algorithm,
        # Entropy kept near a target by an adaptive coefficient instead of a fixed bonus.
        entropy_target=0.2, entropy_step=0.005, entropy_max_coef=0.005,
        dynamic_sampling=True,  # groups whose samples all score alike carry no signal
        loss_agg="token-mean",
    ),
    trainer=replace(GRPO.trainer, prompts_per_iteration=256, output_dir="runs/skywork_or1_grpo"),
    # Context grows with training; each stage resumes from the previous one's checkpoint.
    stages=[
        StageConfig(iterations=300, overrides={"rollout.max_new_tokens": 8192}),
        # Each stage's micro-batches hold its longest sample (2048 prompt tokens + the response).
        StageConfig(iterations=300, overrides={"rollout.max_new_tokens": 16384, "actor.micro_batch_tokens": 18432}),
        StageConfig(iterations=400, overrides={"rollout.max_new_tokens": 32768, "actor.micro_batch_tokens": 34816,
                                               "actor.lr": 5e-7}),
    ],
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
