"""PPO/GRPO: ``core_algos`` (the math, pure torch), ``replay_buffer`` (Experience and batching),
``actors`` (Ray worker groups around Megatron models) and ``trainer`` (the loop)."""
