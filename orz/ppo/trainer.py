"""RayPPOTrainer: the single controller of a PPO/GRPO run.

    main(cfg)   # = RayPPOTrainer(cfg, resume_from=latest_checkpoint(cfg)).fit(), restarted on a lost worker

One iteration, each phase timed into `timing/*`:
  1 rollout     prompts -> vLLM fleet -> samples (n per prompt)
  2 reward      verifier scores; dynamic sampling draws more prompts when asked
  3 forward     old log-probs (actor), reference log-probs, critic values — in parallel
  4 advantages  per-token rewards (score on the last token − β·KL), the configured estimator
  5 update      critic and actor optimizer steps over the experience — in parallel
  6 sync        the actor's new weights into every engine, as the next weight version
then metrics, evaluation and checkpoints every k iterations. The trainer holds handles, not
model tensors: the roles are Ray worker groups (actors.py), the math is core_algos.py.

A Megatron worker that dies (its node lost, OOM-killed) fails the iteration it was in: nothing of
that iteration is logged or checkpointed; `main` then rebuilds every role and the fleet and
resumes from the last checkpoint (trainer.max_restarts times at most). A dead vLLM engine is
the fleet's business: it restarts it and re-issues its requests.
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import ray
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from orz.bundles import Bundles
from orz.config import ConfigError, ExperimentConfig, save_config, stage_at, stage_configs, to_dict, total_iterations
from orz.data.datasets import DatasetFormatError, Row, RunData
from orz.data.sampler import PromptLoader
from orz.data.templates import encode_prompt, make_template, reward_model_inputs
from orz.data.tokenizers import load_tokenizer
from orz.evaluation.benchmarks import benchmark_from_rows
from orz.evaluation.runner import Evaluator, eval_settings
from orz.faults import Fault
from orz.logs import output_to, quiet_driver
from orz.models.checkpoint import HFCheckpoint, atomic_dir
from orz.ppo import placement, run_rules
from orz.ppo.actors import ActorSettings, RoleSpec, WorkerGroup
from orz.ppo.core_algos import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    IS_LEVELS,
    dynamic_sampling_filter,
    estimate_advantages,
    kl_in_score,
    kl_penalty,
    masked_mean,
    mismatch_keep_mask,
    mismatch_metrics,
    overlong_penalty,
    reward_on_last_token,
    whiten,
)
from orz.ppo.metrics_logger import MetricsLogger
from orz.ppo.experience import Experience, experience_from_rollouts
from orz.ppo.trackers import open_trackers
from orz.reward.router import MODEL, RewardRouter, RouterConfig, Verdict, check_verifiers, reward_metrics
from orz.rollout.engine import Sample, SamplingConfig
from orz.rollout.envs import PYTHON, env_names
from orz.rollout.fleet import EngineFleet, FleetConfig
from orz.rollout.multiturn import (
    Conversation, MultiTurnRollout, TurnLimits, env_scores, envs_used, make_envs, multiturn_metrics, turn_stops,
)
from orz.rollout.python_tool import prompt_tools
from orz.rollout.weight_sync import GroupSource
from orz.stopping import StopSignals, Stopped

console = Console(soft_wrap=True)  # long lines stay whole (non-terminal output is 80 columns)


def check_data(cfg: ExperimentConfig) -> RunData:
    """Reads every stage's data as the trainer will, before anything starts: a bad row, or one
    whose verifier nothing defines, stops the run here, naming its file and row. Returns what it
    read, for the trainer. Evaluation prompts must fit data.prompt_max_tokens (the engines'
    context is sized from it): training skips a longer prompt, evaluation refuses it."""
    data, tokenizer = RunData(cfg.trainer.seed), load_tokenizer(cfg.model.path)
    for _, staged in stage_configs(cfg):
        envs = env_names(staged.rollout.envs)
        d, router = staged.data, RouterConfig.from_config(staged.reward, envs=envs)
        template = make_template(d.template, tokenizer, d.instruction, prompt_tools(staged.rollout))
        evaluated = [row for rows in data.eval_sets(d).values() for row in rows]
        rows = data.train(d) + evaluated
        check_verifiers(rows, router)
        unknown_env = next((r for r in rows if r.env and r.env not in envs), None)
        if unknown_env is not None:
            raise DatasetFormatError(unknown_env.source, unknown_env.number, f"unknown environment {unknown_env.env!r}; "
                                     f"known: {sorted(envs)} (add it to rollout.envs)")
        used = envs_used(staged.rollout, rows)
        problems = run_rules.multi_turn_problems(staged) if used else []
        if PYTHON not in used:
            problems += run_rules.python_tool_unused(staged)
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


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory); nothing was lost."""


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing/{phase}"] = time.perf_counter() - start


def latest_checkpoint(cfg: ExperimentConfig) -> Path | None:
    """output_dir/checkpoints/latest's checkpoint, when trainer.resume and there is one."""
    latest = Path(cfg.trainer.output_dir) / "checkpoints" / "latest"
    return latest.parent / latest.read_text().strip() if cfg.trainer.resume and latest.is_file() else None


class RayPPOTrainer:
    """`run_cfg` is the whole run as configured; `stage_cfg` the current stage's view of it (the
    run's config with that stage's overrides). A method reads `stage_cfg` for what a stage may
    change (run_rules.STAGE_KEYS: LR, micro-batching, sampling, data, reward, algorithm switches)
    and `run_cfg` for everything else (layouts, output, seeds, checkpoint cadence)."""

    def __init__(self, cfg: ExperimentConfig, resume_from: Path | None = None, restarts: int = 0,
                 data: RunData | None = None):
        """resume_from: a checkpoint directory to continue from; restarts: how many times the
        run was rebuilt after a lost worker (the `fault/restarts` metric); data: rows already
        read (check_data), kept across restarts."""
        self.run_cfg = cfg  # main has run every refusal (run_rules.check) before Ray started
        self.stage_index, self.stage_cfg = 0, stage_at(cfg, 0)[1]
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.out / "config.yaml")
        self.iteration, self.version, self.restarts = 0, 0, restarts
        self.pending: deque[tuple[Experience, dict]] = deque()  # generated batches not yet trained on
        self._background = ThreadPoolExecutor(1, thread_name_prefix="orz-rollout")  # max_staleness > 0
        self.last_checkpoint = resume_from
        self.total = total_iterations(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.data = RunData(cfg.trainer.seed) if data is None else data
        self.log_dir = "" if cfg.trainer.verbose else str(self.out / "logs")  # the workers' output
        self.reward, self.evaluators, self.loader = None, {}, None
        self.fault = Fault.parse(cfg.trainer.fault)  # main has refused a malformed one
        self.phase = "start"  # what the iteration in flight is doing (named if it fails)
        self._setup_roles()
        self._setup_controllers()
        state = json.loads((resume_from / "trainer_state.json").read_text()) if resume_from is not None else None
        self._enter_stage(stage_at(cfg, state["iteration"])[0] if state else 0, loader_state=state and state["loader"])
        if resume_from is not None:
            self._resume(resume_from, state)
        t = cfg.trainer
        trackers = open_trackers(t.loggers, self.out, t.run_name or self.out.name, t.project, to_dict(cfg),
                                 resume=resume_from is not None)
        self.logger = MetricsLogger(self.out, trackers, resume_from_step=self.iteration if resume_from is not None else -1)

    # ---- setup -------------------------------------------------------------------------------
    def _role(self, name: str, **kwargs) -> RoleSpec:
        cfg = self.run_cfg
        kwargs.setdefault("model_path", cfg.model.path)
        trained = kwargs.get("train", True)
        return RoleSpec(
            name=name, cfg=placement.roles(self.stage_cfg)[name], dtype=cfg.model.dtype, recompute=cfg.model.recompute,
            deterministic=cfg.trainer.batch_invariant,
            vocab_divisible_by=cfg.model.vocab_divisible_by, moe_aux_loss_coef=cfg.model.moe_aux_loss_coef,
            seed=cfg.trainer.seed,
            total_steps=run_rules.optimizer_steps(cfg, name) if trained else 1, log_dir=self.log_dir, **kwargs,
        )

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
        rm = cfg.reward.model
        role_args = {"actor": {"routing_replay": r.routing_replay}, "ref": {"train": False},
                     "critic": {"value_head": True, "model_path": cfg.model.critic_path or cfg.model.path},
                     "reward_model": {"value_head": True, "train": False, "model_path": rm.path}}
        longest = max(run_rules.context_length(staged, bool(envs_used(staged.rollout, self.data.train(staged.data))))
                      for _, staged in stage_configs(cfg))
        fleet_cfg = FleetConfig.from_config(r, longest, sleep_mode=cfg.trainer.colocate, log_dir=self.log_dir,
                                            batch_invariant=cfg.trainer.batch_invariant)

        def start_fleet() -> EngineFleet:
            return EngineFleet(cfg.model.path, fleet_cfg, seed=cfg.trainer.seed, shared=self.bundles)

        with ThreadPoolExecutor(len(roles) + 1, thread_name_prefix="orz-start") as pool:
            fleet = None if cfg.trainer.colocate else pool.submit(start_fleet)
            groups = {name: pool.submit(WorkerGroup, self._role(name, **role_args[name]), self.bundles) for name in roles}
            groups = {name: group.result() for name, group in groups.items()}
            self.fleet = start_fleet() if fleet is None else fleet.result()
        self.actor = groups["actor"]
        self.critic, self.ref, self.reward_model = (groups.get(name) for name in ("critic", "ref", "reward_model"))
        # The reward model reads text in its own tokens when its vocabulary is not the policy's.
        rm_tokenizer = load_tokenizer(rm.path) if self.reward_model else None
        self.rm_tokenizer = rm_tokenizer if rm_tokenizer and rm_tokenizer.get_vocab() != self.tokenizer.get_vocab() else None
        self.weights = GroupSource(self.actor)

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
        previous = self.stage_cfg if self.loader is not None else None
        self.stage_index = index
        self.stage_cfg = cfg = stage_configs(self.run_cfg)[index][1]
        self.algo = run_rules.algorithm(cfg)  # its None defaults decided
        d = cfg.data
        self.template = make_template(d.template, self.tokenizer, d.instruction, prompt_tools(cfg.rollout))
        if previous is None or (previous.data, previous.trainer.prompts_per_iteration) != (d, cfg.trainer.prompts_per_iteration):
            self.loader = PromptLoader(self.data.train(d), cfg.trainer.prompts_per_iteration, self.run_cfg.trainer.seed)
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        if self.reward is not None:
            self.reward.close()
        self.reward = RewardRouter.from_config(cfg.reward, self.loader.rows, envs=env_names(cfg.rollout.envs))
        # Multi-turn when an environment is configured or named by a row; else today's single-turn path.
        used = envs_used(cfg.rollout, self.loader.rows)
        self.multiturn = MultiTurnRollout(self.fleet, self.tokenizer, make_envs(cfg.rollout, cfg.reward.code, used, self.tokenizer),
                                          TurnLimits.of(cfg.rollout, run_rules.context_length(cfg, multi_turn=True)),
                                          turn_stops(cfg.rollout)) if used else None
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
                    metrics |= self.evaluate()
                self.logger.log(self.iteration, metrics)
                progress.update(task, advance=1, description=_summary(metrics))
                if (cfg.save_every and self.iteration % cfg.save_every == 0) or last or stop.is_set():
                    progress.update(task, description="checkpoint")
                    self.save_checkpoint()
                if stop.is_set() and not last:
                    console.print(f"orz: SIGUSR1: stopped after iteration {self.iteration} with a checkpoint")
                    return {"iterations": self.iteration, "seconds": time.time() - start, "preempted": True}
        if cfg.export_hf:
            self.actor.export_hf(str(self.out / "hf"))
        plot = self.logger.close()
        history = self.logger.history()
        return {"iterations": self.iteration, "seconds": time.time() - start, "plot": str(plot),
                "first": history[0] if history else {}, "last": history[-1] if history else {}}

    def step(self, show=lambda phase: None) -> dict:
        """One iteration. With trainer.max_staleness = k > 0 the engines generate (and the pool
        scores) batch i + k in a background thread while the actor trains on batch i; the sync
        waits for them. Batches already generated wait in `self.pending` (and in checkpoints)."""
        timer, k = Timer(), self.run_cfg.trainer.max_staleness
        self._arm_fault()
        with timer("step"):
            show("rollout")
            while len(self.pending) < max(k, 1):  # on-policy, a stage's first iteration, a fresh start
                self.pending.append(self._rollout_and_reward(self.iteration + len(self.pending), self.version))
            experience, metrics = self.pending.popleft()
            metrics |= self._staleness(experience, k)
            colocated = self.run_cfg.trainer.colocate  # the roles' turn: the engines sleep until the sync
            if colocated:
                with timer("sleep"):
                    self.fleet.sleep()
            ahead, prefetch = self.iteration + k, None
            if k and ahead < self.total and stage_at(self.run_cfg, ahead)[0] == self.stage_index:
                self._share_cores(engines_generate=True)
                prefetch = self._background.submit(self._prefetch, ahead, self.version)
            else:
                self._share_cores(engines_generate=False)
            show("log-probs and values")
            with timer("train"):
                with timer("forward"):
                    experience = self._forward(experience)
                with timer("advantages"):
                    experience, adv_metrics = self._advantages(experience)
                show("update")
                with timer("update"):
                    experience, update_metrics = self._update(experience)
            partial = prefetch is not None and self.stage_cfg.rollout.partial
            if partial:  # the engines pause mid-batch, take the new weights, and finish it with them
                self.fleet.interrupt()
                sync = self._sync(timer, show)
            with timer("wait_rollout"):
                if prefetch is not None:
                    show("waiting for the next batch")
                    self.pending.append(prefetch.result())
            if colocated:
                with timer("wake_up"):
                    self.fleet.wake_up()
            if not partial:
                sync = self._sync(timer, show)
        metrics |= adv_metrics | update_metrics | sync | timer.seconds | self.fleet.metrics
        # What ran at once this iteration: the background rollout beside the actor's work.
        generating = self.pending[-1][1]["timing/rollout"] if prefetch is not None else 0.0
        train = timer.seconds["timing/train"]
        metrics |= {"timing/overlap_rollout_train": min(generating, train),
                    "timing/idle_engines": train - min(generating, train),
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
        return metrics

    def _arm_fault(self) -> None:
        """trainer.fault: the role raises in this iteration (orz/faults.py). With batches generated
        ahead, the engines and the reward raise in the next rollout they start."""
        fault = self.fault
        if fault is None or fault.iteration != self.iteration + 1:
            return
        if fault.role == "actor":
            self.actor.arm_fault(fault.message("every actor worker's update"))
        elif fault.role == "engine":
            self.fleet.arm_fault(fault.message("every vLLM engine's generation"))
        else:
            self.reward.arm_fault(fault.message("the reward router's scoring"))

    def _sync(self, timer: Timer, show) -> dict:
        """The actor's new weights into every engine, as the next version."""
        show("weight sync")
        with timer("sync"):
            self.version += 1
            return self.fleet.sync(self.weights, self.version)

    def _prefetch(self, batch: int, version: int) -> tuple[Experience, dict]:
        """_rollout_and_reward in the background; once it is done the workers may take every core."""
        try:
            return self._rollout_and_reward(batch, version)
        finally:  # before the result is set: the next iteration's share comes after this one
            self._share_cores(engines_generate=False)

    def _share_cores(self, engines_generate: bool) -> None:
        """Each Megatron role's torch threads: `threads` beside generating engines, else `threads_alone`."""
        roles = placement.roles(self.stage_cfg)
        for name, group in self._named_groups():
            role = roles[name]
            if role.threads_alone:
                group.use_threads(role.threads if engines_generate else role.threads_alone)

    def _staleness(self, experience: Experience, k: int) -> dict:
        """How many versions behind the actor each sample's weights are; more than k is refused."""
        staleness = self.version - experience.info["weight_version"]
        if int(staleness.max()) > k:
            raise RuntimeError(f"iteration {self.iteration + 1}: a sample of weight version "
                               f"{int(experience.info['weight_version'].min())} is {int(staleness.max())} versions behind "
                               f"the actor's {self.version}, more than trainer.max_staleness={k}")
        return {"rollout/staleness_mean": float(staleness.float().mean()), "rollout/staleness_max": float(staleness.max())}

    # ---- phases ------------------------------------------------------------------------------
    def _sampling(self, batch: int, draw: int) -> SamplingConfig:
        # Seeds depend on the batch, so a resumed run samples what the uninterrupted one did. Each
        # draw's samples take seeds seed, seed + 1, ... (see SamplingConfig.seed): 2^24 apart,
        # no two draws of the run (up to 64 per batch) share one.
        seed = ((self.run_cfg.trainer.seed * 2**20 + batch) * 2**6 + draw) * 2**24
        return SamplingConfig.from_config(self.stage_cfg.rollout, seed)

    def _prompt_ids(self, rows: list[Row]) -> list[tuple[Row, list[int]]]:
        out = []
        for row in rows:
            ids = encode_prompt(self.tokenizer, self.template, row.prompt)
            if len(ids) <= self.stage_cfg.data.prompt_max_tokens:
                out.append((row, ids))
        return out

    def _generate_and_score(self, prompts: list[tuple[Row, list[int]]], sampling: SamplingConfig,
                            min_version: int) -> tuple[list[Sample], list[Verdict], float]:
        """The samples of every prompt in prompt order, their verdicts, and the seconds scoring took
        after the last sample: each prompt's group goes to the reward router as soon as its samples
        finish, so scoring overlaps generation."""
        pending = []
        if self.multiturn is not None:
            env = self.stage_cfg.rollout.env
            groups = self.multiturn.stream([(ids, row.record(), row.env or env) for row, ids in prompts], sampling,
                                           min_version)
        else:
            groups = self.fleet.stream([ids for _, ids in prompts], sampling, min_version=min_version,
                                       interruptible=self.stage_cfg.rollout.partial)
        for group in groups:
            row = prompts[group[0].index][0]
            pending.append((group, self.reward.submit([s.text for s in group], [row] * len(group),
                                                      [s.finish_reason for s in group])))
        start = time.perf_counter()
        pending.sort(key=lambda item: item[0][0].index)
        scored = [(group, verdicts.result()) for group, verdicts in pending]
        samples, verdicts = [s for group, _ in scored for s in group], [v for _, vs in scored for v in vs]
        return samples, verdicts, time.perf_counter() - start

    def _rollout_and_reward(self, batch: int, min_version: int) -> tuple[Experience, dict]:
        """Batch `batch` (its iteration index) from engines holding weights >= min_version: one
        draw of prompts; with dynamic sampling, more draws until the kept groups fill the batch,
        which is then cut, by whole groups, to prompts_per_iteration × n_samples. `reward/*` are
        over every draw; a sample dump of this batch also lists every draw's samples, kept or not."""
        start = time.perf_counter()
        algo, n = self.algo, self.stage_cfg.rollout.n_samples
        target = self.stage_cfg.trainer.prompts_per_iteration * n
        kept, judged, drawn, dropped, first_group, model_score_sum, reward_wait = [], [], [], 0, 0, 0.0, 0.0
        for draw in range(algo.max_prompt_draws if algo.dynamic_sampling else 1):
            prompts = self._prompt_ids(next(self.loader))
            samples, verdicts, wait = self._generate_and_score(prompts, self._sampling(batch, draw), min_version)
            judged += verdicts
            reward_wait += wait
            scores = torch.tensor([v.score for v in verdicts])
            if self.multiturn is not None:
                scores = env_scores(samples, scores, self.stage_cfg.reward.weights)
            if self.reward_model is not None:
                model_scores = self._model_scores(samples, [prompts[s.index][0] for s in samples])
                model_score_sum += model_scores.sum().item()
                scores = scores + self.stage_cfg.reward.weights.get(MODEL, 1.0) * model_scores
            group = torch.tensor([first_group + s.index for s in samples])
            first_group += len(prompts)
            keep = torch.ones(len(samples), dtype=torch.bool)
            if algo.dynamic_sampling:
                keep, n_dropped = dynamic_sampling_filter(scores, group)
                dropped += n_dropped
            this_draw = list(zip(samples, scores.tolist(), group.tolist(), keep.tolist()))
            drawn += [(draw, *item) for item in this_draw]
            kept += [(sample, score, g) for sample, score, g, k in this_draw if k]
            if len(kept) >= target:
                break
        kept = kept[:target]  # groups are whole and in order, and target is a multiple of n
        if not kept:
            raise RuntimeError("dynamic sampling kept no group: every prompt's responses scored alike")
        every = self.run_cfg.trainer.dump_samples_every
        if every and (batch + 1) % every == 0:
            self._dump_draws(batch, drawn, {id(s) for s, _, _ in kept})
        samples = [sample for sample, _, _ in kept]
        scores = torch.tensor([score for _, score, _ in kept], dtype=torch.float32)
        experience = experience_from_rollouts([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                              [s.logprobs for s in samples], pad_id=self.tokenizer.pad_token_id or 0,
                                              loss_masks=[s.loss_mask for s in samples] if self.multiturn else None,
                                              **self._routes(samples))
        lengths = experience.response_mask.sum(1)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.float32)
        every_score = torch.tensor([score for _, _, score, _, _ in drawn])
        if algo.overlong_buffer:
            max_new, buffer, factor = self.stage_cfg.rollout.max_new_tokens, algo.overlong_buffer, algo.overlong_factor
            scores = scores + overlong_penalty(lengths, max_new, buffer, factor)
            every_length = torch.tensor([len(s.response_ids) for _, s, _, _, _ in drawn])
            every_score = every_score + overlong_penalty(every_length, max_new, buffer, factor)
        experience = replace(experience, scores=scores, group_index=torch.tensor([g for _, _, g in kept]),
                             info={"response_length": lengths, "truncated": truncated,
                                   "weight_version": torch.tensor([s.weight_version for s in samples])})
        metrics = reward_metrics(judged) | {  # reward/*: over every draw, kept or not
            "reward/mean": every_score.mean().item(), "response/length_mean": lengths.mean().item(),
            "response/length_max": lengths.max().item(), "response/truncated_rate": truncated.mean().item(),
            "rollout/samples": float(len(samples)),
            # What the engines report they generated with (the fleet refuses anything older).
            "rollout/sample_weight_version": float(min(s.weight_version for s in samples)),
            # Partial rollout: responses continued by newer weights than they started with.
            "rollout/partial_samples": float(sum(len(set(s.token_versions)) > 1 for s in samples)),
        }
        if self.multiturn is not None:
            metrics |= multiturn_metrics([sample for _, sample, _, _, _ in drawn])  # over every draw, like reward/*
        if self.reward_model is not None:
            metrics["reward/model/mean"] = model_score_sum / max(len(judged), 1)  # over every draw, like reward/*
        if algo.dynamic_sampling:
            metrics |= {"rollout/groups_dropped": float(dropped), "rollout/draws": float(draw + 1),
                        "rollout/short_batch": float(len(samples) < target)}
        metrics["timing/rollout"] = time.perf_counter() - start  # generation and scoring
        metrics["timing/reward_wait"] = reward_wait  # scoring that generation did not hide
        return experience, metrics

    def _model_scores(self, samples: list[Sample], rows: list[Row]) -> torch.Tensor:
        """(B,) the reward model's score of each sample. When the reward model's vocabulary differs
        from the policy's, it reads the text in its own tokens (re-tokenized, as verl does): the
        question and response in its own chat template if it has one, else the policy's prompt."""
        prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
        tok = self.rm_tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            prompts, responses = map(list, zip(*(reward_model_inputs(tok, row.prompt, s.text)
                                                 for row, s in zip(rows, samples))))
        elif tok is not None:
            texts = self.tokenizer.batch_decode(prompts, skip_special_tokens=True)
            prompts = [tok(t)["input_ids"] for t in texts]
            responses = [tok(s.text, add_special_tokens=False)["input_ids"] or [tok.eos_token_id] for s in samples]
        view = experience_from_rollouts(prompts, responses, [[0.0] * len(r) for r in responses],
                                        pad_id=(tok or self.tokenizer).pad_token_id or 0)
        return self.reward_model.scores_async(ray.put(view)).get().sum(1)

    def _forward(self, experience: Experience) -> Experience:
        """The passes before the update. π_old is read here only where something needs it before
        the update: the KL against the reference, or a mismatch mask or rejection, which decide
        the actor's loss tokens and normalisers (verl's decoupled mode). Otherwise the actor reads
        it in its update, the first mini-batch at no cost (MegatronWorker.train_actor)."""
        algo = self.algo
        shared = ray.put(experience)
        temperature = self.stage_cfg.rollout.temperature
        old_first = self.ref is not None or _masks_mismatch(algo)
        old = self.actor.logprobs_async(shared, temperature) if old_first and not algo.rollout_logprobs_as_old else None
        ref_logprobs = self.ref.logprobs_async(shared, temperature) if self.ref else None
        values = self.critic.values_async(shared) if self.critic else None
        as_old = experience.rollout_logprobs if algo.rollout_logprobs_as_old else None
        return replace(
            experience,
            old_logprobs=old.get() if old else as_old,
            ref_logprobs=ref_logprobs.get() if ref_logprobs else None,
            values=values.get() if values else None,
        )

    def _advantages(self, experience: Experience) -> tuple[Experience, dict]:
        """The KL penalty enters the per-token rewards of gae/reinforce_pp, the score of group
        estimators (s − β·ΣKL), or, with kl_in_reward off, the actor's loss (_update)."""
        algo, mask = self.algo, experience.response_mask
        estimator = run_rules.estimator(algo)
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
        kl_coef = self.kl_ctl.value if self.ref and not algo.kl_in_reward else 0.0
        step = ActorSettings(algo, self.stage_cfg.rollout.temperature, entropy_coef, kl_coef)
        metrics, read_old = self.actor.train_actor_async(minibatches, step).get(like=experience.response_mask)
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
        return [group for group in (self.actor, self.critic) if group is not None]

    def _routes(self, samples: list) -> dict:
        """experience_from_rollouts' routing-replay arguments: the engines' routes of each sample,
        kept at the model's MoE layers (rollout.routing_replay; GPU only, untested here)."""
        if not self.run_cfg.rollout.routing_replay:
            return {}
        if any(s.routed_experts is None for s in samples):
            raise RuntimeError("rollout.routing_replay=true, and an engine returned a sample without routed experts "
                               "(vLLM's enable_return_routed_experts off, or not on Model Runner V2)")
        return dict(routed_experts=[s.routed_experts for s in samples],
                    moe_layers=HFCheckpoint(self.run_cfg.model.path).arch.moe.layers)

    def _dump_draws(self, batch: int, drawn: list, kept: set[int]) -> None:
        """samples/iter_N_draws.jsonl: every sample of every draw of batch N, its score as the
        dynamic-sampling filter saw it, its group, and whether it went into the batch."""
        (self.out / "samples").mkdir(exist_ok=True)
        with open(self.out / "samples" / f"iter_{batch + 1:06d}_draws.jsonl", "w") as out:
            for draw, sample, score, group, keep in drawn:
                record = {"draw": draw, "group": group, "response": sample.text, "score": score,
                          "length": len(sample.response_ids), "kept": id(sample) in kept, "passed_filter": keep}
                if isinstance(sample, Conversation):  # every turn in order: origin "model" or "env", text, ids
                    record |= {"turns": [vars(turn) for turn in sample.turns], "env": sample.env,
                               "env_reward": sample.env_reward, "env_error": sample.env_error}
                out.write(json.dumps(record) + "\n")

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
        self.evaluators = {prefix: Evaluator(self.fleet, self.tokenizer, self.template, benchmarks, settings,
                                             progress=False, turns=self.multiturn, env=cfg.rollout.env)
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
    @property
    def _ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Writes iter_N atomically (orz.models.checkpoint.atomic_dir: a temporary directory renamed
        when every role and the trainer state are on disk), then replaces `latest`. A crash or a
        full disk never leaves a checkpoint that looks complete, and the previous one stays."""
        root = self._ckpt_root
        final = root / f"iter_{self.iteration:06d}"
        try:
            with atomic_dir(final) as tmp:
                refs = self.actor.save_async(str(tmp / "actor"))
                if self.critic:
                    refs += self.critic.save_async(str(tmp / "critic"))
                ray.get(refs)
                state = {
                    "iteration": self.iteration, "version": self.version, "loader": self.loader.state_dict(),
                    "kl_ctl": self.kl_ctl.state_dict(),
                    "entropy_ctl": self.entropy_ctl.state_dict() if self.entropy_ctl else None,
                    "config": to_dict(self.run_cfg),
                }
                (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=str))
                # Batches generated ahead (max_staleness > 0) by weights no checkpoint holds.
                torch.save(list(self.pending), tmp / "pending_batches.pt")
            pointer = root / "latest.tmp"
            pointer.write_text(final.name)
            pointer.replace(root / "latest")
            self.last_checkpoint = final
        except (OSError, ray.exceptions.RayTaskError) as err:
            previous = (root / "latest").read_text() if (root / "latest").is_file() else "none"
            raise CheckpointError(f"{final}: checkpoint not written ({err}); the latest complete one "
                                  f"({previous}) is intact") from err
        for old in sorted(root.glob("iter_*"))[: -self.run_cfg.trainer.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _resume(self, ckpt: Path, state: dict) -> None:
        """Roles, weight version and controllers from `ckpt`; the stage and its loader position
        were restored by _enter_stage."""
        refs = self.actor.load_async(str(ckpt / "actor"))
        if self.critic:
            refs += self.critic.load_async(str(ckpt / "critic"))
        ray.get(refs)
        self.iteration, self.version = state["iteration"], state["version"]
        if (ckpt / "pending_batches.pt").is_file():
            self.pending = deque(torch.load(ckpt / "pending_batches.pt", weights_only=False))
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.entropy_ctl and state["entropy_ctl"]:
            self.entropy_ctl.load_state_dict(state["entropy_ctl"])
        self.fleet.sync(self.weights, self.version)
        console.print(f"orz: resumed from {ckpt} at iteration {self.iteration}")

    def _named_groups(self) -> list[tuple[str, WorkerGroup]]:
        groups = (("actor", self.actor), ("critic", self.critic), ("ref", self.ref), ("reward_model", self.reward_model))
        return [(name, group) for name, group in groups if group is not None]

    def _groups(self) -> list[WorkerGroup]:
        return [group for _, group in self._named_groups()]

    def lost_workers(self) -> list[str]:
        """The Megatron workers whose process is gone, as "actor rank 1"."""
        return [f"{group.spec.name} rank {rank}" for group in self._groups() for rank in group.dead_ranks()]

    def shutdown(self) -> None:
        self._background.shutdown(wait=True, cancel_futures=True)  # a batch in flight uses the fleet
        self.logger.close(plot=False)
        self.reward.close()
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


def main(cfg: ExperimentConfig) -> dict:
    """Trains to the end; after a lost Megatron worker, rebuilds the run from its last checkpoint.
    SIGTERM and Ctrl-C raise Stopped once every role is shut down, and the local Ray cluster too if
    this call started it: no agent or worker process of the run is left behind. SIGUSR1, from the
    start on and across restarts, ends the run after the current iteration with a checkpoint."""
    stop = threading.Event()
    signals = StopSignals() if threading.current_thread() is threading.main_thread() else None
    if signals:
        signal.signal(signal.SIGUSR1, lambda *_: stop.set())
        signals.install()
    progress = {"iterations": None}  # of the trainer in use, for Stopped
    owns_ray = False
    try:
        try:
            try:
                Fault.parse(cfg.trainer.fault)
            except ValueError as err:
                raise ConfigError(str(err)) from None
            arch = HFCheckpoint(cfg.model.path).arch
            run_rules.check(cfg, arch)  # before Ray or any worker starts
            resume_from = latest_checkpoint(cfg)
            if resume_from is not None:
                saved = json.loads((resume_from / "trainer_state.json").read_text())["config"]
                problems = run_rules.resume_problems(cfg, saved, arch)
                if problems:
                    raise ConfigError("\n".join(f"{resume_from}: {p}" for p in problems))
            data = check_data(cfg)
            t = cfg.trainer
            log_dir = Path(t.output_dir) / "logs"
            if not t.verbose:
                console.print(f"orz: output of Ray, vLLM, Megatron and warnings: {log_dir}/ (trainer.verbose=true shows it)")
            owns_ray = not ray.is_initialized()
            if owns_ray:
                # "local": a new cluster even where `ray start` left its address in /tmp/ray.
                local = {"num_cpus": t.ray_num_cpus or None} if not t.ray_address else {}  # a cluster has its own
                with contextlib.nullcontext() if t.verbose else output_to(log_dir / "driver.log"):
                    ray.init(address=t.ray_address or "local", include_dashboard=False, log_to_driver=t.verbose,
                             configure_logging=False, **local)
            if signals:
                signals.install()
            with contextlib.nullcontext() if t.verbose else quiet_driver(log_dir):
                return _train_with_restarts(cfg, data, stop, signals, progress)
        except KeyboardInterrupt:
            if signals:
                signals.caught()
            latest = Path(cfg.trainer.output_dir) / "checkpoints" / "latest"
            raise Stopped(signals.signum if signals and signals.signum else signal.SIGINT, progress["iterations"],
                          str(latest.parent / latest.read_text().strip()) if latest.is_file() else None) from None
        finally:
            if owns_ray and ray.is_initialized():
                ray.shutdown()  # a joined cluster (ray_address) is only disconnected from
    finally:
        if signals:
            signals.restore()


def _train_with_restarts(cfg: ExperimentConfig, data: RunData, stop: threading.Event,
                         signals: StopSignals | None, progress: dict) -> dict:
    resume_from, restarts = latest_checkpoint(cfg), 0
    while True:
        trainer = None
        try:
            trainer = RayPPOTrainer(cfg, resume_from, restarts, data)
            return trainer.fit(stop) | {"restarts": restarts}
        except KeyboardInterrupt:
            if signals:
                signals.caught()  # before the shutdown below, which must not be interrupted
            raise
        except Exception as err:
            if trainer is None:
                raise
            lost = trainer.lost_workers()
            if not lost:  # an exception, not a lost process: starting again would raise it again
                console.print(f"[bold red]orz: iteration {trainer.iteration + 1} failed[/] in its {trainer.phase} "
                              f"phase: {escape(_origin(err))}; the run stops, its traceback follows. The last checkpoint: "
                              f"{trainer.last_checkpoint or 'none'}")
                raise
            if restarts == cfg.trainer.max_restarts:
                raise
            restarts += 1
            resume_from = trainer.last_checkpoint
            console.print(f"[bold red]orz: {', '.join(lost)} died[/] in iteration {trainer.iteration + 1} "
                          f"({type(err).__name__}); restart {restarts} of at most {cfg.trainer.max_restarts}, "
                          f"from {resume_from or 'the start'}")
        finally:
            if trainer is not None:
                progress["iterations"] = trainer.iteration
                trainer.shutdown()


def _origin(err: BaseException) -> str:
    """The error's first line and, when a Ray actor raised it, which actor (its repr: the name of
    its log, `actor-0`, `engine-0`) in which method, from the line Ray puts over its traceback."""
    cause = getattr(err, "cause", None) if isinstance(err, ray.exceptions.RayTaskError) else None
    what = f"{type(cause or err).__name__}: {cause or err}".splitlines()[0]
    actor = re.search(r"ray::([\w.]+)\(\).*?repr=([^)]+)\)", str(err)) if cause is not None else None
    return f"{what} (raised in {actor[2]}, {actor[1]})" if actor else what
