"""The timeline's cost seen from outside: bench_e2e.py with trainer.timeline on and off, N times
each, interleaved (on, off, on, off, ...) so that the machine's drift falls on both sides alike.

    .venv/bin/python bench/timeline_ab.py [--repeats 10] [--iterations 4] [--base-root runs/demo]

Prints ONE JSON line: each side's seconds per iteration (bench_e2e's mean after the first
iteration) per repeat, their mean and standard deviation, the difference of the means, and that
difference over the spread of the repeats (|Δ| / sqrt(sd_on² + sd_off²)): below 1, the timeline's
cost is lost in the noise of a repeat. Not in the smoke set (minutes per repeat).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import emit, machine  # noqa: E402


def one(side: str, args) -> dict:
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "bench_e2e.py"), "--timeline", side,
                           "--iterations", str(args.iterations), "--base-root", args.base_root],
                          capture_output=True, text=True, check=True)
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--base-root", default="runs/demo")
    args = parser.parse_args()
    seconds = {"on": [], "off": []}
    collect = []
    for _ in range(args.repeats):
        for side in ("on", "off"):
            record = one(side, args)
            seconds[side].append(record["seconds_per_iteration"])
            if side == "on":
                collect.append(record["timeline"]["frac_of_iteration"])
    mean = {side: statistics.mean(v) for side, v in seconds.items()}
    sd = {side: statistics.stdev(v) if len(v) > 1 else 0.0 for side, v in seconds.items()}
    spread = (sd["on"] ** 2 + sd["off"] ** 2) ** 0.5
    emit({"bench": "timeline_on_off", "settings": {"repeats": args.repeats, "iterations": args.iterations},
          "seconds_per_iteration": seconds, "mean_s": mean, "sd_s": sd, "difference_s": mean["on"] - mean["off"],
          "difference_over_spread": abs(mean["on"] - mean["off"]) / spread if spread else None,
          "timeline_frac_of_iteration": {key: statistics.mean(c[key] for c in collect) for key in collect[0]},
          "machine": machine()})


if __name__ == "__main__":
    main()
