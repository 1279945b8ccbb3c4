"""`orz plot RUN_DIR`: a run's pictures, again or while it runs: curves.png (the metrics) and
timeline.png (a Gantt chart of its last iterations, from timeline.json; docs/timeline.md).

    orz plot runs/demo/grpo              # = python -m orz.plot runs/demo/grpo
    orz plot runs/demo/grpo --last 5
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orz.ppo.metrics_logger import plot_curves
from orz.timeline.picture import draw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="orz plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's trainer.output_dir")
    parser.add_argument("--last", type=int, default=3, help="how many of the last iterations timeline.png shows")
    args = parser.parse_args(argv)
    missing = [name for name in ("metrics.jsonl", "timeline.json") if not (args.run_dir / name).is_file()]
    if missing:
        print(f"orz plot: {args.run_dir} has no {' and no '.join(missing)} (is it a run's output_dir? "
              f"trainer.timeline=false writes no timeline.json)", file=sys.stderr)
        return 2
    curves = plot_curves(args.run_dir)
    timeline = args.run_dir / "timeline.png"
    lanes = draw(args.run_dir / "timeline.json", timeline, args.last)
    print(f"orz plot: {curves}\norz plot: {timeline} ({len(lanes)} lanes, the last {args.last} iterations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
