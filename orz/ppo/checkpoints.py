"""A run's checkpoints: output_dir/checkpoints/iter_N holds each trained role's shards (written by
its own workers, which re-shard them on load: workers.py), trainer_state.json (iteration, weight
version, loader position, controllers, the run's config) and the batches generated ahead
(trainer.max_staleness > 0), whose weights no checkpoint holds. `latest` names the newest
complete one; the oldest go beyond trainer.keep_checkpoints.

    path = save(root, iteration, {"actor": actor, "critic": critic}, state, batches_ahead, keep=3)
    state, batches_ahead = load(path, {"actor": actor, "critic": critic})

Written atomically (orz.models.checkpoint.atomic_dir: a temporary directory renamed once every
role and the state are on disk), then `latest` is replaced: a crash or a full disk never leaves
a checkpoint that looks complete, and the previous one stays.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import ray
import torch

from orz.models.checkpoint import atomic_dir

STATE, BATCHES_AHEAD = "trainer_state.json", "pending_batches.pt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory); nothing was lost."""


def latest(root: Path) -> Path | None:
    """The checkpoint root/latest names; None when there is none."""
    pointer = root / "latest"
    return root / pointer.read_text().strip() if pointer.is_file() else None


def saved_state(ckpt: Path) -> dict:
    """The trainer's state a checkpoint holds (its `config` is the run's, as it was saved)."""
    return json.loads((ckpt / STATE).read_text())


def save(root: Path, iteration: int, groups: dict, state: dict, batches_ahead, keep: int) -> Path:
    """Writes root/iter_<iteration>: every group's shards (group.save_async), `state` and the
    batches generated ahead; returns it. CheckpointError when it could not be written."""
    final = root / f"iter_{iteration:06d}"
    try:
        with atomic_dir(final) as tmp:
            ray.get([ref for name, group in groups.items() for ref in group.save_async(str(tmp / name))])
            (tmp / STATE).write_text(json.dumps(state, indent=1, default=str))
            torch.save(list(batches_ahead), tmp / BATCHES_AHEAD)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        pointer.replace(root / "latest")
    except (OSError, ray.exceptions.RayTaskError) as err:
        previous = latest(root)
        raise CheckpointError(f"{final}: checkpoint not written ({err}); the latest complete one "
                              f"({previous.name if previous else 'none'}) is intact") from err
    for old in sorted(root.glob("iter_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load(ckpt: Path, groups: dict) -> tuple[dict, list]:
    """Every group's shards loaded (group.load_async); the trainer's state and the batches
    generated ahead (none in a checkpoint written before they were saved)."""
    ray.get([ref for name, group in groups.items() for ref in group.load_async(str(ckpt / name))])
    ahead = ckpt / BATCHES_AHEAD
    return saved_state(ckpt), torch.load(ahead, weights_only=False) if ahead.is_file() else []
