"""Experience building: each batch's samples from the engines, their scores, and the Experience
the trainer's passes start from.

    builder = ExperienceBuilder(cfg, fleet, tokenizer, data, reward_model, out)
    builder.enter_stage(stage_cfg, algo)                  # the stage's data, template, reward, environments
    experience, metrics = builder.build(iteration, min_version)

A batch is one draw of prompts; with dynamic sampling, more draws until the kept groups fill it,
and it is then cut, by whole groups, to prompts_per_iteration × n_samples. Each prompt's group
goes to the reward router as soon as its samples finish (one turn, or every turn with its
environment: rollout/multiturn.py), so scoring overlaps generation. The score of a sample is its
verifier's (+ its environment's rewards, + the reward model's, weighted), then the overlong
penalty. `reward/*` and the multi-turn figures are over every draw, kept or not (what the policy
scored); `response/*` and `rollout/*` over the kept samples (what the update trains on).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import ray
import torch

from orz.config import ExperimentConfig
from orz.data.datasets import Row, RunData
from orz.data.sampler import PromptLoader
from orz.data.templates import encode_prompt, make_template, reward_model_inputs
from orz.data.tokenizers import load_tokenizer
from orz.models.checkpoint import HFCheckpoint
from orz.run import run_rules
from orz.ppo.core_algos import dynamic_sampling_filter, overlong_penalty
from orz.ppo.distillation import TeacherRoutes
from orz.ppo.experience import Experience, experience_from_rollouts
from orz.reward.router import MODEL, RewardRouter, Verdict, reward_metrics
from orz.rollout.agent_loop import Conversation, TurnLimits
from orz.rollout.driver import stream
from orz.rollout.engine import Sample, SamplingConfig
from orz.rollout.envs import env_names, envs_used
from orz.rollout.fleet import EngineFleet
from orz.rollout.multiturn import MultiTurnRollout, env_scores, make_loops, multiturn_metrics
from orz.rollout.python_tool import prompt_tools
from orz.timeline.record import RECORDER


class ExperienceBuilder:
    """Samples and scores the batches of a run; `cfg` is the current stage's config (enter_stage)."""

    def __init__(self, run_cfg: ExperimentConfig, fleet: EngineFleet, tokenizer, data: RunData, reward_model,
                 out: Path):
        """reward_model: the reward-model role's WorkerGroup, or None; out: the run's directory (sample dumps)."""
        self.run_cfg, self.fleet, self.tokenizer, self.data, self.out = run_cfg, fleet, tokenizer, data, out
        self.reward_model = reward_model
        # The reward model reads text in its own tokens when its vocabulary is not the policy's.
        rm_tokenizer = load_tokenizer(run_cfg.reward.model.path) if reward_model else None
        self.rm_tokenizer = rm_tokenizer if rm_tokenizer and rm_tokenizer.get_vocab() != tokenizer.get_vocab() else None
        # Routing replay keeps the engines' routes at the model's MoE layers (read once, not per batch).
        self.moe_layers = HFCheckpoint(run_cfg.model.path).arch.moe.layers if run_cfg.rollout.routing_replay else None
        self.teachers = TeacherRoutes.from_config(run_cfg)
        self.cfg: ExperimentConfig | None = None
        self.reward: RewardRouter | None = None
        self.loader: PromptLoader | None = None

    def enter_stage(self, cfg: ExperimentConfig, algo, loader_state: dict | None = None) -> None:
        """The stage's template, prompt loader (kept when its data and batch size are the previous
        stage's; at `loader_state` when resuming), reward router and environments (multi-turn when
        an environment is configured or named by a row; else single turn)."""
        previous, d = self.cfg, cfg.data
        self.cfg, self.algo = cfg, algo
        self.template = make_template(d.template, self.tokenizer, d.instruction, prompt_tools(cfg.rollout))
        if previous is None or (previous.data, previous.trainer.prompts_per_iteration) != (d, cfg.trainer.prompts_per_iteration):
            self.loader = PromptLoader(self.data.train(d), cfg.trainer.prompts_per_iteration, self.run_cfg.trainer.seed)
        if loader_state is not None:
            self.loader.load_state_dict(loader_state)
        if self.reward is not None:
            self.reward.close()
        self.reward = RewardRouter.from_config(cfg.reward, self.loader.rows, envs=env_names(cfg.rollout.envs))
        used = envs_used(cfg.rollout, self.loader.rows)
        limits = TurnLimits.of(cfg.rollout, run_rules.context_length(cfg, multi_turn=True))
        loops = make_loops(cfg.rollout, cfg.reward.code, used, self.tokenizer)
        self.multiturn = MultiTurnRollout(self.fleet, self.tokenizer, loops, limits) if used else None

    def build(self, iteration: int, min_version: int) -> tuple[Experience, dict]:
        """The batch of iteration `iteration` (an index from 0) from engines holding weights >=
        min_version (see the module docstring); its sample dump also lists every draw's samples.
        Its timing/rollout and timing/reward_wait are spans of the timeline's lane trainer/rollout."""
        start = RECORDER.now()
        algo, n = self.algo, self.cfg.rollout.n_samples
        target = self.cfg.trainer.prompts_per_iteration * n
        kept, judged, drawn, dropped, first_group, model_score_sum, reward_wait = [], [], [], 0, 0, 0.0, 0.0
        for draw in range(algo.max_prompt_draws if algo.dynamic_sampling else 1):
            prompts = self._prompt_ids(next(self.loader))
            samples, verdicts, wait = self._generate_and_score(prompts, self._sampling(iteration, draw), min_version,
                                                               iteration)
            judged += verdicts
            reward_wait += wait
            scores = torch.tensor([v.score for v in verdicts])
            if self.multiturn is not None:
                scores = env_scores(samples, scores, self.cfg.reward.weights)
            if self.reward_model is not None:
                model_scores = self._model_scores(samples, [prompts[s.index][0] for s in samples])
                model_score_sum += model_scores.sum().item()
                scores = scores + self.cfg.reward.weights.get(MODEL, 1.0) * model_scores
            group = torch.tensor([first_group + s.index for s in samples])
            teacher = [self.teachers.index(prompts[s.index][0].data_source) for s in samples]
            first_group += len(prompts)
            keep = torch.ones(len(samples), dtype=torch.bool)
            if algo.dynamic_sampling:
                keep, n_dropped = dynamic_sampling_filter(scores, group)
                dropped += n_dropped
            this_draw = list(zip(samples, scores.tolist(), group.tolist(), keep.tolist(), teacher))
            drawn += [(draw, *item[:4]) for item in this_draw]
            kept += [(sample, score, g, t) for sample, score, g, k, t in this_draw if k]
            if len(kept) >= target:
                break
        kept = kept[:target]  # groups are whole and in order, and target is a multiple of n
        if not kept:
            raise RuntimeError("dynamic sampling kept no group: every prompt's responses scored alike")
        every = self.run_cfg.trainer.dump_samples_every
        if every and (iteration + 1) % every == 0:
            self._dump_draws(iteration, drawn, {id(s) for s, *_ in kept})
        samples = [sample for sample, *_ in kept]
        scores = torch.tensor([score for _, score, *_ in kept], dtype=torch.float32)
        experience = experience_from_rollouts([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                                              [s.logprobs for s in samples], pad_id=self.tokenizer.pad_token_id or 0,
                                              loss_masks=[s.loss_mask for s in samples] if self.multiturn else None,
                                              **self._routes(samples))
        lengths = experience.response_mask.sum(1)
        truncated = torch.tensor([s.finish_reason == "length" for s in samples], dtype=torch.float32)
        every_score = torch.tensor([score for _, _, score, _, _ in drawn])
        if algo.overlong_buffer:
            scores = scores + self._overlong(samples)
            every_score = every_score + self._overlong([s for _, s, _, _, _ in drawn])
        token_version = torch.zeros_like(experience.response_mask, dtype=torch.long)
        for row, s in enumerate(samples):
            token_version[row, :len(s.token_versions)] = torch.tensor(s.token_versions, dtype=torch.long)
        info = {"response_length": lengths, "truncated": truncated,
                "weight_version": torch.tensor([s.weight_version for s in samples]), "token_version": token_version}
        if self.teachers:  # which teacher scores each row (TeacherRoutes.index), -1: none
            info["teacher"] = torch.tensor([t for *_, t in kept])
        experience = replace(experience, scores=scores, group_index=torch.tensor([g for _, _, g, _ in kept]), info=info)
        metrics = reward_metrics(judged) | {  # reward/*: over every draw, kept or not
            "reward/mean": every_score.mean().item(), "response/length_mean": lengths.mean().item(),
            "prompt/length_mean": float(sum(len(s.prompt_ids) for s in samples) / len(samples)),
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
        end = RECORDER.now()
        RECORDER.add("trainer/rollout", "rollout", start, end, batch=iteration + 1)
        metrics["timing/rollout"] = end - start  # generation and scoring
        metrics["timing/reward_wait"] = reward_wait  # scoring that generation did not hide
        return experience, metrics

    def close(self) -> None:
        if self.reward is not None:
            self.reward.close()

    # ---- the parts of a batch ----------------------------------------------------------------
    def _overlong(self, samples: list[Sample]) -> torch.Tensor:
        """(B,) the overlong penalty (core_algos.overlong_penalty) of each sample. One turn: its
        response length against rollout.max_new_tokens. Multi-turn: its model tokens (observations
        are not the policy's) against its own budget, the engines' context (TurnLimits.max_model_len)
        less its prompt: what reaching the context's end, a truncation, would leave it."""
        algo = self.algo
        if self.multiturn is None:
            lengths, budgets = torch.tensor([len(s.response_ids) for s in samples]), self.cfg.rollout.max_new_tokens
        else:
            lengths = torch.tensor([sum(s.loss_mask) for s in samples])
            budgets = torch.tensor([self.multiturn.limits.max_model_len - len(s.prompt_ids) for s in samples])
        return overlong_penalty(lengths, budgets, algo.overlong_buffer, algo.overlong_factor)


    def _sampling(self, iteration: int, draw: int) -> SamplingConfig:
        # Seeds depend on the iteration, so a resumed run samples what the uninterrupted one did. Each
        # draw's samples take seeds seed, seed + 1, ... (see SamplingConfig.seed): 2^24 apart,
        # no two draws of the run (up to 64 per batch) share one.
        seed = ((self.run_cfg.trainer.seed * 2**20 + iteration) * 2**6 + draw) * 2**24
        return SamplingConfig.from_config(self.cfg.rollout, seed)

    def _prompt_ids(self, rows: list[Row]) -> list[tuple[Row, list[int]]]:
        """The rows whose templated prompt fits data.prompt_max_tokens, with its ids (longer ones are skipped)."""
        out = []
        for row in rows:
            ids = encode_prompt(self.tokenizer, self.template, row.prompt)
            if len(ids) <= self.cfg.data.prompt_max_tokens:
                out.append((row, ids))
        return out

    def _generate_and_score(self, prompts: list[tuple[Row, list[int]]], sampling: SamplingConfig,
                            min_version: int, iteration: int) -> tuple[list[Sample], list[Verdict], float]:
        """The samples of every prompt in prompt order, their verdicts, and the seconds scoring took
        after the last sample: each prompt's group goes to the reward router as soon as its samples
        finish, so scoring overlaps generation."""
        pending, partial = [], self.cfg.rollout.partial
        if self.multiturn is not None:
            env = self.cfg.rollout.env
            groups = self.multiturn.stream([(ids, row.record(), row.env or env) for row, ids in prompts], sampling,
                                           min_version, interruptible=partial)
        else:
            groups = stream(self.fleet, [ids for _, ids in prompts], sampling, min_version, interruptible=partial)
        for group in groups:
            row = prompts[group[0].index][0]
            pending.append((group, self.reward.submit([s.text for s in group], [row] * len(group),
                                                      [s.finish_reason for s in group])))
        start = RECORDER.now()
        pending.sort(key=lambda item: item[0][0].index)
        scored = [(group, verdicts.result()) for group, verdicts in pending]
        samples, verdicts = [s for group, _ in scored for s in group], [v for _, vs in scored for v in vs]
        end = RECORDER.now()
        RECORDER.add("trainer/rollout", "reward_wait", start, end, batch=iteration + 1)
        return samples, verdicts, end - start

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

    def _routes(self, samples: list[Sample]) -> dict:
        """experience_from_rollouts' routing-replay arguments: the engines' routes of each sample,
        kept at the model's MoE layers (rollout.routing_replay; GPU only, untested here)."""
        if self.moe_layers is None:
            return {}
        if any(s.routed_experts is None for s in samples):
            raise RuntimeError("rollout.routing_replay=true, and an engine returned a sample without routed experts "
                               "(vLLM's enable_return_routed_experts off, or not on Model Runner V2)")
        return dict(routed_experts=[s.routed_experts for s in samples], moe_layers=self.moe_layers)

    def _dump_draws(self, iteration: int, drawn: list, kept: set[int]) -> None:
        """samples/iter_N_draws.jsonl: every sample of every draw of iteration N (= index + 1): its
        prompt, its score as the dynamic-sampling filter saw it, its group, whether it went into the
        batch, and the weight versions its tokens came from (more than one: continued by newer
        weights, partial rollout)."""
        (self.out / "samples").mkdir(exist_ok=True)
        with open(self.out / "samples" / f"iter_{iteration + 1:06d}_draws.jsonl", "w") as out:
            for draw, sample, score, group, keep in drawn:
                record = {"draw": draw, "group": group, "prompt": self.tokenizer.decode(sample.prompt_ids),
                          "response": sample.text, "score": score,
                          "length": len(sample.response_ids), "kept": id(sample) in kept, "passed_filter": keep,
                          "weight_versions": sorted(set(sample.token_versions))}
                if isinstance(sample, Conversation):  # every turn in order: origin "model" or "env", text, ids
                    record |= {"turns": [vars(turn) for turn in sample.turns], "env": sample.env,
                               "env_reward": sample.env_reward, "env_error": sample.env_error}
                out.write(json.dumps(record) + "\n")
