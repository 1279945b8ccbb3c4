"""Asynchronous against synchronous RL on the demo task: wall time per iteration, CPU use, accuracy.

    .venv/bin/python bench/bench_async.py [--iterations 15] [--eval-size 400] [--base-root runs/demo] [--smoke]

Runs the CPU demo (its pre-trained tiny base, cached in runs/demo) three times in one process, with
trainer.max_staleness=0 (generate, then train), =1 (the engines generate batch i + 1 while
the actor trains on batch i) and =1 with rollout.partial=true (an update that ends first
interrupts the batch ahead, which the new weights finish), the same seed, iterations and
held-out set, and prints ONE JSON line: seconds per iteration of each (mean over the steady
iterations, all but the first and the last: common.steady), their ratio, the ideal overlap
measured from the synchronous run (max(rollout + reward, forward + update) + sync), the
machine's CPU utilisation during each, and held-out greedy accuracy with its standard error and
the difference's.

Fields: bench, settings.smoke, sync.seconds_per_iteration, sync.phases_s.rollout, sync.cpu_utilisation,
sync.heldout_accuracy, sync.heldout_accuracy_se, async_staleness_1.seconds_per_iteration,
async_staleness_1.heldout_accuracy, async_staleness_1_partial.seconds_per_iteration,
async_staleness_1_partial.partial_samples_per_iteration, ratio_async_over_sync, ratio_partial_over_async,
ideal_overlap_s, async_over_ideal, accuracy_difference, accuracy_difference_se, threads.torch_threads,
machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    RAY_ADDRESS_HELP, SMOKE_RL, demo_base, emit, iterations_arg, machine, parse_args, ray_cluster_overrides,
    set_threads, steady,
)

from orz.demo import rl_config  # noqa: E402
from orz.train import run as train  # noqa: E402


class CpuMeter:
    """Mean whole-machine CPU utilisation (0–1) while it runs, sampled every half second."""

    def __init__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        psutil.cpu_percent(None)
        while not self._stop.wait(0.5):
            self.samples.append(psutil.cpu_percent(None) / 100)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.mean(self.samples) if self.samples else 0.0


def _run(base, spec, out: Path, staleness: int, args, partial: bool = False) -> dict:
    name = f"run_{staleness}{'_partial' if partial else ''}"
    cfg = rl_config(base, spec, out, [*(SMOKE_RL if args.smoke else []), f"rollout.partial={str(partial).lower()}",
        f"trainer.iterations={args.iterations}", f"trainer.max_staleness={staleness}", "trainer.eval_every=0",
        "trainer.eval_n=1", f"data.synthetic_eval_size={args.eval_size}", "trainer.export_hf=false",
        "trainer.dump_samples_every=0", "trainer.loggers=[jsonl]", *ray_cluster_overrides(args.ray_address),
        f"trainer.output_dir={out}/{name}",
    ])
    with CpuMeter() as cpu:
        train(cfg)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = steady([r for r in rows if "timing/step" in r])
    mean = {k: statistics.mean(r[k] for r in steps) for k in steps[0] if k.startswith("timing/")}
    accuracy = rows[-1]["eval/accuracy_greedy"]
    return {"seconds_per_iteration": mean["timing/step"], "phases_s": {k[7:]: v for k, v in mean.items()},
            "cpu_utilisation": cpu.mean, "heldout_accuracy": accuracy,
            "heldout_accuracy_se": math.sqrt(accuracy * (1 - accuracy) / args.eval_size),
            "reward_mean_last": rows[-1]["reward/mean"],
            "partial_samples_per_iteration": statistics.mean(r.get("rollout/partial_samples", 0.0) for r in steps)}


def run(args) -> dict:
    threads = set_threads(1)
    base, spec = demo_base(args.base_root, args.smoke)
    with tempfile.TemporaryDirectory() as out:
        sync = _run(base, spec, Path(out), 0, args)
        pipelined = _run(base, spec, Path(out), 1, args)
        partial = _run(base, spec, Path(out), 1, args, partial=True)
    p = sync["phases_s"]
    ideal = max(p["rollout"], p["train"]) + p["sync"]
    diff = pipelined["heldout_accuracy"] - sync["heldout_accuracy"]
    diff_se = math.hypot(pipelined["heldout_accuracy_se"], sync["heldout_accuracy_se"])
    return {
        "bench": "async_vs_sync",
        "settings": {"smoke": args.smoke, "iterations": args.iterations, "heldout_problems": args.eval_size,
                     "precision": "float32",
                     "engines": 1, "actor_workers": 1},
        "sync": sync, "async_staleness_1": pipelined, "async_staleness_1_partial": partial,
        "ratio_async_over_sync": pipelined["seconds_per_iteration"] / sync["seconds_per_iteration"],
        "ratio_partial_over_async": partial["seconds_per_iteration"] / pipelined["seconds_per_iteration"],
        "ideal_overlap_s": ideal,
        "async_over_ideal": pipelined["seconds_per_iteration"] / ideal,
        "accuracy_difference": diff, "accuracy_difference_se": diff_se,
        "threads": threads, "machine": machine(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=iterations_arg, default=15)
    parser.add_argument("--eval-size", type=int, default=400)
    parser.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    parser.add_argument("--base-root", default="runs/demo", help="where the pre-trained base model is cached")
    emit(run(parse_args(parser, smoke={"iterations": 3, "eval_size": 8})))
