"""Multi-node runs under Slurm: a Ray cluster over the job's nodes, then a playground recipe on it.

    sbatch --nodes=4 scripts/slurm/orz.sbatch [--cluster configs/clusters/h100_4x8.yaml] \\
        playground/orz_7b_ppo.py model.path=/models/Qwen2.5-7B 'data.train=[/data/orz_math_57k.json]'
    python -m orz.launch_slurm check --nodes 4 --gpus-per-node 8 playground/orz_7b_ppo.py model.path=...

`scripts/slurm/orz.sbatch` does only what needs the batch shell: it expands the node list, starts
the steps in the background, forwards SIGUSR1 to the trainer and requeues the job. Everything it
runs comes from here, computed from Slurm's variables, so it is tested without Slurm or Ray:

    alloc = allocation_from_env(os.environ, nodes)      # nodes: `scontrol show hostnames` of SLURM_JOB_NODELIST
    cfg, overrides = resolve_run(recipe, overrides, submit_dir, alloc.restart_count)
    problems = preflight(cfg, alloc.nodes_count, alloc.gpus_per_node, cluster)   # [] to go on
    commands = launch_commands(alloc, head_ip, options, overrides)   # head, workers, waits, train

The head is the node the batch script runs on, so the trainer (the Ray driver) shares a node with
the GCS. Each `ray start` carries a custom resource `slurm_node:NAME`, which lets the wait step
say which Slurm node is missing rather than how many GPUs are. The checks run before any `srun`:
a run the planner says does not fit, or a recipe that needs more GPUs than the job has, never costs an
allocation's worth of waiting for Ray placement groups that cannot be satisfied.

Ray's token authentication is the sbatch script's: it exports RAY_AUTH_MODE=token and a token of
its own to every step (`ray start --head` enables tokens by itself when ~/.ray/auth_token exists,
and worker nodes and drivers given an address do not follow, so it must be explicit).

Subcommands: `check` (login node, before sbatch), `script` (inside the job: prints bash function
definitions for the sbatch script to eval; everything for people goes to stderr) and `wait`.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from orz.config import (ConfigError, ExperimentConfig, apply_overrides, load_config, load_recipe,
                        stage_configs)
from orz.run.resume import start_point

NODE_RESOURCE = "slurm_node:"  # + Slurm node name: a custom Ray resource naming each node
RESUMABLE_EXIT = 75  # EX_TEMPFAIL: the trainer saved a checkpoint and stopped early; requeue to go on
REQUEUE_MARGIN_S = 60  # the watchdog requeues this long before Slurm would kill the job
NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # an output_dir here is not seen by other nodes


class LaunchError(RuntimeError):
    """Something that stops the launch; the message says what and what to change."""


# ---------------------------------------------------------------- the allocation


@dataclass(frozen=True)
class Allocation:
    """What Slurm gave the job, from its environment."""

    job_id: str
    nodes: tuple[str, ...]  # Slurm node names, the head (the batch script's node) first
    gpus_per_node: int  # SLURM_GPUS_ON_NODE; 0 on a CPU partition
    cpus_per_node: int  # SLURM_CPUS_ON_NODE: what each `ray start` step claims and offers Ray
    restart_count: int  # SLURM_RESTART_COUNT: times the job was requeued; > 0 means the trainer resumes

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def workers(self) -> tuple[str, ...]:
        return self.nodes[1:]

    @property
    def nodes_count(self) -> int:
        return len(self.nodes)


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name, "")
    if raw == "" and default is not None:
        return default
    try:
        return int(raw.split("(")[0])  # SLURM_CPUS_ON_NODE may read "64(x2)" on some versions
    except ValueError:
        raise LaunchError(f"{name}={raw!r}: expected a number (is this running inside an sbatch job?)") from None


def allocation_from_env(env: Mapping[str, str], nodes: Sequence[str], gpus_per_node: int | None = None) -> Allocation:
    """The job's allocation; `nodes` is SLURM_JOB_NODELIST already expanded (`scontrol show hostnames`).

    The head is SLURMD_NODENAME, the node the batch script runs on (Slurm's first node); gpus_per_node,
    when given, replaces SLURM_GPUS_ON_NODE (unset when GPUs were requested through --gres on old Slurm).
    """
    if not nodes:
        raise LaunchError("no nodes: pass SLURM_JOB_NODELIST expanded by `scontrol show hostnames`")
    if len(set(nodes)) != len(nodes):
        raise LaunchError(f"node list has duplicates: {' '.join(nodes)}")
    head = env.get("SLURMD_NODENAME") or nodes[0]
    if head not in nodes:
        raise LaunchError(f"SLURMD_NODENAME={head} is not in the job's nodes {' '.join(nodes)}")
    if gpus_per_node is None:
        if "SLURM_GPUS_ON_NODE" not in env:
            raise LaunchError("SLURM_GPUS_ON_NODE is not set: request GPUs with --gpus-per-node=N, or pass "
                              "--gpus-per-node (0 for a CPU partition)")
        gpus_per_node = _env_int(env, "SLURM_GPUS_ON_NODE")
    return Allocation(job_id=env.get("SLURM_JOB_ID", "0"), nodes=(head, *(n for n in nodes if n != head)),
                      gpus_per_node=gpus_per_node, cpus_per_node=_env_int(env, "SLURM_CPUS_ON_NODE"),
                      restart_count=_env_int(env, "SLURM_RESTART_COUNT", default=0))


def pick_ip(addresses: str) -> str:
    """The head's address for Ray from `hostname -I`: the first IPv4 that is not loopback or
    link-local (those are unreachable from other nodes), else the first address given."""
    words = addresses.split()
    if not words:
        raise LaunchError("no IP address for the head node (`hostname -I` printed nothing)")
    for word in words:
        try:
            ip = ipaddress.ip_address(word)
        except ValueError:
            continue
        if ip.version == 4 and not (ip.is_loopback or ip.is_link_local):
            return word
    return words[0]


# ---------------------------------------------------------------- the run's config


def _set(overrides: list[str], key: str, value: str) -> list[str]:
    """overrides with the user's key=... replaced by key=value, or key=value appended."""
    item = f"{key}={value}"
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    return [item if k == key else o for k, o in zip(keys, overrides)] if key in keys else [*overrides, item]


def resolve_run(recipe: str | Path, overrides: Sequence[str], submit_dir: str | Path,
                restart_count: int = 0) -> tuple[ExperimentConfig, list[str]]:
    """(config the trainer will run, overrides to pass it) for a run on the cluster.

    Adds trainer.ray_address=auto (the trainer joins the cluster; RAY_ADDRESS names it) and makes
    trainer.output_dir and the model paths absolute: Ray workers on other nodes read and write
    them, and a requeued job finds its checkpoints there. Refuses what cannot work on several
    nodes: a node-local output_dir, a missing model directory, another ray_address, and a
    requeued job that would not resume (trainer.resume=false would start over on top of the
    checkpoints).
    """
    submit_dir = Path(submit_dir)
    try:
        base = load_recipe(recipe)
    except ConfigError as err:
        raise LaunchError(str(err)) from None
    try:
        cfg = load_config(None, list(overrides), base=base)
    except ConfigError as err:
        raise LaunchError(f"{recipe}: {err}") from None
    if cfg.trainer.ray_address not in ("", "auto"):
        raise LaunchError(f"trainer.ray_address={cfg.trainer.ray_address}: under Slurm the launcher starts the "
                          "cluster and the trainer joins it (auto); drop this setting")
    out = list(overrides)
    if not cfg.model.path:
        raise LaunchError("model.path is not set: pass model.path=/shared/path/to/hf_model")
    for key in ("model.path", "model.critic_path"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not value:
            continue
        path = Path(os.path.abspath(submit_dir / value))  # abspath: normalised, symlinks kept
        if not path.is_dir():
            raise LaunchError(f"{key}={value}: no such directory on the head node; every node reads it, so it "
                              "must be on shared storage")
        if str(path) != value:
            out = _set(out, key, str(path))
    output_dir = Path(os.path.abspath(submit_dir / cfg.trainer.output_dir))
    if any(output_dir == Path(d) or Path(d) in output_dir.parents for d in NODE_LOCAL_DIRS):
        raise LaunchError(f"trainer.output_dir={output_dir} is node-local; checkpoints must be on storage "
                          "every node and a requeued job can see")
    if restart_count and not cfg.trainer.resume:
        raise LaunchError(f"requeued job (restart {restart_count}) with trainer.resume=false would start over "
                          f"on top of {output_dir}/checkpoints; drop the override")
    out = _set(out, "trainer.ray_address", "auto")
    out = _set(out, "trainer.output_dir", str(output_dir))
    return apply_overrides(base, out), out


# ---------------------------------------------------------------- checks before any GPU work


def _layout(cfg: ExperimentConfig):
    """Where the trainer would put the run's processes (orz.run.placement, which imports torch)."""
    from orz.run.placement import Layout

    try:
        return Layout.of(cfg)
    except ConfigError as err:  # an unknown estimator; the message lists the valid ones
        raise LaunchError(str(err)) from None


def config_problems(cfg: ExperimentConfig) -> list[str]:
    """The trainer's own refusals (orz.run.run_rules.check: stage keys, KL settings), one a line."""
    from orz.run import run_rules

    try:
        run_rules.check(cfg, on_gpu=True)
    except ConfigError as err:
        return str(err).splitlines()
    return []


def gpu_demand(cfg: ExperimentConfig) -> dict[str, int]:
    """GPUs each role asks Ray for (orz.run.placement.Layout.gpu_demand)."""
    return _layout(cfg).gpu_demand()


def recipe_problems(cfg: ExperimentConfig, nodes: int, gpus_per_node: int) -> list[str]:
    """Why the recipe's processes cannot be placed on nodes × gpus_per_node GPUs, at any stage; []
    when they can (Ray would otherwise wait forever for placement groups it cannot satisfy)."""
    if gpus_per_node == 0:
        return []  # a CPU partition: roles reserve CPUs, which Ray shares out
    return [label + problem for label, stage in stage_configs(cfg)
            for problem in _layout(stage).cluster_problems(nodes, gpus_per_node)]


def plan_problems(cluster: str | Path, cfg: ExperimentConfig, nodes: int, gpus_per_node: int) -> list[str]:
    """The planner's verdict on this run (`python -m orz.plan --cluster CLUSTER --recipe ...`) with
    the cluster file's GPUs and efficiencies on this job's nodes × GPUs."""
    from orz import plan as planner
    from orz.models.arch import ModelConfigError

    where = f"{cluster} on {nodes} nodes × {gpus_per_node} GPUs"
    try:
        plans = planner.plan_recipe(cfg, planner.load_cluster(cluster, nodes=nodes, gpus_per_node=gpus_per_node))
    except (ConfigError, ModelConfigError) as err:
        return [f"{where} cannot run: {line}" for line in str(err).splitlines()]
    return [f"{where}: {label}{problem}" for label, p in plans for problem in planner.blockers(p)]


def preflight(cfg: ExperimentConfig, nodes: int, gpus_per_node: int, cluster: str | Path | None = None) -> list[str]:
    """Every reason not to start: the recipe against the allocation, then, given a cluster file,
    the planner's verdict on memory; [] to go on."""
    config = config_problems(cfg)
    problems = config + recipe_problems(cfg, nodes, gpus_per_node)
    if cluster and not config:  # the planner reads the config as the trainer would
        problems += plan_problems(cluster, cfg, nodes, gpus_per_node)
    return problems


# ---------------------------------------------------------------- the commands


@dataclass(frozen=True)
class LaunchOptions:
    recipe: str  # playground/*.py, relative to the submit directory
    python: str  # the project's interpreter on shared storage; `ray` is its sibling
    port: int = 6379  # the head's GCS port (nodes are --exclusive, so Ray's default is free)
    join_timeout_s: int = 300  # how long a node may take to join before the job ends naming it
    signal_lead_s: int = 1800  # the @seconds of `#SBATCH --signal=B:USR1@...`


@dataclass(frozen=True)
class LaunchCommands:
    """Every command of the job, as argv lists; `shell()` renders them for the sbatch script."""

    head_node: str
    address: str  # IP:PORT of the head's GCS
    head: list[str]  # `ray start --head` on the head node, in an srun step, blocking
    workers: dict[str, list[str]]  # node -> `ray start --address=...` in an srun step on that node
    wait_head: list[str]  # until the head is up (workers cannot join before)
    wait_all: list[str]  # until every node has joined with all its GPUs
    train: list[str]  # the recipe, in the batch step on the head node
    requeue_after_s: int  # after SIGUSR1, requeue anyway if the trainer is still running then

    def shell(self) -> str:
        """Bash function definitions for `eval`. The start functions `exec`, so `f &` puts the real
        process behind `$!` (the trainer must receive the forwarded SIGUSR1 itself)."""
        q = shlex.join
        lines = [
            f"orz_head_node={shlex.quote(self.head_node)}",
            f"orz_worker_nodes=({' '.join(shlex.quote(n) for n in self.workers)})",
            f"orz_requeue_after_s={self.requeue_after_s}",
            f"orz_start_head() {{ exec {q(self.head)}; }}",
            "orz_start_worker() {",
            '  case "$1" in',
            *(f"    {shlex.quote(node)}) exec {q(cmd)} ;;" for node, cmd in self.workers.items()),
            '    *) echo "orz: $1 is not a worker node of this job" >&2; return 2 ;;',
            "  esac",
            "}",
            f"orz_wait_head() {{ {q(self.wait_head)}; }}",
            f"orz_wait_all() {{ {q(self.wait_all)}; }}",
            f"orz_train() {{ exec {q(self.train)}; }}",
        ]
        return "\n".join(lines) + "\n"

    def describe(self) -> str:
        """The commands, one per line, for the job's log."""
        steps = [("head", self.head), *((f"worker {n}", c) for n, c in self.workers.items()),
                 ("wait", self.wait_head), ("wait", self.wait_all), ("train", self.train)]
        return "\n".join(f"  {label:<14} {shlex.join(cmd)}" for label, cmd in steps)


def _ray_start(alloc: Allocation, node: str, ray: str, role_args: list[str]) -> list[str]:
    """`ray start` on one node in its own srun step, holding all the node's CPUs and GPUs (an srun
    step otherwise gets one CPU); --block keeps the step, and so the Ray node, alive."""
    gpus = [f"--gres=gpu:{alloc.gpus_per_node}"] if alloc.gpus_per_node else []
    return ["srun", "--nodes=1", "--ntasks=1", "-w", node, f"--cpus-per-task={alloc.cpus_per_node}", *gpus,
            ray, "start", *role_args, f"--num-cpus={alloc.cpus_per_node}", f"--num-gpus={alloc.gpus_per_node}",
            f"--resources={json.dumps({NODE_RESOURCE + node: 1})}", "--disable-usage-stats", "--block"]


def launch_commands(alloc: Allocation, head_ip: str, options: LaunchOptions,
                    overrides: Sequence[str]) -> LaunchCommands:
    """The exact commands of the job; `overrides` are resolve_run's (ray_address, absolute paths)."""
    if options.signal_lead_s <= 2 * REQUEUE_MARGIN_S:
        raise LaunchError(f"signal lead {options.signal_lead_s} s is too short: the trainer needs an iteration and "
                          f"a checkpoint, and the watchdog requeues {REQUEUE_MARGIN_S} s before the end")
    python = options.python
    ray = str(Path(python).with_name("ray")) if "/" in python else "ray"
    address = f"{head_ip}:{options.port}"
    head = _ray_start(alloc, alloc.head, ray, ["--head", f"--node-ip-address={head_ip}", f"--port={options.port}",
                                               "--include-dashboard=false"])
    workers = {node: _ray_start(alloc, node, ray, [f"--address={address}"]) for node in alloc.workers}
    wait = [python, "-m", "orz.launch_slurm", "wait", f"--address={address}",
            f"--gpus-per-node={alloc.gpus_per_node}", f"--timeout={options.join_timeout_s}"]
    train = ["env", f"RAY_ADDRESS={address}", python, options.recipe, *overrides]
    return LaunchCommands(head_node=alloc.head, address=address, head=head, workers=workers,
                          wait_head=[*wait, alloc.head], wait_all=[*wait, *alloc.nodes], train=train,
                          requeue_after_s=options.signal_lead_s - REQUEUE_MARGIN_S)


# ---------------------------------------------------------------- waiting for the cluster


def wait_for_nodes(expected: Mapping[str, int], joined: Callable[[], Mapping[str, float]], timeout_s: float,
                   poll_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep, log: Callable[[str], None] = print) -> None:
    """Returns once every expected node (name -> GPUs) has joined with all its GPUs; raises
    LaunchError naming the nodes still missing after timeout_s. `joined()` maps the Slurm nodes in
    the cluster to their GPUs (ray_joined_nodes); an exception from it counts as nothing joined yet
    (the head's GCS may not be listening)."""
    want, nodes = sum(expected.values()), f"{len(expected)} node{'s' * (len(expected) > 1)}"
    start, last, last_report = clock(), None, float("-inf")
    while True:
        try:
            have, error = dict(joined()), None
        except Exception as err:  # noqa: BLE001 - any failure to reach the cluster means "not yet"
            have, error = {}, f"{type(err).__name__}: {err}"
        short = {n: (have.get(n, 0.0), g) for n, g in expected.items() if n not in have or have[n] < g}
        elapsed = clock() - start
        state = (tuple(sorted(have.items())), error)
        if not short:
            log(f"orz: Ray cluster ready after {elapsed:.0f} s: {nodes}, {want} GPUs")
            return
        if state != last or elapsed - last_report >= 30:
            got = sum(min(have.get(n, 0.0), g) for n, g in expected.items())
            log(f"orz: waiting for Ray ({elapsed:.0f}/{timeout_s:.0f} s): {len(expected) - len(short)}/{len(expected)} "
                f"nodes ready, {got:g}/{want} GPUs; missing {', '.join(short)}" + (f" ({error})" if error else ""))
            last, last_report = state, elapsed
        if elapsed >= timeout_s:
            absent = [n for n, (h, _) in short.items() if n not in have]
            partial = [f"{n} joined with {h:g} of {g} GPUs" for n, (h, g) in short.items() if n in have]
            reasons = ([f"{', '.join(absent)} did not join"] if absent else []) + partial
            raise LaunchError(f"Ray cluster not ready after {timeout_s:.0f} s: {'; '.join(reasons)} "
                              f"(expected {nodes}, {want} GPUs); a node's `ray start` output is in "
                              "this job's log" + (f"; last error: {error}" if error else ""))
        sleep(poll_s)


def ray_joined_nodes(address: str) -> Callable[[], dict[str, float]]:
    """joined() for wait_for_nodes: the Slurm nodes alive in the Ray cluster at address, with their GPUs."""

    def joined() -> dict[str, float]:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, configure_logging=False)
        return {key[len(NODE_RESOURCE):]: node["Resources"].get("GPU", 0.0) for node in ray.nodes() if node["Alive"]
                for key in node["Resources"] if key.startswith(NODE_RESOURCE)}

    return joined


# ---------------------------------------------------------------- CLI


def _recipe_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cluster", help="configs/clusters/*.yaml: plan the run's memory on this allocation's nodes")
    ap.add_argument("recipe", help="playground/*.py")
    ap.add_argument("overrides", nargs="*", help="key.sub=value, as for the recipe")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m orz.launch_slurm", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="refuse a recipe that cannot run (or fit) on NODES × GPUS; "
                                         "for the login node, before sbatch")
    check.add_argument("--nodes", type=int, required=True)
    check.add_argument("--gpus-per-node", type=int, required=True)
    _recipe_args(check)
    script = sub.add_parser("script", help="inside the job: the checks, then bash functions for orz.sbatch to eval")
    script.add_argument("--node-list", required=True, help="SLURM_JOB_NODELIST expanded, space-separated")
    script.add_argument("--head-ips", required=True, help="the head node's addresses (`hostname -I`)")
    script.add_argument("--gpus-per-node", type=int, help="instead of SLURM_GPUS_ON_NODE")
    script.add_argument("--python", default=sys.executable,
                        help="the interpreter every node runs (shared storage); `ray` is its sibling")
    script.add_argument("--port", type=int, default=LaunchOptions.port, help="the head's Ray (GCS) port")
    script.add_argument("--join-timeout", type=int, default=LaunchOptions.join_timeout_s,
                        help="seconds a node may take to join the Ray cluster")
    script.add_argument("--signal-lead", type=int, default=LaunchOptions.signal_lead_s,
                        help="the @seconds of #SBATCH --signal=B:USR1@...")
    _recipe_args(script)
    wait = sub.add_parser("wait", help="until every NODE has joined the Ray cluster with its GPUs")
    wait.add_argument("--address", required=True)
    wait.add_argument("--gpus-per-node", type=int, required=True)
    wait.add_argument("--timeout", type=float, required=True)
    wait.add_argument("nodes", nargs="+")
    return ap.parse_args(argv)


def _refuse(problems: list[str]) -> int:
    print("orz.launch_slurm: refusing to start:\n" + "\n".join(f"  - {p}" for p in problems), file=sys.stderr)
    return 1


def _summary(cfg: ExperimentConfig) -> str:
    demand = gpu_demand(cfg)
    return " + ".join(f"{name} {n:g}" for name, n in demand.items()) + f" = {sum(demand.values()):g} GPUs"


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """The entry point; env defaults to os.environ (Slurm's variables)."""
    args = parse_args(argv)
    env = os.environ if env is None else env
    try:
        if args.command == "wait":
            expected = {node: args.gpus_per_node for node in args.nodes}
            try:
                wait_for_nodes(expected, ray_joined_nodes(args.address), args.timeout,
                               log=lambda line: print(line, file=sys.stderr, flush=True))
            except LaunchError as err:
                print(f"orz.launch_slurm wait: {err}", file=sys.stderr)
                return 1
            return 0
        if args.command == "check":
            nodes, gpus, restarts = args.nodes, args.gpus_per_node, 0
        else:
            alloc = allocation_from_env(env, args.node_list.split(), args.gpus_per_node)
            nodes, gpus, restarts = alloc.nodes_count, alloc.gpus_per_node, alloc.restart_count
        cfg, overrides = resolve_run(args.recipe, args.overrides, Path.cwd(), restarts)
        problems = preflight(cfg, nodes, gpus, args.cluster)
    except LaunchError as err:
        return _refuse([str(err)])
    if problems:
        return _refuse(problems)
    print(f"orz.launch_slurm: {args.recipe} on {nodes} nodes × {gpus} GPUs: {_summary(cfg)}"
          + (f"; it fits {args.cluster}" if args.cluster else ""), file=sys.stderr)
    if args.command == "check":
        return 0
    try:
        commands = launch_commands(alloc, pick_ip(args.head_ips), LaunchOptions(
            recipe=args.recipe, python=args.python, port=args.port, join_timeout_s=args.join_timeout,
            signal_lead_s=args.signal_lead), overrides)
    except LaunchError as err:
        return _refuse([str(err)])
    start = start_point(cfg).checkpoint
    resume = f"resumes from {start}" if start else "starts from scratch"
    print(f"orz.launch_slurm: job {alloc.job_id}, restart {alloc.restart_count}: the trainer {resume} in "
          f"{cfg.trainer.output_dir}; head {alloc.head} at {commands.address}\n{commands.describe()}",
          file=sys.stderr, flush=True)
    print(commands.shell(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
