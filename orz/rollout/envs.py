"""Environments of a multi-turn rollout: the protocol, and user environments by import path.

    rollout.envs: {counter: "my_envs:Counter"}      # one instance per sample: Counter()
    env.reset(row)                                  # row: Row.record(), a plain dict
    env.step(turn_text) -> StepResult | {"observation": str | None, "reward": float | None, "done": bool}

`step` receives the text the engine decoded for the model's last turn (its stop string
included), may block (it runs in a daemon thread, bounded by rollout.env_timeout_s), and returns
what the model reads next (None: nothing), a reward (summed over the sample's turns, None: 0) and
whether the sample ends. A user's environment needs no import from orz: a plain dict is
accepted. "python" names the built-in tool environment (python_tool.py).

An environment runs as an agent loop (EnvLoop; orz.rollout.agent_loop): a class in rollout.envs
with an `async def run(sample)` is a loop of the user's own instead, run as it is.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from orz.import_path import load_by_path
from orz.rollout.agent_loop import AgentLoop, AgentSample, SampleFailed

PYTHON = "python"  # reserved: the built-in python tool


def envs_used(rollout, rows) -> set[str]:
    """The environments a stage's rows use (a row's own, else rollout.env); empty: single turn."""
    return {row.env or rollout.env for row in rows} - {""}


def env_names(envs: dict[str, str]) -> set[str]:
    """Every environment a run knows (rollout.envs and the built-in one): reward.weights may weigh them."""
    return {PYTHON, *envs}


class Environment(Protocol):
    def reset(self, row: dict) -> None: ...

    def step(self, turn_text: str) -> StepResult | dict: ...


@dataclass(frozen=True)
class StepResult:
    observation: str | None = None  # what the model reads next; None: nothing (the sample ends)
    reward: float | None = None  # added to the sample's environment reward
    done: bool = False
    counts: dict[str, int] = field(default_factory=dict)  # e.g. {"tool_calls": 1}: summed into rollout/<name>


def as_step_result(value: Any) -> StepResult:
    """A step's return value as a StepResult; a dict needs "done" and may hold "observation" and "reward"."""
    if isinstance(value, StepResult):
        return value
    if not isinstance(value, dict) or "done" not in value or set(value) - {"observation", "reward", "done"}:
        raise TypeError(f"an environment's step must return a StepResult or a dict with 'done' (and optionally "
                        f"'observation', 'reward'); got {value!r:.200}")
    observation, reward = value.get("observation"), value.get("reward")
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"step's observation must be text or None, got {type(observation).__name__}")
    if reward is not None and not isinstance(reward, numbers.Real):
        raise TypeError(f"step's reward must be a number or None, got {type(reward).__name__}")
    return StepResult(observation, None if reward is None else float(reward), bool(value["done"]))


class EnvLoop:
    """An environment as an agent loop: reset(row), then a model turn and step(its text), each
    observation appended, until the environment is done, observes nothing, or max_turns ends it.
    What the environment raises fails the sample ("step: <error>")."""

    def __init__(self, make: Callable[[], Environment], stop: list[str]):
        self.make, self.stop = make, stop

    async def run(self, sample: AgentSample) -> None:
        env = await self._call(sample, "reset", self._reset, sample.row)
        while True:
            turn = await sample.generate(self.stop)
            step = await self._call(sample, "step", lambda: as_step_result(env.step(turn.text)))
            sample.reward += step.reward or 0.0
            for name, count in step.counts.items():
                sample.counts[name] = sample.counts.get(name, 0) + count
            if step.done or step.observation is None or sample.model_turns >= sample.limits.max_turns:
                return
            sample.observe(sample.tokenizer.encode(step.observation, add_special_tokens=False))

    def _reset(self, row: dict) -> Environment:
        env = self.make()
        env.reset(row)
        return env

    @staticmethod
    async def _call(sample: AgentSample, method: str, function: Callable[..., Any], *args) -> Any:
        try:
            return await sample.call(function, *args)
        except SampleFailed:
            raise
        except Exception as err:  # noqa: BLE001 - a user's environment: the sample scores 0
            raise SampleFailed(f"{method}: {type(err).__name__}: {err}") from err


def is_agent_loop(cls: type) -> bool:
    """Whether a class in rollout.envs is an agent loop (an `async def run`) rather than an environment."""
    return inspect.iscoroutinefunction(getattr(cls, "run", None))


def load_env_class(name: str, spec: str) -> Callable[[], Environment | AgentLoop]:
    """The class `spec` ("package.module:Class") names, an environment (reset and step) or an agent
    loop (async run); errors name the key, the path and the module."""
    cls = load_by_path(f"rollout.envs.{name}", spec, "Class")
    if not is_agent_loop(cls) and not (callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))):
        raise ValueError(f"rollout.envs.{name}: {spec!r} is neither an environment (methods reset and step) nor an "
                         "agent loop (an 'async def run(self, sample)')")
    return cls
