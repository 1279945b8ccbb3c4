"""On-policy distillation of Qwen3-8B-Base from Qwen3-32B on math (docs/distillation.md): the
student samples, the teacher scores every token it wrote, and each token's advantage is the
teacher's log-prob less the student's (reverse KL, the policy-gradient form), with no task reward.

    python playground/qwen3_8b_distill.py model.path=/models/Qwen3-8B-Base \
        teachers.qwen3_32b.path=/models/Qwen3-32B data.train=[/data/orz_math_57k_collected.json]

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/qwen3_8b_distill.py model.path=Qwen3-8B teachers.qwen3_32b.path=Qwen3-32B

Launch it with `make qwen3-8b-distill NODES=4 MODEL=... DATA=... CLUSTER=configs/clusters/h100_4x8.yaml
ARGS='teachers.qwen3_32b.path=/shared/Qwen3-32B'`. Every setting below that differs from the
Qwen3-8B GRPO recipe it starts from says why.
"""
import sys
from dataclasses import replace

from orz.config import DistillConfig, TeacherConfig
from orz.train import main
from playground.qwen3_8b_grpo import RECIPE as GRPO

RECIPE = replace(
    GRPO,
    # 32 GPUs: the actor on 8 (TP2 DP4, recomputation and ZeRO-1), the teacher on 8 (TP4 DP2: 32B
    # parameters in bf16 are 16 GiB per GPU), 16 engines of TP1 on the rest.
    actor=replace(GRPO.actor, dp=4),
    teachers={"qwen3_32b": TeacherConfig(path="Qwen3-32B", tp=4, dp=2, micro_batch_tokens=GRPO.actor.micro_batch_tokens)},
    # The reverse KL alone: every token of every sample has a signal, so 4 samples per prompt do
    # (no group baseline is needed), and no group is ever uninformative (no dynamic sampling).
    distill=DistillConfig(objective="reverse_kl", coef=1.0),
    rollout=replace(GRPO.rollout, n_samples=4),
    algorithm=replace(GRPO.algorithm, dynamic_sampling=False, entropy_target=None),
    trainer=replace(GRPO.trainer, prompts_per_iteration=512, output_dir="runs/qwen3_8b_distill"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
