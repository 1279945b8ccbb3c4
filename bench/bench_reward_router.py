"""Verifiers in parallel: a mixed batch of math and code responses through the reward router,
against the same two kinds scored one after the other.

    .venv/bin/python bench/bench_reward_router.py [--math 512] [--code 512] [--rounds 3] [--smoke]

Math responses: MATH500/AIME ground truths when ../shared/data is there (synthetic arithmetic
otherwise), half right (boxed, sometimes in another form), half wrong. Code responses: the
synthetic code task, half right, half wrong, each run in the sandbox. The router runs math-verify
in its pool while the sandbox's process start-ups proceed, so the mixed batch should take at most
0.8x the sequential time (the issue's target) wherever one kind alone leaves cores idle. Two
sizings, in the same run: the defaults (2 math workers, 4 sandboxed solutions at once: each kind
alone already fills a 2-core machine), and one core's worth each (1 and 1). Prints ONE JSON line:
per sizing, median seconds per side over `rounds` alternating rounds, their ratio, responses/s, and
the machine's CPU utilisation during each side (all cores, from /proc/stat: the limit here is the
cores, not matmul or bandwidth).

Fields: bench, workload.smoke, workload.math, workload.code, target_ratio, defaults.sequential_s,
defaults.mixed_s, defaults.mixed_over_sequential, defaults.ideal_over_sequential,
defaults.cpu_utilisation_mixed, defaults.accuracy.math, defaults.accuracy.code, defaults.failures.timeouts,
one_core_each.mixed_over_sequential, one_core_each.accuracy.code, machine.cpu.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import emit, machine, parse_args  # noqa: E402

from orz.config import CodeScoringConfig, RewardConfig  # noqa: E402
from orz.data.datasets import load_rows, load_source  # noqa: E402
from orz.reward.router import RewardRouter, RouterConfig, reward_metrics  # noqa: E402

SHARED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
FENCE = "```"


def math_batch(n: int, rng: random.Random) -> tuple[list, list[str], str]:
    names = ("math500.json", "aime2024.json")
    if all(os.path.exists(os.path.join(SHARED_DATA, name)) for name in names):
        pool, source = [r for name in names for r in load_rows(os.path.join(SHARED_DATA, name))], "math500+aime2024"
    else:
        pool, source = load_source("synthetic:arithmetic", split="test", size=500, seed=0), "synthetic arithmetic"
    rows = [rng.choice(pool) for _ in range(n)]
    responses = [f"Working... so the answer is \\boxed{{{r.answer}}}." if i % 2 == 0 else
                 f"Working... so the answer is \\boxed{{{r.answer}+1}}." for i, r in enumerate(rows)]
    return rows, responses, source


def code_batch(n: int) -> tuple[list, list[str]]:
    rows = load_source("synthetic:code", split="test", size=n, seed=0, digits=(1, 3))
    expressions = [r.prompt.removeprefix("Write a Python program that prints the value of ").rstrip(".") for r in rows]
    responses = [f"<think> easy </think> {FENCE}python\nprint({e}{'' if i % 2 == 0 else ' + 1'})\n{FENCE}"
                 for i, e in enumerate(expressions)]
    return rows, responses


def cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [float(x) for x in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def timed(fn) -> tuple[float, float, object]:
    """(seconds, CPU utilisation of the machine, result) of one call."""
    busy0, total0 = cpu_busy()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    busy1, total1 = cpu_busy()
    return seconds, (busy1 - busy0) / max(total1 - total0, 1.0), result


def measure(math_workers: int, code_parallel: int, batches: dict, rounds: int) -> dict:
    """Sequential (math, then code) against mixed, alternating, at one sizing of the pools."""
    (math_rows, math_responses), (code_rows, code_responses), (mixed_rows, mixed_responses) = batches.values()
    cfg = RouterConfig.from_config(RewardConfig(num_workers=math_workers, code=CodeScoringConfig(max_parallel=code_parallel)))
    sequential, together, seq_cpu, mix_cpu, parts = [], [], [], [], []
    with RewardRouter(cfg, mixed_rows) as router:
        router.score(mixed_responses[:64], mixed_rows[:64])  # warm the pools
        for _ in range(rounds):
            math_s, math_cpu, _ = timed(lambda: router.score(math_responses, math_rows))
            code_s, code_cpu, _ = timed(lambda: router.score(code_responses, code_rows))
            sequential.append(math_s + code_s)
            parts.append((math_s, code_s))
            seq_cpu.append((math_s * math_cpu + code_s * code_cpu) / (math_s + code_s))
            mixed_s, cpu, verdicts = timed(lambda: router.score(mixed_responses, mixed_rows))
            together.append(mixed_s)
            mix_cpu.append(cpu)
        isolation = router.sandbox_isolation
    metrics = reward_metrics(verdicts)
    seq, mix = statistics.median(sequential), statistics.median(together)
    return {
        "math_workers": math_workers, "code_parallel": code_parallel,
        "sequential_s": seq, "mixed_s": mix, "mixed_over_sequential": mix / seq,
        "math_s": statistics.median(m for m, _ in parts), "code_s": statistics.median(c for _, c in parts),
        # The best overlap can do: the longer kind alone (each pool keeps its cores busy throughout).
        "ideal_over_sequential": statistics.median(max(m, c) / (m + c) for m, c in parts),
        "mixed_responses_per_s": len(mixed_rows) / mix,
        "cpu_utilisation_sequential": statistics.median(seq_cpu), "cpu_utilisation_mixed": statistics.median(mix_cpu),
        "rounds": {"sequential_s": sequential, "mixed_s": together},
        "accuracy": {"math": metrics["reward/math/accuracy"], "code": metrics["reward/code/accuracy"]},
        "failures": {k: metrics[f"reward/{k}"] for k in ("timeouts", "crashes", "errors")},
        "sandbox": isolation,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--math", type=int, default=512)
    p.add_argument("--code", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = parse_args(p, smoke={"math": 16, "code": 16, "rounds": 1})
    rng = random.Random(0)
    math_rows, math_responses, source = math_batch(args.math, rng)
    code_rows, code_responses = code_batch(args.code)
    mixed = list(zip(math_rows + code_rows, math_responses + code_responses))
    rng.shuffle(mixed)
    batches = {"math": (math_rows, math_responses), "code": (code_rows, code_responses),
               "mixed": ([r for r, _ in mixed], [t for _, t in mixed])}
    sizings = {"defaults": measure(2, 4, batches, args.rounds), "one_core_each": measure(1, 1, batches, args.rounds)}
    emit({
        "bench": "reward_router",
        "workload": {"smoke": args.smoke, "math": args.math, "code": args.code, "math_source": source,
                     "code_source": "synthetic:code",
                     "right_fraction": 0.5},
        "target_ratio": 0.8, **sizings, "machine": machine(),
    })


if __name__ == "__main__":
    main()
