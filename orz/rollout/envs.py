"""Environments of a multi-turn rollout: the protocol, and user environments by import path.

    rollout.envs: {counter: "my_envs:Counter"}      # one instance per sample: Counter()
    env.reset(row)                                  # row: Row.record(), a plain dict
    env.step(turn_text) -> StepResult | {"observation": str | None, "reward": float | None, "done": bool}

`step` receives the text the engine decoded for the model's last turn (its stop string
included), may block (it runs in a worker thread of the driver, bounded by rollout.env_timeout_s),
and returns what the model reads next (None: nothing), a reward (summed over the sample's turns,
None: 0) and whether the sample ends. A user's environment needs no import from orz: a plain dict
is accepted. "python" names the built-in tool environment (python_tool.py).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from orz.import_path import load_by_path

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


def load_env_class(name: str, spec: str) -> Callable[[], Environment]:
    """The class `spec` ("package.module:Class") names; errors name the key, the path and the module."""
    return load_by_path(f"rollout.envs.{name}", spec, "Class")
