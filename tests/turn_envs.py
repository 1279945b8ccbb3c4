"""Environments for the multi-turn tests, given by import path (`rollout.envs={echo: 'turn_envs:Echo'}`);
plain classes that import nothing from orz."""


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


class Echo:
    """Never done: the sample ends at rollout.max_turns. Each step rewards the share of digits in
    the turn and answers " ok:"."""

    def reset(self, row: dict) -> None:
        self.question = row["prompt"]

    def step(self, turn_text: str) -> dict:
        return {"observation": " ok:", "reward": digit_share(turn_text), "done": False}


class Broken:
    """Raises at its first step: its samples score 0 and are counted in rollout/env_errors."""

    def reset(self, row: dict) -> None:
        pass

    def step(self, turn_text: str) -> dict:
        raise RuntimeError("broken on purpose")
