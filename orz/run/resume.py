"""Where a run starts, and how it is rolled back on purpose. Nothing a restart does sends a run
backwards or loses what it trained (docs/checkpoints.md, "Where a run starts"):

- the run has saved (`output_dir/checkpoints/latest`): every start resumes from its own latest —
  the same command again, a Slurm requeue — whatever `trainer.resume_from` says;
- it has not: `trainer.resume_from`, when set, is where it starts (a checkpoint of another run;
  torchtitan's `initial_load_path`), else it starts from `model.path`;
- `orz rollback RUN_DIR --to N`, once, by hand: the checkpoints after iteration N and the metrics
  rows after step N are moved aside (renamed, not deleted) and `latest` names iter_N, from which
  the next start resumes. `trainer.resume=false` sets the whole earlier run aside the same way.

    start = start_point(cfg)        # StartPoint(checkpoint or None, the line that says why)
    set_aside(run_dir, after=-1)    # trainer.resume=false: the earlier run moved aside
    rollback(run_dir, 200)          # `orz rollback`

Reads and renames files only: no torch, no Ray (the Slurm launcher and `orz rollback` call it).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from orz.config import ConfigError, ExperimentConfig

CHECKPOINTS, METRICS, SAMPLES, ASIDE = "checkpoints", "metrics.jsonl", "samples", "set_aside"


def latest(root: Path) -> Path | None:
    """The checkpoint root/latest names; None when there is none."""
    pointer = root / "latest"
    return root / pointer.read_text().strip() if pointer.is_file() else None


def iteration_of(ckpt: Path) -> int:
    return int(ckpt.name.removeprefix("iter_"))


def saved_iterations(run_dir: Path) -> list[int]:
    """The iterations whose complete checkpoints the run holds (hidden ones being written are not)."""
    return sorted(iteration_of(p) for p in (run_dir / CHECKPOINTS).glob("iter_[0-9]*") if p.is_dir())


@dataclass(frozen=True)
class StartPoint:
    checkpoint: Path | None  # None: from model.path
    says: str  # one line for the console


def start_point(cfg: ExperimentConfig) -> StartPoint:
    """The run's own latest checkpoint (trainer.resume), else trainer.resume_from, else none. It
    says which where trainer.resume_from is set (a run that resumes its own latest without one
    says so when it loads it)."""
    t = cfg.trainer
    own = latest(Path(t.output_dir) / CHECKPOINTS) if t.resume else None
    if own is not None:
        says = (f"orz: resuming from the run's own latest checkpoint, {own}; trainer.resume_from={t.resume_from} "
                "was where it first started" if t.resume_from else "")
        return StartPoint(own, says)
    if t.resume_from:
        return StartPoint(Path(t.resume_from), f"orz: starting from trainer.resume_from={t.resume_from} "
                                               f"({t.output_dir} has no checkpoint of its own yet)")
    return StartPoint(None, "")


def set_aside(run_dir: Path, after: int) -> Path | None:
    """Moves the run's checkpoints of iterations > `after`, its metrics rows of steps > `after` and
    its sample dumps of those iterations into run_dir/set_aside/after_<after>_<time>/ (after=-1:
    the whole earlier run, into earlier_run_<time>/); returns that directory, or None when there
    was nothing to move."""
    run_dir = Path(run_dir)
    later = [run_dir / CHECKPOINTS / f"iter_{i:06d}" for i in saved_iterations(run_dir) if i > after]
    dumps = [p for p in (run_dir / SAMPLES).glob("iter_*") if _dump_iteration(p) > after]
    metrics = run_dir / METRICS
    lines = metrics.read_text().split("\n")[:-1] if metrics.is_file() else []  # a cut last line is dropped
    rows = [(json.loads(line)["step"], line) for line in lines]
    moved_rows = [line for step, line in rows if step > after]
    if not (later or dumps or moved_rows):
        return None
    what = "earlier_run" if after < 0 else f"after_{after:06d}"
    aside = run_dir / ASIDE / f"{what}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}"
    for path, sub in [(p, CHECKPOINTS) for p in later] + [(p, SAMPLES) for p in dumps]:
        (aside / sub).mkdir(parents=True, exist_ok=True)
        path.rename(aside / sub / path.name)
    if moved_rows:
        aside.mkdir(parents=True, exist_ok=True)
        (aside / METRICS).write_text("".join(f"{line}\n" for line in moved_rows))
        _write_atomically(metrics, "".join(f"{line}\n" for step, line in rows if step <= after))
    if after < 0:
        (run_dir / CHECKPOINTS / "latest").unlink(missing_ok=True)
    return aside


def rollback(run_dir: Path, iteration: int) -> Path | None:
    """`orz rollback`: the run resumes from its checkpoint of `iteration` at its next start; what
    came later is set aside. Refused, naming the iterations it has, where it saved none such."""
    run_dir = Path(run_dir)
    saved = saved_iterations(run_dir)
    if iteration not in saved:
        raise ConfigError(f"{run_dir}: no checkpoint of iteration {iteration} to roll back to; it has "
                          f"{', '.join(map(str, saved)) or 'none'} ({run_dir / CHECKPOINTS})")
    aside = set_aside(run_dir, iteration)
    _write_atomically(run_dir / CHECKPOINTS / "latest", f"iter_{iteration:06d}")
    return aside


def _dump_iteration(path: Path) -> int:
    """samples/iter_000003_draws.jsonl → 3."""
    return int(path.name.removeprefix("iter_").split("_")[0].split(".")[0])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    """`orz rollback RUN_DIR --to N`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="orz rollback", description="Roll a run back to one of its checkpoints: "
                                     "the later checkpoints and metrics rows are moved aside, not deleted; the run's "
                                     "next start (its usual command) resumes from iter_N.")
    parser.add_argument("run_dir", help="the run's output_dir")
    parser.add_argument("--to", type=int, required=True, help="the iteration of the checkpoint to resume from")
    args = parser.parse_args(argv)
    try:
        aside = rollback(Path(args.run_dir), args.to)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    moved = f"what came after it is in {aside}" if aside else "nothing came after it"
    print(f"orz: {args.run_dir} rolled back to iteration {args.to}: its next start resumes from "
          f"checkpoints/iter_{args.to:06d}; {moved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
