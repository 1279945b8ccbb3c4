"""One RL iteration end to end: seconds per iteration and per phase, generated and trained tokens/s.

    .venv/bin/python bench/bench_e2e.py [--iterations 6] [--algorithm grpo] [--base-root runs/demo] [--smoke]
                                        [--timeline on|off]

Runs the CPU demo's tiny model (pre-trained on first use, cached in runs/demo) through the whole
stack — Ray, the Megatron actor (and critic for gae), one vLLM engine, the reward pool, weight
sync — and prints ONE JSON line: the mean over iterations after the first (which warms up) of
every `timing/*` phase, tokens/s, and the fraction of the machine's fp32 matmul limit reached by
the useful work (2·params per generated token, 6·params per trained token, real tokens only).

The run's timeline (trainer.timeline, on unless --timeline off) costs what `timeline` reports, per
iteration and as a share of it: `collect_s`, the trainer's gathering of every worker's events,
writing and figures, as the run measured it (perf/timeline_s); `replay_s`, the whole recorder
(making each event, buffering, draining, writing, the figures) timed again here in one process over
the run's own events, iteration by iteration (median of 5 replays). bench/timeline_ab.py compares
runs with the timeline on and off.

Fields: bench, settings.smoke, settings.params, settings.timeline, seconds_per_iteration, phases_s.rollout,
phases_s.update, phases_s.sync, generated_tokens_per_s, trained_tokens_per_s, frac_matmul_limit,
timeline.collect_s, timeline.replay_s, timeline.frac_of_iteration, limits.matmul_fp32_gflops,
threads.torch_threads, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    RAY_ADDRESS_HELP, SMOKE_LIMITS, SMOKE_RL, best_limits, demo_base, emit, machine, machine_limits, param_count,
    parse_args, ray_cluster_overrides, set_threads,
)

from orz.demo import rl_config  # noqa: E402
from orz.timeline.figures import Resource, goodput  # noqa: E402
from orz.timeline.record import Recorder  # noqa: E402
from orz.timeline.trace import Timeline, lanes, load  # noqa: E402
from orz.train import run as train  # noqa: E402


def replay_seconds(timeline: Path, repeats: int = 5) -> float:
    """The median seconds per iteration the whole recorder takes over a run's own events: each
    event made again through a Recorder, drained, appended to a file and its goodput computed."""
    events = load(timeline)
    names = lanes(events)
    by_iteration: dict[int, list] = {}
    for e in events:
        if e["ph"] in "XCi" and e["args"].get("iteration", -1) >= 0:
            by_iteration.setdefault(e["args"]["iteration"], []).append(e)
    resources = [Resource(lane, (lane,), 1, ("busy",) if lane.startswith("engines/") else ())
                 for lane in set(names.values())]
    seconds = []
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(repeats):
            file = Timeline(Path(scratch) / "timeline.json", resume=False)
            for iteration, its in sorted(by_iteration.items()):
                start = time.perf_counter()
                recorder = Recorder()
                for e in its:
                    lane = names.get((e["pid"], e["tid"]), "trainer/counters")
                    if e["ph"] == "X":
                        recorder.add(lane, e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6, **e["args"])
                    elif e["ph"] == "C":
                        recorder.count(lane, e["name"], e["args"]["value"], at=e["ts"] / 1e6)
                    else:
                        recorder.instant(lane, e["name"], **e["args"])
                file.add(recorder.drain())
                written = file.flush(iteration)
                window = (min(e[3] for e in written), max(e[3] + e[4] for e in written))
                goodput(written, window, resources)
                seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def run(args) -> dict:
    threads = set_threads(1)
    limit_sizes = SMOKE_LIMITS if args.smoke else {}
    before = machine_limits(**limit_sizes)
    base, spec = demo_base(args.base_root, args.smoke)
    with tempfile.TemporaryDirectory() as out:
        cfg = rl_config(base, spec, Path(out), [
            f"trainer.iterations={args.iterations}", f"algorithm.advantage={args.algorithm}",
            "trainer.eval_every=0", "trainer.export_hf=false", "trainer.dump_samples_every=0",
            "trainer.loggers=[jsonl]", *ray_cluster_overrides(args.ray_address), f"trainer.output_dir={out}/run",
            f"trainer.timeline={args.timeline == 'on'}", *(SMOKE_RL if args.smoke else []),
        ])
        train(cfg)
        rows = [json.loads(line) for line in (Path(out) / "run/metrics.jsonl").read_text().splitlines()]
        replay = replay_seconds(Path(out) / "run/timeline.json") if args.timeline == "on" else 0.0
    steps = [r for r in rows if "timing/step" in r][1:]  # the first iteration warms up
    mean = {k: statistics.mean(r[k] for r in steps) for k in steps[0] if k.startswith(("timing/", "throughput/"))}
    limits = best_limits(before, machine_limits(**limit_sizes))
    params = param_count(base)
    generated = statistics.mean(r["throughput/generated_tokens_per_s"] * r["timing/rollout"] for r in steps)
    trained = statistics.mean(r["tokens"] for r in steps)
    collect = statistics.mean(r.get("perf/timeline_s", 0.0) for r in steps)
    useful_flops = 2 * params * generated + 6 * params * trained
    return {
        "bench": "e2e_iteration",
        "settings": {"smoke": args.smoke, "algorithm": args.algorithm, "iterations_measured": len(steps),
                     "timeline": args.timeline,
                     "params": params,
                     "prompts_x_samples": f"{cfg.trainer.prompts_per_iteration}x{cfg.rollout.n_samples}",
                     "max_new_tokens": cfg.rollout.max_new_tokens, "engines": cfg.rollout.num_engines},
        "seconds_per_iteration": mean["timing/step"],
        "phases_s": {k.removeprefix("timing/"): v for k, v in mean.items() if k.startswith("timing/")},
        "generated_tokens_per_s": mean["throughput/generated_tokens_per_s"],
        "trained_tokens_per_s": mean["throughput/trained_tokens_per_s"],
        "frac_matmul_limit": useful_flops / mean["timing/step"] / (limits["matmul_fp32_gflops"] * 1e9),
        "timeline": {"collect_s": collect, "replay_s": replay,
                     "frac_of_iteration": {"collect": collect / mean["timing/step"], "replay": replay / mean["timing/step"]}},
        "limits": limits, "threads": threads, "machine": machine(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--algorithm", default="grpo", choices=["grpo", "gae"])
    parser.add_argument("--ray-address", default="", help=RAY_ADDRESS_HELP)
    parser.add_argument("--base-root", default="runs/demo", help="where the pre-trained base model is cached")
    parser.add_argument("--timeline", default="on", choices=["on", "off"], help="trainer.timeline")
    emit(run(parse_args(parser, smoke={"iterations": 2})))
