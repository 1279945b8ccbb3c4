"""Deterministic, resumable batches of prompt rows: the loader's position is part of the checkpoint.

    loader = PromptLoader(rows, batch_size=64, seed=0)
    batch = next(loader)                       # a list of rows; epochs roll over forever
    state = loader.state_dict()                # save with the checkpoint (JSON-serialisable)
    loader.load_state_dict(state)              # resume: the same batches follow

Epoch e visits the rows in the order of a permutation drawn from (seed, e), so resuming needs only
(epoch, batch index), and every epoch is reshuffled differently yet reproducibly.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any


class PromptLoader:
    """Yields batches of `batch_size` rows. With drop_last (the default for RL, where batch shape
    matters more than the last few prompts of an epoch), the remainder of each epoch is skipped;
    without it, the epoch ends with a smaller batch."""

    def __init__(self, rows: Sequence[Any], batch_size: int, seed: int, drop_last: bool = True):
        if batch_size < 1 or len(rows) < (batch_size if drop_last else 1):
            raise ValueError(f"need at least one batch per epoch: {len(rows)} rows, {batch_size=}, {drop_last=}")
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_index = 0  # within the epoch
        self._order = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        full, remainder = divmod(len(self.rows), self.batch_size)
        return full + (remainder > 0 and not self.drop_last)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> list[Any]:
        if self.batch_index == self.batches_per_epoch:
            self.epoch += 1
            self.batch_index = 0
            self._order = self._permutation(self.epoch)
        start = self.batch_index * self.batch_size
        self.batch_index += 1
        return [self.rows[i] for i in self._order[start : start + self.batch_size]]

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed,
                "num_rows": len(self.rows), "batch_size": self.batch_size, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, int | bool]) -> None:
        """Resumes at the saved position; the data and settings must be the ones it was saved with."""
        mine = self.state_dict()
        different = {k: (state[k], mine[k]) for k in ("seed", "num_rows", "batch_size", "drop_last")
                     if state[k] != mine[k]}
        if different:
            raise ValueError(f"loader state is for other data or settings (saved, current): {different}")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        self._order = self._permutation(self.epoch)
