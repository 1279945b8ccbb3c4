"""Checkpoints are written atomically: a crash or a full disk never leaves one that looks complete,
and the previous one stays intact."""
import errno
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from orz.config import ExperimentConfig
from orz.data.sampler import PromptLoader
from orz.models.checkpoint import atomic_dir
from orz.ppo.core_algos import FixedKLController
from orz.ppo.trainer import CheckpointError, RayPPOTrainer


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


def _trainer(tmp_path, fail):
    trainer = SimpleNamespace(
        out=tmp_path, actor=_Group(fail), critic=None, iteration=0, version=0, entropy_ctl=None,
        loader=PromptLoader(list(range(8)), 4, seed=0), kl_ctl=FixedKLController(0.0), run_cfg=ExperimentConfig(),
        pending=[],
    )
    trainer._ckpt_root = tmp_path / "checkpoints"
    return trainer


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, ray_cluster):  # ray.get([]) needs Ray
    good = _trainer(tmp_path, fail=False)
    good.iteration = 1
    RayPPOTrainer.save_checkpoint(good)
    bad = _trainer(tmp_path, fail=True)
    bad.iteration = 2
    with pytest.raises(CheckpointError, match=r"iter_000002: checkpoint not written .*No space left.*iter_000001\) is intact"):
        RayPPOTrainer.save_checkpoint(bad)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "iter_000001"
    assert sorted(p.name for p in root.iterdir()) == ["iter_000001", "latest"]
    assert json.loads((root / "iter_000001/trainer_state.json").read_text())["iteration"] == 1
