"""Multi-turn rollout, token in and token out: each sample alternates model turns and its
environment's observations until the environment says done, `max_turns` model turns, or
`max_model_len` tokens (a truncation).

    rollout = MultiTurnRollout(fleet, tokenizer, make_envs(r, code, used, tokenizer), TurnLimits.of(r, max_model_len))
    for group in rollout.stream([(prompt_ids, row.record(), env_name), ...], sampling):
        ...   # each prompt's n Conversations, as soon as all n have ended

The response of a sample is what the model and its environment appended after the prompt:

    response_ids  m m m m o o o m m m      model turn, observation, model turn
    loss_mask     1 1 1 1 0 0 0 1 1 1      0 on observation tokens: no loss, KL, entropy, IS weight
    logprobs      the engine's on m, 0 on o

A model turn is the engine's own ids and log-probs; an observation is tokenised once, on its own,
and appended as ids. The conversation is never re-tokenised: the next turn's prompt is the ids so
far, so the trainer sees exactly the tokens that were sampled (re-tokenising the joined text can
merge tokens across a turn boundary).

No barrier across the batch: the rollout driver (orz.rollout.driver) takes each sample's next
turn into its engine's running session as soon as its environment has answered (environments run
in daemon threads, bounded by env_timeout_s), while the engine keeps decoding the others. The
driver restarts a lost or hung engine and interrupts and continues turns (partial rollout); this
module keeps the conversations and calls the environments.
"""
from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from orz.config import CodeScoringConfig, RolloutConfig
from orz.rollout.engine import Sample, SamplingConfig
from orz.rollout.envs import PYTHON, Environment, StepResult, as_step_result, load_env_class
from orz.rollout.driver import Client, RolloutDriver
from orz.rollout.fleet import EngineFleet

MODEL, ENV = "model", "env"  # a turn's origin
_TURN_SEED_STRIDE = 2**20  # turn t of a sample samples from seed + t·2^20 (turn 0: the single-turn seed)


@dataclass
class Turn:
    origin: str  # MODEL or ENV
    text: str
    ids: list[int]


@dataclass
class Conversation(Sample):
    """One multi-turn sample: a Sample whose response holds every turn and observation, whose
    `text` is the model's own turns joined (what the verifier reads) and whose `finish_reason` is
    "length" when its last turn or max_model_len cut it."""

    env: str = ""  # its environment's name; "": none (one turn)
    loss_mask: list[int] = field(default_factory=list)  # 1 on model tokens, 0 on observation tokens
    turns: list[Turn] = field(default_factory=list)
    env_reward: float = 0.0  # Σ of its environment's rewards
    env_error: str = ""  # the environment raised or timed out (scored 0): what happened
    counts: dict[str, int] = field(default_factory=dict)  # tool_calls, tool_errors, tool_timeouts
    env_seconds: float = 0.0  # wall time of its environment's calls

    @property
    def model_turns(self) -> int:
        return sum(turn.origin == MODEL for turn in self.turns)


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int
    max_new_tokens: int  # per turn
    max_model_len: int  # prompt + every turn + every observation
    max_observation_tokens: int
    env_timeout_s: float

    @classmethod
    def of(cls, rollout: RolloutConfig, max_model_len: int) -> TurnLimits:
        """A run's limits; max_model_len: run_rules.context_length's, which sized the engines."""
        r = rollout
        return cls(r.max_turns, r.max_new_tokens, max_model_len, r.max_observation_tokens, r.env_timeout_s)


def make_envs(rollout: RolloutConfig, code: CodeScoringConfig, used: set[str],
              tokenizer) -> dict[str, Callable[[], Environment]]:
    """name -> a function making one sample's environment, for the names in `used`: rollout.envs'
    classes, and `python`, whose sandbox (the code reward's limits) every sample shares and whose
    chat format reads the tokenizer's chat template. A weak sandbox is refused here, before any
    rollout, unless reward.code.allow_weak_sandbox."""
    factories = {name: load_env_class(name, spec) for name, spec in rollout.envs.items() if name in used}
    if PYTHON in used:
        from orz.reward.sandbox import Sandbox, SandboxLimits
        from orz.rollout.python_tool import PythonTool, tool_format

        sandbox = Sandbox(SandboxLimits(cpu_s=code.cpu_s, memory_mb=code.memory_mb))
        sandbox.refuse_weak(code.allow_weak_sandbox, "the python environment")
        form = tool_format(rollout, tokenizer)
        factories[PYTHON] = lambda: PythonTool(sandbox, rollout.tool_timeout_s, rollout.max_observation_tokens, form,
                                               rollout.tool_format_reward)
    return factories


def turn_stops(rollout: RolloutConfig) -> dict[str, list[str]]:
    """Each environment's extra stop strings: the python tool's turns end where a code block closes."""
    from orz.rollout.python_tool import delimiters

    return {PYTHON: [delimiters(rollout)[1]]}


class MultiTurnRollout:
    """Every sample's turns and environment calls, through the rollout driver (see the module docstring)."""

    def __init__(self, fleet: EngineFleet, tokenizer, envs: dict[str, Callable[[], Environment]], limits: TurnLimits,
                 stops: dict[str, list[str]] | None = None, env_threads: int = 32):
        self.fleet, self.tokenizer, self.envs, self.limits = fleet, tokenizer, envs, limits
        self.stops = stops or {}
        self.env_threads = env_threads

    def stream(self, prompts: list[tuple[list[int], dict, str]], sampling: SamplingConfig,
               min_version: int | None = None, interruptible: bool = False) -> Iterator[list[Conversation]]:
        """prompts: (prompt ids, row record, environment name or ""). Yields each prompt's
        `sampling.n` Conversations (in sample order) as soon as all have ended, in no fixed order.
        interruptible: partial rollout (orz.rollout.driver): a turn the update interrupts keeps
        its tokens and goes on with the new weights; environment calls in flight finish."""
        conversations = Conversations(self, prompts, sampling)
        try:
            yield from RolloutDriver(self.fleet, sampling, min_version, interruptible).run(conversations)
        finally:
            conversations.close()


class Conversations(Client):
    """The multi-turn client of the rollout driver: one stream's conversations and environments.
    Sample j of prompt i is key i·n + j; its turn t samples from seed + key + t·2^20."""

    def __init__(self, rollout: MultiTurnRollout, prompts, sampling: SamplingConfig):
        super().__init__()
        self.r, self.sampling, self.n = rollout, sampling, sampling.n
        self.driver: RolloutDriver | None = None
        # Environment calls run in daemon threads: one that never returns cannot keep the process
        # alive (a ThreadPoolExecutor's threads are joined at exit).
        self.calls: queue.Queue = queue.Queue()
        for i in range(rollout.env_threads):
            threading.Thread(target=self._env_worker, name=f"orz-env-{i}", daemon=True).start()
        self.conversations: dict[int, Conversation] = {}
        self.rows: dict[int, dict] = {}
        self.instances: dict[int, Environment] = {}
        self.deadlines: dict[int, float] = {}  # key -> when its environment call times out
        for i, (prompt_ids, row, env) in enumerate(prompts):
            for j in range(self.n):
                key = i * self.n + j
                self.conversations[key] = Conversation(index=i, prompt_ids=list(prompt_ids), response_ids=[],
                                                       logprobs=[], finish_reason="", text="", weight_version=0,
                                                       env=env)
                self.rows[key] = row
        self.left = {i: self.n for i in range(len(prompts))}  # conversations not ended, by prompt

    # ---- the driver's client -----------------------------------------------------------------
    def begin(self, driver: RolloutDriver) -> None:
        self.driver = driver
        for key, conversation in self.conversations.items():
            if conversation.env:
                self._call_env(key, "reset", self.rows[key])
            else:
                self._ask_model(key)

    def finished(self) -> bool:
        return not any(self.left.values())

    def deadline(self) -> float | None:
        return min(self.deadlines.values(), default=None)

    def expire(self, now: float) -> None:
        for key in [k for k, deadline in self.deadlines.items() if deadline <= now]:
            del self.deadlines[key]
            self._env_timed_out(key)

    def turn_ended(self, key: int, turn: Sample) -> None:
        c = self.conversations[key]
        c.turns.append(Turn(MODEL, turn.text, turn.response_ids))
        c.response_ids += turn.response_ids
        c.logprobs += turn.logprobs
        c.token_versions += turn.token_versions
        c.loss_mask += [1] * len(turn.response_ids)
        c.routed_experts = turn.routed_experts  # the last turn's request covers the whole conversation
        if not c.env:
            self._end(key, turn.finish_reason)
        else:
            c.finish_reason = turn.finish_reason
            self._call_env(key, "step", turn.text)

    def _ask_model(self, key: int) -> None:
        """Asks the sample's next turn, within max_new_tokens and max_model_len."""
        c = self.conversations[key]
        context = c.prompt_ids + c.response_ids
        max_tokens = min(self.r.limits.max_new_tokens, self.r.limits.max_model_len - len(context))
        if max_tokens < 1:
            return self._end(key, "length")
        stop = [*self.sampling.stop, *self.r.stops.get(c.env, [])]
        self.driver.ask(key, c.index, context, self.sampling.seed + key + c.model_turns * _TURN_SEED_STRIDE,
                        max_tokens, stop)

    # ---- environments ------------------------------------------------------------------------
    def _env_worker(self) -> None:
        """Runs environment calls until close(); each answer, or the exception raised, goes to the driver's loop."""
        while (call := self.calls.get()) is not None:
            method, key, function = call
            try:
                answer = function()
            except Exception as err:  # noqa: BLE001 - a user's environment: the loop scores the sample 0
                answer = err
            self.driver.call_soon(functools.partial(self._env_answered, method, key, answer, time.monotonic()))

    def _call_env(self, key: int, method: str, argument) -> None:
        """env.reset(row) or env.step(turn text) in a worker thread; its answer comes back through the driver."""
        self.deadlines[key] = time.monotonic() + self.r.limits.env_timeout_s

        def call():
            start = time.perf_counter()
            try:
                if method == "reset":
                    self.instances[key] = self.r.envs[self.conversations[key].env]()
                return getattr(self.instances[key], method)(argument)
            finally:
                self.conversations[key].env_seconds += time.perf_counter() - start

        self.calls.put((method, key, call))

    def _env_answered(self, method: str, key: int, answer, answered_at: float) -> None:
        deadline = self.deadlines.pop(key, None)
        if deadline is None:  # timed out before it answered: ended already
            return
        if answered_at > deadline:
            return self._env_timed_out(key)
        c = self.conversations[key]
        if method == "step" and not isinstance(answer, Exception):
            try:
                answer = as_step_result(answer)
            except TypeError as err:
                answer = err
        if isinstance(answer, Exception):  # a user's environment: the sample scores 0, the run goes on
            c.env_error = f"{method}: {type(answer).__name__}: {answer}"[:300]
            return self._end(key, c.finish_reason or "stop")
        if method == "reset":
            return self._ask_model(key)
        self._after_step(key, answer)

    def _after_step(self, key: int, step: StepResult) -> None:
        c, limits = self.conversations[key], self.r.limits
        c.env_reward += step.reward or 0.0
        for name, count in step.counts.items():
            c.counts[name] = c.counts.get(name, 0) + count
        if step.done or step.observation is None or c.model_turns >= limits.max_turns:
            return self._end(key, c.finish_reason)
        ids = self.r.tokenizer.encode(step.observation, add_special_tokens=False)[: limits.max_observation_tokens]
        if len(c.prompt_ids) + len(c.response_ids) + len(ids) >= limits.max_model_len:
            return self._end(key, "length")  # no room for another turn: a truncation
        c.turns.append(Turn(ENV, self.r.tokenizer.decode(ids), ids))
        c.response_ids += ids
        c.logprobs += [0.0] * len(ids)
        c.token_versions += [c.token_versions[-1] if c.token_versions else 0] * len(ids)
        c.loss_mask += [0] * len(ids)
        self._ask_model(key)

    def _env_timed_out(self, key: int) -> None:
        c = self.conversations[key]
        c.env_error = f"timeout: no answer within rollout.env_timeout_s={self.r.limits.env_timeout_s}"
        self._end(key, c.finish_reason or "stop")

    # ---- ending ------------------------------------------------------------------------------
    def _end(self, key: int, finish_reason: str) -> None:
        """Ends a conversation; its group is ready once all of the prompt's n have ended."""
        c = self.conversations[key]
        c.finish_reason = finish_reason
        c.text = "".join(turn.text for turn in c.turns if turn.origin == MODEL)
        model_versions = [v for v, m in zip(c.token_versions, c.loss_mask) if m]
        c.weight_version = min(model_versions, default=self.driver.min_version)
        self.instances.pop(key, None)
        self.left[c.index] -= 1
        if not self.left[c.index]:
            first = c.index * self.n
            self._ready.append([self.conversations[k] for k in range(first, first + self.n)])

    def close(self) -> None:
        for _ in range(self.r.env_threads):
            self.calls.put(None)  # a hung environment's thread is left to end (a daemon)


def env_scores(conversations: list[Conversation], verifier_scores: torch.Tensor, weights: dict[str, float]) -> torch.Tensor:
    """(B,) s = verifier score + w_env · Σ env rewards (w_env = reward.weights[env], default 1);
    0 for a sample whose environment raised or timed out."""
    env_part = torch.tensor([weights.get(c.env, 1.0) * c.env_reward for c in conversations])
    failed = torch.tensor([bool(c.env_error) for c in conversations])
    return torch.where(failed, torch.zeros_like(verifier_scores), verifier_scores + env_part)


def multiturn_metrics(conversations: list[Conversation]) -> dict[str, float]:
    """rollout/turns_*, the tool counts, environment failures, timing/tool (Σ seconds of every
    environment call, which overlap generation), the share of response tokens from environments,
    and reward/env/<name>/mean."""
    turns = torch.tensor([float(c.model_turns) for c in conversations])
    env_tokens = sum(len(c.loss_mask) - sum(c.loss_mask) for c in conversations)
    metrics = {
        "rollout/turns_mean": turns.mean().item(), "rollout/turns_max": turns.max().item(),
        **{f"rollout/{name}": float(sum(c.counts.get(name, 0) for c in conversations))
           for name in ("tool_calls", "tool_errors", "tool_timeouts", "tool_format_errors")},
        "rollout/env_errors": float(sum(bool(c.env_error) for c in conversations)),
        "rollout/env_timeouts": float(sum(c.env_error.startswith("timeout") for c in conversations)),
        "timing/tool": sum(c.env_seconds for c in conversations),
        "rollout/env_token_frac": env_tokens / max(sum(len(c.loss_mask) for c in conversations), 1),
    }
    for name in sorted({c.env for c in conversations if c.env}):
        rewards = [c.env_reward for c in conversations if c.env == name]
        metrics[f"reward/env/{name}/mean"] = sum(rewards) / len(rewards)
    return metrics
