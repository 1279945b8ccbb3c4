"""orz's side of bench_rollout.py at two commits: does a change to the rollout path cost tokens/s?

    git worktree add /tmp/before <commit>
    .venv/bin/python bench/rollout_at_commits.py --before /tmp/before [--repeats 5]

Each repeat runs bench_rollout's two orz workloads (fixed and variable lengths, same model, prompts,
seeds and lengths) once at the `--before` tree and once at this one, each in a fresh process that
imports that tree's orz and bench_rollout (so its engine actors run that code too), alternating, so
that a change in the machine's load hits both alike. Prints ONE JSON line: the median tokens/s of
each side and workload, their ratios (this tree / before) and every repeat's figures.

Fields: bench, settings.repeats, settings.before, fixed.before, fixed.after, fixed.ratio, variable.before,
variable.after, variable.ratio, repeats, machine.cpu, machine.vector_flags.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine  # noqa: E402

HERE = Path(__file__).resolve().parent.parent

ONE_SIDE = """
import sys, tempfile, time, json
sys.path.insert(0, "{tree}/bench")
import torch
import bench_rollout as b
from common import ray_session, char_llama
from orz.data.synthetic import arithmetic_rows
from orz.rollout.engine import SamplingConfig
a = b.arguments()
rows = arithmetic_rows(a.prompts, seed=a.seed)
with tempfile.TemporaryDirectory() as model_dir, ray_session(num_cpus=2, address=""):
    tok = char_llama(model_dir, [r["prompt"] + r["solution"] for r in rows], hidden_size=a.hidden,
                     intermediate_size=a.intermediate, num_layers=a.layers, num_heads=a.heads,
                     num_kv_heads=a.kv_heads, seed=a.seed)
    prompts = [tok.encode(r["prompt"] + " <think>", add_special_tokens=False) for r in rows]
    variable = b.target_lengths(a.prompts * a.n, a.median_tokens, a.sigma, a.min_tokens, a.max_tokens, a.seed)
    expanded = [p for p in prompts for _ in range(a.n)]
    b.fleet_module.VLLMEngine = b.LengthEngine
    engine_args = {{"max_model_len": max(map(len, prompts)) + max(a.fixed_tokens, a.max_tokens) + 8,
                    "enable_chunked_prefill": False}}
    fleet = b.fleet_module.EngineFleet(model_dir, b.fleet_module.FleetConfig(
        num_engines=1, engine_args=engine_args, kv_cache_gib=a.kv_cache_gib, sync_check="off"))
    try:
        b.fleet_run(fleet, prompts[:8], SamplingConfig(max_new_tokens=8, n=a.n), [8] * 8 * a.n)  # warm-up
        fixed = b.fleet_run(fleet, prompts, SamplingConfig(max_new_tokens=a.fixed_tokens, n=a.n, seed=a.seed),
                            [a.fixed_tokens] * (a.prompts * a.n))
        var = b.fleet_run(fleet, expanded, SamplingConfig(seed=a.seed), variable)
    finally:
        fleet.shutdown()
print("RESULT " + json.dumps({{"fixed": fixed["tokens"] / fixed["seconds"], "variable": var["tokens"] / var["seconds"]}}))
"""


def one_side(tree: Path) -> dict:
    """bench_rollout's orz workloads in a fresh process that imports `tree`'s orz: tokens/s of each."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{tree}/bench"}  # the engine actors import bench_rollout too
    done = subprocess.run([sys.executable, "-c", ONE_SIDE.format(tree=tree)], cwd=tree, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the bench at {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="a worktree of the commit to compare against")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    repeats = []
    for i in range(args.repeats):
        repeats.append({"before": one_side(Path(args.before).resolve()), "after": one_side(HERE)})
        print(f"repeat {i + 1}: {repeats[-1]}", file=sys.stderr, flush=True)
    result = {"bench": "rollout_at_commits", "settings": {"repeats": args.repeats, "before": args.before}}
    for workload in ("fixed", "variable"):
        before = statistics.median(r["before"][workload] for r in repeats)
        after = statistics.median(r["after"][workload] for r in repeats)
        result[workload] = {"before": before, "after": after, "ratio": after / before}
    emit(result | {"repeats": repeats, "machine": machine()})


if __name__ == "__main__":
    main()
