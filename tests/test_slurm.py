"""orz.launch_slurm and scripts/slurm/orz.sbatch without Slurm or Ray: exact commands for a fake
4-node allocation, the wait step against an injected cluster, refusals before any command runs,
and the sbatch script itself under fake srun/scontrol (SIGUSR1 → checkpoint → requeue).

    .venv/bin/python -m pytest -q tests/test_slurm.py
"""
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from orz import launch_slurm
from orz.config import RoleConfig, StageConfig, load_recipe
from orz.launch_slurm import (Allocation, LaunchError, LaunchOptions, allocation_from_env, launch_commands, main,
                              pick_ip, preflight, resolve_run, wait_for_nodes)
from test_plan import qwen25_7b_actor_gib  # the hand derivation of the actor's memory

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "scripts" / "slurm" / "orz.sbatch"
RECIPE = "playground/orz_7b_ppo.py"
NODES = ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"]
ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu-a[01-04]", "SLURM_GPUS_ON_NODE": "8",
       "SLURM_CPUS_ON_NODE": "96", "SLURMD_NODENAME": "gpu-a01", "SLURM_RESTART_COUNT": "0"}
PY = "/shared/orz/.venv/bin/python"
RAY = "/shared/orz/.venv/bin/ray"
OUT = "/shared/runs/orz_7b"  # resolve_run only computes paths; nothing is written there


@pytest.fixture
def model(tmp_path):
    """A model directory with Qwen2.5-7B's config.json (all the planner reads of it)."""
    path = tmp_path / "Qwen2.5-7B"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
        "max_position_embeddings": 131072}))
    return str(path)


@pytest.fixture
def in_repo(monkeypatch):
    """Recipes are given relative to the submit directory, the repository root."""
    monkeypatch.chdir(REPO)


def user_overrides(model):
    return [f"model.path={model}", "data.train=[/shared/data/orz_math_57k.json]", f"trainer.output_dir={OUT}"]


def ray_start(node, *args):
    return ["srun", "--nodes=1", "--ntasks=1", "-w", node, "--cpus-per-task=96", "--gres=gpu:8", RAY, "start",
            *args, "--num-cpus=96", "--num-gpus=8", f'--resources={{"slurm_node:{node}": 1}}',
            "--disable-usage-stats", "--block"]


def test_commands_for_a_four_node_allocation(in_repo, model):
    alloc = allocation_from_env(ENV, NODES)
    cfg, overrides = resolve_run(RECIPE, user_overrides(model), REPO, alloc.restart_count)
    assert preflight(cfg, alloc.nodes_count, alloc.gpus_per_node) == []
    cmds = launch_commands(alloc, pick_ip("10.0.0.11 172.17.0.1 fe80::1"), LaunchOptions(recipe=RECIPE, python=PY),
                           overrides)

    assert cmds.head_node == "gpu-a01" and cmds.address == "10.0.0.11:6379"
    assert cmds.head == ray_start("gpu-a01", "--head", "--node-ip-address=10.0.0.11", "--port=6379",
                                  "--include-dashboard=false")
    assert cmds.workers == {node: ray_start(node, "--address=10.0.0.11:6379") for node in NODES[1:]}
    wait = [PY, "-m", "orz.launch_slurm", "wait", "--address=10.0.0.11:6379", "--gpus-per-node=8", "--timeout=300"]
    assert cmds.wait_head == [*wait, "gpu-a01"]
    assert cmds.wait_all == [*wait, *NODES]
    waited = launch_slurm.parse_args(cmds.wait_all[3:])
    assert len(waited.nodes) * waited.gpus_per_node == 32
    assert cmds.train == ["env", "RAY_ADDRESS=10.0.0.11:6379", PY, RECIPE, f"model.path={model}",
                          "data.train=[/shared/data/orz_math_57k.json]", f"trainer.output_dir={OUT}",
                          "trainer.ray_address=auto"]
    assert cmds.requeue_after_s == 1800 - 60


def test_shell_functions_run_exactly_those_commands(in_repo, model, tmp_path):
    """What orz.sbatch evals: `exec` replaced by a function printing its argv, one word a line."""
    alloc = allocation_from_env(ENV, NODES)
    _, overrides = resolve_run(RECIPE, [*user_overrides(model), "data.instruction=it's \"quoted\" $HOME"], REPO)
    cmds = launch_commands(alloc, "10.0.0.11", LaunchOptions(recipe=RECIPE, python=PY), overrides)
    script = tmp_path / "launch.sh"
    script.write_text(cmds.shell())
    probe = ('exec() { printf "%s\\n" "$@"; }; eval "$(cat "$1")"; orz_start_head; echo --; '
             'orz_start_worker gpu-a03; echo --; orz_train; echo --; echo "${orz_worker_nodes[*]}"; '
             'echo "$orz_requeue_after_s"; orz_start_worker gpu-a09; echo "rc=$?"')
    out = subprocess.run(["bash", "-c", probe, "probe", str(script)], capture_output=True, text=True, check=True)
    head, worker, train, rest = out.stdout.split("--\n")
    assert head.splitlines() == cmds.head
    assert worker.splitlines() == cmds.workers["gpu-a03"]
    assert train.splitlines() == cmds.train
    assert rest.splitlines() == ["gpu-a02 gpu-a03 gpu-a04", "1740", "rc=2"]
    assert "gpu-a09 is not a worker node" in out.stderr
    assert shlex.split(cmds.shell().split("orz_wait_all() { ")[1].split(";")[0]) == cmds.wait_all


def test_allocation_from_slurm_variables():
    alloc = allocation_from_env(ENV | {"SLURMD_NODENAME": "gpu-a03", "SLURM_RESTART_COUNT": "2"}, NODES)
    assert alloc == Allocation(job_id="4242", nodes=("gpu-a03", "gpu-a01", "gpu-a02", "gpu-a04"), gpus_per_node=8,
                               cpus_per_node=96, restart_count=2)
    assert allocation_from_env({k: v for k, v in ENV.items() if k != "SLURM_GPUS_ON_NODE"}, NODES,
                               gpus_per_node=4).gpus_per_node == 4
    with pytest.raises(LaunchError, match="SLURM_GPUS_ON_NODE is not set"):
        allocation_from_env({k: v for k, v in ENV.items() if k != "SLURM_GPUS_ON_NODE"}, NODES)
    with pytest.raises(LaunchError, match="not in the job's nodes"):
        allocation_from_env(ENV | {"SLURMD_NODENAME": "login1"}, NODES)
    assert pick_ip("127.0.0.1 169.254.3.4 fe80::1 10.0.0.11") == "10.0.0.11"
    assert pick_ip("fd00::5") == "fd00::5"


def test_wait_names_the_node_that_never_joins():
    clock, logs = [0.0], []
    joined = {"gpu-a01": 8.0, "gpu-a02": 8.0, "gpu-a04": 8.0}  # gpu-a03's `ray start` never reached the head
    with pytest.raises(LaunchError) as err:
        wait_for_nodes({n: 8 for n in NODES}, lambda: joined, timeout_s=300, poll_s=5, clock=lambda: clock[0],
                       sleep=lambda s: clock.__setitem__(0, clock[0] + s), log=logs.append)
    message = str(err.value)
    assert "after 300 s: gpu-a03 did not join" in message and "expected 4 nodes, 32 GPUs" in message
    assert not any(n in message for n in ("gpu-a01", "gpu-a02", "gpu-a04"))
    assert logs[0] == "orz: waiting for Ray (0/300 s): 3/4 nodes ready, 24/32 GPUs; missing gpu-a03"
    assert 2 <= len(logs) <= 12  # on changes and every 30 s, not every poll


def test_wait_until_ready_and_nodes_short_of_gpus():
    states = iter([ConnectionError("GCS not up"), {"gpu-a01": 8.0}, {"gpu-a01": 8.0, "gpu-a02": 8.0}])
    clock, logs = [0.0], []

    def joined():
        state = next(states)
        if isinstance(state, Exception):
            raise state
        return state

    wait_for_nodes({"gpu-a01": 8, "gpu-a02": 8}, joined, timeout_s=60, clock=lambda: clock[0],
                   sleep=lambda s: clock.__setitem__(0, clock[0] + s), log=logs.append)
    assert "ConnectionError: GCS not up" in logs[0]
    assert logs[-1] == "orz: Ray cluster ready after 10 s: 2 nodes, 16 GPUs"
    with pytest.raises(LaunchError, match="gpu-a02 did not join"):  # a CPU partition: nodes, no GPUs
        wait_for_nodes({"gpu-a01": 0, "gpu-a02": 0}, lambda: {"gpu-a01": 0.0}, timeout_s=0, log=logs.append)
    with pytest.raises(LaunchError, match=r"gpu-a02 joined with 4 of 8 GPUs"):
        wait_for_nodes({"gpu-a01": 8, "gpu-a02": 8}, lambda: {"gpu-a01": 8.0, "gpu-a02": 4.0}, timeout_s=0,
                       log=logs.append)


def write_cluster(path, gpu_mem_gib):
    """A cluster file: 4 nodes × 8 GPUs of `gpu_mem_gib` each."""
    path.write_text(json.dumps({"cluster": {"nodes": 4, "gpus_per_node": 8, "gpu": "H100",
                                            "gpu_mem_gib": gpu_mem_gib}}))  # JSON is YAML
    return str(path)


def run_main(argv, capsys):
    rc = main(argv, env=ENV)
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_run_that_does_not_fit_is_refused_before_any_command(in_repo, model, tmp_path, capsys):
    """The planner plans the recipe itself (with the user's overrides) on the job's nodes."""
    small = write_cluster(tmp_path / "small_gpus.yaml", gpu_mem_gib=24.0)
    from orz import plan as planner

    assert planner.main(["--cluster", small, "--recipe", RECIPE, *user_overrides(model), "--json"]) == 1
    [stage] = json.loads(capsys.readouterr().out)["stages"]
    planned = stage["problems"]
    assert any(p.startswith("actor does not fit") for p in planned)

    rc, out, err = run_main(["script", "--node-list", " ".join(NODES), "--head-ips", "10.0.0.11", "--python", PY,
                             "--cluster", small, RECIPE, *user_overrides(model)], capsys)
    assert rc == 1 and out == ""  # nothing for orz.sbatch to eval: no srun, no ray start
    assert "refusing to start" in err
    for problem in planned:
        assert f"{small} on 4 nodes × 8 GPUs: {problem}" in err

    shipped = "configs/clusters/h100_4x8.yaml"
    rc, out, err = run_main(["check", "--nodes", "4", "--gpus-per-node", "8", "--cluster", shipped, RECIPE,
                             *user_overrides(model)], capsys)
    assert rc == 0 and f"it fits {shipped}" in err
    # A user's override is planned too: without recomputation or the distributed optimizer the actor
    # no longer fits.
    rc, _, err = run_main(["check", "--nodes", "4", "--gpus-per-node", "8", "--cluster", shipped, RECIPE,
                           *user_overrides(model), "model.recompute=false", "actor.use_distributed_optimizer=false"],
                          capsys)
    assert rc == 1 and f"actor does not fit: {qwen25_7b_actor_gib(2, 1, 4, False)} GiB per GPU" in err  # 107.5


def test_the_plan_uses_the_jobs_nodes_not_the_files(in_repo, model, capsys):
    shipped = "configs/clusters/h100_4x8.yaml"  # 4 nodes; the job has 2
    rc, _, err = run_main(["check", "--nodes", "2", "--gpus-per-node", "8", "--cluster", shipped, RECIPE,
                           *user_overrides(model)], capsys)
    assert rc == 1
    assert (f"{shipped} on 2 nodes × 8 GPUs cannot run: GPUs needed: actor 8 (2·1·4 workers) + critic 8 (2·1·4 "
            "workers) + rollout 16 (16 engines × TP1) = 32 > 16 GPUs (2 nodes × 8)") in err


def test_recipe_sizes_against_the_allocation(in_repo):
    cfg = load_recipe(RECIPE)
    grpo = replace(cfg, algorithm=replace(cfg.algorithm, advantage="grpo"))
    [problem] = preflight(cfg, nodes=2, gpus_per_node=8)
    assert problem.startswith("GPUs needed: actor 8 (2·1·4 workers) + critic 8 (2·1·4 workers) + rollout 16 "
                              "(16 engines × TP1) = 32 > 16 GPUs (2 nodes × 8)")
    assert preflight(grpo, nodes=3, gpus_per_node=8) == []  # GRPO: no critic
    # Colocated roles share the engines' GPUs: 16 actor and 16 critic workers beside 16 engines.
    shared = RoleConfig(tp=2, dp=8)
    colocated = replace(cfg, actor=shared, critic=shared, trainer=replace(cfg.trainer, colocate=True),
                        rollout=replace(cfg.rollout, transport="object_store"))
    assert preflight(colocated, nodes=2, gpus_per_node=8) == []
    assert preflight(replace(cfg, algorithm=replace(cfg.algorithm, kl_coef=0.01)), 4, 8)[0].startswith(
        "GPUs needed: actor 8 (2·1·4 workers) + critic 8 (2·1·4 workers) + ref 1")
    problems = preflight(replace(grpo, rollout=replace(cfg.rollout, num_engines=2, engine_tp=8), actor=RoleConfig(tp=3)),
                         nodes=8, gpus_per_node=4)
    assert problems == ["rollout.engine_tp=8 does not divide 4 GPUs per node (an engine's GPUs must be on one node)",
                        "actor.tp=3 does not divide 4 GPUs per node (a TP group must stay inside one node)"]
    staged = replace(cfg, stages=[StageConfig(iterations=1),
                                  StageConfig(iterations=1, overrides={"rollout.num_engines": 32})])
    # A stage cannot resize the fleet (the trainer's own rule, run_rules), and it would not fit either.
    config, fit = preflight(staged, nodes=4, gpus_per_node=8)
    assert config.startswith("stages[1].overrides: 'rollout.num_engines' cannot change between stages")
    assert fit.startswith("stage 1: GPUs needed") and "= 48 > 32 GPUs" in fit


def test_resolve_run_paths_and_refusals(in_repo, model):
    # A relative output_dir is taken from the submit directory (here a shared one: the clone
    # running the tests may itself live under /tmp, which the launcher refuses as node-local).
    submit = Path("/shared/orz")
    cfg, overrides = resolve_run(RECIPE, [f"model.path={model}", "trainer.output_dir=runs/x"], submit)
    assert overrides == [f"model.path={model}", f"trainer.output_dir={submit}/runs/x", "trainer.ray_address=auto"]
    assert cfg.trainer.output_dir == f"{submit}/runs/x" and cfg.trainer.ray_address == "auto"
    cases = {
        "trainer.output_dir=/tmp/run": "trainer.output_dir=/tmp/run is node-local",
        "trainer.ray_address=10.0.0.1:6379": "the launcher starts the cluster",
        "actor.nope=1": "unknown key 'actor.nope'",
    }
    for override, message in cases.items():
        with pytest.raises(LaunchError, match=message):
            resolve_run(RECIPE, [f"model.path={model}", override], submit)
    with pytest.raises(LaunchError, match="model.path=/nonexistent/m: no such directory"):
        resolve_run(RECIPE, ["model.path=/nonexistent/m"], submit)
    with pytest.raises(LaunchError, match=r"requeued job \(restart 1\) with trainer.resume=false"):
        resolve_run(RECIPE, [f"model.path={model}", "trainer.resume=false"], submit, restart_count=1)


def test_sbatch_syntax():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_sbatch_shellcheck():
    result = subprocess.run(["shellcheck", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ---------------------------------------------------------------- orz.sbatch under fake Slurm


FAKE_RECIPE = '''
import os, signal, sys, time
from orz.config import AlgorithmConfig, ExperimentConfig, RoleConfig, RolloutConfig, TrainerConfig
RECIPE = ExperimentConfig(algorithm=AlgorithmConfig(advantage="grpo"), actor=RoleConfig(tp=2, dp=8),
                          rollout=RolloutConfig(num_engines=16),
                          trainer=TrainerConfig(output_dir="/shared/runs/fake"))
if __name__ == "__main__":  # a trainer that checkpoints on SIGUSR1 and exits 75, has no handler, or ignores it
    log = os.path.join(os.environ["ORZ_TEST_LOG"], "trainer.log")
    def checkpoint(*_):
        open(log, "a").write("SIGUSR1: checkpoint saved\\n")
        sys.exit(75)
    if os.environ["ORZ_TEST_TRAINER"] == "checkpoints":
        signal.signal(signal.SIGUSR1, checkpoint)
    elif os.environ["ORZ_TEST_TRAINER"] == "ignores":
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    auth = f"{os.environ['RAY_AUTH_MODE']} {len(os.environ['RAY_AUTH_TOKEN'])}"
    open(log, "w").write(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']} auth={auth} " + " ".join(sys.argv[1:]) + "\\n")
    time.sleep(float(os.environ.get("ORZ_TEST_TRAINER_S", 20)))
'''


def _slurm_job(tmp_path, scripts: dict[str, str], slurm_env: dict[str, str]):
    """(environment, log dir) of a batch job submitted from tmp_path, with `scripts` (name -> bash
    body) in a bin/ ahead of PATH; its python wrapper is the job's interpreter."""
    bin_, log = tmp_path / "bin", tmp_path / "log"
    bin_.mkdir()
    log.mkdir()
    for name, body in scripts.items():
        (bin_ / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_ / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | slurm_env | {
        "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path), "ORZ_PYTHON": str(bin_ / "python"),
        "ORZ_TEST_LOG": str(log), "PYTHONPATH": str(REPO)}
    return env, log


def fake_slurm(tmp_path):
    """bin/ with srun, scontrol and hostname that log their calls, and a python wrapper whose
    `wait` succeeds once each node's srun has started (no Ray)."""
    scripts = {
        "srun": ('echo "srun $*" >> "$ORZ_TEST_LOG/srun.log"\n'
                 'echo "$RAY_AUTH_MODE ${#RAY_AUTH_TOKEN}" >> "$ORZ_TEST_LOG/srun_auth.log"\n'
                 'exec sleep 30'),
        "scontrol": ('echo "scontrol $*" >> "$ORZ_TEST_LOG/scontrol.log"\n'
                     'if [[ $1 == show ]]; then printf "%s\\n" ' + " ".join(NODES) + "; fi"),
        "hostname": 'echo "10.0.0.11 172.17.0.1"',
        "python": ('echo "python $*" >> "$ORZ_TEST_LOG/python.log"\n'
                   'if [[ "$1 $2 $3" == "-m orz.launch_slurm wait" ]]; then for arg in "${@:4}"; do '  # each node started
                   '[[ $arg == --* ]] || until grep -q -- "-w $arg " "$ORZ_TEST_LOG/srun.log" 2>/dev/null; '
                   'do sleep 0.05; done; done; exit 0; fi\n'
                   'if [[ "$1 $2 $3" == "-m orz.launch_slurm script" ]]; then shift 2; set -o pipefail; ' + sys.executable
                   + ' -m orz.launch_slurm "$@" '  # the launcher's shortest requeue delay is 61 s
                   '| sed "${ORZ_TEST_REQUEUE_AFTER_S:+s/^orz_requeue_after_s=.*/orz_requeue_after_s=$ORZ_TEST_REQUEUE_AFTER_S/}"; exit; fi\n'
                   'exec ' + sys.executable + ' "$@"'),
    }
    (tmp_path / "fake_recipe.py").write_text(FAKE_RECIPE)
    return _slurm_job(tmp_path, scripts, ENV)


@pytest.mark.parametrize("trainer, rc, why", [
    ("checkpoints", 75, "the trainer saved a checkpoint and stopped (exit 75)"),
    ("dies", 128 + signal.SIGUSR1, "the trainer died of SIGUSR1 without a checkpoint"),
    # Still running 1 s after SIGUSR1 (the watchdog's delay, shortened): requeued anyway. A real
    # `scontrol requeue` ends the job; the fake one does not, so the trainer finishes.
    ("ignores", 0, "the trainer did not stop in time"),
])
def test_sbatch_forwards_usr1_and_requeues(tmp_path, model, trainer, rc, why):
    env, log = fake_slurm(tmp_path)
    env["ORZ_TEST_TRAINER"] = trainer
    if trainer == "ignores":
        env |= {"ORZ_TEST_REQUEUE_AFTER_S": "1", "ORZ_TEST_TRAINER_S": "6"}
    job = subprocess.Popen(["bash", str(SBATCH), "--signal-lead", "600", "fake_recipe.py", f"model.path={model}"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    trainer_log = log / "trainer.log"
    deadline = time.monotonic() + 60
    while not trainer_log.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert trainer_log.exists(), job.communicate(timeout=30)[0]
    job.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@...` does near the time limit
    output = job.communicate(timeout=60)[0]
    assert job.returncode == rc, output
    assert trainer_log.read_text().splitlines() == [
        f"RAY_ADDRESS=10.0.0.11:6379 auth=token 64 model.path={model} trainer.ray_address=auto "
        "trainer.output_dir=/shared/runs/fake"] + ["SIGUSR1: checkpoint saved"] * (trainer == "checkpoints")
    sruns = (log / "srun.log").read_text().splitlines()
    assert sruns[0].split()[4] == "gpu-a01" and "--head" in sruns[0].split()  # the head first, then the workers
    assert sorted(line.split()[4] for line in sruns[1:]) == NODES[1:]
    assert (log / "scontrol.log").read_text().splitlines() == ["scontrol show hostnames gpu-a[01-04]",
                                                               "scontrol requeue 4242"]
    assert set((log / "srun_auth.log").read_text().splitlines()) == {"token 64"}  # one token for every step
    assert f"requeueing job 4242: {why}" in output


def test_sbatch_refuses_before_any_srun(tmp_path, model):
    env, log = fake_slurm(tmp_path)
    job = subprocess.run(["bash", str(SBATCH), "fake_recipe.py", f"model.path={model}", "rollout.num_engines=32"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert job.returncode == 1
    assert "= 48 > 32 GPUs (4 nodes × 8)" in job.stderr
    assert not (log / "srun.log").exists()


# ---------------------------------------------------------------- orz.sbatch on a real 2-node Ray cluster

LOOPBACK_RECIPE = '''
import sys
from orz.config import load_config
from orz.train import main
RECIPE = load_config(None, {overrides!r})
if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=RECIPE))
'''


def loopback_slurm(tmp_path):
    """bin/ for a 2-node job whose nodes are both this machine: srun runs its command here, and the
    launcher lets output_dir be under /tmp (both "nodes" see it)."""
    scripts = {
        "srun": 'while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\nexec "$@"',
        "scontrol": 'echo "scontrol $*" >> "$ORZ_TEST_LOG/scontrol.log"\n[[ $1 == show ]] && printf "n1\\nn2\\n"',
        "python": ('if [[ "$1 $2 $3" == "-m orz.launch_slurm script" ]]; then shift 2; exec ' + sys.executable
                   + ' -c "import sys, orz.launch_slurm as l; l.NODE_LOCAL_DIRS = (); sys.exit(l.main(sys.argv[1:]))" '
                   '"$@"; fi\nexec ' + sys.executable + ' "$@"'),
        "ray": f'exec {Path(sys.executable).with_name("ray")} "$@"',
    }
    slurm_env = {"SLURM_JOB_ID": "4243", "SLURM_JOB_NODELIST": "n[1-2]", "SLURMD_NODENAME": "n1",
                 "SLURM_GPUS_ON_NODE": "0", "SLURM_CPUS_ON_NODE": "1"}
    return _slurm_job(tmp_path, scripts, slurm_env)


@pytest.mark.slow
def test_sbatch_runs_the_tiny_recipe_on_a_two_node_ray_cluster(tmp_path, tiny_run):
    """orz.sbatch, unfaked but for srun/scontrol: `ray start --head` and a worker `ray start` (two
    Ray nodes on this machine, one CPU each), the wait for both nodes, then two GRPO iterations of
    the whole stack. The actor worker and the vLLM engine take one CPU each, so they can only run
    on different nodes; when the job ends, no Ray process of it is left."""
    env, log = loopback_slurm(tmp_path)
    # Ray's files (sockets: a short path) away from /tmp/ray, where `ray start` would leave its
    # address for every later ray.init() on this machine.
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="orz-ray-")
    with socket.socket() as s:  # a port for `ray start` (race-free enough for one test)
        s.bind(("", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    overrides = [*tiny_run(out, iterations=2), "actor.cpus_per_worker=1", "rollout.cpus_per_engine=1"]
    (tmp_path / "tiny_recipe.py").write_text(LOOPBACK_RECIPE.format(overrides=overrides))
    job = subprocess.run(["bash", str(SBATCH), "--port", str(port), "--join-timeout", "120", "tiny_recipe.py"],
                         cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=900)
    assert job.returncode == 0, job.stdout[-5000:]
    assert "orz: Ray cluster ready" in job.stdout and "2 nodes" in job.stdout
    assert "orz: training finished" in job.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert [row["rollout/weight_version"] for row in rows[1:]] == [1, 2]
    assert (out / "checkpoints/latest").read_text() == "iter_000002"
    assert (log / "scontrol.log").read_text().splitlines() == ["scontrol show hostnames n[1-2]"]  # no requeue
    time.sleep(2)  # `ray start --block` stops its processes on SIGTERM
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if f":{port}" in " ".join(p.info["cmdline"] or [])
            or f"--port={port}" in " ".join(p.info["cmdline"] or [])]
    assert left == []
    shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def test_the_slurm_check_counts_the_roles_the_trainer_starts(in_repo):
    """The check asks for GPUs for exactly placement.roles: no critic for GRPO, a reference with KL,
    the reward model when one is set."""
    from orz.config import RewardModelConfig

    cfg = load_recipe(RECIPE)
    with_rm = replace(cfg, reward=replace(cfg.reward, model=RewardModelConfig(path="/models/rm", tp=2, dp=2)))
    grpo_kl = replace(cfg, algorithm=replace(cfg.algorithm, kl_coef=0.01, advantage="grpo"))
    assert list(launch_slurm.gpu_demand(cfg)) == ["actor", "critic", "rollout"]
    assert list(launch_slurm.gpu_demand(grpo_kl)) == ["actor", "ref", "rollout"]
    assert launch_slurm.gpu_demand(with_rm)["reward_model"] == 4
