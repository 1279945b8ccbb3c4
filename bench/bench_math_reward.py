"""Math reward throughput: MathReward's killable pool, through the reward router as the trainer
scores, against math-verify called in-line.

    .venv/bin/python bench/bench_math_reward.py [--responses 10000] [--workers 2] [--timeout-s 2] [--smoke]

10,000 seeded responses of a realistic mix (MATH500/AIME ground truths when ../shared/data is
there, synthetic arithmetic otherwise): boxed right answers, right answers in another form, wrong
answers, answers in ORZ's <answer> tag, no answer, truncated responses, and a few pathological
ones (a tower of powers, deep nesting, a megabyte). Prints ONE JSON line: responses/s through the
pool, per-item latency p50/p99, timeouts; the in-line rate (one process, no pool, no timeout) on
the same mix without the pathological items, which would hang it; their ratio, and the pool's
fraction of its ideal, workers x the in-line rate (the limit here: the work is sympy in Python,
so no matmul or bandwidth limit applies).

The machine is shared and its load moves: the two sides alternate in rounds over slices of the
mix, and CPU seconds per response are reported beside wall-clock rates (the CPU ratio is the
pool's overhead, whatever the load; the wall ratio is its speed-up under the load of the day).

Fields: bench, settings.smoke, settings.responses, pool_responses_per_s, latency_s_p50, latency_s_p99,
timeouts, errors, crashes, accuracy, inline_responses_per_s, inline_responses, inline_accuracy,
pool_over_inline, fraction_of_ideal, cpu_ms_per_response.pool, cpu_ms_per_response.inline, machine.cpu.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from importlib.metadata import version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import emit, machine, parse_args  # noqa: E402

from orz.data.datasets import Row, load_rows  # noqa: E402
from orz.data.synthetic import arithmetic_rows  # noqa: E402
from orz.data.answers import extract_answer  # noqa: E402
from orz.reward.math import MathRewardConfig, is_equivalent  # noqa: E402
from orz.reward.router import RewardRouter, RouterConfig, reward_metrics  # noqa: E402

SHARED_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
PATHOLOGICAL = [
    r"\boxed{2^{2^{2^{100}}}}",
    r"\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
    "Let me think. " * 80_000 + r"\boxed{12}",
    r"\boxed{" + "9" * 100_000 + "}",
    r"\boxed{10^{10^{10^{10}}}}",
]


def ground_truths() -> tuple[list[str], str]:
    names = ("math500.json", "aime2024.json")
    if all(os.path.exists(os.path.join(SHARED_DATA, n)) for n in names):
        return [r.answer for n in names for r in load_rows(os.path.join(SHARED_DATA, n))], "math500+aime2024"
    return [r["answer"] for r in arithmetic_rows(500, seed=0)], "synthetic arithmetic"


def other_form(truth: str) -> str:
    """The same value written differently, where an obvious one exists."""
    if truth.lstrip("-").isdigit():
        return f"{truth}.0" if len(truth) < 6 else f"{int(truth):,}"
    if truth.startswith("\\frac"):
        return truth.replace("\\frac", "\\dfrac", 1)
    return f"\\left( {truth} \\right)" if truth.startswith("(") else f" {truth} "


def wrong(truth: str, truths: list[str], rng: random.Random) -> str:
    return str(int(truth) + rng.choice([-1, 1, 10])) if truth.lstrip("-").isdigit() else rng.choice(truths)


def build_mix(n: int, seed: int, truths: list[str]) -> tuple[list[str], list[str], list[str]]:
    rng = random.Random(seed)
    responses, answers, finish = [], [], []
    for i in range(n):
        truth = rng.choice(truths)
        steps = rng.randint(5, 40)
        reasoning = " ".join(f"Step {k}: we simplify the expression and check the case." for k in range(steps))
        kind = rng.random()
        if i < len(PATHOLOGICAL):
            response = PATHOLOGICAL[i]
        elif kind < 0.35:
            response = f"<think> {reasoning} </think> <answer> \\boxed{{{truth}}} </answer>"
        elif kind < 0.50:
            response = f"{reasoning} So the answer is $\\boxed{{{other_form(truth)}}}$."
        elif kind < 0.60:
            response = f"<think> {reasoning} </think> <answer>{truth}</answer>"
        elif kind < 0.85:
            response = f"<think> {reasoning} </think> <answer> \\boxed{{{wrong(truth, truths, rng)}}} </answer>"
        elif kind < 0.95:
            response = f"<think> {reasoning} and I am not sure"
        else:
            response = f"<think> {reasoning} \\boxed{{{truth}}}"
        responses.append(response)
        answers.append(truth)
        finish.append("length" if kind >= 0.95 else "stop")
    order = list(range(n))
    rng.shuffle(order)  # pathological items anywhere, not all first
    return [responses[i] for i in order], [answers[i] for i in order], [finish[i] for i in order]


def inline_pass(responses, truths, finish) -> tuple[float, float, int]:
    """The peer: extraction and math-verify in this process, one response after another.
    Returns (wall seconds, CPU seconds, responses judged right)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    correct = 0
    for response, truth, reason in zip(responses, truths, finish):
        if reason == "stop" and (answer := extract_answer(response)) is not None:
            correct += is_equivalent(answer, truth)
    return time.perf_counter() - start, time.process_time() - start_cpu, correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5, help="pool and in-line alternate over this many slices")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, smoke={"responses": 40, "timeout_s": 0.5, "rounds": 2})

    all_truths, source = ground_truths()
    responses, truths, finish = build_mix(args.responses, args.seed, all_truths)
    pathological = set(PATHOLOGICAL)
    cfg = MathRewardConfig(num_workers=args.workers, timeout_s=args.timeout_s)
    totals = dict.fromkeys(["pool_wall", "pool_cpu", "inline_wall", "inline_cpu", "inline_n", "inline_right"], 0.0)
    rounds = []
    rows = [Row("", "math", (truth,)) for truth in truths]
    with RewardRouter(RouterConfig(math=cfg), rows) as reward:
        reward.score([r"\boxed{1}"] * args.workers, rows[:args.workers])  # workers started and warm (the verdicts aside)
        is_equivalent("\\frac{1}{2}", "0.5")  # the in-line side warms up the same way
        step = -(-args.responses // args.rounds)
        for begin in range(0, args.responses, step):
            part = slice(begin, begin + step)
            start, start_cpu = time.perf_counter(), time.process_time()
            metrics = reward_metrics(reward.score(responses[part], rows[part], finish[part]))
            totals["pool_wall"] += time.perf_counter() - start
            totals["pool_cpu"] += time.process_time() - start_cpu + metrics["reward/verify_cpu_s"]
            rounds.append(metrics)
            tame = [(r, t, f) for r, t, f in zip(responses[part], truths[part], finish[part]) if r not in pathological]
            wall, cpu, right = inline_pass(*zip(*tame))
            totals["inline_wall"] += wall
            totals["inline_cpu"] += cpu
            totals["inline_n"] += len(tame)
            totals["inline_right"] += right

    pool_per_s = args.responses / totals["pool_wall"]
    inline_per_s = totals["inline_n"] / totals["inline_wall"]
    emit({
        "bench": "math_reward",
        "machine": machine(),
        "settings": {"smoke": args.smoke, "responses": args.responses, "workers": args.workers,
                     "timeout_s": args.timeout_s,
                     "chunk_size": cfg.chunk_size, "rounds": len(rounds), "pathological": len(PATHOLOGICAL),
                     "ground_truths": source, "math_verify": version("math-verify"), "seed": args.seed},
        "pool_responses_per_s": pool_per_s,
        "latency_s_p50": statistics.median(m["reward/verify_s_p50"] for m in rounds),  # median over rounds
        "latency_s_p99": max(m["reward/verify_s_p99"] for m in rounds),  # worst round
        "timeouts": int(sum(m["reward/timeouts"] for m in rounds)),
        "errors": int(sum(m["reward/errors"] for m in rounds)),
        "crashes": int(sum(m["reward/crashes"] for m in rounds)),
        "accuracy": sum(m["reward/accuracy"] * len(responses[i * step:(i + 1) * step]) for i, m in enumerate(rounds))
                    / args.responses,
        "inline_responses_per_s": inline_per_s,
        "inline_responses": int(totals["inline_n"]),
        "inline_accuracy": totals["inline_right"] / args.responses,
        "pool_over_inline": pool_per_s / inline_per_s,
        "fraction_of_ideal": pool_per_s / (args.workers * inline_per_s),
        "cpu_ms_per_response": {"pool": 1e3 * totals["pool_cpu"] / args.responses,
                                "inline": 1e3 * totals["inline_cpu"] / totals["inline_n"]},
    })


if __name__ == "__main__":
    main()
