"""The asynchronous pipeline: the batches generated ahead of the actor (trainer.max_staleness = k).

    pipeline = BatchesAhead(k)
    experience, metrics = pipeline.take(iteration, build)      # the oldest batch ready
    ahead = pipeline.ahead_of(iteration, total, stage_of)        # i + k, unless past the end or the stage
    pipeline.start(generate, ahead, version)                     # generate(i + k, version), in the background
    ...                                                          # the actor trains on batch i
    if pipeline.interrupts(partial):                             # rollout.partial: at the update's end the
        fleet.interrupt(); sync()                                # batch pauses, takes the new weights
    generated_at = pipeline.finish()                             # else the weight sync waits for it

Batch i comes from weights max(0, i − k), the same run to run and on resume: a checkpoint holds
`pipeline.ready` (saved after the sync, so nothing is in flight: docs/async.md). The staleness
bound is checked on every batch taken (staleness_metrics).
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch


class BatchesAhead:
    """The batches generated and not yet trained on, and the one being generated (one at a time,
    by a background thread)."""

    def __init__(self, staleness: int):
        self.k = staleness
        self.ready: deque = deque()  # (Experience, metrics), in iteration order; a resume fills it
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="orz-rollout")
        self._generating: Future | None = None

    def take(self, iteration: int, build: Callable[[int], tuple]) -> tuple:
        """Iteration `iteration`'s batch: the oldest ready, after building here (build(i): batch i)
        what is missing: every batch on-policy (k = 0), k at a stage's first iteration or a fresh start."""
        while len(self.ready) < max(self.k, 1):
            self.ready.append(build(iteration + len(self.ready)))
        return self.ready.popleft()

    def ahead_of(self, iteration: int, total: int, stage_of: Callable[[int], int]) -> int | None:
        """The batch the engines generate while the actor trains on batch `iteration`: iteration + k;
        none past the run's `total` iterations, or in another stage than `iteration`'s (a stage's
        first batches are built on its own settings, never ahead across its boundary)."""
        ahead = iteration + self.k
        return ahead if self.k and ahead < total and stage_of(ahead) == stage_of(iteration) else None

    def interrupts(self, partial: bool) -> bool:
        """Whether the update's end interrupts the batch being generated (rollout.partial): it pauses,
        takes the new weights (the sync comes first) and finishes with them; else the sync waits
        for it to finish on the weights it started with."""
        return self.generating and partial

    def start(self, generate: Callable[..., tuple], *args) -> None:
        """generate(*args) in the background thread: (the batch, (start, end) of its generation)."""
        self._generating = self._thread.submit(generate, *args)

    @property
    def generating(self) -> bool:
        return self._generating is not None

    def finish(self) -> tuple[float, float]:
        """Waits for the batch being generated, keeps it; when (timeline clock start and end) it was
        generated, (0, 0) if none was."""
        if self._generating is None:
            return 0.0, 0.0
        batch, span = self._generating.result()
        self._generating = None
        self.ready.append(batch)
        return span

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)  # a batch in flight uses the fleet


def staleness_metrics(weight_versions: torch.Tensor, version: int, k: int, iteration: int) -> dict:
    """How many versions behind the actor's `version` each sample's weights are; more than k is
    refused (iteration: the 1-based one that would train on them, for the message)."""
    staleness = version - weight_versions
    if int(staleness.max()) > k:
        raise RuntimeError(f"iteration {iteration}: a sample of weight version {int(weight_versions.min())} is "
                           f"{int(staleness.max())} versions behind the actor's {version}, more than "
                           f"trainer.max_staleness={k}")
    return {"rollout/staleness_mean": float(staleness.float().mean()), "rollout/staleness_max": float(staleness.max())}
