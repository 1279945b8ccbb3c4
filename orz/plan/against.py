"""The plan against the run: the planner's prediction of a run's own config on the run's own
hardware, phase by phase, beside the medians the run measured (its timeline). Nothing is fitted.

    orz plan --against runs/demo/grpo                      # this machine, as the run measured it
    orz plan --against runs/x --cluster configs/clusters/h100_4x8.yaml    # a GPU run: its cluster

Hardware. With no --cluster the cluster is configs/clusters/this_machine.yaml (gpu: measured): a
device is one Megatron worker or engine, its peak the run's perf/peak_flops_per_thread times the
actor's threads, its bandwidth perf/copy_gbps_per_thread (both measured once at the run's start,
orz/timeline/peak.py), as many devices on one node as the placement uses.

Phases (seconds per iteration; the measured ones the median over iterations, the first left out
when there are more, each from the timeline's spans of that iteration's last part):
    generation    planned rollout_s; measured: the batch's rollout span (generation and scoring)
    log-probs     planned forward_s; measured: the trainer's forward phase
    update        planned train_s; measured: the update phase
    sync          planned: the actor's weights in the engines' dtype once over the copy (HBM)
                  bandwidth at hbm_efficiency; measured: the sync phase
    idle_engines  the passes' seconds the engines did not generate beside: planned forward + update
                  (on-policy), or what is left of them after the rollout (staleness k > 0);
                  measured: forward + update − their overlap with the batch generated ahead
    idle_actor    on-policy the rollout, else what is left of it after the passes; measured: the
                  wait for the batch ahead (+ the rollout on-policy)
    iteration     planned rollout + passes + sync (on-policy) or max(rollout, passes) + sync;
                  measured: the step
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from orz.config import ExperimentConfig, load_config
from orz.models.arch import ModelArch
from orz.plan.estimate import plan
from orz.plan.inputs import BF16, FP32, GIB, GPU, MEASURED, Cluster, PlanError
from orz.plan.recipe import Means, load_cluster, placement_of, resolve_model, workload_of
from orz.run.placement import Layout
from orz.timeline.trace import lanes, load

PHASES = ("generation", "log-probs", "update", "sync", "idle_engines", "idle_actor", "iteration")
THIS_MACHINE = Path(__file__).resolve().parents[2] / "configs" / "clusters" / "this_machine.yaml"


def run_inputs(run_dir: Path) -> tuple[ExperimentConfig, list[dict], list[dict]]:
    """The run's config, metrics rows and timeline events; refused in one line naming what is missing."""
    missing = [name for name in ("config.yaml", "metrics.jsonl", "timeline.json") if not (run_dir / name).is_file()]
    if missing:
        raise PlanError(f"{run_dir} has no {' and no '.join(missing)}: not a run's output_dir, or one run with "
                        "trainer.timeline=false")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return load_config(str(run_dir / "config.yaml"), []), rows[1:], load(run_dir / "timeline.json")


def measured(events: list[dict], staleness: int) -> tuple[dict[str, float], int]:
    """Each phase's median seconds over the run's iterations (module docstring), and how many."""
    names, parts = lanes(events), []
    for e in events:
        if e["ph"] == "i" and e["name"] == "run started":
            parts.append({})
        elif e["ph"] == "X" and parts and e["args"].get("iteration", -1) >= 0:
            parts[-1].setdefault(e["args"]["iteration"], []).append((names[e["pid"], e["tid"]], e))
    spans = {}
    for part in parts:  # a later part logged an iteration again after a kill: its own is the one
        spans |= part
    batches = {e["args"]["batch"]: e["dur"] / 1e6 for its in spans.values() for lane, e in its
               if lane == "trainer/rollout" and e["name"] == "rollout"}
    per_iteration = []
    for i, its in sorted(spans.items()):
        phase = {}
        for lane, e in its:
            if lane == "trainer/phases":
                phase[e["name"]] = phase.get(e["name"], 0.0) + e["dur"] / 1e6
        if "step" not in phase:
            continue
        windows = [(e["ts"], e["ts"] + e["dur"]) for lane, e in its if lane == "trainer/phases"
                   and e["name"] in ("forward", "update")]
        ahead = [(e["ts"], e["ts"] + e["dur"]) for lane, e in its if lane == "trainer/pipeline"]
        overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in ahead for c, d in windows) / 1e6
        generation = batches.get(i, 0.0)
        per_iteration.append({
            "generation": generation, "log-probs": phase.get("forward", 0.0), "update": phase.get("update", 0.0),
            "sync": phase.get("sync", 0.0),
            "idle_engines": phase.get("forward", 0.0) + phase.get("update", 0.0) - overlap,
            "idle_actor": phase.get("wait_rollout", 0.0) + (0.0 if staleness else generation),
            "iteration": phase["step"]})
    if not per_iteration:
        raise PlanError("the run's timeline holds no whole iteration yet")
    used = per_iteration[1:] if len(per_iteration) > 1 else per_iteration
    return {p: statistics.median(row[p] for row in used) for p in PHASES}, len(used)


def this_machine(rows: list[dict], cfg: ExperimentConfig, cluster: Cluster) -> Cluster:
    """gpu: measured filled from the run: a device per worker and engine (module docstring)."""
    if "perf/peak_flops_per_thread" not in rows[-1]:
        raise PlanError("the run recorded no measured peak (perf/peak_flops_per_thread: a CPU run with the "
                        "timeline on); give --cluster for a GPU run")
    threads = cfg.actor.threads
    flops, copy = rows[-1]["perf/peak_flops_per_thread"] * threads, rows[-1]["perf/copy_gbps_per_thread"] * 1e9
    layout = Layout.of(cfg)
    demand = layout.engine_gpus if cfg.trainer.colocate else sum(layout.gpu_demand().values())
    multiple = math.lcm(layout.engine_tp, *(s.tp for s in layout.roles.values()))
    devices = -(-demand // multiple) * multiple
    import psutil  # the memory of a device: this machine's, shared

    return replace(cluster, nodes=1, gpus_per_node=devices, gpu_mem_gib=psutil.virtual_memory().total / GIB / devices,
                   measured_gpu=GPU(tflops=flops / 1e12, hbm_tb_s=copy / 1e12, nvlink_gb_s=copy / 1e9))


def predicted(cfg: ExperimentConfig, cluster: Cluster, means: Means, arch: ModelArch, name: str,
              engine_bytes: int) -> dict[str, float]:
    """The planner's seconds per phase for the run's config (module docstring)."""
    t = plan(arch, cluster, placement_of(cfg), workload_of(cfg, means), name).timing
    d = cluster.device
    sync = arch.num_params * engine_bytes / (d.hbm_tb_s * 1e12 * cluster.hbm_efficiency)
    passes, ahead = t.forward_s + t.train_s, cfg.trainer.max_staleness > 0
    return {"generation": t.rollout_s, "log-probs": t.forward_s, "update": t.train_s, "sync": sync,
            "idle_engines": max(0.0, passes - t.rollout_s) if ahead else passes,
            "idle_actor": max(0.0, t.rollout_s - passes) if ahead else t.rollout_s,
            "iteration": (max(t.rollout_s, passes) if ahead else t.rollout_s + passes) + sync}


def compare(run_dir: Path, cluster_file: str | None = None) -> dict:
    """plan_vs_run.json's content: the prediction and the measurement per phase, and their ratio."""
    cfg, rows, events = run_inputs(run_dir)
    if not rows:
        raise PlanError(f"{run_dir}/metrics.jsonl holds no iteration yet")
    name, arch = resolve_model(cfg.model.path)
    cluster = load_cluster(cluster_file or THIS_MACHINE)
    hardware = cluster.cluster
    if hardware.gpu == MEASURED:
        hardware = this_machine(rows, cfg, hardware)
    lengths = [(r["prompt/length_mean"], r["response/length_mean"]) for r in rows if "prompt/length_mean" in r]
    if not lengths:  # rows written before orz recorded the prompts' length
        raise PlanError(f"{run_dir}/metrics.jsonl holds no prompt/length_mean: a run from before the plan against it")
    means = Means(mean_prompt_tokens=max(1, round(statistics.median(p for p, _ in lengths))),
                  mean_response_tokens=max(1, round(statistics.median(r for _, r in lengths))))
    # What the engines hold (orz.rollout.engine.engine_dtype): on CPU, "auto" is fp32 but for a hybrid (bf16).
    on_cpu_auto = cfg.rollout.engine_dtype == "auto" and hardware.gpu == MEASURED and arch.linear_attention is None
    engine_bytes = FP32 if cfg.rollout.engine_dtype == "float32" or on_cpu_auto else BF16
    plan_s = predicted(cfg, hardware, means, arch, name, engine_bytes)
    run_s, iterations = measured(events, cfg.trainer.max_staleness)
    return {"run": str(run_dir), "cluster": cluster_file or str(THIS_MACHINE),
            "device": {"tflops": hardware.device.tflops, "bandwidth_tb_s": hardware.device.hbm_tb_s,
                       "devices": hardware.gpus, "measured": hardware.gpu == MEASURED},
            "workload": {"samples": cfg.trainer.prompts_per_iteration * cfg.rollout.n_samples,
                         "mean_prompt_tokens": means.mean_prompt_tokens,
                         "mean_response_tokens": means.mean_response_tokens},
            "iterations_measured": iterations,
            "phases": {p: {"predicted_s": plan_s[p], "measured_s": run_s[p],
                           "measured_over_predicted": run_s[p] / plan_s[p] if plan_s[p] > 0 else None}
                       for p in PHASES}}


def write_and_print(comparison: dict, out: Path, print_line=print) -> Path:
    """plan_vs_run.json beside the run, and the table."""
    path = out / "plan_vs_run.json"
    path.write_text(json.dumps(comparison, indent=1) + "\n")
    print_line(f"the plan against the run ({comparison['iterations_measured']} iterations' medians; "
               f"{comparison['workload']['samples']} samples of {comparison['workload']['mean_prompt_tokens']}+"
               f"{comparison['workload']['mean_response_tokens']} tokens):")
    print_line(f"  {'phase':<13} {'planned s':>10} {'measured s':>11} {'measured/planned':>17}")
    for phase, row in comparison["phases"].items():
        ratio = row["measured_over_predicted"]
        print_line(f"  {phase:<13} {row['predicted_s']:>10.4g} {row['measured_s']:>11.4g} "
                   f"{'-' if ratio is None else f'{ratio:.3g}':>17}")
    print_line(f"  saved in {path}")
    return path
