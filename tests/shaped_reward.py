"""Rewards that vary across a random tiny model's samples, so that GRPO's advantages and
gradients are not 0 (a random model never solves the arithmetic): the share of spaces, or of
digits (for runs whose responses stop at their first digit, `tiny_run`'s default)."""


def space_share(response: str, row: dict) -> float:
    return response.count(" ") / max(len(response), 1)


def digit_share(response: str, row: dict) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)
