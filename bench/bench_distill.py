"""On-policy distillation against GRPO alone, from the same base, on the demo task.

    .venv/bin/python bench/bench_distill.py [--iterations 15] [--seeds 0 1 2] [--eval-size 200] [--smoke]

For each seed and from the CPU demo's pre-trained base (cached in --base-root), with the same
prompts and samples per iteration: GRPO alone (the task reward), distillation alone (the teacher's
per-token reverse KL, no reward) and distillation plus the task reward, each evaluated (held-out
greedy accuracy) after every iteration. The teacher is the GRPO arm's run at seed 0, exported
(the demo's GRPO run: the accuracy the others aim at is 90% of its last). All runs share one
Ray cluster in this process. Prints ONE JSON line: per arm,
the mean accuracy after each iteration over the seeds, the first iteration each seed reaches 90%
of the teacher's accuracy (null: not within the run), and the seconds of each iteration (the
teachers' forward included); then the target's two ratios (distillation over GRPO, in iterations
and in seconds to the accuracy, on the seeds' means; null where GRPO never reached it) and, where
GRPO never reaches it, whether distillation is ahead of GRPO at every iteration from the third on.

Fields: bench, settings.smoke, settings.seeds, teacher.heldout_accuracy, target_accuracy,
grpo.accuracy_by_iteration, grpo.iterations_to_target, grpo.seconds_per_iteration,
distill.accuracy_by_iteration, distill.iterations_to_target, distill.seconds_per_iteration,
distill_task.accuracy_by_iteration, distill_task.iterations_to_target,
iterations_ratio_distill_over_grpo, seconds_ratio_distill_over_grpo, distill_ahead_from_third,
threads.torch_threads, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    RAY_ADDRESS_HELP, SMOKE_RL, demo_base, emit, iterations_arg, machine, parse_args, ray_session, set_threads,
)

from orz.demo import distill_settings, rl_config  # noqa: E402
from orz.train import run as train  # noqa: E402

ARMS = {"grpo": None, "distill": [], "distill_task": ["distill.task_reward=true"]}  # beside distill_settings


def _common(args, out: Path, name: str, seed: int) -> list[str]:
    return [*(SMOKE_RL if args.smoke else []), f"trainer.iterations={args.iterations}", "trainer.eval_every=1",
            "trainer.eval_n=1", f"data.synthetic_eval_size={args.eval_size}", "trainer.dump_samples_every=0",
            "trainer.loggers=[jsonl]", f"trainer.seed={seed}", "trainer.ray_num_cpus=0",
            f"trainer.output_dir={out / name}"]


def _rows(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def _first_reaching(accuracies: list[float], target: float) -> int | None:
    """The first iteration (1-based; 0: before training) whose accuracy is at least `target`."""
    return next((i for i, a in enumerate(accuracies) if a >= target), None)


def _arm(base, spec, out: Path, args, arm: str, teacher: Path | None) -> dict:
    """The arm's accuracy after each iteration (0: before training) and seconds of each, per seed;
    the GRPO arm (teacher None) exports its seed-0 run, the others' teacher."""
    accuracies, seconds = [], []
    for seed in args.seeds:
        name = f"{arm}_seed{seed}"
        extra = [] if teacher is None else [*distill_settings(teacher), *ARMS[arm]]
        export = teacher is None and seed == 0
        train(rl_config(base, spec, out, [*_common(args, out, name, seed), *extra, f"trainer.export_hf={export}"]))
        rows = _rows(out, name)
        accuracies.append([row["eval/accuracy_greedy"] for row in rows])
        seconds.append([row["timing/step"] for row in rows[1:]])
    return {"accuracies": accuracies, "seconds": seconds}


def _summary(runs: dict, target: float) -> dict:
    accuracies, seconds = runs["accuracies"], runs["seconds"]
    by_iteration = [statistics.mean(a[i] for a in accuracies) for i in range(len(accuracies[0]))]
    per_iteration = [statistics.mean(s[i] for s in seconds) for i in range(len(seconds[0]))]
    return {"accuracy_by_iteration": by_iteration,
            "iterations_to_target": [_first_reaching(a, target) for a in accuracies],
            "seconds_per_iteration": statistics.mean(per_iteration), "seconds_by_iteration": per_iteration,
            "mean_iterations_to_target": _first_reaching(by_iteration, target)}


def _seconds_to(arm: dict, iteration: int | None) -> float | None:
    return None if iteration is None else sum(arm["seconds_by_iteration"][:iteration])


def run(args) -> dict:
    if 0 not in args.seeds:
        raise SystemExit(f"--seeds {args.seeds}: must include 0, whose GRPO run is the teacher")
    threads = set_threads(1)
    base, spec = demo_base(args.base_root, args.smoke)
    with tempfile.TemporaryDirectory() as tmp, ray_session(num_cpus=8, address=args.ray_address):
        out = Path(tmp)
        runs = {"grpo": _arm(base, spec, out, args, "grpo", None)}
        teacher_accuracy = runs["grpo"]["accuracies"][args.seeds.index(0)][-1]
        runs |= {arm: _arm(base, spec, out, args, arm, out / "grpo_seed0" / "hf") for arm in ARMS if arm != "grpo"}
    target = 0.9 * teacher_accuracy
    arms = {arm: _summary(arm_runs, target) for arm, arm_runs in runs.items()}
    grpo, distill = arms["grpo"]["mean_iterations_to_target"], arms["distill"]["mean_iterations_to_target"]
    ahead = all(d > g for d, g in zip(arms["distill"]["accuracy_by_iteration"][3:],
                                      arms["grpo"]["accuracy_by_iteration"][3:]))
    both = grpo is not None and distill is not None and grpo > 0
    return {
        "bench": "distill_vs_grpo",
        "settings": {"smoke": args.smoke, "iterations": args.iterations, "seeds": args.seeds,
                     "heldout_problems": args.eval_size,
                     "precision": "float32", "engines": 1, "actor_workers": 1, "teacher_workers": 1},
        "teacher": {"heldout_accuracy": teacher_accuracy},
        "target_accuracy": target,
        **arms,
        "iterations_ratio_distill_over_grpo": distill / grpo if both else None,
        "seconds_ratio_distill_over_grpo": _seconds_to(arms["distill"], distill) / _seconds_to(arms["grpo"], grpo)
        if both else None,
        "distill_ahead_from_third": ahead,
        "threads": threads, "machine": machine(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=iterations_arg, default=15)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    parser.add_argument("--base-root", default="runs/demo", help="where the pre-trained base model is cached")
    emit(run(parse_args(parser, smoke={"iterations": 2, "seeds": [0], "eval_size": 8})))
