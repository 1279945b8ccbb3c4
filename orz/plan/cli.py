"""`python -m orz.plan`: the table (or one JSON line) of a recipe's plan, and its problems."""
import argparse
import json
import sys
from pathlib import Path

from orz.config import ConfigError, load_config, load_recipe
from orz.models.arch import ModelConfigError
from orz.plan.advice import blockers
from orz.plan.against import compare, write_and_print
from orz.plan.estimate import Plan
from orz.plan.inputs import gib
from orz.plan.memory import RoleMemory
from orz.plan.recipe import load_cluster, plan_recipe


ASSUMPTIONS = (
    "bf16 weights, fp32 main grads, fp32 master weights + Adam m, v (Megatron mixed precision)",
    "flash attention (no s×s scores kept), no dropout, 1F1B pipeline with ≥ PP micro-batches in flight",
    "KV cache sized for max_num_seqs sequences of the longest length, so vLLM never preempts",
    "time: FLOPs at train_mfu of peak bf16; decode step = max(weights + KV read at hbm_efficiency of peak "
    "bandwidth, FLOPs at train_mfu); continuous batching at full concurrency",
    "not counted: the slowest sequence's tail, prefix caching, weight sync, the verifiers' time, offload/onload, "
    "data movement",
)


def to_json(p: Plan, problems: list[str]) -> dict:
    """Everything the table shows, GiB and seconds, as one JSON object."""
    t = p.timing
    return {
        "model": p.model, "params_b": round(p.arch.num_params / 1e9, 2), "gpus": p.cluster.gpus,
        "gpu": p.cluster.gpu, "gpu_mem_gib": p.cluster.gpu_mem_gib, "colocate": p.placement.colocate,
        "offload_idle_roles": p.placement.offload_idle_roles, "fits": not problems,
        "memory_gib": {r.role: {"parallel": r.parallel, "gpus": r.gpus,
                                **{c: gib(getattr(r, c)) for c in RoleMemory.COMPONENTS},
                                "total": gib(r.total), "limit": gib(r.limit)} for r in p.memory},
        "time_s": {"rollout": round(t.rollout_s, 1), "forward": round(t.forward_s, 1), "train": round(t.train_s, 1),
                   "iteration": round(t.iteration_s, 1)},
        "decode": {"concurrency": t.decode_concurrency, "step_ms": round(t.decode_step_ms, 2),
                   "tokens_per_s": round(t.rollout_tokens_per_s)},
        "problems": problems,
    }


def print_table(p: Plan, problems: list[str], stage: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    c, placement = p.cluster, p.placement
    where = ("colocated" + (" + offload" if placement.offload_idle_roles else "")) if placement.colocate \
        else "separate GPUs"
    title = (f"{stage}{p.model} ({p.arch.num_params / 1e9:.2f}B) on {c.nodes}×{c.gpus_per_node} {c.gpu} "
             f"({c.gpu_mem_gib} GiB), {where}")
    table = Table(title=title + " — GiB per GPU, heaviest stage")
    for header in ("role", "GPUs", "parallel", "weights", "grads", "optim", "activ", "KV", "reserved", "total",
                   "limit", "fits"):
        table.add_column(header, justify="left" if header in ("role", "parallel") else "right")
    for r in p.memory:
        table.add_row(r.role, str(r.gpus), r.parallel, *(f"{gib(getattr(r, k))}" if getattr(r, k) else "-"
                                                         for k in RoleMemory.COMPONENTS),
                      f"{gib(r.total)}", f"{gib(r.limit)}", "[green]yes[/]" if r.fits else "[red]NO[/]")
    t, w = p.timing, p.workload
    console = Console(width=None if sys.stdout.isatty() else 140)  # piped: wide enough not to fold the table
    console.print(table)
    console.print(f"per iteration ({w.samples} samples, mean {w.mean_prompt_tokens}+{w.mean_response_tokens} tokens): "
                  f"rollout {t.rollout_s:.0f} s ({t.decode_concurrency} seqs/engine, {t.decode_step_ms:.1f} ms/step, "
                  f"{t.rollout_tokens_per_s:,.0f} tok/s) + forward {t.forward_s:.0f} s + train {t.train_s:.0f} s "
                  f"= [bold]{t.iteration_s:.0f} s[/]  (MFU {c.train_mfu:.0%}, HBM {c.hbm_efficiency:.0%} of "
                  f"{c.device.tflops:.0f} TFLOP/s, {c.device.hbm_tb_s} TB/s)")
    console.print("assumptions: " + "; ".join(ASSUMPTIONS) + ".", style="dim")
    for problem in problems:
        console.print(f"[red]✗[/] {problem}", highlight=False)


# the flags laid over the cluster file (load_cluster)
_CLUSTER_FLAGS = ("nodes", "gpus_per_node", "gpu", "gpu_mem_gib", "reserved_gib", "train_mfu", "hbm_efficiency",
                  "mean_prompt_tokens", "mean_response_tokens")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m orz.plan",
                                 description="Memory and time planner: does a recipe fit a cluster, and how long "
                                             "is one of its iterations?",
                                 epilog="Flags override the --cluster file; key=value overrides the recipe.")
    ap.add_argument("--cluster", help="configs/clusters/*.yaml: the cluster and the mean lengths")
    ap.add_argument("--recipe", help="playground/*.py (its RECIPE); without it, orz.config's defaults")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of the tables")
    ap.add_argument("--against", metavar="RUN_DIR",
                    help="a run's output_dir: the plan of its own config on its own hardware beside what it "
                         "measured, saved as RUN_DIR/plan_vs_run.json (without --cluster: this machine, measured)")
    for flag, kind in (("nodes", int), ("gpus-per-node", int), ("gpu", str), ("gpu-mem-gib", float),
                       ("reserved-gib", float), ("train-mfu", float), ("hbm-efficiency", float),
                       ("mean-prompt-tokens", int), ("mean-response-tokens", int)):
        ap.add_argument(f"--{flag}", type=kind)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. model.path=Qwen2.5-7B actor.tp=4")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.against:
        try:
            comparison = compare(Path(args.against), args.cluster)
        except (ConfigError, ModelConfigError) as err:
            print(f"orz.plan --against: {err}", file=sys.stderr)
            return 2
        write_and_print(comparison, Path(args.against))
        return 0
    try:
        cluster = load_cluster(args.cluster, **{key: getattr(args, key) for key in _CLUSTER_FLAGS})
        cfg = load_config(None, args.overrides, base=load_recipe(args.recipe) if args.recipe else None)
        plans = plan_recipe(cfg, cluster)
    except (ConfigError, ModelConfigError) as err:
        hint = "\n(give --cluster FILE, or --nodes, --gpus-per-node and --gpu-mem-gib)" if not args.cluster else ""
        print("orz.plan: cannot plan this run:\n" + "\n".join(f"  - {line}" for line in str(err).splitlines())
              + hint, file=sys.stderr)
        return 2
    checked = [(label, p, blockers(p)) for label, p in plans]
    if args.json:
        print(json.dumps({"recipe": args.recipe, "fits": not any(problems for _, _, problems in checked),
                          "stages": [{"stage": label.rstrip(": ")} | to_json(p, problems)
                                     for label, p, problems in checked]}, ensure_ascii=False))
    else:
        for label, p, problems in checked:
            print_table(p, problems, label)
    return 1 if any(problems for _, _, problems in checked) else 0


if __name__ == "__main__":
    sys.exit(main())
