"""RayPPOTrainer: the single controller of a PPO/GRPO run: setup, `fit` and `step`.

    RayPPOTrainer(cfg, resume_from=checkpoint).fit()     # orz.train.run: the process around it

One iteration, each phase timed into `timing/*`:
  1 rollout     prompts -> vLLM fleet -> samples (n per prompt)     experience_builder.py
  2 reward      verifier scores; dynamic sampling draws more prompts when asked
  3 forward     old log-probs (actor), reference and teacher log-probs, critic values — in parallel
  4 advantages  per-token rewards (score on the last token − β·KL), the configured estimator,
                the teachers' reverse-KL term (teachers.py)
  5 update      critic and actor optimizer steps over the experience — in parallel
  6 sync        the actor's new weights into every engine, as the next weight version
then metrics, evaluation and checkpoints (checkpoints.py) every k iterations. The trainer holds
handles, not model tensors: the roles are Ray worker groups (workers.py), the math is core_algos.py.

A Megatron worker that dies (its node lost, OOM-killed) fails the iteration it was in: nothing of
that iteration is logged or checkpointed; orz.train.run then rebuilds every role and the fleet
and resumes from the last checkpoint (trainer.max_restarts times at most). A dead vLLM engine is
the fleet's business: it restarts it and re-issues its requests.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import ray
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orz.bundles import Bundles
from orz.config import ConfigError, ExperimentConfig, save_config, stage_at, stage_configs, to_dict, total_iterations
from orz.data.datasets import RunData
from orz.data.tokenizers import load_tokenizer
from orz.evaluation.benchmarks import benchmark_from_rows
from orz.evaluation.runner import Evaluator, eval_settings
from orz.faults import Fault
from orz.models.arch import ModelConfigError
from orz.models.checkpoint import HF_FILES, HFCheckpoint, keep_hf_files
from orz.models.peft_format import adapter_config
from orz.plan.against import compare, write_and_print
from orz.ppo import checkpoints
from orz.run import placement, run_rules
from orz.run.role_spec import RoleSpec, role_spec
from orz.ppo.workers import ActorSettings, WorkerGroup
from orz.ppo.core_algos import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    IS_LEVELS,
    estimate_advantages,
    kl_in_score,
    kl_penalty,
    masked_mean,
    mismatch_keep_mask,
    mismatch_metrics,
    reward_on_last_token,
    whiten,
)
from orz.ppo.experience import Experience
from orz.ppo.experience_builder import ExperienceBuilder
from orz.ppo.metrics_logger import MetricsLogger
from orz.ppo.pipeline import BatchesAhead, staleness_metrics
from orz.ppo.run_timeline import RunTimeline
from orz.ppo.teachers import Teachers
from orz.ppo.trackers import open_trackers
from orz.rollout.engine import engine_dtype, is_hybrid
from orz.rollout.fleet import EngineFleet, FleetConfig
from orz.rollout.envs import envs_used
from orz.rollout.weight_sync import GroupSource
from orz.timeline.record import RECORDER

console = Console(soft_wrap=True)  # long lines stay whole (non-terminal output is 80 columns)


class Timer:
    """Each phase's seconds (`timing/<phase>`) and when it ran (start and end on the timeline's
    clock), each phase a span of the timeline's lane trainer/phases."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.spans: dict[str, tuple[float, float]] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = RECORDER.now()
        yield
        self.spans[phase] = start, RECORDER.now()
        self.seconds[f"timing/{phase}"] = self.spans[phase][1] - start
        RECORDER.add("trainer/phases", phase, *self.spans[phase])


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    """How long two (start, end) spans ran at once."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class RayPPOTrainer:
    """`run_cfg` is the whole run as configured; `stage_cfg` the current stage's view of it (the
    run's config with that stage's overrides). A method reads `stage_cfg` for what a stage may
    change (run_rules.STAGE_KEYS: LR, micro-batching, sampling, data, reward, algorithm switches)
    and `run_cfg` for everything else (layouts, output, seeds, checkpoint cadence)."""

    def __init__(self, cfg: ExperimentConfig, resume_from: Path | None = None, restarts: int = 0,
                 data: RunData | None = None):
        """resume_from: a checkpoint directory to continue from; restarts: how many times the
        run was rebuilt after a lost worker (the `fault/restarts` metric); data: rows already
        read (read_data), kept across restarts."""
        self.run_cfg = cfg  # main has run every refusal (run_rules.check) before Ray started
        self.stage_index, self.stage_cfg = 0, stage_at(cfg, 0)[1]
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml")
        keep_hf_files(cfg.model.path, self.out)  # what an export of any checkpoint needs besides the weights
        self.iteration, self.version, self.restarts = 0, 0, restarts
        self.pipeline = BatchesAhead(cfg.trainer.max_staleness)  # the batches generated ahead (docs/async.md)
        self.last_checkpoint = resume_from  # the latest complete one
        self._saving: checkpoints.PendingCheckpoint | None = None  # one still being written (trainer.async_save)
        self.total = total_iterations(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.data = RunData(cfg.trainer.seed) if data is None else data
        self.log_dir = "" if cfg.trainer.verbose else str(self.out / "logs")  # the workers' output
        self.evaluators = {}
        self.fault = Fault.parse(cfg.trainer.fault)  # main has refused a malformed one
        self.phase = "start"  # what the iteration in flight is doing (named if it fails)
        self.timeline = RunTimeline(self.out, cfg.trainer.timeline, resume=resume_from is not None or restarts > 0,
                                    restarts=restarts)
        dtype = engine_dtype(cfg.rollout.engine_dtype, is_hybrid(cfg.model.path), torch.cuda.is_available())
        self.engine_dtype = "" if dtype == "auto" else dtype  # "": vLLM's auto, the model's own dtype
        if resume_from is not None:
            trained = {name: spec for name, spec in self._role_specs().items() if spec.train}
            checkpoints.recut_where_needed(resume_from, trained, WorkerGroup, console.print)
        self._setup_roles()
        self.measured_once = self.timeline.start(dict(self._named_groups()), self._role_specs(), cfg,
                                                 self.fleet.num_engines)
        self._setup_controllers()
        state = checkpoints.saved_state(resume_from) if resume_from is not None else None
        self._enter_stage(stage_at(cfg, state["iteration"])[0] if state else 0, loader_state=state and state["loader"])
        if resume_from is not None:
            self._resume(resume_from)
        t = cfg.trainer
        trackers = open_trackers(t.loggers, self.out, t.run_name or self.out.name, t.project, to_dict(cfg),
                                 resume=resume_from is not None)
        self.logger = MetricsLogger(self.out, trackers, resume_from_step=self.iteration if resume_from is not None else -1)

    # ---- setup -------------------------------------------------------------------------------
    def _role_specs(self) -> dict[str, RoleSpec]:
        """What each Megatron role of the run is built from, in start order."""
        return {name: role_spec(self.run_cfg, name, log_dir=self.log_dir, engine_dtype=self.engine_dtype)
                for name in placement.roles(self.run_cfg)}

    def _setup_roles(self):
        """Every role's workers and the engines, started side by side (each loads its model in its
        own processes). Colocated, the engines start after the roles: vLLM sizes its share of a
        GPU from what is free, which it must not measure while a worker beside it allocates."""
        cfg = self.run_cfg
        console.print(f"[bold]orz:[/] starting roles for [cyan]{cfg.algorithm.advantage}[/] on {cfg.model.path}")
        roles, r, layout = placement.roles(cfg), cfg.rollout, placement.Layout.of(cfg)
        # Colocated: one bundle per GPU for a worker of every role and an engine (run_rules checks the sizes).
        self.bundles = Bundles.create(layout.num_engines, sum(role.cpus_per_worker for role in roles.values())
                                      + r.cpus_per_engine, gpu_share=layout.gpu_share) if layout.colocate else None
        longest = max(run_rules.context_length(staged, bool(envs_used(staged.rollout, self.data.train(staged.data))))
                      for _, staged in stage_configs(cfg))
        lora = role_spec(cfg, "actor").model.lora
        fleet_cfg = FleetConfig.from_config(r, longest, sleep_mode=cfg.trainer.colocate, log_dir=self.log_dir,
                                            batch_invariant=cfg.trainer.batch_invariant,
                                            adapter=adapter_config(lora, cfg.model.path)
                                            if lora and r.lora_sync == "adapter" else None)
        console.print(f"[bold]orz:[/] rollout engines in {self.engine_dtype or 'the model’s own dtype'} "
                      f"(rollout.engine_dtype={r.engine_dtype})")

        def start_fleet() -> EngineFleet:
            return EngineFleet(cfg.model.path, fleet_cfg, seed=cfg.trainer.seed, shared=self.bundles, wait=False)

        # Everything is launched first and waited for here, in the main thread: no other thread is left
        # in a Ray call when a SIGTERM or Ctrl-C shuts Ray down (a Ray call after that ends the process).
        fleet = None if cfg.trainer.colocate else start_fleet()
        groups = {name: WorkerGroup(spec, self.bundles, wait=False) for name, spec in self._role_specs().items()}
        for group in groups.values():
            group.wait_started()
        fleet = fleet or start_fleet()  # colocated: after the roles
        fleet.wait_started()
        self.fleet = fleet
        self.actor = groups["actor"]
        self.critic, self.ref, self.reward_model = (groups.get(name) for name in ("critic", "ref", "reward_model"))
        # The KL term's reference log-probs: the reference role's, or a LoRA actor's with its adapters off
        self.ref_logprobs_async = self.ref.logprobs_async if self.ref else (
            lambda shared, temperature: self.actor.logprobs_async(shared, temperature, adapters=False)
        ) if cfg.algorithm.kl_coef > 0 else None
        self.teachers = Teachers({role: groups[role] for role in placement.teacher_roles(cfg)}, cfg.distill,
                                 HFCheckpoint(cfg.model.path).arch.vocab_size)
        self.weight_source = GroupSource(self.actor)
        self.builder = ExperienceBuilder(cfg, self.fleet, self.tokenizer, self.data, self.reward_model, self.out)

    def _setup_controllers(self):
        a = self.run_cfg.algorithm  # controller settings are run-wide (run_rules._RUN_ONLY)
        self.kl_ctl = AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_target else FixedKLController(a.kl_coef)
        self.entropy_ctl = AdaptiveEntropyController(a.entropy_target, a.entropy_step, a.entropy_max_coef, a.entropy_coef) \
            if a.entropy_target is not None else None

    def _enter_stage(self, index: int, loader_state: dict | None = None) -> None:
        """Applies stage `index` from its first iteration (or, resuming, from where it stopped):
        data, template, reward and evaluation are rebuilt from its config, the roles take its LR,
        schedule and micro-batching. Nothing is in flight here: batches are never generated ahead
        across a stage boundary (step)."""
        self.stage_index = index
        self.stage_cfg = cfg = stage_configs(self.run_cfg)[index][1]
        self.algo = run_rules.algorithm(cfg)  # its None defaults decided
        self.builder.enter_stage(cfg, self.algo, loader_state)
        self._setup_eval()
        roles = placement.roles(cfg)
        for name, group in self._named_groups():
            group.configure(roles[name])
        if self.run_cfg.stages:
            console.print(f"orz: stage {index + 1} of {len(self.run_cfg.stages)} from iteration {self.iteration + 1}")

    # ---- the loop ----------------------------------------------------------------------------
    def fit(self, stop: threading.Event | None = None) -> dict:
        """Trains to the last iteration, or until `stop` is set (main sets it on SIGUSR1, Slurm's
        warning before a time limit): then the current iteration ends with a checkpoint and fit
        returns with `preempted`."""
        cfg = self.run_cfg.trainer
        start = time.time()
        stop = stop or threading.Event()
        if self.iteration == 0:
            self.logger.log(0, self.evaluate())
        with Progress(TextColumn("[bold]iteration"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.description}"), console=console) as progress:
            task = progress.add_task("", total=self.total, completed=self.iteration)

            def show(phase: str) -> None:
                self.phase = phase
                progress.update(task, description=phase)

            while self.iteration < self.total:
                stage = stage_at(self.run_cfg, self.iteration)[0]
                if stage != self.stage_index:
                    self._enter_stage(stage)
                metrics = self.step(show)
                self.iteration += 1
                last = self.iteration == self.total
                if (cfg.eval_every and self.iteration % cfg.eval_every == 0) or last:
                    progress.update(task, description="evaluation")
                    with RECORDER.span("trainer/phases", "evaluation"):
                        metrics |= self.evaluate()
                self.logger.log(self.iteration, metrics)
                progress.update(task, advance=1, description=_summary(metrics))
                if (cfg.save_every and self.iteration % cfg.save_every == 0) or last or stop.is_set():
                    progress.update(task, description="checkpoint")
                    self.save_checkpoint()
                if stop.is_set() and not last:
                    self.finish_checkpoint()
                    console.print(f"orz: SIGUSR1: stopped after iteration {self.iteration} with a checkpoint")
                    return {"iterations": self.iteration, "seconds": time.time() - start, "preempted": True}
        self.finish_checkpoint()
        if cfg.export_hf:
            with RECORDER.span("trainer/checkpoint", "export"):
                self._export()
        plot = self.logger.close()
        timeline = self.timeline.close(dict(self._named_groups()))
        if timeline is not None:
            self._plan_against_the_run()
        history = self.logger.history()
        return {"iterations": self.iteration, "seconds": time.time() - start, "plot": str(plot),
                "timeline": str(timeline),
                "first": history[0] if history else {}, "last": history[-1] if history else {}}

    def step(self, show=lambda phase: None) -> dict:
        """One iteration. With trainer.max_staleness = k > 0 the engines generate (and the pool
        scores) batch i + k in a background thread while the actor trains on batch i; the sync
        waits for them. Batches already generated wait in `self.pipeline` (and in checkpoints)."""
        timer, k = Timer(), self.run_cfg.trainer.max_staleness
        self._arm_fault()
        with timer("step"):
            show("rollout")
            experience, metrics = self.pipeline.take(self.iteration, lambda i: self.builder.build(i, self.version))
            metrics |= staleness_metrics(experience.info["weight_version"], self.version, k, self.iteration + 1)
            colocated = self.run_cfg.trainer.colocate  # the roles' turn: the engines sleep until the sync
            if colocated:
                with timer("sleep"):
                    self.fleet.sleep()
            ahead = self.pipeline.ahead_of(self.iteration, self.total, lambda i: stage_at(self.run_cfg, i)[0])
            self._share_cores(engines_generate=ahead is not None)
            if ahead is not None:
                self.pipeline.start(self._prefetch, ahead, self.version)
            show("log-probs and values")
            with timer("train"):
                with timer("forward"):
                    experience = self._forward(experience)
                with timer("advantages"):
                    experience, adv_metrics = self._advantages(experience)
                show("update")
                with timer("update"):
                    experience, update_metrics = self._update(experience)
            partial = self.pipeline.interrupts(self.stage_cfg.rollout.partial)
            if partial:  # the engines pause mid-batch, take the new weights, and finish it with them
                self.fleet.interrupt()
                sync = self._sync(timer, show)
            with timer("wait_rollout"):
                if self.pipeline.generating:
                    show("waiting for the next batch")
                generating = self.pipeline.finish()
            if colocated:
                with timer("wake_up"):
                    self.fleet.wake_up()
            if not partial:
                sync = self._sync(timer, show)
        metrics |= adv_metrics | update_metrics | sync | timer.seconds | self.fleet.metrics | self.measured_once
        for group in self._groups():  # each role's peak memory in its forward and update phases
            metrics |= group.peak_memory_gib()
        # What ran at once: the engines generating the batch ahead while the actor's passes (log-probs,
        # update) ran, from when each ran; the passes' other seconds left the engines idle.
        passes = [timer.spans[phase] for phase in ("forward", "update")]
        overlap = sum(overlap_seconds(generating, span) for span in passes)
        metrics |= {"timing/overlap_rollout_train": overlap,
                    "timing/idle_engines": sum(end - start for start, end in passes) - overlap,
                    "timing/idle_actor": timer.seconds["timing/wait_rollout"] + (0.0 if k else metrics["timing/rollout"])}
        generated = float(experience.response_mask.sum())
        metrics["throughput/generated_tokens_per_s"] = generated / max(metrics["timing/rollout"], 1e-9)
        metrics["throughput/trained_tokens_per_s"] = update_metrics.get("tokens", 0.0) / max(timer.seconds["timing/update"], 1e-9)
        metrics["algorithm/kl_coef"] = self.kl_ctl.value
        metrics["fault/restarts"] = float(self.restarts)
        if self.entropy_ctl is not None:
            metrics["algorithm/entropy_coef"] = self.entropy_ctl.value
        every = self.run_cfg.trainer.dump_samples_every
        if every and (self.iteration + 1) % every == 0:
            self._dump(experience)
        lengths = experience.sequence_lengths().float()
        metrics |= self.timeline.collect(self.iteration + 1, timer.spans["step"], dict(self._named_groups()),
                                         (float(lengths.sum()), float(lengths.mean())))
        return metrics

    def _plan_against_the_run(self) -> None:
        """plan_vs_run.json and its table: the planner's prediction of this run beside its medians."""
        try:
            write_and_print(compare(self.out), self.out, lambda line: console.print(f"orz: {line}", highlight=False))
        except (ConfigError, ModelConfigError) as err:  # a model or layout the planner does not cover
            console.print(f"orz: no plan against the run: {err}", highlight=False)
        except Exception as err:  # noqa: BLE001 - a report after the run: it never fails a finished run
            console.print(f"orz: no plan against the run ({type(err).__name__}: {err}); `orz plan --against "
                          f"{self.out}` shows the traceback", highlight=False)

    def _arm_fault(self) -> None:
        """trainer.fault: the role raises in this iteration (orz/faults.py). With batches generated
        ahead, the engines and the reward raise in the next rollout they start."""
        fault = self.fault
        if fault is None or fault.iteration != self.iteration + 1:
            return
        RECORDER.instant("trainer/faults", f"fault {fault.role}@{fault.iteration} armed")
        if fault.role == "actor":
            self.actor.arm_fault(fault.message("every actor worker's update"))
        elif fault.role == "engine":
            self.fleet.arm_fault(fault.message("every vLLM engine's generation"))
        else:
            self.builder.reward.arm_fault(fault.message("the reward router's scoring"))

    def _sync(self, timer: Timer, show) -> dict:
        """The actor's new weights into every engine, as the next version."""
        show("weight sync")
        with timer("sync"):
            self.version += 1
            return self.fleet.sync(self.weight_source, self.version)

    def _prefetch(self, iteration: int, version: int) -> tuple[tuple[Experience, dict], tuple[float, float]]:
        """The batch built in the background, and when (start and end on the timeline's clock, a span
        of its lane trainer/pipeline); once it is done the workers may take every core."""
        start = RECORDER.now()
        try:
            built = self.builder.build(iteration, version)
            end = RECORDER.now()
            RECORDER.add("trainer/pipeline", "generate ahead", start, end, batch=iteration + 1)
            return built, (start, end)
        finally:  # before the result is set: the next iteration's share comes after this one
            self._share_cores(engines_generate=False)

    def _share_cores(self, engines_generate: bool) -> None:
        """Each Megatron role's torch threads: `threads` beside generating engines, else `threads_alone`."""
        roles = placement.roles(self.stage_cfg)
        for name, group in self._named_groups():
            role = roles[name]
            if role.threads_alone:
                group.use_threads(role.threads if engines_generate else role.threads_alone)

    # ---- phases ------------------------------------------------------------------------------
    def _forward(self, experience: Experience) -> Experience:
        """The passes before the update. π_old is read here only where something needs it before
        the update: the KL against the reference, or a mismatch mask or rejection, which decide
        the actor's loss tokens and normalisers (verl's decoupled mode). Otherwise the actor reads
        it in its update, the first mini-batch at no cost (MegatronWorker.train_actor)."""
        algo = self.algo
        shared = ray.put(experience)
        temperature = self.stage_cfg.rollout.temperature
        kl = self.ref_logprobs_async
        old_first = kl is not None or _masks_mismatch(algo) or bool(self.teachers)
        old = self.actor.logprobs_async(shared, temperature) if old_first and not algo.rollout_logprobs_as_old else None
        ref_logprobs = kl(shared, temperature) if kl else None
        teachers = self.teachers.launch(experience, temperature)
        values = self.critic.values_async(shared) if self.critic else None
        as_old = experience.rollout_logprobs if algo.rollout_logprobs_as_old else None
        return replace(
            experience,
            old_logprobs=old.get() if old else as_old,
            ref_logprobs=ref_logprobs.get() if ref_logprobs else None,
            values=values.get() if values else None,
            **self.teachers.fields(experience, teachers),
        )

    def _advantages(self, experience: Experience) -> tuple[Experience, dict]:
        """The KL penalty enters the per-token rewards of gae/reinforce_pp, the score of group
        estimators (s − β·ΣKL), or, with kl_in_reward off, the actor's loss (_update)."""
        algo, mask = self.algo, experience.response_mask
        estimator = placement.estimator(algo)
        metrics, kl, scores = {}, None, experience.scores
        if experience.ref_logprobs is not None:
            kl = kl_penalty(experience.old_logprobs, experience.ref_logprobs, algo.kl_kind, mask)
            metrics["actor/kl_ref"] = float(masked_mean(kl, mask))
            self.kl_ctl.update(metrics["actor/kl_ref"], experience.batch_size)
        in_reward = kl if algo.kl_in_reward else None
        if in_reward is not None and not estimator.reads_token_rewards:
            scores, in_reward = kl_in_score(scores, in_reward, mask, self.kl_ctl.value), None
            metrics["algorithm/score_mean"] = float(scores.mean())
        rewards = reward_on_last_token(scores, mask, in_reward, self.kl_ctl.value if in_reward is not None else 0.0)
        advantages, returns = estimate_advantages(
            algo.advantage, mask=mask, token_rewards=rewards, scores=scores, values=experience.values,
            group_index=experience.group_index, gamma=algo.gamma, lam=algo.lam,
        )
        if algo.whiten_advantages:
            advantages = whiten(advantages, mask)
        if self.teachers:
            advantages, distill_metrics = self.teachers.advantages(experience, advantages)
            metrics |= distill_metrics
        metrics |= {
            "algorithm/advantage_mean": float(masked_mean(advantages, mask)),
            "algorithm/advantage_abs_mean": float(masked_mean(advantages.abs(), mask)),
            "algorithm/return_mean": float(masked_mean(returns, mask)),
        }
        return replace(experience, rewards=rewards, advantages=advantages, returns=returns), metrics

    def _update(self, experience: Experience) -> tuple[Experience, dict]:
        """The critic's and the actor's updates. The actor trains on the tokens the mismatch
        mask and rejection keep (all, when both are off); the experience comes back with the
        π_old the update read, and the mismatch/* figures are of the whole batch."""
        algo, rows = self.algo, experience.batch_size
        seed = self.run_cfg.trainer.seed * 7919 + self.iteration
        norm_len = self.stage_cfg.rollout.max_new_tokens
        if self.run_cfg.trainer.offload_idle_roles:
            for group in self._trained_groups():
                group.onload()
        critic_pending = None
        if self.critic:
            steps = self.stage_cfg.critic.steps_per_iteration
            minibatches = experience.minibatches(-(-rows // steps), seed=seed, norm_len=norm_len)
            critic_pending = self.critic.train_critic_async(minibatches, algo)
        keep = None
        if _masks_mismatch(algo):
            keep = mismatch_keep_mask(experience.old_logprobs, experience.rollout_logprobs, experience.response_mask,
                                      algo.mismatch_mask, algo.mismatch_reject_geo)
        kept = experience if keep is None else replace(experience, response_mask=keep.to(experience.response_mask.dtype))
        steps = self.stage_cfg.actor.steps_per_iteration
        minibatches = kept.minibatches(-(-rows // steps), seed=seed + 1, norm_len=norm_len)
        entropy_coef = self.entropy_ctl.value if self.entropy_ctl else algo.entropy_coef
        kl_coef = self.kl_ctl.value if self.ref_logprobs_async and not algo.kl_in_reward else 0.0
        settings = ActorSettings(algo, self.stage_cfg.rollout.temperature, entropy_coef, kl_coef,
                                 self.teachers.loss_coef)
        metrics, read_old = self.actor.train_actor_async(minibatches, settings).get(like=experience.response_mask)
        if read_old is not None:
            experience = replace(experience, old_logprobs=read_old)
        metrics |= {key: float(value) for key, value in mismatch_metrics(
            experience.old_logprobs, experience.rollout_logprobs, experience.response_mask, keep).items()}
        if keep is not None:
            experience = replace(experience, info={**experience.info, "loss_mask": keep.float()})
        if critic_pending:
            critic = critic_pending.get()
            critic.pop("tokens", None)
            metrics |= critic
        if self.run_cfg.trainer.offload_idle_roles:  # untested here: a no-op without a GPU
            for group in self._trained_groups():
                group.offload()
        if self.entropy_ctl is not None and "actor/entropy" in metrics:
            self.entropy_ctl.update(metrics["actor/entropy"])
        return experience, metrics

    def _trained_groups(self) -> list[WorkerGroup]:
        return list(self._trained_named().values())

    def _trained_named(self) -> dict[str, WorkerGroup]:
        return {name: group for name, group in (("actor", self.actor), ("critic", self.critic)) if group is not None}

    def _dump(self, experience: Experience) -> None:
        """samples/iter_N.jsonl; with trainer.dump_per_token, every token's figures, and the IS
        weights the actor's loss applied (recomputed here by the same function)."""
        algo, per_token = self.algo, self.run_cfg.trainer.dump_per_token
        if per_token and algo.is_correction:
            loss_mask = experience.info.get("loss_mask", experience.response_mask)
            weights = IS_LEVELS[algo.is_level](experience.old_logprobs, experience.rollout_logprobs, loss_mask,
                                               algo.is_cap)
            experience = replace(experience, info={**experience.info, "is_weights": weights})
        (self.out / "samples").mkdir(exist_ok=True)
        experience.dump_jsonl(str(self.out / "samples" / f"iter_{self.iteration + 1:06d}.jsonl"), self.tokenizer,
                              per_token=per_token)

    # ---- evaluation --------------------------------------------------------------------------
    def _setup_eval(self):
        """The same Evaluator as `python -m orz.eval`: greedy (avg@1 at temperature 0) and, with
        eval_n > 1, sampled avg@k / pass@k / maj@k at the stage's sampling settings and length;
        multi-turn with the run's environments when it has any."""
        cfg = self.stage_cfg
        for evaluator in self.evaluators.values():
            evaluator.close()
        benchmarks = [benchmark_from_rows(name, rows) for name, rows in self.data.eval_sets(cfg.data).items()]
        # A run with environments is evaluated the way it trains: rows take their own environment, else rollout.env.
        self.evaluators = {prefix: Evaluator(self.fleet, self.tokenizer, self.builder.template, benchmarks,
                                             settings, progress=False, turns=self.builder.multiturn,
                                             env=cfg.rollout.env)
                           for prefix, settings in eval_settings(cfg, self.run_cfg.trainer.seed).items()} \
            if benchmarks else {}

    def evaluate(self) -> dict:
        metrics = {}
        for prefix, evaluator in self.evaluators.items():
            report = evaluator.run(min_version=self.version)
            report.save(self.out / "eval" / f"{prefix}_iter_{self.iteration:06d}")
            metrics |= report.metrics(prefix)
            accuracies = [figures[f"avg@{report.settings['n']}"] for figures in report.figures.values()]
            summary = "eval/accuracy_greedy" if prefix == "eval_greedy" else "eval/avg_at_k"
            metrics[summary] = float(np.mean(accuracies))
        return metrics

    # ---- checkpoints -------------------------------------------------------------------------
    def _export(self) -> None:
        """The final actor as an HF directory (out/hf); a LoRA actor's as its adapter, a PEFT directory
        (out/adapter), and on request (actor.lora.export_merged) its merged model in out/hf."""
        lora = self.run_cfg.actor.lora
        if not lora.rank:
            self.actor.export_hf(str(self.out / "hf"))
            return
        self.actor.export_adapter(str(self.out / "adapter"))
        if lora.export_merged:
            self.actor.export_hf(str(self.out / "hf"), merged=True)

    def save_checkpoint(self) -> Path:
        """checkpoints/iter_N of the trained roles, the trainer's state and the batches generated ahead."""
        state = {
            "iteration": self.iteration, "version": self.version, "loader": self.builder.loader.state_dict(),
            "kl_ctl": self.kl_ctl.state_dict(), "entropy_ctl": self.entropy_ctl.state_dict() if self.entropy_ctl else None,
            "config": to_dict(self.run_cfg), HF_FILES: f"../../{HF_FILES}",  # keep_hf_files, from iter_N
        }
        t = self.run_cfg.trainer
        self.finish_checkpoint()
        with RECORDER.span("trainer/checkpoint", "save", iteration=self.iteration):
            self._saving = checkpoints.save(self.out / "checkpoints", self.iteration, self._trained_named(), state,
                                            self.pipeline.ready, t.keep_checkpoints, t.keep_every, t.async_save)
        final = self._saving.final
        if not t.async_save:
            self.finish_checkpoint()
        return final

    def finish_checkpoint(self) -> None:
        """Completes the checkpoint still being written (trainer.async_save), if any: only then is
        it the latest."""
        if self._saving is not None:
            with RECORDER.span("trainer/checkpoint", "finish"):
                self.last_checkpoint, self._saving = self._saving.finish(), None

    def _resume(self, ckpt: Path) -> None:
        """Roles, weight version, controllers and the batches generated ahead from `ckpt`; the
        stage and its loader position were restored by _enter_stage."""
        state, ahead = checkpoints.load(ckpt, self._trained_named())
        self.iteration, self.version = state["iteration"], state["version"]
        self.pipeline.ready.extend(ahead)
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.entropy_ctl and state["entropy_ctl"]:
            self.entropy_ctl.load_state_dict(state["entropy_ctl"])
        self.fleet.sync(self.weight_source, self.version)
        console.print(f"orz: resumed from {ckpt} at iteration {self.iteration}")

    def _named_groups(self) -> list[tuple[str, WorkerGroup]]:
        groups = (("actor", self.actor), ("critic", self.critic), ("ref", self.ref), ("reward_model", self.reward_model),
                  *self.teachers.groups.items())
        return [(name, group) for name, group in groups if group is not None]

    def _groups(self) -> list[WorkerGroup]:
        return [group for _, group in self._named_groups()]

    def lost_workers(self) -> list[str]:
        """The Megatron workers whose process is gone, as "actor rank 1"."""
        return [f"{group.spec.name} rank {rank}" for group in self._groups() for rank in group.dead_ranks()]

    def shutdown(self) -> None:
        self.pipeline.shutdown()
        self.logger.close(plot=False)
        self.builder.close()
        for evaluator in self.evaluators.values():
            evaluator.close()
        self.fleet.shutdown()
        for group in self._groups():
            group.shutdown()
        if self.bundles is not None:
            self.bundles.remove()


def _masks_mismatch(algo) -> bool:
    """A mismatch mask or rejection is on: the actor's loss tokens depend on π_old."""
    return algo.mismatch_mask is not None or algo.mismatch_reject_geo is not None


def _summary(metrics: dict) -> str:
    keys = (("reward/mean", "reward"), ("eval/accuracy_greedy", "eval"), ("response/length_mean", "len"),
            ("timing/step", "s"))
    return "  ".join(f"{short} {metrics[k]:.3g}" for k, short in keys if k in metrics)
