"""A reward that varies across a random tiny model's samples, so that GRPO's advantages and
gradients are not 0 (a random model never solves the arithmetic): the share of spaces."""


def space_share(response: str, row: dict) -> float:
    return response.count(" ") / max(len(response), 1)
