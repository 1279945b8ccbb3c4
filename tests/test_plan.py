"""orz.plan against numbers derived by hand for a small made-up model, plus bad input and the CLI.

    .venv/bin/python -m pytest -q tests/test_plan.py
"""
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orz.models.arch import GatedDeltaNetArch, ModelArch, ModelConfigError, MoeArch
from orz.plan import (GIB, GPUS, MODELS, Cluster, ModelParallel, Placement, PlanError, Rollout, TrainParallel,
                      Workload, blockers, main, plan, stage_params)

REPO = Path(__file__).resolve().parent.parent
H100_4X8 = str(REPO / "configs/clusters/h100_4x8.yaml")
PPO_7B = str(REPO / "playground/orz_7b_ppo.py")

# h=64, f=256, L=4, a=4 heads, g=2 KV groups, d=16, V=1001 (odd, so TP pads it), untied, no biases.
TINY = ModelArch(family="llama", vocab_size=1001, hidden_size=64, intermediate_size=256, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, max_position_embeddings=256)
# 4 prompts × 8 samples = 32 samples; max 32 + 96 = 128 tokens (sizes memory); mean 16 + 48 = 64 (sizes time).
WORK = Workload(prompts_per_iteration=4, n_samples=8, prompt_max_tokens=32, max_new_tokens=96,
                mean_prompt_tokens=16, mean_response_tokens=48)
# 1 node × 8 GPUs of 1 GiB; no reserved memory, so limits are the whole GPU.
CLUSTER = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gib=1.0, gpu="H100", reserved_gib=0.0,
                  train_mfu=0.5, hbm_efficiency=0.5)

def qwen25_7b_actor_gib(tp: int, pp: int, dp: int, distributed_optimizer: bool, tokens: int = 16384) -> float:
    """The Qwen2.5-7B actor's GiB per GPU without recomputation, on its heaviest pipeline stage, by
    the formulas of the docstrings of orz.plan.memory.train_memory, layer_params, stage_params,
    layer_activation_bytes and logits_bytes, from the numbers of the model's config.json (untied,
    q/k/v biases), plus the cluster's 2 GiB reserved per process. Written out here, not called."""
    V, h, f, L, a, g, d = 152064, 3584, 18944, 28, 28, 4, 128  # V is a multiple of tp: no padding
    layer = (h * d * (2 * a + 2 * g) + 3 * h * f + d * (a + 2 * g)) // tp + 2 * h  # weights, biases / t; norms
    embedding = V * h // tp
    activations_per_layer = tokens * 8 * h + tokens * (4 * a * d + 4 * g * d + 6 * f) // tp  # A(T) without SP
    chunk = min(tokens, (128 << 20) // (4 * V // tp))  # the default: 128 MiB of fp32 logits per rank
    logits = chunk * V // tp * 16 + tokens * h * 6 + 4 * V // tp * h  # a chunk's logits, per token, LM head grad
    per_stage = L // pp
    if pp == 1:  # (parameters, activations): n = 1 micro-batch in flight
        stages = [(per_stage * layer + embedding + h + embedding, per_stage * activations_per_layer + logits)]
    else:  # the first stage holds pp micro-batches under 1F1B, the last one and the logits
        stages = [(per_stage * layer + embedding, pp * per_stage * activations_per_layer),
                  (per_stage * layer + h + embedding, per_stage * activations_per_layer + logits)]
    totals = [2 * params + 4 * params + 12 * params // (dp if distributed_optimizer else 1) + kept
              for params, kept in stages]
    return round((max(totals) + 2 * 2**30) / 2**30, 1)


# Hand-derived pieces reused below:
#   one layer, split part: attention h·d·(2a+2g) = 64·16·12 = 12288, MLP 3·h·f = 49152 → 61440
#   one layer on a TP=2 rank: 61440/2 + norms 2h = 30720 + 128 = 30848
#   vocabulary at TP=2, padded to a multiple of 2: 1002; one rank's embedding: 1002·64/2 = 32064
#   TP=2 PP=2 stages: first = 2 layers + embedding = 61696 + 32064 = 93760
#                     last  = 2 layers + final norm + LM head = 61696 + 64 + 32064 = 93824
#   A(T=128), one layer's activations, TP=2 (4·a·d + 4·g·d + 6f = 256 + 128 + 1536 = 1920):
#     with SP    128·8·64/2 + 128·1920/2 = 32768 + 122880 = 155648
#     without SP 128·8·64   + 128·1920/2 = 65536 + 122880 = 188416
#   log-probs, TP=2 (one chunk holds all 128 tokens): training 128·501·16 + 128·64·6 + 4·501·64
#     = 1026048 + 49152 + 128256 = 1203456; forward-only 128·501·10 + 128·64·2 = 641280 + 16384 = 657664


def tiny_plan(**changes):
    placement = Placement(
        actor=TrainParallel(tp=2, pp=2, dp=2, micro_batch_tokens=128, sequence_parallel=True,
                            use_distributed_optimizer=True),
        critic=TrainParallel(tp=2, pp=2, dp=2, micro_batch_tokens=128, recompute=True, use_distributed_optimizer=True),
        ref=ModelParallel(tp=2, pp=1, dp=4, micro_batch_tokens=128),
        rollout=Rollout(num_engines=8, engine_tp=1, gpu_memory_utilization=0.5, max_num_seqs=8),
        colocate=True, offload_idle_roles=True,
    )
    return plan(TINY, CLUSTER, replace(placement, **changes), WORK, "tiny")


def test_presets_match_published_parameter_counts():
    published_b = {"Qwen2.5-0.5B": 0.49, "Qwen2.5-1.5B": 1.54, "Qwen2.5-7B": 7.62, "Qwen2.5-32B": 32.76,
                   "Llama-3.1-8B": 8.03, "Qwen3-8B": 8.19, "Qwen3-32B": 32.76, "Qwen3-30B-A3B": 30.53,
                   # language models only: the published 27B and 35B count the vision tower too
                   "Qwen3.5-27B": 26.90, "Qwen3.5-35B-A3B": 34.66}
    assert {name: round(arch.num_params / 1e9, 2) for name, arch in MODELS.items()} == published_b


# The published config.json files, as the trainer reads them (transformers 4 writes `rope_scaling`).
_LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "hidden_act": "silu",
               "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
               "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
               "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
          "max_position_embeddings": 40960, "model_type": "qwen3", "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
          "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
          "use_sliding_window": False, "vocab_size": 151936}


# Qwen3.5's released checkpoints: the vision-language wrapper, its language model in text_config.
_QWEN3_5_TEXT = {"attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256,
                 "hidden_act": "silu", "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                 "linear_num_key_heads": 16, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
                 "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
                 "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "vocab_size": 248320,
                 "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                     "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"}}


def _qwen3_5(architecture: str, **text) -> dict:
    layers = text["num_hidden_layers"]
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return {"architectures": [architecture], "tie_word_embeddings": False, "vision_config": {"hidden_size": 1152},
            "text_config": _QWEN3_5_TEXT | {"layer_types": types} | text}


@pytest.mark.parametrize("name, config", [
    ("Qwen3.5-27B", _qwen3_5("Qwen3_5ForConditionalGeneration", model_type="qwen3_5_text", hidden_size=5120,
                             intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                             num_key_value_heads=4, linear_num_value_heads=48)),
    ("Qwen3.5-35B-A3B", _qwen3_5("Qwen3_5MoeForConditionalGeneration", model_type="qwen3_5_moe_text", hidden_size=2048,
                                 num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                                 linear_num_value_heads=32, moe_intermediate_size=512, num_experts=256,
                                 num_experts_per_tok=8, shared_expert_intermediate_size=512,
                                 router_aux_loss_coef=0.001)),
    ("Llama-3.1-8B", _LLAMA31_8B),
    ("Qwen3-8B", _QWEN3 | dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, max_window_layers=36)),
    ("Qwen3-32B", _QWEN3 | dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                num_attention_heads=64, max_window_layers=64)),
    ("Qwen3-30B-A3B", _QWEN3 | dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                                    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                                    num_key_value_heads=4, max_window_layers=48, moe_intermediate_size=768,
                                    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
                                    router_aux_loss_coef=0.001)),
])
def test_presets_equal_what_the_trainer_reads_from_the_published_config(tmp_path, name, config):
    """The trainer reads a model with `read_arch` (run_rules.check) and refuses what it cannot build:
    each preset is exactly what it reads from that model's config.json, llama3 RoPE scaling included."""
    from orz.models.arch import read_arch

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_arch(tmp_path) == MODELS[name]


def test_stage_params_by_hand():
    assert stage_params(TINY, 2, 2, "lm", 1) == [93760, 93824]
    # TP=PP=1, no padding needed at multiple 1: the stage is the whole model.
    assert stage_params(TINY, 1, 1, "lm", 1) == [TINY.num_params]
    # value head h + 1 replaces the LM head: 61696 + 64 + 65
    assert stage_params(TINY, 2, 2, "value", 1) == [93760, 61825]
    # tied, PP=2: the last stage keeps its own copy of the embedding; PP=1: shared, counted once
    tied = replace(TINY, tie_word_embeddings=True)
    assert stage_params(tied, 2, 2, "lm", 1) == [93760, 93824]
    assert stage_params(tied, 2, 1, "lm", 1) == [4 * 30848 + 32064 + 64]


def test_actor_memory_by_hand_no_recompute():
    # actor TP2 PP2 DP2, SP, distributed optimizer, no recompute; the last stage is heaviest:
    #   P = 93824: weights 2P = 187648, grads 4P = 375296, optimizer 12P/DP = 562944
    #   activations: 1 micro-batch in flight · 2 layers · 155648 + log-probs 1203456 = 1514752
    # (the first stage: 93760·(2+4+6) + 2 in flight·2·155648 = 1125120 + 622592 = 1747712 < 2640640)
    actor = tiny_plan().row("actor")
    assert (actor.weights, actor.grads, actor.optimizer, actor.activations) == (187648, 375296, 562944, 1514752)
    assert actor.total == 2640640 and actor.parallel == "TP2 PP2 DP2" and actor.gpus == 8


def test_context_parallel_splits_the_layers_tokens_and_the_optimizer_not_the_logits():
    # actor TP2 PP2 CP2 DP1 on the same 8 GPUs, T = 128: each CP rank's layers hold T/2 = 64 tokens,
    # 155648/2 = 77824 per layer (linear in T); the log-probs read the gathered hidden states of all
    # T (1203456, as at CP1); the distributed optimizer shards over DP·CP: 12·93824/2 = 562944.
    # Last stage: 1 in flight · 2 · 77824 + 1203456 = 1359104 (first: 2 in flight · 2 · 77824 = 311296,
    # with 93760·12 = 1125120 the lighter)
    par = TrainParallel(tp=2, pp=2, cp=2, dp=1, micro_batch_tokens=128, sequence_parallel=True,
                        use_distributed_optimizer=True)
    actor = tiny_plan(actor=par).row("actor")
    assert (actor.optimizer, actor.activations) == (562944, 1359104)
    assert actor.parallel == "TP2 PP2 CP2 DP1" and actor.gpus == 8


def test_critic_memory_by_hand_full_recompute():
    # critic TP2 PP2 DP2, full recompute, no SP, value head: the first stage is heaviest:
    #   P = 93760: 187520 + 375040 + 12·93760/2 = 562560
    #   activations: 2 in flight · 2 layers · layer input 2·T·h = 16384, + one layer re-run 188416 = 253952
    # (last stage: P = 61825 → 741900, + 1·2·16384 + 188416 = 963084, no logits for a value head)
    critic = tiny_plan().row("critic")
    assert (critic.weights, critic.grads, critic.optimizer, critic.activations) == (187520, 375040, 562560, 253952)


def test_optimizer_without_distributed_optimizer_is_on_every_rank():
    # 12 bytes/param (fp32 master + m + v) not divided by DP: 12·93824
    par = TrainParallel(tp=2, pp=2, dp=2, micro_batch_tokens=128, sequence_parallel=True)
    actor = tiny_plan(actor=par).row("actor")
    assert actor.optimizer == 12 * 93824


def test_reference_memory_by_hand():
    # reference TP2 PP1: P = 4·30848 + 2·32064 + 64 = 187584 → weights 375168
    # activations: one layer without SP 188416 + forward-only log-probs 657664 = 846080; no grads or optimizer
    ref = tiny_plan().row("ref")
    assert (ref.weights, ref.grads, ref.optimizer, ref.activations) == (375168, 0, 0, 846080)


def test_rollout_memory_by_hand():
    # engine TP1; vLLM pads V to 64: 1024 → P = 4·61568 + 2·1024·64 + 64 = 377408 → weights 754816
    # KV per token: 2·L·g·d·2 = 2·4·2·16·2 = 512; concurrency min(8, 32/8) = 4; 4·128 tokens·512 = 262144
    rollout = tiny_plan().row("rollout")
    assert (rollout.weights, rollout.kv_cache) == (754816, 262144)
    assert rollout.limit == int(0.5 * GIB)
    # 1 engine of TP4 > g = 2 (beside a TP2 DP2 actor: colocated engines have TP1): KV heads are
    # replicated, one per GPU: 2·4·1·16·2 = 256 bytes per token; concurrency min(8, 32/1) = 8
    wide = tiny_plan(colocate=False, critic=None, ref=None, actor=TrainParallel(tp=2, dp=2, micro_batch_tokens=128),
                     rollout=Rollout(num_engines=1, engine_tp=4, max_num_seqs=8)).row("rollout")
    assert wide.kv_cache == 8 * 128 * 256


def test_colocated_limits_subtract_what_idle_roles_keep():
    # reserved 0.25 GiB per process: with offload, each of 3 other processes keeps only that
    cluster = replace(CLUSTER, reserved_gib=0.25)
    p = plan(TINY, cluster, tiny_plan().placement, WORK)
    assert p.row("actor").limit == GIB - 3 * GIB // 4 and p.row("actor").overhead == GIB // 4
    # without offload the others keep their states too, and vLLM its whole 0.25 GiB budget:
    #   critic (first stage) 187520 + 375040 + 562560 = 1125120, reference 375168, each + 0.25 GiB
    placement = replace(p.placement, offload_idle_roles=False,
                        rollout=replace(p.placement.rollout, gpu_memory_utilization=0.25))
    kept = plan(TINY, cluster, placement, WORK)
    assert kept.row("actor").limit == GIB - (GIB // 4 + 2 * GIB // 4 + 1125120 + 375168)
    assert kept.row("rollout").limit == GIB // 4


def test_separate_gpus_have_the_whole_gpu():
    placement = replace(tiny_plan().placement, colocate=False,
                        actor=TrainParallel(tp=2, pp=1, dp=1, micro_batch_tokens=128),
                        critic=TrainParallel(tp=2, pp=1, dp=1, micro_batch_tokens=128),
                        ref=ModelParallel(tp=2, pp=1, dp=1, micro_batch_tokens=128),
                        rollout=Rollout(num_engines=2, engine_tp=1))
    p = plan(TINY, CLUSTER, placement, WORK)
    assert all(r.limit == GIB for r in p.memory if r.role != "rollout") and p.row("actor").gpus == 2
    # roles on their own 2 GPUs overlap: the slowest counts (forward FLOPs as in test_timing_by_hand)
    flop_s = 989e12 * 0.5
    fwd_lm = 2 * 309824 * 2048 + 512 * 64 * 2048
    assert p.timing.forward_s == pytest.approx(fwd_lm / (2 * flop_s))
    assert p.timing.train_s == pytest.approx(3 * fwd_lm / (2 * flop_s))


def test_timing_by_hand():
    t = tiny_plan().timing
    flop_s, byte_s = 989e12 * 0.5, 3.35e12 * 0.5
    # tokens n = 32 samples · 64 = 2048, s = 64
    # M (LM head) = L·61440 + V·h = 245760 + 64064 = 309824; value head: 245760 + 64 = 245824
    # forward FLOPs = 2·M·n + 2·L·a·d·s·n, with 2·L·a·d = 512
    fwd_lm = 2 * 309824 * 2048 + 512 * 64 * 2048
    fwd_value = 2 * 245824 * 2048 + 512 * 64 * 2048
    # colocated: each role on all 8 GPUs, one after another
    assert t.forward_s == pytest.approx((2 * fwd_lm + fwd_value) / (8 * flop_s))
    # actor 3× forward (no recompute), critic 4× (recompute)
    assert t.train_s == pytest.approx((3 * fwd_lm + 4 * fwd_value) / (8 * flop_s))
    # decode per engine: 32/8 = 4 samples at c = 4; mean context 16 + 48/2 = 40
    #   read = weights 754816 + 4·40·512 = 836736 bytes per step
    #   (memory bound: 4·(2M + 4·L·a·d·40) = 2.7 MFLOP take 5e-9 s, the read 5e-7 s)
    step = 836736 / byte_s
    assert t.decode_step_ms == pytest.approx(step * 1e3)
    # prefill: 4·16 prompt tokens at s = 16 on one GPU; decode: 4·48/4 = 48 steps
    prefill = (2 * 309824 * 64 + 512 * 16 * 64) / flop_s
    assert t.rollout_s == pytest.approx(prefill + 48 * step)
    assert t.rollout_tokens_per_s == pytest.approx(32 * 48 / t.rollout_s)
    assert t.iteration_s == pytest.approx(t.rollout_s + t.forward_s + t.train_s)


def _planned_recipes() -> dict[str, list[str]]:
    """playground recipe → the `python -m orz.plan ...` arguments its docstring gives."""
    import ast
    import shlex

    commands = {}
    for path in sorted((REPO / "playground").glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("python -m orz.plan ")]
        if lines:
            commands[path.stem] = shlex.split(lines[0])[3:]
    return commands


def test_every_large_recipe_names_its_cluster():
    large = {p.stem for p in (REPO / "playground").glob("*.py") if p.stem not in ("__init__",) and "tiny" not in p.stem}
    assert large == set(_planned_recipes()) == {"orz_7b_ppo", "orz_7b_grpo", "orz_32b_ppo", "skywork_or1_grpo",
                                                "qwen3_8b_grpo", "qwen3_8b_distill", "qwen3_30b_a3b_grpo",
                                                "qwen3_5_27b_grpo", "qwen3_32b_lora_grpo"}
    # ... and each has its Make target beside the others (`make qwen3-8b-grpo NODES=4 ...`)
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")  # the list continues over lines
    targets = next(line for line in makefile.splitlines() if line.startswith("SLURM_RECIPES"))
    assert set(targets.split(":=")[1].split()) == {name.replace("_", "-") for name in large}


@pytest.mark.parametrize("recipe", sorted(_planned_recipes()))
def test_every_large_recipe_fits_the_cluster_its_docstring_names(recipe, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the docstring's paths are relative to the repository
    args = _planned_recipes()[recipe]
    assert f"playground/{recipe}.py" in args and any(a.startswith("configs/clusters/") for a in args)
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and all(stage["problems"] == [] and stage["gpu_mem_gib"] == 79.6 for stage in out["stages"])
    assert all(r["total"] <= r["limit"] for stage in out["stages"] for r in stage["memory_gib"].values())
    if recipe == "skywork_or1_grpo":  # its three context stages, each planned at its own length
        assert [stage["stage"] for stage in out["stages"]] == ["stage 0", "stage 1", "stage 2"]


def test_lora_plans_qwen3_32b_on_one_node_where_full_weights_need_three(capsys, monkeypatch):
    """The LoRA recipe's actor (TP4, rank 32 on every linear layer): a frozen bf16 base, the
    adapters' bf16 copy, fp32 grads and 12 bytes of optimizer each (by hand: lora_params per layer
    at TP4), no reference role; 8 GPUs. The same recipe at full weights does not fit there, nor at
    TP8 on 2 nodes; at TP8 DP2 with ZeRO-1 it does, on 20 GPUs (3 nodes)."""
    monkeypatch.chdir(REPO)
    recipe = ["--cluster", "configs/clusters/h100_1x8.yaml", "--recipe", "playground/qwen3_32b_lora_grpo.py",
              "model.path=Qwen3-32B"]
    stage = _memory(capsys, *recipe)
    arch = MODELS["Qwen3-32B"]
    h, d, a, g, f, r = arch.hidden_size, arch.head_dim, arch.num_heads, arch.num_kv_heads, arch.intermediate_size, 32
    per_layer = (r * h + r * d * (a + 2 * g) // 4) + (r * a * d // 4 + h * r) + (r * h + r * 2 * f // 4) + (r * f // 4 + h * r)
    adapters = arch.num_layers * per_layer
    actor = stage["memory_gib"]["actor"]
    assert set(stage["memory_gib"]) == {"actor", "rollout"} and stage["gpus"] == 8 and stage["fits"]
    assert sum(role["gpus"] for role in stage["memory_gib"].values()) == 8
    base = stage_params(arch, 4, 1, "lm", 1)[0]
    assert (actor["weights"], actor["grads"], actor["optimizer"]) == (
        round(2 * (base + adapters) / GIB, 1), round(4 * adapters / GIB, 1), round(12 * adapters / GIB, 1))
    full = ["actor.lora.rank=0", "actor.lora.alpha=32"]
    assert not _memory(capsys, *recipe, *full)["fits"]
    assert not _memory(capsys, *recipe, *full, "actor.tp=8", "actor.use_distributed_optimizer=true", "--nodes", "2")["fits"]
    three = _memory(capsys, *recipe, *full, "actor.tp=8", "actor.dp=2", "actor.use_distributed_optimizer=true",
                    "--nodes", "3")
    assert three["fits"] and sum(role["gpus"] for role in three["memory_gib"].values()) == 20


def test_seven_b_actor_numbers_by_hand(capsys):
    # Qwen2.5-7B actor TP2, one rank: layer split part h·d·(2a+2g) + 3hf + qkv bias d·(a+2g)
    #   = 29360128 + 203685888 + 4608 = 233050624 → /2 + norms 7168 = 116532480, × 28 layers
    #   + embedding and LM head 2·(152064/2)·3584 + final norm 3584 → P = 3807910400
    # the 7B recipe's actor is TP2 DP4 with the distributed optimizer:
    # weights 2P = 7.1 GiB, grads 4P = 14.2 GiB, optimizer 12P/4 = 10.6 GiB
    main(["--cluster", H100_4X8, "--recipe", PPO_7B, "model.path=Qwen2.5-7B", "--json"])
    actor = json.loads(capsys.readouterr().out)["stages"][0]["memory_gib"]["actor"]
    params = 28 * 116532480 + 2 * 76032 * 3584 + 3584
    assert params == stage_params(MODELS["Qwen2.5-7B"], 2, 1, "lm", 1)[0] == 3807910400
    assert actor["parallel"] == "TP2 PP1 DP4"
    assert (actor["weights"], actor["grads"], actor["optimizer"]) == (
        round(2 * params / GIB, 1), round(4 * params / GIB, 1), round(12 * params / 4 / GIB, 1))


def test_a_teacher_is_planned_as_its_own_model_at_its_own_layout(capsys, monkeypatch):
    """The distillation recipe's Qwen3-32B teacher (TP4 DP2, frozen): its row holds the 32B's bf16
    weights per TP4 rank, no grads or optimizer, on its own 8 GPUs."""
    monkeypatch.chdir(REPO)
    main(["--cluster", H100_4X8, "--recipe", "playground/qwen3_8b_distill.py", "model.path=Qwen3-8B",
          "teachers.qwen3_32b.path=Qwen3-32B", "--json"])
    teacher = json.loads(capsys.readouterr().out)["stages"][0]["memory_gib"]["teachers.qwen3_32b"]
    params = stage_params(MODELS["Qwen3-32B"], 4, 1, "lm", 1)[0]
    assert params > 7.5e9  # a quarter of 32B: the teacher's own model, not the 8B student's
    assert (teacher["parallel"], teacher["weights"], teacher["grads"], teacher["optimizer"]) == (
        "TP4 PP1 DP2", round(2 * params / GIB, 1), 0, 0)


def _memory(capsys, *argv) -> dict:
    assert main([*argv, "--json"]) in (0, 1)
    [stage] = json.loads(capsys.readouterr().out)["stages"]
    return stage


def test_the_recipe_decides_roles_and_sizes_and_flags_the_cluster(capsys):
    base = ["--cluster", H100_4X8, "--recipe", PPO_7B, "model.path=Qwen2.5-7B"]
    plain = _memory(capsys, *base)["memory_gib"]
    assert {role: r["parallel"] for role, r in plain.items()} == {
        "actor": "TP2 PP1 DP4", "critic": "TP2 PP1 DP4", "rollout": "16×TP1"}
    # The trainer's rule for roles (run_rules): a KL term brings a reference; GRPO drops the critic.
    with_ref = _memory(capsys, *base, "algorithm.kl_coef=0.01", "rollout.num_engines=15")["memory_gib"]
    assert set(with_ref) == {"actor", "critic", "ref", "rollout"}
    assert set(_memory(capsys, *base, "algorithm.advantage=grpo")["memory_gib"]) == {"actor", "rollout"}
    wider = _memory(capsys, *base, "actor.tp=4", "actor.dp=2")["memory_gib"]["actor"]
    assert wider["parallel"] == "TP4 PP1 DP2" and wider["weights"] < plain["actor"]["weights"]
    # micro_batch_tokens unset: micro_batch_size rows of the longest sample (2048 + 8000 tokens)
    rows = _memory(capsys, *base, "actor.micro_batch_tokens=0", "actor.micro_batch_size=1")["memory_gib"]["actor"]
    exact = _memory(capsys, *base, "actor.micro_batch_tokens=10048")["memory_gib"]["actor"]
    assert rows == exact
    assert _memory(capsys, *base, "--nodes", "8")["gpus"] == 64


def test_without_a_cluster_file_the_flags_describe_it(capsys):
    code = main(["--nodes", "1", "--gpus-per-node", "8", "--gpu-mem-gib", "79.6", "model.path=Qwen2.5-0.5B",
                 "algorithm.advantage=grpo", "rollout.num_engines=4", "actor.dp=4", "--json"])
    out = capsys.readouterr().out
    assert code == 0 and out.count("\n") == 1
    assert {r["parallel"] for r in json.loads(out)["stages"][0]["memory_gib"].values()} == {"TP1 PP1 DP4", "4×TP1"}
    assert main(["--nodes", "1", "model.path=Qwen2.5-0.5B"]) == 2
    assert "give --cluster FILE, or --nodes, --gpus-per-node and --gpu-mem-gib" in capsys.readouterr().err


def test_table_output(capsys):
    assert main(["--cluster", str(REPO / "configs/clusters/h100_16x8.yaml"), "--recipe",
                 str(REPO / "playground/orz_32b_ppo.py"), "model.path=Qwen2.5-32B"]) == 0
    out = capsys.readouterr().out
    assert "Qwen2.5-32B" in out and "TP8 PP2 DP2" in out and "per iteration" in out and "assumptions" in out


def test_does_not_fit_names_role_component_and_the_overrides_that_fix_it(capsys):
    # the 7B actor with neither recomputation nor the distributed optimizer
    code = main(["--cluster", H100_4X8, "--recipe", PPO_7B, "model.path=Qwen2.5-7B", "model.recompute=false",
                 "actor.use_distributed_optimizer=false"])
    out = " ".join(capsys.readouterr().out.split())  # rich folds long lines
    assert code == 1
    assert "actor does not fit" in out and "largest part: optimizer" in out  # not the logits, held a chunk at a time
    # 68.2 and 73.9 GiB (the first of two pipeline stages, with two micro-batches in flight)
    fits_tp, fits_pp = qwen25_7b_actor_gib(4, 1, 2, False), qwen25_7b_actor_gib(2, 2, 2, False)
    assert "Would fit with: actor.use_distributed_optimizer=true" in out  # the biggest part's own fix first
    assert f"; actor.tp=4 actor.dp=2 ({fits_tp} GiB); actor.pp=2 actor.dp=2 ({fits_pp} GiB)" in out
    p = plan(MODELS["Qwen2.5-7B"], Cluster(nodes=4, gpus_per_node=8, gpu_mem_gib=79.6),
             Placement(actor=TrainParallel(tp=1, dp=4), rollout=Rollout(num_engines=16, max_num_seqs=64)), Workload())
    [problem] = blockers(p)
    assert problem.startswith("actor does not fit") and "together" in problem
    fix = problem.split("Would fit with: ")[1].split(" together")[0]
    assert fix == "actor.use_distributed_optimizer=true actor.tp=4 actor.dp=1"  # stacked: the latest tp, dp


def test_rollout_kv_cache_that_does_not_fit_suggests_max_num_seqs():
    p = plan(MODELS["Qwen2.5-7B"], Cluster(nodes=4, gpus_per_node=8, gpu_mem_gib=79.6),
             Placement(actor=TrainParallel(tp=2, dp=8, recompute=True, use_distributed_optimizer=True),
                       rollout=Rollout(num_engines=16, max_num_seqs=256)),
             Workload())
    [problem] = blockers(p)
    # KV budget: 0.85·79.6 GiB − 14.2 GiB weights − 2 GiB reserved = 51.5 GiB; a 10240-token sequence
    # takes 10240·2·28·4·128·2 bytes = 0.55 GiB → 94 sequences
    assert problem.startswith("rollout does not fit") and "largest part: kv_cache" in problem
    assert "rollout.max_num_seqs=94" in problem


def test_gpu_memory_utilization_beyond_what_colocated_roles_leave():
    # 3 other processes keep 0.25 GiB each: vLLM cannot have 0.99 of the GPU
    placement = replace(tiny_plan().placement,
                        rollout=Rollout(num_engines=8, engine_tp=1, gpu_memory_utilization=0.99, max_num_seqs=1))
    p = plan(TINY, replace(CLUSTER, reserved_gib=0.25), placement, WORK)
    assert any("gpu_memory_utilization 0.99 asks for" in problem for problem in blockers(p))


@pytest.mark.parametrize("changes, message", [
    (dict(actor=TrainParallel(tp=2, pp=1, dp=2, micro_batch_tokens=128)), "actor's TP·PP·DP = 2·1·2 = 4 must equal the engines' 8 GPUs"),
    (dict(colocate=False, critic=None, ref=None, actor=TrainParallel(tp=3, dp=1, micro_batch_tokens=128)),
     "actor.tp=3 does not divide num_attention_heads=4"),
    (dict(colocate=False, critic=None, ref=None, actor=TrainParallel(tp=1, pp=3, dp=1, micro_batch_tokens=128)),
     "actor.pp=3 does not divide num_hidden_layers=4"),
    (dict(actor=TrainParallel(tp=2, dp=4, micro_batch_tokens=100)), "actor.micro_batch_tokens=100 cannot hold the longest"),
    (dict(rollout=Rollout(num_engines=3)), "num_engines·engine_tp = 3·1 = 3 ≠ 8 GPUs"),
    (dict(rollout=Rollout(num_engines=1, engine_tp=8)), "rollout.engine_tp=8 must divide num_attention_heads=4"),
    (dict(colocate=False, critic=None, ref=None, actor=TrainParallel(tp=2, dp=2, micro_batch_tokens=128),
          rollout=Rollout(num_engines=8)), "GPUs needed: actor 4 (2·1·2 workers) + rollout 8 (8 engines × TP1) = 12 > 8 GPUs"),
])
def test_placements_that_cannot_run(changes, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        tiny_plan(**changes)


@pytest.mark.parametrize("yaml_text, overrides, message", [
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80, nodez: 2}", [],
     "cluster: unknown key 'nodez' (did you mean 'nodes'?)"),
    ("clustre: {}", [], "unknown key 'clustre' (did you mean 'cluster'?)"),
    ("cluster: {nodes: '1', gpus_per_node: 8, gpu_mem_gib: 80}", [], "cluster.nodes: expected int, got '1'"),
    ("cluster: {nodes: 1, gpus_per_node: 8}", [], "cluster: missing key 'gpu_mem_gib'"),
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80, gpu: B300}", [], "gpu='B300' is not a preset"),
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80}\nworkload: {mean_response_tokens: 0}", [],
     "mean_response_tokens must be positive, got 0"),
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80}", ["model.path=Qwen9"], "neither a preset"),
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80}", ["actor.tpp=2"], "did you mean 'actor.tp'?"),
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80}", ["model.path="], "model.path is not set"),
    # What the trainer refuses (run_rules), the planner refuses too.
    ("cluster: {nodes: 1, gpus_per_node: 8, gpu_mem_gib: 80}", ["trainer.colocate=true", "trainer.max_staleness=1"],
     "the trainer refuses it: trainer.colocate=true takes turns on the same GPUs"),
])
def test_bad_input_exits_2_naming_the_file_and_key(tmp_path, capsys, yaml_text, overrides, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    assert main(["--cluster", str(path), "model.path=Qwen2.5-0.5B", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and (str(path) in err or overrides), err


def test_model_from_hf_config_json(tmp_path):
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from orz.plan import resolve_model

    for source in (tmp_path, tmp_path / "config.json"):
        assert resolve_model(str(source))[1].num_params == MODELS["Qwen2.5-7B"].num_params
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ModelConfigError, match="config.json"):
        resolve_model(str(tmp_path))


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2]),
       recompute=st.booleans(), sp=st.booleans(), tokens=st.sampled_from([128, 256, 1024]))
def test_memory_never_grows_with_more_parallelism_or_savings(tp, pp, dp, recompute, sp, tokens):
    cluster = replace(CLUSTER, nodes=4)  # 32 GPUs: room for every combination on separate GPUs

    def actor(**changes):
        par = TrainParallel(**(dict(tp=tp, pp=pp, dp=dp, micro_batch_tokens=tokens, recompute=recompute,
                                    sequence_parallel=sp) | changes))
        return plan(TINY, cluster, Placement(actor=par, rollout=Rollout(num_engines=1)), WORK).row("actor")

    base = actor()
    assert actor(use_distributed_optimizer=True).total <= base.total
    if pp <= 2:  # ≥ 2 layers per stage: keeping inputs and re-running one layer beats keeping them all
        assert actor(recompute=True).activations <= base.activations
    assert base.weights * tp * pp >= 2 * TINY.num_params  # every parameter lives somewhere
    if tp == 1:
        wider = plan(TINY, cluster, Placement(actor=TrainParallel(tp=2, pp=pp, dp=dp, micro_batch_tokens=tokens,
                                                                  recompute=recompute, sequence_parallel=sp),
                                              rollout=Rollout(num_engines=1)), WORK).row("actor")
        assert all(getattr(wider, c) <= getattr(base, c) for c in ("weights", "grads", "optimizer", "activations"))


def test_gpu_presets_are_complete():
    assert set(GPUS) == {"A100", "H100", "H800", "H200"}


def test_the_arithmetic_imports_no_torch():
    """A Slurm login node may have no torch: with torch unimportable, the package imports and a
    preset's plan is computed and checked. Importing torch anywhere on that path fails the test."""
    script = ("import sys; sys.modules['torch'] = None\n"
              "from orz.plan import MODELS, Cluster, Placement, Rollout, TrainParallel, Workload, blockers, plan\n"
              "p = plan(MODELS['Qwen2.5-7B'], Cluster(nodes=4, gpus_per_node=8, gpu_mem_gib=80), "
              "Placement(actor=TrainParallel(tp=4, dp=2), rollout=Rollout(num_engines=8)), Workload())\n"
              "print(p.timing.iteration_s > 0, blockers(p) == [] or blockers(p))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True"), out.stdout


# A tiny Qwen3-MoE: layer 0 dense (mlp_only_layers=[0]), layers 1-3 sparse with 8 experts of width
# 32, 2 routed per token. Pieces by hand (h=64, d=16, a=4, g=2, V=1000):
#   attention h·d·(2a+2g) = 12288; norms 2h = 128; q/k norms 2d = 32; router E·h = 512
#   one expert 3·h·f_e = 6144, all eight 49152; dense MLP 3·h·f = 49152
TINY_MOE = ModelArch(family="qwen3_moe", vocab_size=1000, hidden_size=64, intermediate_size=256, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=256,
                     moe=MoeArch(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True, layers=(1, 2, 3)))


def test_moe_parameters_by_hand():
    from orz.plan.memory import layer_params, matmul_params

    assert layer_params(TINY_MOE, 2, layer=0, ep=2) == (12288 + 49152) // 2 + 128 + 32  # dense: EP changes nothing
    assert layer_params(TINY_MOE, 2, layer=1, ep=2) == 12288 // 2 + 128 + 32 + 512 + 49152 // 2  # 31392
    assert layer_params(TINY_MOE, 1, layer=1, ep=4, etp=2) == 12288 + 160 + 512 + 49152 // 8
    # TP2 PP2 EP2: stage 1 = layers 0, 1 + embedding 1000·64/2; stage 2 = layers 2, 3 + norm + LM head
    assert stage_params(TINY_MOE, 2, 2, "lm", 1, ep=2) == [30880 + 31392 + 32000, 2 * 31392 + 64 + 32000]
    assert stage_params(TINY_MOE, 1, 1, "lm", 1) == [TINY_MOE.num_params]
    # active per token: 4 attentions + the dense MLP + 3 × (router + 2 experts) + LM head V·h
    assert matmul_params(TINY_MOE, "lm") == 4 * 12288 + 49152 + 3 * (512 + 2 * 6144) + 1000 * 64


def test_moe_memory_by_hand():
    # TP1 PP1 DP4 EP2, distributed optimizer: P = 61600 (layer 0) + 3 × 37536 (sparse: 12288 + 160 +
    # 512 + 49152/2) + embedding 64000 + norm 64 + head 64000 = 302272, of which experts 3 × 24576 = 73728.
    # Optimizer: 12·(P − P_e)/DP + 12·P_e/EDP with EDP = tp·dp/(ep·etp) = 2.
    # Activations, T = 128, layer 0: 128·(8·64 + 384 + 6·256) = 311296; a sparse layer:
    # 128·(8·64 + 384 + 8·8 + 2·(2·64 + 6·32)) = 204800; all four kept: 311296 + 3·204800 + log-probs 128·1000·16 + 128·64·6 + 4·1000·64.
    actor = TrainParallel(tp=1, dp=4, ep=2, micro_batch_tokens=128, use_distributed_optimizer=True)
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gib=1, reserved_gib=0)
    p = plan(TINY_MOE, cluster, Placement(actor=actor, rollout=Rollout(num_engines=4)), WORK)
    row = p.row("actor")
    assert (row.weights, row.grads) == (2 * 302272, 4 * 302272)
    assert row.optimizer == 12 * (302272 - 73728) // 4 + 12 * 73728 // 2
    assert row.activations == 311296 + 3 * 204800 + 128 * 1000 * 16 + 128 * 64 * 6 + 4 * 1000 * 64
    # vLLM (TP1) holds every expert: one GPU's weights are num_params with V padded to 1024
    assert p.row("rollout").weights == 2 * (TINY_MOE.num_params + 2 * 24 * 64)


def test_moe_time_by_hand():
    from orz.plan.timing import all_to_all_s, rollout_time

    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gib=80, gpu="H100", link_efficiency=0.25)
    par = TrainParallel(tp=1, dp=4, ep=2)
    # per forward pass: tokens/dp · 3 sparse layers · k=2 · 2 bytes · h=64 · (ep−1)/ep · 2 (there and back)
    tokens = 1e6
    per_pass = tokens / 4 * 3 * 2 * 2 * 64 * 0.5 * 2
    assert all_to_all_s(TINY_MOE, cluster, par, tokens, 3) == pytest.approx(3 * per_pass / (450e9 * 0.25))
    assert all_to_all_s(TINY_MOE, cluster, replace(par, ep=1), tokens, 3) == 0
    # at ep=4 > k=2 the all-gather dispatcher (the trainer's default) moves each token to all 3 peers,
    # the all-to-all one each of its k copies with probability 3/4
    gather, routed = tokens / 4 * 3 * 3 * 2 * 64 * 2, tokens / 4 * 3 * 2 * 0.75 * 2 * 64 * 2
    assert all_to_all_s(TINY_MOE, cluster, replace(par, ep=4), tokens, 1) == pytest.approx(gather / (450e9 * 0.25))
    assert all_to_all_s(TINY_MOE, cluster, replace(par, ep=4, moe_dispatcher="alltoall"), tokens, 1) == pytest.approx(
        routed / (450e9 * 0.25))
    # decode at c sequences reads the experts its tokens route to: 1 − (1 − 2/8)^c of each layer's
    one = Workload(prompts_per_iteration=1, n_samples=1, prompt_max_tokens=32, max_new_tokens=96,
                   mean_prompt_tokens=16, mean_response_tokens=48)
    _, c, step = rollout_time(TINY_MOE, cluster, Rollout(num_engines=1), one)
    weights = 2 * (TINY_MOE.num_params + 2 * 24 * 64 - 3 * 49152 * (1 - (1 - (1 - 2 / 8) ** c)))
    kv = c * (16 + 24) * 2 * 4 * 2 * 16 * 2
    assert c == 1 and step == pytest.approx((weights + kv) / (3.35e12 * 0.7))


def test_expert_parallel_that_cannot_run():
    cluster = Cluster(nodes=1, gpus_per_node=8, gpu_mem_gib=80)
    with pytest.raises(PlanError, match=re.escape("actor.ep=8 × actor.etp=1 must divide actor.tp × actor.cp × actor.dp = 4")):
        plan(TINY_MOE, cluster, Placement(actor=TrainParallel(tp=1, dp=4, ep=8), rollout=Rollout(num_engines=4)), WORK)
    with pytest.raises(PlanError, match=re.escape("actor.ep=3 does not divide num_experts=8")):
        plan(TINY_MOE, cluster, Placement(actor=TrainParallel(tp=1, dp=3, ep=3), rollout=Rollout(num_engines=4)),
             WORK)
    with pytest.raises(PlanError, match=re.escape("expert parallelism needs a mixture-of-experts model")):
        plan(TINY, cluster, Placement(actor=TrainParallel(tp=2, dp=2, ep=2), rollout=Rollout(num_engines=4)), WORK)


def test_the_planner_sizes_the_default_log_prob_chunk_as_the_trainer_does():
    from orz.models.logprobs import CHUNK_BYTES

    from orz.plan.inputs import LOGPROB_CHUNK_BYTES

    assert LOGPROB_CHUNK_BYTES == CHUNK_BYTES


def test_a_recipe_with_a_reward_model_plans_it_on_its_own_model_and_gpus():
    """reward.model is a role: forward only, a value head on its own model's trunk, its own GPUs.
    Qwen2.5-7B as the reward model of a 0.5B policy: its row holds the 7B's bf16 weights (the LM head
    replaced by h + 1), no grads or optimizer; its GPUs count in the cluster's demand."""
    from orz.config import load_config
    from orz.plan.memory import stage_params
    from orz.plan.recipe import placement_of

    cfg = load_config(None, ["model.path=Qwen2.5-0.5B", "algorithm.advantage=grpo", "reward.model.path=Qwen2.5-7B",
                             "reward.model.tp=2", "rollout.num_engines=2"])
    placement = placement_of(cfg)
    assert placement.reward_model.gpus == 2 and placement.reward_model_arch == MODELS["Qwen2.5-7B"]
    p = plan(MODELS["Qwen2.5-0.5B"], Cluster(nodes=1, gpus_per_node=8, gpu_mem_gib=79.6), placement, WORK)
    row = p.row("reward_model")
    seven_b = MODELS["Qwen2.5-7B"]
    assert row.weights == 2 * stage_params(seven_b, 2, 1, "value", 1)[0] and (row.grads, row.optimizer) == (0, 0)
    assert row.weights > 10 * p.row("actor").weights // 2  # the 7B's, not the policy's (~15× its parameters)
    assert row.gpus == 2 and sum(r.gpus for r in p.memory) == 1 + 2 + 2  # actor, reward model, engines


def test_the_planner_reads_the_recipes_moe_dispatcher():
    """model.moe_dispatcher reaches every role the planner sizes, as the trainer builds them."""
    from orz.config import load_config
    from orz.plan.recipe import placement_of

    cfg = load_config(None, ["model.path=Qwen3-30B-A3B", "algorithm.kl_coef=0.01", "model.moe_dispatcher=alltoall"])
    placement = placement_of(cfg)
    assert {par.moe_dispatcher for par in placement.megatron_roles().values()} == {"alltoall"}
    assert placement_of(load_config(None, ["model.path=Qwen3-30B-A3B"])).actor.moe_dispatcher == "allgather"


TINY_HYBRID = ModelArch(family="qwen3_5_moe", vocab_size=1000, hidden_size=64, intermediate_size=32, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e7, rms_norm_eps=1e-6,
                        tie_word_embeddings=False, max_position_embeddings=256, rotary_fraction=0.25,
                        attention_output_gate=True, zero_centred_norms=True,
                        linear_attention=GatedDeltaNetArch(num_key_heads=2, num_value_heads=4, key_head_dim=8,
                                                           value_head_dim=8, conv_kernel=4, layers=(0, 1, 2)),
                        moe=MoeArch(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True,
                                    layers=(0, 1, 2, 3), shared_intermediate_size=16))


def test_hybrid_parameters_and_recurrent_state_by_hand():
    """GDN layers 0-2 (K = 2·8 = 16, V = 4·8 = 32), gated attention in layer 3, every MLP sparse with a shared expert."""
    from orz.plan.memory import kv_bytes_per_token, layer_params, matmul_params, recurrent_bytes_per_sequence

    # GDN: in_proj 64·(2·16 + 2·32 + 2·4) = 6656, conv (2·16 + 32)·4 = 256, A_log + dt_bias 8, out_proj 32·64
    # = 2048 → 8968 split; its norm 8 replicated. Sparse MLP: shared expert 3·64·16 = 3072 split, router
    # 8·64 = 512 and the shared gate 64 replicated, experts 8·3·64·32 = 49152. Two RMSNorms 128.
    assert layer_params(TINY_HYBRID, 2, layer=0, ep=2) == (8968 + 3072) // 2 + 8 + 128 + 512 + 64 + 49152 // 2
    # gated attention: h·d·(3a + 2g) = 64·16·16 = 16384 split, q/k norms 2·16 replicated
    assert layer_params(TINY_HYBRID, 1, layer=3) == 16384 + 3072 + 128 + 32 + 512 + 64 + 49152
    assert stage_params(TINY_HYBRID, 1, 1, "lm", 1) == [TINY_HYBRID.num_params]
    # active: 3 GDN mixers 64·(32 + 64 + 8) + 32·64, one attention 16384, 4 × (router + 2 experts + shared), head
    assert matmul_params(TINY_HYBRID, "lm") == 3 * (6656 + 2048) + 16384 + 4 * (512 + 2 * 6144 + 3072 + 64) + 64000
    # engines: K and V of the one attention layer per token; per sequence, each GDN layer's fp32 state
    # 4·8·8 and bf16 convolution inputs (2·16 + 32)·3
    assert kv_bytes_per_token(TINY_HYBRID, 1) == 2 * 1 * 2 * 16 * 2
    assert recurrent_bytes_per_sequence(TINY_HYBRID, 1) == 3 * (4 * 8 * 8 * 4 + 64 * 3 * 2)
