"""GRPO with LoRA on Qwen3-32B on one node: the Qwen3-8B GRPO recipe's algorithm, rank-32 adapters
on every linear layer of the actor, the engines serving the adapter (docs/lora.md).

    python playground/qwen3_32b_lora_grpo.py model.path=/models/Qwen3-32B \
        data.train=[/data/orz_math_57k_collected.json] data.eval={aime24: /data/aime2024.json}

Planned for 1 node × 8 H100 80 GB (configs/clusters/h100_1x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_1x8.yaml --recipe playground/qwen3_32b_lora_grpo.py model.path=Qwen3-32B

At full weights (actor.lora.rank=0 actor.lora.alpha=32) the same recipe does not fit: its actor needs
152 GiB per GPU at TP4 (bf16 weights, fp32 grads, masters and Adam moments: 18 bytes a parameter)
and 83 GiB at TP8; it fits at TP8 DP2 with ZeRO-1 (60 GiB), on 16 GPUs beside the engine's 4: three
nodes against this recipe's one. tests/test_plan.py plans both.
Launch it with `make qwen3-32b-lora-grpo NODES=1 MODEL=... DATA=... CLUSTER=configs/clusters/h100_1x8.yaml`.
"""
import sys
from dataclasses import replace

from orz.config import LoraConfig
from orz.train import main
from playground.qwen3_8b_grpo import RECIPE as GRPO

RECIPE = replace(
    GRPO,
    # The actor at TP4 on 4 GPUs (its frozen bf16 base 16 GiB per GPU, the rank-32 adapters' masters,
    # grads and Adam moments a few GiB), one engine of TP4 on the other 4.
    # LoRA's best learning rate is about ten times full fine-tuning's (Thinking Machines, "LoRA
    # Without Regret"); alpha = 2·rank.
    actor=replace(GRPO.actor, tp=4, dp=1, lr=1e-5, lora=LoraConfig(rank=32, alpha=64.0)),
    rollout=replace(GRPO.rollout, num_engines=1, engine_tp=4),
    trainer=replace(GRPO.trainer, prompts_per_iteration=64, output_dir="runs/qwen3_32b_lora_grpo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
