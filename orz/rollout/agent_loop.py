"""Your own agent loop, token in and token out: what one sample does between its prompt and its end.

    class Reviser:                                  # rollout.envs: {revise: "my_loops:Reviser"}
        async def run(self, sample: AgentSample) -> None:
            first = await sample.generate()         # the model's turn: its ids, in the loss
            ids = sample.tokenizer.encode(" Check it:", add_special_tokens=False)
            sample.observe(ids)                     # your ids, out of the loss
            hint = await sample.call(search, first.text)   # a blocking call, in a thread
            ...
            sample.reward += 1.0                    # summed, weighed by reward.weights[revise]

One instance per sample (`Reviser()`); `run` returns when the sample is done. The sample is then
scored as every other: the verifier reads the model's own turns, plus the loop's reward. The
loops run as tasks of one asyncio event loop beside the rollout driver (orz.rollout.driver), so
a thousand samples wait on the engine or on their tools at once; only `call` may block.

    sample.generate(stop=())   the model's next turn (an engine Sample: response_ids, text,
                               finish_reason), asked on the ids so far, within max_new_tokens and
                               max_model_len; seed + key + t·2^20 for its t-th turn; one at a time
    sample.observe(ids, text)  appends an observation, cut to max_observation_tokens
    sample.call(fn, *args)     fn(*args) in a daemon thread, within rollout.env_timeout_s
    sample.fail(reason)        the sample scores 0 (rollout/env_errors); so does an exception out of run
    sample.row, .prompt_ids, .response_ids, .loss_mask, .turns, .reward, .counts, .tokenizer

`generate` and `observe` raise `Ended` where the sample can take no more (rollout.max_turns model
turns, or a context with no room left: finish_reason "length"); the sample then ends there, so a
loop need not catch it. The built-in reset/step environments (orz.rollout.envs.EnvLoop) and the
single turn of a row without one (OneTurn) are loops of this kind. The whole response is the
turns' ids appended, never re-tokenised: the trainer sees exactly the tokens that were sampled.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from orz.config import RolloutConfig
from orz.rollout.engine import Sample
from orz.timeline.record import RECORDER

MODEL, ENV = "model", "env"  # a turn's origin
TURN_SEED_STRIDE = 2**20  # turn t of a sample samples from seed + t·2^20 (turn 0: the single-turn seed)


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

    env: str = ""  # its environment's (or loop's) name; "": none (one turn)
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


class Ended(Exception):
    """The sample can take no more turns; it ends with `reason` (its finish_reason) where raised."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class SampleFailed(Exception):
    """The sample scores 0; its message is the sample's env_error."""


class EnvTimeout(SampleFailed, TimeoutError):
    """A call with no answer within rollout.env_timeout_s."""


class AgentLoop(Protocol):
    async def run(self, sample: AgentSample) -> None: ...


# What the driver's client hands a sample to ask for a turn: (context ids, seed, max tokens, stop) -> its Sample.
Ask = Callable[[list[int], int, int, list[str]], Awaitable[Sample]]


class AgentSample:
    """One sample as its agent loop sees it (see the module docstring)."""

    def __init__(self, conversation: Conversation, row: dict, tokenizer, limits: TurnLimits, seed: int,
                 stop: list[str], ask: Ask, threads: DaemonThreads):
        self.conversation, self.row, self.tokenizer, self.limits = conversation, row, tokenizer, limits
        self.seed, self.stop, self._ask, self._threads = seed, stop, ask, threads

    @property
    def prompt_ids(self) -> list[int]:
        return self.conversation.prompt_ids

    @property
    def response_ids(self) -> list[int]:
        return self.conversation.response_ids

    @property
    def loss_mask(self) -> list[int]:
        return self.conversation.loss_mask

    @property
    def turns(self) -> list[Turn]:
        return self.conversation.turns

    @property
    def model_turns(self) -> int:
        return self.conversation.model_turns

    @property
    def counts(self) -> dict[str, int]:
        return self.conversation.counts

    @property
    def reward(self) -> float:
        return self.conversation.env_reward

    @reward.setter
    def reward(self, value: float) -> None:
        self.conversation.env_reward = float(value)

    async def generate(self, stop: list[str] | tuple = ()) -> Sample:
        """The model's next turn on the ids so far, appended (loss 1) with its log-probs and versions."""
        c, limits = self.conversation, self.limits
        if c.model_turns >= limits.max_turns:
            raise Ended(c.finish_reason or "stop")
        context = c.prompt_ids + c.response_ids
        max_tokens = min(limits.max_new_tokens, limits.max_model_len - len(context))
        if max_tokens < 1:
            raise Ended("length")
        turn = await self._ask(context, self.seed + c.model_turns * TURN_SEED_STRIDE, max_tokens, [*self.stop, *stop])
        c.turns.append(Turn(MODEL, turn.text, turn.response_ids))
        c.response_ids += turn.response_ids
        c.logprobs += turn.logprobs
        c.token_versions += turn.token_versions
        c.loss_mask += [1] * len(turn.response_ids)
        c.routed_experts = turn.routed_experts  # the last turn's request covers the whole conversation
        c.finish_reason = turn.finish_reason
        return turn

    def observe(self, ids: list[int], text: str | None = None) -> None:
        """Appends an observation's first max_observation_tokens ids (loss 0); one that leaves no
        room for another turn ends the sample with "length" instead."""
        c, cut = self.conversation, len(ids) > self.limits.max_observation_tokens
        ids = list(ids[: self.limits.max_observation_tokens])
        if len(c.prompt_ids) + len(c.response_ids) + len(ids) >= self.limits.max_model_len:
            raise Ended("length")
        text = self.tokenizer.decode(ids) if text is None or cut else text
        c.turns.append(Turn(ENV, text, ids))
        c.response_ids += ids
        c.logprobs += [0.0] * len(ids)
        c.token_versions += [c.token_versions[-1] if c.token_versions else 0] * len(ids)
        c.loss_mask += [0] * len(ids)

    async def call(self, function: Callable[..., Any], *args) -> Any:
        """function(*args) in a daemon thread (one that never returns cannot keep the process
        alive); EnvTimeout past rollout.env_timeout_s, the call's wall time in env_seconds."""
        start = RECORDER.now()
        future = asyncio.wrap_future(self._threads.submit(function, *args))
        try:  # asyncio.wait, not wait_for: a TimeoutError the call raises is its own, not a timeout
            done, _ = await asyncio.wait({future}, timeout=self.limits.env_timeout_s)
        finally:
            end = RECORDER.now()
            self.conversation.env_seconds += end - start
            RECORDER.add(f"environments/{self.conversation.env}", "call", start, end)
        if not done:
            future.cancel()
            raise EnvTimeout(f"timeout: no answer within rollout.env_timeout_s={self.limits.env_timeout_s}")
        return future.result()

    def fail(self, reason: str) -> None:
        raise SampleFailed(reason)


class OneTurn:
    """A row without an environment: one model turn."""

    async def run(self, sample: AgentSample) -> None:
        await sample.generate()


class DaemonThreads:
    """A pool of daemon threads with an executor's `submit` (a ThreadPoolExecutor's threads are
    joined at exit: a hung environment would keep the process alive)."""

    def __init__(self, count: int, name: str):
        self.calls: queue.Queue = queue.Queue()
        self.count = count
        for i in range(count):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, function: Callable[..., Any], *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((future, function, args))
        return future

    def _work(self) -> None:
        while (call := self.calls.get()) is not None:
            future, function, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as err:  # noqa: BLE001 - a user's call: its caller decides
                future.set_exception(err)

    def close(self) -> None:
        for _ in range(self.count):
            self.calls.put(None)  # a hung call's thread is left to end (a daemon)
