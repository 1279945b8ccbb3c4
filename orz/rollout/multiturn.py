"""Multi-turn rollout, token in and token out: each sample runs its agent loop
(orz.rollout.agent_loop: a user's own, or the built-in one of its environment) until it is done,
`max_turns` model turns, or `max_model_len` tokens (a truncation).

    rollout = MultiTurnRollout(fleet, tokenizer, make_loops(r, code, used, tokenizer), TurnLimits.of(r, max_model_len))
    for group in rollout.stream([(prompt_ids, row.record(), env_name), ...], sampling):
        ...   # each prompt's n Conversations, as soon as all n have ended

The response of a sample is what the model and its environment appended after the prompt:

    response_ids  m m m m o o o m m m      model turn, observation, model turn
    loss_mask     1 1 1 1 0 0 0 1 1 1      0 on observation tokens: no loss, KL, entropy, IS weight
    logprobs      the engine's on m, 0 on o

No barrier across the batch: every sample's loop is a task of one asyncio event loop (its own
thread), and the rollout driver (orz.rollout.driver) takes each turn asked into its engine's
running session while the engine keeps decoding the others. The driver restarts a lost or hung
engine and interrupts and continues turns (partial rollout) under the loops, which see none of it.
"""
from __future__ import annotations

import asyncio
import functools
import threading
from typing import Callable, Iterator

import torch

from orz.config import CodeScoringConfig, RolloutConfig
from orz.rollout.agent_loop import (
    MODEL, AgentLoop, AgentSample, Conversation, DaemonThreads, Ended, OneTurn, SampleFailed, TurnLimits,
)
from orz.rollout.driver import Client, RolloutDriver
from orz.rollout.engine import Sample, SamplingConfig
from orz.rollout.envs import PYTHON, EnvLoop, is_agent_loop, load_env_class
from orz.rollout.fleet import EngineFleet


def make_loops(rollout: RolloutConfig, code: CodeScoringConfig, used: set[str],
               tokenizer) -> dict[str, Callable[[], AgentLoop]]:
    """name -> a function making one sample's agent loop, for the names in `used`: rollout.envs'
    classes (an agent loop as it is, an environment through EnvLoop), and `python`, whose sandbox
    (the code reward's limits) every sample shares, whose chat format reads the tokenizer's chat
    template and whose turns end where a code block closes. A weak sandbox is refused here, before
    any rollout, unless reward.code.allow_weak_sandbox."""
    loops = {}
    for name, spec in rollout.envs.items():
        if name in used:
            cls = load_env_class(name, spec)
            loops[name] = cls if is_agent_loop(cls) else functools.partial(EnvLoop, cls, [])
    if PYTHON in used:
        from orz.reward.sandbox import Sandbox, SandboxLimits
        from orz.rollout.python_tool import PythonTool, delimiters, tool_format

        sandbox = Sandbox(SandboxLimits(cpu_s=code.cpu_s, memory_mb=code.memory_mb))
        sandbox.refuse_weak(code.allow_weak_sandbox, "the python environment")
        form = tool_format(rollout, tokenizer)
        tool = functools.partial(PythonTool, sandbox, rollout.tool_timeout_s, rollout.max_observation_tokens, form,
                                 rollout.tool_format_reward)
        loops[PYTHON] = functools.partial(EnvLoop, tool, [delimiters(rollout)[1]])
    return loops


class MultiTurnRollout:
    """Every sample's agent loop, through the rollout driver (see the module docstring)."""

    def __init__(self, fleet: EngineFleet, tokenizer, loops: dict[str, Callable[[], AgentLoop]], limits: TurnLimits,
                 env_threads: int = 32):
        self.fleet, self.tokenizer, self.loops, self.limits = fleet, tokenizer, loops, limits
        self.env_threads = env_threads

    def stream(self, prompts: list[tuple[list[int], dict, str]], sampling: SamplingConfig,
               min_version: int | None = None, interruptible: bool = False) -> Iterator[list[Conversation]]:
        """prompts: (prompt ids, row record, environment name or ""). Yields each prompt's
        `sampling.n` Conversations (in sample order) as soon as all have ended, in no fixed order.
        interruptible: partial rollout (orz.rollout.driver): a turn the update interrupts keeps
        its tokens and goes on with the new weights; environment calls in flight finish."""
        loops = AgentLoops(self, prompts, sampling)
        try:
            yield from RolloutDriver(self.fleet, sampling, min_version, interruptible).run(loops)
        finally:
            loops.close()


class AgentLoops(Client):
    """The multi-turn client of the rollout driver: one stream's samples, each an agent loop in
    an asyncio event loop of its own thread. Sample j of prompt i is key i·n + j and samples from
    seed + key (+ t·2^20 at its turn t). The two threads meet in two places: a turn asked goes to
    the driver through driver.call_soon, and a turn ended comes back as the result of its future."""

    def __init__(self, rollout: MultiTurnRollout, prompts, sampling: SamplingConfig):
        super().__init__()
        self.r, self.sampling, self.n = rollout, sampling, sampling.n
        self.driver: RolloutDriver | None = None
        self.loop = asyncio.new_event_loop()
        self.threads = DaemonThreads(rollout.env_threads, "orz-env")
        self.waiting: dict[int, asyncio.Future] = {}  # key -> its turn asked
        self.conversations: dict[int, Conversation] = {}
        self.rows: dict[int, dict] = {}
        for i, (prompt_ids, row, env) in enumerate(prompts):
            for j in range(self.n):
                key = i * self.n + j
                self.conversations[key] = Conversation(index=i, prompt_ids=list(prompt_ids), response_ids=[],
                                                       logprobs=[], finish_reason="", text="", weight_version=0,
                                                       env=env)
                self.rows[key] = row
        self.left = {i: self.n for i in range(len(prompts))}  # conversations not ended, by prompt

    # ---- the driver's client (the driver's thread) -------------------------------------------
    def begin(self, driver: RolloutDriver) -> None:
        self.driver = driver
        threading.Thread(target=self._serve, name="orz-agent-loops", daemon=True).start()
        for key in self.conversations:
            asyncio.run_coroutine_threadsafe(self._run(key), self.loop)

    def finished(self) -> bool:
        return not any(self.left.values())

    def turn_ended(self, key: int, turn: Sample) -> None:
        self.loop.call_soon_threadsafe(self._answer, key, turn)

    def _end(self, key: int) -> None:
        """Ends a conversation; its group is ready once all of the prompt's n have ended."""
        c = self.conversations[key]
        c.text = "".join(turn.text for turn in c.turns if turn.origin == MODEL)
        model_versions = [v for v, m in zip(c.token_versions, c.loss_mask) if m]
        c.weight_version = min(model_versions, default=self.driver.min_version)
        self.left[c.index] -= 1
        if not self.left[c.index]:
            first = c.index * self.n
            self._ready.append([self.conversations[k] for k in range(first, first + self.n)])

    # ---- the samples' loops (the event loop's thread) ----------------------------------------
    def _serve(self) -> None:
        self.loop.run_forever()
        self.loop.close()

    async def _run(self, key: int) -> None:
        """Runs the sample's loop to its end; a failure scores it 0 with what happened."""
        c = self.conversations[key]
        sample = AgentSample(c, self.rows[key], self.r.tokenizer, self.r.limits, self.sampling.seed + key,
                             list(self.sampling.stop), functools.partial(self._ask, key, c.index), self.threads)
        try:
            await (self.r.loops[c.env]() if c.env else OneTurn()).run(sample)
        except Ended as end:
            c.finish_reason = end.reason
        except Exception as err:  # noqa: BLE001 - a user's loop or environment: the sample scores 0
            c.env_error = (str(err) if isinstance(err, SampleFailed) else f"{type(err).__name__}: {err}")[:300]
        c.finish_reason = c.finish_reason or "stop"  # (a loop that asked no turn)
        self.driver.call_soon(functools.partial(self._end, key))

    def _ask(self, key: int, group: int, context: list[int], seed: int, max_tokens: int,
             stop: list[str]) -> asyncio.Future:
        if key in self.waiting:
            raise RuntimeError("a sample asks one turn at a time: await each generate() before the next")
        self.waiting[key] = future = self.loop.create_future()
        self.driver.call_soon(functools.partial(self.driver.ask, key, group, context, seed, max_tokens, stop))
        return future

    def _answer(self, key: int, turn: Sample) -> None:
        future = self.waiting.pop(key, None)
        if future is not None and not future.done():  # (done: cancelled, the rollout abandoned)
            future.set_result(turn)

    def close(self) -> None:
        """Cancels the loops still running (an abandoned rollout) and stops the event loop."""
        if self.driver is None:  # never begun
            self.loop.close()
        else:
            def stop():
                for task in asyncio.all_tasks(self.loop):
                    task.cancel()
                self.loop.call_soon(self.loop.stop)

            self.loop.call_soon_threadsafe(stop)
        self.threads.close()


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
