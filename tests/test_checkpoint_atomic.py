"""Checkpoints are written atomically: a crash or a full disk never leaves one that looks complete,
and the previous one stays intact."""
import errno
import json
from pathlib import Path

import pytest

from orz.models.checkpoint import atomic_dir
from orz.ppo import checkpoints
from orz.ppo.checkpoints import CheckpointError


def test_atomic_dir_replaces_only_on_success(tmp_path):
    dest = tmp_path / "ckpt"
    with atomic_dir(dest) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(OSError, match="No space left"):
        with atomic_dir(dest) as tmp:
            (tmp / "weights").write_text("v2, half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert (dest / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directory left behind
    with atomic_dir(dest) as tmp:
        (tmp / "weights").write_text("v2")
    assert (dest / "weights").read_text() == "v2"


class _Group:
    """Stands in for a worker group: `save` writes a shard, or fails like a full disk."""

    def __init__(self, fail: bool, fail_in_background: bool = False):
        self.fail, self.fail_in_background = fail, fail_in_background

    def save_async(self, root, asynchronous=False):
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(root).mkdir(parents=True)
        self.writing = Path(root) / "model.safetensors"
        if not asynchronous:
            self.finish_saves()
        return []  # no Ray refs to wait for

    def finish_saves(self):
        """The background writer is done: the file is there (or the disk filled up meanwhile)."""
        if self.fail_in_background:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.writing.write_text("weights")


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, ray_cluster):  # ray.get([]) needs Ray
    root = tmp_path / "checkpoints"
    checkpoints.save(root, 1, {"actor": _Group(fail=False)}, {"iteration": 1}, [], keep=3).finish()
    with pytest.raises(CheckpointError, match=r"iter_000002: checkpoint not written .*No space left.*iter_000001\) is intact"):
        checkpoints.save(root, 2, {"actor": _Group(fail=True)}, {"iteration": 2}, [], keep=3)
    assert (root / "latest").read_text() == "iter_000001"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "latest"]
    assert json.loads((root / "iter_000001/trainer_state.json").read_text())["iteration"] == 1
    assert (root / "iter_000001/actor/model.safetensors").is_file()


def test_a_checkpoint_written_in_the_background_is_latest_only_once_finished(tmp_path, ray_cluster):
    """trainer.async_save's order: while the roles' files are still being written the checkpoint is
    a hidden directory and `latest` names the previous one; `finish` renames it and only then moves
    `latest`. A kill in between resumes from the previous one."""
    root = tmp_path / "checkpoints"
    checkpoints.save(root, 1, {"actor": _Group(fail=False)}, {"iteration": 1}, [], keep=3).finish()
    pending = checkpoints.save(root, 2, {"actor": _Group(fail=False)}, {"iteration": 2}, [], keep=3, asynchronous=True)
    assert (root / "latest").read_text() == "iter_000001" and not (root / "iter_000002").exists()
    assert not (pending.tmp / "actor/model.safetensors").exists()  # the premise: still being written
    assert pending.finish() == root / "iter_000002"
    assert (root / "latest").read_text() == "iter_000002" and (root / "iter_000002/actor/model.safetensors").is_file()


def test_a_background_write_that_fails_leaves_latest_on_the_previous_checkpoint(tmp_path, ray_cluster):
    """One rank's background write fails (ENOSPC) after the save started: `finish` raises, naming
    the intact checkpoint; `latest` still names it, and nothing lies under the new one's name or
    beside it. Moving `latest` before the roles' saves have finished fails here."""
    root = tmp_path / "checkpoints"
    checkpoints.save(root, 1, {"actor": _Group(fail=False)}, {"iteration": 1}, [], keep=3).finish()
    groups = {"actor": _Group(fail=False), "critic": _Group(fail=False, fail_in_background=True)}
    pending = checkpoints.save(root, 2, groups, {"iteration": 2}, [], keep=3, asynchronous=True)
    with pytest.raises(CheckpointError, match=r"iter_000002: checkpoint not written .*No space left.*"
                                              r"\(iter_000001\) is intact"):
        pending.finish()
    assert (root / "latest").read_text() == "iter_000001"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "latest"]


def test_keep_every_keeps_each_kth_checkpoint_beside_the_last_ones(tmp_path, ray_cluster):
    """keep=2, every=3 over iterations 1..8: the last two (7, 8) and the multiples of 3 (3, 6) stay."""
    root = tmp_path / "checkpoints"
    for iteration in range(1, 9):
        checkpoints.save(root, iteration, {"actor": _Group(fail=False)}, {"iteration": iteration}, [], keep=2,
                         every=3).finish()
    assert sorted(p.name for p in root.glob("iter_*")) == [f"iter_{i:06d}" for i in (3, 6, 7, 8)]
