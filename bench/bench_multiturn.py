"""Multi-turn rollout throughput: orz's MultiTurnRollout (each sample advances on its own: the
engine decodes the others while one waits for its tool) against a turn-synchronous loop on the
same engine, prompts, tools and tool latencies, in one run.

    .venv/bin/python bench/bench_multiturn.py [--prompts 32] [--turns 8] [--turn-tokens 32]

The turn-synchronous loop is what a naive implementation does: every turn, generate the batch's
next turn in one call, then run every sample's tool call at once (a thread each, as orz does) and
wait for the slowest before the next turn. Tool latencies are heavy-tailed: Pareto with shape
`--alpha` and minimum `--latency-min-s`, capped at `--latency-cap-s`, drawn per (sample, turn)
from one seed, so both sides wait for exactly the same calls. One draw of a heavy tail decides much
of the result (the slowest sample's calls): `--vary-latency` gives repeat r the draws of seed + r,
both sides alike, so that the median is over draws as well as runs. The model is a random Llama without
EOS (common.char_llama): every model turn is exactly `--turn-tokens` tokens on both sides, and
only model tokens are counted. Both sides run the one engine (one OMP thread) in its Ray actor,
never at the same time.

The engine's idle fraction is 1 − (seconds inside vLLM's engine step, with requests) / wall: how
long the engine had nothing to decode because every sample it held waited for a tool. Each side
also reports its engine steps per run, the requests each step held on average, and the seconds a
step took: samples that advance on their own are decoded in more, smaller steps, and each step
costs a fixed part (docs/performance.md). Every run starts with an empty prefix cache.

The critical-path bound on the ratio (bound.*): the synchronous side's seconds over the longer of
its engine work at full batch and the slowest sample's path (its tool calls in a row, its turns
decoded alone: turn_alone_s each); frac_of_bound is the ratio's median over the bound's.

Fields: bench, settings.smoke, settings.model.params, settings.latency.mean_s,
multiturn.tokens, multiturn.seconds, multiturn.tokens_per_s, multiturn.engine_idle_frac, multiturn.engine_steps,
multiturn.requests_per_step, multiturn.seconds_per_step, synchronous.tokens, synchronous.seconds,
synchronous.tokens_per_s, synchronous.engine_idle_frac, synchronous.engine_steps, synchronous.requests_per_step,
synchronous.seconds_per_step,
ratio_tokens_per_s, ratio_per_repeat, ratio_median, bound.turn_alone_s, bound.critical_path_s_per_repeat,
bound.ratio_per_repeat, bound.ratio_median, frac_of_bound, limits.matmul_fp32_gflops, threads.torch_threads, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    RAY_ADDRESS_HELP, SMOKE_LIMITS, best_limits, char_llama, emit, machine, machine_limits, median_seconds, param_count,
    parse_args, ray_session, set_threads,
)

import orz.rollout.fleet as fleet_module  # noqa: E402
from orz.data.synthetic import arithmetic_rows  # noqa: E402
from orz.rollout.driver import generate  # noqa: E402
from orz.rollout.engine import SamplingConfig, VLLMEngine  # noqa: E402
from orz.rollout.agent_loop import TurnLimits  # noqa: E402
from orz.rollout.envs import EnvLoop  # noqa: E402
from orz.rollout.multiturn import MultiTurnRollout  # noqa: E402


class TimedEngine(VLLMEngine):
    """The fleet's engine, counting vLLM's engine steps, the requests each held and the seconds
    they took."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        engine, step = self.llm.llm_engine, self.llm.llm_engine.step
        self.counted = {"busy_s": 0.0, "steps": 0, "held": 0}

        def timed_step(*a, **k):
            held, start = engine.get_num_unfinished_requests(), time.perf_counter()
            try:
                return step(*a, **k)
            finally:
                self.counted["busy_s"] += time.perf_counter() - start
                self.counted["steps"] += 1
                self.counted["held"] += held

        engine.step = timed_step  # shadows the method on this instance only

    def counters(self) -> dict:
        return dict(self.counted)

    def empty_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache: a request was still running")


def latency(seed: int, sample: int, turn: int, alpha: float, low: float, cap: float) -> float:
    """Seconds of sample `sample`'s tool call after its turn `turn`: Pareto(alpha) from `low`, capped."""
    u = random.Random(f"{seed}-{sample}-{turn}").random()
    return min(low * (1 - u) ** (-1 / alpha), cap)


class SlowTool:
    """A tool whose every call sleeps for its drawn latency and answers one line; the sample ends
    after `turns` calls. `row["sample"]` names the sample, so both sides draw the same latencies."""

    settings: dict = {}

    def reset(self, row: dict) -> None:
        self.sample, self.calls = row["sample"], 0

    def step(self, turn_text: str) -> dict:
        s = self.settings
        time.sleep(latency(s["seed"], self.sample, self.calls, s["alpha"], s["low"], s["cap"]))
        self.calls += 1
        return {"observation": "\n<output>42</output>\n", "reward": 0.0, "done": self.calls >= s["turns"]}


def run_multiturn(fleet, tokenizer, prompts: list[list[int]], args) -> dict:
    limits = TurnLimits(max_turns=args.turns, max_new_tokens=args.turn_tokens, max_model_len=args.max_model_len,
                        max_observation_tokens=32, env_timeout_s=3600.0)
    rollout = MultiTurnRollout(fleet, tokenizer, {"slow": functools.partial(EnvLoop, SlowTool, [])}, limits, env_threads=len(prompts))
    sampling = SamplingConfig(max_new_tokens=args.turn_tokens, n=1, seed=args.seed)

    def run() -> int:
        groups = list(rollout.stream([(p, {"sample": i}, "slow") for i, p in enumerate(prompts)], sampling))
        return sum(sum(c.loss_mask) for group in groups for c in group)

    return measured(fleet, run)


def run_synchronous(fleet, tokenizer, prompts: list[list[int]], args) -> dict:
    """Each turn: the batch's next turns in one generate call, then every tool call at once, then
    the next turn only when the slowest has answered."""
    tools = []
    for i in range(len(prompts)):
        tools.append(SlowTool())
        tools[-1].reset({"sample": i})

    def run() -> int:
        contexts, tokens, live = [list(p) for p in prompts], 0, list(range(len(prompts)))
        with ThreadPoolExecutor(len(prompts)) as pool:
            for turn in range(args.turns):
                samples = generate(fleet, [contexts[i] for i in live],
                                   SamplingConfig(max_new_tokens=args.turn_tokens, n=1, seed=args.seed + turn))
                for i, sample in zip(live, samples):
                    contexts[i] += sample.response_ids
                    tokens += len(sample.response_ids)
                answers = list(pool.map(lambda i: tools[i].step(""), live))  # the barrier: the slowest call
                for i, answer in zip(live, answers):
                    contexts[i] += tokenizer.encode(answer["observation"], add_special_tokens=False)
                live = [i for i, answer in zip(live, answers) if not answer["done"]]
        return tokens

    return measured(fleet, run)


def measured(fleet, run) -> dict:
    """run()'s model tokens, its seconds, and the engine's counters over it. The prefix cache is
    emptied first: every repeat asks for the same tokens, and none may find the last one's KV."""
    engine = fleet.engines[0]
    ray.get(engine.empty_prefix_cache.remote())
    before, start = ray.get(engine.counters.remote()), time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    after = ray.get(engine.counters.remote())
    return {"tokens": tokens, "seconds": seconds, **{k: after[k] - before[k] for k in after}}


def main(args: argparse.Namespace) -> None:
    threads = set_threads(args.threads)
    limit_sizes = SMOKE_LIMITS if args.smoke else {}
    limits_before = machine_limits(**limit_sizes)
    rows = arithmetic_rows(args.prompts, seed=args.seed)
    SlowTool.settings = {"alpha": args.alpha, "low": args.latency_min_s, "cap": args.latency_cap_s, "turns": args.turns}
    latency_seeds = [args.seed + r if args.vary_latency else args.seed for r in range(args.repeats)]
    draws = {seed: [[latency(seed, i, t, args.alpha, args.latency_min_s, args.latency_cap_s) for t in range(args.turns)]
                    for i in range(args.prompts)] for seed in latency_seeds}
    every_draw = [d for samples in draws.values() for sample in samples for d in sample]  # each seed once

    with tempfile.TemporaryDirectory() as model_dir, ray_session(num_cpus=2, address=args.ray_address):
        tokenizer = char_llama(model_dir, [r["prompt"] + r["solution"] + "<output>42</output>" for r in rows],
                               hidden_size=args.hidden, intermediate_size=args.intermediate, num_layers=args.layers,
                               num_heads=args.heads, num_kv_heads=args.heads, seed=args.seed)
        params = param_count(model_dir)
        prompts = [tokenizer.encode(r["prompt"] + " <think>", add_special_tokens=False) for r in rows]
        args.max_model_len = max(map(len, prompts)) + args.turns * (args.turn_tokens + 32) + 8
        fleet_module.VLLMEngine = TimedEngine  # the fleet starts this engine class in its actor
        engine_args = {"max_model_len": args.max_model_len, "enable_chunked_prefill": False}
        fleet = fleet_module.EngineFleet(model_dir, fleet_module.FleetConfig(
            num_engines=1, engine_args=engine_args, kv_cache_gib=args.kv_cache_gib, sync_check="off"))
        try:
            generate(fleet, prompts[:4], SamplingConfig(max_new_tokens=8))  # warm-up
            turn_alone_s = median_seconds(lambda: generate(fleet, prompts[:1], SamplingConfig(
                max_new_tokens=args.turn_tokens)), repeats=3, warmup=0)
            # Interleaved, so that a change in the shared machine's load hits both sides alike.
            runs = {"multiturn": [], "synchronous": []}
            for seed in latency_seeds:
                SlowTool.settings["seed"] = seed
                runs["synchronous"].append(run_synchronous(fleet, tokenizer, prompts, args))
                runs["multiturn"].append(run_multiturn(fleet, tokenizer, prompts, args))
        finally:
            fleet.shutdown()
    limits = best_limits(limits_before, machine_limits(**limit_sizes))

    def side(repeats: list[dict]) -> dict:
        tokens, seconds = sum(r["tokens"] for r in repeats), sum(r["seconds"] for r in repeats)
        busy, steps = sum(r["busy_s"] for r in repeats), sum(r["steps"] for r in repeats)
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "engine_idle_frac": max(0.0, 1 - busy / seconds), "engine_steps": steps / len(repeats),
                "requests_per_step": sum(r["held"] for r in repeats) / steps, "seconds_per_step": busy / steps,
                "frac_matmul_limit": tokens / seconds * 2 * params / (limits["matmul_fp32_gflops"] * 1e9)}

    multiturn, synchronous = side(runs["multiturn"]), side(runs["synchronous"])
    ratios = [(m["tokens"] / m["seconds"]) / (s["tokens"] / s["seconds"])
              for m, s in zip(runs["multiturn"], runs["synchronous"])]
    # The critical-path bound: no schedule ends before its slowest sample (its tool calls, one after
    # another, and its turns decoded alone) nor before the engine's work at full batch (what the
    # synchronous side's steps took), so no schedule beats sync seconds / max of the two.
    paths_s = [max(map(sum, draws[seed])) + args.turns * turn_alone_s for seed in latency_seeds]
    bounds = [s["seconds"] / max(path_s, s["busy_s"]) for s, path_s in zip(runs["synchronous"], paths_s)]
    emit({
        "bench": "multiturn",
        "settings": {
            "smoke": args.smoke, "prompts": args.prompts, "turns": args.turns, "turn_tokens": args.turn_tokens,
            "repeats": args.repeats,
            "model": {"params": params, "hidden": args.hidden, "layers": args.layers, "dtype": "float32", "eos": None},
            "latency": {"dist": "pareto", "alpha": args.alpha, "min_s": args.latency_min_s, "cap_s": args.latency_cap_s,
                        "seeds": latency_seeds, "mean_s": float(np.mean(every_draw)),
                        "p50_s": float(np.median(every_draw)), "p99_s": float(np.percentile(every_draw, 99)),
                        "max_s": max(every_draw)},
            "vllm": {"engines": 1, "omp_threads": 1, "engine_args": engine_args},
        },
        "multiturn": multiturn,
        "synchronous": synchronous,
        "ratio_tokens_per_s": multiturn["tokens_per_s"] / synchronous["tokens_per_s"],
        # each repeat's ratio (its two sides ran back to back), and their median: robust to load that moves
        "ratio_per_repeat": ratios, "ratio_median": statistics.median(ratios),
        "bound": {"turn_alone_s": turn_alone_s, "critical_path_s_per_repeat": paths_s, "ratio_per_repeat": bounds,
                  "ratio_median": statistics.median(bounds)},
        "frac_of_bound": statistics.median(ratios) / statistics.median(bounds),
        "limits": limits,
        "threads": threads,
        "machine": machine(),
    })


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--turns", type=int, default=8, help="model turns per sample (a tool call after each)")
    p.add_argument("--turn-tokens", type=int, default=32, help="tokens of every model turn")
    p.add_argument("--alpha", type=float, default=1.5, help="Pareto shape of the tool latency: its tail")
    p.add_argument("--latency-min-s", type=float, default=0.1)
    p.add_argument("--latency-cap-s", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vary-latency", action="store_true",
                   help="repeat r draws its tool latencies from seed + r (by default every repeat waits for seed's draws)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    smoke = {"prompts": 4, "turns": 2, "turn_tokens": 8, "repeats": 1, "hidden": 64, "intermediate": 128, "layers": 1,
             "heads": 2, "latency_min_s": 0.01, "latency_cap_s": 0.2}
    return parse_args(p, smoke, argv)


if __name__ == "__main__":
    main(arguments())
