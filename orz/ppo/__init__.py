"""PPO/GRPO: ``core_algos`` (the math, pure torch), ``experience`` (Experience and batching),
``actors`` (Ray worker groups around Megatron models) and ``trainer`` (the loop)."""
