"""Open-Reasoner-Zero's PPO recipe for Qwen2.5-7B base (ORZ paper, 7B settings).

    python playground/orz_7b_ppo.py model.path=/models/Qwen2.5-7B \
        data.train=[/data/orz_math_57k_collected.json] data.eval={aime24: /data/aime2024.json}

Planned for 4 nodes × 8 H100 80 GB (configs/clusters/h100_4x8.yaml): memory per GPU and time per
iteration of this very recipe (any key=value changes too) are

    python -m orz.plan --cluster configs/clusters/h100_4x8.yaml --recipe playground/orz_7b_ppo.py model.path=Qwen2.5-7B

Launch it with `make orz-7b-ppo NODES=4 MODEL=... CLUSTER=configs/clusters/h100_4x8.yaml`
(scripts/slurm), which runs the same plan before it starts. Every setting below that is not a
default says why; everything else is `orz.config`'s default.
"""
import sys

from orz.config import (AlgorithmConfig, DataConfig, ExperimentConfig, ModelConfig, RoleConfig, RolloutConfig,
                        TrainerConfig)
from orz.train import main

RECIPE = ExperimentConfig(
    # 32 GPUs without colocation: actor 8 (TP2 DP4), critic 8 (TP2 DP4), 16 vLLM engines (TP1).
    # The actor fits in 80 GB with full recomputation and the distributed optimizer (Adam states
    # sharded over DP): 54.7 GiB by the planner; 90.2 GiB without recomputation, 86.6 without ZeRO-1.
    model=ModelConfig(recompute=True),
    actor=RoleConfig(tp=2, dp=4, lr=1e-6, warmup_steps=50, micro_batch_tokens=16384, use_distributed_optimizer=True),
    critic=RoleConfig(tp=2, dp=4, lr=5e-6, warmup_steps=50, steps_per_iteration=12,  # ORZ: 12 critic updates
                      micro_batch_tokens=16384, use_distributed_optimizer=True),
    rollout=RolloutConfig(num_engines=16, n_samples=64, temperature=1.0, top_p=1.0, max_new_tokens=8000,
                          stop=["</answer>"], gpu_memory_utilization=0.85,
                          # 64 sequences of 10k tokens: 34 GiB of KV cache per engine; vLLM's 256 would need 137
                          max_num_seqs=64),
    # PPO with GAE γ = λ = 1, reward on the last token, no KL (ORZ's "minimalist" recipe);
    # advantages whitened over the buffer, as ORZ does (also GAE's default here).
    algorithm=AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, kl_coef=0.0, whiten_advantages=True),
    data=DataConfig(template="think_answer", prompt_max_tokens=2048),
    trainer=TrainerConfig(iterations=1000, prompts_per_iteration=128, eval_every=10, eval_n=1, save_every=10,
                          output_dir="runs/orz_7b_ppo", ray_address="auto"),
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
