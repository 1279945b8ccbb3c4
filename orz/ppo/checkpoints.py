"""A run's checkpoints: output_dir/checkpoints/iter_N holds each trained role's checkpoint in
Megatron's format (written by its own workers: orz/models/dist_checkpoint.py), trainer_state.json
(iteration, weight version, loader position, controllers, the run's config) and the batches
generated ahead (trainer.max_staleness > 0), whose weights no checkpoint holds. `latest` names the
newest complete one. The last trainer.keep_checkpoints are kept, and with trainer.keep_every=k
every k-th iteration's too.

    path = save(root, iteration, {"actor": actor, "critic": critic}, state, batches_ahead, keep=3, every=100).finish()
    recut_where_needed(path, {"actor": actor_spec})     # before the roles start, at another layout
    state, batches_ahead = load(path, {"actor": actor, "critic": critic})

Written atomically (a hidden directory beside it, renamed once every role and the state are on
disk), then `latest` is replaced: a crash or a full disk never leaves a checkpoint that looks
complete, and the previous one stays. With trainer.async_save (GPU) the roles write their files in
the background and the trainer finishes the checkpoint (the rename, `latest`) before the next one.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import ray
import torch

from orz.models.checkpoint import describe, fresh_beside, read_megatron_meta, recut_layout, replace_with
from orz.models.spec import Sizes
from orz.run.resume import iteration_of, latest

STATE, BATCHES_AHEAD = "trainer_state.json", "pending_batches.pt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory); nothing was lost."""


def saved_state(ckpt: Path) -> dict:
    """The trainer's state a checkpoint holds (its `config` is the run's, as it was saved)."""
    return json.loads((ckpt / STATE).read_text())


@dataclass
class PendingCheckpoint:
    """A checkpoint being written into `tmp` (hidden beside `final`): `finish` waits for the roles'
    asynchronous saves (none: returns at once), renames it into place and only then moves `latest`
    to it, so that a kill before leaves the previous one as the one to resume."""

    root: Path
    final: Path
    tmp: Path
    groups: dict
    keep: int
    every: int

    def finish(self) -> Path:
        """The complete checkpoint; the ones neither among the last `keep` nor at a multiple of
        `every` (0: none) are removed. CheckpointError when it could not be written."""
        try:
            for group in self.groups.values():
                group.finish_saves()
            replace_with(self.tmp, self.final)
            pointer = self.root / "latest.tmp"
            pointer.write_text(self.final.name)
            pointer.replace(self.root / "latest")
        except (OSError, ray.exceptions.RayTaskError) as err:
            raise self._not_written(err) from err
        for old in sorted(self.root.glob("iter_*"))[:-self.keep]:
            if not (self.every and iteration_of(old) % self.every == 0):
                shutil.rmtree(old, ignore_errors=True)
        return self.final

    def _not_written(self, err: Exception) -> CheckpointError:
        shutil.rmtree(self.tmp, ignore_errors=True)
        previous = latest(self.root)
        return CheckpointError(f"{self.final}: checkpoint not written ({err}); the latest complete one "
                               f"({previous.name if previous else 'none'}) is intact")


def save(root: Path, iteration: int, groups: dict, state: dict, batches_ahead, keep: int, every: int = 0,
         asynchronous: bool = False) -> PendingCheckpoint:
    """Starts root/iter_<iteration>: every group's checkpoint (group.save_async; asynchronous: its
    files still being written, GPU), `state` and the batches generated ahead; `.finish()` completes it."""
    final = root / f"iter_{iteration:06d}"
    pending = PendingCheckpoint(root, final, fresh_beside(final), groups, keep, every)
    try:
        ray.get([ref for name, group in groups.items() for ref in group.save_async(str(pending.tmp / name), asynchronous)])
        (pending.tmp / STATE).write_text(json.dumps(state, indent=1, default=str))
        torch.save(list(batches_ahead), pending.tmp / BATCHES_AHEAD)
    except (OSError, ray.exceptions.RayTaskError) as err:
        raise pending._not_written(err) from err
    return pending


def recut_where_needed(ckpt: Path, specs: dict, start_group, say=print) -> None:
    """Before a resume at another TP/PP/EP/ETP: each role saved in the distributed optimizer's fast
    cut is re-cut once (beside it, in the cut that loads at any layout) by workers that
    start_group(spec) starts at its saved layout and smallest DP, and that stop after."""
    for name, spec in specs.items():
        sizes = spec.model.sizes.as_dict()
        at = recut_layout(ckpt / name, sizes, spec.cfg.use_distributed_optimizer)
        if at is None:
            continue
        say(f"orz: {name} was saved at {describe(read_megatron_meta(ckpt / name)['layout'])}; this run has "
            f"{spec.model.sizes.label()}: re-cutting its optimizer state for any layout, once, on {describe(at)}")
        group = start_group(spec.at(Sizes(**at)))
        try:
            group.recut(str(ckpt / name))
        finally:
            group.shutdown()


def load(ckpt: Path, groups: dict) -> tuple[dict, list]:
    """Every group's checkpoint loaded (group.load_async); the trainer's state and the batches
    generated ahead."""
    ray.get([ref for name, group in groups.items() for ref in group.load_async(str(ckpt / name))])
    return saved_state(ckpt), torch.load(ckpt / BATCHES_AHEAD, weights_only=False)
