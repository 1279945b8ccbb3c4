"""The Qwen3-8B math recipe on the mixture of experts Qwen3-30B-A3B-Base, with expert parallelism:
128 experts in each of its 48 layers, 8 routed per token (3.3B of its 30.5B parameters active).

    python playground/qwen3_30b_a3b_grpo.py model.path=/models/Qwen3-30B-A3B-Base \
        data.train=[/data/orz_math_57k_collected.json] data.eval={aime24: /data/aime2024.json}

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/qwen3_30b_a3b_grpo.py model.path=Qwen3-30B-A3B

Launch it with `make qwen3-30b-a3b-grpo NODES=4 MODEL=... DATA=... CLUSTER=configs/clusters/h100_4x8.yaml`.
Untested here: expert parallelism runs on CPU over gloo in the suite (a tiny Qwen3-MoE), never at this
size, and neither Transformer Engine's grouped GEMM nor DeepEP is used (docs/models.md).
"""
import sys
from dataclasses import replace

from orz.train import main
from playground.qwen3_8b_grpo import RECIPE as QWEN3_8B

RECIPE = replace(
    QWEN3_8B,
    # 16 actor GPUs: TP1 (a MoE at TP > 1 needs sequence parallelism, which orz's builder keeps off),
    # the experts spread over EP8 (16 experts per GPU) inside each node, the rest data-parallel (DP16).
    # With recomputation and ZeRO-1 (the experts' Adam states over their 2 replicas) it fits an H100
    # once a micro-batch holds just the longest sample (2048 + 8192 tokens): at TP1 its logits over
    # Qwen3's 151,936-token vocabulary take 22 GiB (35 GiB at the 8B recipe's 16384 tokens).
    actor=replace(QWEN3_8B.actor, tp=1, dp=16, ep=8, micro_batch_tokens=10240),
    # 61 GB of bf16 weights leave an H100 no room for a KV cache: 8 engines of TP2 on the other 16 GPUs,
    # each with 64 sequences (its 4 KV heads split over 2 GPUs: 32 GiB of KV cache for 64 of 10k tokens).
    rollout=replace(QWEN3_8B.rollout, num_engines=8, engine_tp=2, max_num_seqs=64),
    trainer=replace(QWEN3_8B.trainer, output_dir="runs/qwen3_30b_a3b_grpo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
