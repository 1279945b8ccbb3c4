"""Where a run starts (orz/run/resume.py): its own latest checkpoint once it has saved, whatever
trainer.resume_from says; a rollback on purpose moves the later checkpoints, metrics rows and
sample dumps aside instead of deleting them. On run directories laid out as the trainer writes
them (the end-to-end resume from another run's checkpoint is in test_trainer)."""
import json
from pathlib import Path

import pytest

from orz.cli import main as orz
from orz.config import ConfigError, load_config
from orz.run.resume import latest, rollback, set_aside, start_point


def _run_dir(root: Path, saved=(1, 2, 3), steps=4) -> Path:
    """A run's output_dir: checkpoints iter_N (each with its trainer_state.json), `latest` naming
    the last, metrics rows for steps 0..steps-1 (and a line a kill cut short), sample dumps."""
    for i in saved:
        ckpt = root / f"checkpoints/iter_{i:06d}"
        (ckpt / "actor").mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": i}))
    if saved:
        (root / "checkpoints/latest").write_text(f"iter_{saved[-1]:06d}")
    rows = "".join(json.dumps({"step": s, "reward/mean": s / 10, "timing/step": 0.123456789 * s}) + "\n"
                   for s in range(steps))
    (root / "metrics.jsonl").write_text(rows + '{"step": 4, "rew')
    (root / "samples").mkdir()
    for i in range(1, steps):
        (root / f"samples/iter_{i:06d}.jsonl").write_text(f"{i}\n")
        (root / f"samples/iter_{i:06d}_draws.jsonl").write_text(f"{i}\n")
    return root


def _cfg(out, *overrides):
    return load_config(None, ["model.path=m", f"trainer.output_dir={out}", *overrides])


def test_a_run_that_has_saved_resumes_from_its_own_latest_whatever_resume_from_says(tmp_path):
    other = _run_dir(tmp_path / "other")
    origin = other / "checkpoints/iter_000001"
    fresh = start_point(_cfg(tmp_path / "new", f"trainer.resume_from={origin}"))
    assert fresh.checkpoint == origin and f"starting from trainer.resume_from={origin}" in fresh.says
    run = _run_dir(tmp_path / "run", saved=(2, 3))  # it has saved since: a requeue with the same command
    again = start_point(_cfg(run, f"trainer.resume_from={origin}"))
    assert again.checkpoint == run / "checkpoints/iter_000003"
    assert str(run / "checkpoints/iter_000003") in again.says and f"trainer.resume_from={origin}" in again.says
    assert start_point(_cfg(run)).checkpoint == run / "checkpoints/iter_000003"
    assert start_point(_cfg(tmp_path / "new")).checkpoint is None
    # trainer.resume=false: not its own checkpoints (set aside at start), resume_from still
    assert start_point(_cfg(run, "trainer.resume=false")).checkpoint is None
    assert start_point(_cfg(run, "trainer.resume=false", f"trainer.resume_from={origin}")).checkpoint == origin


def test_a_rollback_moves_the_later_checkpoints_rows_and_dumps_aside(tmp_path, capsys):
    run = _run_dir(tmp_path / "run")
    before = (run / "metrics.jsonl").read_text()
    assert orz(["rollback", str(run), "--to", "2"]) == 0
    said = capsys.readouterr().out
    [aside] = (run / "set_aside").iterdir()
    assert f"rolled back to iteration 2" in said and str(aside) in said
    assert latest(run / "checkpoints") == run / "checkpoints/iter_000002"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001", "iter_000002", "latest"]
    # Moved, not lost: the checkpoint whole, the rows byte for byte (the kill's cut line is no row)
    assert json.loads((aside / "checkpoints/iter_000003/trainer_state.json").read_text()) == {"iteration": 3}
    rows = before.split("\n")[:-1]
    assert (run / "metrics.jsonl").read_text() == "".join(f"{r}\n" for r in rows[:3])
    assert (aside / "metrics.jsonl").read_text() == f"{rows[3]}\n"
    assert sorted(p.name for p in (aside / "samples").iterdir()) == ["iter_000003.jsonl", "iter_000003_draws.jsonl"]
    assert sorted(p.name for p in (run / "samples").iterdir()) == [f"iter_{i:06d}{s}.jsonl" for i in (1, 2)
                                                                   for s in ("", "_draws")]
    assert start_point(_cfg(run)).checkpoint == run / "checkpoints/iter_000002"


def test_a_rollback_to_an_iteration_never_saved_is_refused_naming_those_it_has(tmp_path, capsys):
    run = _run_dir(tmp_path / "run", saved=(2, 3))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert orz(["rollback", str(run), "--to", "1"]) == 2
    assert f"{run}: no checkpoint of iteration 1 to roll back to; it has 2, 3" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing moved
    with pytest.raises(ConfigError, match="it has none"):
        rollback(tmp_path / "empty", 1)


def test_starting_afresh_sets_the_earlier_run_aside(tmp_path):
    """trainer.resume=false in a directory that holds a run: its checkpoints, every metrics row and
    its dumps move aside, and `latest` goes, so that nothing of it is overwritten."""
    run = _run_dir(tmp_path / "run")
    rows = (run / "metrics.jsonl").read_text().split("\n")[:-1]
    aside = set_aside(run, after=-1)
    assert aside.name.startswith("earlier_run_")
    assert not (run / "checkpoints/latest").exists() and not list((run / "checkpoints").glob("iter_*"))
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == [f"iter_{i:06d}" for i in (1, 2, 3)]
    assert (aside / "metrics.jsonl").read_text() == "".join(f"{r}\n" for r in rows)
    assert (run / "metrics.jsonl").read_text() == ""
    assert set_aside(run, after=-1) is None  # nothing left to move
