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


class Reviser:
    """A user's agent loop, token in and token out: a model turn, then the count of its tokens as
    observation ids (computed in a thread), then a second turn; it rewards the second turn's share
    of digits."""

    async def run(self, sample) -> None:
        first = await sample.generate()
        note = await sample.call(lambda: f" {len(first.response_ids)}:")
        sample.observe(sample.tokenizer.encode(note, add_special_tokens=False))
        second = await sample.generate()
        sample.reward += digit_share(second.text)
