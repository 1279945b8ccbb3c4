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

    def __init__(self, fail: bool):
        self.fail = fail

    def save_async(self, root):
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        Path(root).mkdir(parents=True)
        (Path(root) / "model.safetensors").write_text("weights")
        return []  # no Ray refs to wait for


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, ray_cluster):  # ray.get([]) needs Ray
    root = tmp_path / "checkpoints"
    checkpoints.save(root, 1, {"actor": _Group(fail=False)}, {"iteration": 1}, [], keep=3)
    with pytest.raises(CheckpointError, match=r"iter_000002: checkpoint not written .*No space left.*iter_000001\) is intact"):
        checkpoints.save(root, 2, {"actor": _Group(fail=True)}, {"iteration": 2}, [], keep=3)
    assert (root / "latest").read_text() == "iter_000001"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "latest"]
    assert json.loads((root / "iter_000001/trainer_state.json").read_text())["iteration"] == 1
    assert (root / "iter_000001/actor/model.safetensors").is_file()
