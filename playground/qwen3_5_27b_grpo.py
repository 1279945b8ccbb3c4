"""The ORZ/Skywork-OR1 math recipe (as the Qwen3-8B one) on Qwen3.5-27B, the hybrid the field now trains
from: 48 Gated DeltaNet layers between 16 gated full-attention layers, a 248,320-token vocabulary.

    python playground/qwen3_5_27b_grpo.py model.path=/models/Qwen3.5-27B \
        data.train=[/data/orz_math_57k_collected.json] data.eval={aime24: /data/aime2024.json}

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml):

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/qwen3_5_27b_grpo.py model.path=Qwen3.5-27B

Launch it with `make qwen3-5-27b-grpo NODES=4 MODEL=... DATA=... CLUSTER=configs/clusters/h100_4x8.yaml`.
The released checkpoint is the vision-language wrapper: RL trains its language model, the engines serve
it text-only, and exports keep its vision tower (docs/models.md). Untested here: the Gated DeltaNet
layers run fla's kernels and Transformer Engine on GPU, neither of which this CPU suite runs.
"""
import sys
from dataclasses import replace

from orz.train import main
from playground.qwen3_8b_grpo import RECIPE as QWEN3_8B

RECIPE = replace(
    QWEN3_8B,
    # 16 actor GPUs at TP4 DP4 with recomputation and ZeRO-1 (TP is at most its 4 KV heads): 27B of bf16
    # weights and their fp32 gradients take 38 GiB per GPU, a 10k-token micro-batch's activations 9 GiB
    # (its logits over 248,320 / 4 vocabulary rows in chunks; the GDN layers' chunk states). Rows are not
    # packed: Megatron's Gated DeltaNet takes packed rows only through fla's varlen kernels, untested here.
    actor=replace(QWEN3_8B.actor, tp=4, dp=4, micro_batch_tokens=10240, pack=False),
    # 4 engines of TP4 on the other 16 GPUs. A sequence holds 144 MiB of recurrent state (48 GDN layers,
    # fp32) besides the KV cache of the 16 attention layers, whatever its length: 128 sequences of 10k
    # tokens take 25 GiB per GPU, where 64 attention layers would hold 80 GiB.
    rollout=replace(QWEN3_8B.rollout, num_engines=4, engine_tp=4, max_num_seqs=128),
    trainer=replace(QWEN3_8B.trainer, output_dir="runs/qwen3_5_27b_grpo"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
